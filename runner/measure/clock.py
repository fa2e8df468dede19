"""The run's clocks: the device clock, per-stage step timing after warm-up, timed bursts

Timing rules (after nanoGPT's bench.py and timm's benchmark.py): warm-up steps are excluded,
the device is synchronized only at window boundaries (start, log points, end), and
``.item()`` is called only when logging. Data wait is host time spent blocked on the loader;
copy and compute are host time on CPU and CUDA events on a GPU (read back at log points).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from runner.measure import counters as system
from runner.measure import timeline

STAGES = ("data_wait", "copy", "augment", "compute")  # augment: the device-side stage
MAX_PENDING_EVENTS = 256  # recorded CUDA event pairs kept before completed ones are folded


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

    def done(self, stamp: Any) -> bool:
        """Whether a timestamp is final: an event that has completed (asked without a
        sync), or any host time."""
        return stamp.query() if self.cuda else True

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


CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_seconds() -> float | None:
    """CPU seconds every process on this machine has run so far (/proc/stat; None where
    there is no /proc)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


def _own_seconds() -> float:
    """CPU seconds this process (all its threads) and its live children have run."""
    times = os.times()
    total = times.user + times.system + times.children_user + times.children_system
    try:
        children = set()
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                children.update(f.read().split())
        for pid in children:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
    except OSError:
        pass
    return total


# /proc is read at most this often (a window of a fast data path lasts ~1 ms: reading it at
# every window cost more than the window, and spans that short are all tick noise)
SHARED_SAMPLE_SECONDS = 0.05


class SharedCores:
    """How many cores other processes used while a window was timed: the machine's busy
    CPU time (/proc/stat) less this process's and its workers' own, over the window's wall
    time; and, at the same moments, the system's counters (runner/measure/counters.py:
    iowait, context switches, page faults, bytes read, per process). A virtual machine's steal time (the host running other guests on these cores)
    counts as busy too: it slows the run the same way. A figure measured while another job
    ran on the same cores is not this configuration's figure (runner/tasks/results.py flags it)."""

    def __init__(self, gpu: Any = None) -> None:
        self.gpu = gpu  # counters.Nvml on CUDA where NVML is installed
        self.start = self._sample()
        self.counted = self._counters()

    def _sample(self) -> tuple[float, float | None, float]:
        return time.perf_counter(), _busy_seconds(), _own_seconds()

    def _counters(self) -> system.Sample:
        return system.sample(self.gpu)

    def restart(self) -> None:
        self.start = self._sample()
        self.counted = self._counters()

    def counts(self) -> system.Counts:
        """The system's counters since the last (re)start."""
        return system.delta(self.counted, self._counters())

    def age(self) -> float:
        """Wall seconds since the last (re)start."""
        return time.perf_counter() - self.start[0]

    def others(self) -> float | None:
        """Core-seconds other processes ran since the last (re)start: signed, since CPU
        time is counted in 10 ms ticks and a short span's count is off by a tick either
        way (sums over many spans cancel; a clamped one would not)."""
        (_, busy0, own0), (_, busy1, own1) = self.start, self._sample()
        if busy0 is None or busy1 is None:
            return None
        return (busy1 - busy0) - (own1 - own0)


@dataclass
class Window:
    """Totals over a span of steps."""

    steps: int = 0
    images: int = 0
    seconds: float = 0.0
    stages: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    # core-seconds other processes ran, as counted (signed: off by a tick either way), over
    # ``others_span`` wall seconds that end with this window (a short window's span also
    # holds the windows and gaps before it since the last sample); None: unknown here
    others_cpu: float | None = None
    others_span: float = 0.0
    # the system's counters over that same span (runner/measure/counters.py)
    counts: system.Counts = field(default_factory=system.Counts)

    def add(self, other: Window) -> None:
        self.steps += other.steps
        self.images += other.images
        self.seconds += other.seconds
        for k, v in other.stages.items():
            self.stages[k] = self.stages.get(k, 0.0) + v
        if other.others_cpu is not None:
            self.others_cpu = (self.others_cpu or 0.0) + other.others_cpu
            self.others_span += other.others_span
        self.counts.add(other.counts)

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
        if self.others_cpu is not None and self.others_span > 0:  # cores others used
            out["others_cores"] = max(0.0, self.others_cpu / self.others_span)
        return out | self.counts.figures()


def repeat_split(timed_steps: int, repeats: int) -> list[int]:
    """The timed step (1-based) at which each of ``repeats`` consecutive, near-equal
    windows ends; fewer windows when there are fewer steps."""
    repeats = max(1, min(repeats, timed_steps))
    return [round(timed_steps * (k + 1) / repeats) for k in range(repeats)]


class StepClock:
    """Accumulates stage times per step; ``close_window`` syncs once and returns the totals.

    On CUDA, copy and compute are timed with events, and the GPU's idle time between one
    step's last kernel and the next step's first (``gpu_idle``) is measured the same way:
    the host may wait for data while queued kernels still run, so only an idle GPU means
    the data path held it back.

    Args:
        device: CUDA devices are timed with events, everything else with perf_counter.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.clock = DeviceClock(device)
        self.cuda = self.clock.cuda
        self._window = self._empty()
        self._events: list[tuple[str, Any, Any]] = []
        self._last_end: Any = None  # the previous step's last event (CUDA), this window
        self._start = time.perf_counter()
        self._owner = threading.get_ident()  # the loop's thread
        self._paused = 0.0  # paused time not yet taken out of a data-wait measurement
        # what other processes ran meanwhile, and the system's counters; the child
        # processes alive now (wandb's service, a server) are not the loader's workers,
        # which start with the loop
        system.predating()
        self.gpu, self.gpu_note = system.open_nvml(device)
        self._shared = SharedCores(self.gpu)
        self._sampled = False  # a window has taken the counters' sample since the start

    def _empty(self) -> Window:
        window = Window()
        if self.cuda:
            window.stages["gpu_idle"] = 0.0
        return window

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
            # the device idles through this work too, which is not the data path's
            # (validation, a checkpoint, an eviction): the next step's gap starts now, at
            # its end (forgetting the moment would drop that gap while its data wait counts)
            self._last_end = self.clock.now() if self.cuda else None

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

    def step_done(self, images: int, first: Any = None, last: Any = None) -> None:
        """One step: its images, and (CUDA) its first and last events for the idle gap."""
        self._window.steps += 1
        self._window.images += images
        if self.cuda and first is not None:
            if self._last_end is not None:
                self._events.append(("gpu_idle", self._last_end, first))
            self._last_end = last

    def has_steps(self) -> bool:
        """Whether the open window holds any step yet."""
        return self._window.steps > 0

    def open_window(self, sync: bool = True) -> None:
        """Start a fresh window now. ``sync=False`` right after ``close_window`` (which
        synchronized), when nothing was queued on the device since: one sync per window."""
        if sync:
            synchronize(self.device)
        self._window, self._events = self._empty(), []
        if self._shared.age() >= SHARED_SAMPLE_SECONDS:  # a sample per 50 ms, not per window
            self._shared.restart()  # before the clock starts: reading /proc is the runner's
        self._start = time.perf_counter()
        # the device is idle now (synchronized): the first step's gap is counted from here,
        # as its data wait is from the window's start
        self._last_end = self.clock.now() if self.cuda else None

    def close_window(self) -> Window:
        """Sync, resolve the events and return the window's totals.

        A caller that does untimed host work (logging) afterwards calls
        ``open_window(sync=False)``.
        """
        synchronize(self.device)
        window = self._window
        window.seconds = time.perf_counter() - self._start
        # a sample per 50 ms, and the first window's whatever its age: a timed part shorter
        # than 50 ms (a quick run) had no sample at all in its timeline's counters lane
        if self._shared.age() >= SHARED_SAMPLE_SECONDS or not self._sampled:
            self._sampled = True
            window.others_cpu, window.others_span = self._shared.others(), self._shared.age()
            window.counts = self._shared.counts()
            timeline.record_counters(self._shared.start[0], window.counts.seconds
                                     + self._shared.start[0], window.counts.figures())
        for stage, start, end in self._events:
            window.stages[stage] += self.clock.seconds(start, end)
        self.open_window(sync=False)
        return window
