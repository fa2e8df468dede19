"""Data the runner did not make: handwritten digits on photographs, for the recipes' check.

The detection and masks recipes learn on the runner's own generated sets (shapes.py). Whether
they learn on anything else is a separate question, asked here with data that comes from
elsewhere: the 1,797 handwritten digits that scikit-learn ships (``load_digits``, 8x8 scans
of 43 writers, UCI's "optical recognition of handwritten digits") set on crops of the
photographs that scikit-image ships (``skimage.data``: astronaut, coffee, chelsea, camera,
coins, rocket, ...). Neither is ours; only the composition is. What it writes differs from
the shapes set on every axis a detector or segmenter could have overfitted to:

- non-square images of five sizes (W x H: 192x128, 128x192, 176x144, 160x120, 144x176);
- real photographs behind, real handwriting in front (upscaled 3x to 6x, bilinear), 1 to 4
  digits an image, never touching;
- four classes with COCO category ids that have gaps (``zero`` 3, ``one`` 8, ``four`` 17,
  ``seven`` 42), in COCO's layout: ``coco/annotations/instances_{train,val}.json`` with
  ``bbox`` and ``segmentation`` (RLE, pycocotools), images in ``coco/train/``,
  ``coco/val/``;
- the same images in the masks layout: ``masks/images/{train,val}/*.jpg`` beside
  ``masks/masks/{train,val}/*.png`` of class ids (0 background, 1..4 the digits in category
  order, 255 the ring of pixels at each digit's edge, which neither side can claim).

A digit's box is the extent of its mask (ink above 5/16 after upscaling), so boxes and masks
agree. Deterministic from ``--seed``::

    pip install scikit-learn scikit-image        # the two packages that ship the data
    python -m runner.bench.foreign --out outputs/foreign
    python -m runner recipe=detect_shapes dataset.path=outputs/foreign/coco logger=none

It needs pycocotools (``.[dev]``) for the RLE.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

SIZES = ((192, 128), (128, 192), (176, 144), (160, 120), (144, 176))  # W, H
DIGITS = (0, 1, 4, 7)  # distinct strokes: learnable in a CPU recipe's budget
CATEGORY_IDS = (3, 8, 17, 42)  # COCO-style ids with gaps
NAMES = ("zero", "one", "four", "seven")
PHOTOS = ("astronaut", "coffee", "chelsea", "camera", "coins", "rocket", "immunohistochemistry",
          "moon", "brick", "grass", "gravel", "colorwheel")
INK = 5 / 16  # a pixel is the digit's where its (upscaled) ink is above this
IGNORE = 255
FLOOR = 2 / 16  # ink at or below this is the scanner's background


def _needs() -> tuple:
    try:
        import skimage.data
        import sklearn.datasets
    except ImportError as e:
        raise SystemExit(f"error: {e.name} is missing: pip install scikit-learn scikit-image "
                         "(they ship the digits and the photographs)") from None
    return sklearn.datasets, skimage.data


def photographs() -> list[np.ndarray]:
    """The bundled photographs as uint8 RGB (greyscale ones repeated), large enough to crop."""
    _, data = _needs()
    out = []
    for name in PHOTOS:
        try:
            img = np.asarray(getattr(data, name)())
        except Exception:  # one that needs a download (pooch) on this version: left out
            continue
        if img.ndim == 2:
            img = np.repeat(img[..., None], 3, axis=2)
        img = img[..., :3]
        if img.dtype != np.uint8:
            img = (255 * (img - img.min()) / max(np.ptp(img), 1e-6)).astype(np.uint8)
        if min(img.shape[:2]) >= 200:
            out.append(img)
    if len(out) < 3:
        raise SystemExit("error: scikit-image gave fewer than 3 bundled photographs")
    return out


def digit_glyph(image8: np.ndarray, scale: int) -> np.ndarray:
    """An 8x8 digit scan (0..16) upscaled ``scale`` times, bilinear, as ink in [0, 1]."""
    import torch
    import torch.nn.functional as F

    t = torch.from_numpy(image8.astype(np.float32) / 16.0)[None, None]
    up = F.interpolate(t, scale_factor=scale, mode="bilinear", align_corners=False)
    # the scans' faint background (1-2 of 16) would draw a box around each digit: floored
    return ((up[0, 0] - FLOOR) / (1 - FLOOR)).clamp(0, 1).numpy()


def _free(taken: list[tuple[int, int, int, int]], box: tuple[int, int, int, int], gap: int) -> bool:
    x0, y0, x1, y1 = box
    return all(x1 + gap <= a or b + gap <= x0 or y1 + gap <= c or d + gap <= y0
               for a, c, b, d in taken)


def compose(rng: np.random.Generator, photos: list[np.ndarray], glyphs: dict[int, list]):
    """One image: a photo crop at one of ``SIZES`` and 1-4 digits; its RGB, class-id mask
    (0 background, 1..K, IGNORE at edges) and per digit (class index, mask of its pixels)."""
    w, h = SIZES[rng.integers(len(SIZES))]
    photo = photos[rng.integers(len(photos))]
    ph, pw = photo.shape[:2]
    scale = rng.uniform(0.6, 1.0)
    cw, ch = int(min(pw, w / scale)), int(min(ph, h / scale))
    top, left = rng.integers(0, ph - ch + 1), rng.integers(0, pw - cw + 1)
    from PIL import Image

    crop = Image.fromarray(np.ascontiguousarray(photo[top:top + ch, left:left + cw]))
    canvas = np.asarray(crop.resize((w, h), Image.BILINEAR)).astype(np.float32)
    target = np.zeros((h, w), np.uint8)
    objects, taken = [], []
    for _ in range(int(rng.integers(1, 5))):
        cls = int(rng.integers(len(DIGITS)))
        pool = glyphs[DIGITS[cls]]
        ink = digit_glyph(pool[rng.integers(len(pool))], int(rng.integers(3, 7)))
        gh, gw = ink.shape
        for _try in range(20):
            y, x = int(rng.integers(0, h - gh + 1)), int(rng.integers(0, w - gw + 1))
            on = ink > INK
            ys, xs = np.nonzero(on)
            box = (x + xs.min(), y + ys.min(), x + xs.max() + 1, y + ys.max() + 1)
            if _free(taken, box, 3):
                break
        else:
            continue
        taken.append(box)
        region = canvas[y:y + gh, x:x + gw]
        local = region.mean(axis=(0, 1))
        # ink far from the background under it, in a random hue
        colour = np.where(local > 127, rng.uniform(0, 60, 3), rng.uniform(195, 255, 3))
        region[:] = region * (1 - ink[..., None]) + colour * ink[..., None]
        full = np.zeros((h, w), bool)
        full[y:y + gh, x:x + gw] = on
        edge = np.zeros((h, w), bool)
        edge[y:y + gh, x:x + gw] = (ink > 0.15) & ~on  # the anti-aliased ring
        target[full] = cls + 1
        target[edge & (target == 0)] = IGNORE
        objects.append((cls, full))
    return canvas.clip(0, 255).astype(np.uint8), target, objects


def make(out: Path, num_images: int = 500, val_fraction: float = 0.2, seed: int = 0) -> Path:
    """Write both layouts under ``out`` (``coco/`` and ``masks/``); returns ``out``."""
    from PIL import Image
    from pycocotools import mask as coco_mask

    datasets, _ = _needs()
    digits = datasets.load_digits()
    glyphs = {d: digits.images[digits.target == d] for d in DIGITS}
    photos = photographs()
    rng = np.random.default_rng(seed)
    val = set(rng.permutation(num_images)[:int(num_images * val_fraction)].tolist())
    coco = {s: {"images": [], "annotations": [],
                "categories": [{"id": i, "name": n} for i, n in zip(CATEGORY_IDS, NAMES)]}
            for s in ("train", "val")}
    for split in ("train", "val"):
        for d in (out / "coco" / split, out / "masks" / "images" / split,
                  out / "masks" / "masks" / split):
            d.mkdir(parents=True, exist_ok=True)
    ann_id = 1
    for i in range(num_images):
        split = "val" if i in val else "train"
        rgb, target, objects = compose(rng, photos, glyphs)
        name = f"{i:05d}"
        Image.fromarray(rgb).save(out / "coco" / split / f"{name}.jpg", quality=90)
        Image.fromarray(rgb).save(out / "masks" / "images" / split / f"{name}.jpg", quality=90)
        Image.fromarray(target).save(out / "masks" / "masks" / split / f"{name}.png")
        h, w = target.shape
        image_id = 1000 + i  # ids that are not indices either
        coco[split]["images"].append({"id": image_id, "file_name": f"{name}.jpg",
                                      "width": w, "height": h})
        for cls, full in objects:
            rle = coco_mask.encode(np.asfortranarray(full.astype(np.uint8)))
            x, y, bw, bh = (float(v) for v in coco_mask.toBbox(rle))
            rle["counts"] = rle["counts"].decode("ascii")
            coco[split]["annotations"].append({
                "id": ann_id, "image_id": image_id, "category_id": CATEGORY_IDS[cls],
                "bbox": [x, y, bw, bh], "area": float(full.sum()), "iscrowd": 0,
                "segmentation": rle})
            ann_id += 1
    (out / "coco" / "annotations").mkdir(parents=True, exist_ok=True)
    for split, doc in coco.items():
        (out / "coco" / "annotations" / f"instances_{split}.json").write_text(json.dumps(doc))
    # the class-id PNGs hold 0 for the background: its name first
    (out / "masks" / "classes.txt").write_text("\n".join(("background", *NAMES)) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runner.bench.foreign",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("outputs/foreign"))
    p.add_argument("--images", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    make(args.out, args.images, seed=args.seed)
    print(f"wrote {args.images} images: {args.out / 'coco'} (COCO, ids {list(CATEGORY_IDS)}) "
          f"and {args.out / 'masks'} (images/ + masks/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
