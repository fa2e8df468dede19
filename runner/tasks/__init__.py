"""``task=``: one module per task, each owning its life cycle (the ``Task`` protocol, base.py).

Each task is one module named after its ``task.name``, ``runner/tasks/<name>.py``, which
defines ``TASK`` (its class: what it resumes from, its step, what happens at an epoch's
end, what it writes, what it adds to the figures) beside its step. ``TASKS`` maps every
``TaskName`` to its class, found in its module: a new task is its enum value, its preset
``conf/task/<name>.yaml`` and its module. ``model=none`` is the data path alone whatever
the task (data_only.py); runner/job/run.py runs them all the same way.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from runner.config.schema import AmpConfig, Config, TaskConfig, TaskName, data_path_alone
from runner.tasks.data_only import DataOnlyStep, DataOnlyTask
from runner.tasks.infer.inference import InferStep
from runner.tasks.infer.outputs import Outputs, Reduce
from runner.tasks.loop import Step
from runner.tasks.task import RunContext, Task
from runner.tasks.train.training import TrainStep


def _registry() -> dict[TaskName, type]:
    """Every task's class, from its own module."""
    tasks = {}
    for name in TaskName:
        task = getattr(importlib.import_module(f"{__name__}.{name.value}"), "TASK", None)
        if getattr(task, "name", None) is not name:
            raise ImportError(f"runner/tasks/{name.value}.py must define TASK, the class of "
                              f"task={name.value}")
        tasks[name] = task
    return tasks


TASKS: dict[TaskName, type] = _registry()


def task_for(ctx: RunContext) -> Task:
    """The run's task: ``task=``'s, or the data path alone under ``model=none``."""
    config: Config = ctx.config
    return DataOnlyTask(ctx) if data_path_alone(config) else TASKS[config.task.name](ctx)


def make_step(cfg: TaskConfig, models: dict[str, nn.Module], amp: AmpConfig,
              device: torch.device, total_steps: int,
              reducers: dict[str, Reduce] | None = None, outputs: Outputs | None = None,
              first_step: int = 0, steps_per_epoch: int = 1,
              global_batch: int | None = None) -> Step:
    """The step for ``task=`` alone (the verdict's probes, the selfcheck): training takes
    the one model there is, inference every model of the pass (its outputs reduced by
    ``reducers``, written by ``outputs``), no model the data only."""
    if not models:
        return DataOnlyStep()
    if cfg.name is TaskName.train:
        (model,) = models.values()
        return TrainStep(model, cfg, total_steps, amp, device, first_step + total_steps,
                         steps_per_epoch, global_batch, first_step)
    return InferStep(models, cfg, reducers, outputs, amp, device, first_step)
