"""The loop: next batch, one move to the device, one step; timed per stage after warm-up."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from tensordict import TensorDict
from tqdm import tqdm

from runner.loader import count_images
from runner.logger import MetricLogger
from runner.metrics import StepClock, Window
from runner.profile import stage_range
from runner.task import Step


@dataclass
class LoopResult:
    timed: Window  # the steps after warm-up: every reported figure comes from here
    steps: int  # all steps run, warm-up included
    images: int  # all images seen, warm-up included
    warmup_steps: int


def run_loop(
    batches: Iterable[TensorDict],
    step: Step,
    device: torch.device,
    total_steps: int,
    warmup_steps: int,
    log_every: int,
    logger: MetricLogger,
    progress: bool = True,
    augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
    profiler: torch.profiler.profile | None = None,
    clock: StepClock | None = None,
) -> LoopResult:
    """Run ``step`` on up to ``total_steps`` batches and time the ones after warm-up.

    The device is synchronized only when warm-up ends, at every ``log_every``-th timed
    step, and at the end. ``augment`` (random crops of pre-decoded batches) runs on the
    device after the move and counts as compute. With a ``profiler``, each stage is a
    named range and the profiler advances once per step. A ``clock`` made by the caller
    lets setup code pause it (``StepClock.paused``).
    """
    clock = clock or StepClock(device)
    timed = Window()
    steps = images = 0
    stage = stage_range(profiler is not None)
    bar = tqdm(total=total_steps, unit="step", disable=not progress, dynamic_ncols=True)
    batch_iter = iter(batches)
    if profiler is not None:
        profiler.start()
    if warmup_steps == 0:
        clock.open_window()
    try:
        while steps < total_steps:
            t0 = time.perf_counter()
            with stage("data_wait"):
                batch = next(batch_iter, None)
            if batch is None:
                break
            clock.add_host("data_wait", time.perf_counter() - t0 - clock.take_paused())
            n = count_images(batch)  # before the move: counting padding needs no device sync
            c0 = clock.now()
            with stage("copy"):
                batch = batch.to(device, non_blocking=True)
            c1 = clock.now()
            if augment is not None:
                with stage("augment"):
                    batch["image"] = augment(batch["image"])
            with stage("compute"):
                step(batch)
            c2 = clock.now()
            clock.add("copy", c0, c1)
            clock.add("compute", c1, c2)
            clock.step_done(n)
            steps += 1
            images += n
            bar.update()
            if profiler is not None:
                profiler.step()
            if steps == warmup_steps:  # warm-up ends: what came before is not timed
                logger.log(step.read(), step=steps)
                clock.open_window()
            elif steps > warmup_steps and (steps - warmup_steps) % log_every == 0:
                window = clock.close_window()
                timed.add(window)
                figures = window.figures() | step.read()
                logger.log(figures, step=steps)
                bar.set_postfix_str(f"{figures['images_per_sec']:,.0f} img/s")
                clock.open_window()  # logging is the runner's overhead, not the pipeline's
        if steps > warmup_steps:
            window = clock.close_window()
            if window.steps:
                timed.add(window)
                logger.log(window.figures() | step.read(), step=steps)
    finally:
        bar.close()
        if profiler is not None:
            profiler.stop()
        if hasattr(batch_iter, "close"):
            batch_iter.close()  # stops loader workers now, also when stopping early
    return LoopResult(timed=timed, steps=steps, images=images, warmup_steps=warmup_steps)
