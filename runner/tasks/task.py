"""The ``Task`` protocol: what a ``task=`` owns of a run, and the ``RunContext`` it sees.

runner/job/run.py drives every task the same way, in this order: ``resume`` (what it goes on
from, before the data path: the batch order goes on where it stopped), ``prepare`` (its
checks of the data), ``build`` (models and step), ``start`` (after the per-rank seed),
then the loop with ``on_step`` and ``on_epoch_end``, then ``figures``, ``write`` and
``close``. ``TaskBase`` holds what the tasks share (the resumed state, the models, the
data's fingerprint); each task overrides the parts of the life cycle it owns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from runner.config.schema import AmpConfig, Config, TaskConfig
from runner.data import DataPath
from runner.launch.distributed import Ranks
from runner.measure.clock import StepClock
from runner.measure.metrics import MetricLogger, NullLogger
from runner.model.compile import RunModels
from runner.tasks import checkpoint
from runner.tasks.loop import Step


@dataclass
class RunContext:
    """What a task sees of its run; runner/job/run.py fills in ``data``, ``logger`` and
    ``clock`` as they are made."""

    config: Config
    run_dir: Path  # rank 0's folder, on every rank
    ranks: Ranks
    device: torch.device
    logger: MetricLogger = field(default_factory=NullLogger)
    data: DataPath | None = None
    clock: StepClock | None = None  # the loop's: its paused() keeps a write out of the timing


class Task(Protocol):
    """One ``task=``'s life cycle (runner/job/run.py calls it in the order the module says)."""

    resumed: dict[str, Any] | None  # the state it goes on from (its ``source`` included)
    models: dict[str, nn.Module]  # name -> model, compiled (none: the data path alone)
    speed_asked: bool  # its point is a speed figure (short windows are warned about)
    extends: bool  # a one-process run may be lengthened until its windows are long enough

    @property
    def start_step(self) -> int: ...
    def resume(self) -> dict[str, Any] | None: ...
    def prepare(self, data: DataPath) -> None: ...
    def finished_before(self) -> None: ...
    def build(self, total_steps: int) -> Step: ...
    @staticmethod
    def make_step(cfg: TaskConfig, models: dict[str, nn.Module], amp: AmpConfig,
                  device: torch.device, total_steps: int, reducers: Any = None,
                  outputs: Any = None, first_step: int = 0, steps_per_epoch: int = 1,
                  global_batch: int | None = None) -> Step:
        """Its step over ``models`` alone, outside a run (``build`` makes the run's)."""
        ...
    def start(self) -> None: ...
    def on_step(self) -> Callable[[int], None] | None: ...
    def on_epoch_end(self, epochs: int) -> None: ...
    def figures(self, complete: bool) -> dict[str, Any]: ...
    def rank_digest(self) -> str | None: ...
    def write(self, steps_done: int, complete: bool,
              figures: dict[str, Any]) -> dict[str, Any]: ...
    def close(self) -> None: ...


class TaskBase:
    """What every task shares: the resumed state, the models and step, the data's
    fingerprint (what checkpoints and inference states are checked against)."""

    speed_asked: ClassVar[bool] = False
    extends: ClassVar[bool] = False
    fingerprint_always: ClassVar[bool] = False  # the data's fingerprint, resumed or not

    def __init__(self, ctx: RunContext):
        self.ctx, self.config = ctx, ctx.config
        self.resumed: dict[str, Any] | None = None
        self.models: dict[str, nn.Module] = {}
        self.built: RunModels = RunModels({})
        self.step: Step | None = None
        self.data_print: dict[str, Any] | None = None  # the data's fingerprint
        self.total_steps = 0  # this run's steps (a resumed run's: what was left)

    @property
    def start_step(self) -> int:
        """Steps of the plan done before this run (a resume)."""
        return int(self.resumed["steps"]) if self.resumed is not None else 0

    def resume(self) -> dict[str, Any] | None:
        """The checkpoint ``resume=`` names (none: a fresh start)."""
        self.resumed = checkpoint.resumed(self.config, self.ctx.run_dir)
        return self.resumed

    def prepare(self, data: DataPath) -> None:
        """The data's fingerprint where something is checked against it; a resumed state
        made on other files is refused."""
        if self.resumed is not None or self.config.task.checkpoint or self.fingerprint_always:
            self.data_print = checkpoint.data_fingerprint(data.storage)
        if self.resumed is not None:  # the same files, in the same order, or refused
            checkpoint.check_data(self.resumed, data.storage, self.resumed["source"])

    def finished_before(self) -> None:
        """The plan's steps were all done by the part that ran before: tidy what it left."""

    def start(self) -> None:
        """The loop starts next (after the per-rank seed)."""

    def on_step(self) -> Callable[[int], None] | None:
        return None

    def on_epoch_end(self, epochs: int) -> None:
        pass

    def figures(self, complete: bool) -> dict[str, Any]:
        """The step's figures (closed: ``complete`` when every step of the plan ran) and
        the models' compile figures."""
        closed = self.step.close(complete=complete) if self.step is not None else {}
        return {**self.built.figures(), **{k: v for k, v in closed.items() if v is not None}}

    def rank_digest(self) -> str | None:
        """What the ranks' replicas must agree on (none: nothing)."""
        return None

    def write(self, steps_done: int, complete: bool, figures: dict[str, Any]) -> dict[str, Any]:
        """What the task leaves in the run folder at the end (or where a signal stopped it);
        the figures that say where."""
        return {}

    def close(self) -> None:
        pass
