"""Detection augmentation that moves boxes with the pixels, on the device the batch is on:
``task.augment.mosaic`` and ``task.augment.box_crop`` (runner/data/device/augment.py's
``TrainAugment`` calls them before its colour operations).

A batch carries its boxes padded (runner/data/decode/boxgeometry.py: ``boxes`` [B, M, 4]
xyxy in output pixels, ``box_labels`` [B, M], ``box_count`` [B]); both operations work on
the whole batch with gathers and ``torch.where``, draw on the device and read nothing back
(no host sync), and end with boxgeometry's one rule: boxes clipped to what they land in,
those under ``MIN_SIDE`` pixels wide or high dropped (torchvision's
``SanitizeBoundingBoxes`` defaults), the kept ones first in their row in their order.

**Mosaic** (ultralytics' ``Mosaic``, four images into one): an image, with probability
``p``, becomes a 2 x 2 canvas of four images of its batch (itself top left, then three
partners by three permutations: top right, bottom left, bottom right) seen through a
window of its own size whose corner meets the canvas's centre at a random point ``(cy,
cx)``, uniform over the middle half of each side (ultralytics' centre in ``[s/2, 3s/2]``
of its ``2s`` canvas, cut back to ``s``). So the quadrant above and left of ``(cy, cx)``
is the bottom-right ``cy x cx`` of the first image, and so on: each quadrant a crop of one
image moved into place, pixels copied, no resize. An image left alone is the mosaic with
its centre at its own bottom-right corner. The output holds up to ``4 M`` boxes per image.

**Box crops** (``box_crop``: the smallest area share): a random-resized crop and a
horizontal flip per image, the area share from ``box_crop`` to 1 and aspect 3/4 to 4/3
(torchvision's ``RandomResizedCrop.get_params`` with ATTEMPTS tries), the device crops'
own code (runner/data/decode/crops.py: ``BatchAugment``: one ``grid_sample`` for the batch)
and their boxes' (``map_padded``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runner.data.decode.boxgeometry import MIN_SIDE, PAD_LABEL, map_padded
from runner.data.decode.crops import BatchAugment, Boxes
from runner.data.decode.decoders import RATIO


@dataclass
class MosaicPlan:
    """Each output image's mosaic: its four sources (the image itself and three partners,
    [B, 4] in quadrant order: top left, top right, bottom left, bottom right) and the
    canvas centre in it, ``cy`` [B] and ``cx`` [B] (an image left alone: its size)."""

    sources: torch.Tensor
    cy: torch.Tensor
    cx: torch.Tensor


def draw_mosaic(n: int, size: tuple[int, int], p: float, device: torch.device) -> MosaicPlan:
    """The mosaics of a batch of ``n`` images of ``size``, drawn on ``device``: each image
    with probability ``p``; a centre uniform in the middle half of each side."""
    h, w = size
    on = torch.rand(n, device=device) < p
    partners = [torch.randperm(n, device=device) for _ in range(3)]
    sources = torch.stack([torch.arange(n, device=device), *partners], 1)
    cy = torch.randint(h // 4, 3 * h // 4 + 1, (n,), device=device)
    cx = torch.randint(w // 4, 3 * w // 4 + 1, (n,), device=device)
    cy = torch.where(on, cy, torch.full_like(cy, h))
    cx = torch.where(on, cx, torch.full_like(cx, w))
    return MosaicPlan(torch.where(on[:, None], sources, sources[:, :1]), cy, cx)


def mosaic_images(images: torch.Tensor, plan: MosaicPlan) -> torch.Tensor:
    """The mosaics' pixels (N, C, H, W, any dtype): one gather, each output pixel from its
    quadrant's source at the quadrant's shift."""
    n, c, h, w = images.shape
    device = images.device
    rows = torch.arange(h, device=device)[None, :, None]
    cols = torch.arange(w, device=device)[None, None, :]
    cy, cx = plan.cy[:, None, None], plan.cx[:, None, None]
    below, right = rows >= cy, cols >= cx
    quadrant = below.long() * 2 + right.long()  # [N, H, W]
    source = plan.sources.gather(1, quadrant.view(n, -1)).view(n, h, w)
    y = torch.where(below, rows - cy, rows + h - cy)
    x = torch.where(right, cols - cx, cols + w - cx)
    flat = (source * h + y) * w + x  # into the batch's pixels, one channel
    pixels = images.transpose(0, 1).reshape(c, -1)
    return pixels[:, flat.view(-1)].view(c, n, h, w).transpose(0, 1).contiguous()


def quadrant_shifts(plan: MosaicPlan, size: tuple[int, int]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each quadrant's shift (dy, dx) from its source into the output, and the part of the
    output it fills (top, left, bottom, right): both [B, 4, ...] in quadrant order."""
    h, w = size
    cy, cx = plan.cy.float(), plan.cx.float()
    zero = torch.zeros_like(cy)
    dy = torch.stack([cy - h, cy - h, cy, cy], 1)
    dx = torch.stack([cx - w, cx, cx - w, cx], 1)
    top = torch.stack([zero, zero, cy, cy], 1)
    left = torch.stack([zero, cx, zero, cx], 1)
    bottom = torch.stack([cy, cy, zero + h, zero + h], 1)
    right = torch.stack([cx, zero + w, cx, zero + w], 1)
    return torch.stack([dy, dx], -1), torch.stack([top, left, bottom, right], -1)


def mosaic_boxes(boxes: torch.Tensor, labels: torch.Tensor, counts: torch.Tensor,
                 plan: MosaicPlan, size: tuple[int, int], min_side: float = MIN_SIDE
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mosaics' boxes (the batch's padded targets, [B, M, 4]) as [B, 4M, 4]: each
    quadrant's source boxes moved by its shift, clipped to the quadrant, those under
    ``min_side`` dropped; kept first, quadrant after quadrant, in their order."""
    n, m = boxes.shape[:2]
    shift, region = quadrant_shifts(plan, size)  # [B, 4, 2], [B, 4, 4]
    src = plan.sources  # [B, 4]
    b = boxes.to(torch.float32)[src]  # [B, 4, M, 4]
    lab = labels[src]  # [B, 4, M]
    present = torch.arange(m, device=boxes.device)[None, None, :] < counts[src][..., None]
    dy, dx = shift[..., 0, None], shift[..., 1, None]
    top, left = region[..., 0, None], region[..., 1, None]
    bottom, right = region[..., 2, None], region[..., 3, None]
    x1 = torch.minimum(torch.maximum(b[..., 0] + dx, left), right)
    y1 = torch.minimum(torch.maximum(b[..., 1] + dy, top), bottom)
    x2 = torch.minimum(torch.maximum(b[..., 2] + dx, left), right)
    y2 = torch.minimum(torch.maximum(b[..., 3] + dy, top), bottom)
    keep = present & (x2 - x1 >= min_side) & (y2 - y1 >= min_side)
    moved = torch.stack([x1, y1, x2, y2], -1).reshape(n, 4 * m, 4)
    keep, lab = keep.reshape(n, 4 * m), lab.reshape(n, 4 * m)
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices  # kept first
    kept = keep.gather(1, order)
    moved = moved.gather(1, order[..., None].expand(-1, -1, 4))
    out_boxes = torch.where(kept[..., None], moved, torch.zeros_like(moved))
    out_labels = torch.where(kept, lab.gather(1, order), torch.full_like(lab, PAD_LABEL))
    return out_boxes, out_labels, keep.sum(1)


def mosaic(batch, p: float) -> MosaicPlan:
    """``batch`` (its image and padded boxes) made mosaics in place; returns the plan."""
    images = batch["image"]
    size = tuple(images.shape[-2:])
    plan = draw_mosaic(images.shape[0], size, p, images.device)
    batch["image"] = mosaic_images(images, plan)
    batch["boxes"], batch["box_labels"], batch["box_count"] = mosaic_boxes(
        batch["boxes"], batch["box_labels"], batch["box_count"], plan, size)
    return plan


def box_crops(batch, smallest: float) -> Boxes:
    """A random-resized crop (area share ``smallest`` to 1) and a flip per image of
    ``batch``, its boxes with it, in place (``BatchAugment``'s windows drawn on the batch's
    device); returns the windows."""
    images = batch["image"]
    n, _, h, w = images.shape
    augment = BatchAugment((h, w), scale=(smallest, 1.0), ratio=RATIO)
    windows = augment.boxes(n, h, w, images.device)
    batch["image"] = augment.apply(images, windows)
    batch["boxes"], batch["box_labels"], batch["box_count"] = map_padded(
        batch["boxes"], batch["box_labels"], batch["box_count"], windows, (h, w))
    return windows
