"""Boxes follow the pixels: a detection target's boxes through the crops, resizes and flips
the runner applies to its image.

Boxes are xyxy in pixel-edge coordinates (the pixel at column j spans x = j..j+1), float32:
per image a [n, 4] tensor with int64 [n] class ids; per batch the padded form every stage
after the storage carries (``pad``): ``boxes`` [B, M, 4], ``box_labels`` [B, M] and
``box_count`` [B], the rows past an image's count 0 (boxes) and -1 (labels).

**One mapping.** Every way the runner makes an output image from a source image is a window
of the source (top, left, height, width, in source pixels) resized to the output and maybe
flipped left-right: the decoders' centre, random-resized and whole crops (the integer
window ``pixel_window`` cuts, runner/data/decode/decoders.py), the device's centre crop of a
store larger than the output and its random-resized crops (runner/data/decode/crops.py:
``CenterCrop``, ``BatchAugment``, the same windows). A point goes where the bilinear resize
takes its pixel (``F.interpolate`` with ``align_corners=False``, and ``BatchAugment``'s
grid, map the window's edges onto the output's): ``x' = (x - left) * out_w / width``, the
same for y; a flip is ``x' -> out_w - x'``. This is torchvision's transforms v2 on
``tv_tensors.BoundingBoxes`` (``resized_crop`` then ``horizontal_flip``), which the tests
check it against, within a pixel (to float rounding, in fact).

**A letterbox is a window too** (``dataset.crop=letterbox``): the whole image resized with
its aspect kept and padded is the window that reaches past the image by the pads
(``letterbox_window``: top ``-pad_top / scale``, height ``out_h / scale``), so the same
mapping moves boxes into it and ``to_source`` takes served boxes back out of it; the
tests check it against torchvision v2's ``resize`` then ``pad`` on ``BoundingBoxes``.

**One rule for boxes that leave the crop** (what torchvision's ``resized_crop`` followed by
``SanitizeBoundingBoxes()`` with its defaults does): a box is clipped to the output image,
then dropped when its clipped width or height is under ``MIN_SIDE`` output pixels (a box
wholly outside has zero width or height: always dropped). Nothing else is dropped: a box
mostly cut away but at least a pixel each way is kept, clipped.

The padded batch form is mapped in one go (``map_padded``, for the device's crops): a
box's keep flag is computed for all at once and the kept boxes are moved to the front of
their row by a stable sort, so nothing loops over images or boxes in Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runner.config.schema import Crop
from runner.data.decode.crops import Boxes
from runner.data.decode.decoders import (
    Box,
    ImageDecoder,
    center_box,
    letterbox_window,
    pixel_window,
    source_window,
)

# A box is kept when its width and height, clipped to the output image, are both at least
# this many output pixels: torchvision's SanitizeBoundingBoxes defaults (min_size=1; its
# min_area=1 follows from both sides >= 1), so a v2 pipeline ending in it keeps the same
# boxes. Boxes wholly outside the crop (zero width or height once clipped) always go.
MIN_SIDE = 1.0

PAD_LABEL = -1  # box_labels past an image's box_count (its boxes are 0)


@dataclass(frozen=True)
class Window:
    """The part of a source image an output image is made of: top, left, height, width in
    pixels of the source (upright) image."""

    top: float
    left: float
    height: float
    width: float


def cut_window(box: Box, hw: tuple[int, int], decoded_hw: tuple[int, int] | None = None
               ) -> Window:
    """The window the decoders cut for ``box`` (a crop on the upright ``hw`` image) from an
    image decoded at ``decoded_hw`` (a reduced DCT scale: ``loader.draft``, the region
    decoder at ``denom``; None: full size): ``pixel_window``'s integer window there, in
    pixels of the ``hw`` image (``source_window``, which the decoders report)."""
    return Window(*source_window(box, hw, decoded_hw))


def decoder_window(decoder: ImageDecoder, hw: tuple[int, int], seed: int | None = None,
                   decoded_hw: tuple[int, int] | None = None) -> tuple[Window, bool]:
    """The window and flip ``decoder`` applies to an upright ``hw`` image whose crop seed is
    ``seed`` (its ``box_for``: centre with ``dataset.crop_fraction``, random-resized, or
    whole), as decoded at ``decoded_hw`` (``cut_window``)."""
    if decoder.crop is Crop.random and seed is None:
        raise ValueError("a random crop's window needs the image's crop seed")
    box, flip = decoder.box_for(*hw, seed)
    return cut_window(box, hw, decoded_hw), flip


def _map(boxes: torch.Tensor, top, left, height, width, size: tuple[int, int], flip,
         min_side: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``boxes`` [..., M, 4] through windows broadcast over ``...`` (scalars, or tensors of
    shape [...]) to ``size``, flipped where ``flip``: (mapped and clipped boxes, kept)."""
    out_h, out_w = size
    b = boxes.to(torch.float32)
    sx, sy = out_w / width, out_h / height
    x1 = ((b[..., 0] - left) * sx).clamp(0, out_w)
    y1 = ((b[..., 1] - top) * sy).clamp(0, out_h)
    x2 = ((b[..., 2] - left) * sx).clamp(0, out_w)
    y2 = ((b[..., 3] - top) * sy).clamp(0, out_h)
    if flip is not None:
        x1, x2 = torch.where(flip, out_w - x2, x1), torch.where(flip, out_w - x1, x2)
    keep = (x2 - x1 >= min_side) & (y2 - y1 >= min_side)
    return torch.stack([x1, y1, x2, y2], -1), keep


def map_boxes(boxes: torch.Tensor, labels: torch.Tensor, window: Window,
              size: tuple[int, int], flip: bool = False, min_side: float = MIN_SIDE
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One image's boxes (float [n, 4], xyxy source pixels) and labels (int64 [n]) in the
    output image that ``window`` resized to ``size`` (height, width), flipped when ``flip``:
    clipped to it, those under ``min_side`` pixels wide or high dropped."""
    # ``_map``'s arithmetic in numpy: the same float32 operations in the same order (the
    # scalars rounded to float32 as torch rounds them), for one image's few boxes at a few
    # microseconds an operation where torch's dispatch takes ten (0.2 of 1.4 ms an image
    # on the folder path went to these, under the decode threads' GIL)
    # (all four columns at once: x1, y1, x2, y2 each take their own axis's offset, scale
    # and bound, element by element as torch does)
    out_h, out_w = size
    b = boxes.numpy().astype(np.float32, copy=False).reshape(-1, 4)
    sx, sy = out_w / window.width, out_h / window.height
    offset = np.array([window.left, window.top] * 2, dtype=np.float32)
    scale = np.array([sx, sy] * 2, dtype=np.float32)
    bound = np.array([out_w, out_h] * 2, dtype=np.float32)
    mapped = (b - offset) * scale
    np.clip(mapped, 0, bound, out=mapped)
    if flip:
        mapped[:, 0::2] = bound[0] - mapped[:, 2::-2]
    keep = ((mapped[:, 2] - mapped[:, 0] >= min_side)
            & (mapped[:, 3] - mapped[:, 1] >= min_side))
    return torch.from_numpy(mapped[keep]), labels[torch.from_numpy(keep)]


def pad(boxes: list[torch.Tensor], labels: list[torch.Tensor], max_boxes: int | None = None
        ) -> dict[str, torch.Tensor]:
    """Per-image boxes [n_i, 4] and labels [n_i] as a batch's padded targets: ``boxes``
    float32 [B, M, 4], ``box_labels`` int64 [B, M], ``box_count`` int64 [B]; M is the most
    boxes of an image (at least 1, so no dimension is empty), or ``max_boxes`` (a fixed
    shape; an image with more is an error: drop boxes before, not here)."""
    # numpy, one row copy an image: the collate runs on the loop's thread beside the decode
    # threads, where torch's intra-op parallel ops (repeat_interleave, index_put) waited for
    # busy cores: 9 ms a batch of 32 measured in the bench yolo loop, 0.05 ms here
    counts = [len(b) for b in boxes]
    most = max(counts, default=0)
    m = max(most, 1) if max_boxes is None else max_boxes
    if most > m:
        raise ValueError(f"an image has {most} boxes, more than max_boxes={m}")
    out = np.zeros((len(boxes), m, 4), dtype=np.float32)
    out_labels = np.full((len(boxes), m), PAD_LABEL, dtype=np.int64)
    for k, (b, lab, n) in enumerate(zip(boxes, labels, counts)):
        if n:
            out[k, :n] = b.detach().cpu().numpy().reshape(-1, 4)
            out_labels[k, :n] = lab.detach().cpu().numpy().reshape(-1)
    return {"boxes": torch.from_numpy(out), "box_labels": torch.from_numpy(out_labels),
            "box_count": torch.tensor(counts, dtype=torch.int64)}


def gather_padded(boxes: torch.Tensor, labels: torch.Tensor, starts: torch.Tensor,
                  counts: torch.Tensor) -> dict[str, torch.Tensor]:
    """``pad``'s form for images whose boxes lie in one flat ragged store (memmap's and
    ram's side store, runner/data/storage/decoded.py): image ``k``'s are rows
    ``starts[k]`` to ``starts[k] + counts[k]`` of ``boxes`` [C, 4] and ``labels`` [C]. One
    gather and one scatter for the batch (``repeat_interleave`` turns the counts into
    each box's row, column and source row): no Python loop over images or boxes."""
    n, counts = len(counts), counts.to(torch.int64)
    total = int(counts.sum())
    m = max(int(counts.max()) if n else 0, 1)
    out = torch.zeros((n, m, 4), dtype=torch.float32)
    out_labels = torch.full((n, m), PAD_LABEL, dtype=torch.int64)
    if total:
        rows = torch.repeat_interleave(torch.arange(n), counts)
        first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        cols = torch.arange(total) - first
        source = torch.repeat_interleave(starts.to(torch.int64), counts) + cols
        out[rows, cols] = boxes.index_select(0, source).to(torch.float32)
        out_labels[rows, cols] = labels.index_select(0, source).to(torch.int64)
    return {"boxes": out, "box_labels": out_labels, "box_count": counts.clone()}


def unpad(boxes: torch.Tensor, labels: torch.Tensor, counts: torch.Tensor
          ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The padded targets back as per-image (boxes [n, 4], labels [n]) (for a model that
    takes lists, and for the tests)."""
    return [(boxes[i, :n], labels[i, :n]) for i, n in enumerate(counts.tolist())]


def map_padded(boxes: torch.Tensor, labels: torch.Tensor, counts: torch.Tensor,
               windows: Boxes, size: tuple[int, int], min_side: float = MIN_SIDE
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch's padded targets (``pad``'s form, on any device) through each image's window
    and flip (``windows``: ``BatchAugment.boxes``' crops, or ``center_windows``), to
    ``size``: the kept boxes first in each row in their order, the rest padding, and the new
    counts. No Python loop over images or boxes, no host sync."""
    m = boxes.shape[1]
    mapped, keep = _map(boxes, windows.top[:, None], windows.left[:, None],
                        windows.height[:, None], windows.width[:, None], tuple(size),
                        windows.flip[:, None], min_side)
    present = torch.arange(m, device=boxes.device)[None, :] < counts[:, None]
    keep &= present
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices  # kept first
    kept = keep.gather(1, order)
    mapped = mapped.gather(1, order[..., None].expand(-1, -1, 4))
    out_boxes = torch.where(kept[..., None], mapped, torch.zeros_like(mapped))
    out_labels = torch.where(kept, labels.gather(1, order), torch.full_like(labels, PAD_LABEL))
    return out_boxes, out_labels, keep.sum(1)


def center_windows(n: int, hw: tuple[int, int], size: tuple[int, int], fraction: float,
                   device: torch.device | str = "cpu") -> Boxes:
    """``CenterCrop``'s window on ``n`` stored images of ``hw`` (the centred ``fraction``
    of the shorter side, ``pixel_window``'s integer window), unflipped, as the ``Boxes``
    ``map_padded`` takes."""
    h, w = hw
    top, left, ch, cw = pixel_window(center_box(h, w, *size, fraction), h, w)

    def const(v: float) -> torch.Tensor:
        return torch.full((n,), float(v), dtype=torch.float32, device=device)

    return Boxes(const(top), const(left), const(ch), const(cw),
                 torch.zeros(n, dtype=torch.bool, device=device))


def shown_window(hw: tuple[int, int], size: tuple[int, int], crop: Crop, fraction: float
                 ) -> Window:
    """The part of an upright ``hw`` source image that an output image of ``size`` made by
    the deterministic ``crop`` shows: the whole image, the letterbox's (the whole image
    and its pads, ``letterbox_window``), or the centre crop's window
    (``pixel_window``'s integer window cut from the source; a store that cut it from its
    stored image, a resize of the source, is within a stored pixel of it)."""
    if crop is Crop.random:
        raise ValueError("a random crop's window depends on the image's crop seed")
    h, w = hw
    if crop is Crop.whole:
        return Window(0.0, 0.0, float(h), float(w))
    if crop is Crop.letterbox:  # the whole image and the pads around it
        return Window(*letterbox_window((0.0, 0.0, float(h), float(w)), tuple(size)))
    return cut_window(center_box(h, w, *size, fraction), hw)


def to_source(boxes: torch.Tensor, windows: torch.Tensor,
              size: tuple[int, int] | torch.Tensor) -> torch.Tensor:
    """Boxes [B, K, 4] in pixels of output images of ``size`` (one (height, width), or
    one per image [B, 2]: batches of aspect bins, ``loader.group_aspect``) back into pixels
    of their source images, each image's ``windows`` row (top, left, height, width: [B, 4],
    the ``Window`` it shows) undone: ``x = left + x' * width / out_w``, the same for y; the
    inverse of ``map_boxes`` for a box the crop kept whole."""
    w = windows.to(torch.float64)
    if isinstance(size, torch.Tensor):
        out_h, out_w = size.to(torch.float64).reshape(-1, 2).unbind(1)
    else:
        out_h, out_w = size
    scale = torch.stack([w[:, 3] / out_w, w[:, 2] / out_h] * 2, -1)[:, None, :]
    offset = torch.stack([w[:, 1], w[:, 0]] * 2, -1)[:, None, :]
    return (boxes.to(torch.float64) * scale + offset).to(boxes.dtype)
