"""Prefetching, uint8 transfers, AMP and GPU decoding: correct on CPU, CUDA parts on CUDA."""

from __future__ import annotations

import multiprocessing
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from runner.config.schema import Crop, Decoder, LoaderConfig, OnCorrupt, StorageName
from runner.data.decode.decoders import ImageDecoder
from runner.data.decode.encoded import ReadBytes
from runner.data.device.nvjpeg import GpuDecodedBatches
from runner.data.device.prefetch import CpuPrefetcher, CudaStreamPrefetcher
from runner.data.loading.loader import BatchStream, collate
from runner.data.storage.folder import FolderStorage
from runner.model.networks import UInt8Input
from tests.conftest import (
    SMALL_DATASET,
    encode,
    make_loader,
    make_tree,
    photo,
    read_metrics,
    run_cli,
)


def folder_stream(tree: Path, workers: int, epochs: int = 2) -> BatchStream:
    storage = FolderStorage(tree, ImageDecoder(Decoder.simplejpeg, (16, 16)), OnCorrupt.skip)
    cfg = LoaderConfig(name=StorageName.folder, batch_size=4, num_workers=workers)
    return BatchStream(make_loader(storage, cfg, seed=1, pin_memory=False), epochs)


def snapshot(batches) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(b["index"].clone(), b["image"].clone()) for b in batches]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_cpu_prefetch_yields_exactly_the_plain_batches(image_tree: Path, workers: int):
    plain = snapshot(folder_stream(image_tree, workers))
    prefetched = snapshot(CpuPrefetcher(folder_stream(image_tree, workers), depth=2))
    assert len(plain) == len(prefetched) == 10
    for (i, x), (j, y) in zip(plain, prefetched):
        assert torch.equal(i, j) and torch.equal(x, y)


def failing_source():
    yield 1
    yield 2
    raise ValueError("the producer broke")


def test_a_producer_error_surfaces_with_its_traceback():
    got = []
    with pytest.raises(ValueError, match="the producer broke") as info:
        for item in CpuPrefetcher(failing_source(), depth=2):
            got.append(item)
    assert got == [1, 2]
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "failing_source" in frames  # raised where it happened, not re-wrapped


def test_breaking_out_early_stops_the_thread_and_the_workers(image_tree: Path):
    prefetcher = CpuPrefetcher(folder_stream(image_tree, workers=2, epochs=50), depth=2)
    iterator = iter(prefetcher)
    next(iterator)
    assert any(t.name == "runner-prefetch" for t in threading.enumerate())
    start = time.perf_counter()
    iterator.close()  # what the loop does when run.steps is reached, or on an exception
    assert time.perf_counter() - start < 5
    assert not any(t.name == "runner-prefetch" for t in threading.enumerate())
    assert multiprocessing.active_children() == []


def test_empty_source_and_an_empty_loader():
    assert list(CpuPrefetcher([], depth=3)) == []


@pytest.mark.process
@pytest.mark.slow
def test_bf16_autocast_trains_the_tiny_model_on_cpu(tmp_path: Path, cache_dir: Path):
    run_cli(*SMALL_DATASET, "amp=bf16", "logger=none", "run.epochs=4", "hydra.run.dir=run",
            cwd=tmp_path)
    m = read_metrics(tmp_path / "run")
    assert m["status"] == "ok" and m["config"]["amp"]["name"] == "bf16"
    assert m["loss_last"] < m["loss_first"]


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
@pytest.mark.parametrize(("override", "why"), [
    ("prefetch=gpu", "prefetch=gpu copies batches on a CUDA side stream and needs a CUDA device"),
    ("amp=fp16", "amp=fp16 runs on CUDA only here"),
])
def test_cuda_only_switches_are_skips_with_reasons(tmp_path: Path, image_tree: Path, override,
                                                  why):
    proc = run_cli(override, f"dataset.path={image_tree}", "logger=none", "hydra.run.dir=run",
                   cwd=tmp_path)
    assert proc.returncode == 0
    m = read_metrics(tmp_path / "run")
    assert m["status"] == "skipped" and why in m["reason"]


def test_uint8_input_converts_on_the_device_inside_the_model():
    layer = UInt8Input(channels_last=True)
    x = torch.full((2, 3, 4, 4), 255, dtype=torch.uint8)
    y = layer(x)
    assert y.dtype == torch.float32 and y.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(y[0, :, 0, 0], (1 - torch.tensor([0.485, 0.456, 0.406]))
                          / torch.tensor([0.229, 0.224, 0.225]), atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16  # no float32 copy under autocast


def gpu_decoded(tree: Path, device: torch.device, on_corrupt=OnCorrupt.skip):
    storage = FolderStorage(tree, ReadBytes(ImageDecoder(Decoder.pil, (24, 24), Crop.center)),
                            on_corrupt)
    cfg = LoaderConfig(name=StorageName.folder, batch_size=8, num_workers=0, shuffle=False)
    loader = make_loader(storage, cfg, seed=0, pin_memory=False)
    wrapped = GpuDecodedBatches(loader, storage, device)
    return storage, BatchStream(wrapped, epochs=1)


def test_gpu_decode_path_matches_cpu_decoding(tmp_path: Path):
    """The nvjpeg wrapper end to end, with torchvision's decoder on the CPU standing in for
    the GPU: packing, EXIF orientation, PNG/CMYK fallback and skipping all match."""
    rgb = photo(48, 64, index=3)
    tree = make_tree(tmp_path / "t", {
        "a/plain.jpg": encode(rgb), "a/rotated.jpg": encode(rgb, orientation=6),
        "a/shot.png": encode(rgb, "PNG"), "b/cmyk.jpg": encode(rgb, mode="CMYK"),
        "b/gray.jpg": encode(rgb, mode="L"), "b/broken.jpg": encode(rgb)[:100],
    })
    storage, stream = gpu_decoded(tree, torch.device("cpu"))
    batches = list(stream)
    assert [Path(p).name for p in stream.skips.files] == ["broken.jpg"]
    reference = ImageDecoder(Decoder.pil, (24, 24))
    got = torch.cat([b["image"] for b in batches])
    index = torch.cat([b["index"] for b in batches]).tolist()
    assert len(index) == 5
    for k, i in enumerate(index):
        expected = reference(bytearray(Path(storage.samples[i][0]).read_bytes()))
        assert (got[k].int() - expected.int()).abs().float().mean() < 0.5, storage.samples[i][0]


def test_gpu_decoding_keeps_the_loaders_workers_from_epoch_to_epoch(tmp_path: Path):
    """The GPU-decoding stage shut the persistent workers down at each epoch's end: a node's
    16 workers started again every epoch (the selfcheck's nvjpeg row on an H200 spent most of
    its time there). Kept across epochs now, and shut down at the stream's end or when it
    is cut short."""
    tree = make_tree(tmp_path / "t", {f"a/{k}.jpg": encode(photo(32, 40, index=k))
                                      for k in range(8)})
    storage = FolderStorage(tree, ReadBytes(ImageDecoder(Decoder.pil, (24, 24), Crop.center)),
                            OnCorrupt.skip)
    cfg = LoaderConfig(name=StorageName.folder, batch_size=4, num_workers=2, shuffle=False,
                       persistent_workers=True)
    for cut_short in (False, True):
        loader = make_loader(storage, cfg, seed=0, pin_memory=False)
        stream = BatchStream(GpuDecodedBatches(loader, storage, torch.device("cpu")), epochs=3)
        workers = []
        batches = iter(stream)
        for k, _ in enumerate(batches):
            workers.append(tuple(loader._iterator._workers))
            if cut_short and k == 3:
                batches.close()
                break
        assert len(workers) == (4 if cut_short else 6) and len(set(workers)) == 1
        assert loader._iterator is None
        for worker in workers[0]:
            worker.join(timeout=10)
            assert not worker.is_alive()


def test_encoded_batches_pack_into_one_buffer():
    from runner.data.protocol import Sample

    read = ReadBytes(None)
    items = [Sample(read(bytearray([1, 2, 3]), 2**40 + 7), 0, 0),
             Sample(read(bytearray([4, 5])), 1, 1)]
    batch, skipped = collate(items, ReadBytes.pack)
    assert batch["jpeg"].tolist() == [1, 2, 3, 4, 5] and batch["jpeg_offsets"].tolist() == [0, 3, 5]
    assert batch["label"].tolist() == [0, 1] and skipped == []
    assert batch["crop_seed"].tolist() == [2**40 + 7, -1]  # each image's own crop seed


def test_gpu_prefetch_advances_its_source_inside_the_side_stream(monkeypatch):
    """nvjpeg's decode and DALI's copies run when the source is advanced: on the side
    stream, so they overlap the step. Stand-in CUDA calls record where each batch was made."""
    import contextlib

    from runner.data.device import prefetch

    inside = [False]

    @contextlib.contextmanager
    def stream(s):
        inside[0] = True
        try:
            yield
        finally:
            inside[0] = False

    class Event:
        def __init__(self, **kwargs):
            self.recorded_inside = None

        def record(self, stream=None):
            self.recorded_inside = inside[0]

    made = []

    class Batch:
        def to(self, device, non_blocking=False):
            return self

    def source():
        for _ in range(3):
            made.append(inside[0])
            yield Batch()

    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(prefetch, "count_images", lambda batch: 4)
    prefetcher = object.__new__(prefetch.CudaStreamPrefetcher)
    prefetcher.source, prefetcher.device, prefetcher.stream = source(), "cuda", "side"
    prefetcher.index = None  # the thread binds to no device (nothing real here)
    out = list(prefetcher._copies(None))
    assert len(out) == 3 and made == [True, True, True]
    assert all(start.recorded_inside and done.recorded_inside for _, (start, done), _ in out)


def test_gpu_decoded_random_crops_are_the_cpu_paths_boxes(tmp_path: Path):
    """dataset.crop=random: each image's crop comes from its own seed on either path, so
    the GPU decode gives the CPU decode's pixels (within the decoders' rounding)."""
    tree = make_tree(tmp_path / "t", {f"a/{k}.jpg": encode(photo(48, 64, index=k))
                                      for k in range(4)})
    cpu = FolderStorage(tree, ImageDecoder(Decoder.pil, (24, 24), Crop.random), OnCorrupt.skip)
    gpu = FolderStorage(tree, ReadBytes(ImageDecoder(Decoder.pil, (24, 24), Crop.random)),
                        OnCorrupt.skip)
    wrapped = GpuDecodedBatches([], gpu, torch.device("cpu"))
    items = [gpu[(i, 1000 + i)] for i in range(4)]
    batch, _ = collate(items, ReadBytes.pack)
    out, _ = wrapped.decode_batch(batch, [])
    for i in range(4):
        expected = cpu[(i, 1000 + i)].image
        assert (out["image"][i].int() - expected.int()).abs().float().mean() < 1.0, i
    other = cpu[(0, 5)].image  # another seed: another crop
    assert (out["image"][0].int() - other.int()).abs().float().mean() > 3.0


def test_nvjpeg_keeps_the_padding_mask_on_the_host(tmp_path: Path):
    """Counting a padded batch's images reads ``valid``: on the host, not a device sync."""
    tree = make_tree(tmp_path / "t", {f"a/{k}.jpg": encode(photo(48, 64, index=k))
                                      for k in range(3)})
    storage, stream = gpu_decoded(tree, torch.device("cpu"))
    wrapped = stream.loader
    batch = next(iter(wrapped.loader))[0]
    batch["valid"] = torch.tensor([True, True, False])
    out, _ = wrapped.decode_batch(batch, [])
    assert out["valid"].device.type == "cpu" and out["valid"].tolist() == [True, True, False]


# --- CUDA (skipped without a GPU, never left to fail) -----------------------------------

def device_batches(n: int = 6):
    for k in range(n):
        images = torch.randint(0, 256, (4 + k % 3, 3, 32, 32), dtype=torch.uint8).pin_memory()
        yield TensorDict({"image": images, "label": torch.arange(len(images)).pin_memory()},
                         batch_size=[len(images)])


@pytest.mark.cuda
def test_gpu_prefetch_equals_plain_copies():
    device = torch.device("cuda")
    source = list(device_batches())
    plain = [b.to(device) for b in source]
    prefetched = list(CudaStreamPrefetcher(source, device, depth=2))
    assert len(prefetched) == len(plain)  # the short batches included
    for a, b in zip(prefetched, plain):
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"])
    assert list(CudaStreamPrefetcher([], device)) == []


@pytest.mark.cuda
def test_gpu_prefetch_memory_is_flat_across_epochs():
    device = torch.device("cuda")
    source = list(device_batches(20))
    prefetcher = CudaStreamPrefetcher(source, device, depth=2)
    reserved = []
    for _ in range(3):
        for batch in prefetcher:
            (batch["image"].float() * 2).sum()  # some compute on the compute stream
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved(device))
    assert reserved[2] <= reserved[0]


@pytest.mark.cuda
def test_nvjpeg_pixels_are_close_to_cpu_decoding(tmp_path: Path):
    tree = make_tree(tmp_path / "t", {f"a/{k}.jpg": encode(photo(96, 128, index=k))
                                      for k in range(8)})
    storage, stream = gpu_decoded(tree, torch.device("cuda"))
    reference = ImageDecoder(Decoder.simplejpeg, (24, 24))
    for batch in stream:
        for img, i in zip(batch["image"].cpu(), batch["index"].tolist()):
            expected = reference(bytearray(Path(storage.samples[i][0]).read_bytes()))
            assert (img.int() - expected.int()).abs().float().mean() < 2.0


def _groups_against_one_by_one(device: torch.device) -> None:
    """nvjpeg's grouped finish (one resize per size, window and flip) gives each image the
    pixels it gets alone, flipped or not, enlarged or reduced or only cropped."""
    from runner.data.decode.decoders import Box, resize_crop_many

    gen = torch.Generator().manual_seed(0)
    imgs = [torch.randint(0, 256, (3, 60, 80), generator=gen, dtype=torch.uint8).to(device)
            for _ in range(5)]
    decoder = ImageDecoder(Decoder.simplejpeg, (24, 24), Crop.center)
    for box in (Box(3.2, 5.0, 40.0, 52.0), Box(0, 0, 60, 80), Box(10, 10, 24, 24),
                Box(20, 30, 12, 16)):
        many = resize_crop_many(imgs, box, (24, 24))
        assert many.shape == (5, 3, 24, 24) and many.device.type == device.type
        for k, img in enumerate(imgs):
            assert torch.equal(many[k], resize_crop_many([img], box, (24, 24))[0])
        for flip in (False, True):
            grouped = decoder.finish_many(imgs, box, flip)
            for k, img in enumerate(imgs):
                assert torch.equal(grouped[k], decoder.finish(img, box, flip)), (box, flip, k)


def test_a_group_resized_at_once_has_each_images_own_pixels():
    _groups_against_one_by_one(torch.device("cpu"))


@pytest.mark.cuda
def test_a_group_resized_at_once_on_the_gpu_has_each_images_own_pixels():
    _groups_against_one_by_one(torch.device("cuda"))


def test_the_prefetch_thread_keeps_torch_to_one_core_and_the_main_thread_its_own():
    """A second OpenMP team next to the main thread's made a batched gather 8x slower on
    2 cores; the producer thread runs its torch ops on one core instead."""
    torch.set_num_threads(2)
    seen = []

    def source():
        for k in range(3):
            seen.append(torch.get_num_threads())
            yield k

    assert list(CpuPrefetcher(source(), depth=2)) == [0, 1, 2]
    assert seen == [1, 1, 1]
    assert torch.get_num_threads() == 2  # the main thread's compute keeps both cores
    later = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert later == [2]  # and threads started afterwards get the usual default


@pytest.mark.cuda
def test_the_prefetch_copy_time_leaves_the_host_gather_out():
    """A source that takes 30 ms of host time per batch: the side-stream copy time per
    step is the copy's (well under a millisecond for a small batch), not the gather's."""
    from runner.data.device.prefetch import CudaStreamPrefetcher

    def slow():
        for _ in range(8):
            time.sleep(0.03)
            yield TensorDict({"image": torch.zeros(4, 3, 32, 32, dtype=torch.uint8)
                              .pin_memory()}, batch_size=[4])

    prefetcher = CudaStreamPrefetcher(slow(), torch.device("cuda"), depth=2)
    assert len(list(prefetcher)) == 8
    assert prefetcher.figures(8)["prefetch_copy_ms"] < 5.0
