"""Segmentation targets as people have them: ``images/`` and ``masks/`` side by side, or
COCO's ``instances_*.json`` polygons and RLE.

``read_masks(path, format="auto", split=None)`` returns a ``MaskSet``: per image (its path)
a ``MaskTarget`` (where its mask comes from and the upright source size it is in) and the
class names by id. A target is a recipe, not pixels: ``load_mask(target)`` makes the
[H, W] uint8 class-id mask when it is needed (255 = ``IGNORE``: no loss, no metric), so a
listing of a large set holds no masks in memory. ``list_masks`` lists them for the runner
as ``list_detection`` lists boxes (runner/data/sources/detection.py): a ``Listing`` whose
``targets`` (``MaskTargets``) are in step with its samples, split as the layout has it.

- **Folder** (``format="pairs"``): ``images/`` and ``masks/`` side by side, split as the
  YOLO layout is (``images/<split>`` + ``masks/<split>``, ``<split>/images`` +
  ``<split>/masks``, or flat); the image ``images/a/b.jpg`` has the mask ``masks/a/b.png``,
  a PNG whose pixel values are class ids (8- or 16-bit grey, or a palette image whose
  indices are the ids, as Pascal VOC's are), 255 ignored, in the upright image's frame.
  Class names come from ``data.yaml`` / ``dataset.yaml`` (``names:``) or ``classes.txt``
  (labels.py reads them for YOLO too), or ``classes``; else they are ``0..max`` of the ids
  in the masks (each mask is read once to find them, and that is said once).
- **COCO** (``format="coco"``): each image's annotations' ``segmentation`` (polygons,
  uncompressed or compressed RLE) rasterised by pycocotools as ``COCO.annToMask`` does
  (``coco_rle``), into one class-id mask as torchvision's segmentation references make
  it: category ids mapped to contiguous classes 1..K in category-id order, 0 background.
  **Overlaps:** a pixel covered by instances of one class is that class; by instances of
  two or more classes, ``IGNORE`` (torchvision's references ignore every overlap; one of
  the same class is not ambiguous). An ``iscrowd`` region is ``IGNORE`` (counted).

Bad input never crashes and is never silent: each kind is counted (``MaskSet.counts``),
said once with its count and first example, and where an image is lost it is a
``SkippedFile`` with its reason: an image without a mask, a mask without an image, a mask
whose size is not its image's (upright) size, a colour mask (RGB: not class ids), a file
whose header cannot be read; COCO's malformed annotations and images, as labels.py's.
**Ids beyond the classes.** Where the classes are named (data.yaml, classes.txt,
``classes``), each mask is read once (on threads) for ids at or beyond their count; a pixel
with one (not 255) is made ``IGNORE`` by ``load_mask``, as a box of a class out of range is
dropped (labels.py), and never silently: the masks holding one are counted and said in one
warning with the class count, the ids found and the files (the first few). Where the classes
come from the masks (``0..max``) there is none. A model's head smaller than the classes
(``model.num_classes``) is refused before training (runner/tasks/train/training.py's
``check_head_size``), as a classifier's is.
"""

from __future__ import annotations

import logging
import math
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runner.common.text import printable
from runner.config.schema import DatasetConfig, Split, TargetName
from runner.data.protocol import SkippedFile
from runner.data.sources.labels import (
    _class_file_names,
    _coco_files,
    _coco_images_dir,
    _Report,
    _sorted_images,
    _unlisted,
    _whole,
    _yaml_names,
    classes_said,
    read_coco_json,
    upright_size,
)
from runner.data.sources.listing import DatasetError, Listing, split_listing, walk

log = logging.getLogger(__name__)

IGNORE = 255  # a mask pixel that counts in neither the loss nor the metric
MAX_CLASSES = 255  # ids 0..254 in a uint8 mask, 255 kept for IGNORE
MASK_SUFFIX = ".png"  # lossless: a JPEG would blur class ids into other ids
FORMATS = ("pairs", "coco")
GREY_MODES = ("L", "P", "1", "I;16", "I;16B", "I;16L", "I")  # PIL modes whose values are ids

REASONS = {
    "image_without_mask": "images without a mask (skipped)",
    "mask_without_image": "masks without an image (skipped)",
    "size_mismatch": "masks whose size is not their image's (skipped)",
    "not_class_ids": "colour masks, not a PNG of class ids (skipped)",
    "unreadable": "images or masks whose header cannot be read (skipped)",
    "out_of_range": "masks with ids beyond the classes (those pixels ignored)",
    "malformed": "malformed annotations (skipped)",
    "class_out_of_range": "annotations of no listed category (skipped)",
    "crowd": "iscrowd regions (ignored: 255)",
    "annotation_without_image": "annotations of images the JSON does not list (skipped)",
    "image_missing": "images the JSON lists that are not on disk (skipped)",
    "not_annotated": "images on disk the JSON does not list (skipped)",
}


class _MaskReport(_Report):
    """labels.py's report (count, skip, first example), saying the masks' reasons."""

    def say(self, source: Path) -> None:
        for kind, n in self.counts.items():
            if n:
                level = logging.INFO if kind == "crowd" else logging.WARNING
                log.log(level, "%s: %d %s, e.g. %s", printable(str(source)), n, REASONS[kind],
                        self.first[kind])


@dataclass(frozen=True)
class MaskTarget:
    """Where one image's mask comes from: ``file`` (a PNG of class ids) or ``shapes`` (COCO:
    per annotation its ``segmentation``, class 1..K and ``iscrowd``); ``height`` x ``width``:
    the upright source size the mask is in; ``image_id``: COCO's id, or the position."""

    height: int
    width: int
    image_id: int
    file: str | None = None
    shapes: tuple[tuple[object, int, bool], ...] = ()


@dataclass
class MaskSet:
    """What ``read_masks`` found (``LabelSet``'s fields, for masks).

    Attributes:
        format: "pairs" or "coco".
        root: the images folder. source: the masks folder, or the JSON file.
        classes: class names by id (COCO: "background" then the categories).
        targets: image path -> ``MaskTarget``, in sorted order of the path under ``root``.
        skipped, counts: what was left out, and how many of each kind (``REASONS``).
        category_ids: COCO's category id of each class (0 for the background); None for a
            folder (the class id is the id).
    """

    format: str
    root: Path
    source: Path
    classes: list[str]
    targets: dict[str, MaskTarget]
    skipped: list[SkippedFile] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    category_ids: list[int] | None = None


# --- making a mask ------------------------------------------------------------------------

def read_mask_file(path: str | os.PathLike | object) -> np.ndarray:
    """The class ids of a mask file (a path, or a binary file object) as [H, W] uint8; ids
    outside 0..255 (a 16- or 32-bit mask) become ``IGNORE``; a colour image is a
    ValueError."""
    from PIL import Image

    with Image.open(path) as img:
        if img.mode not in GREY_MODES:
            raise ValueError(f"a {img.mode} image is not a mask of class ids (save one "
                             "channel: a grey or palette PNG whose values are the ids)")
        ids = np.asarray(img)
    if ids.dtype != np.uint8:
        ids = np.where((ids < 0) | (ids > IGNORE), IGNORE, ids).astype(np.uint8)
    return ids


def coco_rle(segmentation: object, h: int, w: int) -> dict:
    """One annotation's ``segmentation`` (polygons, uncompressed or compressed RLE) as a
    compressed RLE of an h x w image: ``COCO.annToRLE``'s steps."""
    from pycocotools import mask as coco_mask

    if isinstance(segmentation, list):
        return coco_mask.merge(coco_mask.frPyObjects(segmentation, h, w))
    if isinstance(segmentation.get("counts"), list):
        return coco_mask.frPyObjects(segmentation, h, w)
    return segmentation


def render_coco(shapes: tuple[tuple[object, int, bool], ...], h: int, w: int) -> np.ndarray:
    """An image's annotations (segmentation, class 1..K, iscrowd) as one [h, w] uint8
    class-id mask: the module docstring's overlap and crowd rules."""
    from pycocotools import mask as coco_mask

    out = np.zeros((h, w), np.uint8)
    conflict = np.zeros((h, w), bool)
    crowd = np.zeros((h, w), bool)
    for segmentation, cls, iscrowd in shapes:
        covered = coco_mask.decode(coco_rle(segmentation, h, w)).astype(bool)
        if iscrowd:
            crowd |= covered
            continue
        conflict |= covered & (out != 0) & (out != cls)  # sticky: once two classes, ignored
        out[covered] = cls
    out[conflict | crowd] = IGNORE
    return out


def load_mask(target: MaskTarget, num_classes: int | None = None) -> np.ndarray:
    """``target``'s [H, W] uint8 class-id mask; with ``num_classes``, an id at or past it
    (not already ``IGNORE``) becomes ``IGNORE``."""
    if target.file is not None:
        mask = read_mask_file(target.file)
    else:
        mask = render_coco(target.shapes, target.height, target.width)
    if num_classes is not None:
        mask = np.where((mask >= num_classes) & (mask != IGNORE), IGNORE, mask).astype(np.uint8)
    return mask


# --- the folder layout --------------------------------------------------------------------

def _mask_dirs(root: Path, split: str | None) -> tuple[Path, Path] | None:
    """The (images, masks) folders at ``root``, or None (labels.py's ``_yolo_dirs``)."""
    candidates = [(root / "images" / split, root / "masks" / split),
                  (root / split / "images", root / split / "masks")] if split else []
    candidates.append((root / "images", root / "masks"))
    if "images" in root.parts:  # the images folder itself: its last /images/ -> /masks/
        parts = list(root.parts)
        at = len(parts) - 1 - parts[::-1].index("images")
        candidates.append((root, Path(*parts[:at], "masks", *parts[at + 1 :])))
    for images, masks in candidates:
        if images.is_dir() and masks.is_dir():
            return images, masks
    return None


def detect_mask_format(path: str | Path, split: str | None = None) -> str:
    """"coco" when ``path`` is a COCO JSON or holds ``annotations/instances_*.json``,
    "pairs" when it holds ``images/`` and ``masks/``; a DatasetError otherwise."""
    root = Path(path).expanduser()
    if _coco_files(root):
        return "coco"
    if root.is_dir() and _mask_dirs(root, split) is not None:
        return "pairs"
    raise DatasetError(
        f"dataset.path={printable(str(root))} holds no masks this runner reads: give "
        "images/ and masks/ side by side (masks/<image stem>.png, a PNG of class ids, 255 "
        "ignored) or COCO's annotations (annotations/instances_<split>.json)")


def read_masks(path: str | Path, format: str = "auto", split: str | None = None,
               classes: list[str] | None = None) -> MaskSet:
    """The segmentation targets at ``path`` (``format``: "auto", "pairs" or "coco";
    ``split``: which split's folders or JSON; ``classes``: a folder's class names when it
    has no data.yaml or classes.txt)."""
    if format not in ("auto", *FORMATS):
        raise DatasetError(f"masks format {format!r} is not one of auto, folder, coco")
    if format == "auto":
        format = detect_mask_format(path, split)
    if format == "pairs":
        return read_mask_folder(path, split, classes)
    return read_coco_masks(path, split=split)


def _header(path: str) -> tuple[tuple[int, int], str] | str:
    """(size (h, w), PIL mode) of a mask file from its header, or why it cannot be read."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            return (img.height, img.width), img.mode
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def _image_size(path: str) -> tuple[int, int] | str:
    try:
        return upright_size(path)
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def _threaded(fn, items: list) -> list:
    if len(items) < 64:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(fn, items))


def read_mask_folder(path: str | Path, split: str | None = None,
                     classes: list[str] | None = None) -> MaskSet:
    """The ``images/`` + ``masks/`` layout at ``path`` (the module docstring)."""
    root = Path(path).expanduser()
    dirs = _mask_dirs(root, split)
    if dirs is None:
        where = f" (split {split!r})" if split else ""
        raise DatasetError(f"dataset.path={printable(str(root))}{where} has no images/ and "
                           "masks/ folders side by side")
    images, masks = dirs
    names = classes or _yaml_names(root, images.parent, images.parent.parent) or \
        _class_file_names(masks, masks.parent, root)
    report = _MaskReport()
    image_paths = _sorted_images(images)
    stem_of = {p: os.path.splitext(os.path.relpath(p, images))[0] for p in image_paths}
    mask_of: dict[str, str] = {}
    stems = set(stem_of.values())
    walked, _, _ = walk(masks, [os.path.realpath(masks)])
    for dirpath, files in sorted(walked):
        for name in sorted(files):
            if not name.lower().endswith(MASK_SUFFIX):
                continue
            file = os.path.join(dirpath, name)
            stem = os.path.splitext(os.path.relpath(file, masks))[0]
            if stem in stems:
                mask_of[stem] = file
            else:
                report.skip("mask_without_image", file, f"no image {stem}.* under "
                            f"{printable(str(images))}; not used")
    paired, place = [], {}
    for position, (image, stem) in enumerate(stem_of.items()):
        place[image] = position  # the image's id: its place among the images, as YOLO's
        if stem in mask_of:
            paired.append(image)
        else:
            report.skip("image_without_mask", image, f"no mask {stem}{MASK_SUFFIX} under "
                        f"{printable(str(masks))}; skipped (an image with no mask is not "
                        "all background: give it one of zeros)")
    image_sizes = _threaded(_image_size, paired)
    headers = _threaded(_header, [mask_of[stem_of[p]] for p in paired])
    targets: dict[str, MaskTarget] = {}
    for image, size, header in zip(paired, image_sizes, headers):
        file = mask_of[stem_of[image]]
        if isinstance(size, str) or isinstance(header, str):
            why = size if isinstance(size, str) else header
            report.skip("unreadable", image if isinstance(size, str) else file,
                        f"its header cannot be read ({why}); skipped")
            continue
        mask_hw, mode = header
        if mode not in GREY_MODES:
            report.skip("not_class_ids", file, f"a {mode} image, not class ids (a grey or "
                        "palette PNG whose values are the ids); skipped")
            continue
        if mask_hw != size:
            report.skip("size_mismatch", file, f"{mask_hw[1]}x{mask_hw[0]}, its image "
                        f"{size[1]}x{size[0]} (upright); skipped")
            continue
        targets[image] = MaskTarget(size[0], size[1], place[image], file=file)
    if names:
        found = list(names)
        _count_beyond(targets, len(found), report, masks)
    else:
        found = _classes_from_masks(targets, report)
        if not classes_said(root):
            log.warning("%s: no class names (data.yaml's names, classes.txt): the classes "
                        "are the ids in the masks, 0..%d", printable(str(root)), len(found) - 1)
    if len(found) > MAX_CLASSES:
        raise DatasetError(f"{printable(str(root))}: {len(found)} classes; a uint8 mask holds "
                           f"{MAX_CLASSES} (0..254, 255 ignored)")
    report.say(masks)
    return MaskSet("pairs", images, masks, found, targets, report.skipped, report.counts)


def _ids_in(target: MaskTarget) -> np.ndarray:
    """The distinct class ids a mask file holds (``IGNORE`` left out)."""
    ids = np.unique(read_mask_file(target.file))
    return ids[ids != IGNORE]


SAID_FILES = 3  # the files a warning names (it counts them all)


def _count_beyond(targets: dict[str, MaskTarget], count: int, report: _MaskReport,
                  masks: Path) -> None:
    """Count the masks holding ids at or beyond the ``count`` named classes (their pixels
    become ``IGNORE``): said once by ``report``, with the ids and the first files (under
    ``masks``, the folder the warning names)."""
    def beyond(target: MaskTarget) -> list[int]:
        try:
            ids = _ids_in(target)
        except Exception:  # unreadable now: its decode says so, counted there
            return []
        return ids[ids >= count].tolist()

    found = [(t.file, ids) for t, ids in zip(targets.values(),
                                              _threaded(beyond, list(targets.values())))
             if ids]
    if not found:
        return
    ids = sorted({i for _, got in found for i in got})
    files = ", ".join(printable(os.path.relpath(f, masks)) for f, _ in found[:SAID_FILES]) + (
        f" and {len(found) - SAID_FILES} more" if len(found) > SAID_FILES else "")
    report.count("out_of_range", files,
                 f"ids {', '.join(map(str, ids))} at or beyond the {count} named classes "
                 f"(0..{count - 1}); name every class (data.yaml's names, classes.txt), or "
                 "repaint those pixels 255 to ignore them", n=len(found))


def _classes_from_masks(targets: dict[str, MaskTarget], report: _MaskReport) -> list[str]:
    """``0..max`` of the ids the masks hold (each mask read once, on threads)."""
    def most(target: MaskTarget) -> int:
        ids = _ids_in(target)
        return int(ids.max()) if len(ids) else 0

    top = max(_threaded(most, list(targets.values())), default=0)
    return [str(k) for k in range(top + 1)]


# --- COCO ---------------------------------------------------------------------------------

def _valid_segmentation(seg: object, h: int, w: int) -> str | None:
    """Why ``seg`` is not a segmentation pycocotools reads (None: it is)."""
    if isinstance(seg, list):
        if not seg:
            return "an empty polygon list"
        for poly in seg:
            if not isinstance(poly, list) or len(poly) < 6 or len(poly) % 2:
                return "a polygon that is not x1, y1, x2, y2, ... of 3 points or more"
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                       and math.isfinite(v) for v in poly):
                return "a polygon with a coordinate that is not a finite number"
        return None
    if isinstance(seg, dict) and "counts" in seg and "size" in seg:
        if list(seg["size"]) != [h, w]:
            return f"an RLE of size {seg['size']}, its image {h}x{w} (h, w)"
        return None
    return f"{str(seg)[:40]} is neither polygons nor an RLE"


def read_coco_masks(path: str | Path, images: str | Path | None = None,
                    split: str | None = None) -> MaskSet:
    """COCO's ``instances_*.json`` at ``path`` as masks (the module docstring), its images
    in ``images`` (found beside it as labels.py's ``read_coco`` finds them)."""
    root = Path(path).expanduser()
    file, data = read_coco_json(root, split)
    report = _MaskReport()
    source = str(file)
    categories = sorted((c for c in data["categories"] if isinstance(c, dict)
                         and _whole(c.get("id"))), key=lambda c: c["id"])
    if len(categories) + 1 > MAX_CLASSES:
        raise DatasetError(f"{printable(source)}: {len(categories)} categories; a uint8 "
                           f"mask holds {MAX_CLASSES - 1} and the background")
    class_of = {c["id"]: k + 1 for k, c in enumerate(categories)}  # 0: the background
    classes = ["background", *(str(c.get("name", c["id"])) for c in categories)]
    listed: dict[int, tuple[str, int, int]] = {}
    for entry in data["images"]:
        try:
            if not _whole(entry["id"]):
                raise TypeError
            listed[entry["id"]] = (str(entry["file_name"]), int(entry["height"]),
                                   int(entry["width"]))
        except (KeyError, TypeError, ValueError):
            report.skip("malformed", source, f"image entry {str(entry)[:80]}: no id, "
                        "file_name, height and width; skipped")
    folder = Path(images).expanduser() if images is not None else _coco_images_dir(
        file, root, [name for name, _, _ in list(listed.values())[:20]])
    per_image: dict[int, list[tuple[object, int, bool]]] = {}
    for ann in data.get("annotations") or []:
        if not isinstance(ann, dict):
            report.skip("malformed", source, f"annotation {str(ann)[:60]} is not an object")
            continue
        where = f"annotation {ann.get('id', '?')}"
        if not _whole(ann.get("image_id")) or ann["image_id"] not in listed:
            report.skip("annotation_without_image", source, f"{where}: image_id "
                        f"{ann.get('image_id')!r} is not in 'images'; skipped")
            continue
        _, h, w = listed[ann["image_id"]]
        why = _valid_segmentation(ann.get("segmentation"), h, w)
        if why is not None:
            report.skip("malformed", source, f"{where}: segmentation is {why}; skipped")
            continue
        if not _whole(ann.get("category_id")) or ann["category_id"] not in class_of:
            report.skip("class_out_of_range", source, f"{where}: category_id "
                        f"{ann.get('category_id')!r} is not among the {len(categories)} "
                        "categories; skipped")
            continue
        if ann.get("iscrowd"):
            report.count("crowd", f"{source}: {where}")
        per_image.setdefault(ann["image_id"], []).append(
            (ann["segmentation"], class_of[ann["category_id"]], bool(ann.get("iscrowd"))))
    targets: dict[str, MaskTarget] = {}
    seen = set()
    for image_id, (name, h, w) in sorted(listed.items(), key=lambda kv: kv[1][0].split("/")):
        image = str(folder / name)
        seen.add(os.path.normpath(image))
        if not os.path.isfile(image):
            report.skip("image_missing", image, f"listed in {file.name} (id {image_id}) but "
                        "not on disk; skipped")
            continue
        targets[image] = MaskTarget(h, w, image_id, shapes=tuple(per_image.get(image_id, ())))
    for image in _unlisted(folder, seen):
        report.skip("not_annotated", image, f"not listed in {file.name}; skipped")
    report.say(file)
    return MaskSet("coco", folder, file, classes, targets, report.skipped, report.counts,
                   [0, *(c["id"] for c in categories)])


# --- the listing --------------------------------------------------------------------------

@dataclass
class MaskTargets:
    """Each listed image's ``MaskTarget``, in listing order (``DetectionTargets``' shape:
    ``subset`` for a split's side, ``source_size`` for serving), and what was left out."""

    items: list[MaskTarget]
    format: str
    num_classes: int
    skipped: list[SkippedFile] = field(default_factory=list)
    category_ids: list[int] | None = None
    kind = TargetName.masks  # what they are (not a field): runner/data/targets/' record

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> MaskTarget:
        return self.items[index]

    def mask(self, index: int) -> np.ndarray:
        """Image ``index``'s [H, W] uint8 mask (ids past the classes ``IGNORE``)."""
        return load_mask(self.items[index], self.num_classes)

    def target(self, index: int) -> np.ndarray:
        """Image ``index``'s target as its kind's record reads it (a store's too): its mask."""
        return self.mask(index)

    def source_size(self, index: int) -> tuple[int, int]:
        return self.items[index].height, self.items[index].width

    def image_id(self, index: int) -> int:
        return self.items[index].image_id

    def subset(self, positions: list[int]) -> MaskTargets:
        return MaskTargets([self.items[k] for k in positions], self.format, self.num_classes,
                           self.skipped, self.category_ids)


def has_mask_split(root: Path, split: str) -> bool:
    """Whether the layout at ``root`` has a folder or a JSON of ``split``."""
    return (root / "images" / split).is_dir() and (root / "masks" / split).is_dir() or \
        (root / split / "masks").is_dir() or \
        any((root / "annotations").glob(f"instances_{split}*.json"))


def default_masks_path(dataset: DatasetConfig, progress: bool = True) -> Path:
    """The generated shapes masks dataset (``dataset.num_images`` of them,
    ``dataset.quality``), made once in ``dataset.cache_dir``: unset ``dataset.path``."""
    from runner.data.sources.shapes import ShapesSpec, ensure_shapes

    spec = ShapesSpec(num_images=dataset.num_images, quality=dataset.quality, masks=True)
    return ensure_shapes(spec, Path(dataset.cache_dir).expanduser(), progress=progress)


def list_masks(dataset: DatasetConfig, path: str | Path, format: str = "auto") -> Listing:
    """The images at ``path`` that have a mask, each with its ``MaskTarget`` (``targets``);
    the split ``dataset.split`` names when the layout has split folders, else
    ``dataset.val_fraction``'s (as ``list_detection``)."""
    root = Path(path).expanduser()
    split = dataset.split.value if dataset.val_fraction == 0 and has_mask_split(
        root, dataset.split.value) else None
    found = read_masks(root, format, split)
    samples = [(image, 0) for image in found.targets]
    targets = MaskTargets(list(found.targets.values()), found.format, len(found.classes),
                          found.skipped, found.category_ids)
    listing = Listing(found.root, found.classes, samples, f"{found.format} masks" + (
        f", {split} split" if split else ""), [], targets)
    if dataset.val_fraction > 0:
        listing = split_listing(listing, dataset.val_fraction, dataset.split_seed,
                                dataset.split is Split.val)
    return listing
