"""``task=train``'s validation figures, one scorer per model family (``SCORERS``, each naming
its ``ModelFamily`` as the families' records in runner/model/families.py do): what a
family's eval forward gives is what is scored, against the kind of target it learns.

A scorer is made once per validation pass (``scorer_for(family)(device, ranks, classes)``),
fed
each batch the model was given (``update(model, batch)``: it runs the model's eval forward
itself, since what it reads differs by kind) and asked for the figures once at the end
(``compute``): the names its target kind's record lists (``TargetKind.figures``), as
``val_<figure>``. Under torch.distributed each gives the figures of the whole split: the
classes' sums are all-reduced, the boxes' images gathered whole (detection_metrics.py),
torchmetrics sums the masks' confusion matrices.

- a classifier: loss, top-1 and top-5 (``ClassScores``);
- a detector: mAP (COCO's, IoU 0.50:0.95) and mAP@0.5 (``BoxScores``, detection_metrics.py);
- a segmenter: mean IoU and pixel accuracy (``MaskScores``, segmentation_metrics.py:
  torchmetrics' ``MulticlassJaccardIndex``, 255 ignored, a class absent from both the
  predictions and the targets left out of the mean).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from runner.config.schema import ModelFamily
from runner.launch.distributed import Ranks
from runner.model.networks import main_output


class Scorer(Protocol):
    def update(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> None: ...

    def compute(self) -> dict[str, float]: ...


def _valid(batch: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The rows that are images (a distributed shard's padding rows are not), or None."""
    return batch["valid"].bool() if "valid" in batch.keys() else None


class ClassScores:
    """Loss, top-1 and top-5 as sums on the device (one tensor, one all-reduce)."""

    family = ModelFamily.classifier

    def __init__(self, device: torch.device, ranks: Ranks, classes: int = 0):
        # correct top-1, correct top-5, loss and images, then the images whose top-1 is each
        # class (validation.py's not_learning): one tensor, one all-reduce
        self.sums = torch.zeros(4 + classes, dtype=torch.float64, device=device)
        self.ranks, self.classes = ranks, classes
        self.predicted: list[int] = []

    def update(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> None:
        logits = main_output(model(batch["image"])).float()
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices
        hit = top == batch["label"][:, None]
        loss = F.cross_entropy(logits, batch["label"], reduction="none")
        valid = _valid(batch)
        valid = valid.double() if valid is not None \
            else torch.ones(len(loss), dtype=torch.float64, device=loss.device)
        self.sums[:4] += torch.stack([(hit[:, 0] * valid).sum(), (hit.any(dim=1) * valid).sum(),
                                      (loss.double() * valid).sum(), valid.sum()])
        if self.classes == logits.shape[1]:
            self.sums[4:].index_add_(0, top[:, 0], valid)

    def compute(self) -> dict[str, float]:
        if self.ranks.enabled:  # every rank's share, each image once
            dist.all_reduce(self.sums)
        correct1, correct5, loss, total, *predicted = self.sums.tolist()
        self.predicted = [int(c) for c in predicted]
        n = max(total, 1)
        return {"top1": correct1 / n, "top5": correct5 / n, "loss": loss / n}


class BoxScores:
    """A detector's padded predictions in eval mode against each batch's boxes
    (detection_metrics.py's ``DetectionMAP``), the padding rows left out."""

    family = ModelFamily.detector

    def __init__(self, device: torch.device, ranks: Ranks, classes: int = 0):
        from runner.tasks.train.detection_metrics import DetectionMAP

        self.metric = DetectionMAP().to(device)

    def update(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> None:
        predictions = model(batch["image"])
        targets = {k: batch[k] for k in ("boxes", "box_labels", "box_count")}
        index = batch["index"] if "index" in batch.keys() else None
        keep = _valid(batch)
        if keep is not None:  # a shard's padding rows: not images
            predictions = {k: v[keep] for k, v in predictions.items()}
            targets = {k: v[keep] for k, v in targets.items()}
            index = index[keep] if index is not None else None
        # the indices put every rank's images in the dataset's order when they are gathered
        self.metric.update(predictions, targets, index)

    def compute(self) -> dict[str, float]:
        figures = self.metric.compute()
        return {k: figures[k] for k in ("map", "map_50")}


class MaskScores:
    """A segmenter's per-pixel predictions against each batch's ``mask`` (its logits
    resized to the mask's size when they differ), one confusion matrix for the pass
    (segmentation_metrics.py's ``SegmentationIoU``: 255 and padding rows ignored)."""

    family = ModelFamily.segmenter

    def __init__(self, device: torch.device, ranks: Ranks, classes: int):
        from runner.tasks.train.segmentation_metrics import IGNORE_INDEX, SegmentationIoU

        self.ignore = IGNORE_INDEX
        self.metric = SegmentationIoU(max(int(classes), 1)).to(device)

    def update(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> None:
        logits = main_output(model(batch["image"])).float()
        target = batch["mask"].long()
        if logits.shape[-2:] != target.shape[-2:]:
            logits = F.interpolate(logits, size=target.shape[-2:], mode="bilinear",
                                   align_corners=False)
        keep = _valid(batch)
        if keep is not None:
            target = torch.where(keep[:, None, None], target, torch.full_like(target, self.ignore))
        self.metric.update(logits, target)

    def compute(self) -> dict[str, float]:
        figures = self.metric.compute()
        return {k: figures[k] for k in ("miou", "pixel_accuracy")}


# the tasks-side half of each family's record (runner/model/families.py's ``FAMILIES`` holds
# the rest, the one registry of ModelFamily; these metrics import the tasks' own modules,
# which the model layer may not): each scorer names its family, as a task class names its
# task; tests/tasks/test_targets.py checks every family has exactly one
SCORERS = (ClassScores, BoxScores, MaskScores)


def scorer_for(family: ModelFamily) -> Callable[[torch.device, Ranks, int], Scorer]:
    """The scorer of ``family`` (made per validation pass: ``(device, ranks, classes)``)."""
    return next(s for s in SCORERS if s.family is family)
