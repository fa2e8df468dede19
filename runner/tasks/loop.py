"""The loop: next batch, one move to the device, one step; timed per stage after warm-up.

Its progress bar (``run.progress``, tqdm on stderr) names the epoch and, at every window's
close, the running loss (a training step's mean since the last window, read where the loop
synchronizes anyway: no sync of its own) and images/s. Log records written while it runs
go above the bar (tqdm's ``logging_redirect_tqdm``), never onto its line.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from tensordict import TensorDict
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from runner.common.errors import Interrupted
from runner.data.loading.loader import is_empty
from runner.data.order import count_images
from runner.measure import timeline
from runner.measure.clock import StepClock, Window, repeat_split
from runner.measure.metrics import MetricLogger
from runner.measure.profile import stage_range
from runner.measure.stats import median

log = logging.getLogger(__name__)


class Step(Protocol):
    """What the loop calls once per device batch (a task's step, runner/tasks/): it never
    synchronizes; ``read`` is called at log points (where the loop has synchronized)."""

    def __call__(self, batch: TensorDict) -> None: ...
    def read(self) -> dict[str, float]: ...
    def close(self, complete: bool = True) -> dict[str, float]: ...
    def start_timing(self) -> None: ...  # warm-up is over: figures count from here
    # optional: ``skip()``, a position read whose images all failed to decode (no step)


@dataclass
class LoopResult:
    timed: Window  # the steps after warm-up: every reported figure comes from here
    repeats: list[Window]  # the timed steps as consecutive windows (run.repeats): the spread
    steps: int  # all steps run, warm-up included
    images: int  # all images seen, warm-up included
    warmup_steps: int
    empty: int = 0  # of the steps, batches read whose images all failed to decode
    interrupted: BaseException | None = None  # Ctrl-C or SIGTERM stopped the loop early
    # (start, end) of the first steps, host clock (time.perf_counter): runner/measure/timeline.py
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

    @property
    def finishes_on_device(self) -> bool:
        """Whether ``finish`` runs a device-side stage (crops of pre-decoded images,
        ``task.augment``): the loop then times it as a stage of its own, ``augment``."""
        ...


class OnDevice:
    """Any iterable of TensorDicts as the loop's batches: moved to ``device``, nothing more."""

    finishes_on_device = False

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


@dataclass(kw_only=True)
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
        profiler: a torch.profiler window (profile.enabled=true).
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


class Progress:
    """The loop's progress bar: steps done, the epoch as its description (``epoch 2/5``)
    and, as its postfix, the figures last read at a window's close: the running loss of a
    training step and images/s. Nothing here reads the device: the loss shown is the one
    ``Step.read`` returned where the loop synchronized anyway (every ``log_every`` timed
    steps), so it lags the step by at most that many steps."""

    def __init__(self, o: LoopOptions):
        self.o = o
        self.epoch = self.epoch_text(0, o.total_steps)
        self.bar = tqdm(total=o.total_steps, unit="step", disable=not o.progress,
                        dynamic_ncols=True, desc=self.epoch or None)
        self.words: dict[str, str] = {}
        self.redirected = contextlib.ExitStack()

    @property
    def total(self) -> int:
        return self.bar.total

    @total.setter
    def total(self, steps: int) -> None:
        self.bar.total = steps

    def epoch_text(self, steps: int, total: int) -> str:
        """``epoch e/E`` of the run's ``steps`` done of ``total`` (a resume's earlier
        steps count: its epochs are those of one uninterrupted run); "" without epochs."""
        per = self.o.steps_per_epoch
        if not per:
            return ""
        done, last = self.o.first_step + steps, self.o.first_step + total
        epochs = max(math.ceil(last / per), 1)
        return f"epoch {min(max(done - 1, 0) // per + 1, epochs)}/{epochs}"

    def step(self, steps: int) -> None:
        """A step is done: the bar moves, and names the epoch it belongs to."""
        epoch = self.epoch_text(steps, self.bar.total)
        if epoch != self.epoch:
            self.epoch = epoch
            self.bar.set_description_str(epoch, refresh=False)
        self.bar.update()

    def show(self, figures: dict[str, Any], rate_words: str = "img/s") -> None:
        """The figures of the window just closed (host values: no sync here)."""
        loss = figures.get("loss")
        if loss is not None:
            self.words["loss"] = f"loss {loss:.4g}"
        if figures.get("images_per_sec") is not None:
            self.words["rate"] = f"{figures['images_per_sec']:,.0f} {rate_words}"
        if self.words:
            self.bar.set_postfix_str(", ".join(self.words.values()))

    def redirect(self) -> None:
        """Until ``close``, log records go above the bar, not onto its line (tqdm's own
        redirect of the root logger's console handlers); nothing changes without a bar,
        or without a console handler to redirect (no console output is added)."""
        if not self.bar.disable and any(isinstance(h, logging.StreamHandler)
                                        and h.stream in (sys.stdout, sys.stderr)
                                        for h in logging.root.handlers):
            self.redirected.enter_context(logging_redirect_tqdm())

    def close(self) -> None:
        try:
            self.bar.close()
        finally:
            self.redirected.close()


class Windows:
    """The timed windows of a loop: where warm-up ends, where each window closes (a device
    sync, then the figures logged), the repeat windows that give the spread, and the
    lengthening of a run whose windows would be too short.

    The device is synchronized only at window edges: when warm-up ends, at every
    ``log_every``-th timed step, at each repeat's end, and at the end.
    """

    def __init__(self, o: LoopOptions, clock: StepClock, step: Step, logger: MetricLogger,
                 bar: Progress):
        self.o, self.clock, self.step, self.logger, self.bar = o, clock, step, logger, bar
        self.total, self.warmup = o.total_steps, o.warmup_steps
        self.ends = repeat_split(max(self.total - self.warmup, 1), o.repeats)
        self.result = LoopResult(timed=Window(), repeats=[Window() for _ in self.ends],
                                 steps=0, images=0, warmup_steps=self.warmup)
        self.repeat = 0
        self.lengthened = False  # the run was lengthened (and said so) already

    @property
    def timed(self) -> int:
        """Timed steps so far (negative during warm-up)."""
        return self.result.steps - self.warmup

    def begin(self) -> None:
        """Warm-up is over: what came before is not timed."""
        figures = self.step.read()
        self.logger.log(_prefixed(figures), step=self.result.steps)
        self.bar.show(figures)
        self.step.start_timing()
        self.clock.open_window()

    def after_step(self) -> None:
        timed = self.timed
        if timed == 0:
            self.begin()
        elif timed > 0 and (timed % self.o.log_every == 0 or timed in self.ends):
            first = self.repeat == 0  # before close(), which moves on at a repeat's end
            figures = self.close()
            self.bar.show(figures)
            if first and self.o.extend is not None and self.o.min_window_seconds > 0:
                self.lengthen()
            self.clock.open_window(sync=False)  # logging is the runner's, not the pipeline's

    def close(self) -> dict[str, Any]:
        """Close the open window (a sync), add it to the run and its repeat window, log it."""
        window = self.clock.close_window()
        self.result.timed.add(window)
        self.result.repeats[self.repeat].add(window)
        if self.repeat < len(self.ends) - 1 and self.timed >= self.ends[self.repeat]:
            self.repeat += 1
        if self.o.on_window is not None:
            self.o.on_window(self.result)
        figures = window.figures() | self.step.read()
        self.logger.log(_prefixed(figures), step=self.result.steps)
        return figures

    def lengthen(self) -> None:
        """Still in the first repeat: make every window last ``min_window_seconds``."""
        o, result = self.o, self.result
        needed = steps_for_windows(result.timed.seconds, result.timed.steps, o.repeats,
                                   o.min_window_seconds)
        if needed <= self.total - self.warmup:
            return
        # said once per run: later windows of the first repeat may lengthen it again (the
        # pace settles), which the progress bar shows; the log is not told each time
        (log.debug if self.lengthened else log.info)(
            "the data path alone runs at least %d steps, not %d: each of its %d windows "
            "lasts run.window_seconds=%g (run.window_seconds=0 keeps the steps asked)",
            self.warmup + needed, self.total, o.repeats, o.min_window_seconds)
        self.lengthened = True
        self.total = self.warmup + needed
        self.ends = [max(e, self.timed) for e in repeat_split(needed, o.repeats)]
        result.repeats += [Window() for _ in range(len(self.ends) - len(result.repeats))]
        if self.timed < self.ends[0]:  # the first repeat, ended early, goes on
            self.repeat = 0
        self.bar.total = self.total
        o.extend(self.total)

    def finish(self) -> LoopResult:
        """The last, partial window, and the repeats that hold steps."""
        if self.result.steps > self.warmup and self.clock.has_steps():
            self.bar.show(self.close())  # its loss: the run's last
        self.result.repeats = [w for w in self.result.repeats if w.steps]
        return self.result


class StepHooks:
    """What runs between two steps besides the timing: the checkpoint schedule
    (``on_step``), epoch ends (validation, checkpoints; their time left out), the
    profiler's step, and a stop a signal asked for (raised between two steps, never inside
    one)."""

    def __init__(self, o: LoopOptions, clock: StepClock):
        self.o, self.clock = o, clock

    def start(self) -> None:
        if self.o.profiler is not None:
            self.o.profiler.start()

    def stop(self) -> None:
        if self.o.profiler is not None:
            self.o.profiler.stop()

    def after_step(self, steps: int) -> None:
        o = self.o
        done = o.first_step + steps
        if o.on_step is not None:
            o.on_step(done)
        if o.on_epoch_end is not None and done % o.steps_per_epoch == 0:
            with self.clock.paused():
                o.on_epoch_end(done // o.steps_per_epoch)
        # what was paused here (a checkpoint, validation) left the window, and falls in no
        # data wait: the next wait must not have it taken out (it would come out negative)
        self.clock.take_paused()
        if o.profiler is not None:
            o.profiler.step()
        timed = steps - o.warmup_steps
        if o.stop_requested is not None and (
                o.stop_each_step or (timed >= 0 and timed % o.log_every == 0)) \
                and (name := o.stop_requested()) is not None:
            raise Interrupted(name)  # between two steps (every rank at this same one)


class StepTrace:
    """The host spans of the first steps after warm-up, for the timeline
    (runner/measure/timeline.py): wait, copy, augment and step, and each step's span."""

    def __init__(self, result: LoopResult, augments: bool):
        self.result, self.augments = result, augments
        self.keep = result.warmup_steps + timeline.STEPS_SHOWN if timeline.enabled() else 0

    def record(self, t0: float, h1: float, h2: float, h3: float,
               events: tuple[Any, Any, Any, Any] | None = None) -> None:
        """The host spans of a step; on CUDA (``events``: the step clock's events at the
        copy's start and end, the augmentation's end, the step's end) its compute stream's
        too, resolved after the loop (no sync here)."""
        if self.result.steps >= self.keep:
            return
        h4 = time.perf_counter()
        for name, a, b in (("wait", t0, h1), ("copy", h1, h2), ("augment", h2, h3),
                           ("step", h3, h4)):
            if b > a and (name != "augment" or self.augments):
                timeline.record(name, a, b)
        if events is not None:
            c0, c1, ca, c2 = events
            for name, a, b in (("copy", c0, c1), ("augment", c1, ca), ("compute", ca, c2)):
                if name != "augment" or self.augments:
                    timeline.record_device(timeline.COMPUTE_STREAM, name, a, b)
        self.result.step_spans.append((t0, h4))


def run_loop(batches: Batches, step: Step, logger: MetricLogger, options: LoopOptions
             ) -> LoopResult:
    """Run ``step`` on up to ``options.total_steps`` batches and time those after warm-up:
    wait for the next batch, copy it to the device, finish it there, step.

    The timed steps are split into ``repeats`` consecutive windows (the run's spread,
    ``Windows``). ``finish`` (random crops of pre-decoded batches) runs on the device after
    the move and counts as compute. With a ``profiler``, each stage is a named range and
    the profiler advances once per step. Ctrl-C or SIGTERM (``KeyboardInterrupt``) ends the
    loop early with the steps done so far timed and kept; the result carries the
    interruption for the caller to re-raise.

    A batch none of whose images decoded (runner/data/loading/loader.py's ``empty_batch``) counts
    as a step read: no copy and no step (the step's ``skip`` is told), but its position
    counts, so epochs end, checkpoints and a run's completion fall where they would
    (``LoopResult.empty``).
    """
    o = options
    clock = o.clock or StepClock(batches.device)
    bar = Progress(o)
    windows, hooks = Windows(o, clock, step, logger, bar), StepHooks(o, clock)
    result = windows.result
    # a device-side stage: crops of pre-decoded images, task.augment (timed on its own;
    # without one, finish is not called)
    augments = batches.finishes_on_device
    trace = StepTrace(result, augments)
    stage = stage_range(o.profiler is not None)
    stream = getattr(batches, "stream", None)  # a DataPath's: empty positions come through
    if stream is not None and hasattr(stream, "keep_empty"):
        stream.keep_empty = True
    skip = getattr(step, "skip", None)
    batch_iter = iter(batches)
    hooks.start()
    if windows.warmup == 0:
        windows.begin()
    bar.redirect()  # until bar.close(): log records go above the bar
    try:
        while result.steps < windows.total:
            t0 = time.perf_counter()
            with stage("data_wait"):
                batch = next(batch_iter, None)
            if batch is None:
                break
            h1 = time.perf_counter()
            clock.add_host("data_wait", h1 - t0 - clock.take_paused())
            if is_empty(batch):  # read, every image undecodable: a position, no step
                if skip is not None:
                    skip()
                result.steps += 1
                result.empty += 1
                bar.step(result.steps)
                hooks.after_step(result.steps)
                windows.after_step()
                continue
            n = batches.count(batch)  # counted on the host: no device sync
            c0 = clock.now()
            with stage("copy"):
                batch = batches.to_device(batch)
            c1, h2 = clock.now(), time.perf_counter()
            ca = c1
            if augments:
                with stage("augment"):
                    batch = batches.finish(batch)
                ca = clock.now()
            h3 = time.perf_counter()
            with stage("compute"):
                step(batch)
            c2 = clock.now()
            events = (c0, c1, ca, c2) if getattr(clock, "cuda", False) else None
            trace.record(t0, h1, h2, h3, events)  # events: the device lanes, on CUDA
            clock.add("copy", c0, c1)
            if augments:
                clock.add("augment", c1, ca)
            clock.add("compute", ca, c2)
            clock.step_done(n, c0, c2)
            result.steps += 1
            result.images += n
            bar.step(result.steps)
            hooks.after_step(result.steps)
            windows.after_step()
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (runner.job.run's handler)
        result.interrupted = e
    finally:
        hooks.stop()
        if hasattr(batch_iter, "close"):
            batch_iter.close()  # stops loader workers now, also when stopping early
        if stream is not None and hasattr(stream, "keep_empty"):
            stream.keep_empty = False  # another reader of this data path (device_batches)
        try:
            windows.finish()
            rates = [w.figures()["images_per_sec"] for w in result.repeats]
            if rates:  # the bar ends on the figure the run reports
                bar.show({"images_per_sec": median(rates)}, "img/s (median of windows)")
        finally:
            bar.close()
    return result
