"""The storage tier a path lives on: NVMe, SATA/SAS SSD, HDD, a virtual machine's disk, a
network filesystem, tmpfs, FUSE or an object store (metrics.json's ``storage_tier``, beside
the read ceiling the verdict measures: runner/job/diagnose.py).

A URL (``s3://``, ``gs://``, ``https://``) is an object store. A local path is looked up in
the mount table (/proc/self/mountinfo: the mount with the longest mount point above it):
its filesystem type says network (nfs, cifs, ceph, lustre, ...), tmpfs or FUSE
(``fuse.gcsfuse``, ``fuse.s3fs``...: an object store mounted as files say so by their
name); an overlay (a container's root) is followed to its upper directory. A block
filesystem's device (``st_dev``) is found in /sys/dev/block, a partition's disk above it,
and the disk's name and ``queue/rotational`` say nvme, ssd or hdd; a virtio/Xen disk
(``vd*``, ``xvd*``) is a hypervisor's, whose rotational flag says nothing of the medium
under it. Where nothing can be read (not Linux): ``unknown``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre", "gpfs",
              "beegfs", "orangefs", "afs", "9p", "virtiofs", "davfs", "wekafs"}
MEMORY_FS = {"tmpfs", "ramfs"}
OBJECT_FUSE = ("gcsfuse", "s3fs", "goofys", "mountpoint-s3", "rclone", "blobfuse",
               "juicefs", "alluxio")
# what to expect of each tier, for the verdict's sentence
TIERS = {
    "nvme": "NVMe SSD",
    "ssd": "SATA/SAS SSD",
    "hdd": "spinning disk (HDD): random reads cost a seek each",
    "virtual": "a virtual machine's disk (its medium and limits are the host's)",
    "network": "network filesystem: each read pays a round trip",
    "tmpfs": "memory (tmpfs)",
    "fuse": "a FUSE filesystem: each read crosses to a user-space daemon",
    "object store": "object store: each read is a request",
    "unknown": "unknown",
}


def mounts(text: str | None = None) -> list[tuple[str, str, str, str, str]]:
    """(mount point, fstype, source, device major:minor, super options) per line of
    /proc/self/mountinfo (``text``: its content, for tests)."""
    if text is None:
        try:
            text = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return []
    out = []
    for line in text.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(rest) < 2:
            continue
        point = fields[4].replace("\\040", " ")
        out.append((point, rest[0], rest[1], fields[2], rest[2] if len(rest) > 2 else ""))
    return out


def mount_of(path: str, table: list[tuple[str, str, str, str, str]]):
    """The mount ``path`` lives under: the longest mount point above it."""
    best = None
    for entry in table:
        point = entry[0].rstrip("/") or "/"
        if path == point or path.startswith(point.rstrip("/") + "/") or point == "/":
            if best is None or len(point) >= len(best[0].rstrip("/") or "/"):
                best = entry
    return best


def block_tier(device: str, sys_root: str = "/sys") -> tuple[str, str]:
    """(tier, disk name) of a block device given as ``major:minor``."""
    link = Path(sys_root, "dev/block", device)
    try:
        real = link.resolve(strict=True)
    except OSError:
        return "unknown", device
    disk = real if (real / "queue").exists() else real.parent  # a partition: its disk
    name = disk.name
    if name.startswith("nvme"):
        return "nvme", name
    if name.startswith(("vd", "xvd")):
        return "virtual", name
    try:
        rotational = (disk / "queue" / "rotational").read_text().strip() == "1"
    except OSError:
        return "unknown", name
    return ("hdd" if rotational else "ssd"), name


def tier(path: str, mountinfo: str | None = None, sys_root: str = "/sys",
         _depth: int = 0) -> dict[str, Any]:
    """``{"tier", "what", "fs", "device", "mount"}`` of ``path`` (a URL or a local path)."""
    if "://" in path:
        scheme = path.split("://", 1)[0]
        return {"tier": "object store", "what": TIERS["object store"], "fs": scheme,
                "device": None, "mount": None}
    real = os.path.realpath(path)
    entry = mount_of(real, mounts(mountinfo))
    if entry is None:
        return {"tier": "unknown", "what": TIERS["unknown"], "fs": None, "device": None,
                "mount": None}
    point, fstype, source, device, options = entry
    kind = fstype.split(".", 1)[0]
    found = "unknown"
    if kind in NETWORK_FS:
        found = "network"
    elif kind in MEMORY_FS:
        found = "tmpfs"
    elif kind in ("fuse", "fuseblk"):
        found = "object store" if any(n in fstype + source for n in OBJECT_FUSE) else "fuse"
    elif kind == "overlay" and _depth == 0:
        upper = next((o.split("=", 1)[1] for o in options.split(",")
                      if o.startswith("upperdir=")), None)
        if upper:  # a container's root: where its files are written is its disk
            under = tier(upper, mountinfo, sys_root, _depth + 1)
            return {**under, "fs": "overlay", "mount": point}
    else:
        found, source = block_tier(device, sys_root)
    return {"tier": found, "what": TIERS[found], "fs": fstype, "device": source,
            "mount": point}
