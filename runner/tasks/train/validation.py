"""``task=train``'s validation: the figures of the kind of target the model learns (scored
by its family's scorer, runner/tasks/train/scores.py's ``scorer_for``):
loss, top-1 and top-5 for classes, mAP and mAP@0.5 for boxes (``val_map``, ``val_map_50``),
mean IoU for masks (``val_miou``), over ``dataset.val_path`` (or the images
``dataset.val_fraction`` holds out) after each epoch, through a data path of its own, with
the crop its kind's record says (boxes and masks: the whole image).

Under torch.distributed each rank scores its own share of the images (padded to the same
number of batches on every rank, the padding rows masked out) and the sums are all-reduced:
every image counts exactly once, and no rank waits on another that ran out of batches.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from runner.common.errors import ConfigError
from runner.config.schema import (
    AmpConfig,
    AugmentConfig,
    Config,
    PageCache,
    PrefetchConfig,
    PrefetchName,
    Split,
    StorageName,
)
from runner.data import DataPath, build_data_path
from runner.data.targets import TARGETS
from runner.launch.distributed import Ranks
from runner.model.amp import autocast
from runner.model.families import family_of
from runner.tasks.train.scores import scorer_for


def validation_config(config: Config) -> Config:
    """The data path of ``dataset.val_path`` (or of the images ``dataset.val_fraction``
    holds out): decoded with the run's decoder, center crops (a detector's: whole images),
    in order, every image once, from a warm page cache (the crop: its kind of target's)."""
    if config.dataset.val_path is not None:
        dataset = dataclasses.replace(config.dataset, path=config.dataset.val_path,
                                      manifest=None, val_fraction=0.0)
    else:  # the held-out side of dataset.val_fraction's split of the training images
        dataset = dataclasses.replace(config.dataset, split=Split.val)
    # a detector sees whole images (a centre crop would cut boxes at the sides away)
    crop = TARGETS[config.dataset.targets.kind].eval_crop
    dataset = dataclasses.replace(dataset, crop=crop, page_cache=PageCache.warm)
    task = dataclasses.replace(config.task, augment=AugmentConfig())  # images as they are
    loader = dataclasses.replace(config.loader, name=StorageName.folder, shuffle=False,
                                 drop_last=False)
    return dataclasses.replace(config, dataset=dataset, loader=loader, task=task,
                               prefetch=PrefetchConfig(PrefetchName.none))


class Validation:
    """The validation figures of the model being trained (after each epoch).

    Args:
        data: the validation data path (``validation_config``), one epoch per call.
        model: the model being trained.
        amp: the run's autocast.
        classes: the training set's classes; the validation folder must have the same.
        ranks: this process's place under torch.distributed (``data`` is its share).
    """

    def __init__(self, data: DataPath, model: nn.Module, amp: AmpConfig, classes: list[str],
                 ranks: Ranks | None = None):
        family = family_of(model)  # what scores it: its family's scorer
        self.family = family.name
        # labels read with their targets (YOLO's ids without names): the ids they use
        prefix = bool(TARGETS[family.target].batch_keys)
        same = data.classes == list(classes) or (prefix and data.classes == list(
            classes)[: len(data.classes)])
        if not same:
            raise ConfigError(f"dataset.val_path={data.storage.root} has classes "
                              f"{data.classes[:5]}..., the training folder {list(classes)[:5]}"
                              "...: they must be the same class folders")
        self.data, self.model, self.amp = data, model, amp
        self.classes = len(classes)
        self.ranks = ranks or Ranks()
        # a package the scorer needs missing (torchmetrics): said now, not after an epoch
        self._scorer()

    def _scorer(self):
        return scorer_for(self.family)(self.data.device, self.ranks, self.classes)

    @classmethod
    def for_run(cls, config: Config, model: nn.Module, amp: AmpConfig, device: torch.device,
                classes: list[str], progress: bool, ranks: Ranks | None = None) -> Validation:
        data = build_data_path(validation_config(config), device, ranks, epochs=1,
                               progress=progress, every_image=True)
        return cls(data, model, amp, classes, ranks)

    def __call__(self, model: nn.Module | None = None) -> dict[str, float]:
        """The figures of ``model`` (default: the model being trained; an EMA's network is
        given with the same uint8 input layer) over the validation images: its kind of
        target's (``TargetKind.figures``), each rank's share counted once."""
        model = model if model is not None else self.model
        scorer = self._scorer()
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), autocast(self.amp, self.data.device):
                for batch in self.data.device_batches():
                    scorer.update(model, batch)
            return scorer.compute()
        finally:
            model.train(was_training)

    def close(self) -> None:
        self.data.close()
