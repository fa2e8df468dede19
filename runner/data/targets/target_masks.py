"""``dataset.targets=masks``: a class per pixel (semantic segmentation), 255 ignored.

Read by runner/data/sources/masklabels.py (``images/`` and ``masks/`` side by side, or COCO's
polygons and RLE by pycocotools); unset ``dataset.path``, the generated shapes set with its
masks (``default_masks_path``). A batch carries each image's mask as ``mask`` uint8
[B, H, W] (class ids, ``IGNORE`` = 255 where no class is known), at the image's size; a
decode's crop, resize and flip move it with the pixels (``sample_fields``), a device crop
too (``follow``), both by runner/data/decode/maskgeometry.py (NEAREST, as torchvision v2
moves a ``tv_tensors.Mask``). The decoded stores keep it as a plane (``TargetPlane``), a
uint8 [N, H, W] beside their images at the stored size, and a batch gathers it as
``mask``. A segmenter
(runner/model/families.py) trains on it with per-pixel cross-entropy and is scored by mean
IoU (``val_miou``); ``task=infer`` writes its masks.

**In a store** (packed, shards): each image's mask is one opaque blob beside its stored
JPEG (``to_blob``: the mask resized to the stored image's size by v2's nearest neighbour
under each pixel's centre, ``NEAREST_EXACT``, aligned with the image's own resize, then a
lossless PNG, runner/data/decode/maskbytes.py),
given back by ``from_blob``; the store never looks inside. Its ``fingerprint`` is every mask
file's bytes (or COCO's shapes), so an edited mask PNG rebuilds the store.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from runner.config.schema import Crop, DatasetConfig, Output, Split, TargetName
from runner.data.decode.boxgeometry import Window
from runner.data.decode.maskbytes import decode_mask, encode_mask
from runner.data.decode.maskgeometry import map_mask, map_masks
from runner.data.protocol import Sample
from runner.data.sources.masklabels import (
    IGNORE,
    MaskTargets,
    default_masks_path,
    has_mask_split,
    list_masks,
)
from runner.data.targets.target import TargetKind, TargetPlane

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
    mask = torch.from_numpy(targets.target(index))  # the listing's, or a store's blob
    top, left, height, width = window
    if hw is not None and tuple(mask.shape) != tuple(hw):
        sy, sx = mask.shape[0] / hw[0], mask.shape[1] / hw[1]
        top, left, height, width = top * sy, left * sx, height * sy, width * sx
    return {"mask": map_mask(mask, Window(top, left, height, width), tuple(size), flip)}


def to_blob(targets, index: int, hw: tuple[int, int]) -> bytes:
    """Image ``index``'s mask (of the listing's ``targets``) as a store keeps it: resized to
    the stored image's upright size ``hw`` by nearest neighbour (a class id is never
    blended), a lossless PNG.

    The store's resize is v2's ``NEAREST_EXACT`` on a ``tv_tensors.Mask`` (output pixel j
    takes input pixel ``floor((j + 0.5) * in / out)``: the one under its centre), not the
    ``NEAREST`` a crop uses (``floor(j * in / out)``), which lies half an input pixel up and
    left of the stored image's own resize (bilinear, centre-aligned); the crop's resize then
    adds its own. Measured on a set whose pixels say their class (tests/data/storage/
    test_stored_masks.py's checker set, stored at 90 for a 48x64 output): a mask agreed with
    its pixels' class on 91.0% of pixels (centre crop) and 92.6% (random crops) with NEAREST
    here, 95.4% and 96.6% with NEAREST_EXACT, against 94.4% and 95.7% on the folder."""
    from torchvision import tv_tensors
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.v2 import functional as TF

    mask = torch.from_numpy(targets.target(index))
    if tuple(mask.shape) != tuple(hw):
        mask = TF.resize(tv_tensors.Mask(mask), list(hw),
                         interpolation=InterpolationMode.NEAREST_EXACT).as_subclass(torch.Tensor)
    return encode_mask(mask.numpy())


def from_blob(blob: bytes) -> np.ndarray:
    """The [H, W] uint8 mask ``to_blob`` wrote."""
    return decode_mask(blob)


def _file_digest(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return hashlib.blake2b(f.read(), digest_size=16).digest()
    except OSError as e:  # gone since the listing: the store's build says so
        return f"unreadable: {e.strerror}".encode()


def fingerprint(targets: MaskTargets, digest) -> None:
    """Update ``digest`` with what a store of these masks depends on: the classes' count,
    each image's size and id, its mask file's bytes (a digest of each, read on threads: a
    few KB per mask, as cheap as the listing's header read) or its COCO shapes."""
    digest.update(b"%d" % targets.num_classes)
    files = [t.file for t in targets.items if t.file is not None]
    with ThreadPoolExecutor(8) as pool:
        hashes = iter(pool.map(_file_digest, files))
    for t in targets.items:
        digest.update(b"\n%d %d %d " % (t.height, t.width, t.image_id))
        digest.update(next(hashes) if t.file is not None else
                      json.dumps(t.shapes, default=str).encode())


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


def probe(bs: int, hw: tuple[int, int], num_classes: int, device: torch.device
          ) -> dict[str, torch.Tensor]:
    """A synthetic batch's masks: random class ids at the image size."""
    return {"mask": torch.randint(0, max(num_classes, 1), (bs, *hw), dtype=torch.uint8,
                                  device=device)}


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
    probe=probe,
    outputs=(Output.masks,),
    applies=frozenset({Output.masks, Output.embeddings}),  # its task.embed_layer's
    recipe="segment_shapes",
    sample_fields=sample_fields,
    has_val_split=has_val_split,
    list_labelled=list_masks,  # the images that have a mask, each with it
    default_path=default_masks_path,
    fingerprint=fingerprint,
    to_blob=to_blob,
    from_blob=from_blob,
    blob_ext="mask.png",  # a PNG to any WebDataset reader, apart from the image's .jpg
    # loader=memmap and loader=ram keep each image's mask at the stored size in a uint8
    # plane beside it (255 where a slot has none), cut on the device with the pixels
    plane=TargetPlane("mask", torch.uint8, IGNORE),
    setting="dataset.targets=masks (images/ and masks/ side by side at dataset.path)",
)
