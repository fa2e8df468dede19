"""The loop: next batch, one move to the device, one step; timed per stage after warm-up."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from tensordict import TensorDict
from tqdm import tqdm

from runner import timeline
from runner.data.order import count_images
from runner.errors import Interrupted
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


class Batches(Protocol):
    """What the loop reads: batches as they come, moved to the device, finished there
    (``runner.data.DataPath``; ``OnDevice`` for any iterable of TensorDicts)."""

    device: torch.device

    def __iter__(self) -> Iterator[TensorDict]: ...
    def count(self, batch: TensorDict) -> int: ...
    def to_device(self, batch: TensorDict) -> TensorDict: ...
    def finish(self, batch: TensorDict) -> TensorDict: ...


class OnDevice:
    """Any iterable of TensorDicts as the loop's batches: moved to ``device``, nothing more."""

    augment = None

    def __init__(self, source: Iterable[TensorDict], device: torch.device):
        self.source, self.device = source, device

    def __iter__(self) -> Iterator[TensorDict]:
        return iter(self.source)

    def count(self, batch: TensorDict) -> int:
        return count_images(batch)

    def to_device(self, batch: TensorDict) -> TensorDict:
        return batch.to(self.device, non_blocking=True)

    def finish(self, batch: TensorDict) -> TensorDict:
        return batch


@dataclass
class LoopOptions:
    """How long the loop runs and how it measures.

    Attributes:
        total_steps: steps to run (fewer if the batches end first).
        warmup_steps: the first steps, left out of every figure.
        log_every: a timed window closes (and is logged) every this many timed steps.
        repeats: the timed steps are split into this many consecutive windows (the spread).
        min_window_seconds: each repeat window should last at least this long: short
            windows of a fast pipeline give figures that differ run to run.
        extend: called with a new total step count when the windows would be too short
            and the run may go on (None: the run keeps its length; its flags say so).
        progress: a progress bar.
        profiler: a torch.profiler window (profile=true).
        clock: the step clock (a caller may pause it around its own work).
        on_window: sees the result so far after every window (to save it as it grows).
        steps_per_epoch: with ``on_epoch_end``: called with the epochs done after each
            epoch's last step (a checkpoint, a validation pass), its time left out.
        first_step: steps of the run done before this loop (a resume): epochs end where
            they would have in one uninterrupted run.
        on_step: called with the run's steps done after every step (a checkpoint
            schedule); what it does must leave the timing itself (``clock.paused``).
        stop_requested: asked between steps (every step with ``stop_each_step``, else when
            warm-up ends and at every ``log_every``-th timed step: the same steps on every
            rank): a signal's name ends the loop there, never inside a step.
    """

    total_steps: int
    warmup_steps: int
    log_every: int = 10
    repeats: int = 3
    min_window_seconds: float = 0.0
    extend: Callable[[int], None] | None = None
    progress: bool = False
    profiler: torch.profiler.profile | None = None
    clock: StepClock | None = None
    on_window: Callable[[LoopResult], None] | None = None
    steps_per_epoch: int | None = None
    on_epoch_end: Callable[[int], None] | None = None
    first_step: int = 0
    on_step: Callable[[int], None] | None = None
    stop_requested: Callable[[], str | None] | None = None
    stop_each_step: bool = False


def steps_for_windows(timed_seconds: float, timed_steps: int, repeats: int,
                      min_window_seconds: float) -> int:
    """Timed steps that make ``repeats`` windows of ``min_window_seconds`` each at the pace
    measured so far (with a tenth to spare)."""
    per_step = timed_seconds / max(timed_steps, 1)
    return math.ceil(1.1 * repeats * min_window_seconds / max(per_step, 1e-9))


def run_loop(batches: Batches, step: Step, logger: MetricLogger, options: LoopOptions
             ) -> LoopResult:
    """Run ``step`` on up to ``options.total_steps`` batches and time those after warm-up.

    The timed steps are split into ``repeats`` consecutive windows (the run's spread); the
    device is synchronized only at window edges: when warm-up ends, at every
    ``log_every``-th timed step, at each repeat's end, and at the end. When the first
    repeat shows that the windows would last less than ``min_window_seconds``, the run is
    lengthened through ``extend`` (when given) so that they do not. ``finish`` (random
    crops of pre-decoded batches) runs on the device after the move and counts as compute.
    With a ``profiler``, each stage is a named range and the profiler advances once per
    step. Ctrl-C or SIGTERM (``KeyboardInterrupt``) ends the loop early with the steps done
    so far timed and kept; the result carries the interruption for the caller to re-raise.
    """
    o = options
    clock = o.clock or StepClock(batches.device)
    total_steps, warmup_steps = o.total_steps, o.warmup_steps
    ends = repeat_split(max(total_steps - warmup_steps, 1), o.repeats)
    result = LoopResult(timed=Window(), repeats=[Window() for _ in ends], steps=0, images=0,
                        warmup_steps=warmup_steps)
    stage = stage_range(o.profiler is not None)
    bar = tqdm(total=total_steps, unit="step", disable=not o.progress, dynamic_ncols=True)
    batch_iter = iter(batches)
    repeat = 0
    traced = timeline.enabled()
    keep_spans = warmup_steps + timeline.STEPS_SHOWN
    finishes = getattr(batches, "augment", None) is not None

    def close_window() -> dict[str, Any]:
        nonlocal repeat
        window = clock.close_window()
        result.timed.add(window)
        result.repeats[repeat].add(window)
        timed = result.steps - warmup_steps
        if repeat < len(ends) - 1 and timed >= ends[repeat]:
            repeat += 1
        if o.on_window is not None:
            o.on_window(result)
        return window.figures()

    def lengthen() -> None:
        """Still in the first repeat: make every window last ``min_window_seconds``."""
        nonlocal total_steps, ends
        timed = result.steps - warmup_steps
        needed = steps_for_windows(result.timed.seconds, result.timed.steps, o.repeats,
                                   o.min_window_seconds)
        if needed <= total_steps - warmup_steps:
            return
        total_steps = warmup_steps + needed
        ends = [max(e, timed) for e in repeat_split(needed, o.repeats)]
        result.repeats += [Window() for _ in range(len(ends) - len(result.repeats))]
        bar.total = total_steps
        o.extend(total_steps)

    if o.profiler is not None:
        o.profiler.start()
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
            n = batches.count(batch)  # counted on the host: no device sync
            c0 = clock.now()
            with stage("copy"):
                batch = batches.to_device(batch)
            c1 = clock.now()
            h2 = time.perf_counter()
            if finishes:
                with stage("augment"):
                    batch = batches.finish(batch)
            h3 = time.perf_counter()
            with stage("compute"):
                step(batch)
            c2 = clock.now()
            if traced and result.steps < keep_spans:  # host spans, for runner/timeline.py
                h4 = time.perf_counter()
                for name, a, b in (("wait", t0, h1), ("copy", h1, h2), ("augment", h2, h3),
                                   ("step", h3, h4)):
                    if b > a and (name != "augment" or finishes):
                        timeline.record(name, a, b)
                result.step_spans.append((t0, h4))
            clock.add("copy", c0, c1)
            clock.add("compute", c1, c2)
            clock.step_done(n, c0, c2)
            result.steps += 1
            result.images += n
            bar.update()
            done = o.first_step + result.steps
            if o.on_step is not None:
                o.on_step(done)
            if o.on_epoch_end is not None and done % o.steps_per_epoch == 0:
                with clock.paused():
                    o.on_epoch_end(done // o.steps_per_epoch)
            if o.profiler is not None:
                o.profiler.step()
            timed = result.steps - warmup_steps
            if o.stop_requested is not None and (
                    o.stop_each_step or (timed >= 0 and timed % o.log_every == 0)) \
                    and (name := o.stop_requested()) is not None:
                raise Interrupted(name)  # between two steps (every rank at this same one)
            if timed == 0:  # warm-up ends: what came before is not timed
                logger.log(_prefixed(step.read()), step=result.steps)
                step.start_timing()
                clock.open_window()
            elif timed > 0 and (timed % o.log_every == 0 or timed in ends):
                figures = close_window() | step.read()
                logger.log(_prefixed(figures), step=result.steps)
                bar.set_postfix_str(f"{figures['images_per_sec']:,.0f} img/s")
                if repeat == 0 and o.extend is not None and o.min_window_seconds > 0:
                    lengthen()
                clock.open_window(sync=False)  # logging is the runner's, not the pipeline's
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (runner.run's handler)
        result.interrupted = e
    finally:
        bar.close()
        if o.profiler is not None:
            o.profiler.stop()
        if hasattr(batch_iter, "close"):
            batch_iter.close()  # stops loader workers now, also when stopping early
    if result.steps > warmup_steps and clock.has_steps():
        figures = close_window() | step.read()
        logger.log(_prefixed(figures), step=result.steps)
    result.repeats = [w for w in result.repeats if w.steps]
    return result
