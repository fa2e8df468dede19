"""``loader=ram``: every image decoded once into one contiguous uint8 tensor in memory.

The tensor lives in shared memory, so DataLoader workers map it instead of copying it, and
is read from the memmap cache when one is valid for this dataset (the whole folder, its
files opened once as memmap.py's readers open them, the split's slots served), else the
images the run reads are decoded straight into memory with every core. It is never page-locked as a whole: the batched path gathers
into pinned batch buffers already (runner/data/loading/buffers.py), and pinning the dataset would take
it out of shared memory, give every rank its own copy and, through the caching host
allocator's power-of-two rounding, pin up to twice its size. A dataset that does not fit is
refused before anything is loaded.

A detection set's boxes come the same way: the memmap store's side store read into memory
(runner/data/storage/memmap.py), or each decoded image's boxes gathered into an in-memory
``RaggedBoxes`` (runner/data/storage/decoded.py) as the images are decoded; a per-pixel
target's plane (masks) too: the memmap store's plane file read into shared memory, or each
image's target decoded into a plane in shared memory beside it.
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
from pathlib import Path

import torch
from tqdm import tqdm

from runner.config.schema import DatasetConfig, LoaderConfig, StorageName
from runner.data.decode.decoders import CPU_DECODERS
from runner.data.protocol import StorageKind, image_nbytes, shared_empty
from runner.data.sources.listing import DatasetError
from runner.data.storage.convert import check_skipped, chunk_ranges, skipped_files, valid_cache
from runner.data.storage.decoded import DecodedStorage
from runner.data.storage.folder import FolderStorage
from runner.data.storage.memmap import (
    MemmapSpec,
    box_room,
    build_memmap,
    decode_into,
    decoding_folder,
    image_shape,
    memmap_spec,
    pin_store,
    plane_nbytes,
    raw_footprint,
    split_slots,
    with_label_skips,
)

log = logging.getLogger(__name__)

GiB = 1024**3


def memory_available() -> int:
    """Bytes this process can still allocate: the least of what the kernel says can be
    allocated without swapping (MemAvailable), what its cgroup's limit leaves (a container's
    or a SLURM job's memory), and what ``ulimit -v`` (RLIMIT_AS) leaves of its address
    space. Each limit is one an allocation fails against (a batch the machine holds but the
    job may not fails in the allocator, or the OOM killer takes the job)."""
    bounds = [_meminfo_available(), _cgroup_left(), _address_space_left()]
    return min(b for b in bounds if b is not None)


def _meminfo_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _cgroup_left(root: str = "/sys/fs/cgroup") -> int | None:
    """The bytes this process's memory cgroup lets it add (None: no limit, or none found).
    Page cache counts in a cgroup's usage but is given back under pressure: the inactive
    file pages are added back (v2's ``inactive_file``, v1's ``total_inactive_file``)."""
    v2 = ("memory.max", "memory.current", "inactive_file")
    v1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    candidates = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:  # "0::/path" (v2) or "4:memory:/path" (v1)
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            candidates.append((Path(root) / path.lstrip("/"), v2))
        elif "memory" in controllers.split(","):
            candidates.append((Path(root) / "memory" / path.lstrip("/"), v1))
    # inside a container's cgroup namespace the mount's root is the process's own cgroup
    candidates += [(Path(root), v2), (Path(root) / "memory", v1)]
    for folder, (limit_name, usage_name, inactive) in candidates:
        try:
            limit = (folder / limit_name).read_text().strip()
            usage = int((folder / usage_name).read_text())
        except (OSError, ValueError):
            continue
        if not limit.isdigit() or int(limit) >= 1 << 60:  # "max", or v1's "no limit"
            return None
        reclaimable = _read_stat(folder / "memory.stat").get(inactive, 0)
        return max(0, int(limit) - usage + reclaimable)
    return None


def _read_stat(path: Path) -> dict[str, int]:
    try:
        return {k: int(v) for k, v in (line.split() for line in path.read_text().splitlines())}
    except (OSError, ValueError):
        return {}


def _address_space_left() -> int | None:
    """What ``ulimit -v`` leaves of this process's address space (None: unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        size = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        size = 0
    return max(0, soft - size)


SHM = "/dev/shm"  # where torch's shared memory lives (shm_open)


def shm_free() -> int | None:
    """Free bytes in the shared-memory filesystem (None: there is none to ask)."""
    try:
        return shutil.disk_usage(SHM).free
    except OSError:
        return None


def check_fits(nbytes: int, count: int, shape: tuple[int, ...]) -> None:
    """Refuse, before loading anything, a dataset that RAM or /dev/shm cannot hold."""
    available = memory_available()
    what = f"{nbytes / GiB:.2f} GiB for {count:,} images of {'x'.join(map(str, shape))} uint8"
    if nbytes > 0.9 * available:
        raise DatasetError(
            f"loader=ram needs {what}, but only {available / GiB:.1f} GiB of memory "
            "is available; use loader=memmap (reads a memory-mapped file instead), or a "
            "smaller dataset.image_size"
        )
    shm = shm_free()
    if shm is not None and nbytes > shm:
        raise DatasetError(
            f"loader=ram needs {what} of shared memory, but {SHM} has only {shm / GiB:.2f} GiB "
            "free (a container's default is 64 MB): start the container with a larger "
            "--shm-size (docker run --shm-size=16g), or use loader=memmap"
        )


def open_ram(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
             progress: bool = True) -> DecodedStorage:
    """The folder at ``path`` decoded once into memory (read from its memmap store if
    valid), serving the side of ``dataset.val_fraction``'s split the run reads."""
    folder = decoding_folder(loader, dataset, path, progress)
    return load_ram(folder, memmap_spec(loader, dataset, path, folder),
                    Path(dataset.cache_dir), progress,
                    keep=split_slots(dataset, folder)).serving(dataset)


def load_ram(folder_storage: FolderStorage, spec: MemmapSpec, cache_root: Path,
             progress: bool = True, keep: list[int] | None = None) -> DecodedStorage:
    """The dataset as a DecodedStorage whose images live in shared memory; ``keep``: the
    slots of ``folder_storage`` it serves (None: all). A valid memmap store (the whole
    folder) is read whole; without one, only the slots kept are decoded."""
    folder = spec.folder(cache_root)
    pinned = pin_store(lambda: _valid(folder, spec, folder_storage), spec)
    if pinned is not None:
        count = len(folder_storage)
        shape = image_shape(count, spec.image_size)
        check_fits(count * (image_nbytes(spec.image_size) + plane_bytes(spec)), count, shape[1:])
        check_skipped(pinned.meta, folder_storage)
        images = shared_empty(shape, torch.uint8)
        planes = {key: shared_empty(plane.shape, plane.dtype)
                  for key, plane in pinned.map_planes().items()}
        with pinned.images:
            _read_file(pinned.images_path, images, progress)
            for key, plane in planes.items():
                _read_file(pinned.plane_path(key), plane, progress)
        pinned.close_planes()
        storage = DecodedStorage(images, pinned.labels, skipped=skipped_files(pinned.meta),
                                 classes=folder_storage.classes,
                                 names=folder_storage.names(), root=folder_storage.root,
                                 keep=keep, boxes=pinned.boxes, planes=planes)
        return with_label_skips(storage, folder_storage)
    whole = folder_storage
    if keep is not None:  # the split's side alone, as a folder of it would list it
        kept = FolderStorage.__new__(FolderStorage)  # decode_into reads local files
        kept._serve(folder_storage, keep, [])
        if folder_storage.targets is not None:  # and their boxes
            kept.targets = folder_storage.targets.subset(keep)
        folder_storage = kept
    count = len(folder_storage)
    shape = image_shape(count, spec.image_size)
    check_fits(count * (image_nbytes(spec.image_size) + plane_bytes(spec)), count, shape[1:])
    images = shared_empty(shape, torch.uint8)
    boxes = box_room(folder_storage)
    planes = {} if spec.plane is None else {  # a per-pixel target, decoded with the pixels
        spec.plane.key: shared_empty((count, *spec.image_size), spec.plane.dtype)}
    log.info("no memmap cache for %s: decoding %d images into memory", spec.source, count)
    skipped = decode_into(images, folder_storage, chunk_ranges(count), progress, boxes=boxes,
                          planes=planes)
    storage = DecodedStorage(images, folder_storage.label_tensor(), skipped=skipped,
                             classes=folder_storage.classes, names=folder_storage.names(),
                             root=folder_storage.root, boxes=boxes, planes=planes)
    return with_label_skips(storage, whole, folder_storage)


def plane_bytes(spec: MemmapSpec) -> int:
    """Bytes of one image's per-pixel target plane (0: none)."""
    return 0 if spec.plane is None else plane_nbytes(1, spec.image_size, spec.plane.dtype)


def _valid(folder: Path, spec: MemmapSpec, source: FolderStorage
           ) -> tuple[Path, dict] | None:
    meta = valid_cache(folder, spec, source)
    return None if meta is None else (folder, meta)


def _read_file(path: Path, images: torch.Tensor, progress: bool) -> None:
    """Read a cache file (the images, a plane) straight into the tensor's memory, in 64 MiB
    pieces."""
    view = memoryview(images.numpy()).cast("B")
    step = 64 * 1024 * 1024
    with open(path, "rb", buffering=0) as f, tqdm(total=len(view), unit="B", unit_scale=True,
                                                  desc="loading into RAM",
                                                  disable=not progress) as bar:
        for start in range(0, len(view), step):
            got = f.readinto(view[start : start + step])
            if got != min(step, len(view) - start):
                raise DatasetError(f"{path} ended early while loading it into RAM")
            bar.update(got)


KIND = StorageKind(
    name=StorageName.ram,
    open=open_ram,
    storage=DecodedStorage,
    summary="decoded once into one uint8 tensor in shared memory; each batch is one "
            "indexed read",
    decoders=CPU_DECODERS,
    knobs=("loader.shuffle_block",),
    bench={"ram": ("loader=ram",)},
    build=build_memmap,  # it loads the memmap store when there is one
    footprint=raw_footprint,
    speed_rank=0,
    boxes=True,  # a ragged side store beside the images, moved by the device's crops
    masks=True,  # a uint8 plane beside the images, moved by the device's crops
)
