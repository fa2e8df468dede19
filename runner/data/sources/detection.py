"""``dataset.targets``: a detection dataset listed for the runner, each image with its boxes.

``list_detection(dataset, path)`` reads the labels (runner/data/sources/labels.py: a YOLO
layout or COCO's JSON, bad input counted and reported) and lists the images that have an
entry, in the label set's order, as a ``Listing`` whose ``targets`` (``DetectionTargets``)
hold each image's boxes in step with its samples; every sample's class index is 0 (a
detection image has no one class: ``classes`` are the boxes' classes). A layout with split
folders (YOLO's ``images/train`` and ``images/val``, COCO's ``instances_train*.json`` and
``instances_val*.json``) gives the split ``dataset.split`` names (validation reads ``val``);
one without them is split by ``dataset.val_fraction`` as an image folder is.

Unset ``dataset.path``: the generated shapes dataset (runner/data/sources/shapes.py), made
once in the cache, with its own train/val split.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from runner.config.schema import DatasetConfig, Split
from runner.data.protocol import SkippedFile
from runner.data.sources.labels import ImageTargets, read_labels
from runner.data.sources.listing import Listing, split_listing


@dataclass
class DetectionTargets:
    """Each listed image's boxes (``ImageTargets``: float32 [n, 4] xyxy in pixels of the
    upright source image at ``height`` x ``width``, int64 [n] class ids), in listing order,
    and what the labels left out (``skipped``: reported in ``skipped_files``).

    ``category_ids``: COCO's id of each class (None: the class index is the id), so served
    detections name the categories the user's ground truth does. ``source_sizes``: each
    image's upright source size (height, width) where ``items`` are at another size (a
    store's), so served detections can be mapped back to the source's pixels; None: the
    items' own sizes are the source's."""

    items: list[ImageTargets]
    format: str
    skipped: list[SkippedFile] = field(default_factory=list)
    category_ids: list[int] | None = None
    source_sizes: list[tuple[int, int]] | None = None

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> ImageTargets:
        return self.items[index]

    def source_size(self, index: int) -> tuple[int, int]:
        """Image ``index``'s upright source size (height, width)."""
        if self.source_sizes is not None:
            return self.source_sizes[index]
        return self.items[index].height, self.items[index].width

    def fingerprint(self) -> bytes:
        """A digest of every image's boxes, class ids and size: what a store built from
        the labels depends on (an edited label file changes it)."""
        digest = hashlib.sha256(self.format.encode())
        for t in self.items:
            digest.update(b"%d %d %d;" % (t.height, t.width, len(t.labels)))
            digest.update(t.boxes.numpy().tobytes())
            digest.update(t.labels.numpy().tobytes())
        return digest.digest()

    def subset(self, positions: list[int]) -> DetectionTargets:
        """The targets of the listed images ``positions`` (a split's side)."""
        return DetectionTargets([self.items[k] for k in positions], self.format, self.skipped,
                                self.category_ids,
                                None if self.source_sizes is None
                                else [self.source_sizes[k] for k in positions])


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
    """Whether a detection dataset's layout holds a validation split of its own (the
    generated one does): training then validates on it after each epoch."""
    if not dataset.targets.boxes or dataset.val_path is not None or dataset.val_fraction > 0:
        return False
    if dataset.path is None and dataset.manifest is None:
        return True  # the shapes dataset: images/val
    if dataset.path is None:
        return False
    return has_split(Path(dataset.path).expanduser(), dataset.targets.value, Split.val.value)


def list_detection(dataset: DatasetConfig, path: str | Path) -> Listing:
    """The images at ``path`` that the labels name, each with its boxes (``targets``)."""
    root = Path(path).expanduser()
    format = dataset.targets.value
    split = dataset.split.value if dataset.val_fraction == 0 and has_split(
        root, format, dataset.split.value) else None
    labels = read_labels(root, format, split)
    samples = [(image, 0) for image in labels.targets]
    targets = DetectionTargets(list(labels.targets.values()), labels.format, labels.skipped,
                               labels.category_ids)
    listing = Listing(labels.root, labels.classes, samples,
                      f"{labels.format} detection labels" + (f", {split} split" if split
                                                              else ""), [], targets)
    if dataset.val_fraction > 0:
        listing = split_listing(listing, dataset.val_fraction, dataset.split_seed,
                                dataset.split is Split.val)
    return listing
