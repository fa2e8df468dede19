"""``task=train``: its life cycle (a checkpoint to resume from, validation, EMA and the best
checkpoint at each epoch's end, the checkpoints' schedule) and its step, ``TrainStep``.

A run resumes from the checkpoint ``resume=`` names (runner/tasks/checkpoint.py), its data
checked against the checkpoint's fingerprint; after each epoch the validation images
(``dataset.val_path`` or ``val_fraction``, runner/tasks/train/validation.py) are scored with the
trained weights and the EMA's, ``checkpoint-best.pt`` keeps the best ``task.best_metric``,
and the ``Checkpointer`` writes ``checkpoint.pt`` on its schedule and at the end (rank 0
alone: the replicas are equal).

What is trained and how is asked of the model's family (runner/model/families.py) and the
kind of target it learns (runner/data/targets/), never of the model's type: a classifier
trains on cross-entropy, a segmenter on per-pixel cross-entropy against the batch's
``mask``, a detector on the sum of its own losses given the batch's padded boxes, under the
same accumulation, clipping, scaler and EMA. The validation figures are the kind's
(``val_top1``...; ``val_map``, ``val_map_50``; ``val_miou``), and ``checkpoint-best.pt``
follows the kind's own (``TargetKind.best``) unless ``task.best_metric`` names another of
them. ``check_target_task`` refuses a model that does not learn the data's kind, mixing
images whose target belongs to one image (``task.augment.mixup``, ``cutmix``), a
host-normalized batch for a family that normalizes inside and a backend that compiles whole
models for one that cannot be compiled whole (a detector: compile=inductor compiles its
backbone).
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn

from runner.common.errors import ConfigError, Diverged
from runner.config.schema import (
    NO_MODEL,
    AmpConfig,
    AmpName,
    Config,
    HostDtype,
    TaskConfig,
    TaskName,
    to_plain,
)
from runner.data import DataPath
from runner.data.targets import TARGETS, TargetKind
from runner.launch.distributed import parameter_digest
from runner.measure.clock import MAX_PENDING_EVENTS, DeviceClock
from runner.model.amp import autocast, grad_scaler
from runner.model.compile import build_models, check_compiles, step_amp
from runner.model.families import Family, family_of, family_of_config, learns
from runner.tasks import checkpoint, results
from runner.tasks.checkpoint import unwrapped_network
from runner.tasks.loop import Step
from runner.tasks.task import RunContext, TaskBase
from runner.tasks.train.optim import (
    OPTIMIZERS,
    Ema,
    build_optimizer,
    build_schedule,
    learning_rate,
    updates_in,
)
from runner.tasks.train.validation import Validation

log = logging.getLogger("runner")


class TrainTask(TaskBase):
    """One model trained over the plan's steps (a resumed run: the steps left)."""

    name = TaskName.train

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        self.validation: Validation | None = None
        self.epoch_figures: list[dict[str, Any]] = []  # per epoch: validation top-1
        self.saves: checkpoint.Checkpointer | None = None  # rank 0: the checkpoints
        self.best: float | None = None  # the best validation figure so far (checkpoint-best)

    def resume(self) -> dict[str, Any] | None:
        """The checkpoint ``resume=`` names; checkpoint-best.pt is beaten only by a better
        epoch than the one it holds."""
        super().resume()
        if self.resumed is not None:
            self.best = self.resumed.get("best")
            # another world size: the same global batch (per-rank batch scaled), or refused
            checkpoint.fit_world(self.resumed, self.config, self.ctx.ranks.world,
                                 self.resumed["source"])
        return self.resumed

    def prepare(self, data: DataPath) -> None:
        if not data.classes:
            raise ConfigError(f"task=train needs labelled images: {data.storage.root} holds "
                              "unlabelled ones (a flat folder, dataset.labels=none, or a "
                              "manifest without labels); give one sub-folder per class, or a "
                              "manifest with a label column")
        labels = getattr(data.storage, "label_tensor", None)
        if getattr(data.storage, "labels_unknown", False):
            labels = None  # a user's Dataset whose labels come only as it is read
        unlabelled = int((labels() < 0).sum()) if callable(labels) else 0
        if unlabelled:  # a WebDataset sample without its .cls, a manifest row without label
            raise ConfigError(f"task=train needs every image labelled: {unlabelled} of "
                              f"{len(data.storage)} in {data.storage.root} have no label (a "
                              "shard's sample without a .cls member, a manifest row without "
                              "a label); unlabelled images serve task=infer only: label them, "
                              "or leave them out")
        check_head_size(self.config, data.classes)
        classes = self.config.model.classes
        if classes is not None:  # it names an inference's outputs; said, not silently ignored
            log.warning("model.classes=%s is not used in training: the classes are the "
                        "data's (%d: %s), and the checkpoint keeps those names", classes,
                        len(data.classes), ", ".join(map(str, data.classes[:5]))
                        + (", ..." if len(data.classes) > 5 else ""))
        check_target_task(self.config)
        super().prepare(data)
        if self.resumed is not None:
            checkpoint.check_epoch_length(self.resumed, data.steps_per_epoch,
                                          self.resumed["source"])

    def build(self, total_steps: int) -> Step:
        """The model (built, compiled, verified; its checkpoint's state restored), its
        step, and the validation data path."""
        cfg, ctx = self.config, self.ctx
        data, ranks = ctx.data, ctx.ranks
        self.total_steps = total_steps
        self.built = build_models(cfg, data.storage, ctx.device, ranks)
        self.models = self.built.models
        (model,) = self.models.values()
        self.step = step = self.make_step(
            cfg.task, self.models, step_amp(cfg), ctx.device, total_steps,
            first_step=self.start_step, steps_per_epoch=data.steps_per_epoch,
            global_batch=cfg.loader.batch_size * ranks.world * cfg.task.accumulate)
        if self.resumed is not None:
            checkpoint.restore(step, self.resumed, self.resumed["source"], cfg)
        split = TARGETS[cfg.dataset.targets.kind].has_val_split  # a layout's own val split
        if cfg.dataset.val_path or cfg.dataset.val_fraction > 0 or (
                split is not None and split(cfg.dataset)):
            self.validation = Validation.for_run(cfg, model, step_amp(cfg), ctx.device,
                                                 data.classes, cfg.run.progress and ranks.main,
                                                 ranks)
        return step

    @staticmethod
    def make_step(cfg: TaskConfig, models: dict[str, nn.Module], amp: AmpConfig,
                  device: torch.device, total_steps: int, reducers: Any = None,
                  outputs: Any = None, first_step: int = 0, steps_per_epoch: int = 1,
                  global_batch: int | None = None) -> TrainStep:
        """The one model there is, trained (``TrainStep``; no reducers nor writers)."""
        (model,) = models.values()
        return TrainStep(model, cfg, total_steps, amp, device, first_step + total_steps,
                         steps_per_epoch, global_batch, first_step)

    def start(self) -> None:
        if self.resumed is not None:  # dropout goes on drawing where it stopped
            checkpoint.restore_rng(self.resumed)

    def on_step(self) -> Callable[[int], None] | None:
        """Rank 0 (the replicas are equal): the checkpoints' schedule, after each step."""
        ctx = self.ctx
        if not ctx.ranks.main:
            return None
        self.saves = saves = checkpoint.Checkpointer(
            self.config.task, ctx.run_dir, to_plain(self.config), ctx.clock.paused,
            lambda: {"wandb_id": ctx.logger.run_id, "data": self.data_print,
                     "best": self.best})
        return lambda done: saves.after_step(self.step, done, ctx.data.steps_per_epoch)

    def on_epoch_end(self, epochs: int) -> None:
        """After each epoch: validation top-1 (the EMA's too), the best checkpoint, and a
        checkpoint when one is due."""
        row: dict[str, Any] = {"epoch": epochs}
        if self.validation is not None:
            got = {f"val_{k}": v for k, v in self.validation().items()}
            ema = getattr(self.step, "ema", None)
            if ema is not None:  # the averaged weights behind the same uint8 input layer
                # served as the model is (a detector's padded predictions), its family's way
                averaged = family_of(self.step.model).averaged(self.step.model, ema.model)
                got.update({f"val_ema_{k}": v for k, v in self.validation(averaged).items()})
            row.update(got)
            log.info("epoch %d: %s", epochs, validation_line(got))
            self.ctx.logger.log({**{k.replace("val_", "val/", 1): v for k, v in got.items()},
                                 "epoch": epochs}, step=None)
            self._keep_best(epochs, row)
        self.epoch_figures.append(row)
        if self.saves is not None:
            self.saves.after_epoch(self.step, epochs, self.ctx.data.steps_per_epoch)

    def _keep_best(self, epoch: int, row: dict[str, Any]) -> None:
        """checkpoint-best.pt: the weights of the epoch with the best ``task.best_metric``
        (``best_metric``: a detector left at the default, ``val_map``)."""
        key = best_metric(self.config)
        if self.saves is None or key not in row:
            return
        if row[key] is None or math.isnan(row[key]):  # nothing measured (mAP without boxes)
            return
        better = (lambda a, b: a < b) if key.endswith("loss") else (lambda a, b: a > b)
        if self.best is None or math.isnan(self.best) or better(row[key], self.best):
            self.best = row[key]
            per_epoch = self.ctx.data.steps_per_epoch
            path = self.saves.write(self.step, epoch * per_epoch, per_epoch, {},
                                    name="checkpoint-best.pt")
            log.info("epoch %d: best %s so far (%.4g): %s", epoch, key, row[key], path)

    def figures(self, complete: bool) -> dict[str, Any]:
        last = self.epoch_figures[-1] if self.epoch_figures else {}
        if complete and self.validation is not None and "val_top1" in last:
            warning = self.validation.not_learning(last["val_top1"])
            if warning:  # a run that ends at chance says so, naming what to try
                log.warning("%s", warning)
        return {**super().figures(complete), **results.epochs(self.epoch_figures)}

    def rank_digest(self) -> str | None:
        return parameter_digest(next(iter(self.models.values())))

    def write(self, steps_done: int, complete: bool, figures: dict[str, Any]) -> dict[str, Any]:
        """``checkpoint.pt`` at the end, or where a signal stopped it (with its losses)."""
        if self.saves is None:
            return {}
        losses = {k: figures[k] for k in ("loss_first", "loss_last") if k in figures}
        path = self.saves.write(self.step, steps_done, self.ctx.data.steps_per_epoch, losses)
        return {"checkpoint": str(path) if path else None}

    def close(self) -> None:
        if self.validation is not None:
            self.validation.close()


KIND = TrainTask  # its registry record (runner/tasks/__init__.py)

# the augmentations that mix two images' labels: a box or a pixel's class belongs to one image
MIX_KEYS = ("mixup", "cutmix")
DEFAULT_BEST = "val_top1"  # task.best_metric's default, a classifier's figure


def run_family(config: Config) -> Family:
    """The family of the model a training run trains (runner/model/families.py)."""
    return family_of_config(config.model, config.dataset.targets)


def check_head_size(config: Config, classes: list[str]) -> None:
    """A classifier's or a segmenter's ``model.num_classes`` that holds every class of the
    data: a label (a mask's class id) at or beyond it would fail the loss at its first
    batch (``Target 3 is out of bounds``)."""
    asked = config.model.num_classes
    if asked is None or len(classes) <= asked or config.model.name == NO_MODEL:
        return
    kind = TARGETS[run_family(config).target]
    if kind.batch_keys and kind.plane is None:  # boxes: a detector's head has its own count
        return
    names = ", ".join(map(str, classes[:5])) + (", ..." if len(classes) > 5 else "")
    raise ConfigError(f"model.num_classes={asked}, and the data's labels run to "
                      f"{len(classes) - 1} ({len(classes)} classes: {names}): a head of "
                      f"{asked} outputs cannot learn labels {asked}..{len(classes) - 1}; set "
                      f"model.num_classes={len(classes)}, or leave it unset (the head is "
                      "sized from the data), or fix the labels")


def check_target_task(config: Config) -> None:
    """The model learns the kind of target ``dataset.targets`` gives (its family's
    ``target``); a target that belongs to one image is trained without mixing images
    (``task.augment.mixup``/``cutmix``); a family that normalizes inside gets uint8 batches
    (``loader.host_dtype``) and one that cannot be compiled whole gets a backend that
    compiles its part (``check_compiles``) or none; the best
    checkpoint follows a figure the kind's validation gives."""
    model, targets = config.model, config.dataset.targets
    if model.name == NO_MODEL:
        return
    kind, family = TARGETS[targets.kind], run_family(config)
    name = f"model.name={model.name}" if model.target is None else f"model.target={model.target}"
    if family.target is not kind.name:
        if not kind.batch_keys:  # the data gives a class per image, the model learns more
            raise ConfigError(f"{name} is a {family.name.value} and trains on "
                              f"{family.target.value}: set {TARGETS[family.target].setting}")
        learner = learns(kind.name)
        raise ConfigError(f"dataset.targets={targets.value} gives {kind.name.value}, and {name} "
                          f"is not a {learner.name.value}: train one (model.name="
                          f"{learner.examples}) or leave dataset.targets=none")
    for key in () if kind.mixes else MIX_KEYS:
        value = getattr(config.task.augment, key)
        if value:
            raise ConfigError(f"task.augment.{key}={value} mixes two images and their "
                              f"labels, which {kind.name.value} cannot follow (each belongs "
                              f"to one image): drop it (task.augment.{key}=0) to train {name}")
    if family.uint8 and config.loader.host_dtype is not HostDtype.uint8:
        raise ConfigError(f"loader.host_dtype={config.loader.host_dtype.value} normalizes on "
                          f"the host, and {name} normalizes its own way inside: "
                          "use loader.host_dtype=uint8")
    check_compiles(family, config.compile, model.label)
    if config.task.class_balance and not family.balances:
        raise ConfigError(f"task.class_balance={config.task.class_balance} weighs a "
                          f"segmenter's pixels by class, and {name} is a "
                          f"{family.name.value}: drop it (task.class_balance=0)")
    key = config.task.best_metric
    if key != DEFAULT_BEST and key.removeprefix("val_").removeprefix("ema_") \
            not in kind.figures:
        raise ConfigError(f"task.best_metric={key} is not a {family.name.value}'s validation "
                          f"figure: choose one of {', '.join(best_metrics(kind))}")


def best_metrics(kind: TargetKind) -> list[str]:
    """The ``task.best_metric`` values a kind's validation gives."""
    return [f"val_{p}{k}" for p in ("", "ema_") for k in kind.figures]


def best_metric(config: Config) -> str:
    """The figure ``checkpoint-best.pt`` is chosen by: ``task.best_metric``; left at the
    classifier's default, the kind of target's own (a detector's ``val_map``)."""
    key = config.task.best_metric
    if key != DEFAULT_BEST or config.model.name == NO_MODEL:
        return key
    return TARGETS[run_family(config).target].best


def validation_line(got: dict[str, float]) -> str:
    """An epoch's validation figures in words (a classifier's, a detector's, any other's)."""
    if "val_map" in got:
        return (f"validation mAP {got['val_map']:.3f}, mAP@0.5 {got['val_map_50']:.3f}"
                + (f" (EMA mAP {got['val_ema_map']:.3f})" if "val_ema_map" in got else ""))
    if "val_top1" in got:
        return (f"validation top-1 {100 * got['val_top1']:.1f}%, top-5 "
                f"{100 * got['val_top5']:.1f}%, loss {got['val_loss']:.4f}"
                + (f" (EMA top-1 {100 * got['val_ema_top1']:.1f}%)"
                   if "val_ema_top1" in got else ""))
    if "val_miou" in got:
        return (f"validation mIoU {got['val_miou']:.3f}, pixel accuracy "
                f"{100 * got['val_pixel_accuracy']:.1f}%"
                + (f" (EMA mIoU {got['val_ema_miou']:.3f})" if "val_ema_miou" in got else ""))
    return "validation " + ", ".join(f"{k.removeprefix('val_')} {v:.4g}" for k, v in got.items())


class TrainStep:
    """One training step: cross-entropy (``task.label_smoothing``), or a detector's own
    losses summed (``total_loss``: the model is a ``Detector``), gradients accumulated
    over ``task.accumulate`` batches, clipped (``task.clip_grad_norm``), an optimizer step
    with its learning-rate schedule and the EMA's update (runner/tasks/train/optim.py); losses stay on
    the device until read.

    Under DistributedDataParallel the gradients are all-reduced once per optimizer step:
    each batch runs (forward and backward) under the DDP model's ``no_sync()`` except an
    accumulation's last, which the optimizer step follows, and the run's last, whose
    partial accumulation ``close`` applies.

    Args:
        model: the network (its first layer takes uint8).
        cfg: the task's optimizer, schedule and the rest.
        total_steps: the batches this run trains on; every step's loss is kept (one scalar
            each) so the figures compare the first and last tenth of the run.
        amp: autocast dtype (a GradScaler for fp16).
        device: the model's device.
        plan_steps: the whole plan's batches (a resumed run's included): the schedule's
            length. Unset: ``total_steps``.
        steps_per_epoch: batches per epoch (warm-up and step schedules in epochs).
        global_batch: images per step over every rank (``task.scale_lr``).
        first_step: the plan's steps done before this run (a resume): a non-finite loss
            is named by its step of the plan.

    The losses are checked where the loop syncs anyway (``read`` at log points,
    ``check_finite`` before a checkpoint is written, ``close``), never per step: the first
    non-finite one raises ``Diverged`` naming its step of the plan.
    """

    def __init__(self, model: nn.Module, cfg: TaskConfig, total_steps: int,
                 amp: AmpConfig | None = None, device: torch.device | None = None,
                 plan_steps: int | None = None, steps_per_epoch: int = 1,
                 global_batch: int | None = None, first_step: int = 0):
        self.model = model.train()
        self.cfg = cfg
        # how a batch goes through it and what it is trained by: its family's
        self.family = family_of(model)
        device = device or next(model.parameters()).device
        self.base_lr = learning_rate(cfg, global_batch)  # the schedule's peak
        self.plan_steps = plan_steps or total_steps  # the schedule's length, in batches
        self.steps_per_epoch = steps_per_epoch
        self.first_step = first_step
        self.optimizer = build_optimizer(model, cfg, device, self.base_lr)
        # the configured hyperparameters of each group, as a resume sets them again
        self._weight_decay = [g["weight_decay"] for g in self.optimizer.param_groups]
        self.schedule = self._build_schedule()
        self.ema = Ema(unwrapped_network(model), cfg.ema_decay) if cfg.ema_decay > 0 else None
        amp = amp or AmpConfig(AmpName.off)
        self.autocast = lambda: autocast(amp, device)
        self.scaler = grad_scaler(amp, device)
        self.losses = torch.zeros(max(total_steps, 1), device=device)
        self.total_steps = total_steps
        self.steps = 0
        self.skipped = 0  # batches read with no decodable image (no step)
        # DDP's (also behind torch.compile): gradients kept local, not all-reduced
        self._no_sync = getattr(getattr(model, "_orig_mod", model), "no_sync", None)
        # the gradients waiting for an optimizer step are this rank's alone (accumulated
        # under no_sync, not all-reduced yet): a checkpoint says so
        self.local_grads = False
        self.micro = 0  # batches whose gradients wait for the next optimizer step
        self._read = 0  # losses before this index were already read
        self._checked = 0  # losses before this index are known to be finite
        self.diverged: Diverged | None = None  # the first non-finite loss, once found
        # what a recipe costs: the optimizer step (clipping included) and the EMA update,
        # timed on the device (events on CUDA, resolved where the loop syncs anyway)
        self.clock = DeviceClock(device)
        self._spans: dict[str, list] = {"optimizer": [], "ema": []}
        self._seconds = {"optimizer": 0.0, "ema": 0.0}

    def _build_schedule(self) -> torch.optim.lr_scheduler.LRScheduler:
        """The schedule of ``task.*`` over the plan, from the groups' current ``lr``."""
        return build_schedule(self.optimizer, self.cfg,
                              updates_in(self.plan_steps, self.cfg.accumulate),
                              max(1, self.steps_per_epoch // self.cfg.accumulate))

    def apply_config(self, rebuild_schedule: bool, updates: int) -> None:
        """After a checkpoint's optimizer state is loaded: this run's hyperparameters over
        the checkpoint's (weight decay, momentum, Nesterov, betas, eps), and, with
        ``rebuild_schedule``, this run's schedule (base learning rate, ``task.schedule``
        and its keys, the plan's length) built afresh and stepped through the ``updates``
        optimizer steps done: the rate in force is the new schedule's at that step.
        Without it the checkpoint's schedule state (loaded already) stands, and with it
        the rates the groups hold."""
        kind = OPTIMIZERS[self.cfg.optimizer]
        # one-cycle with momentum cycling owns the groups' momentum (or betas) too
        cycles = bool(getattr(self.schedule, "cycle_momentum", False))
        hyper = {k: v for k, v in kind.hyperparameters(self.cfg).items()
                 if rebuild_schedule or not cycles or k not in ("momentum", "betas")}
        for group, decay in zip(self.optimizer.param_groups, self._weight_decay):
            group["weight_decay"] = decay
            group.update({k: v for k, v in hyper.items() if k in group})
        kind.prepare(self.optimizer)  # e.g. a checkpoint trained without momentum: zeros
        if not rebuild_schedule:
            return
        for group in self.optimizer.param_groups:  # as a fresh optimizer's: the base rate
            group["lr"] = self.base_lr
            for key in ("initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum"):
                group.pop(key, None)
        self.schedule = self._build_schedule()
        with warnings.catch_warnings():  # "scheduler stepped before the optimizer": on purpose
            warnings.simplefilter("ignore")
            for _ in range(updates):
                self.schedule.step()

    def __call__(self, batch: TensorDict) -> None:
        local = self._keeps_gradients_local()
        # DDP decides at the forward whether the backward all-reduces: both inside
        with self._no_sync() if local else contextlib.nullcontext():
            with self.autocast():  # a detector's forward takes the batch's boxes
                out = self.family.forward(self.model, batch)
            loss = self.loss(out, batch)
            if self.micro == 0:
                self.optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(loss / self.cfg.accumulate).backward()
        self.local_grads = local
        self.micro += 1
        if self.micro == self.cfg.accumulate:
            self.update()
        if self.steps < len(self.losses):
            self.losses[self.steps] = loss.detach()  # stays on the device: no sync
        self.steps += 1

    def skip(self) -> None:
        """A batch whose images all failed to decode (listed in ``skipped_files``): read,
        nothing to train on; it counts toward the run's last batch (``total_steps``).

        Under DDP the other ranks' backward waits on this one's all-reduce, which an
        empty batch never makes: rather than hang every rank, this one stops the run in
        one line (its checkpoint-on-signal path is not involved; the last saved one holds)."""
        if self._no_sync is not None:
            raise ConfigError("a whole batch of undecodable images on one rank under "
                              "torchrun: the ranks' gradient all-reduce cannot pair up "
                              "without it; remove the files listed under skipped_files "
                              "(or run on one process), then resume")
        self.skipped += 1

    def _keeps_gradients_local(self) -> bool:
        """Whether this batch's backward skips DDP's all-reduce: a DDP model, and neither
        the accumulation's last batch (the optimizer step follows) nor the run's last (its
        partial accumulation is applied at ``close``)."""
        return (self._no_sync is not None and self.micro + 1 < self.cfg.accumulate
                and self.steps + self.skipped + 1 < self.total_steps)

    def loss(self, out: Any, batch: TensorDict) -> torch.Tensor:
        """The loss of the forward's ``out``: its family's (runner/model/families.py:
        ``class_loss``, ``mask_loss``, a detector's own losses summed)."""
        return self.family.loss(out, batch, self.cfg)

    def update(self) -> None:
        """The optimizer step of the gradients gathered so far (clipped), the schedule's
        step and the EMA's update; nothing here syncs with the device."""
        start = self.clock.now()
        if self.cfg.clip_grad_norm > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad_norm,
                                           foreach=True)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.schedule.step()
        stepped = self.clock.now()
        self._spans["optimizer"].append((start, stepped))
        if self.ema is not None:
            self.ema.update(unwrapped_network(self.model))
            self._spans["ema"].append((stepped, self.clock.now()))
        if not self.clock.cuda or len(self._spans["optimizer"]) > MAX_PENDING_EVENTS:
            self._fold(done_only=self.clock.cuda)
        self.micro = 0

    def _fold(self, done_only: bool = False) -> None:
        """Timed spans into seconds: all (after a sync) or those completed (no sync)."""
        for name, spans in self._spans.items():
            k = len(spans)
            if done_only:
                k = 0
                while k < len(spans) and self.clock.done(spans[k][1]):
                    k += 1
            self._seconds[name] += sum(self.clock.seconds(a, b) for a, b in spans[:k])
            del spans[:k]

    def costs(self) -> dict[str, float]:
        """Seconds the optimizer steps and the EMA updates took since warm-up (after a
        sync); runner/tasks/results.py turns them into their share of the step
        (``optimizer_ms``, ``ema_ms``), as the loop's stages."""
        if self.clock.cuda:
            torch.cuda.synchronize()
        self._fold()
        out = {"optimizer_seconds": self._seconds["optimizer"]}
        if self.ema is not None:
            out["ema_seconds"] = self._seconds["ema"]
        return out

    @property
    def lr(self) -> float:
        """The learning rate in force (a host value: no sync)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def start_timing(self) -> None:
        """Warm-up is over: the optimizer and EMA times count from the next step."""
        if self.clock.cuda:
            torch.cuda.synchronize()  # once, where the loop syncs anyway
        self._fold()
        self._seconds = dict.fromkeys(self._seconds, 0.0)

    def read(self) -> dict[str, float]:
        """Mean loss since the last read (a sync point: call only at log points). A
        non-finite mean (a NaN or an infinity among those losses) raises ``Diverged``
        naming the first such step; once raised, reads return nothing."""
        end = min(self.steps, len(self.losses))
        if end <= self._read or self.diverged is not None:
            return {}
        start, self._read = self._read, end
        loss = self.losses[start:end].mean().item()  # the one sync, as before
        if not math.isfinite(loss):
            raise self._diverged(start, end)
        self._checked = max(self._checked, end)
        return {"loss": loss, "lr": self.lr}

    def check_finite(self) -> None:
        """Raise ``Diverged`` if a loss not checked yet is non-finite: before a checkpoint
        is written (which syncs anyway) and at ``close``; one sync when there are any."""
        if self.diverged is not None:
            raise self.diverged
        end = min(self.steps, len(self.losses))
        if end <= self._checked:
            return
        if not bool(torch.isfinite(self.losses[self._checked : end]).all()):
            raise self._diverged(self._checked, end)
        self._checked = end

    def _diverged(self, start: int, end: int) -> Diverged:
        """The error for the first non-finite loss among steps ``start:end`` (indices of
        this run's losses), kept so it is raised once."""
        bad = (~torch.isfinite(self.losses[start:end])).nonzero()
        index = start + (int(bad[0]) if len(bad) else 0)
        value = float(self.losses[index])
        step = self.first_step + index + 1
        self.diverged = Diverged(
            f"the loss is {value} at step {step} (the first non-finite one: training "
            f"diverged); the run stops here and writes no checkpoint from step {step} on. "
            f"Lower task.lr (now {self.base_lr:g}), set task.clip_grad_norm, warm up "
            "(task.warmup_steps), or train under amp=bf16 rather than fp16")
        return self.diverged

    def close(self, complete: bool = True) -> dict[str, float]:
        """The run's loss figures; a complete run's last, partial accumulation is applied
        (an interrupted one's waits in the checkpoint). ``Diverged`` if a loss the log
        points did not read is non-finite."""
        self.check_finite()
        if complete and self.micro:
            self.update()
        n = min(self.steps, len(self.losses))
        if n == 0:
            return {}
        tenth = max(1, n // 10)
        return {"loss_first": self.losses[:tenth].mean().item(),
                "loss_last": self.losses[n - tenth : n].mean().item(), "lr_last": self.lr,
                **self.costs()}
