"""``task.outputs=[logits]``: each image's logits as float32, ``<model>.logits.npy``."""

from __future__ import annotations

import torch

from runner.config.schema import Output, TaskConfig
from runner.tasks.infer.kinds.kind import OutputKind, RowsWriter


def reduce(logits: torch.Tensor, task: TaskConfig) -> dict[str, torch.Tensor]:
    return {"logits": logits.float()}


KIND = OutputKind(Output.logits, ("logits",), reduce, RowsWriter,
                  files="<model>.logits.npy: float32, N x classes, in dataset order")
