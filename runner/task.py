"""``task=``: what one step does with a device-resident batch (train, infer, or data only).

Each step object is called once per batch and never synchronizes; ``read()`` is called at
log points (where the loop has already synchronized) and returns the figures to log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from runner import timeline
from runner.amp import autocast, grad_scaler
from runner.checkpoint import network
from runner.config import (
    AmpConfig,
    AmpName,
    AugmentConfig,
    Config,
    Crop,
    PageCache,
    PrefetchConfig,
    PrefetchName,
    Split,
    StorageName,
    TaskConfig,
    TaskName,
)
from runner.data import DataPath, build_data_path
from runner.errors import ConfigError, Diverged
from runner.metrics import DeviceClock
from runner.optim import Ema, build_optimizer, build_schedule, learning_rate, updates_in
from runner.outputs import Outputs, Reduce

MAX_PENDING_EVENTS = 256  # recorded CUDA event pairs kept before completed ones are folded


class Step(Protocol):
    def __call__(self, batch: TensorDict) -> None: ...
    def read(self) -> dict[str, float]: ...
    def close(self, complete: bool = True) -> dict[str, float]: ...
    def start_timing(self) -> None: ...  # warm-up is over: figures count from here


class TrainStep:
    """One training step: cross-entropy (``task.label_smoothing``), gradients accumulated
    over ``task.accumulate`` batches, clipped (``task.clip_grad_norm``), an optimizer step
    with its learning-rate schedule and the EMA's update (runner/optim.py); losses stay on
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
        device = device or next(model.parameters()).device
        self.base_lr = learning_rate(cfg, global_batch)  # the schedule's peak
        self.plan_steps = plan_steps or total_steps  # the schedule's length, in batches
        self.steps_per_epoch = steps_per_epoch
        self.first_step = first_step
        self.optimizer = build_optimizer(model, cfg, device, self.base_lr)
        # the configured hyperparameters of each group, as a resume sets them again
        self._weight_decay = [g["weight_decay"] for g in self.optimizer.param_groups]
        self.schedule = self._build_schedule()
        self.ema = Ema(network(model), cfg.ema_decay) if cfg.ema_decay > 0 else None
        amp = amp or AmpConfig(AmpName.off)
        self.autocast = lambda: autocast(amp, device)
        self.scaler = grad_scaler(amp, device)
        self.losses = torch.zeros(max(total_steps, 1), device=device)
        self.total_steps = total_steps
        self.steps = 0
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
        cfg = self.cfg
        # one-cycle with momentum cycling owns the groups' momentum (or betas) too
        cycles = bool(getattr(self.schedule, "cycle_momentum", False))
        for group, decay in zip(self.optimizer.param_groups, self._weight_decay):
            group["weight_decay"] = decay
            if "nesterov" in group:
                group["nesterov"] = cfg.nesterov
            if "eps" in group:
                group["eps"] = cfg.eps
            if rebuild_schedule or not cycles:
                if "momentum" in group:
                    group["momentum"] = cfg.momentum
                if "betas" in group:
                    group["betas"] = tuple(cfg.betas)
        for group in self.optimizer.param_groups:  # a checkpoint trained without momentum
            if not group.get("momentum"):          # has no buffers: zeros, as a fresh run's
                continue                           # (runner/optim.py's zero_momentum)
            for p in group["params"]:
                if self.optimizer.state[p].get("momentum_buffer") is None:
                    self.optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
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
            with self.autocast():
                logits = self.model(batch["image"])
            loss = self.loss(logits.float(), batch)
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

    def _keeps_gradients_local(self) -> bool:
        """Whether this batch's backward skips DDP's all-reduce: a DDP model, and neither
        the accumulation's last batch (the optimizer step follows) nor the run's last (its
        partial accumulation is applied at ``close``)."""
        return (self._no_sync is not None and self.micro + 1 < self.cfg.accumulate
                and self.steps + 1 < self.total_steps)

    def loss(self, logits: torch.Tensor, batch: TensorDict) -> torch.Tensor:
        """Cross-entropy (label smoothing); a mixed image's is ``(1 - mix) * CE(label) +
        mix * CE(label_b)`` (task.augment); padding rows of a distributed shard weigh
        nothing."""
        keys = batch.keys()
        smoothing = self.cfg.label_smoothing
        losses = F.cross_entropy(logits, batch["label"], reduction="none",
                                 label_smoothing=smoothing)
        if "mix" in keys:
            mix = batch["mix"].float()
            other = F.cross_entropy(logits, batch["label_b"], reduction="none",
                                    label_smoothing=smoothing)
            losses = (1 - mix) * losses + mix * other
        if "valid" in keys:
            valid = batch["valid"].float()
            return (losses * valid).sum() / valid.sum().clamp(min=1.0)
        return losses.mean()

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
            self.ema.update(network(self.model))
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
        sync); runner/results.py turns them into their share of the step
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


class InferStep:
    """Forward under inference_mode for one or several models on the same device batch.

    Each model's output is reduced on the device (runner/outputs.py: top-k, probabilities,
    embeddings, masks, the user's post-processing) and only that is handed to the writers.
    Each model's forward is timed on its own (CUDA events on a GPU, read at ``close``), so
    a multi-model pass reports images/s per model as well as for the whole pass.

    Args:
        models: name -> model (already compiled), all on one device.
        cfg: the task.
        reducers: name -> what is kept of its output (``outputs.Reduce``).
        outputs: the writers (None: nothing written).
        amp: autocast dtype.
        device: the models' device (a frozen TorchScript model cannot tell).
        first_step: the plan's step of the first batch (a resumed run's parts go on there).
    """

    def __init__(self, models: dict[str, nn.Module], cfg: TaskConfig,
                 reducers: dict[str, Reduce] | None = None, outputs: Outputs | None = None,
                 amp: AmpConfig | None = None, device: torch.device | None = None,
                 first_step: int = 0):
        self.models = {name: m.eval() for name, m in models.items()}
        # no reducers: the forward timed with its reduction, nothing written (the
        # verdict's probe; with no network to tap, no embeddings)
        self.reducers = reducers if reducers is not None else {
            name: Reduce(cfg, None) for name in models}
        self.outputs = outputs
        self.device = device or torch.device("cpu")
        amp = amp or AmpConfig(AmpName.off)
        self.autocast = lambda: autocast(amp, self.device)
        self.clock = DeviceClock(self.device)
        self._spans: dict[str, list] = {name: [] for name in models}
        # the loop's pass (not the verdict's probe, which has no reducers) draws each model
        # on a lane; host times are the models' own times on the CPU only
        self._lanes = (len(models) > 1 and reducers is not None and not self.clock.cuda
                       and timeline.enabled())
        self._seconds = dict.fromkeys(models, 0.0)
        self.images = 0
        self.step = first_step
        self.first_step = first_step
        self._valid_rows = torch.zeros((), dtype=torch.int64, device=self.device)

    def __call__(self, batch: TensorDict) -> None:
        # Padding rows of a distributed shard go through the model with the rest (a boolean
        # mask here would sync with the device to learn the count); the writer drops them
        # on the host and the count of real rows stays on the device until ``close``.
        valid = batch["valid"] if "valid" in batch.keys() else None
        if valid is None:
            self.images += batch.batch_size[0]
        else:
            self._valid_rows = self._valid_rows + valid.sum()
        with torch.inference_mode(), self.autocast():
            for name, model in self.models.items():
                start = self.clock.now()
                reduce = self.reducers[name]
                reduce.start()
                kept = reduce(model(batch["image"]), batch)
                end = self.clock.now()
                self._spans[name].append((start, end))
                if self._lanes:  # each model its own lane of the timeline
                    timeline.record("model", start, end, sub=f"model {name}")
                if self.outputs is not None:
                    self.outputs.submit(self.step, name, batch["index"], batch["label"], kept,
                                        valid)
        self.step += 1
        if not self.clock.cuda:  # host times are final already: keep no list
            self._resolve()
        elif sum(len(s) for s in self._spans.values()) > MAX_PENDING_EVENTS:
            self._resolve(done_only=True)  # a bounded list, and no sync

    def read(self) -> dict[str, float]:
        return {}

    def start_timing(self) -> None:
        """Warm-up is over: the per-model figures count from the next step."""
        if self.clock.cuda:
            torch.cuda.synchronize(self.device)  # once, where the loop syncs anyway
        self._resolve()
        self._seconds = dict.fromkeys(self._seconds, 0.0)
        self.images = 0
        self._valid_rows = torch.zeros((), dtype=torch.int64, device=self.device)

    def _resolve(self, done_only: bool = False) -> None:
        """Fold recorded spans into per-model seconds: all of them (after a sync), or those
        whose end event has completed (``done_only``: no sync, bounds the lists)."""
        for name, spans in self._spans.items():
            k = 0
            if done_only:
                while k < len(spans) and self.clock.done(spans[k][1]):
                    k += 1
            else:
                k = len(spans)
            self._seconds[name] += sum(self.clock.seconds(s, e) for s, e in spans[:k])
            del spans[:k]

    def close(self, complete: bool = True) -> dict[str, Any]:
        """The per-model figures, and the writers' (every write waited for; a ``complete``
        run's CSV parts joined, an interrupted one's kept to go on from)."""
        if self.clock.cuda:
            torch.cuda.synchronize(self.device)
        self._resolve()
        self.images += int(self._valid_rows)
        out: dict[str, Any] = {"models": {
            name: {"images_per_sec": self.images / sec if sec > 0 else None,
                   "ms_per_image": 1000.0 * sec / max(self.images, 1)}
            for name, sec in self._seconds.items()}}
        if self.outputs is not None:
            out.update(self.outputs.close(complete, self.step))
        return out


class DataOnlyStep:
    """``model=none``: the batch is loaded and moved, nothing else; measures the data path."""

    def __call__(self, batch: TensorDict) -> None:
        pass

    def read(self) -> dict[str, float]:
        return {}

    def start_timing(self) -> None:
        pass

    def close(self, complete: bool = True) -> dict[str, float]:
        return {}


def make_step(cfg: TaskConfig, models: dict[str, nn.Module], amp: AmpConfig,
              device: torch.device, total_steps: int,
              reducers: dict[str, Reduce] | None = None, outputs: Outputs | None = None,
              first_step: int = 0, steps_per_epoch: int = 1,
              global_batch: int | None = None) -> Step:
    """The step for ``task=``: training takes the one model there is, inference every
    model of the pass (its outputs reduced by ``reducers``, written by ``outputs``), no
    model the data only."""
    if not models:
        return DataOnlyStep()
    if cfg.name is TaskName.train:
        (model,) = models.values()
        return TrainStep(model, cfg, total_steps, amp, device, first_step + total_steps,
                         steps_per_epoch, global_batch, first_step)
    return InferStep(models, cfg, reducers, outputs, amp, device, first_step)


def validation_config(config: Config) -> Config:
    """The data path of ``dataset.val_path`` (or of the images ``dataset.val_fraction``
    holds out): decoded with the run's decoder, center crops, in order, every image once,
    from a warm page cache."""
    if config.dataset.val_path is not None:
        dataset = dataclasses.replace(config.dataset, path=config.dataset.val_path,
                                      manifest=None, val_fraction=0.0)
    else:  # the held-out side of dataset.val_fraction's split of the training images
        dataset = dataclasses.replace(config.dataset, split=Split.val)
    dataset = dataclasses.replace(dataset, crop=Crop.center, page_cache=PageCache.warm)
    task = dataclasses.replace(config.task, augment=AugmentConfig())  # images as they are
    loader = dataclasses.replace(config.loader, name=StorageName.folder, shuffle=False,
                                 drop_last=False)
    return dataclasses.replace(config, dataset=dataset, loader=loader, task=task,
                               prefetch=PrefetchConfig(PrefetchName.none))


class Validation:
    """Top-1 accuracy of the trained model over ``dataset.val_path`` (after each epoch).

    Args:
        data: the validation data path (``validation_config``), one epoch per call.
        model: the model being trained.
        amp: the run's autocast.
        classes: the training set's classes; the validation folder must have the same.
    """

    def __init__(self, data: DataPath, model: nn.Module, amp: AmpConfig, classes: list[str]):
        if data.classes != list(classes):
            raise ConfigError(f"dataset.val_path={data.storage.root} has classes "
                              f"{data.classes[:5]}..., the training folder {list(classes)[:5]}"
                              "...: they must be the same class folders")
        self.data, self.model, self.amp = data, model, amp

    @classmethod
    def for_run(cls, config: Config, model: nn.Module, amp: AmpConfig, device: torch.device,
                classes: list[str], progress: bool) -> Validation:
        data = build_data_path(validation_config(config), device, epochs=1, progress=progress)
        return cls(data, model, amp, classes)

    def __call__(self, model: nn.Module | None = None) -> dict[str, float]:
        """Loss, top-1 and top-5 of ``model`` (default: the model being trained; an EMA's
        network is given with the same uint8 input layer) over the validation images."""
        model = model if model is not None else self.model
        device = self.data.device
        correct1 = torch.zeros((), dtype=torch.int64, device=device)
        correct5 = torch.zeros((), dtype=torch.int64, device=device)
        loss = torch.zeros((), dtype=torch.float64, device=device)
        total = 0
        was_training = model.training
        model.eval()
        with torch.no_grad(), autocast(self.amp, device):
            for batch in self.data.device_batches():
                logits = model(batch["image"]).float()
                top = logits.topk(min(5, logits.shape[1]), dim=1).indices
                hit = top == batch["label"][:, None]
                correct1 += hit[:, 0].sum()
                correct5 += hit.any(dim=1).sum()
                loss += F.cross_entropy(logits, batch["label"], reduction="sum")
                total += batch.batch_size[0]
        model.train(was_training)
        n = max(total, 1)
        return {"top1": int(correct1) / n, "top5": int(correct5) / n, "loss": float(loss) / n}

    def close(self) -> None:
        self.data.close()
