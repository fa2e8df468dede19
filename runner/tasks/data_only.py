"""``model=none``: the data path alone (any ``task=``): batches loaded and moved, no model.

Its point is the data path's speed: a run of one process with no length asked
(``run.epochs``, ``run.steps``) is lengthened until its windows are long enough to time.
"""

from __future__ import annotations

from typing import Any

from tensordict import TensorDict

from runner.tasks.loop import Step
from runner.tasks.task import TaskBase


class DataOnlyTask(TaskBase):
    """The data path measured: no model, nothing written but the figures."""

    speed_asked = True
    extends = True

    def build(self, total_steps: int) -> Step:
        self.total_steps = total_steps
        self.step = self.make_step()
        return self.step

    @staticmethod
    def make_step(*args: Any, **kwargs: Any) -> DataOnlyStep:
        """No model: the batch loaded and moved, nothing else."""
        return DataOnlyStep()


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
