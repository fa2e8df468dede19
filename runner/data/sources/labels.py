"""Detection targets as people have them: the YOLO layout or COCO's ``instances_*.json``.

``read_labels(path, format="auto")`` returns a ``LabelSet``: per image (its path), its boxes
as a float32 [n, 4] tensor, xyxy, in pixels of the upright source image, and its int64 [n]
class ids (0..K-1), plus the class names. ``format="auto"`` tells the layout from the folder
(``detect_format``); ``yolo`` or ``coco`` names it.

- **YOLO** (ultralytics' layout): ``images/`` and ``labels/`` side by side (or, with a
  ``split``, ``images/<split>`` and ``labels/<split>``, or ``<split>/images`` and
  ``<split>/labels``: a split's images without its labels folder are refused, never given
  the top ``labels/``); the image ``images/a/b.jpg`` has the label file ``labels/a/b.txt``,
  one line per box, ``class cx cy w h`` normalised to [0, 1] by the image's upright size
  (a line of more than five numbers is a polygon, ``class x1 y1 x2 y2 ...``, whose box is
  its points' extent, as ultralytics reads segments; a UTF-8 BOM is dropped, as
  ultralytics reads them). An empty label file, or none, is an image with no boxes; a set
  where no image has one is said in a warning. Class names come from ``data.yaml`` / ``dataset.yaml`` (``names:``,
  a list or ``{id: name}``) or ``classes.txt`` (one per line, LabelImg's) when there is one;
  otherwise the classes are ``0..max`` of the ids seen. Pixels need the image's size, read
  from its header (PIL, no decode; EXIF orientation applied) for images that have boxes.
- **COCO**: ``annotations/instances_<split>.json`` (or the JSON itself as ``path``),
  images in ``<split>/`` beside ``annotations/`` (or ``images/<split>``, ``images/``, the
  folder itself: the first that holds the first listed image). ``bbox`` is x, y, w, h in
  pixels of the JSON's ``width`` x ``height``; categories get contiguous ids 0..K-1 in
  category-id order; ``iscrowd`` boxes are left out (counted, as COCO's detectors train).
  **Sizes**: COCO's ``width`` x ``height`` are the upright image's (EXIF orientation
  applied), checked against each file's header (``upright_size``). A file of another size
  but the same shape (each side within a pixel of the JSON's scaled: a resized copy) keeps
  its boxes, scaled with it when decoded (counted ``resized``, said at INFO); any other size
  (a side that disagrees, an EXIF-rotated JPEG whose JSON gives its stored size) is
  skipped with its boxes (``size_mismatch``), never scaled out of shape. **Entries that
  contradict each other** are never merged: two entries of one id (``duplicate_id``) or one
  file under two ids (``duplicate_file``) are each skipped with the boxes of their id.

A YOLO folder's parsed label files and the image sizes (YOLO's and COCO's) are kept in the
labels cache (runner/data/sources/labelcache.py, ``dataset.cache_dir``) by each file's
stat, so a second listing reads neither a label file nor an image header that has not
changed.

Bad input never crashes and is never silent. Each is counted (``LabelSet.counts``), said
once in a warning with its count and first example, and, where an entry is lost, reported
as a ``SkippedFile`` (runner/data/protocol.py: the record the loop counts and writes to
``skipped_files``) with its reason:

- a label file without an image, an annotation of an image the JSON does not list, an
  image the JSON lists that is not on disk, an image on disk the JSON does not list, an
  image whose size cannot be read, or whose size contradicts the JSON's, an image entry
  that contradicts another: skipped;
- a malformed line (not ``class`` and 4 numbers, or a polygon; a number that is not
  finite), a malformed annotation (no 4-number ``bbox``): skipped;
- a class out of range (no such class name / category): the box dropped, skipped;
- a degenerate box (zero or negative width or height once clipped to the image): dropped,
  skipped;
- a box reaching outside the image: clipped to it, kept, counted (``clipped``);
- an image without a label file (YOLO): no boxes, counted (``no_label_file``).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from runner.common.text import printable
from runner.data.protocol import SkippedFile
from runner.data.sources.labelcache import LabelCache, ParsedFile
from runner.data.sources.listing import DatasetError, is_image_name, walk

log = logging.getLogger(__name__)
_NAMELESS_SAID: set[str] = set()  # layouts whose missing class names were said (once each)


def classes_said(root: Path) -> bool:
    """Whether this process said ``root``'s missing class names already (its train and
    val sides, a store's listing: one line)."""
    key = str(root)
    said = key in _NAMELESS_SAID
    _NAMELESS_SAID.add(key)
    return said

FORMATS = ("yolo", "coco")
YAML_NAMES = ("data.yaml", "dataset.yaml", "data.yml", "dataset.yml")
CLASS_FILE = "classes.txt"  # LabelImg writes it among the label files: no image's labels
# a coordinate further outside the image than this (pixels) counts as clipped; closer is
# the rounding of normalised coordinates (6 decimals of a 10000-pixel side: 0.005 px)
CLIP_TOLERANCE = 0.01

# counts' keys, and what the warning says of each
REASONS = {
    "label_without_image": "label files without an image (skipped)",
    "no_label_file": "images without a label file (no boxes)",
    "malformed": "malformed label entries (skipped)",
    "class_out_of_range": "boxes with a class out of range (dropped)",
    "degenerate": "degenerate boxes, zero or negative width or height (dropped)",
    "clipped": "boxes reaching outside their image (clipped to it)",
    "crowd": "iscrowd boxes (left out, as COCO's detectors train)",
    "annotation_without_image": "annotations of images the JSON does not list (skipped)",
    "image_missing": "images the JSON lists that are not on disk (skipped)",
    "not_annotated": "images on disk the JSON does not list (skipped)",
    "unreadable_size": "images whose size cannot be read (skipped)",
    "resized": "images of another size than the JSON gives, of its shape (a resized copy: "
               "boxes scaled to it)",
    "size_mismatch": "images whose JSON width x height is not the upright image's, nor of "
                     "its shape (skipped with their boxes)",
    "duplicate_id": "image entries sharing one id (each skipped with the boxes of that id)",
    "duplicate_file": "images listed twice under two ids (each entry skipped with its boxes)",
}


@dataclass(frozen=True)
class ImageTargets:
    """One image's boxes (float32 [n, 4], xyxy, pixels of the upright source image) and
    class ids (int64 [n]); ``height`` x ``width``: the size they are in (0 x 0 when no size
    was read: an image with no boxes); ``image_id``: COCO's id, or the position in the
    set for YOLO."""

    boxes: torch.Tensor
    labels: torch.Tensor
    height: int
    width: int
    image_id: int


@dataclass
class LabelSet:
    """What ``read_labels`` found.

    Attributes:
        format: "yolo" or "coco".
        root: what the images' names are relative to (the images folder).
        source: the labels folder, or the JSON file.
        classes: class names by id (0..K-1).
        targets: image path (absolute, as a str) -> its ``ImageTargets``, in sorted order of
            the path relative to ``root``.
        skipped: what was left out, with its reason (a file, a line, an annotation).
        counts: how many of each kind of bad input (``REASONS``'s keys).
        category_ids: COCO's category id of each class (its ``categories``' ids, in class
            order: 1..90 with gaps for COCO itself); None for YOLO (the class index is the id).
    """

    format: str
    root: Path
    source: Path
    classes: list[str]
    targets: dict[str, ImageTargets]
    skipped: list[SkippedFile] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    category_ids: list[int] | None = None

    @property
    def num_boxes(self) -> int:
        return sum(len(t.labels) for t in self.targets.values())


class _Report:
    """Counts bad input by kind, keeps the skipped entries, says each kind once."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.skipped: list[SkippedFile] = []
        self.first: dict[str, str] = {}

    def count(self, kind: str, where: str, why: str = "", n: int = 1) -> None:
        self.counts[kind] += n
        self.first.setdefault(kind, f"{printable(where)}{': ' + why if why else ''}")

    def skip(self, kind: str, path: str, why: str) -> None:
        self.count(kind, path, why)
        self.skipped.append(SkippedFile(path, why, label=True))

    def say(self, source: Path) -> None:
        for kind, n in self.counts.items():
            if n:
                level = logging.INFO if kind in ("crowd", "no_label_file", "resized") \
                    else logging.WARNING
                log.log(level, "%s: %d %s, e.g. %s", printable(str(source)), n, REASONS[kind],
                        self.first[kind])


def _empty() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros((0, 4), dtype=torch.float32), torch.zeros(0, dtype=torch.int64)


def _clip(xyxy: np.ndarray, h: int, w: int, report: _Report, where: list[str]
          ) -> tuple[np.ndarray, np.ndarray]:
    """Boxes (float64 [n, 4]) clipped to the w x h image, and which are kept (positive
    width and height once clipped); the clipped and the degenerate counted."""
    limits = np.array([w, h, w, h], np.float64)
    clipped = np.clip(xyxy, 0.0, limits)
    moved = (np.abs(clipped - xyxy) > CLIP_TOLERANCE).any(1)
    keep = (clipped[:, 2] > clipped[:, 0]) & (clipped[:, 3] > clipped[:, 1])
    for k in np.flatnonzero(moved & keep):
        report.count("clipped", where[k])
    for k in np.flatnonzero(~keep):
        x1, y1, x2, y2 = xyxy[k]
        report.skip("degenerate", where[k],
                    f"box ({x1:.1f}, {y1:.1f}, {x2:.1f}, {y2:.1f}) has no area inside the "
                    f"{w}x{h} image; dropped")
    return clipped, keep


# --- the format ---------------------------------------------------------------------------

def _coco_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root] if root.suffix.lower() == ".json" else []
    return sorted([*root.glob("annotations/instances_*.json"), *root.glob("instances_*.json")])


def _yolo_dirs(root: Path, split: str | None) -> tuple[Path, Path] | None:
    """The (images, labels) folders of a YOLO layout at ``root``, or None. A split's images
    folder without its labels folder is refused (a DatasetError): the layout's top
    ``labels/`` would give it the training images' boxes, or another split's."""
    candidates = [(root / "images" / split, root / "labels" / split),
                  (root / split / "images", root / split / "labels")] if split else []
    for images, labels in candidates:
        if images.is_dir() and labels.is_dir():
            return images, labels
    for images, labels in candidates:
        if images.is_dir():
            raise DatasetError(
                f"dataset.path={printable(str(root))}: the {split} split's images "
                f"({printable(str(images))}) have no labels folder ({printable(str(labels))} "
                f"is missing): put the split's label files there (<image stem>.txt); the "
                "top labels/ is not this split's")
    candidates.append((root / "images", root / "labels"))
    if "images" in root.parts:
        # the images folder itself (ultralytics' 'train: images/train'): the last /images/
        # of its path -> /labels/, as ultralytics finds label files
        parts = list(root.parts)
        at = len(parts) - 1 - parts[::-1].index("images")
        candidates.append((root, Path(*parts[:at], "labels", *parts[at + 1 :])))
    for images, labels in candidates:
        if images.is_dir() and labels.is_dir():
            return images, labels
    return None


def detect_format(path: str | Path, split: str | None = None) -> str:
    """"coco" when ``path`` is a COCO JSON or holds ``annotations/instances_*.json``;
    "yolo" when it holds ``images/`` and ``labels/`` side by side; a DatasetError otherwise."""
    root = Path(path).expanduser()
    if _coco_files(root):
        return "coco"
    if root.is_dir() and _yolo_dirs(root, split) is not None:
        return "yolo"
    raise DatasetError(
        f"dataset.path={printable(str(root))} holds no detection labels this runner reads: "
        "give a YOLO layout (images/ and labels/ side by side, labels/<image stem>.txt) or "
        "COCO's annotations (annotations/instances_<split>.json beside the images)")


def read_labels(path: str | Path, format: str = "auto", split: str | None = None,
                classes: list[str] | None = None, cache_dir: str | Path | None = None,
                stats: dict[str, tuple[int, int, int, int]] | None = None) -> LabelSet:
    """The detection targets at ``path`` (``format``: "auto", "yolo" or "coco"; ``split``:
    which split's folder or JSON, e.g. "train"; ``classes``: YOLO class names, when the
    layout has no data.yaml or classes.txt; ``cache_dir``: where the labels cache lives,
    runner/data/sources/labelcache.py, None: none; ``stats``: YOLO label files' stat rows
    taken already)."""
    if format not in ("auto", *FORMATS):
        raise DatasetError(f"labels format {format!r} is not one of auto, yolo, coco")
    if format == "auto":
        format = detect_format(path, split)
    if format == "yolo":
        return read_yolo(path, split, classes, cache_dir, stats)
    return read_coco(path, split=split, cache_dir=cache_dir)


# --- YOLO ---------------------------------------------------------------------------------

def other_yaml(root: Path) -> list[Path]:
    """The dataset's own YAML files at its root under other names (Ultralytics' sets are
    named after themselves: ``coco128.yaml``), in name order."""
    try:
        return sorted(p for p in root.iterdir() if p.suffix in (".yaml", ".yml")
                      and p.name not in YAML_NAMES and p.is_file())
    except OSError:
        return []


def _yaml_names(*folders: Path) -> list[str] | None:
    import yaml

    files = [folder / name for folder in dict.fromkeys(folders) for name in YAML_NAMES]
    for file in files + other_yaml(folders[0]):
        if not file.is_file():
            continue
        try:
            names = (yaml.safe_load(file.read_text(encoding="utf-8-sig")) or {}).get("names")
        except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError) as e:
            if file.name not in YAML_NAMES:  # another YAML file: not necessarily the set's
                continue
            raise DatasetError(f"{printable(str(file))} cannot be read as YAML ({e}); fix "
                               "it or remove it (class names then come from the ids)"
                               ) from e
        if names is not None and file.name not in YAML_NAMES:
            log.info("class names from %s", printable(str(file)))
        if isinstance(names, dict):
            try:
                ids = sorted(int(k) for k in names)
            except (TypeError, ValueError):
                ids = None
            if ids is None or ids != list(range(len(ids))):
                raise DatasetError(f"{printable(str(file))}: names' keys are not the ids "
                                   f"0..{len(names) - 1}; give names as a list or "
                                   "{0: name, 1: name, ...}")
            return [str(names[k] if k in names else names[str(k)]) for k in ids]
        if isinstance(names, list):
            return [str(n) for n in names]
    return None


def _class_file_names(*folders: Path) -> list[str] | None:
    for folder in folders:
        file = folder / CLASS_FILE
        if file.is_file():
            return [line.strip() for line in file.read_text(encoding="utf-8-sig",
                                                             errors="replace").splitlines()
                    if line.strip()]
    return None


def _class_id(token: str) -> int | None:
    try:
        value = float(token)
    except ValueError:
        return None
    return int(value) if math.isfinite(value) and value == int(value) else None


def _parse_file(file: Path, text: str) -> ParsedFile:
    """A label file's text parsed (``_parse_yolo``), its bad lines kept to be said."""
    report = _Report()
    ids, boxes, lines = _parse_yolo(file, text, report)
    return ParsedFile(ids, boxes, lines, [("malformed", s.error) for s in report.skipped])


def _parse_yolo(file: Path, text: str, report: _Report
                ) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """A label file's well-formed lines: class ids, normalised xyxy boxes, line numbers."""
    ids, boxes, lines = [], [], []
    for n, line in enumerate(text.splitlines(), 1):
        tokens = line.split()
        if not tokens:
            continue
        where = f"line {n}"
        values = tokens[1:]
        polygon = len(values) > 4 and len(values) % 2 == 0
        if len(values) != 4 and not polygon:
            report.skip("malformed", str(file), f"{where}: {len(tokens)} values, not 'class cx "
                        "cy w h' (5) or a polygon 'class x1 y1 x2 y2 ...'; skipped")
            continue
        cls = _class_id(tokens[0])
        try:
            numbers = [float(v) for v in values]
        except ValueError:
            numbers = None
        if cls is None or numbers is None or not all(map(math.isfinite, numbers)):
            report.skip("malformed", str(file), f"{where}: {line.strip()[:60]!r} is not a "
                        "class id and finite numbers; skipped")
            continue
        if polygon:
            xs, ys = numbers[0::2], numbers[1::2]
            box = [min(xs), min(ys), max(xs), max(ys)]
        else:
            cx, cy, w, h = numbers
            box = [cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2]
        ids.append(cls)
        boxes.append(box)
        lines.append(n)
    return np.array(ids, np.int64), np.array(boxes, np.float64).reshape(-1, 4), lines


def upright_size(path) -> tuple[int, int]:
    """(height, width) of the image at ``path`` (or in a binary file object) once its EXIF
    orientation is applied, from its header (PIL opens lazily: nothing is decoded)."""
    from PIL import Image

    with Image.open(path) as img:
        w, h = img.size
        try:
            orientation = img.getexif().get(0x0112, 1)
        except Exception:  # a broken EXIF block: the decoders ignore it too
            orientation = 1
    return (w, h) if orientation in (5, 6, 7, 8) else (h, w)


def _sizes(paths: list[str], cache: LabelCache | None = None
           ) -> list[tuple[int, int] | str]:
    """Each image's upright size, or why it cannot be read (threads: a header read each;
    ``cache``: those it holds for the file as it is are not read)."""
    def one(path: str) -> tuple[int, int] | str:
        try:
            return upright_size(path)
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    cached = [cache.size(p) for p in paths] if cache is not None else [([], None)] * len(paths)
    todo = [p for p, (_, size) in zip(paths, cached) if size is None]
    if len(todo) < 64:
        read = [one(p) for p in todo]
    else:
        with ThreadPoolExecutor(8) as pool:
            read = list(pool.map(one, todo))
    got = iter(read)
    out: list[tuple[int, int] | str] = []
    for path, (stat, size) in zip(paths, cached):
        if size is None:
            size = next(got)
            if cache is not None and not isinstance(size, str):
                cache.put_size(path, stat, size)
        out.append(size)
    return out


def relative(path: str | Path, folder: str | Path) -> str:
    """``path`` relative to ``folder``, which it was found under (a walk's own join: a
    prefix cut, where ``os.path.relpath``'s two abspaths cost more than the listing)."""
    path, prefix = str(path), os.path.join(str(folder), "")
    return path[len(prefix):] if path.startswith(prefix) else os.path.relpath(path, folder)


def _sorted_images(images: Path) -> list[str]:
    walked, _, _ = walk(images, [os.path.realpath(images)])
    found = [os.path.join(d, f) for d, files in walked for f in files if is_image_name(f)]
    return sorted(found, key=lambda p: relative(p, images).split(os.sep))


def yolo_inputs(path: str | Path, split: str | None = None
                ) -> tuple[Path, list[str], list[str]] | None:
    """What ``read_yolo`` lists and reads at ``path``, without reading a label file: the
    images folder, its images in listing order, and the files the boxes and class names
    come from (every ``.txt`` under the labels folder, and each place a ``data.yaml`` or
    ``classes.txt`` is looked for, there or not); None when it is not a YOLO layout."""
    dirs = _yolo_dirs(Path(path).expanduser(), split)
    if dirs is None:
        return None
    images, labels = dirs
    root = Path(path).expanduser()
    walked, _, _ = walk(labels, [os.path.realpath(labels)])
    files = sorted(os.path.join(d, f) for d, names in walked for f in names
                   if f.endswith(".txt"))
    names = [str(folder / name) for folder in dict.fromkeys(
        (root, images.parent, images.parent.parent)) for name in YAML_NAMES]
    names += [str(p) for p in other_yaml(root)]
    names += [str(folder / CLASS_FILE) for folder in (labels, labels.parent, root)]
    return images, _sorted_images(images), files + names


def read_yolo(path: str | Path, split: str | None = None, classes: list[str] | None = None,
              cache_dir: str | Path | None = None,
              stats: dict[str, tuple[int, int, int, int]] | None = None) -> LabelSet:
    """The YOLO layout at ``path`` (module docstring); ``cache_dir``: where the labels
    cache lives (runner/data/sources/labelcache.py; None: every label file read);
    ``stats``: the label files' stat rows, if taken already (before reading them)."""
    root = Path(path).expanduser()
    dirs = _yolo_dirs(root, split)
    if dirs is None:
        where = f" (split {split!r})" if split else ""
        raise DatasetError(f"dataset.path={printable(str(root))}{where} has no images/ and "
                           "labels/ folders side by side (the YOLO layout)")
    images, labels = dirs
    names = classes or _yaml_names(root, images.parent, images.parent.parent) or \
        _class_file_names(labels, labels.parent, root)
    report = _Report()
    image_paths = _sorted_images(images)
    stem_of = {p: os.path.splitext(relative(p, images))[0] for p in image_paths}
    stems = set(stem_of.values())  # a.jpg and a.png both take labels/a.txt, as in ultralytics
    # label files, and the ones with no image
    label_of: dict[str, Path] = {}
    walked, _, _ = walk(labels, [os.path.realpath(labels)])
    for dirpath, files in sorted(walked):
        for name in sorted(files):
            if not name.endswith(".txt"):
                continue
            file = Path(dirpath, name)
            stem = os.path.splitext(relative(file, labels))[0]
            if stem in stems:
                label_of[stem] = file
            elif name != CLASS_FILE:
                report.skip("label_without_image", str(file),
                            f"no image {stem}.* under {printable(str(images))}; its boxes are "
                            "not used")
    parsed: dict[str, tuple[Path, np.ndarray, np.ndarray, list[int]]] = {}
    cache = LabelCache(cache_dir, labels, stats)
    for image, stem in stem_of.items():
        file = label_of.get(stem)
        if file is None:
            report.count("no_label_file", image)
            continue
        got = cache.parsed(file, _parse_file)
        if isinstance(got, str):
            report.skip("malformed", str(file), f"{got}; the image has no boxes")
            continue
        for kind, why in got.issues:
            report.skip(kind, str(file), why)
        if len(got.ids):
            parsed[image] = (file, got.ids, got.boxes, got.lines)
    num_classes = len(names) if names else 1 + max(
        (int(ids.max()) for _, ids, _, _ in parsed.values() if (ids >= 0).any()), default=-1)
    classes = list(names) if names else [str(k) for k in range(num_classes)]
    if not names and not classes_said(root):
        log.warning("%s: no class names (data.yaml's names, classes.txt): the classes are the "
                    "ids seen, 0..%d; a name file makes an id beyond them a reported bad "
                    "label", printable(str(root)), num_classes - 1)
    # sizes of the images with boxes (the normalised coordinates need them)
    with_boxes = list(parsed)
    sizes = dict(zip(with_boxes, _sizes(with_boxes, cache)))
    cache.save()
    if cache.hits:
        log.info("%s: %d label files from the labels cache, %d read", printable(str(labels)),
                 cache.hits, cache.reads)
    targets: dict[str, ImageTargets] = {}
    for position, image in enumerate(image_paths):
        if image not in parsed:
            targets[image] = ImageTargets(*_empty(), 0, 0, position)
            continue
        file, ids, boxes, lines = parsed[image]
        size = sizes[image]
        if isinstance(size, str):
            report.skip("unreadable_size", image, f"its size cannot be read ({size}); skipped "
                        "with its boxes")
            continue
        h, w = size
        where = [f"{file}: line {n}" for n in lines]
        in_range = (ids >= 0) & (ids < num_classes)
        for k in np.flatnonzero(~in_range):
            report.skip("class_out_of_range", str(file),
                        f"line {lines[k]}: class {ids[k]} is out of range ({num_classes} "
                        f"classes: 0..{num_classes - 1}); the box is dropped")
        pixels = boxes[in_range] * np.array([w, h, w, h], np.float64)
        xyxy, keep = _clip(pixels, h, w, report, [x for x, ok in zip(where, in_range) if ok])
        targets[image] = ImageTargets(torch.from_numpy(xyxy[keep]).to(torch.float32),
                                      torch.from_numpy(ids[in_range][keep]), h, w, position)
    report.say(labels)
    if targets and not any(len(t.labels) for t in targets.values()):
        log.warning("%s: none of its %d images has a box (%d label files; a line is 'class cx "
                    "cy w h', normalised): a detector trains on nothing from it and validation "
                    "has nothing to score; check the label files", printable(str(labels)),
                    len(targets), len(label_of))
    return LabelSet("yolo", images, labels, classes, targets, report.skipped, report.counts)


# --- COCO ---------------------------------------------------------------------------------

def _coco_json(path: Path, split: str | None) -> Path:
    files = _coco_files(path)
    if split and len(files) > 1:
        files = [f for f in files if f.stem.removeprefix("instances_").startswith(split)]
    if not files:
        raise DatasetError(f"dataset.path={printable(str(path))} holds no COCO annotations "
                           f"(annotations/instances_{split or '<split>'}.json)")
    if len(files) > 1:
        raise DatasetError(f"dataset.path={printable(str(path))} holds several COCO "
                           f"annotation files ({', '.join(f.name for f in files)}); name the "
                           "split (e.g. train2017) or give the JSON itself")
    return files[0]


def _coco_images_dir(file: Path, root: Path, names: list[str]) -> Path:
    """Where the images of ``file`` are: of the usual places, the one holding most of the
    first listed ones (one missing image does not send the search elsewhere)."""
    split = file.stem.removeprefix("instances_")
    base = file.parent.parent if file.parent.name == "annotations" else file.parent
    candidates = [base / split, base / "images" / split, base / "images", base, file.parent]
    if root.is_dir():
        candidates.insert(0, root / split)
    candidates = list(dict.fromkeys(candidates))
    if not names:
        return next((c for c in candidates if c.is_dir()), base)
    found = [sum((folder / n).is_file() for n in names) for folder in candidates]
    if max(found) == 0:
        raise DatasetError(
            f"the images of {printable(str(file))} are not found: its first image "
            f"{printable(names[0])} is in none of "
            f"{', '.join(printable(str(c)) for c in candidates)}; put them in "
            f"{printable(str(base / split))}")
    return candidates[found.index(max(found))]


def read_coco_json(root: Path, split: str | None) -> tuple[Path, dict]:
    """The ``instances_*.json`` at ``root`` (``_coco_json``) and its content, checked to be
    COCO's (images and categories lists), or a DatasetError naming the file."""
    file = _coco_json(root, split)
    try:
        data = json.loads(file.read_bytes())
    except (OSError, ValueError) as e:
        raise DatasetError(f"{printable(str(file))} cannot be read as JSON ({e})") from e
    if not isinstance(data, dict) or not isinstance(data.get("images"), list) \
            or not isinstance(data.get("categories"), list):
        raise DatasetError(f"{printable(str(file))} is not COCO instances JSON: it needs "
                           "'images', 'annotations' and 'categories' lists")
    return file, data


def _whole(value: object) -> bool:
    """An id COCO's files use: a whole number (not a bool, a list, a string)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _finite_bbox(value: object) -> list[float] | None:
    if not isinstance(value, (list, tuple)) or len(value) != 4:
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return None
    return [float(v) for v in value] if all(map(math.isfinite, value)) else None


def read_coco(path: str | Path, images: str | Path | None = None, split: str | None = None,
              cache_dir: str | Path | None = None) -> LabelSet:
    """COCO's ``instances_*.json`` at ``path`` (the file, or the folder that holds
    ``annotations/``), its images in ``images`` (found beside it when not given);
    ``cache_dir``: where the images' sizes are cached (runner/data/sources/labelcache.py)."""
    root = Path(path).expanduser()
    file, data = read_coco_json(root, split)
    report = _Report()
    source = str(file)
    categories = sorted((c for c in data["categories"] if isinstance(c, dict)
                         and _whole(c.get("id"))), key=lambda c: c["id"])
    class_of = {c["id"]: k for k, c in enumerate(categories)}
    classes = [str(c.get("name", c["id"])) for c in categories]
    entries: list[tuple[int, str, int, int]] = []
    for entry in data["images"]:
        try:
            if not _whole(entry["id"]):
                raise TypeError
            entries.append((entry["id"], str(entry["file_name"]), int(entry["height"]),
                            int(entry["width"])))
        except (KeyError, TypeError, ValueError):
            report.skip("malformed", source, f"image entry {str(entry)[:80]}: no id, "
                        "file_name, height and width; skipped")
    listed, doubtful = _unique_entries(entries, file.name)
    doubtful_ids = {e[0] for e in doubtful}
    folder = Path(images).expanduser() if images is not None else _coco_images_dir(
        file, root, [name for name, _, _ in list(listed.values())[:20]])
    # annotations grouped by image
    per_image: dict[int, list[tuple[list[float], int, str]]] = {}
    doubtful_boxes: Counter = Counter()
    for ann in data.get("annotations") or []:
        if not isinstance(ann, dict):
            report.skip("malformed", source, f"annotation {str(ann)[:60]} is not an object")
            continue
        where = f"annotation {ann.get('id', '?')}"
        if _whole(ann.get("image_id")) and ann["image_id"] in doubtful_ids:
            doubtful_boxes[ann["image_id"]] += 1  # said with the entries it cannot go to
            continue
        if not _whole(ann.get("image_id")) or ann["image_id"] not in listed:
            report.skip("annotation_without_image", source,
                        f"{where}: image_id {ann.get('image_id')!r} is not in 'images'; "
                        "skipped")
            continue
        if ann.get("iscrowd"):
            report.count("crowd", f"{source}: {where}")
            continue
        bbox = _finite_bbox(ann.get("bbox"))
        if bbox is None:
            report.skip("malformed", source, f"{where}: bbox {str(ann.get('bbox'))[:60]} is "
                        "not 4 finite numbers (x, y, w, h); skipped")
            continue
        if not _whole(ann.get("category_id")) or ann["category_id"] not in class_of:
            report.skip("class_out_of_range", source,
                        f"{where}: category_id {ann.get('category_id')!r} is not among the "
                        f"{len(classes)} categories; the box is dropped")
            continue
        per_image.setdefault(ann["image_id"], []).append(
            (bbox, class_of[ann["category_id"]], f"{source}: {where}"))
    seen = set()
    for image_id, kind, name, why in doubtful:
        seen.add(os.path.normpath(str(folder / name)))
        n = doubtful_boxes[image_id]
        report.skip(kind, str(folder / name), f"{why}; skipped with the {n} "
                    f"box{'es' if n != 1 else ''} of id {image_id}")
    targets: dict[str, ImageTargets] = {}
    on_disk = []
    for image_id, (name, h, w) in sorted(listed.items(), key=lambda kv: kv[1][0].split("/")):
        image = str(folder / name)
        seen.add(os.path.normpath(image))
        if not os.path.isfile(image):
            report.skip("image_missing", image, f"listed in {file.name} (id {image_id}) but "
                        "not on disk; skipped with its boxes")
            continue
        on_disk.append((image_id, image, h, w))
    cache = LabelCache(cache_dir, file)
    sizes = _sizes([image for _, image, _, _ in on_disk], cache)
    cache.save()
    for (image_id, image, h, w), size in zip(on_disk, sizes):
        anns = per_image.get(image_id, [])
        if not _size_agrees(report, file.name, image, (h, w), size, len(anns)):
            continue
        if not anns:
            targets[image] = ImageTargets(*_empty(), h, w, image_id)
            continue
        xywh = np.array([a[0] for a in anns], np.float64)
        xyxy = np.concatenate([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], 1)
        ids = np.array([a[1] for a in anns], np.int64)
        clipped, keep = _clip(xyxy, h, w, report, [a[2] for a in anns])
        targets[image] = ImageTargets(torch.from_numpy(clipped[keep]).to(torch.float32),
                                      torch.from_numpy(ids[keep]), h, w, image_id)
    for image in _unlisted(folder, seen):
        report.skip("not_annotated", image, f"not listed in {file.name}; skipped")
    report.say(file)
    return LabelSet("coco", folder, file, classes, targets, report.skipped, report.counts,
                    [c["id"] for c in categories])


def _unique_entries(entries: list[tuple[int, str, int, int]], json_name: str
                    ) -> tuple[dict[int, tuple[str, int, int]], list[tuple[int, str, str, str]]]:
    """The image entries that name one image each (id -> file_name, height, width), and
    those that contradict another ((id, kind, file_name, why) each): two entries of one id (its
    annotations cannot tell which image they belong to), or one file under two ids (which
    id's boxes are its own is unknown). Neither is merged: each is skipped, counted."""
    ids = Counter(e[0] for e in entries)
    names = Counter(os.path.normpath(e[1]) for e in entries)
    listed: dict[int, tuple[str, int, int]] = {}
    doubtful: list[tuple[int, str, str, str]] = []
    for image_id, name, h, w in entries:
        if ids[image_id] > 1:
            others = [e[1] for e in entries if e[0] == image_id]
            doubtful.append((image_id, "duplicate_id", name, f"{json_name} lists id "
                             f"{image_id} for {len(others)} images ({', '.join(others[:3])})"))
        elif names[os.path.normpath(name)] > 1:
            others = [str(e[0]) for e in entries
                      if os.path.normpath(e[1]) == os.path.normpath(name)]
            doubtful.append((image_id, "duplicate_file", name, f"{json_name} lists this file "
                             f"under {len(others)} ids ({', '.join(others[:3])})"))
        else:
            listed[image_id] = (name, h, w)
    return listed, doubtful


def _size_agrees(report: _Report, json_name: str, image: str, given: tuple[int, int],
                 size: tuple[int, int] | str, boxes: int) -> bool:
    """Whether ``image``'s boxes can be used in the JSON's frame (``given``: its height
    and width): COCO's sizes are the upright image's (EXIF orientation applied). The same
    size, or a copy resized with its shape kept (each side within a pixel of the scaled
    size: the boxes are scaled with it, counted ``resized``); any other size is skipped
    with the image's boxes (``size_mismatch``), as is one that cannot be read."""
    plural = "es" if boxes != 1 else ""
    if isinstance(size, str):
        report.skip("unreadable_size", image, f"its size cannot be read ({size}); skipped "
                    f"with its {boxes} box{plural}")
        return False
    (h, w), (fh, fw) = given, size
    if (h, w) == (fh, fw):
        return True
    if h > 0 and w > 0 and abs(h * fw / w - fh) <= 1 and abs(w * fh / h - fw) <= 1:
        report.count("resized", image, f"{json_name} gives {w}x{h}, the file is {fw}x{fh}")
        return True
    why = f"{json_name} gives {w}x{h} (width x height), the upright image is {fw}x{fh}"
    if (h, w) == (fw, fh):
        why += (" (the stored size of an EXIF-rotated image: COCO's sizes are the upright "
                "image's, as its boxes are)")
    report.skip("size_mismatch", image, f"{why}; skipped with its {boxes} box{plural}")
    return False


def _unlisted(folder: Path, seen: Iterable[str]) -> list[str]:
    """Images directly in ``folder`` that the JSON does not list (COCO's folders are flat)."""
    try:
        with os.scandir(folder) as it:
            names = sorted(e.name for e in it if e.is_file() and is_image_name(e.name))
    except OSError:
        return []
    seen = set(seen)
    return [str(folder / n) for n in names if os.path.normpath(str(folder / n)) not in seen]
