"""loader.decoder=nvjpeg's stage: its decode thread, its batched resample, the bytes' one copy
(CPU, with torchvision's CPU decoder standing in for nvJPEG; the CUDA parts on CUDA)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from runner.config.schema import Crop, Decoder, LoaderConfig, OnCorrupt, StorageName
from runner.data.decode.decoders import ImageDecoder
from runner.data.decode.encoded import ReadBytes
from runner.data.device.nvjpeg import GpuDecodedBatches, resample_batch
from runner.data.loading.loader import BatchStream
from runner.data.storage.folder import FolderStorage
from tests.conftest import encode, make_loader, make_tree, photo


def reference(img: torch.Tensor, window, flip: bool, size) -> torch.Tensor:
    """One image's window resized as the group path does on the GPU (float interpolate)."""
    top, left, h, w = window
    crop = img[None, :, top : top + h, left : left + w].float()
    out = F.interpolate(crop, size=list(size), mode="bilinear", antialias=True,
                        align_corners=False)[0].round().clamp(0, 255)
    return out.flip(-1) if flip else out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_batched_resample_gives_each_windows_own_resize(device):
    """One batched resample (per-image weights, two matmuls) against interpolate, image by
    image: reduced, enlarged, only cropped, flipped, images of several sizes in one batch."""
    gen = torch.Generator().manual_seed(0)
    imgs = [torch.randint(0, 256, (3, h, w), generator=gen, dtype=torch.uint8).to(device)
            for h, w in ((60, 80), (60, 80), (45, 70), (90, 50), (60, 80))]
    windows = [(3, 5, 40, 52), (0, 0, 60, 80), (10, 10, 24, 24), (20, 4, 12, 16),
               (7, 30, 50, 33)]
    flips = [False, True, False, True, False]
    out = resample_batch(imgs, windows, flips, (24, 24))
    assert out.shape == (5, 3, 24, 24) and out.dtype == torch.uint8
    for k, img in enumerate(imgs):
        expected = reference(img, windows[k], flips[k], (24, 24))
        gap = (out[k].float() - expected).abs()
        assert gap.max() <= 1 and gap.mean() < 0.05, k  # rounding only
    other = resample_batch(imgs[:1], [(20, 30, 30, 40)], [False], (24, 24))
    assert (other[0].float() - out[0].float()).abs().mean() > 10  # another window: other pixels


def decoded_stage(tree: Path, ahead: int, crop=Crop.center, batch_size: int = 4):
    storage = FolderStorage(tree, ReadBytes(ImageDecoder(Decoder.pil, (24, 24), crop)),
                            OnCorrupt.skip)
    cfg = LoaderConfig(name=StorageName.folder, batch_size=batch_size, num_workers=0,
                       shuffle=False)
    loader = make_loader(storage, cfg, seed=0, pin_memory=False)
    return storage, GpuDecodedBatches(loader, storage, torch.device("cpu"), ahead=ahead)


def test_batches_are_decoded_ahead_on_a_thread_of_their_own(tmp_path: Path, monkeypatch):
    """The GPU decode ran on the loop's thread (prefetch=none: nothing decoded ahead while
    the model computed). Now on the stage's own thread, ``ahead`` batches in front; the
    same batches as decoding when asked (ahead=0), and a decode error reaches the loop."""
    tree = make_tree(tmp_path / "t", {f"a/{k}.jpg": encode(photo(32, 40, index=k))
                                      for k in range(10)})
    results = {}
    for ahead in (0, 2):
        _, stage = decoded_stage(tree, ahead)
        threads, real = [], stage._nvjpeg

        def recorded(data, real=real, threads=threads):
            threads.append(threading.current_thread())
            return real(data)

        monkeypatch.setattr(stage, "_nvjpeg", recorded)
        results[ahead] = [b for b, _ in stage]
        main = threading.main_thread()
        assert threads and all((t is main) == (ahead == 0) for t in threads), ahead
    assert len(results[0]) == len(results[2]) == 3
    for a, b in zip(results[0], results[2]):
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["index"], b["index"])

    _, stage = decoded_stage(tree, ahead=2)

    def broken(data):
        raise ValueError("decoder broke")

    monkeypatch.setattr(stage, "_nvjpeg", broken)
    with pytest.raises(ValueError, match="decoder broke"):
        list(stage)


def test_a_stage_cut_short_stops_its_thread(tmp_path: Path):
    tree = make_tree(tmp_path / "t", {f"a/{k}.jpg": encode(photo(32, 40, index=k))
                                      for k in range(16)})
    _, stage = decoded_stage(tree, ahead=2, batch_size=2)
    before = threading.active_count()
    batches = iter(BatchStream(stage, epochs=2))
    next(batches)
    batches.close()
    for _ in range(50):
        if threading.active_count() <= before:
            break
        threading.Event().wait(0.1)
    assert threading.active_count() <= before


def test_the_bytes_are_not_copied_between_the_read_and_the_batch(monkeypatch):
    """The file's buffer is the item (its seed appended in place), and a worker packs the
    batch straight into shared memory (not a private buffer the loader then copies)."""
    read = ReadBytes(None)
    data = bytearray(b"\xff\xd8abc")
    item = read(data, 7)
    data[2] = ord("z")  # the same memory
    assert bytes(item[:5].numpy()) == b"\xff\xd8zbc" and len(item) == 5 + 8
    assert not ReadBytes.pack([item])["jpeg"].is_shared()  # in the main process: no need
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: object())
    packed = ReadBytes.pack([item, read(bytearray(b"de"))])
    assert packed["jpeg"].is_shared() and bytes(packed["jpeg"].numpy()) == b"\xff\xd8zbcde"
    assert packed["jpeg_offsets"].tolist() == [0, 5, 7] and packed["crop_seed"].tolist() == [7, -1]


def test_a_packed_stores_sizes_come_from_its_index_not_a_header():
    class Store:
        heights, widths = [10, 20, 30], [11, 21, 31]
        stored_upright = True
        decode = ReadBytes(ImageDecoder(Decoder.pil, (8, 8), Crop.center))

    stage = GpuDecodedBatches([], Store(), torch.device("cpu"))
    headers = stage.headers({"index": torch.tensor([2, 0])}, [torch.zeros(4, dtype=torch.uint8)] * 2)
    assert [(h.height, h.width, h.components, h.orientation) for h in headers] == [
        (30, 31, 3, 1), (10, 11, 3, 1)]

    class Shards(Store):  # an index that does not vouch for upright RGB: headers parsed
        stored_upright = False

    rotated = torch.frombuffer(bytearray(encode(photo(20, 30), orientation=6)), dtype=torch.uint8)
    header = GpuDecodedBatches([], Shards(), torch.device("cpu")).headers(
        {"index": torch.tensor([1])}, [rotated])[0]
    assert (header.height, header.width, header.orientation) == (20, 30, 6)


@pytest.mark.cuda
def test_random_crops_of_many_sizes_on_the_gpu_are_the_cpu_paths(tmp_path: Path):
    """dataset.crop=random with images of several sizes: one batched resample on the GPU,
    each image the CPU decode's crop of the same seed (within the decoders' rounding)."""
    from runner.data.loading.loader import collate

    tree = make_tree(tmp_path / "t", {f"a/{k}.jpg": encode(photo(48 + 8 * k, 64, index=k))
                                      for k in range(6)})
    cpu = FolderStorage(tree, ImageDecoder(Decoder.pil, (24, 24), Crop.random), OnCorrupt.skip)
    gpu = FolderStorage(tree, ReadBytes(ImageDecoder(Decoder.pil, (24, 24), Crop.random)),
                        OnCorrupt.skip)
    stage = GpuDecodedBatches([], gpu, torch.device("cuda"))
    batch, _ = collate([gpu[(i, 1000 + i)] for i in range(6)], ReadBytes.pack)
    out, _ = stage.decode_batch(batch, [])
    for i in range(6):
        expected = cpu[(i, 1000 + i)].image
        assert (out["image"][i].cpu().int() - expected.int()).abs().float().mean() < 2.0, i


def test_a_huge_image_does_not_pad_the_whole_batch_to_its_size():
    """One 4000 x 3000 photo among small ones would pad all of them to its size in one
    resample (tens of GB at a batch of 256): the batch is resampled in parts under a byte
    limit, smallest first, every image in exactly one part."""
    from runner.data.device.nvjpeg import padded_parts

    shapes = [torch.Size((3, 300, 400))] * 255 + [torch.Size((3, 4000, 3000))]
    parts = padded_parts(shapes, limit=1 << 30)
    assert sorted(k for p in parts for k in p) == list(range(256))
    assert parts[-1] == [255]  # the photo alone
    for part in parts:
        h = max(shapes[k][1] for k in part)
        w = max(shapes[k][2] for k in part)
        assert len(part) == 1 or len(part) * 3 * h * w * 4 <= 1 << 30
    assert len(parts) <= 3  # the small ones share parts: not one call each
