"""``run.timeline=true`` (default): what every lane of the pipeline did, over a few steps.

Each stage records its start and end (``time.perf_counter``: the system's monotonic
clock, the same in every process) into a per-process list: loader workers their reads,
decodes, gathers and collates; the main thread (and a prefetch thread) its waits for the
next batch, gathers, the copy to the device, augmentation and the model step. Workers
append their spans to a file per process in the run folder after each batch. After the
loop, the spans of a few consecutive steps after warm-up are drawn as one lane per
process/thread: ``timeline.png``, with the data in ``timeline.json``. Overlap, or its
absence, shows at a glance. A pass of several models draws each model's forward (with its
reduction) on a lane of its own under the main thread's (on the CPU, where host time is
the model's time).

Recording costs two clock reads and one append per span; each process keeps at most
``LIMIT`` spans, so a long run records its beginning only (which is where the window is).
On CUDA the main thread's spans are host time: the launch of the copy and of the step,
not their execution on the device. So the device gets two lanes of its own, drawn from
CUDA events (``record_device``): the copy stream (the GPU prefetcher's copies, recorded on
its side stream where it issues them) and the compute stream (the loop's copy when no side
stream does it, its augmentation and its step, from the step clock's events): the
read / copy / compute picture that shows whether prefetching overlaps the copy with the
step. Events are only kept while the run goes (no sync per step); after the loop, one sync
resolves them to host time through an anchor event taken once, with the device idle, at
the first one (``_anchor``). On the CPU there are no such lanes.

The same spans are also written as a Chrome trace-event file, ``timeline.trace.json``
(``trace_events``), which Perfetto (https://ui.perfetto.dev) and chrome://tracing open:
one complete event (``ph: "X"``, µs from the first step shown) per span of
``timeline.json``, a process per process (the GPU's streams one of their own) and a named
thread per lane. (Not ``trace.json``: that is ``profile.enabled=true``'s torch.profiler trace.)

The system's counters (runner/measure/counters.py: iowait, context switches, page faults,
bytes read, GPU use) are read at the timed windows' edges, not per step (a read of /proc
costs more than a fast step); each window that overlaps the steps shown is drawn as one
span on a lane of its own, ``counters``, labelled with its rates, and written to the trace
as counter events (Perfetto draws them as tracks).

On CUDA the stages are also NVTX ranges, for Nsight Systems (``nsys profile``): the loop's
(wait, copy, augment, step; ``nvtx_stage``, through runner/measure/profile.py's
``stage_range``) and those recorded with ``span`` (collate, gather). Whether NVTX is on is
decided once, in the main process, from ``torch.cuda.is_available()`` (``nvtx_on``); where
it is not, ``span`` and ``stage_range`` cost what they cost before (no call into NVTX).
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from runner.common.atomic import dumps

LIMIT = 200_000  # spans kept per process
STEPS_SHOWN = 4  # consecutive steps drawn after warm-up

_state: dict[str, Any] = {"dir": None, "nvtx": None}  # nvtx: None until ``nvtx_on`` asks
_spans: list[tuple[str, str, float, float]] = []  # (lane, stage, start, end)
_written = 0  # spans of this process already appended to its file
# (lane, stage, start event, end event) recorded on a CUDA stream, resolved after the run
_device: list[tuple[str, str, Any, Any]] = []
DEVICE_LIMIT = 4_000  # event pairs kept: the first steps, where the window is
# (start, end, figures) of each window the system's counters were read over (main process)
_counters: list[tuple[float, float, dict[str, Any]]] = []
COUNTERS_LANE = "counters"
_anchor: dict[str, Any] = {}  # a CUDA event and the host time it ran at (``_set_anchor``)
COPY_STREAM, COMPUTE_STREAM = "GPU copy stream", "GPU compute stream"


def enable(folder: Path) -> None:
    """Record from now on, in this process and in the workers it forks later."""
    global _written
    folder.mkdir(parents=True, exist_ok=True)
    nvtx_on()  # decided here, in the main process: forked workers inherit the answer
    for old in folder.glob("*.jsonl"):
        old.unlink()
    _state["dir"] = folder
    _spans.clear()
    _device.clear()
    _counters.clear()
    _anchor.clear()
    _written = 0


def disable() -> None:
    """Stop recording and remove the workers' span files."""
    folder, _state["dir"] = _state["dir"], None
    _spans.clear()
    _device.clear()
    _counters.clear()
    _anchor.clear()
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def enabled() -> bool:
    return _state["dir"] is not None


def lane() -> str:
    """The recording process and thread, as a lane name: ``main``, ``worker 1``,
    ``main/prefetch``."""
    if mp.parent_process() is None:
        name = "main"
    else:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        name = f"worker {info.id}" if info is not None else f"process {os.getpid()}"
    thread = threading.current_thread()
    if thread is not threading.main_thread():
        name += f"/{thread.name.removeprefix('runner-')}"
    return name


def record(stage: str, start: float, end: float, sub: str | None = None) -> None:
    """A span of ``stage`` on this thread's lane (``sub``: a lane of its own under it, as
    each model of a multi-model pass has)."""
    if _state["dir"] is not None and len(_spans) < LIMIT:
        _spans.append((lane() if sub is None else f"{lane()}/{sub}", stage, start, end))


def record_counters(start: float, end: float, figures: dict[str, Any]) -> None:
    """The system's counters over ``[start, end]`` (a timed window's span), for the
    ``counters`` lane."""
    if _state["dir"] is not None and figures and len(_counters) < LIMIT:
        _counters.append((start, end, figures))


def record_device(lane: str, stage: str, start: Any, end: Any) -> None:
    """A span of ``stage`` on a CUDA stream's lane (``COPY_STREAM``, ``COMPUTE_STREAM``),
    between two timing events recorded on that stream where the work is issued; kept
    unresolved (no sync) until ``write``. The first one takes the anchor (one sync)."""
    if _state["dir"] is None or len(_device) >= DEVICE_LIMIT:
        return
    if not _anchor:
        _set_anchor()
    _device.append((lane, stage, start, end))


def _set_anchor() -> None:
    """An event that runs on an idle device at a known host time: every device event's
    host time is the anchor's plus the device time between them."""
    import torch

    torch.cuda.synchronize()  # note: the one sync of the device lanes while the run goes
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    _anchor.update(event=event, host=time.perf_counter())


def _resolve_device() -> list[tuple[str, str, float, float]]:
    """The device spans recorded so far, on the host clock (after a sync, when CUDA is
    in use: every event has run)."""
    if not _device:
        return []
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    anchor, host = _anchor["event"], _anchor["host"]
    return [(lane, stage, host + anchor.elapsed_time(a) / 1e3,
             host + anchor.elapsed_time(b) / 1e3) for lane, stage, a, b in _device]


def nvtx_on() -> bool:
    """NVTX ranges are emitted: CUDA is available (asked once, then remembered)."""
    if _state["nvtx"] is None:
        import torch

        _state["nvtx"] = torch.cuda.is_available()
    return _state["nvtx"]


# the loop's stage names (runner/tasks/loop.py) as the timeline's lanes name them
NVTX_NAMES = {"data_wait": "wait", "compute": "step"}


@contextlib.contextmanager
def nvtx_stage(stage: str) -> Iterator[None]:
    """An NVTX range named as the timeline names ``stage`` (call only where ``nvtx_on``)."""
    import torch

    torch.cuda.nvtx.range_push(NVTX_NAMES.get(stage, stage))
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


@contextlib.contextmanager
def span(stage: str) -> Iterator[None]:
    if _state["dir"] is None:
        yield
        return
    nvtx = _state["nvtx"]
    if nvtx:
        import torch

        torch.cuda.nvtx.range_push(stage)
    start = time.perf_counter()
    try:
        yield
    finally:
        record(stage, start, time.perf_counter())
        if nvtx:
            torch.cuda.nvtx.range_pop()


def flush() -> None:
    """In a worker process: append the spans recorded since the last flush to this
    process's file (the main process keeps its own in memory)."""
    global _written
    folder = _state["dir"]
    if folder is None or mp.parent_process() is None or _written >= len(_spans):
        return
    new = _spans[_written:]
    _written = len(_spans)
    try:
        with open(folder / f"{os.getpid()}.jsonl", "a") as f:
            f.write("".join(dumps(s) + "\n" for s in new))
    except OSError:
        pass  # a timeline is never worth a failed batch


def collect(start: float, end: float) -> list[tuple[str, str, float, float]]:
    """Every process's spans that overlap ``[start, end]``, the device's included."""
    spans = list(_spans) + _resolve_device()
    folder = _state["dir"]
    if folder is not None:
        for file in folder.glob("*.jsonl"):
            for line in file.read_text().splitlines():
                try:
                    spans.append(tuple(json.loads(line)))
                except ValueError:
                    continue  # a line cut by a worker that was stopped mid-write
    return [s for s in spans if s[3] >= start and s[2] <= end]


COLORS = {"read": "#8c564b", "decode": "#d62728", "gather": "#9467bd", "collate": "#e377c2",
          "wait": "#bbbbbb", "copy": "#ff7f0e", "augment": "#bcbd22", "step": "#2ca02c",
          "model": "#17becf", "compute": "#1f77b4"}
DEVICE_LANES = (COPY_STREAM, COMPUTE_STREAM)


def _lane_order(name: str) -> tuple:
    """Workers first, then the main process, then the device's streams (copy, compute)."""
    device = DEVICE_LANES.index(name) if name in DEVICE_LANES else -1
    return (device >= 0, name.startswith("main"), device, name)


def write(run_dir: Path, step_spans: list[tuple[float, float]], warmup: int,
          title: str) -> dict[str, Any]:
    """Draw the steps after warm-up (``STEPS_SHOWN`` of them) into ``timeline.png`` and
    ``timeline.json``, and return their figures (none when the run timed no step, or when
    they could not be written: a picture is never worth the run)."""
    try:
        return _write(run_dir, step_spans, warmup, title) or {}
    except Exception as e:
        logging.getLogger("runner").warning("timeline.png could not be drawn: %s: %s",
                                            type(e).__name__, e)
        return {}


def _write(run_dir: Path, step_spans: list[tuple[float, float]], warmup: int,
           title: str) -> dict[str, Any] | None:
    shown = step_spans[warmup : warmup + STEPS_SHOWN]
    if not shown:
        return None
    start, end = shown[0][0], shown[-1][1]
    spans = collect(start, end)
    lanes = sorted({s[0] for s in spans}, key=_lane_order)
    data = {
        "title": title, "unit": "ms from the first step shown",
        "steps": [[(a - start) * 1e3, (b - start) * 1e3] for a, b in shown],
        "spans": [{"lane": s[0], "stage": s[1], "start": (max(s[2], start) - start) * 1e3,
                   "end": (min(s[3], end) - start) * 1e3} for s in spans],
    }
    counted = [c for c in _counters if c[1] >= start and c[0] <= end]
    if counted:
        from runner.measure.counters import summary

        lanes.append(COUNTERS_LANE)
        data["counters"] = [{"start": (max(a, start) - start) * 1e3,
                             "end": (min(b, end) - start) * 1e3, "label": summary(f),
                             "figures": {k: v for k, v in f.items() if not isinstance(v, list)}}
                            for a, b, f in counted]
    json_path = run_dir / "timeline.json"
    json_path.write_text(dumps(data, indent=1) + "\n")
    trace_path = run_dir / TRACE
    trace_path.write_text(dumps(trace_events(data, lanes)) + "\n")
    png = run_dir / "timeline.png"
    try:
        draw(data, lanes, png)
    except Exception:  # matplotlib missing or failing: the JSON is the record
        png = None
    busy = {name: sum(s["end"] - s["start"] for s in data["spans"] if s["lane"] == name)
            for name in lanes if name != COUNTERS_LANE}
    total = (end - start) * 1e3
    return {"timeline": str(png or json_path), "timeline_json": str(json_path),
            "timeline_trace": str(trace_path),
            "timeline_busy": {k: v / total for k, v in busy.items()} if total else {}}


TRACE = "timeline.trace.json"


def trace_events(data: dict[str, Any], lanes: list[str]) -> dict[str, Any]:
    """``timeline.json``'s spans as a Chrome trace (the trace-event format): a complete
    event per span, in µs from the first step shown; a process per process of the run (the
    GPU's streams one of their own), a named thread per lane, in the picture's order."""
    pids: dict[str, int] = {}
    tids: dict[str, tuple[int, int]] = {}
    meta: list[dict[str, Any]] = []
    for order, name in enumerate(lanes):
        process = "GPU" if name in DEVICE_LANES else name.split("/", 1)[0]
        if process not in pids:
            pids[process] = pid = len(pids) + 1
            meta += [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                      "args": {"name": process}},
                     {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                      "args": {"sort_index": pid}}]
        tids[name] = (pids[process], order + 1)
        meta += [{"name": "thread_name", "ph": "M", "pid": pids[process], "tid": order + 1,
                  "args": {"name": name}},
                 {"name": "thread_sort_index", "ph": "M", "pid": pids[process],
                  "tid": order + 1, "args": {"sort_index": order + 1}}]
    events = [{"name": s["stage"], "cat": "device" if s["lane"] in DEVICE_LANES else "host",
               "ph": "X", "ts": s["start"] * 1e3, "dur": (s["end"] - s["start"]) * 1e3,
               "pid": tids[s["lane"]][0], "tid": tids[s["lane"]][1]} for s in data["spans"]]
    for c in data.get("counters", []):  # a counter track per figure (Perfetto, chrome://tracing)
        pid = tids[COUNTERS_LANE][0]
        events += [{"name": name, "ph": "C", "ts": c["start"] * 1e3, "pid": pid,
                    "args": {name: value}} for name, value in c["figures"].items()
                   if isinstance(value, int | float) and value is not None]
    return {"traceEvents": meta + events, "displayTimeUnit": "ms",
            "otherData": {"title": data["title"]}}


def draw(data: dict[str, Any], lanes: list[str], path: Path) -> None:
    fig = figure(data, lanes)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)


def figure(data: dict[str, Any], lanes: list[str]):
    """The timeline as a matplotlib figure: one lane per process or thread, the stages as
    bars, the legend to the right of the axes (below them it covered the axis label of a
    timeline with one lane)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 0.55 * len(lanes) + 1.8))
    seen = set()
    for row, name in enumerate(lanes):
        for s in data["spans"]:
            if s["lane"] != name:
                continue
            label = s["stage"] if s["stage"] not in seen else None
            seen.add(s["stage"])
            ax.broken_barh([(s["start"], max(s["end"] - s["start"], 1e-3))], (row - 0.35, 0.7),
                           color=COLORS.get(s["stage"], "C0"), label=label,
                           edgecolor="white", linewidth=0.3)
        if name == COUNTERS_LANE:
            for c in data.get("counters", []):
                ax.broken_barh([(c["start"], max(c["end"] - c["start"], 1e-3))],
                               (row - 0.35, 0.7), color="#eeeeee", edgecolor="#999999")
                ax.text(c["start"], row, f" {c['label']}", fontsize=7, va="center")
    for k, (a, _) in enumerate(data["steps"]):
        ax.axvline(a, color="black", alpha=0.25, linewidth=0.8)
        ax.text(a, len(lanes) - 0.4, f" step {k + 1}", fontsize=7, va="bottom")
    ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
    ax.set_ylim(-0.6, len(lanes))
    ax.invert_yaxis()
    ax.set_xlabel("ms (a few consecutive steps after warm-up)")
    ax.set_title(data["title"], fontsize=8)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    return fig
