"""Text for people: byte sizes, counted nouns and file names as a log line or message shows them."""

from __future__ import annotations

import os


def human_bytes(nbytes: float) -> str:
    """``1.52 GB``, ``12.3 MB``, ``900 B``: decimal units, about three significant figures
    (never "0.00 GB" for a few megabytes)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(nbytes) < 999.5 or unit == "TB":
            break
        nbytes /= 1000
    if unit == "B":
        return f"{nbytes:,.0f} B"
    digits = 0 if abs(nbytes) >= 99.5 else 1 if abs(nbytes) >= 9.95 else 2
    return f"{nbytes:,.{digits}f} {unit}"


def plural(n: int, noun: str) -> str:
    """``1 step``, ``2 steps``, ``1 class``, ``3 classes``."""
    if n == 1:
        return f"1 {noun}"
    return f"{n:,} {noun}es" if noun.endswith(("s", "sh", "ch", "x")) else f"{n:,} {noun}s"


def printable(path: str) -> str:
    """``path`` as valid UTF-8 text: bytes that are not UTF-8 (a file name from another
    system's encoding) appear as ``\\xNN`` escapes instead of failing a write."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")
