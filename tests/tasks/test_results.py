"""runner/tasks/results.py: figures that cannot contradict each other (no stage longer than the
step it is part of, merged ranks' shares of the run's step)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from runner.measure.clock import STAGES, Window
from runner.tasks.loop import LoopResult
from runner.tasks.results import loop_figures, step_shares, summary_line
from tests.conftest import SMALL_DATASET, run_in_process


def window(seconds: float, augment: float, wait: float = 0.0, steps: int = 10) -> Window:
    stages = {**dict.fromkeys(STAGES, 0.0), "data_wait": wait, "augment": augment,
              "compute": seconds - augment - wait}
    return Window(steps=steps, images=8 * steps, seconds=seconds, stages=stages)

def result_of(windows: list[Window]) -> LoopResult:
    timed = Window()
    for w in windows:
        timed.add(w)
    return LoopResult(timed=timed, repeats=windows, steps=timed.steps + 2,
                      images=timed.images + 16, warmup_steps=2)

def test_no_stage_is_longer_than_the_step_after_a_slow_first_window():
    """A slow first window (first uses of augmentation ops) lifts the stages' mean over all
    steps but not the windows' median step: each stage must be its share of that step."""
    figures = loop_figures(result_of([window(10.0, 9.0), window(3.0, 2.0, 0.5),
                                      window(3.0, 2.0, 0.5)]), [])
    step = figures["ms_per_step"]
    assert step == pytest.approx(300.0)
    assert figures["augment_ms"] <= step  # was 433 ms beside 300 ms/step
    assert sum(figures[f"{s}_ms"] for s in STAGES) == pytest.approx(step)
    for s in STAGES:
        assert figures[f"{s}_ms"] == pytest.approx(figures[f"{s}_frac"] * step)

def test_the_optimizer_and_ema_are_shares_of_the_step_and_of_its_compute():
    figures = loop_figures(result_of([window(4.0, 1.0), window(2.0, 0.5),
                                      window(2.0, 0.5)]), [])
    figures.update(optimizer_seconds=3.0, ema_seconds=9.0)  # more than compute: clamped
    step_shares(figures)
    assert "optimizer_seconds" not in figures and "ema_seconds" not in figures
    assert figures["optimizer_frac"] == pytest.approx(3.0 / 8.0)
    assert figures["optimizer_ms"] == pytest.approx(3.0 / 8.0 * figures["ms_per_step"])
    assert figures["ema_ms"] == pytest.approx(figures["compute_ms"])  # never beyond compute
    assert figures["optimizer_ms"] <= figures["compute_ms"] <= figures["ms_per_step"]

def ms_in(line: str) -> dict[str, float]:
    return {name: float(v) for v, name in re.findall(r"([\d.]+) ms(?:/(step))?", line)
            if name} | {name: float(v) for name, v in re.findall(
                r"(augmentation|optimizer step|EMA update) ([\d.]+) ms", line)}

@pytest.mark.slow
def test_a_training_run_prints_no_part_longer_than_its_step(tmp_path: Path, cache_dir: Path):
    """End to end: augmentation, accumulated optimizer steps and the EMA, each printed as
    a share of the step beside it."""
    from runner.job.compose import compose

    over = [*SMALL_DATASET, "dataset.crop=random", "logger=none", "diagnose=false",
            "run.steps=14", "run.warmup_steps=2", "run.log_every=4", "task.accumulate=4",
            "task.ema_decay=0.9", "task.augment.auto=trivialaugment", "run.timeline=false"]
    m = run_in_process(*over, run_dir=tmp_path / "run")
    assert m["status"] == "ok"
    step = m["ms_per_step"]
    for key in ("augment_ms", "optimizer_ms", "ema_ms", "compute_ms", "data_wait_ms"):
        assert 0 < m[key] <= step, (key, m[key], step)
    assert m["optimizer_ms"] + m["ema_ms"] <= m["compute_ms"] + 1e-9
    line = summary_line(compose(over), m)
    printed = ms_in(line)
    assert set(printed) == {"step", "augmentation", "optimizer step", "EMA update"}
    for name in ("augmentation", "optimizer step", "EMA update"):
        assert printed[name] <= printed["step"], line

def test_merged_ranks_give_each_stage_as_a_share_of_the_runs_step():
    """Under torch.distributed the run's step is its slowest rank's: every stage (the
    optimizer's too) is recomputed as a share of that step."""
    from runner.tasks.results import merge_ranks, rank_figures

    fast = result_of([window(1.0, 0.2), window(1.0, 0.2), window(1.0, 0.2)])
    slow = result_of([window(2.0, 0.2), window(2.0, 0.2), window(2.0, 0.2)])
    figures = step_shares({**loop_figures(fast, []), "optimizer_seconds": 0.3})
    every = [rank_figures(0, figures, fast, None),
             rank_figures(1, loop_figures(slow, []), slow, None)]
    merged = merge_ranks(figures, every, "gloo")
    assert merged["ms_per_step"] == pytest.approx(200.0)  # the slowest rank's step
    for part in (*STAGES, "optimizer"):
        assert merged[f"{part}_ms"] == pytest.approx(merged[f"{part}_frac"] * 200.0)
    assert sum(merged[f"{s}_ms"] for s in STAGES) <= merged["ms_per_step"] + 1e-9
