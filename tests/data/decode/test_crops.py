"""One meaning of a crop on every storage: the same images through every storage with the
same config give the same pixels (centre crops equal within decoder rounding, random crops
the same boxes for the same seed), and the packed store's batch decode gives the pixels its
per-image path gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import runner
from runner.config.schema import (
    Decoder,
    StorageName,
)
from runner.data.decode.crops import BatchAugment
from runner.data.decode.decoders import DECODERS, center_box
from runner.data.storage import STORAGES
from runner.job.compose import compose
from tests.conftest import encode, make_tree, photo

SIZE = 48
# square sources: a decode-once store at dataset.store_size=64 holds the whole image, so
# its random crops (cut on the device) are the same regions a folder's decode cuts
SOURCE = 96


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "tree", {f"c{k % 2}/img{k}.jpg": encode(photo(SOURCE, SOURCE, k),
                                                                       quality=95)
                                         for k in range(12)})


def images(tree: Path, tmp_path: Path, *overrides: str) -> torch.Tensor:
    """Every image of one epoch in dataset order, as the model gets them."""
    pipe = runner.pipeline(f"dataset.image_size=[{SIZE},{SIZE}]", "loader.batch_size=5",
                           "loader.shuffle=true", f"dataset.cache_dir={tmp_path / 'cache'}",
                           "run.progress=false", *overrides, dataset_path=str(tree))
    batches = list(pipe)
    index = torch.cat([b["index"] for b in batches])
    out = torch.cat([b["image"] for b in batches])
    assert sorted(index.tolist()) == list(range(12))
    return out[torch.argsort(index)]


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean absolute difference per image, the largest over the batch (grey levels)."""
    return (a.float() - b.float()).abs().mean(dim=(1, 2, 3)).max().item()


def storage_cases() -> tuple[dict[str, list[str]], set[str], set[str]]:
    """Every runner storage of the registry (the rivals bring their own pipelines: their own
    test below), as name -> overrides; and the cases whose pixels equal the reference's
    within rounding: for centre crops, and for random crops.

    A storage that reads the folder as it is runs once per CPU decoder it takes; a store
    re-encoded once and decoded every epoch once, at full quality (its own JPEG loss
    aside); a store decoded once at the output size and at ``dataset.store_size`` (where
    its random crops have the whole source to choose from). Equal within rounding: the
    same decode, box and resize as the reference (region decodes at a reduced DCT scale,
    a re-encoded store cuts its window from an image stored at 55; a store at the output
    size holds the centre square alone, so its random crops differ)."""
    cases: dict[str, list[str]] = {}
    centre, random = set(), set()
    for kind in STORAGES.values():
        if kind.own_loader or not kind.reads_path:  # a rival's crops, or the user's Dataset
            continue
        storage = f"loader={kind.name.value}"
        if kind.build is None:  # the folder itself, decoded every epoch
            for decoder in sorted(kind.decoders, key=lambda d: d.value):
                if decoder in DECODERS and not DECODERS[decoder].cuda:
                    name = f"{kind.name.value} {decoder.value}"
                    cases[name] = [storage, f"loader.decoder={decoder.value}"]
                    if not DECODERS[decoder].region:
                        centre.add(name)
                        random.add(name)
        elif kind.decodes_per_epoch:  # re-encoded once, decoded every epoch
            cases[kind.name.value] = [storage, "dataset.store_quality=100"]
        else:  # decoded once
            cases[f"{kind.name.value} at the output size"] = [storage]
            cases[f"{kind.name.value} at store_size"] = [storage,
                                                         f"dataset.store_size={SOURCE}"]
            centre |= {f"{kind.name.value} at the output size",
                       f"{kind.name.value} at store_size"}
            random.add(f"{kind.name.value} at store_size")
    return cases, centre, random


CASES, EXACT_CENTRE, EXACT_RANDOM = storage_cases()
# the reference every storage is held against: the folder decoded by simplejpeg
REFERENCE = CASES[f"{StorageName.folder.value} {Decoder.simplejpeg.value}"]


def available(overrides: list[str]) -> bool:
    decoder = compose([f"dataset.image_size=[{SIZE},{SIZE}]", *overrides]).loader.decoder
    return DECODERS[decoder].available()


def test_every_runner_storage_is_held_against_the_reference():
    assert {c[0] for c in CASES.values()} == {f"loader={k.name.value}"
                                             for k in STORAGES.values()
                                             if not k.own_loader and k.reads_path}


@pytest.mark.slow
@pytest.mark.parametrize("fraction", ["0.875", "1.0"])
def test_a_centre_crop_is_the_same_pixels_on_every_storage(tree: Path, tmp_path: Path,
                                                           fraction: str):
    crop = [f"dataset.crop_fraction={fraction}"]
    reference = images(tree, tmp_path, *REFERENCE, *crop)
    other = images(tree, tmp_path, *REFERENCE,
                   f"dataset.crop_fraction={0.6 if fraction == '0.875' else 0.875}")
    apart = diff(reference, other)
    for name, overrides in CASES.items():
        if not available(overrides):
            continue
        got = images(tree, tmp_path, *overrides, *crop)
        # the same region of the same image: far closer than another crop fraction's
        assert diff(got, reference) < apart / 3, (name, diff(got, reference), apart)
        if name in EXACT_CENTRE:  # the same decode, box and resize: equal within rounding
            assert diff(got, reference) < 1.0, (name, diff(got, reference))


def test_the_default_crop_is_resize_256_crop_224_and_packed_stores_at_256():
    config = compose([])
    assert config.dataset.crop_fraction == 0.875
    from runner.data.storage.packed import default_store_size

    assert default_store_size(config.dataset) == 256
    assert default_store_size(compose(["dataset.crop_fraction=1.0"]).dataset) == 224
    box = center_box(480, 640, 224, 224, 0.875)
    assert (box.height, box.width) == (420, 420)  # 0.875 of the shorter side
    from runner.common.errors import ConfigError

    with pytest.raises(ConfigError, match=r"dataset.crop_fraction=1.5 .*\(0, 1\]"):
        compose(["dataset.crop_fraction=1.5"])


@pytest.mark.parametrize("rival", ["dali", "ffcv"])
def test_the_rivals_take_the_same_centre_crop(tree: Path, tmp_path: Path, rival: str):
    pytest.importorskip({"dali": "nvidia.dali", "ffcv": "ffcv.loader"}[rival])
    reference = images(tree, tmp_path, *REFERENCE)
    whole = images(tree, tmp_path, *REFERENCE, "dataset.crop_fraction=1.0")
    got = images(tree, tmp_path, f"loader={rival}", "dataset.store_quality=100")
    # their own resize filters: near the runner's 0.875 crop, not its whole-side one
    assert diff(got, reference) < diff(got, whole) / 1.5, (diff(got, reference),
                                                           diff(got, whole))


@pytest.mark.slow
def test_a_random_crop_is_the_same_box_on_every_storage(tree: Path, tmp_path: Path):
    """Random crops: the same seed and batch position give the same region of the same
    image on a folder, its packed store and a decode-once store (cut on the device)."""
    random = ["dataset.crop=random", "seed=3"]
    reference = images(tree, tmp_path, *REFERENCE, *random)
    again = images(tree, tmp_path, *REFERENCE, *random)
    assert torch.equal(reference, again)
    other_seed = images(tree, tmp_path, *REFERENCE, "dataset.crop=random",
                        "seed=4")
    apart = diff(reference, other_seed)
    for name, overrides in CASES.items():
        if not available(overrides):
            continue
        got = images(tree, tmp_path, *overrides, *random)
        assert diff(got, reference) < apart / 3, (name, diff(got, reference), apart)
        if name in EXACT_RANDOM:  # the stored square cut on the device as the folder's
            # decode cuts the source: the same pixels
            assert diff(got, reference) < 1.0, (name, diff(got, reference))


@pytest.mark.parametrize("crop", ["center", "random"])
def test_the_packed_batch_decode_gives_the_per_image_pixels(tree: Path, tmp_path: Path,
                                                            crop: str):
    from runner.data.loading.loader import ThreadedBatches
    from runner.data.order import BatchOrder
    from runner.data.storage import build_storage, resolve_dataset
    from runner.data.storage.folder import FolderStorage

    config = compose([f"dataset.path={tree}", f"dataset.image_size=[{SIZE},{SIZE}]",
                      f"dataset.cache_dir={tmp_path / 'cache'}", "loader=packed",
                      f"dataset.crop={crop}", "run.progress=false"])
    storage = build_storage(config.loader, config.dataset, resolve_dataset(config.dataset), False)
    if not storage.native_batches:
        pytest.skip("the libjpeg binding is not built")
    order = BatchOrder(len(storage), 5, shuffle=True, drop_last=False, seed=1,
                       crop_seeds=crop == "random")

    def epoch() -> list[tuple[torch.Tensor, torch.Tensor]]:
        order.set_epoch(0)  # the same permutation and crop seeds each time
        return [(b["index"].clone(), b["image"].clone())
                for b, _ in ThreadedBatches(storage, order, pin_memory=False, threads=2)]

    from runner.data.decode import _jpegregion

    decode_batch, errors = _jpegregion.decode_batch, []

    def counted(jobs):  # every image of the native epoch decoded by the binding itself
        results = decode_batch(jobs)
        errors.extend(r for r in results if r is not None)
        return results

    _jpegregion.decode_batch = counted
    try:
        native = epoch()
    finally:
        _jpegregion.decode_batch = decode_batch
    assert errors == []
    calls = []
    storage.decode_slice = lambda out, positions, indices: calls.append(1) or \
        FolderStorage.decode_slice(storage, out, positions, indices)
    per_image = epoch()
    assert calls and len(native) == len(per_image) == 3
    for (index, image), (again, pixels) in zip(native, per_image):
        assert torch.equal(index, again) and torch.equal(image, pixels)


def test_the_bindings_enlargement_is_the_antialiased_resize():
    """The binding's bilinear (random crops that are enlargements: nearly all of them)
    against torch's antialiased uint8 resize, on HWC buffers and CHW windows, flipped."""

    from runner.data.decode.decoders import resize_into, upsample_job

    generator = torch.Generator().manual_seed(0)
    store = torch.randint(0, 256, (3, 64, 80), dtype=torch.uint8, generator=generator)
    hwc = store.permute(1, 2, 0).contiguous()
    cases = [(store[:, 3:40, 5:61], False), (store[:, 10:42, 0:32], True),
             (hwc[7:40, 2:29].permute(2, 0, 1), True), (store[:, :1, :1], False)]
    used = 0
    for window, flip in cases:
        out = torch.empty(3, 48, 56, dtype=torch.uint8)
        used += upsample_job(out, window, flip) is not None
        resize_into(out, window, flip)
        ref = F.interpolate(window[None].contiguous(), size=[48, 56], mode="bilinear",
                            antialias=True, align_corners=False)[0]
        ref = ref.flip(2) if flip else ref
        assert (out.int() - ref.int()).abs().max() <= 1, (window.shape, flip)
    from runner.data.decode.decoders import _UPSAMPLE

    # the HWC view is torch's (its channels-last kernel is faster there), the CHW ones the
    # binding's
    assert used == (len(cases) - 1 if _UPSAMPLE is not None else 0)
    # a reduction is not the binding's: torch's antialiased resize does it
    out = torch.empty(3, 16, 16, dtype=torch.uint8)
    assert upsample_job(out, store, False) is None
    resize_into(out, store)
    assert torch.equal(out, F.interpolate(store[None], size=[16, 16], mode="bilinear",
                                          antialias=True, align_corners=False)[0])


def test_the_stores_bench_holds_packed_to_its_decode_limit_and_memmap_to_the_grid():
    """The targets of ``bench stores`` from a round's figures: each ratio is taken within
    the round (a store's share of that round's decode limit; memmap's random crops against
    that round's batched grid_sample), then the median over rounds."""
    from runner.bench.stores import _row, folder_rows, store_targets
    from runner.config.schema import StorageName
    from runner.data.storage import STORAGES

    packed, memmap = _row(StorageName.packed), _row(StorageName.memmap)
    memmap_256 = [n for n in STORAGES[StorageName.memmap].bench if n != memmap][0]

    def round_(limit: float, packed_center: float, packed_random: float, grid: float,
               memmap_random: float) -> dict:
        r = {f"{f}/{c}/{b}/{cache}": 100.0 for f in folder_rows() for c in ("center", "random")
             for b in (64, 256) for cache in ("warm", "cold")}
        for b in (64, 256):
            r[f"decode limit/{b}"] = limit
            r[f"{packed}/center/{b}/warm"] = packed_center
            r[f"{packed}/random/{b}/warm"] = packed_random
            r[f"{memmap}/random grid_sample/{b}"] = grid
            r[f"{memmap}/random/{b}/warm"] = memmap_random
            r[f"{memmap_256}/random/{b}/warm"] = memmap_random
        r[f"{packed}/center/64/cold"] = packed_center
        return r

    stores = {"rounds": [round_(1000, 900, 650, 100, 520), round_(2000, 1700, 1500, 100, 480),
                         round_(1000, 950, 800, 100, 530)],
              "bytes": {memmap: 400, packed: 50}}
    targets = {what: (value, target) for what, value, target, _ in store_targets(stores)}
    center = targets[f"{packed} center / the decode limit of its stored JPEGs, batch 64"]
    assert center == (pytest.approx(0.9), 0.85)  # 0.90, 0.85, 0.95 -> median 0.90
    random = targets[f"{packed} random / the decode limit of its stored JPEGs, batch 256"]
    assert random == (pytest.approx(0.75), 0.7)  # 0.65, 0.75, 0.80
    grid = targets[f"{memmap} random (cut per image) / the batched grid_sample crop on the "
                   "CPU, batch 64"]
    assert grid == (pytest.approx(5.2), 5.0)
    assert not any("packed random / packed center" in what for what in targets)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("size", [(375, 500), (3000, 4000)])
def test_batched_boxes_are_the_decoders_boxes_pixel_for_pixel(size, device):
    """The device's batched boxes (memmap/ram random crops on a GPU) are the integer windows
    the decoders cut for the same seeds (``random_box`` + ``pixel_window``): float64 like
    them, so no box rounds to a neighbouring pixel (in float32, 1 and 6 of these 20,000
    boxes did)."""
    from runner.data.decode.decoders import pixel_window, random_box

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    h, w = size
    aug = BatchAugment((24, 24))
    draws = aug.draws(list(range(20_000)))
    on_device = {k: v.to(device) for k, v in draws.items()}
    boxes = aug.boxes(20_000, h, w, torch.device(device), draws=on_device)
    got = torch.stack([boxes.top, boxes.left, boxes.height, boxes.width], 1).long().tolist()
    want, flips = [], []
    for u in draws["crop_uniforms"].tolist():
        box, flip = random_box(h, w, u)
        want.append(list(pixel_window(box, h, w)))
        flips.append(flip)
    assert got == want and boxes.flip.tolist() == flips
