"""``task.augment.mosaic`` and ``task.augment.box_crop``: pixels and boxes against a
hand-derived mosaic and against torchvision v2 (crop + pad per quadrant; resized_crop +
horizontal_flip), boxes within a pixel, cut ones clipped and those left without area
dropped (SanitizeBoundingBoxes' defaults)."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from runner.data.decode.boxgeometry import pad, unpad
from runner.data.device.boxaugment import (
    MosaicPlan,
    box_crops,
    draw_mosaic,
    mosaic,
    mosaic_boxes,
    mosaic_images,
)

H, W = 40, 56


def detection_batch(n: int = 6, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 3, H, W), dtype=torch.uint8, generator=g)
    boxes, labels = [], []
    for _ in range(n):
        k = int(torch.randint(0, 6, (), generator=g))
        xy = torch.rand(k, 2, generator=g) * torch.tensor([W - 4, H - 4])
        wh = torch.rand(k, 2, generator=g) * torch.tensor([W / 2, H / 2]) + 2
        boxes.append(torch.cat([xy, torch.minimum(xy + wh, torch.tensor([W, H]))], 1))
        labels.append(torch.randint(0, 4, (k,), generator=g))
    return TensorDict({"image": images, **pad(boxes, labels)}, batch_size=[n])


def sanitized(bb, labels):
    out = v2.SanitizeBoundingBoxes()({"boxes": v2.ClampBoundingBoxes()(bb), "labels": labels})
    return out["boxes"].as_subclass(torch.Tensor), out["labels"]


def test_a_hand_derived_mosaic():
    images = torch.stack([torch.arange(H * W).view(1, H, W).expand(3, -1, -1) + 10_000 * k
                          for k in range(4)]).to(torch.int64)
    plan = MosaicPlan(torch.tensor([[0, 1, 2, 3]] * 4), torch.full((4,), 3),
                      torch.full((4,), 4))
    out = mosaic_images(images, plan)[0, 0]

    def at(k, y, x):
        return 10_000 * k + y * W + x

    assert out[0, 0] == at(0, H - 3, W - 4)  # top left: the first's bottom-right corner
    assert out[2, 3] == at(0, H - 1, W - 1)
    assert out[0, 4] == at(1, H - 3, 0)  # top right: the second's bottom-left
    assert out[3, 0] == at(2, 0, W - 4)  # bottom left: the third's top-right
    assert out[3, 4] == at(3, 0, 0) and out[H - 1, W - 1] == at(3, H - 4, W - 5)
    boxes = torch.zeros(4, 2, 4)
    boxes[1, 0] = torch.tensor([1.0, 36, 5, 39])  # the second's, near its bottom: kept
    boxes[0, 0] = torch.tensor([0.0, 0, 3, 3])  # the first's top-left: outside, dropped
    boxes[3, 0] = torch.tensor([50.0, 1, 56, 20])  # cut by the mosaic's right edge
    boxes[3, 1] = torch.tensor([52.0, 30, 53.5, 40])  # left 0.5 px wide: dropped
    labels = torch.tensor([[7, -1], [8, -1], [-1, -1], [9, 6]])
    counts = torch.tensor([1, 1, 0, 2])
    got, got_labels, got_counts = mosaic_boxes(boxes, labels, counts, plan, (H, W))
    assert got_counts[0] == 2 and got_labels[0, :2].tolist() == [8, 9]
    # the second's box: up by H - cy = 37, right by cx = 4; the fourth's: down 3, right 4,
    # clipped at the right edge (56) and the bottom (40)
    assert got[0, 0].tolist() == [5.0, 0.0, 9.0, 2.0]  # (y from -1: clipped to the top)
    assert got[0, 1].tolist() == [54.0, 4.0, 56.0, 23.0]


@pytest.mark.parametrize("seed", range(4))
def test_mosaics_equal_torchvision_crop_and_pad_per_quadrant(seed):
    batch = detection_batch(seed=seed)
    torch.manual_seed(seed)
    plan = draw_mosaic(6, (H, W), 0.7, torch.device("cpu"))
    assert (plan.cy < H).any() and (plan.cy == H).any() or seed  # both kinds, mostly
    images, boxes = batch["image"].clone(), batch["boxes"].clone()
    labels, counts = batch["box_labels"].clone(), batch["box_count"].clone()
    out = batch.clone()
    got_plan = plan
    out["image"] = mosaic_images(images, got_plan)
    out["boxes"], out["box_labels"], out["box_count"] = mosaic_boxes(
        boxes, labels, counts, got_plan, (H, W))
    rows = unpad(out["boxes"], out["box_labels"], out["box_count"])
    dropped = 0
    for i in range(6):
        cy, cx = int(plan.cy[i]), int(plan.cx[i])
        regions = [(H - cy, W - cx, cy, cx, 0, 0), (H - cy, 0, cy, W - cx, 0, cx),
                   (0, W - cx, H - cy, cx, cy, 0), (0, 0, H - cy, W - cx, cy, cx)]
        canvas = torch.zeros(3, H, W, dtype=torch.int64)
        tv_boxes, tv_labels = [], []
        for q, (top, left, h, w, at_y, at_x) in enumerate(regions):
            if h == 0 or w == 0:
                continue
            k = int(plan.sources[i, q])
            padding = [at_x, at_y, W - w - at_x, H - h - at_y]
            canvas += TF.pad(TF.crop(images[k], top, left, h, w), padding).long()
            n = int(counts[k])
            bb = tv_tensors.BoundingBoxes(boxes[k, :n], format="XYXY", canvas_size=(H, W))
            moved = TF.pad(TF.crop(bb, top, left, h, w), padding)
            kept, kept_labels = sanitized(moved, labels[k, :n])
            tv_boxes.append(kept)
            tv_labels.append(kept_labels)
            dropped += n - len(kept_labels)
        assert torch.equal(out["image"][i].long(), canvas)
        mine, mine_labels = rows[i]
        assert mine_labels.tolist() == torch.cat(tv_labels).tolist()
        assert torch.allclose(mine, torch.cat(tv_boxes), atol=1e-4)  # within a pixel: exact
    assert dropped > 0  # some boxes were cut away


@pytest.mark.parametrize("seed", range(4))
def test_box_crops_equal_torchvision_resized_crop_and_flip(seed):
    batch = detection_batch(seed=10 + seed)
    before = batch.clone()
    torch.manual_seed(seed)
    windows = box_crops(batch, 0.3)
    rows = unpad(batch["boxes"], batch["box_labels"], batch["box_count"])
    for i in range(6):
        top, left = int(windows.top[i]), int(windows.left[i])
        h, w, flip = int(windows.height[i]), int(windows.width[i]), bool(windows.flip[i])
        n = int(before["box_count"][i])
        bb = tv_tensors.BoundingBoxes(before["boxes"][i, :n], format="XYXY", canvas_size=(H, W))
        moved = TF.resized_crop(bb, top, left, h, w, [H, W])
        image = TF.resized_crop(before["image"][i], top, left, h, w, [H, W], antialias=False)
        if flip:
            moved, image = TF.horizontal_flip(moved), TF.horizontal_flip(image)
        tv, tv_labels = sanitized(moved, before["box_labels"][i, :n])
        mine, mine_labels = rows[i]
        assert mine_labels.tolist() == tv_labels.tolist()
        assert torch.allclose(mine, tv, atol=1.0)  # the bound
        assert torch.allclose(mine, tv, atol=1e-3)  # in fact: float rounding
        diff = (batch["image"][i].int() - image.int()).abs()
        assert diff.max() <= 1  # the same bilinear enlargement, rounded
    assert windows.flip.any() and not windows.flip.all() or seed


def test_train_augment_moves_boxes_and_replays_a_step():
    from runner.config.schema import AugmentConfig
    from runner.data.device.augment import TrainAugment

    cfg = AugmentConfig(mosaic=1.0, box_crop=0.5)
    assert cfg.active
    first, again = detection_batch(seed=3), detection_batch(seed=3)
    TrainAugment(cfg, seed=1, start_step=5)(first)
    TrainAugment(cfg, seed=1, start_step=5)(again)  # a resumed run at step 5
    assert torch.equal(first["image"], again["image"])
    assert torch.equal(first["boxes"], again["boxes"])
    assert first["boxes"].shape[1] == 4 * detection_batch(seed=3)["boxes"].shape[1]
    kept = first["boxes"][torch.arange(first["boxes"].shape[1])[None, :]
                          < first["box_count"][:, None]]
    assert len(kept) and (kept[:, 2] <= W).all() and (kept[:, 3] <= H).all()
    assert ((kept[:, 2] - kept[:, 0]) >= 1).all() and ((kept[:, 3] - kept[:, 1]) >= 1).all()


def test_mosaic_at_p_zero_changes_nothing_and_needs_boxes():
    from runner.common.errors import ConfigError
    from runner.job.compose import compose

    batch = detection_batch()
    before = batch.clone()
    mosaic(batch, 0.0)
    assert torch.equal(batch["image"], before["image"])
    n = before["boxes"].shape[1]
    assert torch.equal(batch["boxes"][:, :n], before["boxes"])
    assert torch.equal(batch["box_count"], before["box_count"])
    with pytest.raises(ConfigError, match="task.augment.mosaic=0.5"):
        compose(["task.augment.mosaic=0.5"])
    assert compose(["task.augment.mosaic=0.5", "dataset.targets=yolo"]).task.augment.mosaic
