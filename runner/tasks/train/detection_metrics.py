"""A detector's validation figures: mAP (COCO's, over IoU 0.50:0.95) and mAP@0.5, by
torchmetrics' ``MeanAveragePrecision`` (pycocotools' COCOeval underneath, or
faster_coco_eval's with ``backend="faster_coco_eval"``).

``DetectionMAP`` is fed each validation batch's padded predictions and targets (the
layout of runner/model/detectors.py: ``boxes`` [B, K, 4] xyxy pixels, ``box_scores``,
``box_labels``, ``box_count``; the targets without scores) and computes once, at the
epoch's end, over every image it was given: COCO's mAP is not a mean of per-batch
figures. The padded rows are dropped before the metric sees them, as are target boxes of
no area (as in training: runner/model/detectors.py's ``as_targets``); an image without
boxes still counts (its detections are false positives).

Under torch.distributed each rank holds its own images; ``compute`` gathers them whole,
once (``all_gather_object`` of each rank's per-image predictions and targets, on the CPU),
puts them in the dataset's order (the images' ``index``, when ``update`` was given it) and
computes the figures of the whole split on every rank: the same figures, to the bit, as one
process given every image. torchmetrics' own sync is off (``sync_on_compute=False``): it
gathers a list state one tensor per image, one collective each, so two ranks holding
different numbers of images (a split that does not divide by the world, its padding rows
dropped) called different numbers of collectives, and gloo aborted ("Received data size
doesn't match expected size") or the ranks hung.

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
        # the ranks' images are gathered whole in ``compute`` (the module docstring says why
        # not torchmetrics' own sync); given here: Metric reads it once, in its __init__
        self.metric = MeanAveragePrecision(box_format="xyxy", iou_type="bbox",
                                           class_metrics=class_metrics, backend=backend,
                                           sync_on_compute=False)
        self.metric.warn_on_many_detections = False
        # per image, in the order given: its predictions, its targets, its index (or None)
        self.preds: list[dict[str, torch.Tensor]] = []
        self.truth: list[dict[str, torch.Tensor]] = []
        self.order: list[int | None] = []
        self.counted = 0  # the images the last ``compute`` scored, every rank's

    @property
    def images(self) -> int:
        """The images given to this process so far."""
        return len(self.preds)

    def to(self, device: torch.device) -> DetectionMAP:
        self.metric = self.metric.to(device)
        return self

    def update(self, predictions: Mapping[str, torch.Tensor],
               targets: Mapping[str, torch.Tensor], index: torch.Tensor | None = None) -> None:
        """One batch's padded predictions and targets (the same images, in order), and
        the images' dataset indices (``index``: their order when ranks are gathered)."""
        preds = as_prediction_lists({k: v.detach() for k, v in predictions.items()
                                     if isinstance(v, torch.Tensor)})
        truth = as_targets(targets)
        if len(preds) != len(truth):
            raise ValueError(f"{len(preds)} images of predictions for {len(truth)} of targets")
        order = index.tolist() if index is not None else [None] * len(preds)
        if len(order) != len(preds):
            raise ValueError(f"{len(order)} indices for {len(preds)} images")
        self.preds += preds
        self.truth += truth
        self.order += order

    def _gathered(self) -> tuple[list[dict], list[dict]]:
        """Every rank's images (this process's alone without a group), in the dataset's
        order where every image has an index, else rank after rank."""
        import torch.distributed as dist

        every = list(zip(self.order, self.preds, self.truth))
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            mine = [(i, {k: v.cpu() for k, v in p.items()}, {k: v.cpu() for k, v in t.items()})
                    for i, p, t in every]
            out: list = [None] * dist.get_world_size()
            dist.all_gather_object(out, mine)  # every rank joins, with images or none
            device = self.metric.device
            every = [(i, {k: v.to(device) for k, v in p.items()},
                      {k: v.to(device) for k, v in t.items()})
                     for rank in out for i, p, t in rank]
        if all(i is not None for i, _, _ in every):  # the dataset's order, whoever held them
            every.sort(key=lambda image: image[0])
        return [p for _, p, _ in every], [t for _, _, t in every]

    def compute(self) -> dict[str, float]:
        """``map``, ``map_50``, ``map_75``, ``mar_100`` over the images so far, every
        rank's under torch.distributed (NaN: nothing to measure; nothing fed is NaN)."""
        preds, truth = self._gathered()
        self.counted = len(preds)
        if not preds:
            return {k: math.nan for k in FIGURES}
        self.metric.reset()
        self.metric.update(preds, truth)
        out = self.metric.compute()
        self.metric.reset()  # its copies of the images: kept once, in the lists
        figures = {k: float(out[k]) for k in FIGURES}
        return {k: (math.nan if v == -1 else v) for k, v in figures.items()}

    def reset(self) -> None:
        self.metric.reset()
        self.preds, self.truth, self.order = [], [], []
