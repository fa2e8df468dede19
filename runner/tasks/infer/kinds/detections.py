"""``task.outputs=[detections]``: a detector's boxes, as a COCO results file and as one CSV
row per image.

What is read: the detector's padded predictions (runner/model/detectors.py's ``Detector``
in eval mode: ``boxes`` [B, K, 4] xyxy, ``box_scores`` [B, K], ``box_labels`` [B, K],
``box_count`` [B], K the model's most detections per image). ``reduce`` keeps them as
float32 boxes and scores, int64 labels and counts, the rows past each image's count set to
0 (labels -1), so padding never depends on what the model left there; on the device, or on
the host's copy with ``task.reduce_on=host`` (the same ops). Only detectors give this
output, and a detector gives no other (``OutputKind.detector``; refused at the start,
runner/tasks/infer/outputs.py's ``check_models``).

Files (``detections_<model>.*`` with several models, ``.rank<r>`` under torch.distributed
until the ranks' files are merged):

- ``detections.json``: COCO's results format (runner/tasks/infer/coco_results.py), the
  JSON array pycocotools' ``COCO.loadRes`` and ``COCOeval`` read, one object per detection
  in dataset order, each image's by score: ``{"image_id", "category_id", "bbox": [x, y,
  w, h], "score"}``; boxes rounded to 2 decimals, scores to 5; a detection with a
  non-finite box or score is left out there. ``image_id`` is the image's id in the
  dataset's labels (COCO's annotations' ids; for YOLO, its place in the label set) and
  ``category_id`` its class's (COCO's category ids, 1..90 with gaps for COCO itself; for
  YOLO, the class index), both from ``coco_results.ServedFrame``; the names are in
  ``detections.categories.json``, COCO's ``categories`` list (``[{"id": 1, "name":
  "person"}, ...]``). So ``COCOeval`` takes the user's own ``instances_val.json`` as the
  ground truth and this file as the results, as they are.
- ``detections.csv``: one row per image (as ``predictions.csv`` is for top-k), lists
  space-separated, in the detections' order (by score)::

      index,file,count,classes,names,scores,boxes
      0,a.jpg,2,1 0,dog cat,0.91234 0.40000,"12.50,30.00,52.75,48.00 0.00,1.00,20.00,9.50"

  ``index`` the dataset index, ``file`` the image's name, ``count`` its detections,
  ``classes`` the dataset's class indices, ``names`` their names (the model's class names
  as for top-k, else the index; a name's own white space written as ``_``, so that the
  column splits into one name per detection: COCO's ``traffic light`` is
  ``traffic_light`` here, and as it is in ``detections.categories.json``), ``scores`` with
  5 decimals, ``boxes`` one
  ``x1,y1,x2,y2`` per detection with 2 decimals (the csv module quotes the field: it holds
  commas; read it with a CSV reader). ``grep dog detections.csv`` lists the images where a
  dog was found.

Boxes, in both files, are in pixels of the upright source image (the ground truth's
frame): the model's boxes, in pixels of the image it was given (``dataset.image_size``,
after its resize and crop), are mapped back through the window of the source that image
shows (boxgeometry's ``shown_window`` and ``to_source``: the whole image, the letterbox's
(the image and its pads), or the centre crop's window), on the writer threads. Under ``dataset.crop=random`` there is no one
window: the boxes stay in input pixels, said once.

Resumable as the top-k CSV is: each step's rows go to a part file of their own under
``.detections.parts`` (``<step>.csv`` and ``<step>.json``), rewritten whole when a resumed
run does that step again; when the run completes, the parts are joined in step order, so a
run stopped and resumed writes the bytes of a straight one.
"""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runner.common.atomic import replacing
from runner.common.text import printable
from runner.config.schema import Output, TaskConfig
from runner.data.decode.boxgeometry import to_source
from runner.tasks.infer.coco_results import join_parts, result_rows, write_part
from runner.tasks.infer.kinds.kind import DETECTIONS, OutputKind, WriterContext
from runner.tasks.infer.predictions import join_csv

HEADER = "index,file,count,classes,names,scores,boxes\n"
KEYS = ("boxes", "box_scores", "box_labels", "box_count")
BOX_DECIMALS, SCORE_DECIMALS = 2, 5


def reduce(predictions: dict[str, torch.Tensor], task: TaskConfig) -> dict[str, torch.Tensor]:
    """The padded predictions as they are written: float32 boxes and scores, int64 labels
    and counts, the padding rows 0 (labels -1). Whole-batch ops: no sync with the device."""
    count = predictions["box_count"].long()
    scores = predictions["box_scores"].float()
    within = torch.arange(scores.shape[1], device=scores.device)[None, :] < count[:, None]
    return {
        "boxes": torch.where(within[..., None], predictions["boxes"].float(), 0.0),
        "box_scores": torch.where(within, scores, 0.0),
        "box_labels": torch.where(within, predictions["box_labels"].long(), -1),
        "box_count": count,
    }


def file_stem(csv_name: str) -> str:
    """The files' stem from the top-k CSV's name: ``predictions_a.rank1.csv`` ->
    ``detections_a.rank1``."""
    return "detections" + Path(csv_name).stem.removeprefix("predictions")


def csv_rows(f: Any, index: list[int], kept: dict[str, np.ndarray], name_of, class_name
             ) -> None:
    """One batch's rows (HEADER's columns) into the open text file ``f``; rows end in
    ``\\n``, a field with a comma, quote or newline is quoted (the csv module's rule)."""
    buf = io.StringIO()
    rows = csv.writer(buf)  # its "\r\n" terminator: fields with \r or \n are quoted
    counts = kept["box_count"].tolist()
    for row, (i, n) in enumerate(zip(index, counts)):
        labels = kept["box_labels"][row, :n].tolist()
        scores = kept["box_scores"][row, :n].tolist()
        boxes = kept["boxes"][row, :n].tolist()
        buf.seek(0)
        buf.truncate()
        rows.writerow([i, printable(name_of(i)), n, " ".join(map(str, labels)),
                       " ".join(class_name(c) for c in labels),
                       " ".join(f"{s:.{SCORE_DECIMALS}f}" for s in scores),
                       " ".join(",".join(f"{v:.{BOX_DECIMALS}f}" for v in b) for b in boxes)])
        f.write(buf.getvalue()[:-2] + "\n")


class DetectionsWriter:
    """``detections.json`` and ``detections.csv``: a part of each per step under
    ``.detections.parts``, joined in step order when the run completes, and
    ``detections.categories.json`` beside them."""

    def __init__(self, ctx: WriterContext, shapes: dict[str, tuple[tuple[int, ...], Any]]):
        self.ctx = ctx
        self.arrays: dict[str, np.memmap] = {}
        run_dir, stem = Path(ctx.run_dir), file_stem(ctx.csv_name)
        self.csv, self.json = run_dir / f"{stem}.csv", run_dir / f"{stem}.json"
        # one file for every rank: they all write the same bytes
        self.categories = run_dir / f"{re.sub(r'[.]rank[0-9]+$', '', stem)}.categories.json"
        self.parts = run_dir / f".{stem}.parts"
        self.parts.mkdir(parents=True, exist_ok=True)
        # the class names by dataset class index: the model's, else the dataset's
        self.names = list(ctx.classes or ctx.dataset_classes)
        self.words = ["_".join(printable(n).split()) or "_" for n in self.names]

    def _name(self, k: int) -> str:
        """Class ``k``'s name as one word of the CSV's ``names`` column."""
        return self.words[k] if 0 <= k < len(self.words) else str(k)

    def write(self, step: int, index: np.ndarray, label: np.ndarray,
              kept: dict[str, np.ndarray]) -> None:
        ids = index.tolist()
        if self.ctx.source_windows is not None:  # the boxes in their source's pixels
            windows = torch.from_numpy(self.ctx.source_windows(index))
            size = self.ctx.input_size if self.ctx.input_sizes is None \
                else torch.from_numpy(self.ctx.input_sizes(index))  # each bin's shape
            boxes = to_source(torch.from_numpy(kept["boxes"]), windows, size)
            if self.ctx.source_sizes is not None:  # a box reaching into a letterbox's pads
                hw = torch.from_numpy(self.ctx.source_sizes(index)).to(boxes.dtype)
                limit = torch.stack([hw[:, 1], hw[:, 0]] * 2, -1)[:, None, :]
                boxes = torch.minimum(boxes.clamp(min=0), limit)
            kept = {**kept, "boxes": boxes.numpy()}
            kept["boxes"][np.arange(kept["boxes"].shape[1])[None, :]
                          >= kept["box_count"][:, None]] = 0.0  # padding stays 0
        with replacing(self.parts / f"{step:08d}.csv") as tmp, \
                open(tmp, "w", newline="", encoding="utf-8") as f:
            csv_rows(f, ids, kept, self.ctx.names, self._name)
        if self.ctx.image_id is not None:
            ids = [int(self.ctx.image_id(i)) for i in ids]
        predictions = {k: torch.from_numpy(np.ascontiguousarray(kept[k])) for k in KEYS}
        write_part(self.parts / f"{step:08d}.json",
                   result_rows(ids, predictions, self.ctx.category_ids,
                               box_decimals=BOX_DECIMALS, score_decimals=SCORE_DECIMALS))

    def flush(self) -> None:
        pass

    def finish(self, steps: int) -> None:
        """The run is complete: every step's parts joined, in order (the parts stay until
        the run's state says it is done), and the class names written."""
        csv_parts = [self.parts / f"{k:08d}.csv" for k in range(steps)]
        join_csv(self.csv, [p for p in csv_parts if p.exists()], header=HEADER)
        join_parts(self.json, [self.parts / f"{k:08d}.json" for k in range(steps)])
        ids = self.ctx.category_ids or range(len(self.names))
        rows = [json.dumps({"id": int(c), "name": printable(n)})
                for c, n in zip(ids, self.names)]
        with replacing(self.categories) as tmp:
            tmp.write_text("[" + ("\n" + ",\n".join(rows) if rows else "") + "\n]\n",
                           encoding="utf-8")

    def files(self, complete: bool) -> list[str]:
        return [str(self.json), str(self.csv), str(self.categories)]


KIND = OutputKind(Output.detections, KEYS, reduce, DetectionsWriter, needs=DETECTIONS,
                  dense=False, detector=True, parts=(".detections*.parts",),
                  files="detections.json (COCO results) and detections.csv: each image's "
                        "boxes, classes and scores, in the source images' pixels")
