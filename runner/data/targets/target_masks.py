"""``dataset.targets=masks``: a class per pixel (semantic segmentation), 255 ignored.

A batch carries each image's mask as ``mask`` uint8 [B, H, W] (class ids, ``IGNORE`` where
no class is known), at the image's size; a crop, resize or flip moves it with the pixels,
nearest-neighbour (``follow``: one gather on the batch's device, no host sync). A segmenter
(runner/model/families.py) trains on it with per-pixel cross-entropy and is scored by mean
IoU (``val_miou``); ``task=infer`` writes its masks.
"""

from __future__ import annotations

import torch

from runner.config.schema import Crop, Output, TargetName
from runner.data.protocol import Sample
from runner.data.targets.target import TargetKind

IGNORE = 255  # a pixel of no known class: no loss, no IoU
MASK_KEYS = ("mask",)


def collate(samples: list[Sample]) -> dict[str, torch.Tensor]:
    """The samples' masks stacked (every image of a batch has the batch's size)."""
    if not samples or getattr(samples[0], "mask", None) is None:
        return {}
    return {"mask": torch.stack([s.mask for s in samples])}


def follow(batch, windows, size: tuple[int, int]) -> None:
    """Each image's mask cut by its window (top, left, height, width in its pixels),
    flipped where its pixels are, resized to ``size`` by the nearest source pixel of each
    output pixel's centre."""
    mask = batch["mask"]
    n, h, w = mask.shape
    out_h, out_w = (int(v) for v in size)
    device = mask.device
    ys = (torch.arange(out_h, device=device, dtype=torch.float64) + 0.5) / out_h
    xs = (torch.arange(out_w, device=device, dtype=torch.float64) + 0.5) / out_w
    top, left = windows.top.double()[:, None], windows.left.double()[:, None]
    height, width = windows.height.double()[:, None], windows.width.double()[:, None]
    xs = torch.where(windows.flip[:, None].bool(), 1 - xs[None], xs[None].expand(n, -1))
    rows = (top + ys[None] * height).floor().long().clamp_(0, h - 1)  # [B, out_h]
    cols = (left + xs * width).floor().long().clamp_(0, w - 1)  # [B, out_w]
    image = torch.arange(n, device=device)[:, None, None]
    batch["mask"] = mask[image, rows[:, :, None], cols[:, None, :]]


KIND = TargetKind(
    name=TargetName.masks,
    summary="a class per pixel: a PNG of class ids per image (255: ignored)",
    batch_keys=MASK_KEYS,
    collate=collate,
    follow=follow,
    eval_crop=Crop.whole,
    mixes=False,
    best="val_miou",
    figures=("miou",),
    outputs=(Output.masks,),
    applies=frozenset({Output.masks}),
    recipe="segment_shapes",
    setting="dataset.targets=masks (images/ and masks/ side by side at dataset.path)",
)
