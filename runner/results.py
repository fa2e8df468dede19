"""A run's results: the figures of metrics.json, built from what the loop measured.

Pure functions of their arguments (no device, no collectives): the loop's windows become
figures, every rank's figures become the run's, and a config becomes its one-line name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runner.config import Config, Storage, TaskName
from runner.loop import LoopResult
from runner.pagecache import ColdPageCache


def describe(cfg: Config) -> str:
    """The run's options in one line, e.g. ``loader=folder decoder=pil workers=2 ...``."""
    parts = [f"loader={cfg.loader.name.value}"]
    if cfg.loader.name is Storage.folder:
        parts.append(f"decoder={cfg.loader.decoder.value}")
    parts += [f"workers={cfg.loader.num_workers}", f"batch={cfg.loader.batch_size}",
              f"prefetch={cfg.prefetch.name.value}", f"amp={cfg.amp.name.value}",
              f"compile={cfg.compile.name.value}"]
    if cfg.models:
        parts.append(f"models=[{','.join(m.value for m in cfg.models)}]")
    else:
        parts.append(f"model={cfg.model.name.value}")
    parts.append(f"task={cfg.task.name.value}")
    return " ".join(parts)


def loop_figures(result: LoopResult, skipped: list[str]) -> dict[str, Any]:
    """images/s, ms/step and stage shares of the timed steps, with the step counts."""
    return {
        **result.timed.figures(),
        "steps": result.steps,
        "images": result.images,
        "warmup_steps": result.warmup_steps,
        "timed_steps": result.timed.steps,
        "timed_images": result.timed.images,
        "timed_seconds": result.timed.seconds,
        "skipped_files": sorted(skipped),
        "skipped_count": len(skipped),
    }


def page_cache_figures(page_cache: ColdPageCache | None) -> dict[str, Any]:
    if page_cache is None:
        return {"page_cache": "warm"}
    return {"page_cache": page_cache.state, "page_cache_note": page_cache.note,
            "evictions": page_cache.evictions, "evict_seconds": page_cache.seconds}


def rank_figures(rank: int, figures: dict[str, Any], result: LoopResult,
                 parameters: str | None) -> dict[str, Any]:
    """What one rank sends rank 0 (``merge_ranks``)."""
    return {
        "rank": rank,
        "images": result.images,
        "timed_images": result.timed.images,
        "timed_seconds": result.timed.seconds,
        "images_per_sec": figures["images_per_sec"],
        "ms_per_step": figures["ms_per_step"],
        "data_wait_frac": figures["data_wait_frac"],
        "skipped_files": figures["skipped_files"],
        "parameters": parameters,
    }


def merge_ranks(figures: dict[str, Any], every: list[dict[str, Any]], backend: str
                ) -> dict[str, Any]:
    """Rank 0's figures for the whole run: images summed, time and data wait at their
    worst rank, skipped files joined, the replicas' parameter digests compared."""
    every = [dict(r) for r in every]
    seconds = max(r["timed_seconds"] for r in every)
    images = sum(r["timed_images"] for r in every)
    skipped = sorted({f for r in every for f in r.pop("skipped_files")})
    digests = {r["parameters"] for r in every}
    return {
        **figures,
        "images_per_sec": images / seconds if seconds > 0 else None,
        "ms_per_step": max(r["ms_per_step"] or 0.0 for r in every),
        "data_wait_frac": max(r["data_wait_frac"] or 0.0 for r in every),
        "images": sum(r["images"] for r in every), "timed_images": images,
        "timed_seconds": seconds, "skipped_files": skipped, "skipped_count": len(skipped),
        "distributed": {"world": len(every), "backend": backend, "ranks": every,
                        "replicas_in_sync": len(digests) == 1 if None not in digests else None},
    }


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
    if cfg.task.name is TaskName.train and "loss_first" in figures:
        line += f"; loss {figures['loss_first']:.3f} -> {figures['loss_last']:.3f}"
    return line
