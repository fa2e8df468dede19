"""Local paths on a far disk (a network mount: NFS, SMB, an rclone or s3fs FUSE mount): read
through the read engine, many files in flight, not one blocking read per decode thread.

A file on such a disk costs a network round trip to open and read (5-50 ms), not a local
disk's 0.1 ms: with one blocking read per decode thread, two threads read 40-400 images/s
whatever the decoder does. ``is_far`` tells such a folder by timing a few whole-file reads
spread over the listing (``FAR_READ_SECONDS``: a local disk, even cold, reads a small
image well under it) and names the file system from ``/proc/self/mountinfo`` for the log;
a file system of the machine's own (``LOCAL_FILESYSTEMS``: ext4, xfs, tmpfs, overlay, ...)
is local without a probe.
``dataset.far_disk=true|false`` decides instead of the probe. A packed store (one large
file, ``loader=packed``) is told the same way, by timing ``pread``s of a few of its images.

A far folder is then read as a folder in a store is (``FarFiles``, files.py): obstore's
``LocalStore`` behind the same ``ReadEngine``, whose window settles at rate x round trip
(the engine's docstring); obstore runs each read on its own blocking-I/O threads, off the
GIL, so hundreds can be in flight. A far packed store is read the same way: each coming batch's
images as ranges of its one file (adjacent ones merged into one read), many in flight
(``PackedStorage.read_through``).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

FAR_READ_SECONDS = 0.002  # median whole-file read above which a folder is on a far disk
PROBE_FILES = 8
READAHEAD = 1 << 20  # bytes around a probed image evicted first (the kernel's readahead)


def filesystem_of(path: str | Path) -> str:
    """The file system type of the mount holding ``path`` (``nfs4``, ``fuse.rclone``,
    ``ext4``, ...; "" where /proc/self/mountinfo is not there)."""
    target = os.path.realpath(path)
    best, kind = "", ""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        mount = fields[4].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, right.split()[0]
    return kind


def spread(items: Sequence[T]) -> Sequence[T]:
    """Up to PROBE_FILES of ``items``, spread evenly over them: what a probe times."""
    return items[::max(1, len(items) // PROBE_FILES)][:PROBE_FILES]


def read_seconds(paths: list[str]) -> float:
    """The median seconds to open and read one of ``paths`` whole (``spread`` over the
    list), or 0.0 when none could be read."""
    times = []
    for path in spread(paths):
        t0 = time.perf_counter()
        try:
            with open(path, "rb", buffering=0) as f:
                while f.read(1 << 20):
                    pass
        except OSError:
            continue
        times.append(time.perf_counter() - t0)
    return statistics.median(times) if times else 0.0


def pread_seconds(path: str | Path, spans: list[tuple[int, int]]) -> float:
    """The median seconds of one ``pread`` of each of ``spans`` (offset, size; ``spread``
    over the list) from the file ``path``, or 0.0."""
    times = []
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return 0.0
    try:
        for offset, size in spread(spans):
            if hasattr(os, "posix_fadvise"):  # from the disk, not the page cache (nor
                # the kernel's readahead of an image before): only around this image
                start = max(0, offset - READAHEAD)
                os.posix_fadvise(fd, start, offset + size + READAHEAD - start,
                                 os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            os.pread(fd, size, offset)
            times.append(time.perf_counter() - t0)
    except OSError:
        pass
    finally:
        os.close(fd)
    return statistics.median(times) if times else 0.0


# file systems on this machine's own disks or memory: never far, and never probed (a probe
# of a packed store evicts the pages around the images it times)
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "bcachefs",
                               "tmpfs", "ramfs", "overlay", "squashfs", "vfat", "exfat",
                               "ntfs3"})


def is_far(paths: list[str], setting: bool | None,
           spans: list[tuple[int, int]] | None = None) -> tuple[bool, str]:
    """Whether ``paths`` (a folder's images; with ``spans``, the one file holding them at
    those offsets and sizes) are on a far disk, and the reason in words: ``setting``
    (``dataset.far_disk``) when given, else the probe."""
    where = filesystem_of(paths[0]) if paths else ""
    on = f" ({where})" if where else ""
    if setting is not None:
        return setting, f"dataset.far_disk={str(setting).lower()}{on}"
    if where in LOCAL_FILESYSTEMS:
        return False, f"{where}: a local disk"
    seconds = read_seconds(paths) if spans is None else pread_seconds(paths[0], spans)
    far = seconds >= FAR_READ_SECONDS
    what = "a file" if spans is None else "an image"
    return far, (f"{what} reads in {seconds * 1000:.1f} ms{on}: "
                 + ("a far disk" if far else "a local disk"))
