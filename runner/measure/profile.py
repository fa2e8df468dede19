"""``profile.enabled=true``: a torch.profiler window, written as a Chrome trace with its
``key_averages`` table beside it (config group ``profile.*``: runner/config/schema.py).

The schedule (``torch.profiler.schedule``) skips ``skip_first`` steps once, then per cycle
idles ``wait`` steps, warms the profiler up for ``warmup`` (recorded and thrown away) and
records ``active``; ``repeat`` cycles (0: until the run ends). The loop's stages appear as
named ranges (data_wait, copy, augment, compute). Each cycle writes ``trace.json`` (the
second ``trace-2.json``, ...) and ``profile_table.txt``: the ops sorted by their self time
(CUDA's on a GPU, else CPU's), what ``prof.key_averages().table`` prints. A run shorter
than the schedule is said in one line before it starts (``too_short``). Open the trace in
https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from runner.measure import timeline

TABLE_ROWS = 40  # ops in the table: the top of the self-time ranking


def steps_needed(skip_first: int, wait: int, warmup: int, active: int, repeat: int) -> int:
    """Steps the schedule needs for its cycles (one cycle when ``repeat`` is 0)."""
    return skip_first + (wait + warmup + active) * max(repeat, 1)


def too_short(total_steps: int, **schedule_keys: int) -> str | None:
    """One line when a run of ``total_steps`` is shorter than the schedule, else None."""
    needed = steps_needed(**schedule_keys)
    if total_steps >= needed:
        return None
    k = schedule_keys
    lead = k["skip_first"] + k["wait"] + k["warmup"]
    recorded = max(0, min(k["active"], total_steps - lead))  # of the first cycle
    what = (f"its trace records {recorded} of its {k['active']} active steps"
            if recorded < k["active"] else "it records fewer cycles than profile.repeat asks")
    return (f"profile: the schedule needs {needed} steps (skip_first={k['skip_first']}, "
            f"wait={k['wait']}, warmup={k['warmup']}, active={k['active']}, "
            f"repeat={k['repeat']}) and this run has {total_steps}, so {what}: set "
            f"run.steps={needed} or shorten profile.wait, warmup or active")


def cycle_file(run_dir: Path, stem: str, suffix: str, cycle: int) -> Path:
    """The file of a profiler cycle: ``trace.json``, then ``trace-2.json``, ..."""
    return Path(run_dir) / (f"{stem}{suffix}" if cycle == 1 else f"{stem}-{cycle}{suffix}")


def build_profiler(run_dir: Path, device: torch.device, total_steps: int, *,
                   skip_first: int = 0, wait: int = 2, warmup: int = 2, active: int = 5,
                   repeat: int = 1, record_shapes: bool = False, profile_memory: bool = False,
                   with_stack: bool = False, enabled: bool = True) -> profile:
    """A profiler with this schedule (``profile.*``), writing each cycle's trace and table
    to ``run_dir``; a run of ``total_steps`` too short for it is said in one line."""
    short = too_short(total_steps, skip_first=skip_first, wait=wait, warmup=warmup,
                      active=active, repeat=repeat)
    if short is not None:
        logging.getLogger("runner").warning("%s", short)
    activities = [ProfilerActivity.CPU]
    cuda = device.type == "cuda"
    if cuda:
        activities.append(ProfilerActivity.CUDA)
    cycles = {"done": 0}

    def ready(p: Any) -> None:
        cycles["done"] += 1
        n = cycles["done"]
        p.export_chrome_trace(str(cycle_file(run_dir, "trace", ".json", n)))
        cycle_file(run_dir, "profile_table", ".txt", n).write_text(table(p, cuda) + "\n")

    return profile(
        activities=activities,
        schedule=schedule(skip_first=skip_first, wait=wait, warmup=warmup, active=active,
                          repeat=repeat),
        on_trace_ready=ready, record_shapes=record_shapes, profile_memory=profile_memory,
        with_stack=with_stack,
    )


def table(p: Any, cuda: bool) -> str:
    """The ops of a recorded cycle by self time (CUDA's on a GPU, else the CPU's)."""
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return p.key_averages().table(sort_by=sort_by, row_limit=TABLE_ROWS)


def stage_range(profiling: bool):
    """``record_function`` while profiling; else, where CUDA is available, an NVTX range
    named as the timeline names the stage (runner/measure/timeline.py: for Nsight
    Systems); else a no-op (no cost in the hot path)."""
    if profiling:
        return record_function
    return timeline.nvtx_stage if timeline.nvtx_on() else (lambda name: contextlib.nullcontext())
