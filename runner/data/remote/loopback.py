"""An S3-compatible server on loopback, for the tests and ``python -m runner.bench remote``.

``LoopbackS3()`` starts moto's server (``pip install -e ".[dev]"``) in its own process on a
free port of 127.0.0.1 (its own process: its request handling does not take this process's
GIL from the decode threads), waits until it answers, and gives the credentials and
endpoint a client needs (``env()``: the AWS variables the runner reads, as a user sets
them). ``upload(folder, bucket, prefix)`` copies an image folder into a bucket, one object
per file; ``DelayLine`` (delayline.py) goes in front of it for a far link.

moto keeps objects in memory and accepts any credentials unless told otherwise; it answers
range requests (rclone's ``serve s3``, the other pip-installable server, answered a range
request with the whole object when tried, so it is not used here).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

ACCESS_KEY, SECRET_KEY, REGION = "loopback-key", "loopback-secret", "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackS3:
    """moto's S3 server in a child process on 127.0.0.1."""

    def __init__(self, timeout: float = 60.0):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("moto's server exited at start (pip install -e '.[dev]')")
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.1)
        self.close()
        raise RuntimeError(f"moto's server did not answer on port {self.port}")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The environment a client reads: credentials, region and endpoint."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_DEFAULT_REGION": REGION, "AWS_ENDPOINT_URL": endpoint or self.endpoint}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name=REGION)

    def make_bucket(self, bucket: str) -> None:
        self.client().create_bucket(Bucket=bucket)

    def upload(self, folder: Path, bucket: str, prefix: str = "") -> int:
        """Every file under ``folder`` as ``<prefix>/<relative path>``; returns the count."""
        client, n = self.client(), 0
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file():
                key = "/".join(filter(None, [prefix.strip("/"),
                                             path.relative_to(folder).as_posix()]))
                client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
                n += 1
        return n

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def __enter__(self) -> LoopbackS3:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def aws_env_keys() -> list[str]:
    """The AWS variables a test or the bench sets (and restores)."""
    return ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
            "AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN", "AWS_PROFILE"]
