"""``dataset.page_cache=cold``: read the dataset from the storage device, not from RAM.

On a machine with enough memory, every epoch after the first is served from the page
cache, so its figures measure RAM. ``cold`` evicts the dataset's files (for memmap, the
cache file) before the run and before each epoch, with no root: each file is synced
(``fdatasync``; dirty pages cannot be dropped) and dropped with
``posix_fadvise(POSIX_FADV_DONTNEED)``. Pages a process still maps are not dropped, so a
memmap storage reopens its mapping first. Whether the eviction took is then measured with
``mincore`` on a sample of the files; where it did not (another OS, a filesystem that
ignores the advice, files mapped by worker processes), the run says so and records
``page_cache=unknown`` instead of pretending.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import mmap
import os
import time
from collections.abc import Callable, Iterable

import numpy as np

log = logging.getLogger(__name__)

STILL_RESIDENT = 0.1  # more than this share of sampled pages still cached: eviction failed


def can_evict() -> bool:
    return hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_DONTNEED")


def evict(paths: Iterable[str | os.PathLike]) -> int:
    """Drop each file's pages from the page cache; returns how many files were advised."""
    count = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            try:
                os.fdatasync(fd)  # dirty pages would stay
            except OSError:
                pass
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            count += 1
        finally:
            os.close(fd)
    return count


_libc = None


def _mincore():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    return _libc.mincore


def resident_fraction(paths: list[str], sample: int = 64) -> float | None:
    """Share of the sampled files' pages now in the page cache (None: cannot tell here)."""
    try:
        mincore = _mincore()
    except (OSError, AttributeError):
        return None
    step = max(1, len(paths) // sample)
    resident = total = 0
    for path in paths[::step][:sample]:
        size = os.path.getsize(path)
        if size == 0:
            continue
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            view = np.frombuffer(mapped, dtype=np.uint8)  # the mapping's address, untouched
            if mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec) != 0:
                return None
            del view
            resident += sum(v & 1 for v in vec)
            total += pages
        finally:
            mapped.close()
    return resident / total if total else None


class ColdPageCache:
    """Evicts ``files`` before the run and at each epoch, and checks that it took.

    Args:
        files: every file the run reads during its epochs.
        reopen: called before each eviction to drop this process's own mappings (memmap).
    """

    def __init__(self, files: list[str], reopen: Callable[[], None] | None = None):
        self.files = files
        self.reopen = reopen
        self.state = "cold" if can_evict() else "unknown"
        self.note = None if can_evict() else "posix_fadvise is not available on this OS"
        self.seconds = 0.0
        self.evictions = 0
        self.pause: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def __call__(self, epoch: int = 0) -> None:
        if self.state == "unknown" and self.evictions and self.note:
            return  # already known not to work: do not pretend each epoch
        with self.pause():  # the eviction is the measurement's cost, not the pipeline's
            start = time.perf_counter()
            if self.reopen is not None:
                self.reopen()
            if can_evict():
                evict(self.files)
                self._check()
            self.seconds += time.perf_counter() - start
        self.evictions += 1

    def figures(self) -> dict:
        """What the run reports about its page cache."""
        return {"page_cache": self.state, "page_cache_note": self.note,
                "evictions": self.evictions, "evict_seconds": self.seconds}

    def _check(self) -> None:
        left = resident_fraction(self.files)
        if left is None:
            self.state, self.note = "unknown", "mincore is unavailable: cannot confirm eviction"
        elif left > STILL_RESIDENT:
            self.state = "unknown"
            self.note = (f"eviction did not take: {left:.0%} of the sampled pages stayed cached "
                         "(a filesystem that ignores POSIX_FADV_DONTNEED, or files mapped by "
                         "another process such as loader workers)")
        if self.note and self.state == "unknown":
            log.warning("dataset.page_cache=cold: %s; recording page_cache=unknown", self.note)
