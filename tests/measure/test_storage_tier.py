"""The storage tier of a path (runner/measure/storage_tier.py), from a mount table and a
/sys tree built in tmp_path, and on this machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.measure.storage_tier import tier

MOUNTS = """\
27 1 259:2 / / rw,relatime - ext4 /dev/nvme0n1p2 rw
28 27 8:17 / /data rw,relatime - xfs /dev/sdb1 rw
29 27 8:33 / /fast rw,relatime - ext4 /dev/sdc1 rw
30 27 0:50 / /nfs rw,relatime - nfs4 server:/export rw,vers=4.2
31 27 0:51 / /dev/shm rw - tmpfs tmpfs rw
32 27 0:52 / /gcs rw - fuse.gcsfuse bucket rw
33 27 0:53 / /sshfs rw - fuse.sshfs host:/x rw
34 27 0:54 / /container rw - overlay overlay rw,lowerdir=/l,upperdir=/data/upper,workdir=/w
35 27 254:0 / /vm rw - ext4 /dev/vda rw
"""


@pytest.fixture
def sys_root(tmp_path: Path) -> str:
    """A /sys with an NVMe disk, an HDD, a SATA SSD and a virtio disk, partitions under them."""
    root = tmp_path / "sys"
    for disk, part, dev, rotational in (("nvme0n1", "nvme0n1p2", "259:2", "0"),
                                        ("sdb", "sdb1", "8:17", "1"),
                                        ("sdc", "sdc1", "8:33", "0"),
                                        ("vda", None, "254:0", "1")):
        d = root / "devices" / disk
        (d / "queue").mkdir(parents=True)
        (d / "queue" / "rotational").write_text(rotational + "\n")
        target = d / part if part else d
        target.mkdir(exist_ok=True)
        (root / "dev" / "block").mkdir(parents=True, exist_ok=True)
        (root / "dev" / "block" / dev).symlink_to(target)
    return str(root)


@pytest.mark.parametrize(("path", "expected", "device"), [
    ("/home/me/images", "nvme", "nvme0n1"),
    ("/data/imagenet", "hdd", "sdb"),
    ("/fast/imagenet", "ssd", "sdc"),
    ("/nfs/imagenet", "network", "server:/export"),
    ("/dev/shm/imagenet", "tmpfs", "tmpfs"),
    ("/gcs/imagenet", "object store", "bucket"),
    ("/sshfs/imagenet", "fuse", "host:/x"),
    ("/container/x", "hdd", "sdb"),  # an overlay: the disk its upper directory is on
    ("/vm/x", "virtual", "vda"),
    ("s3://bucket/train", "object store", None),
])
def test_each_tier_is_told_from_the_mount_table_and_sys(path, expected, device, sys_root):
    found = tier(path, MOUNTS, sys_root)
    assert (found["tier"], found["device"]) == (expected, device)
    assert found["what"]


def test_this_machines_tier_is_one_of_the_known_ones(tmp_path: Path):
    from runner.measure.storage_tier import TIERS

    assert tier(str(tmp_path))["tier"] in TIERS
