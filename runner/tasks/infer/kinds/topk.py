"""``task.outputs=[topk]``: the top ``task.topk`` classes and probabilities per image, in
``predictions.csv`` (``predictions_<model>.csv`` with several models; its columns:
runner/tasks/infer/predictions.py), written as one part file per batch and joined when the run
completes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from runner.common.atomic import replacing
from runner.config.schema import Output, TaskConfig
from runner.tasks.infer.kinds.kind import OutputKind, WriterContext
from runner.tasks.infer.predictions import HEADER, csv_rows, join_csv


def reduce(logits: torch.Tensor, task: TaskConfig) -> dict[str, torch.Tensor]:
    probs = torch.softmax(logits.float(), dim=1)
    top = probs.topk(min(task.topk, probs.shape[1]), dim=1)
    return {"topk_probs": top.values, "topk_classes": top.indices}


class CsvWriter:
    """The top-k CSV: a part per step under ``.<csv stem>.parts``, joined in step order."""

    def __init__(self, ctx: WriterContext, shapes: dict[str, tuple[tuple[int, ...], Any]]):
        self.ctx = ctx
        self.arrays: dict[str, np.memmap] = {}
        self.csv = Path(ctx.run_dir) / ctx.csv_name
        self.parts = Path(ctx.run_dir) / f".{self.csv.stem}.parts"
        self.parts.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, index: np.ndarray, label: np.ndarray,
              kept: dict[str, np.ndarray]) -> None:
        part = self.parts / f"{step:08d}.csv"
        with replacing(part) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
            csv_rows(f, index.tolist(), label.tolist(), kept["topk_probs"].tolist(),
                     kept["topk_classes"].tolist(), self.ctx.names, self._name,
                     self._dataset_name)

    def _name(self, k: int) -> str:
        classes = self.ctx.classes
        return classes[k] if 0 <= k < len(classes) else str(k)

    def _dataset_name(self, k: int) -> str:
        classes = self.ctx.dataset_classes
        return classes[k] if 0 <= k < len(classes) else ""

    def flush(self) -> None:
        pass

    def finish(self, steps: int) -> None:
        """The run is complete: join the parts of every step, in order (the parts stay
        until the run's state says it is done)."""
        parts = [self.parts / f"{k:08d}.csv" for k in range(steps)]
        join_csv(self.csv, [p for p in parts if p.exists()], header=HEADER)

    def files(self, complete: bool) -> list[str]:
        return [str(self.csv)]


KIND = OutputKind(Output.topk, ("topk_probs", "topk_classes"), reduce, CsvWriter,
                  settings=("task.topk",), parts=(".predictions*.parts",),
                  files="predictions.csv: the top task.topk classes and probabilities")
