"""Masks follow the pixels: a segmentation target (an [H, W] uint8 map of class ids, 255 =
ignore) through the crops, resizes, flips and letterbox the runner applies to its image,
and a predicted mask back into the source image's frame.

**The same windows as the pixels and the boxes.** Every output image is a window of its
upright source image (``Window``: top, left, height, width in source pixels) resized to the
output size and maybe flipped (runner/data/decode/boxgeometry.py says which window each
crop cuts: ``decoder_window``, ``shown_window``, ``center_windows``, and the device's
``BatchAugment.boxes``). A mask takes the same window: ``map_mask`` cuts it and resizes it
with torchvision v2's own kernels on a ``tv_tensors.Mask`` (``resized_crop`` then
``horizontal_flip``), so a mask here is exactly what a user's v2 pipeline makes of it.
v2 resizes a mask with NEAREST (``F.interpolate(mode="nearest")``: output pixel j takes
source pixel ``floor(j * in / out)``, a float32 product), never blends class ids.

**Letterbox** (issue 60's ``dataset.crop=letterbox``; ultralytics' ``LetterBox``): the
whole image resized with its aspect kept to fit ``size``, centred, the rest padded. ``letterbox_layout``
says where the resized image lands (``Placement``: top, left, height, width in output
pixels; ultralytics' rounding of the new size and of the two pads); ``letterbox_mask``
resizes the mask into it (NEAREST) and pads the rest with ``IGNORE``, so the padding never
counts in the loss or the metric. A decoder says a letterbox as a window reaching over the
pads (runner/data/decode/decoders.py's ``letterbox_window``, what boxes follow); ``map_mask``
takes such a window back to its ``Placement`` (``window_placement``), so a decode's mask
lands on exactly the pixels its image did.

**A batch on the device** (``map_masks``): [B, H, W] uint8 masks, each cut by its own
window (``crops.Boxes``, float32 tensors of integer values, as the pixels' crops are), with
its own flip, to one size, by one gather: the row and column each output pixel reads are
computed as v2's nearest kernel computes them (the float32 ``floor(j * (height / out))``,
clamped to the window), so each image equals ``map_mask`` of it exactly; no Python loop
over images, no host sync.

**Back to the source frame** (``mask_to_source``, for served masks): source pixel (y, x)
inside the window takes the prediction at output pixel
``floor((y + 0.5 - top) * out_h / height)`` (the same for x; mirrored when the image was
flipped): the output pixel whose footprint ``[j, j + 1) * height / out_h`` holds the source
pixel's centre, which is the footprint both the bilinear pixels and v2's nearest mask give
output pixel j. Source pixels outside the window (a centre crop's cut-away sides) have no
prediction and get ``fill`` (``IGNORE`` by default). A letterboxed prediction is first cut
to its ``Placement`` (the padding is no part of the image).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as TF

from runner.data.decode.boxgeometry import Window
from runner.data.decode.crops import Boxes
from runner.data.sources.masklabels import IGNORE


@dataclass(frozen=True)
class Placement:
    """Where a letterboxed image lies in its output: top, left, height, width in output
    pixels (the rest is padding)."""

    top: int
    left: int
    height: int
    width: int


def integer_window(window: Window) -> tuple[int, int, int, int]:
    """``window`` as the integer (top, left, height, width) a mask is cut by: the decoders'
    windows are whole source pixels already; a window from a reduced DCT decode
    (``cut_window`` with ``decoded_hw``) can be fractional, and is rounded to the nearest
    source pixel (at most half a source pixel from the pixels' window)."""
    top, left = int(round(window.top)), int(round(window.left))
    return top, left, max(1, int(round(window.height))), max(1, int(round(window.width)))


def map_mask(mask: torch.Tensor, window: Window, size: tuple[int, int], flip: bool = False
             ) -> torch.Tensor:
    """One [H, W] mask through ``window`` resized to ``size`` (height, width), flipped
    left-right when ``flip``: torchvision v2's ``resized_crop`` and ``horizontal_flip`` of a
    ``tv_tensors.Mask`` (NEAREST). A window that reaches past the mask is a letterbox's
    (the decoders' ``letterbox_window``: the whole image and its pads): the mask is placed
    where the pixels were (``window_placement``) and the pads are ``IGNORE``
    (``letterbox_mask``), never a class (v2's crop would pad with 0, a class)."""
    if reaches_past(window, tuple(mask.shape[-2:])):
        out = letterbox_mask(mask, window_placement(window, tuple(mask.shape[-2:]), size), size)
        return (TF.horizontal_flip(out) if flip else out).as_subclass(torch.Tensor)
    top, left, height, width = integer_window(window)
    out = TF.resized_crop(tv_tensors.Mask(mask), top, left, height, width, list(size))
    if flip:
        out = TF.horizontal_flip(out)
    return out.as_subclass(torch.Tensor)


SLACK = 1e-4  # source pixels: a window inside the mask, up to the float error of a rescale


def reaches_past(window: Window, hw: tuple[int, int]) -> bool:
    """Whether ``window`` reaches past an ``hw`` image (a letterbox's pads)."""
    h, w = hw
    return (window.top < -SLACK or window.left < -SLACK
            or window.top + window.height > h + SLACK
            or window.left + window.width > w + SLACK)


def window_placement(window: Window, hw: tuple[int, int], size: tuple[int, int]
                     ) -> Placement:
    """Where the whole ``hw`` image lies in an output of ``size`` that shows ``window`` of
    it (a letterbox's, reaching over the pads): the inverse of the decoders'
    ``letterbox_window``, so the mask lands on exactly the pixels the image did."""
    h, w = hw
    sy, sx = size[0] / window.height, size[1] / window.width  # output pixels per source one
    top, left = int(round(-window.top * sy)), int(round(-window.left * sx))
    height = max(1, min(size[0] - top, int(round(h * sy))))
    width = max(1, min(size[1] - left, int(round(w * sx))))
    return Placement(top, left, height, width)


def letterbox_layout(hw: tuple[int, int], size: tuple[int, int]) -> Placement:
    """Where an upright ``hw`` image lands letterboxed into ``size``: scaled by
    ``min(out_h / h, out_w / w)`` (aspect kept, the whole image shown), its new size rounded
    to whole pixels, centred; an odd padding puts its extra pixel at the bottom and the right
    (ultralytics' ``LetterBox``: ``round(d / 2 - 0.1)`` before, the rest after)."""
    h, w = hw
    out_h, out_w = size
    scale = min(out_h / h, out_w / w)
    new_h = min(out_h, max(1, int(round(h * scale))))
    new_w = min(out_w, max(1, int(round(w * scale))))
    top = int(round((out_h - new_h) / 2 - 0.1))
    left = int(round((out_w - new_w) / 2 - 0.1))
    return Placement(top, left, new_h, new_w)


def letterbox_mask(mask: torch.Tensor, placement: Placement, size: tuple[int, int],
                   fill: int = IGNORE) -> torch.Tensor:
    """The whole [H, W] mask resized (NEAREST) into ``placement`` of an output of ``size``,
    the padding ``fill`` (``IGNORE``: no loss, no metric there): v2's ``resize`` then
    ``pad`` of a ``tv_tensors.Mask``."""
    out_h, out_w = size
    resized = TF.resize(tv_tensors.Mask(mask), [placement.height, placement.width])
    padding = [placement.left, placement.top, out_w - placement.left - placement.width,
               out_h - placement.top - placement.height]
    return TF.pad(resized, padding, fill=fill).as_subclass(torch.Tensor)


def _source_index(start: torch.Tensor, length: torch.Tensor, out: int) -> torch.Tensor:
    """[B, out] source indices v2's nearest resize reads for each image's window: the
    float32 ``floor(j * (length / out))`` (PyTorch's ``nearest_idx``: the scale and product
    in float32), clamped to the window, plus its start."""
    j = torch.arange(out, device=start.device, dtype=torch.float32)
    scale = (length.to(torch.float32) / out)[:, None]
    offset = torch.floor(j[None, :] * scale).to(torch.int64)
    offset = torch.minimum(offset, length.to(torch.int64)[:, None] - 1)
    return start.to(torch.int64)[:, None] + offset


def map_masks(masks: torch.Tensor, windows: Boxes, size: tuple[int, int]) -> torch.Tensor:
    """A batch's [B, H, W] masks (on any device) each through its window and flip
    (``windows``: ``BatchAugment.boxes``' crops or ``center_windows``; whole pixels, as
    those are) to ``size``: one gather, each image equal to ``map_mask`` of it."""
    n, h, w = masks.shape
    out_h, out_w = size
    rows = _source_index(windows.top, windows.height, out_h)  # [B, out_h]
    cols = _source_index(windows.left, windows.width, out_w)  # [B, out_w]
    cols = torch.where(windows.flip[:, None], cols.flip(1), cols)
    flat = (rows[:, :, None] * w + cols[:, None, :]).reshape(n, -1)
    return masks.reshape(n, h * w).gather(1, flat).reshape(n, out_h, out_w)


def _from_output(n_source: int, start: float, length: float, n_out: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For each source index 0..n_source-1, the output index whose footprint holds its
    centre (``floor((i + 0.5 - start) * n_out / length)``, in float64), and whether it is
    inside the output."""
    i = torch.arange(n_source, device=device, dtype=torch.float64)
    j = torch.floor((i + 0.5 - start) * (n_out / length)).to(torch.int64)
    inside = (j >= 0) & (j < n_out)
    return j.clamp(0, n_out - 1), inside


def mask_to_source(pred: torch.Tensor, window: Window, source_hw: tuple[int, int],
                   flip: bool = False, placement: Placement | None = None,
                   fill: int = IGNORE) -> torch.Tensor:
    """A predicted [h, w] class-id mask at the model's input size back in the frame of the
    upright ``source_hw`` image it was made from through ``window`` (flipped when ``flip``;
    letterboxed into ``placement`` of the input when given, the window then the whole
    image): nearest, each source pixel taking the output pixel over its centre; source pixels
    the window leaves out get ``fill``."""
    if placement is not None:
        pred = pred[placement.top : placement.top + placement.height,
                    placement.left : placement.left + placement.width]
    if flip:
        pred = pred.flip(-1)
    out_h, out_w = pred.shape[-2:]
    src_h, src_w = source_hw
    if not (math.isfinite(window.height) and window.height > 0 and window.width > 0):
        raise ValueError(f"window {window} has no area")
    rows, row_in = _from_output(src_h, window.top, window.height, out_h, pred.device)
    cols, col_in = _from_output(src_w, window.left, window.width, out_w, pred.device)
    out = pred[rows[:, None], cols[None, :]]
    inside = row_in[:, None] & col_in[None, :]
    return torch.where(inside, out, torch.full_like(out, fill))
