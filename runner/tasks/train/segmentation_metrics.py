"""A segmenter's validation figures: mean IoU and each class's IoU, by torchmetrics'
``MulticlassJaccardIndex`` (``ignore_index=255``), and the pixel accuracy.

``SegmentationIoU`` is fed each validation batch's predictions (logits [B, K, H, W], as
torchvision's segmentation models give under ``"out"``, or class ids [B, H, W]) and
target masks ([B, H, W] class ids, 255 = ignore, at the same size) and computes once, at
the epoch's end, from one confusion matrix summed over every pixel it was given: IoU is
not a mean of per-batch figures (torchvision's segmentation reference sums its
``ConfusionMatrix`` the same way). A class's IoU is TP / (TP + FP + FN) over the epoch;
a class absent from both the targets and the predictions has no IoU (NaN, null in
metrics.json) and is left out of the mean, so a validation split that lacks a class is
not marked down for it. Pixels whose target is 255 count nowhere. Under DDP torchmetrics
sums every rank's matrix before computing, so each rank gets the whole split's figures.

Targets are taken as they come (``validate_args=False``: the per-batch check of every
value is a host sync): the masks' loader has already made any id past the classes 255
(runner/data/sources/masklabels.py: ``load_mask``).
"""

from __future__ import annotations

import math

import torch

from runner.common.errors import Unavailable

IGNORE_INDEX = 255
FIGURES = ("miou", "pixel_accuracy")


class SegmentationIoU:
    """mIoU, per-class IoU and pixel accuracy over every pixel ``update`` was given."""

    def __init__(self, num_classes: int, ignore_index: int = IGNORE_INDEX):
        try:
            from torchmetrics.classification import MulticlassJaccardIndex
        except ImportError as e:
            raise Unavailable("a segmenter's mean IoU needs torchmetrics: "
                              "pip install torchmetrics") from e
        self.num_classes = num_classes
        self.metric = MulticlassJaccardIndex(num_classes, average="none",
                                             ignore_index=ignore_index, validate_args=False,
                                             zero_division=math.nan)
        self.images = 0

    def to(self, device: torch.device) -> SegmentationIoU:
        self.metric = self.metric.to(device)
        return self

    def update(self, predictions: torch.Tensor, targets: torch.Tensor) -> None:
        """One batch: logits [B, K, H, W] (or class ids [B, H, W]) and masks [B, H, W]."""
        preds = predictions.detach()
        if preds.ndim == 4:
            if preds.shape[1] != self.num_classes:
                raise ValueError(f"logits of {preds.shape[1]} classes for a metric of "
                                 f"{self.num_classes}")
            preds = preds.argmax(1)
        if preds.shape != targets.shape:
            raise ValueError(f"predictions {tuple(preds.shape)} and targets "
                             f"{tuple(targets.shape)} are not the same pixels")
        self.metric.update(preds.long(), targets.long())
        self.images += len(preds)

    def compute(self) -> dict[str, float | list[float]]:
        """``miou`` (the mean over the classes with an IoU), ``iou`` (each class's, NaN
        where absent), ``pixel_accuracy`` (of the pixels not ignored); NaN when nothing was
        fed."""
        import torch.distributed as dist

        if not self.images and not (dist.is_available() and dist.is_initialized()):
            return {"miou": math.nan, "iou": [math.nan] * self.num_classes,
                    "pixel_accuracy": math.nan}
        iou = self.metric.compute().double()
        with self.metric.sync_context():  # the summed matrix, as compute() saw it
            confmat = self.metric.confmat.double()
        total = float(confmat.sum())
        present = ~torch.isnan(iou)
        return {"miou": float(iou[present].mean()) if present.any() else math.nan,
                "iou": iou.tolist(),
                "pixel_accuracy": float(confmat.diagonal().sum()) / total if total
                else math.nan}

    def reset(self) -> None:
        self.metric.reset()
        self.images = 0
