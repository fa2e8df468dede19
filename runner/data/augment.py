"""Training augmentation that survives pre-decoding: random-resized-crop + flip per image,
applied to a whole uint8 batch on the device it was moved to (``dataset.crop=random`` with
``loader=memmap`` or ``loader=ram``, whose caches hold deterministic center crops).

Each image gets its own crop (torchvision's RandomResizedCrop parameters) and flip, all
drawn on the device and applied with one ``grid_sample`` for the whole batch: a constant
number of kernels per batch, no host round trip, no sync. The sampling grid reproduces a
bilinear resize of each crop (``align_corners=False``, source coordinates clamped to the
crop, as ``interpolate`` does); crops of a cached image are never larger than the output,
so the resize only upsamples and antialiasing has nothing to do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runner.data.threads import RowPool

ATTEMPTS = 10  # torchvision's: tries per image before the fallback crop


@dataclass
class Boxes:
    """Per-image crops (integer pixels, as tensors on the device) and flips."""

    top: torch.Tensor
    left: torch.Tensor
    height: torch.Tensor
    width: torch.Tensor
    flip: torch.Tensor  # bool


def center_crop(images: torch.Tensor, size: tuple[int, int] | list[int]) -> torch.Tensor:
    """The centred ``size`` window of every image of an (N, C, H, W) batch (a view)."""
    h, w = images.shape[-2:]
    top, left = (h - int(size[0])) // 2, (w - int(size[1])) // 2
    return images[..., top : top + int(size[0]), left : left + int(size[1])]


class CenterCrop:
    """The device-side stage of ``dataset.crop=center`` over a store larger than the
    output (``dataset.store_size``): the centred window, as "resize 256, crop 224" does."""

    def __init__(self, size: tuple[int, int]):
        self.size = tuple(size)

    def __call__(self, images: torch.Tensor, draws: dict | None = None,
                 rows: RowPool | None = None) -> torch.Tensor:
        return center_crop(images, self.size)


class BatchAugment:
    """uint8 (N, 3, H, W) -> uint8 (N, 3, *size), each image randomly cropped and flipped.

    Args:
        size: output (height, width).
        scale: range of the crop's share of the image area.
        ratio: range of the crop's aspect ratio.
    """

    def __init__(self, size: tuple[int, int], scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
        self.size, self.scale, self.ratio = list(size), scale, ratio

    @staticmethod
    def draws(n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """The uniform draws that decide ``n`` images' crops and flips, made on the host
        from ``generator``: a batch carries them to the device (no sync, and a resumed run
        replays them exactly when the generator is seeded by the batch's place)."""
        return {"crop_area": torch.rand(n, ATTEMPTS, generator=generator),
                "crop_aspect": torch.rand(n, ATTEMPTS, generator=generator),
                "crop_place": torch.rand(n, 3, generator=generator)}

    def boxes(self, n: int, h: int, w: int, device: torch.device,
              generator: torch.Generator | None = None,
              draws: dict[str, torch.Tensor] | None = None) -> Boxes:
        """RandomResizedCrop.get_params for ``n`` images at once: ``ATTEMPTS`` draws each,
        the first that fits, else the whole image clipped to the ratio range. ``draws``
        (``BatchAugment.draws``, on ``device``) replace the device's own random numbers."""
        def rand(key: str, cols: int) -> torch.Tensor:
            if draws is not None:
                return draws[key]
            return torch.rand(n, cols, device=device, generator=generator)

        def uniform(u: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
            return u * (hi - lo) + lo

        area = h * w
        target = area * uniform(rand("crop_area", ATTEMPTS), *self.scale)
        aspect = torch.exp(uniform(rand("crop_aspect", ATTEMPTS), math.log(self.ratio[0]),
                                   math.log(self.ratio[1])))
        cw = torch.round(torch.sqrt(target * aspect))
        ch = torch.round(torch.sqrt(target / aspect))
        fits = (cw > 0) & (cw <= w) & (ch > 0) & (ch <= h)
        first = torch.argmax(fits.int(), dim=1, keepdim=True)  # first fitting attempt
        any_fit = fits.any(dim=1)
        cw = cw.gather(1, first).squeeze(1)
        ch = ch.gather(1, first).squeeze(1)
        # the fallback: the whole image, clipped to the ratio range (a constant per batch)
        in_ratio = w / h
        if in_ratio < min(self.ratio):
            fw, fh = w, int(round(w / min(self.ratio)))
        elif in_ratio > max(self.ratio):
            fw, fh = int(round(h * max(self.ratio))), h
        else:
            fw, fh = w, h
        cw = torch.where(any_fit, cw, torch.full_like(cw, fw))
        ch = torch.where(any_fit, ch, torch.full_like(ch, fh))
        r = rand("crop_place", 3)
        top = torch.floor(r[:, 0] * (h - ch + 1))
        left = torch.floor(r[:, 1] * (w - cw + 1))
        top = torch.where(any_fit, top, torch.full_like(top, (h - fh) // 2))
        left = torch.where(any_fit, left, torch.full_like(left, (w - fw) // 2))
        return Boxes(top, left, ch, cw, r[:, 2] < 0.5)

    def apply(self, images: torch.Tensor, boxes: Boxes) -> torch.Tensor:
        """Crop, resize and flip every image by its box, in one grid_sample."""
        n, _, h, w = images.shape
        out_h, out_w = self.size

        def axis(start: torch.Tensor, length: torch.Tensor, out: int, size: int) -> torch.Tensor:
            # output pixel j samples crop coordinate (j + 0.5) * length / out - 0.5, clamped
            # to the crop, as a bilinear interpolate of the crop does
            j = torch.arange(out, device=images.device, dtype=torch.float32) + 0.5
            src = start[:, None] + j[None, :] * (length[:, None] / out) - 0.5
            src = torch.minimum(torch.maximum(src, start[:, None]),
                                (start + length - 1)[:, None])
            return (src + 0.5) * (2.0 / size) - 1.0  # grid_sample's normalized coordinates

        xs = axis(boxes.left, boxes.width, out_w, w)
        xs = torch.where(boxes.flip[:, None], xs.flip(1), xs)
        ys = axis(boxes.top, boxes.height, out_h, h)
        grid = torch.stack(torch.broadcast_tensors(xs[:, None, :], ys[:, :, None]), dim=-1)
        out = F.grid_sample(images.float(), grid, mode="bilinear", padding_mode="border",
                            align_corners=False)
        return out.round_().clamp_(0, 255).to(images.dtype)

    def per_image(self, images: torch.Tensor, boxes: Boxes, rows: RowPool) -> torch.Tensor:
        """The same crops on the CPU, image by image with the antialiased uint8 resize (no
        float batch), split over ``rows``' threads: measured here 5x the batched
        ``grid_sample``, whose float conversion and sampling dominate on a CPU."""
        n = images.shape[0]
        out = torch.empty((n, images.shape[1], *self.size), dtype=images.dtype)
        top, left = boxes.top.tolist(), boxes.left.tolist()
        height, width, flip = boxes.height.tolist(), boxes.width.tolist(), boxes.flip.tolist()

        def crop(a: int, b: int) -> None:
            for i in range(a, b):
                t, l_, h, w = int(top[i]), int(left[i]), int(height[i]), int(width[i])
                window = images[i : i + 1, :, t : t + h, l_ : l_ + w]
                resized = F.interpolate(window, size=self.size, mode="bilinear",
                                        antialias=True, align_corners=False)[0]
                out[i].copy_(resized.flip(2) if flip[i] else resized)

        rows.run(crop, n)
        return out

    def __call__(self, images: torch.Tensor, draws: dict[str, torch.Tensor] | None = None,
                 rows: RowPool | None = None) -> torch.Tensor:
        n, _, h, w = images.shape
        boxes = self.boxes(n, h, w, images.device, draws=draws)
        if rows is not None and images.device.type == "cpu":
            return self.per_image(images, boxes, rows)
        return self.apply(images, boxes)
