"""The loop: next batch, one move to the device, one step; timed per stage after warm-up."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict
from tqdm import tqdm

from runner import timeline
from runner.loader import count_images
from runner.logger import MetricLogger
from runner.metrics import StepClock, Window, repeat_split
from runner.profile import stage_range
from runner.task import Step


@dataclass
class LoopResult:
    timed: Window  # the steps after warm-up: every reported figure comes from here
    repeats: list[Window]  # the timed steps as consecutive windows (run.repeats): the spread
    steps: int  # all steps run, warm-up included
    images: int  # all images seen, warm-up included
    warmup_steps: int
    interrupted: BaseException | None = None  # Ctrl-C or SIGTERM stopped the loop early
    # (start, end) of the first steps, host clock (time.perf_counter): runner/timeline.py
    step_spans: list[tuple[float, float]] = field(default_factory=list)


def _prefixed(figures: dict[str, Any]) -> dict[str, Any]:
    """Per-window figures for the logger's history, under ``window/``: the run's own
    figures (metrics.json, the logger's summary) are never overwritten by the last window."""
    return {f"window/{k}": v for k, v in figures.items() if v is not None}


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
    repeats: int = 3,
    on_window: Callable[[LoopResult], None] | None = None,
    on_epoch_end: tuple[int, Callable[[int], None]] | None = None,
) -> LoopResult:
    """Run ``step`` on up to ``total_steps`` batches and time the ones after warm-up.

    The timed steps are split into ``repeats`` consecutive windows (the run's spread); the
    device is synchronized only at window edges: when warm-up ends, at every
    ``log_every``-th timed step, at each repeat's end, and at the end. ``augment`` (random
    crops of pre-decoded batches) runs on the device after the move and counts as compute.
    With a ``profiler``, each stage is a named range and the profiler advances once per
    step. A ``clock`` made by the caller lets setup code pause it (``StepClock.paused``).
    ``on_window`` sees the result so far after every window (to save it as it grows).
    ``on_epoch_end=(steps_per_epoch, fn)`` calls ``fn(epochs done)`` on the loop's thread
    after each epoch's last step (a checkpoint, a validation pass); its time is taken out
    of the figures.
    Ctrl-C or SIGTERM (``KeyboardInterrupt``) ends the loop early with the steps done so
    far timed and kept; the result carries the interruption for the caller to re-raise.
    """
    clock = clock or StepClock(device)
    ends = repeat_split(max(total_steps - warmup_steps, 1), repeats)
    result = LoopResult(timed=Window(), repeats=[Window() for _ in ends], steps=0, images=0,
                        warmup_steps=warmup_steps)
    stage = stage_range(profiler is not None)
    bar = tqdm(total=total_steps, unit="step", disable=not progress, dynamic_ncols=True)
    batch_iter = iter(batches)
    repeat = 0
    traced = timeline.enabled()
    keep_spans = warmup_steps + timeline.STEPS_SHOWN

    def close_window() -> dict[str, Any]:
        nonlocal repeat
        window = clock.close_window()
        result.timed.add(window)
        result.repeats[repeat].add(window)
        timed = result.steps - warmup_steps
        if repeat < len(ends) - 1 and timed >= ends[repeat]:
            repeat += 1
        if on_window is not None:
            on_window(result)
        return window.figures()

    if profiler is not None:
        profiler.start()
    if warmup_steps == 0:
        step.start_timing()
        clock.open_window()
    try:
        while result.steps < total_steps:
            t0 = time.perf_counter()
            with stage("data_wait"):
                batch = next(batch_iter, None)
            if batch is None:
                break
            h1 = time.perf_counter()
            clock.add_host("data_wait", h1 - t0 - clock.take_paused())
            n = count_images(batch)  # before the move: counting padding needs no device sync
            c0 = clock.now()
            with stage("copy"):
                batch = batch.to(device, non_blocking=True)
            c1 = clock.now()
            h2 = time.perf_counter()
            if augment is not None:
                with stage("augment"):
                    batch["image"] = augment(batch["image"])
            h3 = time.perf_counter()
            with stage("compute"):
                step(batch)
            c2 = clock.now()
            if traced and result.steps < keep_spans:  # host spans, for runner/timeline.py
                h4 = time.perf_counter()
                for name, a, b in (("wait", t0, h1), ("copy", h1, h2), ("augment", h2, h3),
                                   ("step", h3, h4)):
                    if b > a and (name != "augment" or augment is not None):
                        timeline.record(name, a, b)
                result.step_spans.append((t0, h4))
            clock.add("copy", c0, c1)
            clock.add("compute", c1, c2)
            clock.step_done(n, c0, c2)
            result.steps += 1
            result.images += n
            bar.update()
            if on_epoch_end is not None and result.steps % on_epoch_end[0] == 0:
                with clock.paused():
                    on_epoch_end[1](result.steps // on_epoch_end[0])
            if profiler is not None:
                profiler.step()
            timed = result.steps - warmup_steps
            if timed == 0:  # warm-up ends: what came before is not timed
                logger.log(_prefixed(step.read()), step=result.steps)
                step.start_timing()
                clock.open_window()
            elif timed > 0 and (timed % log_every == 0 or timed in ends):
                figures = close_window() | step.read()
                logger.log(_prefixed(figures), step=result.steps)
                bar.set_postfix_str(f"{figures['images_per_sec']:,.0f} img/s")
                clock.open_window(sync=False)  # logging is the runner's, not the pipeline's
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (runner.run's handler)
        result.interrupted = e
    finally:
        bar.close()
        if profiler is not None:
            profiler.stop()
        if hasattr(batch_iter, "close"):
            batch_iter.close()  # stops loader workers now, also when stopping early
    if result.steps > warmup_steps and clock.has_steps():
        figures = close_window() | step.read()
        logger.log(_prefixed(figures), step=result.steps)
    result.repeats = [w for w in result.repeats if w.steps]
    return result
