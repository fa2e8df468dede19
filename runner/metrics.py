"""Measurement: the device clock, per-stage step timing after warm-up, timed bursts.

Timing rules (after nanoGPT's bench.py and timm's benchmark.py): warm-up steps are excluded,
the device is synchronized only at window boundaries (start, log points, end), and
``.item()`` is called only when logging. Data wait is host time spent blocked on the loader;
copy and compute are host time on CPU and CUDA events on a GPU (read back at log points).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

STAGES = ("data_wait", "copy", "compute")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # note: a CPU-GPU sync point, only at window edges


class DeviceClock:
    """Timestamps of work on a device: CUDA events on a GPU (resolved only after a sync),
    host time elsewhere (where work is done when the call returns)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self) -> Any:
        """A timestamp: an event recorded on the current CUDA stream, or host seconds."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds between two timestamps (for events: only after both have completed)."""
        if self.cuda:
            return start.elapsed_time(end) / 1000.0
        return end - start


def burst(fn: Callable[[], int], seconds: float = 0.4, min_calls: int = 2,
          sync: Callable[[], None] = lambda: None, warmup: int = 1) -> float:
    """Images/s of ``fn`` (which returns how many images it handled) after ``warmup`` calls,
    over at least ``seconds`` and ``min_calls`` calls."""
    for _ in range(warmup):
        fn()
    sync()
    images, calls, start = 0, 0, time.perf_counter()
    while calls < min_calls or time.perf_counter() - start < seconds:
        images += fn()
        calls += 1
    sync()
    return images / (time.perf_counter() - start)


@dataclass
class Window:
    """Totals over a span of steps."""

    steps: int = 0
    images: int = 0
    seconds: float = 0.0
    stages: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))

    def add(self, other: Window) -> None:
        self.steps += other.steps
        self.images += other.images
        self.seconds += other.seconds
        for k, v in other.stages.items():
            self.stages[k] += v

    def figures(self) -> dict[str, float | None]:
        """images/s, ms/step and each stage's share of the wall time."""
        if self.steps == 0 or self.seconds <= 0:
            return {"images_per_sec": None, "ms_per_step": None, "data_wait_frac": None}
        out: dict[str, float | None] = {
            "images_per_sec": self.images / self.seconds,
            "ms_per_step": 1000.0 * self.seconds / self.steps,
        }
        for stage, total in self.stages.items():
            out[f"{stage}_frac"] = total / self.seconds
            out[f"{stage}_ms"] = 1000.0 * total / self.steps
        return out


class StepClock:
    """Accumulates stage times per step; ``close_window`` syncs once and returns the totals.

    Args:
        device: CUDA devices are timed with events, everything else with perf_counter.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.clock = DeviceClock(device)
        self.cuda = self.clock.cuda
        self._window = Window()
        self._events: list[tuple[str, Any, Any]] = []
        self._start = time.perf_counter()
        self._owner = threading.get_ident()  # the loop's thread
        self._paused = 0.0  # paused time not yet taken out of a data-wait measurement

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Work that is the measurement's, not the pipeline's (evicting the page cache):
        on the loop's thread its time leaves the window and the data wait it falls in."""
        if threading.get_ident() != self._owner:  # overlaps the loop: nothing to take out
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            self._start += spent
            self._paused += spent

    def take_paused(self) -> float:
        spent, self._paused = self._paused, 0.0
        return spent

    def now(self) -> Any:
        """A timestamp for copy/compute (``DeviceClock.now``)."""
        return self.clock.now()

    def add_host(self, stage: str, seconds: float) -> None:
        self._window.stages[stage] += seconds

    def add(self, stage: str, start: Any, end: Any) -> None:
        if self.cuda:
            self._events.append((stage, start, end))
        else:
            self._window.stages[stage] += end - start

    def step_done(self, images: int) -> None:
        self._window.steps += 1
        self._window.images += images

    def open_window(self) -> None:
        """Start a fresh window now (after a sync, so queued work is not counted in it)."""
        synchronize(self.device)
        self._window, self._events = Window(), []
        self._start = time.perf_counter()

    def close_window(self) -> Window:
        """Sync, resolve the events and return the window's totals; a new window starts.

        A caller that does untimed work (logging) afterwards calls ``open_window`` again.
        """
        synchronize(self.device)
        window = self._window
        window.seconds = time.perf_counter() - self._start
        for stage, start, end in self._events:
            window.stages[stage] += self.clock.seconds(start, end)
        self._window, self._events = Window(), []
        self._start = time.perf_counter()
        return window
