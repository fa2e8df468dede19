"""A run's plan: how many steps it takes (a resumed run: those left), how many warm up, and
whether a data-only run may be lengthened until its windows are long enough to time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from runner.config.schema import Config
from runner.data import DataPath
from runner.launch.distributed import Ranks
from runner.tasks import Task, checkpoint

log = logging.getLogger("runner")


@dataclass
class Plan:
    total_steps: int  # this run's steps (a resumed run's: what was left)
    warmup_steps: int  # of those, the untimed first ones
    extend: bool  # the loop may go on past total_steps until its windows are long enough


def plan_run(config: Config, task: Task, data: DataPath, ranks: Ranks, overrides: list[str],
             sweep: bool) -> Plan:
    """The plan of ``run.steps`` (or ``run.epochs`` of the data path), less the steps a
    resumed ``task`` did; a warm-up that leaves no timed step is shortened (said aloud when
    the run's point is its speed)."""
    run = config.run
    total = run.steps if run.steps is not None else run.epochs * data.steps_per_epoch
    if task.resumed is not None:  # the plan is the whole run's: do what is left
        total = checkpoint.steps_left(total, task.start_step, config.resume)
    warmup = run.warmup_steps
    if warmup >= total:
        warmup = max(total - 1, 0)
        # a short job whose point is its outputs (predictions of 100 images, a few
        # epochs) need not hear it: its flags say "few timed steps" in metrics.json
        (log.warning if speed_asked(task, overrides, sweep) else log.debug)(
            "run.warmup_steps=%d leaves no step to time in a %d-step run; using %d: its "
            "speed figures come from %d step(s) and are not to be trusted (give more "
            "images or run.steps)", run.warmup_steps, total, warmup, total - warmup)
    # only a data-only run of one process goes on (ranks keep one schedule)
    extend = task.extends and not ranks.enabled and not length_asked(overrides)
    return Plan(total, warmup, extend)


def speed_asked(task: Task, overrides: list[str], sweep: bool) -> bool:
    """Whether this run's point is a speed figure: a sweep (which compares them), a task
    whose point it is (runner/tasks/), or a warm-up the user set."""
    return sweep or task.speed_asked or any(
        o.lstrip("+~").startswith("run.warmup_steps=") for o in overrides)


def length_asked(overrides: list[Any]) -> bool:
    """``run.epochs`` or ``run.steps`` given on the command line: what the user sets is
    what runs (a data-only run is lengthened only when no length was asked; short windows
    are then flagged)."""
    return any(o.lstrip("+~").split("=")[0] in ("run.epochs", "run.steps") for o in overrides)
