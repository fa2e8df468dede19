"""Writing ``loader=shards``'s shards: ``python -m runner.prepare shards`` and the conversion
of an image folder on first use.

The images are packed first (packed.py: re-encoded once at ``dataset.store_size``, so the
shards hold exactly what packed decodes), then written in a shuffled order (``shuffle_seed=``,
default 0, recorded in the manifest: the same seed writes the same files) as WebDataset tars
with an index each and one manifest (tarformat.py). ``out=`` a folder writes there; ``out=``
a URL writes to a temporary folder and uploads each shard and index, the manifest last (a
reader sees the whole set or none). An image folder at a URL is first copied to a local
staging folder (a manifest keeps its order and labels). Unset ``out=``: the cache, where
``loader=shards`` over the image folder finds them, rewritten when the packed store changed.
A detection set (``dataset.targets``) is packed with its boxes, and each sample's boxes are
written beside its JPEG as ``<key>.json`` (tarformat.py); the manifest's ``packed`` facts
then name the boxes' digest, so shards in the cache are rewritten when the labels change.
A set of any other target (masks) is packed with its kind's blobs (packed.py's
``StoredBlobs``), each written beside its JPEG as ``<key>.<blob_ext>`` as the store holds it,
unread; the manifest names the kind (``blobs``) and the targets' digest the same way.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

from runner.config.schema import DatasetConfig, LoaderConfig
from runner.data.sources.url import RemoteURL, is_url
from runner.data.storage.convert import CacheError
from runner.data.storage.packed import PackedStorage, StoredBlobs, build_packed, open_packed
from runner.data.storage.tarformat import (
    DEFAULT_SHARD_BYTES,
    MANIFEST,
    SHARD_LIST,
    ShardWriter,
    box_json,
    write_manifest,
)
from runner.data.targets import TARGETS

log = logging.getLogger(__name__)

READ_AHEAD = 256  # images of a packed store asked for together while writing its shards
DEFAULT_SHUFFLE_SEED = 0


def cache_folder(dataset: DatasetConfig, what: str, key: str) -> Path:
    """``<cache_dir>/shards/<what>/<digest of key>``: one folder per shard set."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(dataset.cache_dir).expanduser() / "shards" / what / digest



def write_order(count: int, seed: int) -> torch.Tensor:
    """The order the samples are written in: a permutation of the dataset drawn from
    ``seed`` (the same on every machine and torch version: a CPU generator)."""
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed))


def write_packed_as_shards(packed: PackedStorage, out: Path, shard_bytes: int,
                           facts: dict[str, Any]) -> dict[str, Any]:
    """Every stored JPEG of ``packed`` into shards in ``out`` in the shuffled order of
    ``facts["shuffle"]["seed"]``, with indexes and manifest; a sample's key is its place in
    the dataset."""
    writer = ShardWriter(out, shard_bytes)
    if isinstance(packed.targets, StoredBlobs):
        ext = TARGETS[packed.targets.kind].blob_ext
    order = write_order(len(packed), facts["shuffle"]["seed"])
    for k, i in enumerate(order.tolist()):
        if k % READ_AHEAD == 0:  # the next images asked for together: on a far disk one
            # request per run of neighbours, locally the kernel's readahead
            packed.will_need(order[k:k + READ_AHEAD].sort().values)
        boxes, blob = None, None
        if isinstance(packed.targets, StoredBlobs):  # its target's blob, as packed holds it
            blob = (ext, packed.targets.blob(i))
        elif packed.targets is not None:  # detection: its boxes beside it, as packed holds them
            t = packed.targets[i]
            boxes = box_json(t.boxes, t.labels, t.image_id, packed.heights[i], packed.widths[i],
                             packed.targets.source_size(i))
        writer.add(f"{i:08d}", packed.read(i), packed.samples[i][1], packed.heights[i],
                   packed.widths[i], packed.name_of(i), i, boxes, blob)
    skipped = [{"path": s.path, "error": s.error, **({"label": True} if s.label else {})}
               for s in packed.known_skipped]
    images = [s for s in skipped if "label" not in s]  # bad labels: said when read
    if images:  # a run over these shards lists them in its skipped_files too
        log.warning("%d file(s) could not be read and are not in the shards (e.g. %s): "
                    "listed under \"skipped\" in the shards' %s", len(images),
                    images[0]["path"], MANIFEST)
    return write_manifest(out, writer.close(), packed.classes, skipped=skipped, **facts)


def _packed_facts(packed: PackedStorage, shard_bytes: int,
                  seed: int = DEFAULT_SHUFFLE_SEED) -> dict[str, Any]:
    spec = packed.spec
    facts = {"store_size": spec.store_size, "store_side": spec.side.value,
             "store_quality": spec.quality, "shard_bytes": shard_bytes,
             "shuffle": {"seed": seed},
             "packed": {"folder": packed.cache.name, "data_bytes": packed.data_bytes,
                        "count": len(packed)}}
    if packed.targets is not None:  # detection: the boxes the shards hold
        facts["targets"] = packed.targets.format
        if packed.targets.category_ids is not None:  # COCO's own ids, for served detections
            facts["category_ids"] = packed.targets.category_ids
        facts["packed"]["targets"] = packed.targets_digest
    if isinstance(packed.targets, StoredBlobs):  # the kind whose blobs the shards hold
        facts["blobs"] = packed.targets.kind.value
    return facts


def convert_to_shards(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
                      progress: bool = True, shard_bytes: int = DEFAULT_SHARD_BYTES,
                      seed: int = DEFAULT_SHUFFLE_SEED) -> Path:
    """The cached shards of the image folder at ``path`` (packed, then written as shards,
    once; again when the packed store or the seed of their order changed)."""
    with contextlib.closing(open_packed(loader, dataset, path, progress)) as packed:
        facts = _packed_facts(packed, shard_bytes, seed)
        out = Path(dataset.cache_dir).expanduser() / "shards" / "local" / \
            f"{packed.cache.name}-{shard_bytes >> 20}MiB"
        out.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(out) + ".lock"):
            try:
                meta = json.loads((out / MANIFEST).read_text())
            except (OSError, ValueError):
                meta = None
            if meta is None or any(meta.get(k) != facts[k] for k in ("packed", "shuffle")):
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
    from runner.data.sources.files import open_files

    files = open_files(dataset, text)  # the store's objects, listed (StoreFiles)
    listing = files.listing
    stage = cache_folder(dataset, "staging", f"{text}|{dataset.endpoint_url}")
    done = stage / "manifest.csv"
    if done.is_file():
        return done
    rows = []
    futures = [(files.name_of(i), label, files.engine.get(files.keys[i]))
               for i, (_, label) in enumerate(listing.samples)]
    for name, label, future in futures:
        target = stage / "files" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(bytes(future.result()))
        rows.append((f"files/{name}", listing.classes[label] if label >= 0 else ""))
    files.close()
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
                 shard_mb: str | None = None, shuffle_seed: str | None = None) -> Path | str:
    """``python -m runner.prepare shards dataset.path=<folder, manifest or URL>
    out=<folder or URL> [shard_mb=64] [shuffle_seed=0]``: the packed store of the images
    written as shards at ``out`` (unset: the cache, where ``loader=shards`` finds them), in
    the shuffled order of ``shuffle_seed``."""
    import dataclasses

    shard_bytes = int(float(shard_mb) * (1 << 20)) if shard_mb else DEFAULT_SHARD_BYTES
    if shard_bytes < 1 << 12:
        raise CacheError(f"shard_mb={shard_mb} is too small: give at least 0.004 (4 KiB; "
                         "64 is the usual size)")
    seed = DEFAULT_SHUFFLE_SEED
    if shuffle_seed is not None:
        if not shuffle_seed.isdigit():
            raise CacheError(f"shuffle_seed={shuffle_seed} is invalid: give a whole number "
                             "0 or more (the seed of the order the shards are written in)")
        seed = int(shuffle_seed)
    if is_url(path):
        path = stage_remote(dataset, str(path))
        dataset = dataclasses.replace(dataset, path=None, manifest=str(path))
    if out is None:
        return convert_to_shards(loader, dataset, Path(path), progress, shard_bytes, seed)
    if rebuild:
        build_packed(loader, dataset, Path(path), progress, rebuild=True)
    with contextlib.closing(open_packed(loader, dataset, Path(path), progress)) as packed:
        return _write_out(packed, out, dataset, shard_bytes, seed)


def _write_out(packed: PackedStorage, out: str | Path, dataset: DatasetConfig,
               shard_bytes: int, seed: int = DEFAULT_SHUFFLE_SEED) -> str | Path:
    """``packed`` as shards at ``out``: a local folder, or a URL (written locally first)."""
    facts = _packed_facts(packed, shard_bytes, seed)
    if not is_url(out):
        target = Path(out).expanduser()
        write_packed_as_shards(packed, target, shard_bytes, facts)
        return target
    from runner.data.sources.objectstore import check_bucket_writable

    url = RemoteURL.parse(out)
    store = check_bucket_writable(out, dataset.endpoint_url)
    with tempfile.TemporaryDirectory(dir=Path(dataset.cache_dir).expanduser()) as tmp:
        manifest = write_packed_as_shards(packed, Path(tmp), shard_bytes, facts)
        for shard in manifest[SHARD_LIST]:  # the manifest last: a reader sees all or none
            store.put_file(url.key(shard["name"]), str(Path(tmp) / shard["name"]))
            store.put_file(url.key(shard["index"]), str(Path(tmp) / shard["index"]))
        store.put_file(url.key(MANIFEST), str(Path(tmp) / MANIFEST))
    return out


