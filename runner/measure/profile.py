"""``profile=true``: a short torch.profiler window, written as a Chrome trace.

The schedule skips the first steps (``wait``), warms the profiler up, then records
``active`` steps; the loop's stages appear as named ranges (data_wait, copy, augment,
compute). Open ``trace.json`` in chrome://tracing or https://ui.perfetto.dev.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from runner.measure import timeline

WAIT, WARMUP, ACTIVE = 2, 2, 5


def build_profiler(run_dir: Path, device: torch.device) -> profile:
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    trace = Path(run_dir) / "trace.json"
    return profile(
        activities=activities,
        schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(trace)),
    )


def stage_range(profiling: bool):
    """``record_function`` while profiling; else, where CUDA is available, an NVTX range
    named as the timeline names the stage (runner/measure/timeline.py: for Nsight
    Systems); else a no-op (no cost in the hot path)."""
    if profiling:
        return record_function
    return timeline.nvtx_stage if timeline.nvtx_on() else (lambda name: contextlib.nullcontext())
