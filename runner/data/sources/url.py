"""Which dataset paths are URLs, and how a URL splits into a store and a key prefix.

The spelling is fsspec's: ``s3://bucket/prefix``, ``gs://bucket/prefix``,
``http(s)://host/path``. A URL names a store (the bucket, or the server) and a key prefix
under it; keys are ``/``-separated, never starting with ``/``. Anything else is a local
path (``~`` expanded by the caller, as before).
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMES = ("s3", "gs", "http", "https")


def is_url(path: object) -> bool:
    """Whether ``path`` (a config value: a str, a Path or None) is a URL a store reads."""
    return isinstance(path, str) and path.split("://", 1)[0].lower() in SCHEMES \
        and "://" in path


@dataclass(frozen=True)
class RemoteURL:
    """A parsed URL: ``scheme://bucket/prefix`` (http: ``scheme://host[:port]/prefix``).

    Attributes:
        scheme: s3, gs, http or https.
        bucket: the bucket (s3, gs) or the ``host[:port]`` (http, https).
        prefix: the key prefix, without leading or trailing ``/`` ("" for the root).
    """

    scheme: str
    bucket: str
    prefix: str

    @classmethod
    def parse(cls, text: str) -> RemoteURL:
        scheme, rest = text.split("://", 1)
        bucket, _, prefix = rest.partition("/")
        return cls(scheme.lower(), bucket, prefix.strip("/"))

    @property
    def store_url(self) -> str:
        """The store's own URL (the bucket, or the server's root)."""
        return f"{self.scheme}://{self.bucket}"

    def key(self, name: str = "") -> str:
        """The key of ``name`` under this prefix."""
        return "/".join(p for p in (self.prefix, name.strip("/")) if p)

    def child(self, name: str) -> RemoteURL:
        return RemoteURL(self.scheme, self.bucket, self.key(name))

    def url_of(self, key: str) -> str:
        """The URL of a key of this store."""
        return f"{self.store_url}/{key}"

    def __str__(self) -> str:
        return self.url_of(self.prefix) if self.prefix else self.store_url
