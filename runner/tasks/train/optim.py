"""``task=train``'s optimizer, learning-rate schedule and EMA, from torch.optim.

- **optimizer** (``task.optimizer``): one ``OptimizerKind`` record per ``OptimizerName`` in
  ``OPTIMIZERS`` (its torch.optim class, the ``task.*`` keys it reads and hands the class
  under the same names, whether one-cycle cycles its momentum, the state it starts from):
  SGD with momentum (``task.nesterov``) or AdamW (``task.betas``, ``task.eps``); the fused
  kernel on CUDA (one launch for every parameter, and a GradScaler step without a sync),
  torch's default elsewhere. Normalization layers' weights and every bias get no weight
  decay unless ``task.decay_norm_and_bias=true`` (the usual practice: decaying them only
  hurts). ``task.scale_lr=true`` sets the learning rate to ``task.lr * global batch / 256``
  (Goyal et al., 2017), said in the log. A new optimizer is its enum value and one record.
- **schedule** (``task.schedule``): one ``ScheduleKind`` record per ``ScheduleName`` in
  ``SCHEDULES``: constant, cosine (to ``task.min_lr``), step (times ``task.step_gamma``
  every ``task.step_epochs``), or one-cycle (its own warm-up), after a linear warm-up of
  ``task.warmup_steps`` optimizer steps (or ``task.warmup_epochs``' worth), stepped once per
  optimizer step over the whole plan (``run.epochs`` or ``run.steps``, a resumed run's
  steps included): torch.optim.lr_scheduler's, chained with SequentialLR.
- **EMA** (``task.ema_decay``): an averaged copy of the network (``Ema.model.module``: its
  parameters and buffers), updated on the device after each optimizer step by foreach
  kernels, one per dtype (floating tensors lerped toward the network's, integer buffers
  such as batch norm's count copied), with a decay warmed up as
  ``min(decay, (1 + n) / (10 + n))`` (n: updates so far, counted on the host; the first
  update copies), as timm's ModelEmaV2 and TF's ExponentialMovingAverage do. Not
  torch.optim.swa_utils.AveragedModel: built without ``device``, it keeps its update count
  ``n_averaged`` as a CPU buffer that every update compares and copies to the network's
  device, a blocking copy per optimizer step on CUDA. An update here reads nothing back
  and makes no tensor: the decay is a host float handed to the kernel.

Gradient accumulation (``task.accumulate``), clipping (``task.clip_grad_norm``, after the
GradScaler unscales) and label smoothing live in runner/tasks/train/training.py's TrainStep.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import nn

from runner.common.registry import Registry
from runner.config.schema import OptimizerName, ScheduleName, TaskConfig

log = logging.getLogger(__name__)

NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm,
         nn.modules.normalization.RMSNorm)


def optimizer_options(device: torch.device) -> dict[str, Any]:
    """The optimizer's implementation for the device: the fused kernel on CUDA, one launch
    for every parameter, and the path on which a GradScaler's step needs no ``.item()``
    sync (the scaler hands the fused kernel its inf check on the device)."""
    return {"fused": True} if device.type == "cuda" else {}


def param_groups(model: nn.Module, weight_decay: float, decay_all: bool) -> list[dict]:
    """The parameters with weight decay, and (unless ``decay_all``) the normalization
    weights and biases without."""
    decay, plain, seen = [], [], set()
    for module in model.modules():
        for _, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            (plain if not decay_all and (isinstance(module, NORMS) or p.ndim <= 1)
             else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if plain:
        groups.append({"params": plain, "weight_decay": 0.0})
    return groups


def learning_rate(cfg: TaskConfig, global_batch: int | None) -> float:
    """``task.lr``, scaled by the global batch over 256 with ``task.scale_lr``."""
    if not cfg.scale_lr or not global_batch:
        return cfg.lr
    lr = cfg.lr * global_batch / 256
    log.info("task.scale_lr: learning rate %.4g = task.lr %.4g x global batch %d / 256", lr,
             cfg.lr, global_batch)
    return lr


def fill_momentum(optimizer: torch.optim.Optimizer) -> None:
    """Momentum buffers that start at zero, before the first step (a resumed checkpoint's
    are kept; one trained without momentum has none: zeros, as a fresh run's).

    Fused SGD makes them with ``empty_like`` on its first step and fills them inside the
    kernel, which returns at once when the GradScaler found an overflow: a first step that
    overflows (common at the scaler's initial scale) would leave garbage that the second
    step reads, and the weights would turn to NaN. Starting from zeros is exactly the first
    step's ``buf = grad`` when dampening is 0 (``buf = momentum * 0 + grad``), so nothing
    else changes.
    """
    for group in optimizer.param_groups:
        if not group.get("momentum"):
            continue
        if group.get("dampening", 0) != 0:
            raise ValueError("fill_momentum is exact only with dampening=0")
        for p in group["params"]:
            if optimizer.state[p].get("momentum_buffer") is None:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)


def _never(cfg: TaskConfig) -> bool:
    return False


def _nothing(optimizer: torch.optim.Optimizer) -> None:
    return None


@dataclass(frozen=True)
class OptimizerKind:
    """What the runner knows of one ``task.optimizer``.

    Args:
        name: its ``task.optimizer`` value.
        make: the torch.optim class (or a function of the same call): ``make(param_groups,
            lr=..., **hyperparameters, **implementation options)``.
        keys: the ``task.*`` keys it reads beyond ``lr`` and ``weight_decay``, each handed
            to ``make`` (and set again on its parameter groups by a resume) under its own
            name (a list becomes a tuple: ``betas``).
        cycles_momentum: whether ``task.schedule=onecycle`` cycles its momentum (or betas).
        prepare: the state it starts from, before the first step (and after a checkpoint's
            is loaded).
    """

    name: Enum
    make: Callable[..., torch.optim.Optimizer]
    keys: tuple[str, ...] = ()
    cycles_momentum: Callable[[TaskConfig], bool] = _never
    prepare: Callable[[torch.optim.Optimizer], None] = _nothing

    def hyperparameters(self, cfg: TaskConfig) -> dict[str, Any]:
        """``task.<key>`` of each of its keys, as its parameter groups hold them."""
        values = {key: getattr(cfg, key) for key in self.keys}
        return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}


SGD = OptimizerKind(OptimizerName.sgd, torch.optim.SGD, keys=("momentum", "nesterov"),
                    cycles_momentum=lambda cfg: cfg.momentum > 0, prepare=fill_momentum)
ADAMW = OptimizerKind(OptimizerName.adamw, torch.optim.AdamW, keys=("betas", "eps"))
OPTIMIZERS: Registry[OptimizerKind] = Registry(OptimizerName, "task.optimizer={}", (SGD, ADAMW))


def build_optimizer(model: nn.Module, cfg: TaskConfig, device: torch.device,
                    lr: float | None = None, options: dict[str, Any] | None = None
                    ) -> torch.optim.Optimizer:
    """``task.optimizer`` (its record in ``OPTIMIZERS``) over ``model``'s parameter groups;
    ``options``: the implementation (default: the device's, ``optimizer_options``)."""
    kind = OPTIMIZERS[cfg.optimizer]
    groups = param_groups(model, cfg.weight_decay, cfg.decay_norm_and_bias)
    options = optimizer_options(device) if options is None else options
    lr = cfg.lr if lr is None else lr
    optimizer = kind.make(groups, lr=lr, **kind.hyperparameters(cfg), **options)
    kind.prepare(optimizer)
    return optimizer


def warmup_updates(cfg: TaskConfig, updates_per_epoch: int) -> int:
    return int(cfg.warmup_steps or round(cfg.warmup_epochs * updates_per_epoch))


@dataclass(frozen=True)
class Span:
    """What a schedule spans: ``total`` optimizer steps (>= 1), the first ``warmup`` of
    them a linear warm-up (< total), ``per_epoch`` of them an epoch."""

    total: int
    warmup: int
    per_epoch: int


Scheduler = torch.optim.lr_scheduler.LRScheduler


@dataclass(frozen=True)
class ScheduleKind:
    """What the runner knows of one ``task.schedule``.

    Args:
        name: its ``task.schedule`` value.
        build: ``build(optimizer, cfg, span)``: the schedule after the warm-up (or the
            whole schedule, with ``own_warmup``).
        keys: the ``task.*`` keys it reads (beyond ``lr`` and the warm-up's).
        own_warmup: it makes its own warm-up from ``span.warmup``: nothing is chained
            before it.
    """

    name: Enum
    build: Callable[[torch.optim.Optimizer, TaskConfig, Span], Scheduler]
    keys: tuple[str, ...] = ()
    own_warmup: bool = False


def after_warmup(optimizer: torch.optim.Optimizer, main: Scheduler, warmup: int) -> Scheduler:
    """``main`` after a linear ramp of ``warmup`` optimizer steps from lr/(warmup + 1)."""
    if warmup <= 0:
        return main
    sched = torch.optim.lr_scheduler
    ramp = sched.LinearLR(optimizer, start_factor=1.0 / (warmup + 1), end_factor=1.0,
                          total_iters=warmup)
    return sched.SequentialLR(optimizer, [ramp, main], milestones=[warmup])


def _constant(optimizer: torch.optim.Optimizer, cfg: TaskConfig, span: Span) -> Scheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def _cosine(optimizer: torch.optim.Optimizer, cfg: TaskConfig, span: Span) -> Scheduler:
    return torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=max(span.total - span.warmup, 1), eta_min=cfg.min_lr)


def _step(optimizer: torch.optim.Optimizer, cfg: TaskConfig, span: Span) -> Scheduler:
    return torch.optim.lr_scheduler.StepLR(
        optimizer, step_size=max(1, round(cfg.step_epochs * span.per_epoch)),
        gamma=cfg.step_gamma)


def _onecycle(optimizer: torch.optim.Optimizer, cfg: TaskConfig, span: Span) -> Scheduler:
    if span.total < 4:  # too short to cycle: constant after the warm-up
        return after_warmup(optimizer, _constant(optimizer, cfg, span), span.warmup)
    # its own warm-up: the first 30%, or the warm-up asked (two steps at least: a one-step
    # phase divides by zero inside OneCycleLR)
    return torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=[g["lr"] for g in optimizer.param_groups], total_steps=span.total,
        pct_start=(max(span.warmup, 2) / span.total) if span.warmup else 0.3,
        cycle_momentum=OPTIMIZERS[cfg.optimizer].cycles_momentum(cfg))


SCHEDULES: Registry[ScheduleKind] = Registry(ScheduleName, "task.schedule={}", (
    ScheduleKind(ScheduleName.constant, _constant),
    ScheduleKind(ScheduleName.cosine, _cosine, keys=("min_lr",)),
    ScheduleKind(ScheduleName.step, _step, keys=("step_epochs", "step_gamma")),
    ScheduleKind(ScheduleName.onecycle, _onecycle, own_warmup=True),
))


def build_schedule(optimizer: torch.optim.Optimizer, cfg: TaskConfig, total_updates: int,
                   updates_per_epoch: int) -> Scheduler:
    """The learning rate per optimizer step over ``total_updates`` of them: ``task.schedule``
    (its record in ``SCHEDULES``) after the warm-up."""
    kind = SCHEDULES[cfg.schedule]
    total = max(int(total_updates), 1)
    span = Span(total, min(warmup_updates(cfg, max(updates_per_epoch, 1)), total - 1),
                updates_per_epoch)
    main = kind.build(optimizer, cfg, span)
    return main if kind.own_warmup else after_warmup(optimizer, main, span.warmup)


class AveragedNetwork(nn.Module):
    """The EMA's averaged copy of a network (``module``), called like it; its state_dict's
    keys are ``module.<name>``, as AveragedModel's were (without ``n_averaged``)."""

    def __init__(self, network: nn.Module):
        super().__init__()
        self.module = copy.deepcopy(network)
        for p in self.module.parameters():
            p.requires_grad_(False)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def averaged_tensors(module: nn.Module) -> list[torch.Tensor]:
    """What an EMA averages, in a fixed order: every parameter, then every buffer."""
    return [*module.parameters(), *module.buffers()]


class Ema:
    """An exponential moving average of a network's weights and buffers (``model``, an
    ``AveragedNetwork``), its decay warmed up from 0 by a host-side count of its updates.

    An update is one foreach kernel per device and dtype, whatever the number of tensors:
    nothing is read back from the device, moved to it or created on the host.
    """

    def __init__(self, network: nn.Module, decay: float):
        self.decay, self.updates = decay, 0
        self.model = AveragedNetwork(network)

    def current_decay(self) -> float:
        n = self.updates
        return min(self.decay, (1 + n) / (10 + n))

    @torch.no_grad()
    def update(self, network: nn.Module) -> None:
        """Average ``network``'s current parameters and buffers in (the first update copies
        them); the decay is a host float, so nothing syncs."""
        ema, current = averaged_tensors(self.model.module), averaged_tensors(network)
        if len(current) != len(ema):
            raise ValueError(f"the EMA averages {len(ema)} tensors, the network has "
                             f"{len(current)}: not the network it was made from")
        groups: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = {}
        for e, c in zip(ema, current):
            mine, theirs = groups.setdefault((e.device, e.dtype), ([], []))
            mine.append(e)
            theirs.append(c)
        weight = 1.0 - self.current_decay()
        for (_, dtype), (mine, theirs) in groups.items():
            if self.updates > 0 and (dtype.is_floating_point or dtype.is_complex):
                torch._foreach_lerp_(mine, theirs, weight)
            else:  # the first update, or a count (not a weight): copied
                torch._foreach_copy_(mine, theirs)
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This EMA's state, or an older runner's (AveragedModel's: ``module.<name>`` keys
        and an ``n_averaged`` count, which ``updates`` repeats)."""
        saved = dict(state["model"])
        saved.pop("n_averaged", None)
        self.model.load_state_dict(saved)
        self.updates = int(state["updates"])


def updates_in(steps: int, accumulate: int) -> int:
    """Optimizer steps in ``steps`` batches (the last, partial accumulation steps too)."""
    return math.ceil(steps / max(accumulate, 1))
