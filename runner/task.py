"""``task=``: what one step does with a device-resident batch (train, infer, or data only).

Each step object is called once per batch and never synchronizes; ``read()`` is called at
log points (where the loop has already synchronized) and returns the figures to log.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from runner.amp import autocast, grad_scaler
from runner.config import AmpConfig, AmpName, TaskConfig
from runner.predictions import PredictionWriter


class Step(Protocol):
    def __call__(self, batch: TensorDict) -> None: ...
    def read(self) -> dict[str, float]: ...
    def close(self) -> dict[str, float]: ...


class TrainStep:
    """SGD with momentum on cross-entropy; losses stay on the device until read.

    Args:
        model: the network (its first layer takes uint8).
        cfg: learning rate, momentum, weight decay.
        total_steps: the run's length; every step's loss is kept (one scalar each) so the
            figures compare the first and last tenth of the run, not single noisy steps.
    """

    def __init__(self, model: nn.Module, cfg: TaskConfig, total_steps: int,
                 amp: AmpConfig | None = None):
        self.model = model.train()
        self.optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                         weight_decay=cfg.weight_decay)
        device = next(model.parameters()).device
        amp = amp or AmpConfig(AmpName.off)
        self.autocast = lambda: autocast(amp, device)
        self.scaler = grad_scaler(amp, device)
        self.losses = torch.zeros(max(total_steps, 1), device=device)
        self.steps = 0
        self._read = 0  # losses before this index were already read

    def __call__(self, batch: TensorDict) -> None:
        with self.autocast():
            logits = self.model(batch["image"])
        loss = F.cross_entropy(logits.float(), batch["label"])
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.steps < len(self.losses):
            self.losses[self.steps] = loss.detach()  # stays on the device: no sync
        self.steps += 1

    def read(self) -> dict[str, float]:
        """Mean loss since the last read (a sync point: call only at log points)."""
        end = min(self.steps, len(self.losses))
        if end <= self._read:
            return {}
        loss = self.losses[self._read : end].mean().item()
        self._read = end
        return {"loss": loss}

    def close(self) -> dict[str, float]:
        n = min(self.steps, len(self.losses))
        if n == 0:
            return {}
        tenth = max(1, n // 10)
        return {"loss_first": self.losses[:tenth].mean().item(),
                "loss_last": self.losses[n - tenth : n].mean().item()}


class InferStep:
    """Forward under inference_mode; softmax and top-k on the device, rows to the writer."""

    def __init__(self, model: nn.Module, cfg: TaskConfig, writer: PredictionWriter | None,
                 amp: AmpConfig | None = None):
        self.model = model.eval()
        self.topk = cfg.topk
        self.writer = writer
        device = next(model.parameters()).device
        amp = amp or AmpConfig(AmpName.off)
        self.autocast = lambda: autocast(amp, device)

    def __call__(self, batch: TensorDict) -> None:
        with torch.inference_mode(), self.autocast():
            logits = self.model(batch["image"])
            probs = torch.softmax(logits.float(), dim=1)
            top = probs.topk(min(self.topk, probs.shape[1]), dim=1)
            if self.writer is not None:
                self.writer.submit(batch["index"], batch["label"], top.values, top.indices)

    def read(self) -> dict[str, float]:
        return {}

    def close(self) -> dict[str, float]:
        if self.writer is None:
            return {}
        return {"predictions": self.writer.close()}


class DataOnlyStep:
    """``model=none``: the batch is loaded and moved, nothing else; measures the data path."""

    def __call__(self, batch: TensorDict) -> None:
        pass

    def read(self) -> dict[str, float]:
        return {}

    def close(self) -> dict[str, float]:
        return {}
