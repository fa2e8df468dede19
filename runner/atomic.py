"""Whole-file writes: a crash or a kill never leaves half a file under the final name.

Every JSON file the runner writes goes through ``dumps``: a non-finite number (NaN, an
infinity: a diverged loss, a figure of nothing) is written as ``null``, since JSON has no
such numbers and strict readers (jq, JavaScript, ``json.loads`` with ``parse_constant``)
refuse Python's bare ``NaN``; ``allow_nan=False`` makes any that slipped past fail loudly.
"""

from __future__ import annotations

import json
import math
import numbers
import os
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


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary name beside ``path``, then rename it into place."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_json(path: Path, payload: Any) -> None:
    write_atomic(path, (dumps(payload, indent=2) + "\n").encode())
