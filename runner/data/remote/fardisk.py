"""Local paths on a far disk (a network mount: NFS, SMB, an rclone or s3fs FUSE mount): read
through the read engine, many files in flight, not one blocking read per decode thread.

A file on such a disk costs a network round trip to open and read (5-50 ms), not a local
disk's 0.1 ms: with one blocking read per decode thread, two threads read 40-400 images/s
whatever the decoder does. ``is_far`` tells such a folder by timing a few whole-file reads
spread over the listing (``FAR_READ_SECONDS``: a local disk, even cold, reads a small
image well under it) and names the file system from ``/proc/self/mountinfo`` for the log.
``dataset.far_disk=true|false`` decides instead of the probe.

A far folder is then read as a folder in a store is (``RemoteFolderStorage``): obstore's
``LocalStore`` behind the same ``ReadEngine``, whose window settles at rate x round trip
(the engine's docstring); obstore runs each read on its own blocking-I/O threads, off the
GIL, so hundreds can be in flight.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

FAR_READ_SECONDS = 0.002  # median whole-file read above which a folder is on a far disk
PROBE_FILES = 8


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


def read_seconds(paths: list[str]) -> float:
    """The median seconds to open and read one of ``paths`` whole (up to PROBE_FILES of
    them, spread over the list), or 0.0 when none could be read."""
    step = max(1, len(paths) // PROBE_FILES)
    times = []
    for path in paths[::step][:PROBE_FILES]:
        t0 = time.perf_counter()
        try:
            with open(path, "rb", buffering=0) as f:
                while f.read(1 << 20):
                    pass
        except OSError:
            continue
        times.append(time.perf_counter() - t0)
    return statistics.median(times) if times else 0.0


def is_far(paths: list[str], setting: bool | None) -> tuple[bool, str]:
    """Whether ``paths`` (a folder's images) are on a far disk, and the reason in words:
    ``setting`` (``dataset.far_disk``) when given, else the probe."""
    where = filesystem_of(paths[0]) if paths else ""
    on = f" ({where})" if where else ""
    if setting is not None:
        return setting, f"dataset.far_disk={str(setting).lower()}{on}"
    seconds = read_seconds(paths)
    far = seconds >= FAR_READ_SECONDS
    return far, (f"a file reads in {seconds * 1000:.1f} ms{on}: "
                 + ("a far disk" if far else "a local disk"))
