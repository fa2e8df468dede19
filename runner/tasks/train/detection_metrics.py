"""A detector's validation figures: mAP (COCO's, over IoU 0.50:0.95) and mAP@0.5, by
torchmetrics' ``MeanAveragePrecision`` (pycocotools' COCOeval underneath, or
faster_coco_eval's with ``backend="faster_coco_eval"``).

``DetectionMAP`` is fed each validation batch's padded predictions and targets (the
layout of runner/model/detectors.py: ``boxes`` [B, K, 4] xyxy pixels, ``box_scores``,
``box_labels``, ``box_count``; the targets without scores) and computes once, at the
epoch's end, over every image it was given: COCO's mAP is not a mean of per-batch
figures. The padded rows are dropped before the metric sees them, as are target boxes of
no area (as in training: runner/model/detectors.py's ``as_targets``); an image without
boxes still counts (its detections are false positives). Under DDP torchmetrics gathers
every rank's images before computing, so each rank gets the figures of the whole split.

COCO's rules hold: the best 100 detections per image count (a model that returns more,
such as RetinaNet's and SSD's 300, is cut there without a warning each epoch), classes
are averaged over those present in the targets or the predictions, and a figure with
nothing to measure (no target box at all) is -1, which ``compute`` returns as NaN (written
as null in metrics.json).

Needs the ``detection`` extra: ``pip install -e '.[detection]'`` (torchmetrics and
pycocotools).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from runner.common.errors import Unavailable
from runner.model.detectors import as_targets

# what ``compute`` returns, of torchmetrics' dict (the rest are per-size and recall figures)
FIGURES = ("map", "map_50", "map_75", "mar_100")


def as_prediction_lists(predictions: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Padded predictions as torchmetrics takes them: per image ``boxes``, ``scores``,
    ``labels`` (one host sync for the counts; the dicts are torchmetrics' API)."""
    count = predictions["box_count"].to(predictions["boxes"].device)
    keep = torch.arange(predictions["boxes"].shape[1], device=count.device) < count[:, None]
    per_image = keep.sum(1).tolist()
    parts = [predictions["boxes"][keep].float().split(per_image),
             predictions["box_scores"][keep].float().split(per_image),
             predictions["box_labels"][keep].long().split(per_image)]
    return [{"boxes": b, "scores": s, "labels": lab} for b, s, lab in zip(*parts)]


class DetectionMAP:
    """mAP and mAP@0.5 over every image ``update`` was given (the module docstring)."""

    def __init__(self, backend: str = "pycocotools", class_metrics: bool = False):
        try:
            from torchmetrics.detection import MeanAveragePrecision
        except ImportError as e:
            raise Unavailable("a detector's mAP needs torchmetrics and pycocotools: "
                              "pip install -e '.[detection]'") from e
        self.metric = MeanAveragePrecision(box_format="xyxy", iou_type="bbox",
                                           class_metrics=class_metrics, backend=backend)
        self.metric.warn_on_many_detections = False
        self.images = 0

    def to(self, device: torch.device) -> DetectionMAP:
        self.metric = self.metric.to(device)
        return self

    def update(self, predictions: Mapping[str, torch.Tensor],
               targets: Mapping[str, torch.Tensor]) -> None:
        """One batch's padded predictions and targets (the same images, in order)."""
        preds = as_prediction_lists({k: v.detach() for k, v in predictions.items()
                                     if isinstance(v, torch.Tensor)})
        truth = as_targets(targets)
        if len(preds) != len(truth):
            raise ValueError(f"{len(preds)} images of predictions for {len(truth)} of targets")
        self.metric.update(preds, truth)
        self.images += len(preds)

    def compute(self) -> dict[str, float]:
        """``map``, ``map_50``, ``map_75``, ``mar_100`` over the images so far (NaN: nothing
        to measure); nothing fed yet is NaN for each."""
        import torch.distributed as dist

        if not self.images and not (dist.is_available() and dist.is_initialized()):
            return {k: math.nan for k in FIGURES}  # (under DDP every rank joins the gather)
        out = self.metric.compute()
        figures = {k: float(out[k]) for k in FIGURES}
        return {k: (math.nan if v == -1 else v) for k, v in figures.items()}

    def reset(self) -> None:
        self.metric.reset()
        self.images = 0
