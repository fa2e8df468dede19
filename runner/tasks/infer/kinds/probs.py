"""``task.outputs=[probs]``: the softmax of each image's logits, ``<model>.probs.npy``."""

from __future__ import annotations

import torch

from runner.config.schema import Output, TaskConfig
from runner.tasks.infer.kinds.kind import OutputKind, RowsWriter


def reduce(logits: torch.Tensor, task: TaskConfig) -> dict[str, torch.Tensor]:
    return {"probs": torch.softmax(logits.float(), dim=1)}


KIND = OutputKind(Output.probs, ("probs",), reduce, RowsWriter,
                  files="<model>.probs.npy: float32, N x classes, in dataset order")
