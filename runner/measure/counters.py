"""What the machine did while the run was timed: the system's own counters (vmstat's and
iostat's figures, per process), read from /proc at the timed windows' edges.

A ``Sample`` holds, at one moment, the machine's CPU ticks (/proc/stat: how many went to
iowait) and, for the run's process and each of its child processes (the DataLoader's
workers), from /proc/<pid>/{stat,status,io}: CPU seconds, voluntary and involuntary context
switches (of every thread: ``context_switches``), minor and major page faults, bytes read
from a block device (``read_bytes``: what the page cache did not hold), and the peak
resident set (``VmHWM``). ``delta`` turns two
samples into counts over the span between them; ``Counts`` adds spans up and ``figures``
gives the rates metrics.json declares (runner/measure/metrics.py). A worker that exits
between two samples takes its counts since the first with it (a worker lives the whole
epoch; ``persistent_workers`` keeps it across epochs). Where there is no /proc (not
Linux), every figure is null. No dependency: psutil reads the same files.

On CUDA, NVML (``nvidia-ml-py``, imported only there) adds the GPU's utilisation and the
memory in use, read at each sample; without it those figures are absent and
``gpu_counters_note`` says why.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# per-process fields summed over the span (the rest, peaks, are the largest seen)
SUMMED = ("cpu_seconds", "ctx_voluntary", "ctx_involuntary", "faults_minor", "faults_major",
          "read_bytes")


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def process(pid: int | str) -> dict[str, int | float] | None:
    """One process's cumulative counters (None: it is gone, or there is no /proc)."""
    stat = _read(f"/proc/{pid}/stat")
    status = _read(f"/proc/{pid}/status")
    if stat is None or status is None:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    out: dict[str, int | float] = {
        "faults_minor": int(fields[7]), "faults_major": int(fields[9]),
        "cpu_seconds": (int(fields[11]) + int(fields[12])) / CLOCK_TICKS,
        "ctx_voluntary": 0, "ctx_involuntary": 0, "read_bytes": 0, "peak_rss_bytes": 0}
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name == "VmHWM":
            out["peak_rss_bytes"] = int(value.split()[0]) * 1024
    out["ctx_voluntary"], out["ctx_involuntary"] = context_switches(pid)
    io = _read(f"/proc/{pid}/io")  # absent without task I/O accounting: read_bytes stays 0
    for line in (io or "").splitlines():
        if line.startswith("read_bytes:"):
            out["read_bytes"] = int(line.split()[1])
    return out


def context_switches(pid: int | str) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of every thread of process ``pid``.

    /proc/<pid>/status counts its main thread's alone (stat's faults and CPU time are the
    whole process's): the run's decode threads, whose hand-offs are most of its switches,
    were missing (2 threads sleeping 2,000 times each: 7 counted of 4,007). The run's own
    process is read by getrusage, which keeps the counts of threads that have ended too; a
    child's threads are summed from /proc/<pid>/task/*/status (one that ended between two
    samples takes its counts since the first with it, as a worker does)."""
    if pid == "self":
        import resource

        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_nvcsw, usage.ru_nivcsw
    voluntary = involuntary = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tasks = []
    for tid in tasks or [None]:
        text = _read(f"/proc/{pid}/task/{tid}/status" if tid else f"/proc/{pid}/status")
        for line in (text or "").splitlines():
            name, _, value = line.partition(":")
            if name == "voluntary_ctxt_switches":
                voluntary += int(value)
            elif name == "nonvoluntary_ctxt_switches":
                involuntary += int(value)
    return voluntary, involuntary


# child processes that were there before the run's clock started (``predating``): not its
# workers (a server a test or a notebook started, an earlier run's lingering worker)
_PREDATING: set[str] = set()


def predating() -> None:
    """Leave the child processes alive now out of every later sample: the run's clock calls
    it before the loader starts its workers."""
    _PREDATING.clear()
    _PREDATING.update(children(every=True))


def children(every: bool = False) -> list[str]:
    """This process's child processes that its run started (its DataLoader workers), by
    pid; ``every``: those that predate it too."""
    found: set[str] = set()
    try:
        for task in os.listdir("/proc/self/task"):
            found.update((_read(f"/proc/self/task/{task}/children") or "").split())
    except OSError:
        pass
    if not every:
        found -= _PREDATING
    return sorted(found, key=int)


def cpu_ticks() -> tuple[int, int] | None:
    """The machine's (iowait, all) CPU ticks so far (/proc/stat's first line)."""
    text = _read("/proc/stat")
    if text is None:
        return None
    values = [int(v) for v in text.split("\n", 1)[0].split()[1:]]
    return values[4], sum(values[:8])  # user nice system idle iowait irq softirq steal


@dataclass
class Sample:
    """The counters at one moment: the machine's ticks, and per process its own."""

    at: float
    ticks: tuple[int, int] | None
    processes: dict[str, dict[str, int | float]]  # "main" or a child's pid -> counters
    gpu: dict[str, float] | None = None


def sample(gpu: Any = None) -> Sample:
    """The counters now (``gpu``: an ``Nvml`` to read as well)."""
    found = {"main": process("self")}
    for pid in children():
        found[pid] = process(pid)
    return Sample(time.perf_counter(), cpu_ticks(),
                  {k: v for k, v in found.items() if v is not None},
                  gpu.read() if gpu is not None else None)


@dataclass
class Counts:
    """Counts over one or more spans: summed per-process counters, their peaks, the
    machine's ticks, the GPU's readings."""

    seconds: float = 0.0
    main: dict[str, float] = field(default_factory=dict)
    workers: dict[str, dict[str, float]] = field(default_factory=dict)  # by pid
    iowait_ticks: int = 0
    all_ticks: int = 0
    gpu_util: list[float] = field(default_factory=list)  # one reading per span
    gpu_memory_bytes: float = 0.0  # the most seen
    known: bool = False  # /proc was read

    def add(self, other: Counts) -> None:
        if not other.known:
            return
        self.known = True
        self.seconds += other.seconds
        _merge(self.main, other.main)
        for pid, counts in other.workers.items():
            _merge(self.workers.setdefault(pid, {}), counts)
        self.iowait_ticks += other.iowait_ticks
        self.all_ticks += other.all_ticks
        self.gpu_util += other.gpu_util
        self.gpu_memory_bytes = max(self.gpu_memory_bytes, other.gpu_memory_bytes)

    def figures(self) -> dict[str, Any]:
        """The rates and peaks metrics.json declares (runner/measure/metrics.py); empty
        when nothing was counted."""
        if not self.known or self.seconds <= 0:
            return {}
        every = [self.main, *self.workers.values()]

        def rate(name: str) -> float:
            return sum(c.get(name, 0.0) for c in every) / self.seconds

        out: dict[str, Any] = {
            "iowait_frac": self.iowait_ticks / self.all_ticks if self.all_ticks else None,
            "ctx_switches_per_sec": rate("ctx_voluntary"),
            "ctx_switches_involuntary_per_sec": rate("ctx_involuntary"),
            "page_faults_major_per_sec": rate("faults_major"),
            "page_faults_minor_per_sec": rate("faults_minor"),
            "disk_read_bytes": int(sum(c.get("read_bytes", 0) for c in every)),
            "disk_read_mb_per_sec": rate("read_bytes") / 1e6,
            "main_cpu": self.main.get("cpu_seconds", 0.0) / self.seconds,
            "worker_cpu": [w.get("cpu_seconds", 0.0) / self.seconds
                           for _, w in sorted(self.workers.items(), key=lambda kv: int(kv[0]))],
            "peak_rss_bytes": int(self.main.get("peak_rss_bytes", 0)),
            "workers_peak_rss_bytes": int(sum(w.get("peak_rss_bytes", 0)
                                              for w in self.workers.values())),
        }
        if self.gpu_util:
            out["gpu_util_frac"] = sum(self.gpu_util) / len(self.gpu_util)
            out["gpu_memory_bytes"] = int(self.gpu_memory_bytes)
        return out


def _merge(into: dict[str, float], counts: dict[str, float]) -> None:
    for name, value in counts.items():
        if name in SUMMED:
            into[name] = into.get(name, 0.0) + value
        else:
            into[name] = max(into.get(name, 0.0), value)


def delta(a: Sample, b: Sample) -> Counts:
    """The counts between two samples: a process in both counts what it did between them
    (one that appeared in between, all it did so far; one that left, nothing)."""
    counts = Counts(seconds=b.at - a.at, known=b.ticks is not None)
    if a.ticks is not None and b.ticks is not None:
        counts.iowait_ticks = b.ticks[0] - a.ticks[0]
        counts.all_ticks = b.ticks[1] - a.ticks[1]
    for key, now in b.processes.items():
        before = a.processes.get(key, {})
        diff = {name: (value - before.get(name, 0) if name in SUMMED else value)
                for name, value in now.items()}
        if key == "main":
            counts.main = diff
        else:
            counts.workers[key] = diff
    if b.gpu is not None:
        counts.gpu_util.append(b.gpu["util"])
        counts.gpu_memory_bytes = b.gpu["memory_bytes"]
    return counts


class Nvml:
    """The GPU's utilisation and memory in use through NVML (``nvidia-ml-py``)."""

    def __init__(self, index: int):
        import pynvml  # nvidia-ml-py; ImportError: the caller says so

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)

    def read(self) -> dict[str, float]:
        util = self.nvml.nvmlDeviceGetUtilizationRates(self.handle)
        memory = self.nvml.nvmlDeviceGetMemoryInfo(self.handle)
        return {"util": util.gpu / 100.0, "memory_bytes": float(memory.used)}


def open_nvml(device: Any) -> tuple[Nvml | None, str | None]:
    """An ``Nvml`` for a CUDA ``device``, or None and why not (not CUDA: no reason)."""
    if getattr(device, "type", None) != "cuda":
        return None, None
    try:
        return Nvml(device.index or 0), None
    except ImportError:
        return None, "GPU utilisation and memory not counted: pip install nvidia-ml-py"
    except Exception as e:  # NVML present but failing (a driver mismatch, a container)
        return None, f"GPU utilisation and memory not counted: NVML: {type(e).__name__}: {e}"


def summary(figures: dict[str, Any]) -> str:
    """The counters in a few words (the timeline's lane, the verdict's evidence)."""
    parts = []
    if figures.get("iowait_frac") is not None:
        parts.append(f"iowait {figures['iowait_frac']:.0%}")
    if "ctx_switches_per_sec" in figures:
        parts.append(f"{figures['ctx_switches_per_sec'] + figures['ctx_switches_involuntary_per_sec']:,.0f} cs/s")
    if "page_faults_major_per_sec" in figures:
        parts.append(f"{figures['page_faults_major_per_sec']:,.0f} major faults/s")
    if "disk_read_mb_per_sec" in figures:
        parts.append(f"{figures['disk_read_mb_per_sec']:,.1f} MB/s read")
    if "gpu_util_frac" in figures:
        parts.append(f"GPU {figures['gpu_util_frac']:.0%}")
    return ", ".join(parts)
