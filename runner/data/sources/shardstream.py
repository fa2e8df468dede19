"""Remote shards read ahead of need (``loader=shards`` with ``dataset.path=s3://...``).

``RemoteShards`` is the byte source of a ``ShardsStorage`` (runner/data/storage/shards.py)
whose shards live in a store. The loader tells it each batch it queues (``will_need``) and
the batch order is known in advance (``order``: the blocks of shards each epoch reads), so
it fetches the shards of the next blocks before they are needed, each whole into the
node-local cache (shardcache.py: bounded, furthest-ahead eviction, one fetcher per shard across
processes), in ``PART_BYTES`` range requests in flight together on the read engine
(readengine.py). The first ``RANGED_BATCHES`` batches of a cold start (of shards larger than two
parts), and every sample whose shard the cache has no room for, are read by range requests
instead, a batch's neighbouring samples merged into one: the first batch does not wait for
whole shards, and a cache smaller than a block still works. Once cached, a sample is one
``pread`` from the cached shard: epoch 2 runs at local speed when the shards fit.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from pathlib import Path
from typing import Any

from runner.data.order import BatchOrder
from runner.data.sources.objectstore import RemoteError
from runner.data.sources.url import RemoteURL

log = logging.getLogger(__name__)

SHARDS_PER_BLOCK = 4  # shards whose samples one stretch of an epoch mixes
PART_BYTES = 8 << 20  # one range request of a shard fetch
LOOKAHEAD_BLOCKS = 2  # blocks fetched ahead of the one being read (as the cache allows)
# A cold start reads its first batches by range requests while their shards arrive whole
# (a short first batch); later samples of a shard on its way wait for it (no byte twice).
# A shard of at most two parts arrives about as soon as a batch's ranges would: waited for.
RANGED_BATCHES = 2



class RemoteShards:
    """Shards in a store, fetched ahead into the node-local cache (the module's docstring).

    Args:
        url: the shard set's URL (a prefix).
        engine: the read engine of its store.
        names: shard names (keys under the prefix).
        nbytes: each shard's size.
        cache: the node-local cache.
        shard_of: the shard of each sample.
        spans: each sample's (offset, size) in its shard.
    """

    remote = True

    def __init__(self, url: RemoteURL, engine, names: list[str], nbytes: list[int],
                 cache, shard_of: list[int], spans: list[tuple[int, int]]):
        self.url, self.engine, self.names, self.nbytes = url, engine, names, nbytes
        self.cache, self.shard_of, self.spans = cache, shard_of, spans
        self.order: BatchOrder | None = None
        # bytes the engine fetched before any shard: the set's manifest and indexes
        self.index_bytes = engine.stats.bytes
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._pid = os.getpid()
        self._fds: dict[int, int] = {}
        self._pending: dict[int, concurrent.futures.Future] = {}  # sample -> its bytes
        self._fetching: dict[int, concurrent.futures.Future] = {}  # shard -> its fetch
        # shard fetches at once (each its parts in flight together; the engine bounds bytes)
        self._pool = concurrent.futures.ThreadPoolExecutor(8, "runner-shards")
        self._lock = threading.Lock()
        self._plan: dict[int, list[list[int]]] = {}
        self._where = (0, 0)  # (epoch, block) being read
        self.uncached_reads = 0
        self._ranged = 0  # batches read (partly) by range requests
        self._batch = 1  # the largest batch queued

    def __getstate__(self) -> dict:  # a worker process: its own pool, fds and loop
        keep = ("url", "engine", "names", "nbytes", "cache", "shard_of", "spans", "order",
                "index_bytes")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    # --- the schedule: which blocks of shards come next ----------------------------------

    def blocks(self, epoch: int) -> list[list[int]]:
        if epoch not in self._plan:
            self._plan = {e: b for e, b in self._plan.items() if e >= epoch - 1}
            self._plan[epoch] = self.order.group_blocks(epoch)
        return self._plan[epoch]

    def upcoming(self) -> list[int]:
        """Shards from the block being read on, this epoch then the next (none after the
        run's last epoch), in order."""
        epoch, block = self._where
        out: list[int] = []
        last = getattr(self.order, "last_epoch", None)
        after = self.blocks(epoch + 1) if last is None or epoch < last else []
        for blocks in (self.blocks(epoch)[block:], after):
            for b in blocks:
                out += [s for s in b if s not in out]
        return out

    def next_use(self, filename: str) -> float:
        """A cached shard's next use, in blocks from now (inf: not within two epochs, or
        no order known yet)."""
        if self.order is None:
            return float("inf")
        epoch, block = self._where
        for base, blocks in ((0, self.blocks(epoch)[block:]),
                             (len(self.blocks(epoch)) - block, self.blocks(epoch + 1))):
            for k, b in enumerate(blocks):
                if any(self.cache.path(self.names[s]).name == filename for s in b):
                    return base + k
        return float("inf")

    # --- fetching ------------------------------------------------------------------------

    def _write(self, shard: int):
        """Fetch shard ``shard`` into ``partial`` in PART_BYTES ranges, in flight together."""
        def write(partial: Path) -> None:
            size = self.nbytes[shard]
            key = self.url.key(self.names[shard])
            ranges = [(a, min(a + PART_BYTES, size)) for a in range(0, size, PART_BYTES)]
            if len(ranges) == 1:  # one part: a plain GET (servers without ranges too)
                futures = {self.engine.get(key, size): 0}
            else:
                futures = {self.engine.get_range(key, a, b): a for a, b in ranges}
            fd = os.open(partial, os.O_WRONLY)
            try:
                for future in concurrent.futures.as_completed(futures):
                    os.pwrite(fd, future.result(), futures[future])
                os.fsync(fd)
            finally:
                os.close(fd)
        return write

    def _fetch(self, shard: int, busy: set[str]) -> Path | None:
        try:
            return self.cache.fetch(self.names[shard], self.nbytes[shard], self._write(shard),
                                    self.next_use, busy)
        finally:
            with self._lock:
                self._fetching.pop(shard, None)

    def _prefetch(self) -> None:
        """Queue whole-shard fetches of the blocks coming next, as far as the cache holds
        them beside the block being read."""
        if self.order is None:
            return
        epoch, block = self._where
        now = self.blocks(epoch)[block] if block < len(self.blocks(epoch)) else []
        busy = {self.cache.path(self.names[s]).name for s in now}
        room = self.cache.bound - sum(self.nbytes[s] for s in now)
        ahead = self.upcoming()[: len(now) * (1 + LOOKAHEAD_BLOCKS)]
        for shard in ahead:
            if room < self.nbytes[shard]:
                break
            room -= self.nbytes[shard]
            busy.add(self.cache.path(self.names[shard]).name)
            with self._lock:
                if shard in self._fetching or self.cache.has(self.names[shard]):
                    continue
                self._fetching[shard] = self._pool.submit(self._fetch, shard, set(busy))

    def _forked(self) -> None:
        """In a forked loader worker: its own pool, descriptors and pending reads (the
        parent's threads did not come along)."""
        if self._pid != os.getpid():
            self._init_runtime()

    def will_need(self, index: list[int]) -> None:
        """A batch is queued: note where the epoch is, fetch ahead, and start range reads
        of its samples whose shards are not cached (neighbours merged into one request)."""
        self._forked()
        if self.order is not None and index:
            shard = self.shard_of[index[0]]
            epoch = max(self.order.epoch, 0)
            for k, b in enumerate(self.blocks(epoch)):
                if shard in b:
                    self._where = (epoch, k)
                    break
            self._prefetch()
        by_shard: dict[int, list[int]] = {}
        cached: dict[int, bool] = {}  # a file test per shard, not per sample
        for i in index:
            shard = self.shard_of[i]
            if i in self._pending:
                continue
            if shard not in cached:
                cached[shard] = self.cache.has(self.names[shard])
            if cached[shard]:
                continue
            if shard in self._fetching and (self._ranged >= RANGED_BATCHES
                                            or self.nbytes[shard] <= 2 * PART_BYTES):
                continue  # its whole shard is on its way (a small one: as soon as ranges)
            by_shard.setdefault(shard, []).append(i)
        self._ranged += bool(by_shard)
        for shard, items in by_shard.items():
            ranges = [(self.spans[i][0], self.spans[i][0] + self.spans[i][1]) for i in items]
            futures = self.engine.get_ranges(self.url.key(self.names[shard]), ranges)
            self._pending.update(zip(items, futures))
        self._batch = max(self._batch, len(index))
        if len(self._pending) > 16 * self._batch:  # queued, never read (a short last batch
            # of an epoch measures nothing: the batches queued before it are still to come)
            for stale in list(self._pending)[: len(self._pending) // 2]:
                self._pending.pop(stale, None)

    def read(self, shard: int, offset: int, size: int, index: int) -> bytes:
        self._forked()
        future = self._pending.pop(index, None)
        if future is not None:
            self.uncached_reads += 1
            try:
                return bytes(future.result())
            except RemoteError:  # what the server does to every request: the run stops
                raise
            except Exception:  # retried already: once more alone, then unreadable
                return self._range(shard, offset, size)
        fd = self._fds.get(shard)
        if fd is None:
            path = self.cache.path(self.names[shard])
            if not path.is_file():
                with self._lock:
                    fetching = self._fetching.get(shard)
                try:
                    path = fetching.result() if fetching is not None \
                        else self._fetch(shard, set())
                except RemoteError:
                    raise
                except Exception as e:  # the shard's fetch gave up: this sample alone
                    log.warning("fetching %s failed (%s): reading its samples one by one",
                                self.url.child(self.names[shard]), type(e).__name__)
                    path = None
            try:
                fd = os.open(path, os.O_RDONLY) if path is not None else None
            except FileNotFoundError:  # evicted meanwhile
                fd = None
            if fd is None:  # no room in the cache (or no shard): around it, one range
                return self._range(shard, offset, size)
            with self._lock:
                old = self._fds.get(shard)
                if old is not None:
                    os.close(fd)
                    fd = old
                else:
                    self._fds[shard] = fd
        self._drop_evicted()
        return os.pread(fd, size, offset)

    def _range(self, shard: int, offset: int, size: int) -> bytes:
        """One sample by a range request; an OSError naming it when the engine gives up
        (an unreadable sample: skipped, or with on_corrupt=fail an error)."""
        self.uncached_reads += 1
        url = self.url.child(self.names[shard])
        try:
            return bytes(self.engine.get_range(url.prefix, offset, offset + size).result())
        except RemoteError:
            raise
        except Exception as e:
            raise OSError(f"{url} bytes {offset}-{offset + size}: {type(e).__name__} after "
                          f"{self.engine.attempts} tries") from e

    def _drop_evicted(self) -> None:
        """Close descriptors of shards evicted (by any process), so their space is freed,
        when more are open than the cache could hold; never one of the blocks being read
        now (a decode thread may be reading it)."""
        if self.order is None or len(self._fds) <= 2 * SHARDS_PER_BLOCK * (1 + LOOKAHEAD_BLOCKS):
            return
        epoch, block = self._where
        reading = {s for b in self.blocks(epoch)[max(block - 1, 0):block + 2] for s in b}
        with self._lock:
            for shard in list(self._fds):
                if shard not in reading and not self.cache.has(self.names[shard]):
                    os.close(self._fds.pop(shard))

    def figures(self) -> dict[str, Any]:
        return {**self.engine.stats.figures(), "remote_index_bytes": self.index_bytes,
                "cache_peak_bytes": self.cache.peak_bytes,
                "cache_bound_bytes": self.cache.bound, "cache_evictions": self.cache.evictions,
                "uncached_reads": self.uncached_reads}

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self.engine.close()
