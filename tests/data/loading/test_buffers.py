"""Batched loading from pre-decoded storage: same batches on every path, buffers never
overwritten under a holder, RAM refused when it does not fit, augmentation on batches."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runner.config.schema import Decoder, LoaderConfig, OnCorrupt, StorageName
from runner.data.decode.crops import BatchAugment
from runner.data.decode.decoders import ImageDecoder
from runner.data.loading.buffers import BufferPool
from runner.data.loading.loader import BatchStream, InProcessBatches
from runner.data.order import BatchOrder
from runner.data.sources.listing import DatasetError
from runner.data.storage import ram
from runner.data.storage.folder import FolderStorage
from runner.data.storage.memmap import MemmapSpec, open_cache
from tests.conftest import (
    REPO,
    SMALL_DATASET,
    encode,
    make_loader,
    make_tree,
    photo,
)

SIZE = (16, 16)


@pytest.fixture
def folder(tmp_path: Path) -> FolderStorage:
    files = {f"c{k % 3}/img{k:02d}.jpg": encode(photo(32, 48, index=k)) for k in range(22)}
    root = make_tree(tmp_path / "src", files)
    return FolderStorage(root, ImageDecoder(Decoder.simplejpeg, SIZE), OnCorrupt.skip)


def spec(folder: FolderStorage) -> MemmapSpec:
    return MemmapSpec(folder.root.resolve(), SIZE, "simplejpeg", False)


@pytest.fixture
def memmap_storage(folder: FolderStorage, tmp_path: Path):
    return open_cache(folder, spec(folder), tmp_path / "cache", progress=False)


def cfg(**kwargs) -> LoaderConfig:
    base = dict(name=StorageName.memmap, batch_size=4, num_workers=0, batched=True, shuffle=True)
    return LoaderConfig(**{**base, **kwargs})


def batches(storage, epochs: int = 2, **kwargs) -> list:
    loader = make_loader(storage, cfg(**kwargs), seed=7, pin_memory=False)
    return [{k: v.clone() for k, v in b.items()} for b in BatchStream(loader, epochs)]


def assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for key in ("image", "label", "index"):
            assert torch.equal(x[key], y[key]), key


def test_batch_order_is_a_seeded_permutation_per_epoch():
    order = BatchOrder(10, batch_size=4, shuffle=True, drop_last=False, seed=1)
    epochs = [[b.tolist() for b in order.batches()] for _ in range(3)]
    for epoch in epochs:
        flat = [i for b in epoch for i in b]
        assert sorted(flat) == list(range(10)) and [len(b) for b in epoch] == [4, 4, 2]
        assert all(b == sorted(b) for b in epoch)  # read in file order within a batch
    assert epochs[0] != epochs[1]  # reshuffled each epoch
    again = BatchOrder(10, 4, shuffle=True, drop_last=False, seed=1)
    assert [b.tolist() for b in again.batches()] == epochs[0]  # reproducible
    assert len(BatchOrder(10, 4, shuffle=True, drop_last=True, seed=1)) == 2


def test_an_epochs_order_depends_on_its_number_alone_so_a_resumed_run_reads_the_same():
    straight = BatchOrder(50, batch_size=8, shuffle=True, drop_last=False, seed=4,
                          crop_seeds=True)
    seen = [([b.tolist() for b in straight.batches()], straight.seeds_for(torch.arange(50)))
            for _ in range(4)]
    resumed = BatchOrder(50, batch_size=8, shuffle=True, drop_last=False, seed=4,
                         crop_seeds=True)
    resumed.set_epoch(3)  # a run that starts after 3 epochs
    assert [b.tolist() for b in resumed.batches()] == seen[3][0]
    assert resumed.seeds_for(torch.arange(50)) == seen[3][1]  # the same crops too
    assert seen[2][0] != seen[3][0] and seen[2][1] != seen[3][1]


def test_a_stream_resumed_at_an_epoch_gives_that_epochs_batches(memmap_storage):
    from runner.data.loading.loader import batch_order, build_loader

    def stream(start: int, epochs: int) -> list[list[int]]:
        config = cfg(batch_size=4)
        order = batch_order(memmap_storage, config, seed=5)
        loader = build_loader(memmap_storage, config, order, False)
        return [b["index"].tolist() for b in BatchStream(loader, epochs, order=order, start_epoch=start)]

    per_epoch = -(-len(memmap_storage) // 4)
    assert stream(2, 1) == stream(0, 3)[2 * per_epoch :]


def test_block_shuffle_keeps_runs_together():
    order = BatchOrder(64, batch_size=16, shuffle=True, drop_last=False, seed=0, block=8)
    flat = order.epoch_order(0).tolist()
    assert sorted(flat) == list(range(64))
    runs = [flat[k : k + 8] for k in range(0, 64, 8)]
    assert all(r == list(range(r[0], r[0] + 8)) and r[0] % 8 == 0 for r in runs)
    assert [r[0] for r in runs] != sorted(r[0] for r in runs)


def test_every_loading_path_gives_the_same_batches(memmap_storage):
    in_process = batches(memmap_storage)
    assert isinstance(make_loader(memmap_storage, cfg(), 7, False), InProcessBatches)
    assert_same(in_process, batches(memmap_storage, batched=False))  # per item, collated
    assert_same(in_process, batches(memmap_storage, num_workers=2))  # batched, 2 workers
    assert_same(in_process, batches(memmap_storage, batched=False, num_workers=2))


def test_ram_and_memmap_give_identical_batches(folder, memmap_storage, tmp_path: Path):
    from_cache = ram.load_ram(folder, spec(folder), tmp_path / "cache", progress=False)
    assert_same(batches(memmap_storage), batches(from_cache))
    assert from_cache.images.is_shared()  # workers map it instead of copying it
    # no cache for this root: decoded straight into memory, no cache folder written
    direct = ram.load_ram(folder, spec(folder), tmp_path / "elsewhere", progress=False)
    assert_same(batches(memmap_storage), batches(direct))
    assert not (tmp_path / "elsewhere").exists()


def test_ram_refuses_a_dataset_that_does_not_fit(folder, tmp_path: Path, monkeypatch):
    monkeypatch.setattr(ram, "memory_available", lambda: 1000)
    with pytest.raises(DatasetError, match=r"needs .* GiB for 22 images of 3x16x16 .* use loader=memmap"):
        ram.load_ram(folder, spec(folder), tmp_path / "cache", progress=False)


def test_a_held_batch_is_never_overwritten(memmap_storage):
    loader = make_loader(memmap_storage, cfg(batch_size=4), seed=0, pin_memory=False)
    stream = iter(BatchStream(loader, epochs=3))
    kept = next(stream)
    snapshot = kept["image"].clone()
    for _ in range(12):  # more batches than the pool has buffers
        next(stream)
    assert torch.equal(kept["image"], snapshot)


def test_buffer_pool_reuses_only_released_buffers():
    pool = BufferPool((4, 3), torch.uint8, capacity=2)
    a = pool.take()
    a_ptr = a.data_ptr()
    del a
    b = pool.take(2)  # the released buffer again: no new allocation
    assert b.data_ptr() == a_ptr and pool.allocated == 1 and b.shape == (2, 3)
    c = pool.take()  # b is held: a second buffer
    assert c.data_ptr() != b.data_ptr() and pool.allocated == 2
    view = c[1:]
    del c
    d = pool.take()  # c's storage is still referenced through `view`: never handed out
    assert d.data_ptr() not in (b.data_ptr(), view.data_ptr() - 3) and pool.allocated == 3


def test_batch_augment_crops_each_image_differently():
    torch.manual_seed(0)
    images = torch.stack([torch.from_numpy(photo(32, 32, index=k)).permute(2, 0, 1)
                          for k in range(2)] * 4)
    out = BatchAugment((24, 24))(images)
    assert out.shape == (8, 3, 24, 24) and out.dtype == torch.uint8
    same_source = [out[k] for k in range(0, 8, 2)]  # four crops of one image
    assert any(not torch.equal(same_source[0], x) for x in same_source[1:])
    torch.manual_seed(0)
    assert torch.equal(out, BatchAugment((24, 24))(images))  # seeded: reproducible


@pytest.mark.process
@pytest.mark.slow
def test_the_loader_benchmark_runs_end_to_end(tmp_path: Path, cache_dir: Path):
    """A smoke run on tiny data: every measurement happens and the JSON lands."""


    proc = subprocess.run(
        [sys.executable, "-m", "runner.bench", "loaders", "--size", "32",  # default batch 256
         "--seconds", "0.2", "--rounds", "1", "--out", str(tmp_path / "bench"),
         "dataset.num_images=96", "dataset.num_classes=3", "dataset.source_size=[64,80]"],
        capture_output=True, text=True, timeout=600,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode in (0, 1), proc.stderr  # 1: a target missed on toy data
    assert "only 96 images: batch 256" in proc.stdout and "using batch 24" in proc.stdout
    for line in ("memcpy_limit", "per_item_dataloader", "naive_folder", "folder_simplejpeg_draft",
                 "memmap_2_workers", "round 1:", "targets"):
        assert line in proc.stdout
    (result,) = (tmp_path / "bench").glob("loaders-*.json")
    data = json.loads(result.read_text())
    assert {t["what"].split(" /")[0] for t in data["targets"]} >= {"memmap", "ram"}
    assert data["rates"]["memmap"] > 0 and len(data["folder_vs_naive_rounds"]) == 1


def test_a_batch_whose_buffers_cannot_fit_in_memory_is_refused_in_one_line(
        tmp_path: Path, cache_dir: Path, monkeypatch):
    from runner.common.errors import ConfigError
    from runner.data import build_data_path, path
    from runner.job.compose import compose

    monkeypatch.setattr(path, "memory_available", lambda: 10 * 3 * 48 * 48)
    config = compose([*SMALL_DATASET, "loader.batch_size=50", "model=none"])
    with pytest.raises(ConfigError, match=r"loader.batch_size=50 needs .* per batch of 50 "
                                          r"images .* use a smaller loader.batch_size"):
        build_data_path(config, torch.device("cpu"), epochs=1, progress=False)


def test_a_channels_last_pool_hands_out_nchw_views_of_nhwc_memory():
    """``BufferPool(channels_last=True)``: each buffer is N x H x W x C memory seen as
    N x C x H x W, a slot's pixels side by side; reused like any other once let go."""
    pool = BufferPool((4, 3, 5, 6), torch.uint8, channels_last=True)
    a = pool.take(3)
    assert a.shape == (3, 3, 5, 6) and not a.is_contiguous()
    assert a.permute(0, 2, 3, 1).is_contiguous() and a.stride() == (90, 1, 18, 3)
    ptr = a.data_ptr()
    del a
    assert pool.take().data_ptr() == ptr and pool.allocated == 1
    assert BufferPool((4, 3, 5, 6), torch.uint8).take().is_contiguous()

