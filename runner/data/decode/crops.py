"""Training augmentation that survives pre-decoding: random-resized-crop + flip per image,
applied to a whole uint8 batch on the device it was moved to (``dataset.crop=random`` with
``loader=memmap`` or ``loader=ram``, whose caches hold deterministic center crops).

Each image gets its own crop (torchvision's RandomResizedCrop parameters) and flip, decided
by the same per-image uniforms as a folder's or packed store's decode of that image
(``runner/data/decode/decoders.py``: ``crop_uniforms``, ``random_box``), carried to the
device with the batch; on a GPU they are applied with one ``grid_sample`` for the whole
batch: a constant number of kernels per batch, no host round trip, no sync. On a CPU
device each image is cut and resized alone, split over the runner's row threads
(``BatchAugment.per_image``). The GPU's sampling grid reproduces a bilinear resize of
each crop (``align_corners=False``, source coordinates clamped to the crop, as
``interpolate`` does), without antialiasing: exact for the enlargements nearly every crop
is, not for the few crops larger than the output of a store at ``dataset.store_size``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runner.data.decode.decoders import ATTEMPTS, CROP_UNIFORMS, fallback_box
from runner.data.threads import RowPool


@dataclass
class Boxes:
    """Per-image crops (integer pixels, as tensors on the device) and flips."""

    top: torch.Tensor
    left: torch.Tensor
    height: torch.Tensor
    width: torch.Tensor
    flip: torch.Tensor  # bool


class CenterCrop:
    """The device-side stage of ``dataset.crop=center`` over a store larger than the
    output (``dataset.store_size``): the centred ``fraction`` of the stored shorter side
    (``dataset.crop_fraction``, as every storage crops), a window with no resize when that
    is the output size (a store at 256, 224 at 0.875), else resized to it."""

    def __init__(self, size: tuple[int, int], fraction: float = 1.0):
        self.size, self.fraction = tuple(int(v) for v in size), fraction

    def __call__(self, images: torch.Tensor, draws: dict | None = None,
                 rows: RowPool | None = None) -> torch.Tensor:
        from runner.data.decode.decoders import center_box, pixel_window

        h, w = images.shape[-2:]
        top, left, ch, cw = pixel_window(center_box(h, w, *self.size, self.fraction), h, w)
        window = images[..., top : top + ch, left : left + cw]
        if (ch, cw) == self.size:
            return window
        if images.device.type == "cpu":  # image by image on the row threads (uint8)
            from runner.data.decode.decoders import resize_into

            out = torch.empty((*images.shape[:-2], *self.size), dtype=images.dtype)

            def resize(a: int, b: int) -> None:
                for i in range(a, b):
                    resize_into(out[i], window[i])

            if rows is None:
                resize(0, len(out))
            else:
                rows.run(resize, len(out))
            return out
        out = F.interpolate(window.float(), size=list(self.size), mode="bilinear",
                            antialias=True, align_corners=False)
        return out.round_().clamp_(0, 255).to(images.dtype)


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
    def draws(seeds: list[int]) -> dict[str, torch.Tensor]:
        """The uniforms that decide each image's crop and flip, from its crop seed (the batch
        order's, a function of the run's seed, the epoch and the image: the draws a folder
        or packed decode takes for the same image), made on the host: a batch carries them
        to the device (no sync; a resumed run replays them exactly)."""
        from runner.data.decode.decoders import crop_uniforms

        return {"crop_uniforms": torch.tensor([crop_uniforms(s) for s in seeds],
                                              dtype=torch.float64)}

    def boxes(self, n: int, h: int, w: int, device: torch.device,
              generator: torch.Generator | None = None,
              draws: dict[str, torch.Tensor] | None = None) -> Boxes:
        """``random_box`` (runner/data/decode/decoders.py) for ``n`` images at once:
        ``ATTEMPTS`` tries each, the first that fits, else the whole image clipped to the
        ratio range; continuous, as there. ``draws`` (``BatchAugment.draws``, on
        ``device``) replace the device's own random numbers. Worked out in float64, as
        ``random_box`` is (a float32 box could round to a pixel another storage does not
        cut for the same seed; n values, so the cost is nothing even on a GPU's slow
        float64), and handed to ``apply`` in float32."""
        u = draws["crop_uniforms"] if draws is not None else torch.rand(
            n, CROP_UNIFORMS, device=device, generator=generator)
        u = u.to(torch.float64)
        scale, (lo, hi) = self.scale, (math.log(self.ratio[0]), math.log(self.ratio[1]))
        target = (h * w) * (scale[0] + u[:, :ATTEMPTS] * (scale[1] - scale[0]))
        aspect = torch.exp(lo + u[:, ATTEMPTS : 2 * ATTEMPTS] * (hi - lo))
        cw, ch = torch.sqrt(target * aspect), torch.sqrt(target / aspect)
        fits = (cw <= w) & (ch <= h)
        first = torch.argmax(fits.int(), dim=1, keepdim=True)  # first fitting attempt
        any_fit = fits.any(dim=1)
        cw, ch = cw.gather(1, first).squeeze(1), ch.gather(1, first).squeeze(1)
        fallback = fallback_box(h, w, self.ratio)  # a constant per batch
        cw = torch.where(any_fit, cw, torch.full_like(cw, fallback.width))
        ch = torch.where(any_fit, ch, torch.full_like(ch, fallback.height))
        place = u[:, 2 * ATTEMPTS :]
        top = torch.where(any_fit, place[:, 0] * (h - ch), torch.full_like(ch, fallback.top))
        left = torch.where(any_fit, place[:, 1] * (w - cw), torch.full_like(cw, fallback.left))
        # integer windows, rounded as resize_crop_many rounds a box (pixel_window)
        top, left = torch.round(top), torch.round(left)
        ch = torch.clamp(torch.minimum(torch.round(ch), h - top), min=1)
        cw = torch.clamp(torch.minimum(torch.round(cw), w - left), min=1)
        return Boxes(*(v.to(torch.float32) for v in (top, left, ch, cw)), place[:, 2] < 0.5)

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

    def per_image(self, images: torch.Tensor, uniforms: torch.Tensor, rows: RowPool
                  ) -> torch.Tensor:
        """The crops on a CPU device, image by image, everything per image on ``rows``'
        threads (the main thread only hands out slices: no batch-wide box computation
        between the gather and the crops): each image's box from its uniforms by the
        decoders' own ``random_box`` (the same float64 arithmetic: a store holding the
        whole image gives a folder decode's crop exactly), its window enlarged by the
        libjpeg binding's bilinear in one call per slice without the GIL, or reduced (a
        store at ``dataset.store_size``) by torch's antialiased uint8 resize
        (runner/data/decode/decoders.py: ``resize_into``). Measured against the batched
        float ``grid_sample``, whose float conversion and sampling dominate on a CPU:
        ``python -m runner.bench stores`` prints both."""
        from runner.data.decode.decoders import (
            pixel_window,
            random_box,
            resize_into,
            upsample,
            upsample_job,
        )

        n, _, h, w = images.shape
        out = torch.empty((n, images.shape[1], *self.size), dtype=images.dtype)

        def crop(a: int, b: int) -> None:
            jobs = []
            for i, u in zip(range(a, b), uniforms[a:b].tolist()):
                box, flip = random_box(h, w, u, self.scale, self.ratio)
                t, l_, ch, cw = pixel_window(box, h, w)
                window = images[i, :, t : t + ch, l_ : l_ + cw]
                job = upsample_job(out[i], window, flip)
                if job is None:
                    resize_into(out[i], window, flip)
                else:
                    jobs.append(job)
            upsample(jobs)

        rows.run(crop, n)
        return out

    def __call__(self, images: torch.Tensor, draws: dict[str, torch.Tensor] | None = None,
                 rows: RowPool | None = None) -> torch.Tensor:
        n, _, h, w = images.shape
        if rows is not None and images.device.type == "cpu":
            uniforms = draws["crop_uniforms"] if draws is not None else torch.rand(
                n, CROP_UNIFORMS, dtype=torch.float64)
            return self.per_image(images, uniforms, rows)
        return self.apply(images, self.boxes(n, h, w, images.device, draws=draws))
