"""``loader=shards``: WebDataset tar shards, on local disk or in a store, decoded every epoch.

``dataset.path`` is a shard set (a folder or URL prefix holding ``manifest.json`` or
``*.tar``; or the ``manifest.json`` itself) or an image folder, which is converted once:
packed at ``dataset.store_size`` (packed.py), then written as shards into the cache
(``python -m runner.prepare shards ... out=<folder or URL>`` writes them anywhere). The
format is WebDataset's, with an index per shard (tarshards.py); a tar set someone else
wrote is indexed on first use, the index cached under ``dataset.cache_dir``.

**Reading.** Samples are decoded as packed's are (the same decoders, crop, DCT-scaled and
region decode: ``PackedStorage.decode_slice``); a sample is one ``pread`` from its shard.
Every sample's bytes are checked against the CRC-32 in the index: a mismatch reads as an
unreadable file named ``<shard>/<key>``, skipped or (``dataset.on_corrupt=fail``) an error.

**Order.** Shards are shuffled in blocks of ``SHARDS_PER_BLOCK`` and the samples of a block
among themselves (``BatchOrder`` with ``groups``): a function of (seed, epoch) and the shard
set, so a resumed run reads exactly what an uninterrupted one does, on every rank.

**Remote shards** (``dataset.path=s3://...``): the loader tells the storage each batch it
queues (``will_need``) and the storage knows the epoch's order (``follow``), so it fetches
the shards of the next blocks before they are needed, each whole into the node-local cache
(runner/data/remote/cache.py: bounded by ``dataset.cache_bytes``, evicting the shard needed
furthest ahead, one fetcher per shard across processes), in ``PART_BYTES`` range requests
in flight together (runner/data/remote/engine.py). The first ``RANGED_BATCHES`` batches of
a cold start, and every sample whose shard the cache has no room for, are read by range
requests instead (a batch's neighbouring samples merged into one), so the first batch does
not wait for whole shards and a cache smaller than a block still works; epoch 2 reads the
cache, at local speed, when the shards fit.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import zlib
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

from runner.config import DatasetConfig, LoaderConfig, StorageName
from runner.data.order import BatchOrder, split_padding
from runner.data.remote.url import RemoteURL, is_url
from runner.data.storage.base import StorageKind, StoreFootprint
from runner.data.storage.cache import CacheError, human_bytes
from runner.data.storage.decode import DECODERS
from runner.data.storage.folder import FolderStorage
from runner.data.storage.listing import DatasetError
from runner.data.storage.packed import PackedStorage, build_packed, open_packed, packed_spec
from runner.data.storage.tarshards import (
    DEFAULT_SHARD_BYTES,
    MANIFEST,
    SHARD_LIST,
    ShardIndex,
    ShardWriter,
    index_name,
    index_tar,
    load_json,
    write_manifest,
)

log = logging.getLogger(__name__)

SHARDS_PER_BLOCK = 4  # shards whose samples one stretch of an epoch mixes
PART_BYTES = 8 << 20  # one range request of a shard fetch
DEFAULT_CACHE_BYTES = 10 * 10**9
LOOKAHEAD_BLOCKS = 2  # blocks fetched ahead of the one being read (as the cache allows)
# A cold start reads its first batches by range requests while their shards arrive whole
# (a short first batch); later samples of a shard on its way wait for it (no byte twice).
# A shard of at most two parts arrives about as soon as a batch's ranges would: waited for.
RANGED_BATCHES = 2


# --- where the shards are -----------------------------------------------------------------

class LocalShards:
    """Shards in a local folder: a sample is one ``pread``."""

    remote = False

    def __init__(self, folder: Path, names: list[str]):
        self.folder, self.names = Path(folder), names
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"folder": self.folder, "names": self.names}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["folder"], state["names"])

    def path(self, shard: int) -> Path:
        return self.folder / self.names[shard]

    def read(self, shard: int, offset: int, size: int, index: int) -> bytes:
        fd = self._fds.get(shard)
        if fd is None:
            with self._lock:  # one descriptor per shard, however many threads ask at once
                fd = self._fds.get(shard)
                if fd is None:
                    fd = self._fds[shard] = os.open(self.path(shard), os.O_RDONLY)
        return os.pread(fd, size, offset)

    def will_need(self, index: list[int]) -> None:
        """Nothing: the page cache reads ahead on its own."""

    def figures(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


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

    def __getstate__(self) -> dict:  # a worker process: its own pool, fds and loop
        keep = ("url", "engine", "names", "nbytes", "cache", "shard_of", "spans", "order")
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
        """Shards from the block being read on, this epoch then the next, in order."""
        epoch, block = self._where
        out: list[int] = []
        for blocks in (self.blocks(epoch)[block:], self.blocks(epoch + 1)):
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
        for i in index:
            shard = self.shard_of[i]
            if i in self._pending or self.cache.has(self.names[shard]):
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
        if len(self._pending) > 16 * max(len(index), 1):  # queued, never read
            for stale in list(self._pending)[: len(self._pending) // 2]:
                self._pending.pop(stale, None)

    def read(self, shard: int, offset: int, size: int, index: int) -> bytes:
        self._forked()
        future = self._pending.pop(index, None)
        if future is not None:
            self.uncached_reads += 1
            try:
                return bytes(future.result())
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
        return {**self.engine.stats.figures(), "cache_peak_bytes": self.cache.peak_bytes,
                "cache_bound_bytes": self.cache.bound, "cache_evictions": self.cache.evictions,
                "uncached_reads": self.uncached_reads}

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self.engine.close()


# --- the storage --------------------------------------------------------------------------

class ShardsStorage(PackedStorage):
    """The samples of a shard set (the ``Storage`` protocol), decoded per epoch as packed's
    stored JPEGs are.

    Args:
        root: the shard set's location (a folder or a URL).
        indexes: each shard's index.
        classes: class names by index.
        decode: the decoder (the folder's ``ImageDecoder`` or ``ReadBytes``).
        on_corrupt: skip or fail on a sample that does not decode or fails its CRC.
        source: where the bytes come from (``LocalShards`` or ``RemoteShards``).
    """

    group_block = SHARDS_PER_BLOCK

    def __init__(self, root: str | Path, indexes: list[ShardIndex], classes: list[str],
                 decode, on_corrupt, source: LocalShards | RemoteShards):
        self.root, self.classes = root, classes
        self.decode, self.on_corrupt = decode, on_corrupt
        self.known_skipped = []
        self.samples, self.offsets, self.sizes = [], [], []
        self.heights, self.widths, self.crcs, self.shard_of = [], [], [], []
        self.order_groups = [0]
        upright = True
        for k, index in enumerate(indexes):
            self.samples += [(f"{index.shard}/{key}", label)
                             for key, label in zip(index.keys, index.labels)]
            self.offsets += index.offsets
            self.sizes += index.sizes
            self.heights += index.heights
            self.widths += index.widths
            self.crcs += index.crcs
            self.shard_of += [k] * len(index)
            self.order_groups.append(len(self.samples))
            upright = upright and all(index.upright)
        self.upright = upright
        self.source = source
        self.spec, self.cache = None, None
        self.data_bytes = sum(self.sizes)
        self.path = None

    def __del__(self) -> None:
        pass  # the source owns the descriptors

    def __getstate__(self) -> dict:
        return dict(self.__dict__)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def name_of(self, index: int) -> str:
        """``<shard>/<key>`` (what predictions name a sample by)."""
        return self.samples[index][0]

    def follow(self, order: BatchOrder) -> None:
        """The batch order this storage is read in (its blocks of shards, to fetch ahead)."""
        self.source.order = order

    @property
    def files(self) -> list[str]:
        if self.source.remote:
            return []
        return [str(self.source.path(k)) for k in range(len(self.source.names))]

    @property
    def native_batches(self) -> bool:
        return self.upright and PackedStorage.native_batches.func(self)

    def will_need(self, index: torch.Tensor) -> None:
        self.source.will_need(split_padding(index)[0].tolist())

    def read(self, index: int) -> bytes:
        """Sample ``index``'s JPEG, checked against its CRC-32 (a mismatch is an OSError
        naming ``<shard>/<key>``: skipped, or with on_corrupt=fail an error)."""
        size = self.sizes[index]
        data = self.source.read(self.shard_of[index], self.offsets[index], size, index)
        if len(data) != size or zlib.crc32(data) != self.crcs[index]:
            raise OSError(f"{self.root}/{self.samples[index][0]}: its bytes fail the CRC-32 "
                          "of the shard's index (a damaged or changed shard)")
        return data

    def check_stored(self, index: int, data: bytes | bytearray) -> None:
        """Nothing more: ``read`` checked the CRC already."""

    def figures(self) -> dict[str, Any]:
        return self.source.figures()

    def close(self) -> None:
        self.source.close()


# --- opening a shard set ------------------------------------------------------------------

def _cache_folder(dataset: DatasetConfig, what: str, key: str) -> Path:
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(dataset.cache_dir).expanduser() / "shards" / what / digest


def _local_set(folder: Path, dataset: DatasetConfig) -> tuple[list[ShardIndex], list[str]]:
    """The indexes and classes of a local shard set (its manifest, else its ``*.tar``
    indexed now and cached)."""
    manifest = folder / MANIFEST
    if manifest.is_file():
        meta = load_json(manifest.read_text(), str(manifest))
        indexes = [ShardIndex.from_json(json.loads((folder / s["index"]).read_text()))
                   for s in meta[SHARD_LIST]]
        return indexes, list(meta.get("classes", []))
    tars = sorted(p.name for p in folder.glob("*.tar"))
    cache = _cache_folder(dataset, "index", str(folder.resolve()))
    cache.mkdir(parents=True, exist_ok=True)
    indexes = []
    for name in tars:
        st = (folder / name).stat()
        saved = cache / f"{index_name(name)}.{st.st_size}.{st.st_mtime_ns}"
        if saved.is_file():
            indexes.append(ShardIndex.from_json(json.loads(saved.read_text())))
            continue
        with open(folder / name, "rb") as f:
            index = index_tar(f, name, st.st_size)
        saved.write_text(json.dumps(index.to_json()))
        indexes.append(index)
    return indexes, _classes_of(indexes)


def _classes_of(indexes: list[ShardIndex]) -> list[str]:
    top = max((max(i.labels, default=-1) for i in indexes), default=-1)
    return [str(k) for k in range(top + 1)]


def is_shard_set(path: Path) -> bool:
    return (path / MANIFEST).is_file() or any(path.glob("*.tar"))


def _remote_set(url: RemoteURL, dataset: DatasetConfig, engine, cache
                ) -> tuple[list[ShardIndex], list[str]]:
    """The indexes and classes of a shard set in a store: its manifest and indexes
    (fetched together), else its ``*.tar`` fetched through the cache and indexed once."""
    store = engine.store
    objects = {o.key: o for o in store.list(url.prefix)}
    manifest_key = url.key(MANIFEST)
    if manifest_key in objects:
        meta = load_json(store.get(manifest_key), str(url.child(MANIFEST)))
        futures = [engine.get(url.key(s["index"])) for s in meta[SHARD_LIST]]
        indexes = [ShardIndex.from_json(json.loads(bytes(f.result()))) for f in futures]
        return indexes, list(meta.get("classes", []))
    tars = sorted(k for k in objects if k.endswith(".tar"))
    if not tars:
        raise DatasetError(f"dataset.path={url} holds no {MANIFEST} and no .tar shards")
    indexes = []
    for key in tars:
        name = key[len(url.prefix) + 1:] if url.prefix else key
        info = objects[key]
        saved = cache.folder / f"{index_name(name).replace('/', '__')}.{info.size}.{info.etag}"
        if saved.is_file():
            indexes.append(ShardIndex.from_json(json.loads(saved.read_text())))
            continue
        with tempfile.TemporaryFile(dir=cache.folder) as f:
            f.write(bytes(engine.get(key, info.size).result()))
            f.seek(0)
            index = index_tar(f, name, info.size)
        saved.write_text(json.dumps(index.to_json()))
        indexes.append(index)
    return indexes, _classes_of(indexes)


def open_remote_shards(loader: LoaderConfig, dataset: DatasetConfig, text: str,
                       decode) -> ShardsStorage:
    from runner.data.remote.cache import ShardCache
    from runner.data.remote.client import ObjectStore
    from runner.data.remote.engine import ReadEngine

    url = RemoteURL.parse(text)
    if url.prefix.endswith(MANIFEST):
        url = RemoteURL(url.scheme, url.bucket, url.prefix[: -len(MANIFEST)].rstrip("/"))
    engine = ReadEngine(ObjectStore(url, dataset.endpoint_url))
    bound = dataset.cache_bytes or DEFAULT_CACHE_BYTES
    cache = ShardCache(_cache_folder(dataset, "remote", f"{url}|{dataset.endpoint_url}"),
                       bound)
    indexes, classes = _remote_set(url, dataset, engine, cache)
    shard_of = [k for k, i in enumerate(indexes) for _ in range(len(i))]
    spans = [(o, s) for i in indexes for o, s in zip(i.offsets, i.sizes)]
    largest = max((i.nbytes for i in indexes), default=0)
    if bound < SHARDS_PER_BLOCK * largest:
        log.warning("dataset.cache_bytes=%d holds fewer than a block of shards (%d x %s): "
                    "samples outside it are read by range requests each epoch",
                    bound, SHARDS_PER_BLOCK, human_bytes(largest))
    source = RemoteShards(url, engine, [i.shard for i in indexes], [i.nbytes for i in indexes],
                          cache, shard_of, spans)
    return ShardsStorage(str(url), indexes, classes, decode, dataset.on_corrupt, source)


def open_shards(loader: LoaderConfig, dataset: DatasetConfig, path: Path | str,
                progress: bool = True) -> ShardsStorage:
    """The shard set at ``path`` (a folder, URL or manifest), or an image folder's shards
    (converted once into the cache)."""
    decode = _decoder(loader, dataset)
    if is_url(path):
        return open_remote_shards(loader, dataset, str(path), decode)
    folder = Path(path).expanduser()
    if folder.name == MANIFEST and folder.is_file():
        folder = folder.parent
    if not (folder.is_dir() and is_shard_set(folder)):
        folder = convert_to_shards(loader, dataset, folder, progress)
    indexes, classes = _local_set(folder, dataset)
    if not indexes:
        raise DatasetError(f"dataset.path={folder} holds no samples in its shards")
    source = LocalShards(folder, [i.shard for i in indexes])
    return ShardsStorage(folder, indexes, classes, decode, dataset.on_corrupt, source)


def _decoder(loader: LoaderConfig, dataset: DatasetConfig):
    """The decoder a folder of ``dataset`` would use (its size, crop and fallbacks)."""
    from runner.data.storage.decode import FALLBACK, ImageDecoder, check_decoder
    from runner.data.storage.encoded import ReadBytes

    check_decoder(loader.decoder)
    decode = ImageDecoder(loader.decoder, tuple(dataset.image_size), dataset.crop,
                          loader.draft, dataset.crop_fraction)
    if DECODERS[loader.decoder].cuda:
        decode = ReadBytes(ImageDecoder(FALLBACK, decode.size, decode.crop,
                                        fraction=decode.fraction))
    return decode


# --- writing shards -----------------------------------------------------------------------

def write_packed_as_shards(packed: PackedStorage, out: Path, shard_bytes: int,
                           facts: dict[str, Any]) -> dict[str, Any]:
    """Every stored JPEG of ``packed`` into shards in ``out``, with indexes and manifest."""
    writer = ShardWriter(out, shard_bytes)
    for i in range(len(packed)):
        writer.add(f"{i:08d}", packed.read(i), packed.samples[i][1], packed.heights[i],
                   packed.widths[i], packed.name_of(i))
    skipped = [{"path": s.path, "error": s.error} for s in packed.known_skipped]
    return write_manifest(out, writer.close(), packed.classes, skipped=skipped, **facts)


def _packed_facts(packed: PackedStorage, shard_bytes: int) -> dict[str, Any]:
    spec = packed.spec
    return {"store_size": spec.store_size, "store_side": spec.side.value,
            "store_quality": spec.quality, "shard_bytes": shard_bytes,
            "packed": {"folder": packed.cache.name, "data_bytes": packed.data_bytes,
                       "count": len(packed)}}


def convert_to_shards(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
                      progress: bool = True, shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """The cached shards of the image folder at ``path`` (packed, then written as shards,
    once; again when the packed store changed)."""
    packed = open_packed(loader, dataset, path, progress)
    facts = _packed_facts(packed, shard_bytes)
    out = Path(dataset.cache_dir).expanduser() / "shards" / "local" / \
        f"{packed.cache.name}-{shard_bytes >> 20}MiB"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        try:
            meta = json.loads((out / MANIFEST).read_text())
        except (OSError, ValueError):
            meta = None
        if meta is None or meta.get("packed") != facts["packed"]:
            partial = out.with_name(out.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            write_packed_as_shards(packed, partial, shard_bytes, facts)
            shutil.rmtree(out, ignore_errors=True)
            os.replace(partial, out)
            log.info("shards ready: %s", out)
    return out


def stage_remote(dataset: DatasetConfig, text: str) -> Path:
    """A local copy of the images at the URL ``text`` (to pack), with a manifest that keeps
    their order and labels; reused when complete."""
    from runner.data.remote.client import ObjectStore
    from runner.data.remote.engine import ReadEngine
    from runner.data.remote.listing import list_remote

    store = ObjectStore(RemoteURL.parse(text), dataset.endpoint_url)
    listing = list_remote(dataset, text, store)
    stage = _cache_folder(dataset, "staging", f"{text}|{dataset.endpoint_url}")
    done = stage / "manifest.csv"
    if done.is_file():
        return done
    engine = ReadEngine(store)
    root = str(listing.root).rstrip("/") + "/"
    prefix = len(store.url.store_url) + 1
    rows = []
    futures = [(u[len(root):], label, engine.get(u[prefix:])) for u, label in listing.samples]
    for name, label, future in futures:
        target = stage / "files" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(bytes(future.result()))
        rows.append((f"files/{name}", listing.classes[label] if label >= 0 else ""))
    engine.close()
    import csv

    partial = stage / "manifest.csv.partial"
    with open(partial, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["path", "label"] if listing.classes else ["path"])
        for name, label in rows:
            writer.writerow([name, label] if listing.classes else [name])
    os.replace(partial, done)
    return done


def build_shards(loader: LoaderConfig, dataset: DatasetConfig, path: Path | str,
                 progress: bool = True, rebuild: bool = False, out: str | None = None,
                 shard_mb: str | None = None) -> Path | str:
    """``python -m runner.prepare shards dataset.path=<folder, manifest or URL>
    out=<folder or URL> [shard_mb=64]``: the packed store of the images written as shards
    at ``out`` (unset: the cache, where ``loader=shards`` finds them)."""
    import dataclasses

    shard_bytes = int(float(shard_mb) * (1 << 20)) if shard_mb else DEFAULT_SHARD_BYTES
    if shard_bytes < 1 << 12:
        raise CacheError(f"shard_mb={shard_mb} is too small: give at least 0.004 (4 KiB; "
                         "64 is the usual size)")
    if is_url(path):
        path = stage_remote(dataset, str(path))
        dataset = dataclasses.replace(dataset, path=None, manifest=str(path))
    if out is None:
        return convert_to_shards(loader, dataset, Path(path), progress, shard_bytes)
    if rebuild:
        build_packed(loader, dataset, Path(path), progress, rebuild=True)
    packed = open_packed(loader, dataset, Path(path), progress)
    facts = _packed_facts(packed, shard_bytes)
    if not is_url(out):
        target = Path(out).expanduser()
        write_packed_as_shards(packed, target, shard_bytes, facts)
        return target
    from runner.data.remote.client import check_bucket_writable

    url = RemoteURL.parse(out)
    store = check_bucket_writable(out, dataset.endpoint_url)
    with tempfile.TemporaryDirectory(dir=Path(dataset.cache_dir).expanduser()) as tmp:
        manifest = write_packed_as_shards(packed, Path(tmp), shard_bytes, facts)
        for shard in manifest[SHARD_LIST]:  # the manifest last: a reader sees all or none
            store.put_file(url.key(shard["name"]), str(Path(tmp) / shard["name"]))
            store.put_file(url.key(shard["index"]), str(Path(tmp) / shard["index"]))
        store.put_file(url.key(MANIFEST), str(Path(tmp) / MANIFEST))
    return out


def shards_footprint(dataset: DatasetConfig, folder: FolderStorage) -> StoreFootprint:
    from runner.data.storage.packed import estimate_bytes

    spec = packed_spec(None, dataset, folder.root)
    return StoreFootprint(f"tar shards of JPEG q{spec.quality} at {spec.store_size}",
                          estimate_bytes(folder, spec), estimated=True)


KIND = StorageKind(
    name=StorageName.shards,
    open=open_shards,
    storage=ShardsStorage,
    summary="WebDataset tar shards (local or a URL, cached on the node), decoded every epoch",
    decoders=frozenset(DECODERS),
    knobs=("loader.decoder", "loader.draft"),
    autotune=False,
    advice={"decode": "a smaller dataset.store_size (fewer pixels to decode per image)"},
    build=build_shards,
    build_options=("out", "shard_mb"),
    footprint=shards_footprint,
    speed_rank=2,
    urls=True,
)
