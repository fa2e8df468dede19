"""Whole-file writes: a crash or a kill never leaves half a file under the final name.

Every file the runner publishes is written under a temporary name beside it and renamed
into place (``replacing``): a reader sees the old file or the new one, never half of one.

Every JSON file the runner writes goes through ``dumps``: a non-finite number (NaN, an
infinity: a diverged loss, a figure of nothing) is written as ``null``, since JSON has no
such numbers and strict readers (jq, JavaScript, ``json.loads`` with ``parse_constant``)
refuse Python's bare ``NaN``; ``allow_nan=False`` makes any that slipped past fail loudly.

A file that was not written this way (a copy cut short, a full disk under another tool)
can still arrive half there: ``unreadable`` says why ``torch.load`` refused one in words a
user can act on (empty, truncated) instead of the zip reader's (``[Errno 22] Invalid
argument``, or nothing at all).
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


def unreadable(path: str | Path, error: BaseException) -> str:
    """Why a saved torch file at ``path`` could not be read by ``torch.load`` (raising
    ``error``), and how to get a good one."""
    try:
        size = os.path.getsize(path)
    except OSError:
        size = None
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if "PytorchStreamReader" in reason:  # its first sentence: the rest is advice for torch's
        reason = reason.split(". ")[0]
    if size == 0:
        return ("is empty (0 bytes): it was never written whole (a copy or a save that "
                "stopped at once); copy it again from where it was written, or point to "
                "another checkpoint (the run folder's checkpoint.pt or checkpoint-best.pt)")
    damaged = isinstance(error, EOFError | OSError) or any(
        s in reason for s in ("PytorchStreamReader", "central directory", "zip archive",
                              "Invalid argument", "unexpected EOF", "truncated"))
    if damaged or not str(error).strip():
        return (f"is truncated or damaged, or not a torch file ({size:,} bytes; {reason}): a "
                "copy or save that stopped part-way leaves such a file; copy it again whole "
                "(its size should be the original's), or point to another checkpoint (the "
                "run folder's checkpoint.pt or checkpoint-best.pt)")
    return f"cannot be read: {reason}"
