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

from runner.config import TaskConfig
from runner.predictions import PredictionWriter


class Step(Protocol):
    def __call__(self, batch: TensorDict) -> None: ...
    def read(self) -> dict[str, float]: ...
    def close(self) -> dict[str, float]: ...


class TrainStep:
    """SGD with momentum on cross-entropy; the loss stays on the device until ``read``."""

    def __init__(self, model: nn.Module, cfg: TaskConfig):
        self.model = model.train()
        self.optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                         weight_decay=cfg.weight_decay)
        self._loss_sum: torch.Tensor | None = None
        self._count = 0
        self.first_loss: float | None = None
        self.last_loss: float | None = None

    def __call__(self, batch: TensorDict) -> None:
        loss = F.cross_entropy(self.model(batch["image"]), batch["label"])
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        loss = loss.detach()
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._count += 1

    def read(self) -> dict[str, float]:
        if not self._count:
            return {}
        loss = (self._loss_sum / self._count).item()
        self._loss_sum, self._count = None, 0
        if self.first_loss is None:
            self.first_loss = loss
        self.last_loss = loss
        return {"loss": loss}

    def close(self) -> dict[str, float]:
        self.read()
        return {"loss_first": self.first_loss, "loss_last": self.last_loss}


class InferStep:
    """Forward under inference_mode; softmax and top-k on the device, rows to the writer."""

    def __init__(self, model: nn.Module, cfg: TaskConfig, writer: PredictionWriter | None):
        self.model = model.eval()
        self.topk = cfg.topk
        self.writer = writer

    def __call__(self, batch: TensorDict) -> None:
        with torch.inference_mode():
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
