"""The object-store client: one ``ObjectStore`` per URL, through obstore.

**Why obstore.** Measured on this project's delay line (runner/bench/servers/delayline.py, a
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

Retries are the read engine's (readengine.py: it counts them and backs off with jitter), so
the client itself makes one attempt per call.

**A range answered with status 200.** HTTP lets a server answer a range request with
``200 OK``: with the whole object (it ignores ranges), or, as rclone's ``serve s3`` 1.75
does, with just the bytes asked and their ``Content-Range``. obstore refuses both
(``NotPartial``, ``RangeNotSupported``). The first such answer is said once (a warning naming the server and what
it did) and this store's ranges are read from then on by a client that takes a 200
(botocore for s3://, signed as boto3 signs; the standard library for http(s)://), its body
kept when its ``Content-Range`` is what was asked and sliced when it is the whole object;
any other answer stops the run in one line (``RangeAnswerError``: not retried).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

from runner.common.errors import ConfigError
from runner.config.credentials import redacted
from runner.data.sources.url import RemoteURL

T = TypeVar("T")

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = "5s"
REQUEST_TIMEOUT = "60s"


class RemoteError(ConfigError):
    """A URL that cannot be read as given; the message names it and what to set."""


class RangeAnswerError(RemoteError):
    """A server's answer to a range request that holds neither the bytes asked nor the
    whole object: the message says what was asked and what came."""


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
        self.ranges_200 = False  # the server answered a range with 200: read them elsewhere
        self._plain: tuple[int, Any] | None = None  # (pid, botocore client)
        self._plain_lock = threading.Lock()

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
        """Bytes ``[start, end)`` of ``key``; from a server that answers ranges with status
        200, through ``range_anyway`` (the module's docstring)."""
        import obstore

        if not self.ranges_200:
            try:
                return memoryview(await obstore.get_range_async(self.store, key, start=start,
                                                                end=end))
            except Exception as e:
                if not not_partial(e):
                    raise
                if not self.ranges_200:
                    self.ranges_200 = True
                    log.warning("%s answers a range request with HTTP 200, not 206 Partial "
                                "Content; its ranges are read with %s from now on (a body "
                                "whose Content-Range is what was asked is kept, a whole "
                                "object sliced)", self.where(), self._plain_client_name())
        return memoryview(await asyncio.to_thread(self.range_anyway, key, start, end))

    def where(self) -> str:
        """The server, as a message names it (never a credential)."""
        endpoint = endpoint_for(self.url, self.endpoint_url)
        return f"the server at {redacted(endpoint, '')}" if endpoint else \
            f"the server of {redacted(str(self.url), '')}"

    def _plain_client_name(self) -> str:
        return "botocore" if self.url.scheme == "s3" else "a plain GET"

    def range_anyway(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``key`` by a client that takes a 200: the body when its
        Content-Range is the range asked, sliced when it is the whole object, else a
        ``RangeAnswerError`` naming what came."""
        if self.url.scheme == "s3":
            status, content_range, body = self._s3_range(key, start, end)
        elif self.url.scheme in ("http", "https"):
            status, content_range, body = self._http_range(key, start, end)
        else:
            return self.get(key)[start:end]
        return range_body(status, content_range, body, start, end,
                          redacted(f"{self.url.store_url}/{key}", ""), self.where())

    def _s3_client(self) -> Any:
        """botocore's S3 client of this store (its endpoint, region and credentials, as
        ``_s3_store`` finds them), one per process."""
        with self._plain_lock:
            if self._plain is None or self._plain[0] != os.getpid():
                try:
                    import boto3
                    from botocore import UNSIGNED
                    from botocore.config import Config as BotoConfig
                except ImportError:
                    raise RemoteError(
                        f"{self.url}: {self.where()} answers range requests with HTTP 200, "
                        "which obstore refuses; pip install boto3 to read it") from None
                session = boto3.Session()
                endpoint = endpoint_for(self.url, self.endpoint_url)
                region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") \
                    or session.region_name or "us-east-1"
                unsigned = session.get_credentials() is None
                config = BotoConfig(
                    signature_version=UNSIGNED if unsigned else None,
                    s3={"addressing_style": "path"} if endpoint else None,
                    connect_timeout=5, read_timeout=60, retries={"max_attempts": 1},
                    max_pool_connections=64)
                self._plain = (os.getpid(), session.client("s3", endpoint_url=endpoint,
                                                           region_name=region, config=config))
            return self._plain[1]

    def _s3_range(self, key: str, start: int, end: int) -> tuple[int, str | None, bytes]:
        answer = self._s3_client().get_object(Bucket=self.url.bucket, Key=key,
                                              Range=f"bytes={start}-{end - 1}")
        return (int(answer["ResponseMetadata"]["HTTPStatusCode"]), answer.get("ContentRange"),
                answer["Body"].read())

    def _http_range(self, key: str, start: int, end: int) -> tuple[int, str | None, bytes]:
        import urllib.request

        request = urllib.request.Request(f"{self.url.store_url.rstrip('/')}/{key}",
                                         headers={"Range": f"bytes={start}-{end - 1}"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.headers.get("Content-Range"), answer.read()

    def put(self, key: str, data: bytes | memoryview) -> None:
        import obstore

        obstore.put(self.store, key, data)

    def put_file(self, key: str, path: str) -> None:
        """A local file uploaded as ``key`` (in parts when large)."""
        import obstore

        with open(path, "rb") as f:
            obstore.put(self.store, key, f, chunk_size=8 << 20)


# --- ranges answered with status 200 --------------------------------------------------------

CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


def not_partial(error: BaseException) -> bool:
    """Whether obstore refused a range's answer for not being 206 Partial Content (its
    HTTP store says ``RangeNotSupported`` where its S3 store says ``NotPartial``)."""
    text = str(error)
    return any(what in text for what in ("NotPartial", "non-partial response",
                                         "RangeNotSupported"))


def range_body(status: int, content_range: str | None, body: bytes, start: int, end: int,
               url: str, where: str) -> bytes:
    """The bytes ``[start, end)`` in an answer to a range request: the body when its
    Content-Range is the range asked (whatever the status), the slice of a whole object
    (a 200 with no Content-Range), else a ``RangeAnswerError`` saying what came."""
    found = CONTENT_RANGE.fullmatch((content_range or "").strip())
    if found and (int(found.group(1)), int(found.group(2))) == (start, end - 1) \
            and len(body) == end - start:
        return body
    if content_range is None and status == 200 and len(body) >= end:
        return body[start:end]  # the server ignored the range: the whole object came
    raise RangeAnswerError(
        f"{url}: asked for bytes {start}-{end - 1}, {where} answered HTTP {status} with "
        f"{len(body)} bytes and Content-Range {content_range or 'none'}: neither those bytes "
        "nor the whole object; use a server that answers range requests with 206 Partial "
        "Content")


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
    if isinstance(error, RemoteError) or not_partial(error):
        return False  # the same request would get the same answer
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
    if url.lower().startswith(("http://", "https://")):
        return explain_http(status, text, url)
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


def explain_http(status: int | None, text: str, url: str) -> RemoteError:
    """An http(s) URL's failure in one line: no bucket, no prefix, no credentials to set;
    a server that cannot be reached told from one that answered."""
    host = urlsplit(url).netloc or url
    if status is None:
        why = ("its name does not resolve" if "dns error" in text.lower()
               or "resolve" in text.lower() else "the connection timed out"
               if "timed out" in text.lower() else "the connection failed")
        return RemoteError(f"{url}: cannot reach {host} ({why}); check the URL's host and "
                           "port, and that this machine reaches it (curl -I URL)")
    if status == 404:
        return RemoteError(f"{url}: {host} answered 404 Not Found: nothing is at that URL, "
                           "or a proxy or firewall between this machine and the host "
                           f"answered for it; check the URL, and that this machine reaches "
                           f"{host} (curl -I URL)")
    if status in (401, 403):
        return RemoteError(f"{url}: {host} refused access (HTTP {status}); the runner's "
                           "http(s) client sends no credentials: serve the files without a "
                           "login, or from a bucket (s3://) with AWS_ACCESS_KEY_ID and "
                           "AWS_SECRET_ACCESS_KEY set")
    return RemoteError(f"{url}: {host} answered HTTP {status}; check the URL")


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
