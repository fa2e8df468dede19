"""No credentials inside a URL: a URL with userinfo (``http://user:SECRET@host``,
``s3://KEY:SECRET@bucket/train``, ``https://TOKEN@host``) is refused before anything is
written or printed, in one line that names the key and the variables to use instead, with
the userinfo shown as ``***``.

Why refuse rather than redact: a run writes its config in many places (Hydra's
``.hydra/*.yaml``, metrics.json, checkpoint.pt, the inference state, wandb's files,
runner.log, the console's lines), and the runner's own client never used URL userinfo to
sign in: obstore's S3 store signs with the AWS variables, its HTTP store sends no
credentials at all (checked against a server that records the ``Authorization`` header). So
a URL's userinfo could only leak, never work. The ways that do work:

- S3 (``s3://`` and an S3-compatible ``dataset.endpoint_url``): ``AWS_ACCESS_KEY_ID`` and
  ``AWS_SECRET_ACCESS_KEY`` (``AWS_SESSION_TOKEN``), or ``AWS_PROFILE`` and ``~/.aws``;
- GCS (``gs://``): ``GOOGLE_APPLICATION_CREDENTIALS``;
- http(s): the client sends no credentials: a server the nodes may read without a login,
  or the files in a bucket read with the AWS variables.

What the runner reads from the data itself is not config: a manifest's row may hold a URL
with credentials (``http://bob:pw@host/b.jpg``). So every path the runner prints or stores
passes through the same ``redacted``: a manifest's paths as they are read
(runner/data/sources/listing.py), every log record on the console and in runner.log
(``SecretFilter``, conf/hydra/job_logging/runner.yaml), every string of metrics.json
(``scrubbed_strings``, runner/launch/outcome.py's ``save_metrics``: ``skipped_files``
among them) and the wandb run's config and summary (runner/job/logger.py's ``scrubbed``).

Three places check, so that no path writes or prints first: ``python -m runner``'s command
line before anything else (``refuse_credentials``, runner/job/commandline.py); the overrides
runner/job/compose.py composes (``compose``: ``runner.pipeline(...)``, ``runner.export``,
``runner.prepare``; ``job_refusal``: the benches), before Hydra's messages could repeat
one; and every string of the composed config, an interpolation's
value included, with the S3 endpoint the environment gives (``check_config_urls``, from
runner/config/rules.py's ``check_config``: the job and every tool that composes a config).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from runner.common.errors import EXIT_USER_ERROR, ConfigError
from runner.config.schema import keys_where

# scheme://userinfo@ : the userinfo is everything between // and the first @ before any
# /, ?, # (a '@' further on belongs to the path: s3://bucket/a@2x.jpg is no credential);
# or user:password@ whose password holds a '/' (half of AWS's secret keys do), told from
# host:port/path@ by what follows the colon not being a port
_USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)"
                       r"(?:[^/?#@\s\"\[\]{}]*"
                       r"|[^/?#@\s:\"\[\]{}]*:(?!\d+(?:[/?#]|$))[^@\s\"\[\]{}]*)@")

# the environment variables that give an S3 endpoint (runner/data/sources/objectstore.py)
ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


def has_userinfo(text: str) -> bool:
    """Whether ``text`` holds a URL with credentials (user, or user:password, before @)."""
    return bool(_USERINFO.search(text))


def redacted(text: str, mask: str = "***@") -> str:
    """``text`` with every URL's userinfo replaced by ``mask`` ("": left out)."""
    return _USERINFO.sub(lambda m: m.group(1) + mask, text)


def scrubbed_strings(value: Any) -> Any:
    """``value`` (mappings, lists and strings of a record such as metrics.json) with every
    string's URL userinfo shown as ``***``."""
    if isinstance(value, str):
        return redacted(value) if "@" in value else value
    if isinstance(value, dict):
        return {k: scrubbed_strings(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(scrubbed_strings(v) for v in value)
    return value


class SecretFilter(logging.Filter):
    """A logging filter that redacts URL userinfo from a record's message and traceback
    (on every handler of the job's logging: the console and runner.log)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record whose arguments do not format: left to the formatter
            return True
        if "@" in message and has_userinfo(message):
            record.msg, record.args = redacted(message), ()
        if record.exc_info and not record.exc_text:
            text = logging.Formatter().formatException(record.exc_info)
            if has_userinfo(text):
                record.exc_text = redacted(text)
        return True


# the keys whose values a store reads as URLs (runner/data/sources/): declared on each field
# (``key(..., url=True)``, runner/config/schema.py)
URL_KEYS = keys_where("url")


def _instead(key: str, text: str) -> str:
    """What to use in place of URL credentials, for ``key``'s URL."""
    aws = "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) instead"
    found = _USERINFO.search(text)
    scheme = found.group(1)[:-3].lower() if found else ""
    if key not in URL_KEYS and key not in ENDPOINT_VARIABLES:
        return "no key of the runner's config takes credentials"
    if key.endswith("endpoint_url") or key in ENDPOINT_VARIABLES or scheme == "s3":
        return aws
    if scheme == "gs":
        return "set GOOGLE_APPLICATION_CREDENTIALS instead"
    return ("the runner's http(s) client sends none: serve the files without a login, or "
            "from a bucket (s3://) with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY set")


def message(key: str, value: str) -> str:
    """The one line refusing ``key=value`` (the value's userinfo shown as ``***``)."""
    return (f"{key}={redacted(value)} holds credentials in a URL (user:password@), which "
            "the runner would write into its config, metrics.json, checkpoints and logs: "
            f"give the URL without them; {_instead(key, value)}")


def argv_refusal(argv: Iterable[str]) -> str | None:
    """The refusal of a command line (or a list of overrides) holding a URL with
    credentials, in one line, or None. Run before anything parses the values: Hydra's own
    messages repeat an override whole."""
    for arg in argv:
        if has_userinfo(arg):
            key, eq, value = arg.partition("=")
            key = key.lstrip("+~") if eq else "the command line"
            return message(key, value if eq else arg)
    return None


def check_overrides(overrides: Iterable[str]) -> None:
    """A ConfigError with ``argv_refusal``'s line, if any (runner/job/compose.py's ``compose``:
    ``runner.pipeline(...)``, ``runner.export``, ``runner.prepare``)."""
    why = argv_refusal(overrides)
    if why:
        raise ConfigError(why)


def refuse_credentials(argv: Iterable[str]) -> None:
    """``python -m runner``: exit with ``argv_refusal``'s line (status 2), if any."""
    why = argv_refusal(argv)
    if why:
        print(f"error: {why}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


def _strings(value: Any, key: str) -> Iterator[tuple[str, str]]:
    """Every string under ``value`` (a config's dataclasses, mappings and lists), with
    its dotted key."""
    if isinstance(value, str):
        yield key, value
    elif hasattr(value, "__dataclass_fields__"):
        for name in value.__dataclass_fields__:
            yield from _strings(getattr(value, name), f"{key}.{name}" if key else name)
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from _strings(item, f"{key}.{name}" if key else str(name))
    elif isinstance(value, list | tuple):
        for k, item in enumerate(value):
            yield from _strings(item, f"{key}[{k}]")


def check_config_urls(config: Any) -> None:
    """A ConfigError (one line, the secret left out) for a composed config holding a URL
    with credentials in any value (``dataset.path``, ``dataset.val_path``,
    ``dataset.manifest``, ``dataset.endpoint_url``, ``models=[...]``, ``model.kwargs``,
    ...), or an S3 endpoint variable holding one while a dataset key is an s3:// URL."""
    for key, value in _strings(config, ""):
        if has_userinfo(value):
            raise ConfigError(message(key, value))
    dataset = getattr(config, "dataset", None)
    reads_s3 = dataset is not None and any(
        isinstance(v, str) and v.lower().startswith("s3://")
        for v in (dataset.path, dataset.val_path, dataset.manifest))
    if reads_s3 and not dataset.endpoint_url:
        for variable in ENDPOINT_VARIABLES:
            if has_userinfo(os.environ.get(variable) or ""):
                raise ConfigError(message(variable, os.environ[variable]))
