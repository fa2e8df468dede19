"""``loader=`` storages: where batches come from (the ``Storage`` protocol, runner/data/protocol.py).

Each storage is one module named after its ``loader.name``, ``runner/data/storage/<name>.py``,
which defines its registry record ``KIND`` (a ``StorageKind``: how to open it and what
callers need to know about it: does it decode every epoch, which decoders and knobs it
takes, its own loader, its advice, its bench rows, the store it converts to). ``STORAGES``
maps every ``StorageName`` to its record, found in its module: a new storage is its enum
value, its preset ``conf/loader/<name>.yaml`` and its module.

folder decodes every image on every epoch; memmap and ram decode once (memmap.py, ram.py)
and then serve batches by indexed reads of one uint8 tensor (decoded.py); packed re-encodes
once at a stored size into one file and decodes per epoch (packed.py); dali and ffcv run
the rivals' own pipelines (rival.py); shards holds packed's JPEGs in WebDataset tars
(shards.py). The stores built once share one engine (convert.py). user is no folder's: the
torch Dataset ``dataset.target=module:function`` returns, which replaces ``loader=``
(user.py; its record says ``reads_path=False``).

**One crop, every storage.** ``dataset.crop=center`` takes the centred
``dataset.crop_fraction`` of the shorter side (default 0.875, "resize 256, crop 224", what
ImageNet models are evaluated with; 1.0 keeps the whole side) on every storage, rivals
included. Packed stores at 256 for 224 by default, so its centre crop is a window of the
stored JPEG with no resize. With ``dataset.crop=random`` the runner's own storages draw each
image's crop from the same per-image seed (DALI and FFCV draw theirs): folder, packed and
shards decode it; memmap and ram cut it from the stored image per batch on the device
(runner/data/decode/crops.py). ``dataset.store_size=256`` stores memmap and ram images larger
than the output so those crops have pixels to choose from, and one store then serves
centre and random crops; at the output size, the centre crop and the whole side are two
stores. ``dataset.crop=letterbox`` (the detectors' default: the whole image, aspect kept,
padded with grey 114) is decoded so by folder, packed and shards, and stored so by memmap
and ram (at ``dataset.image_size``: with ``dataset.store_size`` refused in one line); DALI
and FFCV have no letterbox and say so (runner/data/decode/decoders.py: ``letterbox_place``).

**Targets beside the label** (``dataset.targets``: boxes, masks) go where the pixels go:
a storage's record says which kinds it carries (``StorageKind.carries``). A store keeps
each image's target as its kind's record makes it: boxes in their own arrays, any other
kind (masks) as an opaque blob beside the stored image (``TargetKind.to_blob`` and
``from_blob``: packed's ``blobs.bin``, shards' ``<key>.<blob_ext>`` member), moved through
the crop by the kind's ``sample_fields`` as on a folder; the store's key names the kind
and its plan the kind's ``fingerprint``, so an edited label or mask rebuilds it. memmap
and ram keep a per-pixel target (masks) decoded, as a plane beside their images at the
stored size (``TargetKind.plane``: its key and dtype, decoded.py), cut, resized and
flipped on the device with the pixels by the kind's ``follow``.

``loader.decoder=auto`` (the folder's default) picks the region decoder when its
binding is built, else simplejpeg with DCT scaling; the run's ``metrics.json`` names the
one that ran. How fast each storage is here: ``python -m runner.bench stores`` (figures
depend on the machine, so they live in the bench's output, not in the docs).
"""

from __future__ import annotations

import os
from pathlib import Path

from runner.common.errors import ConfigError
from runner.common.registry import Registry
from runner.config.schema import Crop, DatasetConfig, Decoder, LoaderConfig, StorageName, TargetName
from runner.data.decode.decoders import DECODERS, concrete_decoder
from runner.data.protocol import Storage, StorageKind
from runner.data.sources.listing import EXTENSIONS, check_no_loop, check_path_exists, is_image_name
from runner.data.sources.synthetic import SyntheticSpec, ensure_dataset
from runner.data.sources.url import is_url
from runner.data.storage.tarformat import MANIFEST
from runner.data.targets import TARGETS

STORAGES: Registry[StorageKind] = Registry.from_modules(__name__, StorageName, "loader={}",
                                                      StorageKind)


def resolve_dataset(cfg: DatasetConfig, progress: bool = True) -> Path | str:
    """``dataset.manifest`` or ``dataset.path``, or the generated default dataset (made
    once, then reused). A URL (runner/data/sources/) stays a string, checked readable now
    with one request (a RemoteError naming it and what to set, before any work)."""
    for key in ("manifest", "path"):
        value = getattr(cfg, key)
        if is_url(value):
            from runner.data.sources.objectstore import check_url
            from runner.data.sources.remote_listing import is_manifest
            from runner.data.sources.url import RemoteURL

            check_url(value, cfg.endpoint_url, is_file=is_manifest(RemoteURL.parse(value)))
            return value
    if cfg.manifest is not None:
        check_no_loop(Path(cfg.manifest).expanduser(), "dataset.manifest")
        return Path(cfg.manifest).expanduser()
    if cfg.path is not None:
        check_no_loop(Path(cfg.path).expanduser(), "dataset.path")
        return Path(cfg.path).expanduser()
    generated = TARGETS[cfg.targets.kind].default_path  # its kind's own: boxes known
    if generated is not None:
        return generated(cfg, progress)
    spec = SyntheticSpec(cfg.num_images, cfg.num_classes, *cfg.source_size, quality=cfg.quality)
    return ensure_dataset(spec, cfg.cache_dir, progress=progress)


def check_dataset_found(cfg: DatasetConfig) -> None:
    """A ConfigError, before any work (``python -m runner`` calls it before its run folder is
    made), for a local ``dataset.path`` or ``dataset.val_path`` that does not exist or is a
    folder with no image (nor shard) in it or below it, and a ``dataset.manifest`` that is
    not there; a ``dataset.target`` whose module or function is not there. Cheap: the walk
    stops at the first image. URLs are not probed here."""
    if cfg.target is not None:
        from runner.data.storage.user import check_target

        check_target(cfg.target)
    for key in ("path", "val_path", "manifest"):
        value = getattr(cfg, key)
        if value is None or is_url(value):
            continue
        where = check_path_exists(key, value)
        if key != "manifest" and where.is_dir() and not holds_images(where):
            raise ConfigError(f"dataset.{key}={value!r} holds no images ({' '.join(EXTENSIONS)}) "
                              "in it or its sub-folders: point it at your image folder (one "
                              "sub-folder per class, or the images themselves)")


def holds_images(folder: Path) -> bool:
    """Whether ``folder`` or a folder below it holds an image or a shard set (a walk that
    stops at the first; links followed, each real folder once)."""
    seen: set[str] = set()
    for top, dirs, files in os.walk(folder, followlinks=True):
        real = os.path.realpath(top)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        if any(is_image_name(f) or f.endswith(".tar") or f == MANIFEST for f in files):
            return True
        dirs.sort()
    return False


def unset_draft(decoder: Decoder) -> bool:
    """What an unset ``loader.draft`` means with ``loader.decoder=decoder``: on only where
    ``auto`` falls back to a decoder that scales (simplejpeg: the pair auto stands for; the
    region decoder crops instead), off for a decoder named."""
    return decoder is Decoder.auto and DECODERS[concrete_decoder(decoder)].scales


def settle_loader(loader: LoaderConfig, dataset: DatasetConfig | None = None) -> None:
    """Settle ``loader`` in place, then check it: ``loader.decoder=auto`` becomes the decoder
    it runs (so the run's config and metrics name it), an unset ``loader.draft`` true or
    false; a ConfigError naming the fix when ``loader.decoder`` is not one ``loader=``
    takes. ``dataset.target`` (the user's own Dataset, user.py) replaces ``loader=``: the
    storage becomes ``loader=user`` (its log line says what else does not apply)."""
    if dataset is not None:
        settle_user(loader, dataset)
    if loader.draft is None:
        loader.draft = unset_draft(loader.decoder)
    loader.decoder = concrete_decoder(loader.decoder)
    kind = STORAGES[loader.name]
    target = dataset.targets.kind if dataset is not None else TargetName.classes
    if TARGETS[target].batch_keys:  # a target beside the label: boxes, masks
        given = f"dataset.targets={dataset.targets.value}"
        if not kind.carries(target):
            carry = " and ".join(f"loader={k.name.value}" for k in STORAGES.values()
                                 if k.carries(target)) or "no storage"
            raise ConfigError(f"{given} carries {target.value} through {carry} so far, not "
                              f"loader={loader.name.value}: use one of them")
        if is_url(dataset.path) and kind.build is None:  # a store holds its own boxes
            how = "".join(
                f", or write it as loader={k.name.value}'s store, which holds the boxes "
                f"(python -m runner.prepare {k.name.value} {given} dataset.path=<local "
                f"folder> out=<URL>), and read that with loader={k.name.value}"
                for k in STORAGES.values()
                if k.carries(target) and k.urls and k.build is not None and "out" in k.build_options)
            raise ConfigError(f"{given} reads labels from a local folder, not dataset.path="
                              f"{dataset.path}: copy the dataset to a local folder{how}")
        if DECODERS[loader.decoder].cuda:
            raise ConfigError(f"{given} maps boxes through the CPU decoders' crops, not "
                              f"loader.decoder={loader.decoder.value}: use a CPU decoder "
                              "(loader.decoder=auto)")
    if loader.group_aspect and not kind.decodes_per_epoch:
        # a letterbox stored square could be cut to a bin's shape on the device; not done
        raise ConfigError(f"loader.group_aspect=true with loader={loader.name.value}: its "
                          "images are decoded once at the square dataset.image_size, so its "
                          "batches cannot take each aspect bin's shape; use loader=folder or "
                          "packed (decoded every epoch)")
    if dataset is not None and dataset.crop is Crop.letterbox and DECODERS[loader.decoder].cuda:
        # (its batched resample of mixed sizes fills the output: no pads)
        raise ConfigError(f"loader.decoder={loader.decoder.value} has no "
                          "dataset.crop=letterbox: use a CPU decoder (loader.decoder=auto)")
    if loader.decoder not in kind.decoders:
        takes = ", ".join(sorted(d.value for d in kind.decoders))
        why = (" (it decodes on the GPU, every epoch)" if DECODERS[loader.decoder].cuda
               else "")
        raise ConfigError(f"loader.decoder={loader.decoder.value} is invalid for "
                          f"loader={loader.name.value}{why}: it takes {takes}")


def settle_user(loader: LoaderConfig, dataset: DatasetConfig) -> None:
    """``dataset.target`` makes the storage the user's Dataset (``loader=user``, decoded by
    nothing of the runner's); ``loader=user`` without it, or with a key of an image folder
    it replaces, is a ConfigError naming the fix."""
    user = StorageName.user
    if dataset.target is None:
        if loader.name is user:
            raise ConfigError("loader=user reads the Dataset dataset.target names: set "
                              "dataset.target=module:function (with module.py in the current "
                              "folder), or choose another loader=")
        return
    for key in ("path", "manifest"):
        if getattr(dataset, key) is not None:
            raise ConfigError(f"dataset.target={dataset.target} replaces dataset.{key}="
                              f"{getattr(dataset, key)}: give one of them, not both")
    if dataset.val_fraction > 0:
        raise ConfigError(f"dataset.val_fraction={dataset.val_fraction} splits an image folder "
                          f"and does not apply to dataset.target={dataset.target}: hold out "
                          "your own split in your Dataset, or validate on an image folder of "
                          "the same classes with dataset.val_path=<folder>")
    loader.name, loader.decoder, loader.draft = user, Decoder.pil, False


def build_storage(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
                  progress: bool = True, needed: int | None = None) -> Storage:
    """The storage ``loader.name`` asks for, over the image folder at ``path`` (a URL:
    only storages whose record says ``urls`` read one); ``needed``: the items the run's
    steps read, for a storage that ``counts_items``."""
    kind = STORAGES[loader.name]
    if is_url(path) and not kind.urls:
        readers = " or ".join(f"loader={k.name.value}" for k in STORAGES.values() if k.urls)
        raise ConfigError(f"loader={loader.name.value} reads local folders only, and "
                          f"dataset.path is the URL {path}: use {readers} (python -m "
                          "runner.prepare shards ... out=<folder or URL> writes shards), or "
                          "copy the data to a local folder")
    if is_url(path) and loader.num_workers > 0 and not kind.own_loader:
        # the client's runtime (obstore's, in Rust) does not survive a fork (a rival's own
        # pipeline fetches in its workers its own way)
        raise ConfigError(f"loader.num_workers={loader.num_workers} forks DataLoader workers, "
                          f"and reading dataset.path={path} does not survive a fork: use "
                          "loader.num_workers=0 (decode threads, one per core; the fetches "
                          "run on an I/O thread of their own)")
    if kind.counts_items:
        return kind.open(loader, dataset, path, progress, needed=needed)
    return kind.open(loader, dataset, path, progress)


def decoded_once() -> list[StorageKind]:
    """The storages that decode once (and the runner's loaders read)."""
    return [k for k in STORAGES.values() if not k.decodes_per_epoch and not k.own_loader]


def choices(kinds: list[StorageKind]) -> str:
    """``loader=memmap or loader=ram``."""
    return " or ".join(f"loader={k.name.value}" for k in kinds)


def advice(stage: str, loader: LoaderConfig) -> str | None:
    """What to try when ``stage`` of a data path with ``loader`` limits a run, leaving out
    what it already does; None for a stage that is not the storage's."""
    kind, once = STORAGES[loader.name], choices(decoded_once())
    if stage in kind.advice and stage != "decode":  # e.g. a rival's own pipeline
        return kind.advice[stage]
    if stage == "decode":
        tries = [f"{once} (decode once)"]
        if "decode" in kind.advice:
            tries.append(kind.advice["decode"])
        region = [d for d, k in DECODERS.items() if k.region and d in kind.decoders]
        if region and not DECODERS[loader.decoder].region:
            tries.append(f"loader.decoder={region[0].value} (decodes only the crop)")
        if not loader.draft and DECODERS[loader.decoder].scales:
            tries.append("loader.draft=true")
        cores = len(os.sched_getaffinity(0))
        if loader.num_workers > cores:  # more would only preempt each other: more cores
            tries.append("more cores (the workers already fill them)")
        else:
            tries.append("more loader.num_workers" if loader.num_workers > 0
                         else "more loader.decode_threads (more cores)")
        return "try " + ", ".join(tries[:-1]) + " or " + tries[-1]
    return {
        "read": f"try {once}, a warm page cache, smaller files (re-encoded JPEGs) or faster "
                "storage",
        "storage": f"the disk, not decode, is the limit: try {once}, a warm page cache "
                   "(dataset.page_cache=warm), smaller files (python -m runner.prepare "
                   "reencode --quality 75) or faster storage",
        "collate": f"try loader.batched=true (one call per batch) or {once}",
        "gather": "a batched gather is a memory copy already; only fewer bytes per image "
                  "(a smaller dataset.image_size) or a model that keeps up will change this",
    }.get(stage)
