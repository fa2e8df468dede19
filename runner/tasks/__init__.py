"""``task=``: one module per task, each owning its life cycle (the ``Task`` protocol, task.py).

Each task is one module (or package) named after its ``task.name``, ``runner/tasks/<name>``, which
defines its registry record ``KIND``: its class (what it resumes from, how it makes its
step, what happens at an epoch's end, what it writes, what it adds to the figures),
beside its step. ``TASKS`` (a ``Registry``, runner/common/registry.py) maps every ``TaskName`` to
its class, found in its module: a new task is its enum value, its preset
``conf/task/<name>.yaml`` and its module. ``model=none`` is the data path alone whatever
the task (data_only.py); runner/job/run.py runs them all the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from runner.common.registry import Registry
from runner.config.schema import AmpConfig, Config, TaskConfig, TaskName, data_path_alone
from runner.tasks.data_only import DataOnlyStep, DataOnlyTask  # noqa: F401 (re-exported)
from runner.tasks.infer.inference import InferStep  # noqa: F401 (re-exported)
from runner.tasks.infer.outputs import Outputs, Reduce
from runner.tasks.loop import Step
from runner.tasks.task import RunContext, Task
from runner.tasks.train.training import TrainStep  # noqa: F401 (re-exported)

TASKS: Registry[type] = Registry.from_modules(__name__, TaskName, "task={}", type)


def task_for(ctx: RunContext) -> Task:
    """The run's task: ``task=``'s, or the data path alone under ``model=none``."""
    config: Config = ctx.config
    return DataOnlyTask(ctx) if data_path_alone(config) else TASKS[config.task.name](ctx)


def make_step(cfg: TaskConfig, models: dict[str, nn.Module], amp: AmpConfig,
              device: torch.device, total_steps: int,
              reducers: dict[str, Reduce] | None = None, outputs: Outputs | None = None,
              first_step: int = 0, steps_per_epoch: int = 1,
              global_batch: int | None = None) -> Step:
    """The step for ``task=`` alone (the verdict's probes, the selfcheck), as its record
    makes it (``make_step``: training takes the one model there is, inference every model
    of the pass, its outputs reduced by ``reducers`` and written by ``outputs``); no model:
    the data only."""
    task = TASKS[cfg.name] if models else DataOnlyTask
    return task.make_step(cfg, models, amp, device, total_steps, reducers, outputs,
                          first_step, steps_per_epoch, global_batch)
