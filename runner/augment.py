"""Training augmentation that survives pre-decoding: random-resized-crop + flip per image,
applied to a whole uint8 batch on the device it was moved to (``dataset.crop=random`` with
``loader=memmap`` or ``loader=ram``, whose caches hold deterministic center crops).

Each image gets its own crop (torchvision's RandomResizedCrop parameters, from torch's
seeded RNG) through ``torchvision.transforms.v2.functional.resized_crop``; the flips are
one batched ``torch.where``.
"""

from __future__ import annotations

import torch
import torchvision.transforms.v2.functional as TF

from runner.storage.decode import random_box


class BatchAugment:
    """uint8 (N, 3, H, W) -> uint8 (N, 3, H, W), each image randomly cropped and flipped.

    Args:
        size: output (height, width).
        scale: range of the crop's share of the image area.
        ratio: range of the crop's aspect ratio.
    """

    def __init__(self, size: tuple[int, int], scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
        self.size, self.scale, self.ratio = list(size), scale, ratio

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        n, c, h, w = images.shape
        out = torch.empty((n, c, *self.size), dtype=images.dtype, device=images.device)
        for k in range(n):
            box = random_box(h, w, self.scale, self.ratio)
            out[k] = TF.resized_crop(images[k], int(box.top), int(box.left), int(box.height),
                                     int(box.width), self.size, antialias=True)
        flip = (torch.rand(n) < 0.5).to(images.device).view(n, 1, 1, 1)
        return torch.where(flip, out.flip(-1), out)
