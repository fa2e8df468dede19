"""Whole-file writes: a crash or a kill never leaves half a file under the final name.

Every file the runner publishes is written under a temporary name beside it and renamed
into place (``replacing``): a reader sees the old file or the new one, never half of one.

Every JSON file the runner writes goes through ``dumps``: a non-finite number (NaN, an
infinity: a diverged loss, a figure of nothing) is written as ``null``, since JSON has no
such numbers and strict readers (jq, JavaScript, ``json.loads`` with ``parse_constant``)
refuse Python's bare ``NaN``; ``allow_nan=False`` makes any that slipped past fail loudly.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def finite(value: Any) -> Any:
    """``value`` with every non-finite float in it (in dicts, lists and tuples, at any
    depth; numpy's floats too) replaced by None."""
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(payload: Any, **kwargs: Any) -> str:
    """``payload`` as JSON, non-finite numbers as null (``finite``); what JSON cannot hold
    otherwise is written as its ``str``."""
    return json.dumps(finite(payload), allow_nan=False, default=str, **kwargs)


def temporary(path: Path, keep_suffix: bool = False) -> Path:
    """Where ``path`` is written before it is renamed into place: beside it, hidden, and this
    process's (``.name.tmp<pid>``; ``keep_suffix``: ``.stem.tmp<pid>.suffix``, for a writer
    that insists on its suffix)."""
    path = Path(path)
    if keep_suffix:
        return path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


@contextlib.contextmanager
def replacing(path: Path, keep_suffix: bool = False) -> Iterator[Path]:
    """The temporary name to write ``path`` under (``temporary``); when the block ends it
    is renamed over ``path``, whole. A block that raises leaves ``path`` as it was, and no
    temporary behind."""
    tmp = temporary(path, keep_suffix)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary name beside ``path``, then rename it into place."""
    with replacing(path) as tmp:
        tmp.write_bytes(data)


def write_json(path: Path, payload: Any) -> None:
    write_atomic(path, (dumps(payload, indent=2) + "\n").encode())
