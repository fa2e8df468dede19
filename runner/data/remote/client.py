"""The object-store client: one ``ObjectStore`` per URL, through obstore.

**Why obstore.** Measured on this project's delay line (runner/data/remote/delayline.py, a
10 ms round trip in front of moto's S3 server on loopback, a 2-core machine, 2026-11-26):
200 GETs of 50 KB objects, 32 at a time, took 0.53 s wall and 0.26 s of CPU with obstore
(its asyncio API), 0.94 s and 0.51 s with boto3 in 32 threads, 1.96 s and 1.05 s with
s3fs; 16 ranges of 1 MiB of one object took 0.06 s with obstore's ``get_ranges``, 0.24 s
with boto3 and 0.15 s with s3fs. On a machine whose cores decode, the CPU per request is
what counts: obstore's requests run in Rust, off the GIL, and its asyncio API keeps
hundreds in flight from one thread. It reads s3://, gs:// and http(s):// alike.

**Credentials and endpoints, the usual way.** S3: the AWS environment variables
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION`` /
``AWS_DEFAULT_REGION``); without keys in the environment, boto3's own chain when boto3 is
installed (``AWS_PROFILE``, ``~/.aws/credentials`` and ``~/.aws/config``, SSO, instance
roles). An S3-compatible server (MinIO, Ceph, R2, moto): ``dataset.endpoint_url``, else
``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``; a plain-http endpoint is allowed (a server
on the node or the rack). GCS: ``GOOGLE_APPLICATION_CREDENTIALS`` or the default service
account. Every store of a run (the training set, ``dataset.val_path``, a manifest, the
shards) is opened here, so the endpoint holds on every code path.

**Bad input fails before any work**, in one line naming the URL and what to set
(``RemoteError``, a ConfigError: exit 2): an endpoint that does not answer, credentials the
server refuses, a bucket or prefix that does not exist, a 403. The line never holds a
credential: it is written here from the error's kind and HTTP status, not copied from the
client's message.

Retries are the read engine's (engine.py: it counts them and backs off with jitter), so
the client itself makes one attempt per call.
"""

from __future__ import annotations

import datetime
import os
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from runner.data.remote.url import RemoteURL
from runner.errors import ConfigError

T = TypeVar("T")

CONNECT_TIMEOUT = "5s"
REQUEST_TIMEOUT = "60s"


class RemoteError(ConfigError):
    """A URL that cannot be read as given; the message names it and what to set."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str


def endpoint_for(url: RemoteURL, endpoint_url: str | None) -> str | None:
    """The endpoint an s3:// URL is read from: ``dataset.endpoint_url``, else the AWS
    variables for it, else None (AWS itself)."""
    if url.scheme != "s3":
        return None
    return endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") \
        or os.environ.get("AWS_ENDPOINT_URL") or None


def _s3_store(url: RemoteURL, endpoint: str | None) -> Any:
    from obstore.store import S3Store

    config: dict[str, Any] = {}
    provider = None
    if endpoint:
        config["endpoint"] = endpoint
        config["virtual_hosted_style_request"] = False  # path style: what servers take
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if not os.environ.get("AWS_ACCESS_KEY_ID"):
        try:  # profiles, ~/.aws files, SSO, instance roles: boto3's chain
            import boto3
            from obstore.auth.boto3 import Boto3CredentialProvider

            session = boto3.Session()
            if session.get_credentials() is not None:
                provider = Boto3CredentialProvider(session)
                region = region or session.region_name
            else:
                config["skip_signature"] = True  # a public bucket
        except ImportError:
            pass
    config.update(region=region or "us-east-1")  # (a keyword: "region" names a decoder too)
    options = {"allow_http": bool(endpoint and endpoint.startswith("http://")),
               "connect_timeout": CONNECT_TIMEOUT, "timeout": REQUEST_TIMEOUT}
    return S3Store(url.bucket, config=config, client_options=options,
                   retry_config=_no_retries(), credential_provider=provider)


def _no_retries() -> dict[str, Any]:
    return {"max_retries": 0, "retry_timeout": datetime.timedelta(seconds=1),
            "backoff": {"init_backoff": datetime.timedelta(milliseconds=50),
                        "max_backoff": datetime.timedelta(seconds=1), "base": 2}}


LOCAL_SCHEME = "file"  # the machine's own files, by absolute path (never a dataset URL)


def open_store(url: RemoteURL, endpoint_url: str | None = None) -> Any:
    """The obstore store of ``url``'s bucket (or server)."""
    try:
        import obstore  # noqa: F401
    except ImportError:
        raise RemoteError(f"{url}: reading URLs needs obstore: pip install -e '.[remote]'"
                          ) from None
    options = {"connect_timeout": CONNECT_TIMEOUT, "timeout": REQUEST_TIMEOUT}
    if url.scheme == LOCAL_SCHEME:  # a far disk's files (fardisk.py): keys are paths
        from obstore.store import LocalStore

        return LocalStore(prefix="/")
    if url.scheme == "s3":
        return _s3_store(url, endpoint_for(url, endpoint_url))
    if url.scheme == "gs":
        from obstore.store import GCSStore

        return GCSStore(url.bucket, client_options=options, retry_config=_no_retries())
    from obstore.store import HTTPStore

    options["allow_http"] = url.scheme == "http"
    return HTTPStore.from_url(url.store_url, client_options=options,
                              retry_config=_no_retries())


class ObjectStore:
    """One store (a bucket or an HTTP server) and the calls the runner makes on it.

    Args:
        url: any URL of the store (its bucket is what counts).
        endpoint_url: ``dataset.endpoint_url`` (S3-compatible servers).
    """

    def __init__(self, url: RemoteURL, endpoint_url: str | None = None):
        self.url = url
        self.endpoint_url = endpoint_url
        self._opened = (os.getpid(), open_store(url, endpoint_url))

    @property
    def store(self) -> Any:
        """The obstore store, this process's own: its runtime's threads do not survive a
        fork (a DataLoader worker), so a forked process opens the store again."""
        if self._opened[0] != os.getpid():
            self._opened = (os.getpid(), open_store(self.url, self.endpoint_url))
        return self._opened[1]

    def __getstate__(self) -> dict:  # a worker process opens its own client
        return {"url": self.url, "endpoint_url": self.endpoint_url}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["url"], state["endpoint_url"])

    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object under ``prefix`` (a folder: ``prefix/``), sorted by key."""
        import obstore

        prefix = prefix.rstrip("/") + "/" if prefix else ""

        def listing() -> list[ObjectInfo]:
            found = []
            for page in obstore.list(self.store, prefix or None):
                found += [ObjectInfo(o["path"], int(o["size"]), str(o.get("e_tag") or ""))
                          for o in page]
            return found

        return sorted(retried(listing), key=lambda o: o.key)

    def head(self, key: str) -> ObjectInfo:
        import obstore

        meta = retried(lambda: obstore.head(self.store, key))
        return ObjectInfo(meta["path"], int(meta["size"]), str(meta.get("e_tag") or ""))

    def get(self, key: str) -> bytes:
        import obstore

        return retried(lambda: obstore.get(self.store, key).bytes().to_bytes())

    async def get_async(self, key: str) -> memoryview:
        """The whole object ``key`` (its body awaited too: a blocking ``bytes()`` would hold
        the loop, and every other fetch, while a slow body or a local file is read)."""
        import obstore

        result = await obstore.get_async(self.store, key)
        return memoryview(await result.bytes_async())

    async def get_range_async(self, key: str, start: int, end: int) -> memoryview:
        import obstore

        return memoryview(await obstore.get_range_async(self.store, key, start=start, end=end))

    def put(self, key: str, data: bytes | memoryview) -> None:
        import obstore

        obstore.put(self.store, key, data)

    def put_file(self, key: str, path: str) -> None:
        """A local file uploaded as ``key`` (in parts when large)."""
        import obstore

        with open(path, "rb") as f:
            obstore.put(self.store, key, f, chunk_size=8 << 20)


# --- errors -------------------------------------------------------------------------------

STATUS = re.compile(r"status code: (\d{3})")


def status_of(error: BaseException) -> int | None:
    """The HTTP status an error carries (its kind, else its message's status code)."""
    from obstore.exceptions import (
        NotFoundError,
        PermissionDeniedError,
        UnauthenticatedError,
    )

    if isinstance(error, (NotFoundError, FileNotFoundError)):
        return 404
    if isinstance(error, PermissionDeniedError):
        return 403
    if isinstance(error, UnauthenticatedError):
        return 401
    found = STATUS.search(str(error))
    return int(found.group(1)) if found else None


def retried(call: Callable[[], T], attempts: int = 6, backoff: float = 0.1) -> T:
    """``call()``, tried again after a transient error (``transient``) with full-jitter
    back-off, as the read engine retries its fetches: the listing and the metadata a run
    reads before its first batch would otherwise fail it on one reset connection. (Bad
    input fails before any work in ``check_url``, which does not retry.)"""
    for attempt in range(attempts):
        try:
            return call()
        except Exception as e:
            if not transient(e) or attempt == attempts - 1:
                raise
            time.sleep(backoff_seconds(attempt, backoff, cap=2.0))
    raise AssertionError("unreachable")


def backoff_seconds(attempt: int, base: float, cap: float,
                    rng: random.Random | None = None) -> float:
    """The wait before retry ``attempt + 1``: full jitter, a random wait in
    ``[0, min(cap, base * 2**attempt)]`` (botocore's "standard" mode, a shorter base)."""
    return (rng or random).uniform(0, min(cap, base * 2 ** attempt))


def transient(error: BaseException) -> bool:
    """Whether retrying may help: a reset, a timeout, a 5xx (SlowDown is a 503), a 429 or
    408; not a 4xx that says the request itself is wrong (missing, denied)."""
    status = status_of(error)
    if status is None:
        return True  # connection reset, refused, timed out, body cut short
    return status >= 500 or status in (408, 429)


def explain(error: BaseException, url: str, endpoint: str | None) -> RemoteError:
    """One line naming ``url`` and what to set, from the kind of ``error`` (its message is
    not copied: it could hold a signed request)."""
    status = status_of(error)
    text = str(error)
    where = f" at {endpoint}" if endpoint else ""
    if status == 404 or "NoSuchBucket" in text:
        what = "the bucket does not exist" if "NoSuchBucket" in text else "nothing is there"
        return RemoteError(f"{url}: {what}{where}; check the bucket and prefix of "
                           "dataset.path (or dataset.val_path, dataset.manifest)")
    if status in (401, 403) or "AccessDenied" in text or "SignatureDoesNotMatch" in text \
            or "InvalidAccessKeyId" in text:
        return RemoteError(f"{url}: access denied (HTTP {status or 403}){where}; set "
                           "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) to "
                           "credentials that may read it")
    if status is None:
        return RemoteError(f"{url}: cannot reach the server{where or ''}; check the network, "
                           "or set dataset.endpoint_url (or AWS_ENDPOINT_URL) to an "
                           "S3-compatible server's address")
    return RemoteError(f"{url}: the server answered HTTP {status}{where}; check the URL and "
                       "dataset.endpoint_url (or AWS_ENDPOINT_URL)")


def check_url(text: str, endpoint_url: str | None = None, is_file: bool = False
              ) -> ObjectStore:
    """The store of the URL ``text``, once one request proved it readable (``is_file``:
    the object exists; else: something is under the prefix); a RemoteError naming the URL
    and what to set when not. One attempt, a few seconds at most: this runs before any work."""
    import obstore

    url = RemoteURL.parse(text)
    if url.scheme in ("s3", "gs") and not url.bucket:
        raise RemoteError(f"{text}: no bucket; write {url.scheme}://<bucket>/<prefix>")
    try:
        store = ObjectStore(url, endpoint_url)
        if is_file or url.scheme in ("http", "https"):
            obstore.head(store.store, url.prefix)  # one attempt: not ObjectStore.head's
            return store
        prefix = url.prefix + "/" if url.prefix else None
        page = next(iter(obstore.list(store.store, prefix, chunk_size=1)), [])
    except RemoteError:
        raise
    except Exception as e:  # obstore's errors, a refused connection, a bad endpoint
        raise explain(e, text, endpoint_for(url, endpoint_url)) from None
    if not page:
        raise RemoteError(f"{text}: nothing is under this prefix"
                          f"{' at ' + endpoint_for(url, endpoint_url) if endpoint_for(url, endpoint_url) else ''}; "
                          "check the bucket and prefix of dataset.path (or dataset.val_path, "
                          "dataset.manifest)")
    return store


def check_bucket_writable(text: str, endpoint_url: str | None = None) -> ObjectStore:
    """The store of the URL ``text`` once its bucket answered a listing (shards are written
    there); a RemoteError naming the URL and what to set when not."""
    import obstore

    url = RemoteURL.parse(text)
    try:
        store = ObjectStore(url, endpoint_url)
        next(iter(obstore.list(store.store, (url.prefix + "/") if url.prefix else None,
                               chunk_size=1)), [])
    except Exception as e:
        raise explain(e, text, endpoint_for(url, endpoint_url)) from None
    return store
