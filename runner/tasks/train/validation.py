"""``task=train``'s validation: loss, top-1 and top-5 over ``dataset.val_path`` (or the images
``dataset.val_fraction`` holds out) after each epoch, through a data path of its own; for a
detector (runner/model/detectors.py) mAP and mAP@0.5 instead (``Validation.detection``),
recorded as ``val_map`` and ``val_map_50``.

Under torch.distributed each rank scores its own share of the images (padded to the same
number of batches on every rank, the padding rows masked out) and the sums are all-reduced:
every image counts exactly once, and no rank waits on another that ran out of batches.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from runner.common.errors import ConfigError
from runner.config.schema import (
    AmpConfig,
    AugmentConfig,
    Config,
    Crop,
    PageCache,
    PrefetchConfig,
    PrefetchName,
    Split,
    StorageName,
)
from runner.data import DataPath, build_data_path
from runner.launch.distributed import Ranks, local_module
from runner.model.amp import autocast
from runner.model.detectors import Detector
from runner.tasks.train.detection_metrics import DetectionMAP

DETECTION_FIGURES = ("map", "map_50")  # what a detector's validation records (val_map, ...)


def validation_config(config: Config) -> Config:
    """The data path of ``dataset.val_path`` (or of the images ``dataset.val_fraction``
    holds out): decoded with the run's decoder, center crops (a detector's: its letterbox, or whole images),
    in order, every image once, from a warm page cache."""
    if config.dataset.val_path is not None:
        dataset = dataclasses.replace(config.dataset, path=config.dataset.val_path,
                                      manifest=None, val_fraction=0.0)
    else:  # the held-out side of dataset.val_fraction's split of the training images
        dataset = dataclasses.replace(config.dataset, split=Split.val)
    # a detector sees whole images as it trained on them (whole or letterbox; a centre or
    # random crop would cut boxes at the sides away: the letterbox, its default)
    crop = Crop.center
    if config.dataset.targets.boxes:
        crop = config.dataset.crop if config.dataset.crop is Crop.whole else Crop.letterbox
    dataset = dataclasses.replace(dataset, crop=crop, page_cache=PageCache.warm)
    task = dataclasses.replace(config.task, augment=AugmentConfig())  # images as they are
    loader = dataclasses.replace(config.loader, name=StorageName.folder, shuffle=False,
                                 drop_last=False)
    return dataclasses.replace(config, dataset=dataset, loader=loader, task=task,
                               prefetch=PrefetchConfig(PrefetchName.none))


# a classifier's final validation is "at chance" up to this factor of 1/classes (a few
# held-out images measure accuracy coarsely), and "one class for everything" from this share
AT_CHANCE = 1.25
ONE_CLASS = 0.9


def not_learning(top1: float, predicted: list[int], classes: list[str]) -> str | None:
    """A warning, naming what to try, when the final validation says the classifier has not
    learned: its top-1 at chance (at most ``AT_CHANCE`` / classes) or its predictions collapsed
    onto one class (``ONE_CLASS`` of the images or more); None when it learned something.

    ``predicted``: how many validation images the top-1 named each class (empty: unknown)."""
    k = len(classes)
    total = sum(predicted)
    if k < 2:
        return None
    share, top = (max(predicted) / total, predicted.index(max(predicted))) if total else (0, 0)
    collapsed = total > 0 and share >= ONE_CLASS
    if top1 > AT_CHANCE / k and not collapsed:
        return None
    what = (f"it predicts {classes[top]!r} for {share:.0%} of the validation images"
            if collapsed else f"its validation top-1 {top1:.0%} is at chance (1/{k} = "
            f"{1 / k:.0%})")
    return (f"the model has not learned: {what}. On a small folder, start from pretrained "
            "weights (model=resnet18 model.weights=resnet18.pt model.replace_head=true; "
            "README, 'Your own data'), or train with recipe=small_folder (more optimizer "
            "steps, augmentation); more images, more epochs (run.epochs) or another "
            "task.lr may be what it needs")


class Validation:
    """Top-1 accuracy of the trained model over ``dataset.val_path`` (after each epoch).

    Args:
        data: the validation data path (``validation_config``), one epoch per call.
        model: the model being trained.
        amp: the run's autocast.
        classes: the training set's classes; the validation folder must have the same.
        ranks: this process's place under torch.distributed (``data`` is its share).
    """

    def __init__(self, data: DataPath, model: nn.Module, amp: AmpConfig, classes: list[str],
                 ranks: Ranks | None = None):
        detection = isinstance(local_module(model), Detector)
        same = data.classes == list(classes) or (detection and data.classes == list(
            classes)[: len(data.classes)])  # YOLO ids without names: the ids its labels use
        if not same:
            raise ConfigError(f"dataset.val_path={data.storage.root} has classes "
                              f"{data.classes[:5]}..., the training folder {list(classes)[:5]}"
                              "...: they must be the same class folders")
        self.data, self.model, self.amp = data, model, amp
        self.ranks = ranks or Ranks()
        self.classes = list(classes)
        # per class: how many validation images the last call's top-1 named it (not_learning)
        self.predicted: list[int] = []
        if isinstance(local_module(model), Detector):
            DetectionMAP()  # torchmetrics or pycocotools missing: said now, not after an epoch

    @classmethod
    def for_run(cls, config: Config, model: nn.Module, amp: AmpConfig, device: torch.device,
                classes: list[str], progress: bool, ranks: Ranks | None = None) -> Validation:
        data = build_data_path(validation_config(config), device, ranks, epochs=1,
                               progress=progress, every_image=True)
        return cls(data, model, amp, classes, ranks)

    def __call__(self, model: nn.Module | None = None) -> dict[str, float]:
        """Loss, top-1 and top-5 of ``model`` (default: the model being trained; an EMA's
        network is given with the same uint8 input layer) over the validation images; a
        detector's mAP figures (``detection``)."""
        model = model if model is not None else self.model
        if isinstance(local_module(model), Detector):
            return self.detection(model)
        device = self.data.device
        # correct top-1, correct top-5, loss and images, then the images whose top-1 is each
        # class: one tensor, one all-reduce
        sums = torch.zeros(4 + len(self.classes), dtype=torch.float64, device=device)
        was_training = model.training
        model.eval()
        with torch.no_grad(), autocast(self.amp, device):
            for batch in self.data.device_batches():
                logits = model(batch["image"]).float()
                top = logits.topk(min(5, logits.shape[1]), dim=1).indices
                hit = top == batch["label"][:, None]
                loss = F.cross_entropy(logits, batch["label"], reduction="none")
                valid = batch["valid"].double() if "valid" in batch.keys() \
                    else torch.ones(len(loss), dtype=torch.float64, device=device)
                sums[:4] += torch.stack([(hit[:, 0] * valid).sum(),
                                         (hit.any(dim=1) * valid).sum(),
                                         (loss.double() * valid).sum(), valid.sum()])
                if len(self.classes) == logits.shape[1]:
                    sums[4:].index_add_(0, top[:, 0], valid)
        model.train(was_training)
        if self.ranks.enabled:  # every rank's share, each image once
            dist.all_reduce(sums)
        correct1, correct5, loss, total, *predicted = sums.tolist()
        self.predicted = [int(c) for c in predicted]
        n = max(total, 1)
        return {"top1": correct1 / n, "top5": correct5 / n, "loss": loss / n}

    def not_learning(self, top1: float) -> str | None:
        """The warning for a classifier that has not learned, from the last call's figures
        (``not_learning``), or None."""
        return not_learning(top1, self.predicted, self.classes)

    def detection(self, model: nn.Module) -> dict[str, float]:
        """A detector's ``map`` (COCO's, IoU 0.50:0.95) and ``map_50`` over the validation
        images (runner/tasks/train/detection_metrics.py): its padded predictions in eval
        mode against each batch's boxes, the padding rows of a distributed shard left out;
        under torch.distributed the metric gathers every rank's images before it computes,
        so each rank gets the figures of the whole split."""
        device = self.data.device
        metric = DetectionMAP().to(device)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), autocast(self.amp, device):
                for batch in self.data.device_batches():
                    predictions = model(batch["image"])
                    targets = {k: batch[k] for k in ("boxes", "box_labels", "box_count")}
                    if "valid" in batch.keys():  # a shard's padding rows: not images
                        keep = batch["valid"].bool()
                        predictions = {k: v[keep] for k, v in predictions.items()}
                        targets = {k: v[keep] for k, v in targets.items()}
                    metric.update(predictions, targets)
            figures = metric.compute()
            return {k: figures[k] for k in DETECTION_FIGURES}
        finally:
            model.train(was_training)

    def close(self) -> None:
        self.data.close()
