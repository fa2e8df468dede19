"""loader=ram (runner/data/storage/ram.py): the memory it may take (``/dev/shm``, ``ulimit -v``, a
cgroup's limit) and what it pins."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runner.job.compose import compose
from tests.conftest import (
    REPO,
)

MEMORY_UNDER_ULIMIT = """
import resource, sys
from types import SimpleNamespace
from runner.data.path import check_batch_memory
from runner.data.storage.ram import memory_available
from runner.config.schema import LoaderConfig
from runner.common.errors import ConfigError
soft, _ = resource.getrlimit(resource.RLIMIT_AS)
left = memory_available()
assert left <= soft, (left, soft)
image = (3, 1024, 1024)
fits = SimpleNamespace(largest_batch=max(1, left // (8 * 3 * 1024 * 1024)))
check_batch_memory(LoaderConfig(batch_size=fits.largest_batch), fits,
                   SimpleNamespace(item_shape=image))
too_big = SimpleNamespace(largest_batch=left // (3 * 1024 * 1024))  # 1x: 4 in flight do not fit
try:
    check_batch_memory(LoaderConfig(batch_size=too_big.largest_batch), too_big,
                       SimpleNamespace(item_shape=image))
except ConfigError as e:
    print("refused:", e)
print("left", left)
"""

@pytest.mark.process
def test_the_batch_memory_check_holds_to_ulimit_v(tmp_path: Path):
    """A batch the machine holds but ``ulimit -v`` does not is refused in one line (it
    passed the MemAvailable check and failed in the allocator)."""
    import resource


    def limit() -> None:  # 8 GiB of address space (importing torch takes about 3.4)
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    out = subprocess.run([sys.executable, "-c", MEMORY_UNDER_ULIMIT], preexec_fn=limit,
                         capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    left = int(out.stdout.split("left ")[1])
    assert left < 8 << 30  # the limit, less what the process already holds
    assert "refused: loader.batch_size=" in out.stdout and "use a smaller" in out.stdout

def test_the_memory_left_reads_a_cgroup_limit(tmp_path: Path):
    from runner.data.storage.ram import _cgroup_left

    (tmp_path / "memory.max").write_text(f"{1 << 30}\n")
    (tmp_path / "memory.current").write_text(f"{512 << 20}\n")
    (tmp_path / "memory.stat").write_text(f"anon 1\ninactive_file {100 << 20}\n")
    assert _cgroup_left(str(tmp_path)) == (1 << 30) - (512 << 20) + (100 << 20)
    (tmp_path / "memory.max").write_text("max\n")
    assert _cgroup_left(str(tmp_path)) is None


def test_loader_ram_refuses_a_dataset_larger_than_dev_shm(monkeypatch):
    from runner.data.sources.listing import DatasetError
    from runner.data.storage import ram

    monkeypatch.setattr(ram, "shm_free", lambda: 64 * 2**20)  # docker's default 64 MB
    with pytest.raises(DatasetError, match="--shm-size"):
        ram.check_fits(200 * 2**20, 1000, (3, 224, 224))
    ram.check_fits(10 * 2**20, 50, (3, 224, 224))  # fits: no error


def test_loader_ram_does_not_pin_the_dataset_and_batches_pin_their_small_fields(monkeypatch,
                                                                             image_tree: Path):
    from runner.data.loading.buffers import pin_small_fields
    from runner.data.storage import build_storage

    pinned = []

    def fake_pin(self):
        pinned.append(tuple(self.shape))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    cfg = compose(["loader=ram", f"dataset.path={image_tree}", "dataset.image_size=[16,16]",
                   "run.progress=false"])
    storage = build_storage(cfg.loader, cfg.dataset, image_tree, False)
    assert pinned == []  # the whole dataset is never pinned (every rank would pin a copy)
    assert not storage.images.is_pinned()
    batch = {"image": torch.zeros(4, 3, 16, 16, dtype=torch.uint8),
             "label": torch.zeros(4, dtype=torch.int64), "index": torch.arange(4)}
    pin_small_fields(batch)
    assert sorted(pinned) == [(4,), (4,)]  # labels and indices; the image buffer is pinned
