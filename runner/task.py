"""``task=``: what one step does with a device-resident batch (train, infer, or data only).

Each step object is called once per batch and never synchronizes; ``read()`` is called at
log points (where the loop has already synchronized) and returns the figures to log.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from runner.amp import autocast, grad_scaler
from runner.config import (
    AmpConfig,
    AmpName,
    Config,
    Crop,
    PageCache,
    PrefetchConfig,
    PrefetchName,
    StorageName,
    TaskConfig,
    TaskName,
)
from runner.data import DataPath, build_data_path
from runner.errors import ConfigError
from runner.metrics import DeviceClock
from runner.outputs import Outputs, Reduce

MAX_PENDING_EVENTS = 256  # recorded CUDA event pairs kept before completed ones are folded


class Step(Protocol):
    def __call__(self, batch: TensorDict) -> None: ...
    def read(self) -> dict[str, float]: ...
    def close(self, complete: bool = True) -> dict[str, float]: ...
    def start_timing(self) -> None: ...  # warm-up is over: figures count from here


def optimizer_options(device: torch.device) -> dict[str, Any]:
    """SGD's implementation for the device: the fused kernel on CUDA, one launch for every
    parameter, and the path on which a GradScaler's step needs no ``.item()`` sync (the
    scaler hands the fused kernel its inf check on the device)."""
    return {"fused": True} if device.type == "cuda" else {}


def build_optimizer(model: nn.Module, cfg: TaskConfig, options: dict[str, Any]
                    ) -> torch.optim.SGD:
    """SGD with momentum for ``model``, its momentum buffers at zero (``zero_momentum``)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                weight_decay=cfg.weight_decay, **options)
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


class TrainStep:
    """SGD with momentum on cross-entropy; losses stay on the device until read.

    Args:
        model: the network (its first layer takes uint8).
        cfg: learning rate, momentum, weight decay.
        total_steps: the run's length; every step's loss is kept (one scalar each) so the
            figures compare the first and last tenth of the run, not single noisy steps.
        amp: autocast dtype (a GradScaler for fp16).
        device: the model's device.
    """

    def __init__(self, model: nn.Module, cfg: TaskConfig, total_steps: int,
                 amp: AmpConfig | None = None, device: torch.device | None = None):
        self.model = model.train()
        device = device or next(model.parameters()).device
        self.optimizer = build_optimizer(model, cfg, optimizer_options(device))
        amp = amp or AmpConfig(AmpName.off)
        self.autocast = lambda: autocast(amp, device)
        self.scaler = grad_scaler(amp, device)
        self.losses = torch.zeros(max(total_steps, 1), device=device)
        self.steps = 0
        self._read = 0  # losses before this index were already read

    def __call__(self, batch: TensorDict) -> None:
        with self.autocast():
            logits = self.model(batch["image"])
        if "valid" in batch.keys():  # padding rows of a distributed shard weigh nothing
            valid = batch["valid"].float()
            losses = F.cross_entropy(logits.float(), batch["label"], reduction="none")
            loss = (losses * valid).sum() / valid.sum().clamp(min=1.0)
        else:
            loss = F.cross_entropy(logits.float(), batch["label"])
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.steps < len(self.losses):
            self.losses[self.steps] = loss.detach()  # stays on the device: no sync
        self.steps += 1

    def start_timing(self) -> None:
        pass

    def read(self) -> dict[str, float]:
        """Mean loss since the last read (a sync point: call only at log points)."""
        end = min(self.steps, len(self.losses))
        if end <= self._read:
            return {}
        loss = self.losses[self._read : end].mean().item()
        self._read = end
        return {"loss": loss}

    def close(self, complete: bool = True) -> dict[str, float]:
        n = min(self.steps, len(self.losses))
        if n == 0:
            return {}
        tenth = max(1, n // 10)
        return {"loss_first": self.losses[:tenth].mean().item(),
                "loss_last": self.losses[n - tenth : n].mean().item()}


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
        self.reducers = reducers if reducers is not None else {
            name: Reduce(cfg, None) for name in models}
        self.outputs = outputs
        self.device = device or torch.device("cpu")
        amp = amp or AmpConfig(AmpName.off)
        self.autocast = lambda: autocast(amp, self.device)
        self.clock = DeviceClock(self.device)
        self._spans: dict[str, list] = {name: [] for name in models}
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
                self._spans[name].append((start, self.clock.now()))
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
              first_step: int = 0) -> Step:
    """The step for ``task=``: training takes the one model there is, inference every
    model of the pass (its outputs reduced by ``reducers``, written by ``outputs``), no
    model the data only."""
    if not models:
        return DataOnlyStep()
    if cfg.name is TaskName.train:
        (model,) = models.values()
        return TrainStep(model, cfg, total_steps, amp, device)
    return InferStep(models, cfg, reducers, outputs, amp, device, first_step)


def validation_config(config: Config) -> Config:
    """The data path of ``dataset.val_path``: the folder decoded with the run's decoder,
    center crops, in order, every image once, from a warm page cache."""
    dataset = dataclasses.replace(config.dataset, path=config.dataset.val_path, crop=Crop.center,
                                  page_cache=PageCache.warm)
    loader = dataclasses.replace(config.loader, name=StorageName.folder, shuffle=False,
                                 drop_last=False)
    return dataclasses.replace(config, dataset=dataset, loader=loader,
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

    def __call__(self) -> float:
        correct = torch.zeros((), dtype=torch.int64, device=self.data.device)
        total = 0
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad(), autocast(self.amp, self.data.device):
            for batch in self.data.device_batches():
                pred = self.model(batch["image"]).argmax(dim=1)
                correct += (pred == batch["label"]).sum()
                total += batch.batch_size[0]
        self.model.train(was_training)
        return int(correct) / max(total, 1)

    def close(self) -> None:
        self.data.close()
