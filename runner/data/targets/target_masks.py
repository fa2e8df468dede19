"""``dataset.targets=masks``: a class per pixel (semantic segmentation), 255 ignored.

Read by runner/data/sources/masklabels.py (``images/`` and ``masks/`` side by side, or COCO's
polygons and RLE by pycocotools); unset ``dataset.path``, the generated shapes set with its
masks (``default_masks_path``). A batch carries each image's mask as ``mask`` uint8
[B, H, W] (class ids, ``IGNORE`` = 255 where no class is known), at the image's size; a
decode's crop, resize and flip move it with the pixels (``sample_fields``), a device crop
too (``follow``), both by runner/data/decode/maskgeometry.py (NEAREST, as torchvision v2
moves a ``tv_tensors.Mask``). A segmenter
(runner/model/families.py) trains on it with per-pixel cross-entropy and is scored by mean
IoU (``val_miou``); ``task=infer`` writes its masks.
"""

from __future__ import annotations

from pathlib import Path

import torch

from runner.config.schema import Crop, DatasetConfig, Output, Split, TargetName
from runner.data.decode.boxgeometry import Window
from runner.data.decode.maskgeometry import map_mask, map_masks
from runner.data.protocol import Sample
from runner.data.sources.masklabels import (
    MaskTargets,
    default_masks_path,
    has_mask_split,
    list_masks,
)
from runner.data.targets.target import TargetKind

MASK_KEYS = ("mask",)


def collate(samples: list[Sample]) -> dict[str, torch.Tensor]:
    """The samples' masks stacked (every image of a batch has the batch's size)."""
    if not samples or samples[0].mask is None:
        return {}
    return {"mask": torch.stack([s.mask for s in samples])}


def follow(batch, windows, size: tuple[int, int]) -> None:
    """A batch's masks through each image's window and flip, on its device (maskgeometry's
    ``map_masks``: one gather, each image as torchvision v2 moves a ``tv_tensors.Mask``)."""
    batch["mask"] = map_masks(batch["mask"], windows, tuple(size))


def sample_fields(targets: MaskTargets, index: int, window: tuple[float, float, float, float],
                  flip: bool, size: tuple[int, int], hw: tuple[int, int] | None = None
                  ) -> dict[str, torch.Tensor]:
    """Image ``index``'s mask (read from its file or rasterised now) through the window and
    flip the decoder cut its pixels by, at ``size`` (NEAREST); a window in the pixels of a
    decode at another size than the mask's (a DCT-reduced one) is scaled to the mask's."""
    mask = torch.from_numpy(targets.mask(index))
    top, left, height, width = window
    if hw is not None and tuple(mask.shape) != tuple(hw):
        sy, sx = mask.shape[0] / hw[0], mask.shape[1] / hw[1]
        top, left, height, width = top * sy, left * sx, height * sy, width * sx
    return {"mask": map_mask(mask, Window(top, left, height, width), tuple(size), flip)}


def has_val_split(dataset: DatasetConfig) -> bool:
    """A masks layout with a training and a validation split of its own (images/train and
    images/val beside masks/, COCO's instances_train and instances_val), or the generated
    set (unset ``dataset.path``)."""
    if dataset.val_path is not None or dataset.val_fraction > 0 or dataset.manifest:
        return False
    if dataset.path is None:
        return True  # the generated shapes masks set: images/val
    root = Path(dataset.path).expanduser()
    return has_mask_split(root, Split.val.value) and has_mask_split(root, Split.train.value)


KIND = TargetKind(
    name=TargetName.masks,
    summary="a class per pixel: a PNG of class ids per image (255: ignored)",
    batch_keys=MASK_KEYS,
    collate=collate,
    follow=follow,
    eval_crop=Crop.whole,
    mixes=False,
    best="val_miou",
    figures=("miou", "pixel_accuracy"),
    outputs=(Output.masks,),
    applies=frozenset({Output.masks, Output.embeddings}),  # its task.embed_layer's
    recipe="segment_shapes",
    sample_fields=sample_fields,
    has_val_split=has_val_split,
    list_labelled=list_masks,  # the images that have a mask, each with it
    default_path=default_masks_path,
    setting="dataset.targets=masks (images/ and masks/ side by side at dataset.path)",
)
