"""A detector's predictions as a COCO results file: the JSON array pycocotools'
``COCO.loadRes`` and ``COCOeval`` read, one object per detection::

    [
    {"image_id": 42, "category_id": 3, "bbox": [12.5, 30.0, 40.25, 18.0], "score": 0.91234},
    ...
    ]

``bbox`` is COCO's x, y, width, height in pixels (the padded predictions of
runner/model/detectors.py are xyxy); ``image_id`` is each image's id (the COCO
annotations' own, or the dataset index where there are none); ``category_id`` maps the
model's class index to a category id (COCO's run 1..90 with gaps; none given: the class
index itself), decided before the pass by ``served_category_ids``: the ids its checkpoint
was trained with when the data's JSON gives each the same name, else each class's id by
its name there; a contradiction is refused in one line naming both lists. Boxes are rounded to ``box_decimals``, scores to
``score_decimals`` places, so the same predictions always give the same bytes; a row with
a non-finite box or score is left out (a file pycocotools can read beats a complete one it
cannot).

Written the way task=infer's other files are, to survive a resume byte-identically: each
step's rows go to a part file of their own (``write_part``: one object per line, no
brackets, whole or not at all), and ``join_parts`` writes the array from the parts in step
order when the run completes. ``write_results`` writes rows in one go. An empty array (no
detection at all) is valid JSON, but pycocotools' ``loadRes`` cannot take it (it reads the
first row): evaluate that case as a mAP of 0 without it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from runner.common.atomic import replacing
from runner.common.errors import ConfigError

log = logging.getLogger(__name__)


def result_rows(image_ids: Sequence[int] | np.ndarray | torch.Tensor,
                predictions: Mapping[str, torch.Tensor],
                category_ids: Sequence[int] | None = None, box_decimals: int = 2,
                score_decimals: int = 5) -> list[dict]:
    """One batch's padded predictions (``boxes`` [B, K, 4] xyxy, ``box_scores``,
    ``box_labels``, ``box_count``) as COCO result rows, image by image in batch order,
    each image's detections in their order (torchvision's: by score)."""
    boxes = predictions["boxes"].detach().float().cpu().numpy()
    scores = predictions["box_scores"].detach().float().cpu().numpy()
    labels = predictions["box_labels"].detach().cpu().numpy().astype(np.int64)
    count = predictions["box_count"].detach().cpu().numpy()
    ids = np.asarray(image_ids.cpu() if isinstance(image_ids, torch.Tensor) else image_ids,
                     dtype=np.int64)
    if ids.shape != count.shape:
        raise ValueError(f"{ids.shape[0] if ids.ndim else ids} image ids for "
                         f"{count.shape[0]} images of predictions")
    keep = np.arange(boxes.shape[1])[None, :] < count[:, None]
    keep &= np.isfinite(boxes).all(-1) & np.isfinite(scores) & (labels >= 0)
    image, _ = np.nonzero(keep)
    xyxy = boxes[keep].astype(np.float64)
    xywh = np.round(np.concatenate([xyxy[:, :2], xyxy[:, 2:] - xyxy[:, :2]], 1), box_decimals)
    label = labels[keep]
    if category_ids is not None:
        table = np.asarray(category_ids, dtype=np.int64)
        if label.size and label.max() >= len(table):
            raise ValueError(f"class {int(label.max())} has no category id: "
                             f"{len(table)} are given")
        label = table[label]
    score = np.round(scores[keep].astype(np.float64), score_decimals)
    return [{"image_id": i, "category_id": c, "bbox": b, "score": s}
            for i, c, b, s in zip(ids[image].tolist(), label.tolist(), xywh.tolist(),
                                  score.tolist())]


def rows_text(rows: Iterable[dict]) -> str:
    """The rows as the lines of the array, one object each, without brackets or a final
    comma and newline."""
    return ",\n".join(json.dumps(row, allow_nan=False) for row in rows)


def write_part(part: Path, rows: Iterable[dict]) -> None:
    """One step's rows into ``part``, whole (an empty part for a step of no detections)."""
    with replacing(Path(part)) as tmp:
        tmp.write_text(rows_text(rows), encoding="utf-8")


def join_parts(path: Path, parts: Iterable[Path]) -> None:
    """The results file at ``path``, whole: the rows of ``parts``, in their order, as one
    JSON array (a missing or empty part adds nothing)."""
    _write_array(path, (Path(p).read_text(encoding="utf-8") if Path(p).is_file() else ""
                        for p in parts))


def join_results(path: Path, files: Iterable[Path]) -> None:
    """Results files (whole arrays, as ``join_parts`` writes them: one per rank) as one
    array at ``path``, their rows in the files' order."""
    def rows(file: Path) -> str:
        text = Path(file).read_text(encoding="utf-8")
        if not (text.startswith("[") and text.endswith("]\n")):
            raise ValueError(f"{file} is not a results file as join_parts writes it")
        return text[1:-2].strip("\n")

    _write_array(path, (rows(f) for f in files))


def _write_array(path: Path, texts: Iterable[str]) -> None:
    """Rows texts (``rows_text``'s) as one JSON array, whole, at ``path``."""
    with replacing(Path(path)) as tmp, open(tmp, "w", encoding="utf-8") as out:
        out.write("[")
        first = True
        for text in texts:
            if not text:
                continue
            out.write("\n" if first else ",\n")
            out.write(text)
            first = False
        out.write("\n]\n")


def write_results(path: Path, rows: Iterable[dict]) -> None:
    """Rows as a results file in one go."""
    with replacing(Path(path)) as tmp:
        text = rows_text(rows)
        tmp.write_text("[" + (f"\n{text}" if text else "") + "\n]\n", encoding="utf-8")


class ServedFrame:
    """Where a detection dataset's served boxes live: the frame a ground truth of the
    user's own uses, so ``COCOeval`` compares ``detections.json`` with their
    ``instances_*.json`` as they are.

    - ``image_id``: each image's COCO id (its annotations'; for YOLO, its place in the set);
    - ``category_ids``: COCO's category id of each class (1..90 with gaps for COCO; None
      for YOLO: the class index);
    - ``source_windows``: the window of its upright source image (top, left, height,
      width) each output image shows under ``dataset.crop`` (whole, letterbox or centre, at
      ``dataset.image_size``; boxgeometry's ``shown_window``), so boxes go back into the
      source's pixels (``to_source``), clipped to the image (``source_sizes``: a
      letterbox's pads lie outside it). Under random crops there is no one window: boxes
      stay in the model's input pixels (said once). An image whose labels gave no size (a
      YOLO image with no boxes), or any image of a folder without labels, has its size
      read from its file's header; in a bucket (``dataset.path`` a URL) such a folder's
      boxes stay in input pixels (said once).
    - ``input_sizes``: under ``loader.group_aspect`` each image's output size, its aspect
      bin's (``shapes``), which its window is taken at; else every image's is
      ``dataset.image_size``.

    Args:
        targets: the storage's targets (``DetectionTargets``, a store's): their
            ``image_id``, ``source_size`` and ``category_ids``; None: a folder without
            labels (ids are dataset indices, categories class indices).
        dataset: the run's dataset config (crop, crop_fraction, image_size).
        source: dataset index -> the image's source file (for a size the labels lack).
        shapes: each dataset index's output (height, width) [N, 2] where it differs by
            image (the storage's ``item_shapes``: ``loader.group_aspect``), else None.
    """

    def __init__(self, targets, dataset, source, shapes=None):
        from runner.config.schema import Crop

        self.targets, self.source, self.shapes = targets, source, shapes
        self.size = tuple(int(v) for v in dataset.image_size)
        self.crop, self.fraction = dataset.crop, float(dataset.crop_fraction)
        self.mapped = self.crop is not Crop.random
        if not self.mapped:
            log.warning("dataset.crop=random: served detections stay in the model's input "
                        "pixels (a random crop has no one window to undo)")
        elif targets is None and "://" in str(dataset.path or ""):
            self.mapped = False
            log.warning("dataset.path=%s has no labels to size its images by: served "
                        "detections stay in the model's input pixels", dataset.path)

    def image_id(self, index: int) -> int:
        return int(self.targets.image_id(index)) if self.targets is not None else index

    def _size(self, index: int) -> tuple[int, int]:
        h, w = self.targets.source_size(index) if self.targets is not None else (0, 0)
        if h and w:
            return h, w
        from runner.data.sources.labels import upright_size

        return upright_size(self.source(index))

    def source_windows(self, index: np.ndarray) -> np.ndarray:
        """The windows [B, 4] (top, left, height, width) of images ``index``."""
        from runner.data.decode.boxgeometry import shown_window

        return np.array([list(vars(shown_window(self._size(int(i)), self._shape(int(i)),
                                                self.crop, self.fraction)).values())
                         for i in index], dtype=np.float64).reshape(-1, 4)

    def _shape(self, index: int) -> tuple[int, int]:
        """The output size of image ``index``: its bin's, or ``dataset.image_size``."""
        return self.size if self.shapes is None else tuple(self.shapes[index].tolist())

    def input_sizes(self, index: np.ndarray) -> np.ndarray:
        """The output sizes [B, 2] (height, width) of images ``index``."""
        return np.array([self._shape(int(i)) for i in index], dtype=np.float64).reshape(-1, 2)

    def source_sizes(self, index: np.ndarray) -> np.ndarray:
        """The upright source sizes [B, 2] (height, width) of images ``index``."""
        return np.array([self._size(int(i)) for i in index], dtype=np.float64).reshape(-1, 2)

    def context(self, category_ids: list[int] | None = None) -> dict:
        """The ``WriterContext`` fields it fills (``category_ids``: a model's, from
        ``served_category_ids``; unset: the dataset's)."""
        return {"image_id": self.image_id,
                "source_windows": self.source_windows if self.mapped else None,
                "source_sizes": self.source_sizes if self.mapped else None,
                "input_size": self.size if self.mapped else None,
                "input_sizes": self.input_sizes if self.mapped and self.shapes is not None
                else None,
                "category_ids": category_ids if category_ids is not None
                else getattr(self.targets, "category_ids", None)}


def _categories(ids: Sequence[int], names: Sequence[str]) -> str:
    """Categories as a short list in words: ``[1 person, 7 car, ...]``."""
    shown = [f"{i} {n}" for i, n in zip(ids, names)]
    more = f", ... ({len(shown)} in all)" if len(shown) > 12 else ""
    return "[" + ", ".join(shown[:12]) + more + "]"


def served_category_ids(model: str, names: Sequence[str], count: int,
                        trained_ids: Sequence[int] | None, data_names: Sequence[str],
                        data_ids: Sequence[int] | None, labelled: bool,
                        where: str = "the dataset") -> list[int] | None:
    """The category id each of a detector's ``count`` classes is served under, decided
    before the pass; a contradiction is a ConfigError naming both lists.

    - the data has COCO ids (``data_ids``, with ``data_names``): the checkpoint's own ids
      (``trained_ids``) when every one names the same class in the data as in the model
      (``names``); without them, each model class's id by its name in the data (each
      name once there); a model whose names are unknown takes the data's ids by position
      when the counts agree;
    - the data has none (YOLO: the class index is the id): the class index when the
      model's names are the data's in order (or unknown), each model class's index in
      the data by name when they are the same names in another order (a model trained on
      ``[car, person]`` served on a folder whose classes.txt says ``person, car``: served
      as is, every detection would carry the other class's index); refused naming both
      lists when a name is not there; on images without labels (``labelled`` false), the
      checkpoint's own ids when it has them.

    Args:
        model: the model's name, for the message.
        names: the model's class names (empty when unknown).
        count: the model's class count.
        trained_ids: the category ids its checkpoint was trained with, or None.
        data_names, data_ids: the dataset's classes and their COCO ids (None: none).
        labelled: whether the images have labels at all.
        where: the labels' source, for the message (the JSON's path).
    """
    named = len(names) == count
    trained = list(trained_ids) if trained_ids is not None and len(trained_ids) == count \
        else None
    if data_ids is None:
        if not labelled:
            return trained
        if not named or not data_names or list(names) == list(data_names):
            return None
        index = {n: i for i, n in enumerate(data_names)}
        missing = [n for n in names if n not in index]
        if missing or len(set(names)) != len(names):
            bad = missing[0] if missing else next(n for n in names if list(names).count(n) > 1)
            raise ConfigError(
                f"model {model}'s classes {list(names)[:12]} are not the classes of {where} "
                f"{list(data_names)[:12]}: {bad!r} is "
                f"{'not there' if missing else 'the model’s more than once'}, so its "
                "detections cannot carry that folder's class indices. Serve it on labels "
                "with its classes, or on images without labels")
        table = [index[n] for n in names]
        return None if table == list(range(count)) else table
    data = dict(zip(data_ids, data_names))
    theirs = _categories(data_ids, data_names)
    if trained is not None and named:
        wrong = [(i, n) for i, n in zip(trained, names) if data.get(i) != n]
        if not wrong:
            return trained
        i, n = wrong[0]
        raise ConfigError(
            f"model {model} was trained on categories {_categories(trained, names)}; the "
            f"categories of {where} are {theirs}: id {i} is {n!r} to the model and "
            f"{repr(data[i]) if i in data else 'missing'} there ({len(wrong)} of "
            f"{count} disagree). Serve it on labels with its categories, or on images without "
            "labels (its own ids are used)")
    if named:
        by_name: dict[str, list[int]] = {}
        for i, n in data.items():
            by_name.setdefault(n, []).append(i)
        ids = [by_name.get(n, []) for n in names]
        if all(len(found) == 1 for found in ids):
            return [found[0] for found in ids]
        bad = next(n for n, found in zip(names, ids) if len(found) != 1)
        raise ConfigError(
            f"model {model}'s classes {list(names)[:12]} are not each one category of "
            f"{where}, whose categories are {theirs}: {bad!r} is "
            f"{'not there' if not by_name.get(bad) else 'there more than once'}. Serve it on "
            "labels with its categories, or name its classes as they are there "
            "(model.classes=[...])")
    if count == len(data_ids):
        return list(data_ids)
    raise ConfigError(
        f"model {model} has {count} classes and no names (a plain state_dict); {where} "
        f"has {len(data_ids)} categories {theirs}: give model.classes=[...] (its class "
        "names in order) so each is served under its category's id")
