"""``dataset.targets=masks`` through the decoded stores (``loader=memmap``, ``loader=ram``):
each image's mask kept as a uint8 plane beside it (runner/data/storage/decoded.py), cut,
resized and flipped on the device with its pixels, batched as ``mask``; the store rebuilt
when a mask is edited; a short training run on it that validates by mean IoU."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import runner
from tests.conftest import run_in_process

# four classes, each painted in its own flat colour, far from the others
PALETTE = np.array([[20, 20, 20], [230, 40, 40], [40, 200, 60], [60, 80, 240]], np.uint8)
HW = (48, 72)  # not square: a transposed mask would not even fit


def write_blocks(root: Path, count: int = 8, seed: int = 0) -> Path:
    """``images/`` (lossless PNGs) and ``masks/`` side by side: each image a grid of 4 x 6
    blocks of random classes, every pixel the colour of the class its mask says."""
    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    for k in range(count):
        grid = rng.integers(0, len(PALETTE), size=(4, 6)).astype(np.uint8)
        mask = np.kron(grid, np.ones((HW[0] // 4, HW[1] // 6), np.uint8))
        Image.fromarray(PALETTE[mask]).save(root / "images" / f"{k:02d}.png")
        Image.fromarray(mask).save(root / "masks" / f"{k:02d}.png")
    (root / "data.yaml").write_text("names: [dark, red, green, blue]\n")
    return root


@pytest.fixture(scope="module")
def blocks(tmp_path_factory) -> Path:
    return write_blocks(tmp_path_factory.mktemp("blocks"))


def agreement(image: torch.Tensor, mask: torch.Tensor) -> float:
    """The share of labelled pixels whose colour is nearest their mask's class's colour."""
    palette = torch.from_numpy(PALETTE).float()
    pixels = image.permute(0, 2, 3, 1).float()  # [B, H, W, 3]
    nearest = ((pixels[..., None, :] - palette) ** 2).sum(-1).argmin(-1)
    labelled = mask != 255
    return float((nearest == mask.long())[labelled].float().mean())


def batches(root: Path, cache: Path, loader: str, *overrides: str) -> list[dict]:
    p = runner.pipeline("dataset.targets=masks", f"dataset.path={root}",
                        f"dataset.cache_dir={cache}", "loader.batch_size=4",
                        "run.progress=false", "seed=3", *overrides, loader=loader)
    try:
        return [{k: v.cpu() for k, v in b.items()} for b in p]
    finally:
        p.close()


CROPS = {
    "center at the stored size": ("dataset.crop=center", "dataset.image_size=[32,40]"),
    "center of a larger store": ("dataset.crop=center", "dataset.image_size=[32,40]",
                                 "dataset.store_size=48"),
    "random crops and flips": ("dataset.crop=random", "dataset.image_size=[32,40]",
                               "dataset.store_size=48"),
    "whole": ("dataset.crop=whole", "dataset.image_size=[40,56]"),
    "random crops gathered in a worker": (  # the plane gathered into shared memory
        "dataset.crop=random", "dataset.image_size=[32,40]", "dataset.store_size=48",
        "loader.num_workers=1"),
    "letterbox": ("dataset.crop=letterbox", "dataset.image_size=[40,40]"),  # pads: 255
    "a split's side": ("dataset.crop=whole", "dataset.image_size=[40,56]",
                       "dataset.val_fraction=0.25", "dataset.split=val"),
}


@pytest.mark.parametrize("loader", ["folder", "memmap", "ram"])  # folder: the reference
@pytest.mark.parametrize("crop", list(CROPS))
def test_a_decoded_stores_masks_line_up_with_their_pixels(blocks: Path, tmp_path: Path,
                                                           loader: str, crop: str):
    """Every batch's mask says the class whose colour its pixel has (all but the pixels on
    a block's edge, which the bilinear resize of the pixels blends), after the store's
    decode and the device's crops, resizes and flips; a mask that missed a flip or a
    crop would agree on about a third of them."""
    got = batches(blocks, tmp_path / "cache", loader, *CROPS[crop])
    assert sum(len(b["index"]) for b in got) == (2 if "split" in crop else 8)
    size = tuple(int(v) for v in CROPS[crop][1].split("=")[1].strip("[]").split(","))
    for b in got:
        assert b["mask"].shape == (len(b["index"]), *size) and b["mask"].dtype == torch.uint8
        assert b["image"].shape[-2:] == size
        assert agreement(b["image"], b["mask"]) > 0.9, crop
        assert agreement(b["image"], b["mask"].flip(-1)) < 0.75  # the check can tell
        if crop == "letterbox":  # 48 x 72 into 40 x 40: 27 rows of picture, the pads ignored
            assert (b["mask"][:, :6] == 255).all() and (b["mask"][:, 33:] == 255).all()
            assert (b["mask"][:, 6:33] != 255).all()


def test_random_crops_move_each_mask_as_torchvision_v2_moves_a_mask(blocks: Path,
                                                                     tmp_path: Path):
    """A random-crop batch's masks are exactly torchvision v2's ``resized_crop`` (then
    ``horizontal_flip``) of the stored mask plane, through each image's own window and flip
    as the device drew them for its pixels: NEAREST, never blended."""
    from runner.data.decode.boxgeometry import Window
    from runner.data.decode.maskgeometry import map_mask

    p = runner.pipeline("dataset.targets=masks", f"dataset.path={blocks}",
                        f"dataset.cache_dir={tmp_path}", "loader.batch_size=4",
                        "run.progress=false", "dataset.crop=random",
                        "dataset.image_size=[32,40]", "dataset.store_size=48", loader="ram")
    try:
        store, augment = p.storage, p.data.augment
        stored = store.planes["mask"]
        hw = tuple(store.image_shape[1:])
        assert tuple(stored.shape[1:]) == hw == (48, 60)  # at the stored size
        flips = 0
        for b in p:
            b = {k: v.cpu() for k, v in b.items()}
            n = len(b["index"])
            windows = augment.boxes(n, *hw, torch.device("cpu"),
                                    draws={"crop_uniforms": b["crop_uniforms"]})
            for row, index in enumerate(b["index"].tolist()):
                window = Window(*(float(getattr(windows, k)[row])
                                  for k in ("top", "left", "height", "width")))
                flip = bool(windows.flip[row])
                flips += flip
                want = map_mask(stored[int(store.slots[index])], window, (32, 40), flip)
                assert torch.equal(b["mask"][row], want), (index, window, flip)
        assert 0 < flips < 8  # both met
    finally:
        p.close()


def open_store(root: Path, cache: Path, loader: str = "memmap", *overrides: str):
    from runner.data.storage import build_storage, settle_loader
    from runner.job.compose import compose

    cfg = compose(["dataset.targets=masks", f"dataset.path={root}",
                   f"dataset.cache_dir={cache}", f"loader={loader}", "dataset.crop=whole",
                   "dataset.image_size=[48,72]", *overrides])
    settle_loader(cfg.loader, cfg.dataset)
    return build_storage(cfg.loader, cfg.dataset, root, progress=False)


@pytest.mark.parametrize("loader", ["memmap", "ram"])
def test_an_edited_mask_rebuilds_the_store(tmp_path: Path, monkeypatch, loader: str):
    """The masks are part of the source's fingerprint: a mask repainted in place (same
    names, same images, same size) rebuilds the store (ram: decodes anew rather than read
    the stale one), whose plane then holds the edit; an untouched source reuses it."""
    from runner.data.storage import memmap

    root = write_blocks(tmp_path / "blocks", count=4)
    cache = tmp_path / "cache"
    open_store(root, cache, "memmap")  # the store ram then reads
    builds = []
    real_convert = memmap._convert
    monkeypatch.setattr(memmap, "_convert", lambda *a: builds.append(1) or real_convert(*a))
    store = open_store(root, cache, loader)
    assert builds == []  # unchanged: reused
    index = [store.name_of(i) for i in range(len(store))].index("02.png")
    edited = np.full(HW, 3, np.uint8)
    edited[:, :10] = 255
    Image.fromarray(edited).save(root / "masks" / "02.png")
    store = open_store(root, cache, loader)
    # memmap rebuilds its store; ram no longer trusts it and decodes into memory instead
    assert builds == ([1] if loader == "memmap" else [])
    assert torch.equal(store[index].mask, torch.from_numpy(edited))
    assert torch.equal(store.gather(torch.tensor([index]))[0]["mask"][0],
                       torch.from_numpy(edited))


def test_a_masks_layout_with_its_own_split_and_a_val_fraction_is_refused(tmp_path: Path):
    from runner.common.errors import ConfigError

    root = tmp_path / "split"
    for split in ("train", "val"):
        write_blocks(root / split, count=2)  # <split>/images + <split>/masks
    with pytest.raises(ConfigError, match="val_fraction=0.5 splits a masks layout .* split "
                                          "folders of its own"):
        open_store(root, tmp_path / "cache", "memmap", "dataset.val_fraction=0.5")


@pytest.mark.slow  # a segmenter's few steps and its validation: ~40 s on 2 loaded cores
@pytest.mark.parametrize("loader", ["memmap"])
def test_a_segmenter_trains_on_a_decoded_store_and_validates_by_miou(tmp_path: Path,
                                                                     loader: str):
    """``python -m runner dataset.targets=masks loader=memmap``: random crops of a store at
    40 px cut to 32 on the device with their masks, and the run's val mIoU in
    metrics.json."""
    run = tmp_path / "run"
    run_in_process("task=train", "model.name=lraspp_mobilenet_v3_large", "run.epochs=1",
                   "logger=none", "diagnose=false", "run.timeline=false",
                   "run.warmup_steps=0", "dataset.image_size=[32,32]", "dataset.store_size=40",
                   "dataset.crop=random", f"dataset.cache_dir={tmp_path / 'cache'}",
                   "dataset.targets=masks", "dataset.num_images=12", "loader.batch_size=4",
                   "run.progress=false", f"loader={loader}", run_dir=run)
    metrics = json.loads((run / "metrics.json").read_text())
    assert 0 <= metrics["val_miou"] <= 1 and "val_pixel_accuracy" in metrics
    assert metrics["config"]["loader"]["name"] == loader
    assert list((tmp_path / "cache" / loader).glob("*-mask-*/mask.memmap"))


def test_prepare_builds_and_sizes_a_masks_store(blocks: Path, tmp_path: Path):
    """``python -m runner.prepare memmap dataset.targets=masks`` builds the store with its
    mask plane, and prepare's table counts the plane in memmap's and ram's bytes and lists
    only stores that carry masks."""
    from runner import prepare
    from runner.config.schema import StorageName, TargetName
    from runner.data.storage import STORAGES

    overrides = [f"dataset.path={blocks}", "dataset.targets=masks", "dataset.crop=whole",
                 "dataset.image_size=[24,36]", f"dataset.cache_dir={tmp_path / 'cache'}",
                 "run.progress=false"]
    assert prepare.main(["memmap", *overrides]) == 0
    (plane,) = (tmp_path / "cache" / "memmap").glob("*/mask.memmap")
    assert plane.stat().st_size == 8 * 24 * 36
    sizes = {k.name.value: f for k, f in prepare.store_sizes(prepare.compose(overrides)).stores}
    assert all(STORAGES[StorageName(n)].carries(TargetName.masks) for n in sizes)
    for name in ("memmap", "ram"):
        assert sizes[name].nbytes == 8 * (3 + 1) * 24 * 36 and "mask" in sizes[name].what


def test_a_damaged_mask_plane_is_a_clear_error(blocks: Path, tmp_path: Path):
    from runner.data.storage.convert import META, CacheError

    cache = tmp_path / "cache"
    open_store(blocks, cache)
    (store,) = [p.parent for p in cache.rglob(META)]
    with open(store / "mask.memmap", "r+b") as f:
        f.truncate(100)
    with pytest.raises(CacheError, match="damaged.*mask.memmap holds 100 bytes.*prepare memmap"):
        open_store(blocks, cache)
    meta = json.loads((store / META).read_text())
    del meta["planes"]
    (store / META).write_text(json.dumps(meta))
    with pytest.raises(CacheError, match="damaged.*does not name its mask plane"):
        open_store(blocks, cache)


@pytest.mark.slow  # three short segmenter runs: ~1-2 minutes on 2 loaded cores
def test_a_segmenter_on_memmap_stopped_and_resumed_sees_the_same_masks_and_losses(
        tmp_path: Path, monkeypatch):
    """Stopped mid-epoch (a SIGTERM before step 3 of 6) and resumed: the same images, the
    same random crops of their pixels and masks, and the same losses as a run that never
    stopped (tests/tasks/test_checkpoint.py's check, with the masks)."""
    import runner.tasks
    from runner.common.errors import Interrupted

    common = ["task=train", "model.name=lraspp_mobilenet_v3_large", "logger=none",
              "diagnose=false", "run.timeline=false", "run.warmup_steps=0", "run.epochs=2",
              "dataset.targets=masks", "dataset.num_images=15", "dataset.crop=random",
              "dataset.image_size=[32,32]", "dataset.store_size=40", "loader=memmap",
              "loader.batch_size=4", f"dataset.cache_dir={tmp_path / 'cache'}",
              "run.progress=false"]

    def run(run_dir: Path, *extra: str, stop_at: int | None = None) -> list[tuple]:
        steps: list[tuple] = []
        real = runner.tasks.TrainStep.__call__

        def step(self, batch) -> None:
            if stop_at is not None and len(steps) == stop_at:
                raise Interrupted("SIGTERM")
            real(self, batch)
            steps.append((tuple(batch["index"].tolist()), int(batch["image"].long().sum()),
                          int(batch["mask"].long().sum()), float(self.losses[self.steps - 1])))

        monkeypatch.setattr(runner.tasks.TrainStep, "__call__", step)
        try:
            run_in_process(*common, *extra, run_dir=run_dir)
        except KeyboardInterrupt:
            pass
        monkeypatch.undo()
        return steps

    straight = run(tmp_path / "straight")
    assert len(straight) == 6  # 12 training images, 3 whole batches an epoch
    first = run(tmp_path / "run", stop_at=3)
    second = run(tmp_path / "run", "resume=auto")
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["status"] == "ok" and metrics["start_step"] == 3
    together = first + second
    assert [s[:3] for s in together] == [s[:3] for s in straight]  # images, crops, masks
    assert [s[3] for s in together] == pytest.approx([s[3] for s in straight], abs=1e-5)
