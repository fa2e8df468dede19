"""``task=train``'s optimizer, learning-rate schedule and EMA, from torch.optim.

- **optimizer** (``task.optimizer``): SGD with momentum (``task.nesterov``) or AdamW
  (``task.betas``, ``task.eps``); the fused kernel on CUDA (one launch for every parameter,
  and a GradScaler step without a sync), torch's default elsewhere. Normalization layers'
  weights and every bias get no weight decay unless ``task.decay_norm_and_bias=true`` (the
  usual practice: decaying them only hurts). ``task.scale_lr=true`` sets the learning rate
  to ``task.lr * global batch / 256`` (Goyal et al., 2017), said in the log.
- **schedule** (``task.schedule``): constant, cosine (to ``task.min_lr``), step (times
  ``task.step_gamma`` every ``task.step_epochs``), or one-cycle, after a linear warm-up of
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
GradScaler unscales) and label smoothing live in runner/tasks/train.py's TrainStep.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

import torch
from torch import nn

from runner.config import OptimizerName, ScheduleName, TaskConfig

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


def build_optimizer(model: nn.Module, cfg: TaskConfig, device: torch.device,
                    lr: float | None = None, options: dict[str, Any] | None = None
                    ) -> torch.optim.Optimizer:
    """``task.optimizer`` over ``model``'s parameter groups; ``options``: the
    implementation (default: the device's, ``optimizer_options``)."""
    groups = param_groups(model, cfg.weight_decay, cfg.decay_norm_and_bias)
    options = optimizer_options(device) if options is None else options
    lr = cfg.lr if lr is None else lr
    if cfg.optimizer is OptimizerName.adamw:
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(cfg.betas), eps=cfg.eps, **options)
    optimizer = torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                                **options)
    zero_momentum(optimizer)
    return optimizer


def zero_momentum(optimizer: torch.optim.SGD) -> None:
    """Momentum buffers that start at zero, before the first step.

    Fused SGD makes them with ``empty_like`` on its first step and fills them inside the
    kernel, which returns at once when the GradScaler found an overflow: a first step that
    overflows (common at the scaler's initial scale) would leave garbage that the second
    step reads, and the weights would turn to NaN. Starting from zeros is exactly the first
    step's ``buf = grad`` when dampening is 0 (``buf = momentum * 0 + grad``), so nothing
    else changes.
    """
    for group in optimizer.param_groups:
        if group["momentum"] == 0:
            continue
        if group["dampening"] != 0:
            raise ValueError("zero_momentum is exact only with dampening=0")
        for p in group["params"]:
            optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)


def warmup_updates(cfg: TaskConfig, updates_per_epoch: int) -> int:
    return int(cfg.warmup_steps or round(cfg.warmup_epochs * updates_per_epoch))


def build_schedule(optimizer: torch.optim.Optimizer, cfg: TaskConfig, total_updates: int,
                   updates_per_epoch: int) -> torch.optim.lr_scheduler.LRScheduler:
    """The learning rate per optimizer step over ``total_updates`` of them."""
    sched = torch.optim.lr_scheduler
    total = max(int(total_updates), 1)
    warmup = min(warmup_updates(cfg, max(updates_per_epoch, 1)), total - 1)
    if cfg.schedule is ScheduleName.onecycle and total >= 4:
        # its own warm-up: the first 30%, or the warm-up asked (two steps at least: a
        # one-step phase divides by zero inside OneCycleLR)
        return sched.OneCycleLR(optimizer, max_lr=[g["lr"] for g in optimizer.param_groups],
                                total_steps=total, pct_start=(max(warmup, 2) / total)
                                if warmup else 0.3,
                                cycle_momentum=cfg.optimizer is OptimizerName.sgd
                                and cfg.momentum > 0)
    if cfg.schedule is ScheduleName.cosine:
        main = sched.CosineAnnealingLR(optimizer, T_max=max(total - warmup, 1),
                                       eta_min=cfg.min_lr)
    elif cfg.schedule is ScheduleName.step:
        main = sched.StepLR(optimizer, step_size=max(1, round(cfg.step_epochs *
                                                              updates_per_epoch)),
                            gamma=cfg.step_gamma)
    else:
        main = sched.LambdaLR(optimizer, lambda step: 1.0)
    if warmup <= 0:
        return main
    ramp = sched.LinearLR(optimizer, start_factor=1.0 / (warmup + 1), end_factor=1.0,
                          total_iters=warmup)
    return sched.SequentialLR(optimizer, [ramp, main], milestones=[warmup])


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
