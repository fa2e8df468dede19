"""``task.outputs=[embeddings]``: the classifier's input (or ``task.embed_layer``'s output,
feature maps averaged over their height and width), ``<model>.embeddings.npy``."""

from __future__ import annotations

import torch

from runner.config.schema import Output, TaskConfig
from runner.tasks.infer.kinds.kind import FEATURES, OutputKind, RowsWriter


def reduce(features: torch.Tensor, task: TaskConfig) -> dict[str, torch.Tensor]:
    if features.dim() == 4:  # a feature map: its average over the image
        features = features.mean(dim=(2, 3))
    return {"embeddings": features.flatten(1).float()}


KIND = OutputKind(Output.embeddings, ("embeddings",), reduce, RowsWriter, needs=FEATURES,
                  settings=("task.embed_layer",),
                  dense=None, files="<model>.embeddings.npy: float32, N x features")
