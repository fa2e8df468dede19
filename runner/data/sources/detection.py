"""``dataset.targets``: a detection dataset listed for the runner, each image with its boxes.

``list_detection(dataset, path)`` reads the labels (runner/data/sources/labels.py: a YOLO
layout or COCO's JSON, bad input counted and reported) and lists the images that have an
entry, in the label set's order, as a ``Listing`` whose ``targets`` (``DetectionTargets``)
hold each image's boxes in step with its samples; every sample's class index is 0 (a
detection image has no one class: ``classes`` are the boxes' classes). A layout with split
folders (YOLO's ``images/train`` and ``images/val``, COCO's ``instances_train*.json`` and
``instances_val*.json``) gives the split ``dataset.split`` names (validation reads ``val``);
one without them is split by ``dataset.val_fraction`` as an image folder is, and
``dataset.split=val`` on it without a ``dataset.val_fraction`` is refused (``check_split``).
A split's images folder without its labels folder is refused too (labels.py).

A YOLO listing also records the files its labels were read from and their stats, taken
before reading them (``DetectionTargets.inputs``, ``input_stats``): a store that holds the
boxes (runner/data/storage/packed.py) keeps them, and ``quick_detection`` lists the same
images without reading a label file, so that store is opened with a ``stat`` of each
label file instead of a parse of it.

Unset ``dataset.path``: the generated shapes dataset (runner/data/sources/shapes.py), made
once in the cache, with its own train/val split.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from runner.common.text import printable
from runner.config.schema import DatasetConfig, Split, TargetName
from runner.data.protocol import SkippedFile
from runner.data.sources.labels import ImageTargets, detect_format, read_labels, yolo_inputs
from runner.data.sources.listing import DatasetError, Listing, split_listing, stat_row


@dataclass
class DetectionTargets:
    """Each listed image's boxes (``ImageTargets``: float32 [n, 4] xyxy in pixels of the
    upright source image at ``height`` x ``width``, int64 [n] class ids), in listing order,
    and what the labels left out (``skipped``: reported in ``skipped_files``).

    ``category_ids``: COCO's id of each class (None: the class index is the id), so served
    detections name the categories the user's ground truth does."""

    items: list[ImageTargets]
    format: str
    skipped: list[SkippedFile] = field(default_factory=list)
    category_ids: list[int] | None = None
    inputs: list[str] | None = None  # the label files read (YOLO; None: COCO's one JSON)
    input_stats: list[tuple[int, int, int, int]] | None = None  # theirs, before reading
    kind = TargetName.boxes  # what they are (not a field): runner/data/targets/' record

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> ImageTargets:
        return self.items[index]

    def source_size(self, index: int) -> tuple[int, int]:
        """Image ``index``'s upright source size (height, width; 0 x 0 where the labels gave
        none: a YOLO image without boxes)."""
        return self.items[index].height, self.items[index].width

    def image_id(self, index: int) -> int:
        return self.items[index].image_id

    def subset(self, positions: list[int]) -> DetectionTargets:
        """The targets of the listed images ``positions`` (a split's side)."""
        return DetectionTargets([self.items[k] for k in positions], self.format, self.skipped,
                                self.category_ids, self.inputs, self.input_stats)


def has_split(root: Path, format: str, split: str) -> bool:
    """Whether the layout at ``root`` has a folder (YOLO) or a JSON (COCO) of ``split``."""
    if format in ("auto", "yolo") and ((root / "images" / split).is_dir()
                                       or (root / split / "images").is_dir()):
        return True
    if format in ("auto", "coco"):
        return any((root / "annotations").glob(f"instances_{split}*.json"))
    return False


def default_path(dataset: DatasetConfig, progress: bool = True) -> Path:
    """The generated shapes dataset (``dataset.num_images`` of them, ``dataset.quality``),
    made once in ``dataset.cache_dir``."""
    from runner.data.sources.shapes import ShapesSpec, ensure_shapes

    spec = ShapesSpec(num_images=dataset.num_images, quality=dataset.quality)
    return ensure_shapes(spec, Path(dataset.cache_dir).expanduser(), progress=progress)


def has_val_split(dataset: DatasetConfig) -> bool:
    """Whether a detection dataset's layout holds a training split and a validation split
    of its own (the generated one does): training then validates on ``val`` after each
    epoch."""
    if not dataset.targets.boxes or dataset.val_path is not None or dataset.val_fraction > 0:
        return False
    if dataset.path is None and dataset.manifest is None:
        return True  # the shapes dataset: images/val
    if dataset.path is None:
        return False
    # both: a layout with only a val split trains on it (the split it has), and validating
    # on the images it trains on would say nothing
    root, format = Path(dataset.path).expanduser(), dataset.targets.value
    return has_split(root, format, Split.val.value) and has_split(root, format,
                                                                  Split.train.value)


def check_split(dataset: DatasetConfig, root: Path, split: str | None) -> None:
    """``dataset.split=val`` on a layout without a val split of its own, and no
    ``dataset.val_fraction`` to hold one out, is refused in one line (the runner sets it
    only where there is one: a user asked for it, and reading every image instead would
    answer another question)."""
    if dataset.split is Split.val and split is None and dataset.val_fraction == 0:
        raise DatasetError(
            f"dataset.split=val: dataset.path={printable(str(root))} has no val split of its "
            "own (images/val with labels/val, val/images with val/labels, or "
            "annotations/instances_val*.json): drop dataset.split to read all its images, or "
            "point dataset.path at the validation images")


def list_detection(dataset: DatasetConfig, path: str | Path) -> Listing:
    """The images at ``path`` that the labels name, each with its boxes (``targets``)."""
    root = Path(path).expanduser()
    format = dataset.targets.value
    split = dataset.split.value if dataset.val_fraction == 0 and has_split(
        root, format, dataset.split.value) else None
    check_split(dataset, root, split)
    inputs = stats = None
    if format in ("auto", "yolo") and (format == "yolo" or detect_format(root, split) == "yolo"):
        found = yolo_inputs(root, split)
        if found is not None:  # stat-ed before they are read: a change after is seen
            inputs = found[2]
            stats = [stat_row(p) for p in inputs]
    labels = read_labels(root, format, split, cache_dir=dataset.cache_dir,
                         stats=dict(zip(inputs, stats)) if inputs else None)
    samples = [(image, 0) for image in labels.targets]
    targets = DetectionTargets(list(labels.targets.values()), labels.format, labels.skipped,
                               labels.category_ids, inputs=inputs, input_stats=stats)
    listing = Listing(labels.root, labels.classes, samples,
                      f"{labels.format} detection labels" + (f", {split} split" if split
                                                              else ""), [], targets)
    if dataset.val_fraction > 0:
        listing = split_listing(listing, dataset.val_fraction, dataset.split_seed,
                                dataset.split is Split.val)
    return listing


def quick_detection(dataset: DatasetConfig, path: str | Path
                    ) -> tuple[Listing, list[str], list[tuple[int, int, int, int]]] | None:
    """The listing ``list_detection`` would give, without its targets and without reading a
    label file (a YOLO layout, not split by ``dataset.val_fraction``), with the label files
    and their stats: for a store that holds the boxes to check against. None where it
    cannot be listed so (COCO lists its images in its JSON)."""
    if dataset.val_fraction > 0:
        return None
    root = Path(path).expanduser()
    format = dataset.targets.value
    split = dataset.split.value if has_split(root, format, dataset.split.value) else None
    check_split(dataset, root, split)
    try:
        if format == "auto":
            format = detect_format(root, split)
    except DatasetError:
        return None
    found = yolo_inputs(root, split) if format == "yolo" else None
    if found is None:
        return None
    images, paths, inputs = found
    listing = Listing(images, [], [(p, 0) for p in paths], "yolo detection labels" + (
        f", {split} split" if split else ""), [], None)
    return listing, inputs, [stat_row(p) for p in inputs]
