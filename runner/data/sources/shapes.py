"""The default detection and segmentation datasets: shapes on photo-like backgrounds, exactly.

Made locally and offline, deterministic from a seed, written once in the YOLO layout
(runner/data/sources/labels.py reads it) into the cache, as the default classification
dataset is (runner/data/sources/synthetic.py)::

    <cache>/datasets/shapes-v1-n600-160x160-q90-s0/
        images/train/000001.jpg ...   images/val/000000.jpg ...
        labels/train/000001.txt ...   labels/val/000000.txt ...   (class cx cy w h, normalised)
        data.yaml                     (names, train: images/train, val: images/val)
        dataset.json                  (the spec; written last: its presence means complete)

With ``masks=True`` (the default segmentation dataset, ``shapes-masks-v1-...``) the same
images come with ``masks/<split>/<stem>.png`` instead of ``labels/``: a PNG of class ids,
0 the background and 1, 2, 3 the circle, square and triangle (the pixels each shape was
drawn on, exactly), read back by runner/data/sources/masklabels.py; its ``data.yaml``
names the four classes, background first.

Each image is a 1/f ("pink") noise scene, the spectrum natural images have (synthetic.py's
noise fields), in a random hue, with 0 to ``max_objects`` filled shapes on it: circles,
axis-aligned squares and triangles (classes 0, 1, 2), of random size, colour and place;
objects never touch (a gap of at least ``GAP`` pixels), so each is whole. A shape is drawn
with a hard edge on the pixel grid (a pixel is the shape's when its centre is inside), and
its label is the extent of exactly those pixels: the box is what was drawn. Its colour
contrasts with the background under it (the value far from the local mean), its hue says
nothing of its class (the shape does), and a texture shades it as light would.

Which images are validation is a seeded permutation (``val_fraction`` of them), so the
split is the same on every machine. Publication is atomic, as synthetic.py's: files go into
a ``.partial`` folder, each written whole, and the folder is renamed into place at the end;
an interrupted generation resumes where it stopped.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from runner.common.atomic import write_atomic
from runner.data.sources.listing import split_positions
from runner.data.sources.synthetic import (
    _CHROMA_U,
    _CHROMA_V,
    _noise_fields,
    _rgb,
    encode_jpeg,
    publish_once,
    write_parallel,
)

log = logging.getLogger(__name__)

VERSION = 1  # bump when the images or labels change, so old caches are not reused
CLASSES = ("circle", "square", "triangle")
GAP = 3  # pixels between two objects' boxes at least


@dataclass(frozen=True)
class ShapesSpec:
    num_images: int = 600
    height: int = 160
    width: int = 160
    quality: int = 90
    seed: int = 0
    val_fraction: float = 0.2
    max_objects: int = 4
    min_size: float = 0.12  # an object's side, as a share of the shorter image side
    max_size: float = 0.35
    masks: bool = False  # masks/ (class-id PNGs) instead of labels/ (boxes)

    @property
    def name(self) -> str:
        kind = "shapes-masks" if self.masks else "shapes"
        return (f"{kind}-v{VERSION}-n{self.num_images}-{self.height}x{self.width}"
                f"-q{self.quality}-s{self.seed}")

    @property
    def classes(self) -> list[str]:
        """The class names by id: a mask's ids put the background first."""
        return ["background", *CLASSES] if self.masks else list(CLASSES)

    def val_indices(self) -> set[int]:
        return set(split_positions(self.num_images, self.val_fraction, self.seed, True))

    def split_of(self, index: int, val: set[int] | None = None) -> str:
        return "val" if index in (self.val_indices() if val is None else val) else "train"


@dataclass(frozen=True)
class Sample:
    """One image (HWC uint8 RGB), its boxes (float32 [n, 4], xyxy pixels: the extent of the
    pixels each shape covers) and classes (int64 [n]), and its mask (uint8 [H, W]: 0 the
    background, a shape's class + 1 on the pixels it was drawn on)."""

    image: np.ndarray
    boxes: np.ndarray
    labels: np.ndarray
    mask: np.ndarray | None = None


def background(spec: ShapesSpec, index: int) -> np.ndarray:
    """Image ``index``'s background, HWC float32 in [0, 1] (before its shapes): pink noise
    around a random hue, chroma variation that keeps luminance, sensor grain."""
    rng = np.random.default_rng([spec.seed, index, 0])
    h, w = spec.height, spec.width
    lum, chroma_u, chroma_v = _noise_fields(rng, h, w, (1.5, 1.7, 1.7))
    base = _rgb(rng.uniform(), rng.uniform(0.2, 0.6), rng.uniform(0.4, 0.65))
    img = base * (1.0 + 0.22 * lum)[..., None]
    img += (0.05 * chroma_u)[..., None] * _CHROMA_U + (0.05 * chroma_v)[..., None] * _CHROMA_V
    img += rng.standard_normal(img.shape, np.float32) * 0.006
    return np.clip(img, 0.0, 1.0)


def shape_mask(kind: int, cy: float, cx: float, size: float, turn: float, h: int, w: int
               ) -> np.ndarray:
    """The pixels (bool, h x w) whose centres are inside the shape: a circle of diameter
    ``size``, a square of side ``size``, or a triangle inscribed in the circle of diameter
    ``size``, turned by ``turn`` radians; centred on (cy, cx)."""
    r = size / 2
    mask = np.zeros((h, w), bool)
    y0, y1 = max(int(cy - r) - 1, 0), min(int(cy + r) + 2, h)  # the shape's window
    x0, x1 = max(int(cx - r) - 1, 0), min(int(cx + r) + 2, w)
    yy, xx = np.mgrid[y0:y1, x0:x1].astype(np.float64) + 0.5
    dy, dx = yy - cy, xx - cx
    if kind == 0:
        inside = dy * dy + dx * dx <= r * r
    elif kind == 1:
        inside = (np.abs(dy) <= r) & (np.abs(dx) <= r)
    else:
        angles = turn + np.array([0.0, 2 * np.pi / 3, 4 * np.pi / 3])
        py, px = cy + r * np.sin(angles), cx + r * np.cos(angles)
        inside = np.ones(yy.shape, bool)
        for k in range(3):  # on the inner side of each edge (the vertices run anticlockwise)
            a, b = k, (k + 1) % 3
            inside &= (px[b] - px[a]) * (yy - py[a]) - (py[b] - py[a]) * (xx - px[a]) >= 0
    mask[y0:y1, x0:x1] = inside
    return mask


def extent(mask: np.ndarray) -> tuple[float, float, float, float] | None:
    """The box (x1, y1, x2, y2) of a mask's pixels in pixel-edge coordinates (the pixel at
    column j spans j..j+1), or None for an empty mask."""
    rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
    if not len(rows):
        return None
    return float(cols[0]), float(rows[0]), float(cols[-1] + 1), float(rows[-1] + 1)


def make_sample(spec: ShapesSpec, index: int) -> Sample:
    """Image ``index`` of ``spec`` with its boxes; same inputs, same pixels and boxes."""
    rng = np.random.default_rng([spec.seed, index, 1])
    h, w = spec.height, spec.width
    img = background(spec, index)
    (texture,) = _noise_fields(rng, h, w, (1.2,))
    side = min(h, w)
    boxes: list[tuple[float, float, float, float]] = []
    labels: list[int] = []
    ids = np.zeros((h, w), np.uint8)
    wanted = int(rng.integers(0, spec.max_objects + 1))
    for _ in range(20 * wanted):  # placements that would touch another object are redrawn
        if len(boxes) == wanted:
            break
        kind = int(rng.integers(0, len(CLASSES)))
        size = rng.uniform(spec.min_size, spec.max_size) * side
        cy, cx = rng.uniform(size / 2, h - size / 2), rng.uniform(size / 2, w - size / 2)
        turn = rng.uniform(0, 2 * np.pi)
        colour_draws = rng.uniform(size=3)
        mask = shape_mask(kind, cy, cx, size, turn, h, w)
        box = extent(mask)
        if box is None or any(_near(box, other) for other in boxes):
            continue
        x1, y1, x2, y2 = (int(v) for v in box)
        local = float(img[y1:y2, x1:x2].mean())
        value = (0.08 + 0.17 * colour_draws[2]) if local > 0.5 else (0.78 + 0.2 * colour_draws[2])
        colour = _rgb(colour_draws[0], 0.3 + 0.6 * colour_draws[1], value)
        shade = (1.0 + 0.08 * texture)[..., None]
        img = np.where(mask[..., None], np.clip(colour * shade, 0.0, 1.0), img)
        ids[mask] = kind + 1
        boxes.append(box)
        labels.append(kind)
    pixels = (img * 255 + 0.5).astype(np.uint8)
    return Sample(pixels, np.array(boxes, np.float32).reshape(-1, 4),
                  np.array(labels, np.int64), ids)


def _near(a: tuple, b: tuple) -> bool:
    """Whether two boxes are closer than ``GAP`` pixels (or overlap)."""
    return not (a[2] + GAP <= b[0] or b[2] + GAP <= a[0] or a[3] + GAP <= b[1]
                or b[3] + GAP <= a[1])


def yolo_lines(sample: Sample, h: int, w: int) -> str:
    """The label file of a sample: ``class cx cy w h`` normalised, one line per box."""
    lines = []
    for (x1, y1, x2, y2), label in zip(sample.boxes.tolist(), sample.labels.tolist()):
        lines.append(f"{label} {(x1 + x2) / 2 / w:.6f} {(y1 + y2) / 2 / h:.6f} "
                     f"{(x2 - x1) / w:.6f} {(y2 - y1) / h:.6f}")
    return "".join(line + "\n" for line in lines)


def relpaths(spec: ShapesSpec, index: int, val: set[int] | None = None) -> tuple[str, str]:
    """(image, label file or mask) of image ``index``, relative to the dataset's folder."""
    split = spec.split_of(index, val)
    if spec.masks:
        return f"images/{split}/{index:06d}.jpg", f"masks/{split}/{index:06d}.png"
    return f"images/{split}/{index:06d}.jpg", f"labels/{split}/{index:06d}.txt"


def encode_png(ids: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(ids, "L").save(buf, "PNG")
    return buf.getvalue()


def _write_one(args: tuple[ShapesSpec, Path, int, set[int]]) -> int:
    spec, root, index, val = args
    image, label = relpaths(spec, index, val)
    if not (root / image).exists():  # resume: an image present was written with its labels
        sample = make_sample(spec, index)
        target = encode_png(sample.mask) if spec.masks else \
            yolo_lines(sample, spec.height, spec.width).encode()
        write_atomic(root / label, target)
        write_atomic(root / image, encode_jpeg(sample.image, spec.quality))
    return index


def ensure_shapes(spec: ShapesSpec, cache_dir: str | Path, progress: bool = True) -> Path:
    """Return the folder of ``spec``'s dataset, generating it first if it is not cached.

    Safe to call from several processes at once: one generates, the others wait on a lock.
    """
    import yaml

    def make(partial: Path, final: Path) -> dict:
        for kind in ("images", "masks" if spec.masks else "labels"):
            for split in ("train", "val"):
                (partial / kind / split).mkdir(parents=True, exist_ok=True)
        val = spec.val_indices()
        todo = [i for i in range(spec.num_images)
                if not (partial / relpaths(spec, i, val)[0]).exists()]
        log.info("generating the default %s dataset (%d of %d images to write) in %s",
                 "segmentation" if spec.masks else "detection", len(todo), spec.num_images,
                 final)
        write_parallel(_write_one, [(spec, partial, i, val) for i in todo], "shapes dataset",
                       progress, per_worker=256, chunksize=16)
        write_atomic(partial / "data.yaml", yaml.safe_dump(
            {"train": "images/train", "val": "images/val",
             "names": spec.classes}, sort_keys=False).encode())
        return {"version": VERSION, **spec.__dict__, "classes": spec.classes}

    return publish_once(Path(cache_dir).expanduser() / "datasets", spec.name, make)
