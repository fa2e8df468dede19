"""One large file on a far disk read in blocks: a packed store on a network mount.

Network file systems and FUSE mounts of buckets (NFS, s3fs, gcsfuse, Mountpoint, rclone)
serve small random reads in one file badly: rclone's mount answers one read of a file at a
time, whatever the threads or handles asking (measured here through a 10 ms line: 44 reads/s
of 50 KB from one thread, 41 from 16 threads on one handle, 52 from 16 handles, 22 opening
the file for each read), while one 4 MiB read costs about one round trip more than a 50 KB
one (18.6 reads/s: 78 MB/s). Read one image at a time, a packed store of 15 KB JPEGs gave
25 images/s there; read a few megabytes at a time, the same mount gives thousands.

So a packed store on a far disk is read as FFCV reads its files in quasi-random order:

- the store's images are cut into **blocks** of consecutive images spanning at most
  ``BLOCK_BYTES`` of the file (``block_bounds``);
- the epoch's order is a function of those blocks (``BatchOrder`` with ``groups``, as for
  shards): the blocks are shuffled, and the images of ``BLOCKS_MIXED`` blocks at a time are
  shuffled among themselves, so each batch is random within a stretch of the file and the
  epoch is random in its order of stretches;
- a batch the loader queues (``will_need``, a few batches ahead) starts a read of each of
  its blocks, whole, in one request each (``BlockReads``), kept in a small cache
  (``CACHED_BLOCKS``: the stretch being read, the next, and one more) until newer blocks
  push it out; an image is then a slice of its block's bytes.

A batch whose images lie in many blocks (anything but this order: a conversion reading the
store in another order) is not read in blocks: its images' ranges are fetched as before, so
nothing reads a block for one image. The order depends on (seed, epoch, the blocks): a run
resumed on a far disk reads what an uninterrupted one there does; a checkpoint records it
(``order`` in its data fingerprint), and a resume that would read the store in the other
order (moved between a far and a local disk) is refused with the key that decides.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np

BLOCK_BYTES = 4 << 20  # a block's bytes at most (one request: ~1 round trip more than 50 KB)
BLOCKS_MIXED = 4  # blocks whose images one stretch of an epoch mixes
CACHED_BLOCKS = 3 * BLOCKS_MIXED  # the stretch read now, the next one, and one more


def block_bounds(offsets: Sequence[int], sizes: Sequence[int],
                 block_bytes: int = BLOCK_BYTES) -> list[int]:
    """The first item of each block of consecutive items whose bytes (from the first
    item's offset to the end of the last's) span at most ``block_bytes`` (an item larger
    than that is a block of its own), then the item count: ``BatchOrder``'s ``groups``."""
    bounds, start = [0], None
    for i, (offset, size) in enumerate(zip(offsets, sizes)):
        if start is None:
            start = offset
        elif offset + size - start > block_bytes:
            bounds.append(i)
            start = offset
    n = len(offsets)
    if bounds[-1] != n:
        bounds.append(n)
    return bounds if n else [0]


class BlockReads:
    """The blocks of one far file, each fetched whole by the read engine and cached (the
    module's docstring).

    Args:
        engine: the read engine (``get_range(key, start, end)`` -> Future of the bytes).
        key: the file's key in the engine's store.
        offsets, sizes: each item's bytes in the file.
        bounds: ``block_bounds`` of the items.
        cached: blocks kept at most.
    """

    def __init__(self, engine, key: str, offsets: Sequence[int], sizes: Sequence[int],
                 bounds: list[int], cached: int = CACHED_BLOCKS):
        self.engine, self.key, self.cached = engine, key, cached
        self.offsets, self.sizes = offsets, sizes
        self.block_of = np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))
        self.spans = [(offsets[a], offsets[b - 1] + sizes[b - 1])
                      for a, b in zip(bounds[:-1], bounds[1:])]
        self.blocks: collections.OrderedDict[int, Future] = collections.OrderedDict()
        self.lock = threading.Lock()
        self.fetched = 0  # blocks read (a block pushed out and needed again counts again)

    def will_need(self, items: Sequence[int]) -> bool:
        """Start reading the blocks of ``items`` (a coming batch) not cached yet; False
        when they lie in more than two stretches' blocks (two thirds of the cache: not
        this order, the caller reads their ranges instead)."""
        blocks = np.unique(self.block_of[np.asarray(items, dtype=np.int64)]).tolist()
        if len(blocks) > min(2 * self.cached // 3, self.cached):
            return False
        with self.lock:
            for b in blocks:
                if b in self.blocks:
                    self.blocks.move_to_end(b)
                    continue
                self.blocks[b] = self.engine.get_range(self.key, *self.spans[b])
                self.fetched += 1
            while len(self.blocks) > self.cached:  # the oldest stretch is done
                self.blocks.popitem(last=False)
        return True

    def read(self, item: int) -> bytes | None:
        """Item ``item``'s bytes from its block (waiting for the block's read), or None when
        its block is not being read (the caller reads its range)."""
        b = int(self.block_of[item])
        with self.lock:
            future = self.blocks.get(b)
        if future is None:
            return None
        data = memoryview(future.result())
        start = self.offsets[item] - self.spans[b][0]
        return bytes(data[start : start + self.sizes[item]])

    def figures(self) -> dict:
        return {"far_reads": f"blocks of up to {BLOCK_BYTES >> 20} MiB, {BLOCKS_MIXED} "
                             "mixed at a time",
                "far_blocks": len(self.spans), "far_blocks_fetched": self.fetched}
