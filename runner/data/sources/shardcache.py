"""The node-local shard cache: whole shards on local disk, with a hard bound in bytes.

``ShardCache(folder, bound)`` keeps copies of remote shards in ``folder`` (under
``dataset.cache_dir``, one folder per shard set) and never lets the bytes there, finished
shards and shards being written together, pass ``bound`` (``dataset.cache_bytes``) except
by what is in flight while room is made:

- **whole or nothing**: a shard is written under ``<name>.partial.<pid>`` and renamed into
  place once complete, so a killed run leaves no half shard that a later one would read
  (a stale ``.partial`` is removed by the next run that fetches that shard);
- **one fetcher per shard**: a file lock per shard (``<name>.lock``, filelock) makes the
  ranks of a node and concurrent sweep jobs fetch a shard once; the others wait on the lock
  and then find it in place, so they share one copy;
- **room before a fetch**: under the folder's lock, the bytes in the folder are counted
  (every process's shards) and shards are evicted until the new one fits. The victim is the
  shard needed furthest in the future by this process's schedule (Belady's rule: the order
  is known in advance, ``ShardSchedule``), never one it is reading now; a shard another
  process still reads stays readable through its open descriptor after the unlink.
  When nothing may go, ``reserve`` says so and the caller reads around the cache
  (range requests) instead of passing the bound;
- ``peak_bytes``: the most bytes this process saw in the folder (the bench's figure).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

log = logging.getLogger(__name__)

LOCK, PARTIAL = ".lock", ".partial."


def folder_bytes(folder: Path) -> int:
    """Bytes of every shard and partial shard in ``folder`` (not its locks or indexes)."""
    total = 0
    for entry in os.scandir(folder):
        if entry.is_file() and not entry.name.endswith((LOCK, ".json")):
            try:
                total += entry.stat().st_size
            except FileNotFoundError:  # evicted by another process meanwhile
                continue
    return total


class ShardCache:
    """Whole shards on local disk, at most ``bound`` bytes.

    Args:
        folder: where the shards go (created).
        bound: the most bytes the folder may hold.
    """

    def __init__(self, folder: Path, bound: int):
        self.folder, self.bound = Path(folder), int(bound)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.peak_bytes = folder_bytes(self.folder)
        self.evictions = 0
        self._locks: tuple[int, FileLock] | None = None

    @property
    def _lock(self) -> FileLock:
        """The folder's lock, this process's own (a forked loader worker makes its own)."""
        if self._locks is None or self._locks[0] != os.getpid():
            self._locks = (os.getpid(), FileLock(str(self.folder / ("cache" + LOCK))))
        return self._locks[1]

    def path(self, name: str) -> Path:
        return self.folder / name.replace("/", "__")

    def has(self, name: str) -> bool:
        return self.path(name).is_file()

    def reserve(self, nbytes: int, next_use: Callable[[str], float], busy: set[str],
                partial: Path) -> bool:
        """Make room for ``nbytes`` more by evicting the cached shards needed furthest in
        the future (``next_use``: a shard's next position in this process's schedule, inf
        when not needed again), never one of ``busy``, and hold it: ``partial`` is created
        at its full size under the folder's lock, so concurrent fetches count each other.
        False when there is no room to make."""
        with self._lock:
            if self._evict(nbytes, next_use, busy):
                with open(partial, "wb") as f:
                    f.truncate(nbytes)
                self.peak_bytes = max(self.peak_bytes, folder_bytes(self.folder))
                return True
            return False

    def _evict(self, nbytes: int, next_use: Callable[[str], float], busy: set[str]) -> bool:
        used = folder_bytes(self.folder)
        if used + nbytes <= self.bound:
            return True
        cached = [e for e in os.scandir(self.folder) if e.is_file()
                  and e.name.endswith(".tar") and PARTIAL not in e.name]
        victims = sorted((e for e in cached if e.name not in busy),
                         key=lambda e: next_use(e.name), reverse=True)
        for entry in victims:
            if used + nbytes <= self.bound:
                break
            try:
                size = entry.stat().st_size
                os.unlink(entry.path)
            except FileNotFoundError:
                continue
            used -= size
            self.evictions += 1
        return used + nbytes <= self.bound

    def fetch(self, name: str, nbytes: int, write: Callable[[Path], None],
              next_use: Callable[[str], float], busy: set[str]) -> Path | None:
        """The local path of shard ``name`` (``nbytes``), fetched with ``write(partial)``
        when not cached yet, by one process at a time; None when the cache has no room for
        it (the caller reads around the cache)."""
        final = self.path(name)
        if final.is_file():
            return final
        with FileLock(str(final) + LOCK):
            if final.is_file():  # another process fetched it while this one waited
                return final
            partial = final.with_name(f"{final.name}{PARTIAL}{os.getpid()}")
            if not self.reserve(nbytes, next_use, busy | {final.name}, partial):
                return None
            try:
                write(partial)
                os.replace(partial, final)
            finally:
                if partial.exists():
                    partial.unlink()
        return final
