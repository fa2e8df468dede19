"""A run's results: the figures of metrics.json, built from what the loop measured.

Pure functions of their arguments (no device, no collectives): the loop's windows become
figures, every rank's figures become the run's, and a config becomes its one-line name.

``ms_per_step`` is the median of the repeat windows; each stage's ``<stage>_ms`` (data
wait, copy, augmentation, compute, and a training step's optimizer step and EMA update) is
that stage's share of the timed time (``<stage>_frac``) times that same step, so no
stage is ever longer than the step it is part of (a stage's mean over all windows beside
the windows' median could be: a slow first window lifts the one and not the other).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from runner.common.text import printable
from runner.config.rules import model_configs
from runner.config.schema import Config
from runner.data.storage import STORAGES
from runner.measure.clock import STAGES
from runner.measure.stats import quantiles
from runner.tasks.loop import LoopResult

MIN_STEPS_PER_REPEAT = 5  # fewer timed steps than this in a window: too few to trust
WIDE_SPREAD = 0.25  # (max - min) / median of the windows' images/s beyond this: noisy
# other processes running on this many cores (or a quarter of the machine, if more) while a
# window was timed: the figure is that of a shared machine, not of the configuration
SHARED_CORES = 0.5


def shared_limit() -> float:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    return max(SHARED_CORES, 0.25 * cores)


def disturbance(figures: dict[str, Any]) -> str | None:
    """Why the figures are a shared machine's rather than this configuration's, or None:
    other processes ran on the cores while the windows were timed."""
    others = figures.get("others_cores")
    if others is not None and others >= shared_limit():
        return (f"disturbed: other processes used {others:.1f} cores while it was timed (a "
                "virtual machine's steal time counts too), so its figures are a shared "
                "machine's; run it again on idle cores to compare")
    return None


def describe(cfg: Config) -> str:
    """The run's options in one line, e.g. ``loader=folder decoder=pil workers=2 ...``."""
    parts = [f"loader={cfg.loader.name.value}"]
    kind = STORAGES[cfg.loader.name]
    if kind.decodes_per_epoch and not kind.own_loader:
        parts.append(f"decoder={cfg.loader.decoder.value}")
    parts += [f"workers={cfg.loader.num_workers}", f"batch={cfg.loader.batch_size}",
              f"prefetch={cfg.prefetch.name.value}", f"amp={cfg.amp.name.value}",
              f"compile={cfg.compile.name.value}"]
    if cfg.models:
        parts.append(f"models=[{','.join(m.label for m in model_configs(cfg))}]")
    else:
        parts.append(f"model={cfg.model.name}")
    parts.append(f"task={cfg.task.name.value}")
    return " ".join(parts)


def spread_figures(rates: list[float], step_ms: list[float]) -> dict[str, Any]:
    """The median images/s and ms/step of the repeat windows, with their spread."""
    if not rates:
        return {"images_per_sec": None, "ms_per_step": None, "repeats": 0}
    ips, ms = quantiles(rates), quantiles(step_ms)
    return {"images_per_sec": ips["median"], "ms_per_step": ms["median"],
            "repeats": len(rates), "spread": {"images_per_sec": ips, "ms_per_step": ms},
            "spread_frac": (ips["max"] - ips["min"]) / ips["median"] if ips["median"] else None}


def flags(figures: dict[str, Any], repeats_asked: int, window_seconds: float = 0.0
          ) -> list[str]:
    """Why a figure should not be trusted as it stands: too few steps, too few windows,
    windows too short to be stable, or windows that disagree."""
    out = []
    steps, repeats = figures.get("timed_steps") or 0, figures.get("repeats") or 0
    if steps < MIN_STEPS_PER_REPEAT * max(repeats_asked, 1):
        out.append(f"few timed steps ({steps}; time at least "
                   f"{MIN_STEPS_PER_REPEAT * max(repeats_asked, 1)})")
    if repeats < min(repeats_asked, 3):
        out.append(f"{repeats} timed window(s): no spread to judge noise by")
    seconds = figures.get("timed_seconds") or 0.0
    if repeats and window_seconds > 0 and seconds / repeats < 0.8 * window_seconds:
        steps_needed = math.ceil(steps * window_seconds * repeats / max(seconds, 1e-9))
        out.append(f"short windows ({1000 * seconds / repeats:,.0f} ms each, run.window_seconds"
                   f"={window_seconds:g}): about {steps_needed:,} timed steps would fill them")
    if (figures.get("spread_frac") or 0.0) > WIDE_SPREAD:
        out.append(f"wide spread (windows differ by {figures['spread_frac']:.0%})")
    disturbed = disturbance(figures)
    if disturbed:
        out.append(disturbed)
    return out


SHARED_MIN_SECONDS = 0.5  # CPU time is counted in 10 ms ticks: shorter spans are too coarse


def others_cores(windows: list) -> float | None:
    """Cores other processes used while the run was timed: the most of any repeat window
    long enough to tell, or of all of them together (None: unknown here, or too short a
    span to tell)."""
    known = [(w.others_cpu, w.others_span or w.seconds) for w in windows
             if w.others_cpu is not None]
    spans = [(cpu, span) for cpu, span in known if span >= SHARED_MIN_SECONDS]
    total = sum(span for _, span in known)
    if total >= SHARED_MIN_SECONDS:
        spans.append((sum(cpu for cpu, _ in known), total))
    if not spans:
        return None
    return max(max(0.0, cpu / span) for cpu, span in spans)


def loop_figures(result: LoopResult, skipped: list[str], repeats_asked: int = 3,
                 window_seconds: float = 0.0) -> dict[str, Any]:
    """images/s and ms/step (the median of the repeat windows, with their spread), stage
    shares over all timed steps, the step counts and the flags that qualify them."""
    windows = [w.figures() for w in result.repeats if w.steps]
    figures = {
        **result.timed.figures(),
        "images_per_sec_mean": result.timed.figures()["images_per_sec"],
        **spread_figures([w["images_per_sec"] for w in windows],
                         [w["ms_per_step"] for w in windows]),
        "steps": result.steps,
        "images": result.images,
        "warmup_steps": result.warmup_steps,
        "timed_steps": result.timed.steps,
        "timed_images": result.timed.images,
        "timed_seconds": result.timed.seconds,
        "skipped_files": sorted(printable(f) for f in skipped),
        "skipped_count": len(skipped),
    }
    figures["others_cores"] = others_cores(result.repeats)
    step_shares(figures)
    figures["flags"] = flags(figures, repeats_asked, window_seconds)
    figures["disturbed"] = disturbance(figures) is not None
    return figures


# parts of the compute stage a training step times on its own (``<name>_seconds`` from
# TrainStep.costs): each becomes its share of the step, as the loop's stages are
STEP_PARTS = ("optimizer", "ema")


def step_shares(figures: dict[str, Any]) -> dict[str, Any]:
    """Each stage's ms as its share of the step ``ms_per_step`` reports (in place).

    The loop's stages: ``<stage>_frac`` (its share of the timed time) times
    ``ms_per_step``. A training step's own parts (``optimizer_seconds``, ``ema_seconds``:
    their time over the timed steps) become ``<name>_frac`` and ``<name>_ms`` the same way,
    never more than the compute they are part of."""
    step, seconds = figures.get("ms_per_step"), figures.get("timed_seconds")
    compute = figures.get("compute_frac")
    for part in STEP_PARTS:
        spent = figures.pop(f"{part}_seconds", None)
        if spent is not None:
            share = spent / seconds if seconds else None
            if share is not None and compute is not None:
                share = min(share, compute)  # a part of the step's compute, never more
            figures[f"{part}_frac"] = share
    for stage in (*STAGES, "gpu_idle", *STEP_PARTS):
        if f"{stage}_frac" in figures:
            share = figures[f"{stage}_frac"]
            figures[f"{stage}_ms"] = share * step if share is not None and step is not None \
                else None
    return figures


def device_figures(device) -> dict[str, str]:
    """The device the run used, by name."""
    import platform

    import torch

    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or platform.machine())
    return {"device": str(device), "device_name": name}


def epochs(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-epoch figures (validation loss, top-1, top-5, or a detector's mAP figures; the
    EMA's too), and the last validated epoch's as the run's."""
    if not rows:
        return {}
    last = next((e for e in reversed(rows) if any(k.startswith("val_") for k in e)), {})
    return {"epochs": rows, **{k: v for k, v in last.items() if k.startswith("val_")}}


def rank_figures(rank: int, figures: dict[str, Any], result: LoopResult,
                 parameters: str | None, node: int = 0) -> dict[str, Any]:
    """What one rank sends rank 0 (``merge_ranks``)."""
    windows = [w.figures() for w in result.repeats if w.steps]
    return {
        "rank": rank,
        "node": node,
        "steps": result.steps,
        # data read from a URL, by this rank: all of it, and the shard set's indexes
        "remote_bytes": figures.get("remote_bytes"),
        "remote_index_bytes": figures.get("remote_index_bytes"),
        "repeat_rates": [w["images_per_sec"] for w in windows],
        "repeat_ms": [w["ms_per_step"] for w in windows],
        "images": result.images,
        "timed_images": result.timed.images,
        "timed_seconds": result.timed.seconds,
        "images_per_sec": figures["images_per_sec"],
        "ms_per_step": figures["ms_per_step"],
        "data_wait_frac": figures["data_wait_frac"],
        "skipped_files": figures["skipped_files"],
        "parameters": parameters,
    }


def merge_ranks(figures: dict[str, Any], every: list[dict[str, Any]], backend: str,
                repeats_asked: int = 3) -> dict[str, Any]:
    """Rank 0's figures for the whole run: images summed, time and data wait at their
    worst rank, skipped files joined, the replicas' parameter digests compared."""
    every = [dict(r) for r in every]
    seconds = max(r["timed_seconds"] for r in every)
    images = sum(r["timed_images"] for r in every)
    skipped = sorted({f for r in every for f in r.pop("skipped_files")})
    digests = {r["parameters"] for r in every}
    # every rank runs the same steps, so its k-th window spans the same steps: the run's
    # k-th window moved the ranks' images together, at the pace of the slowest rank
    windows = min(len(r["repeat_rates"]) for r in every)
    rates = [sum(r["repeat_rates"][k] for r in every) for k in range(windows)]
    step_ms = [max(r["repeat_ms"][k] for r in every) for k in range(windows)]
    for r in every:
        r.pop("repeat_rates"), r.pop("repeat_ms")
    fetched: dict[int, list[int]] = {}  # bytes read from a URL and of them the indexes
    for r in every:  # per node (its ranks share one cache)
        if r.get("remote_bytes") is not None:
            node = fetched.setdefault(r["node"], [0, 0])
            node[0] += r["remote_bytes"]
            node[1] += r.get("remote_index_bytes") or 0
    merged = {
        **figures,
        **spread_figures(rates, step_ms),
        "images_per_sec_mean": images / seconds if seconds > 0 else None,
        "data_wait_frac": max(r["data_wait_frac"] or 0.0 for r in every),
        "images": sum(r["images"] for r in every), "timed_images": images,
        "timed_seconds": seconds, "skipped_files": skipped, "skipped_count": len(skipped),
        "distributed": {"world": len(every), "backend": backend, "ranks": every,
                        "replicas_in_sync": len(digests) == 1 if None not in digests else None},
    }
    if fetched:
        merged["remote_bytes"] = sum(b for b, _ in fetched.values())
        merged["distributed"]["remote_bytes_per_node"] = [fetched[n][0] for n in sorted(fetched)]
        merged["distributed"]["remote_index_bytes_per_node"] = [fetched[n][1]
                                                                for n in sorted(fetched)]
    step_shares(merged)  # the run's step is its slowest rank's
    merged["flags"] = flags(merged, repeats_asked)
    merged["disturbed"] = disturbance(merged) is not None
    return merged


def end_figures(figures: dict[str, Any], device: Any, task: dict[str, Any],
                data: dict[str, Any], run_dir: Path, profiled: bool) -> dict[str, Any]:
    """The loop's ``figures`` with the setup's, the ``task``'s (runner/tasks/) and the
    ``data`` path's; each stage's share of the step (the task's own parts too); the
    profiler's trace."""
    figures.update(**device_figures(device), **task, **data)
    step_shares(figures)  # the task's own parts (optimizer, EMA) of the step
    if profiled:  # a run too short for the schedule was said so before it started
        figures["trace"] = trace_file(run_dir)
        table = Path(run_dir) / "profile_table.txt"
        figures["profile_table"] = str(table) if table.exists() else None
    return figures


def trace_file(run_dir: Path) -> str | None:
    """The profiler's trace, when the run was long enough to record one."""
    trace = Path(run_dir) / "trace.json"
    return str(trace) if trace.exists() else None


def summary_line(cfg: Config, figures: dict[str, Any], world: int = 1) -> str | None:
    """The run's result in one line, for the log (None when nothing was timed)."""
    if figures.get("images_per_sec") is None:
        return None
    ranks = f" over {world} ranks" if world > 1 else ""
    line = (f"{describe(cfg)}: {figures['images_per_sec']:.1f} images/s{ranks}, "
            f"{figures['ms_per_step']:.1f} ms/step, data wait "
            f"{100 * figures['data_wait_frac']:.0f}% of step time "
            f"({figures['timed_steps']} timed steps)")
    if cfg.task.name.trains and "loss_first" in figures:
        line += f"; loss {figures['loss_first']:.3f} -> {figures['loss_last']:.3f}"
    parts = [f"{name} {figures[key]:.2f} ms" for key, name in (
        ("augment_ms", "augmentation"), ("optimizer_ms", "optimizer step"),
        ("ema_ms", "EMA update")) if figures.get(key)]
    if parts:  # what a recipe costs, per step: each a share of the step above
        line += f"; of each step: {', '.join(parts)}"
    return line


def announce(cfg: Config, figures: dict[str, Any], world: int = 1) -> None:
    """The run's result on the console: its summary line, the files it skipped, and why
    its figures are disturbed, unless the verdict that follows says that (its sentence
    gives the same reason: said once)."""
    import logging

    log = logging.getLogger("runner")
    line = summary_line(cfg, figures, world)
    if line is not None:
        log.info("%s", line)
    if figures["skipped_files"]:
        log.warning("%d files skipped: images that did not decode or labels left out "
                    "(listed in metrics.json's skipped_files)", len(figures["skipped_files"]))
    verdict_follows = cfg.diagnose and figures.get("images_per_sec") is not None
    for flag in figures.get("flags") or []:
        if flag.startswith("disturbed") and not verdict_follows:
            log.warning("%s", flag)
