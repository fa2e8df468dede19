"""The console says each thing once, where it matters: the lengthening of a fast run once
per run, the clipped warm-up only where a speed figure is the point, and wandb's offline
run in one line of the runner's own (wandb's own console output silenced)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from runner.logger import NullLogger
from runner.loop import LoopOptions, OnDevice, run_loop
from runner.tasks import DataOnlyStep
from tests.conftest import REPO, SMALL_DATASET, run_in_process

LENGTHENED = "the data path alone runs"
WARMUP = "leaves no step to time"


def endless(size: int = 4):
    while True:
        yield TensorDict({"image": torch.zeros(size, 3, 8, 8, dtype=torch.uint8),
                          "label": torch.zeros(size, dtype=torch.long)}, batch_size=[size])


class SettlingStep(DataOnlyStep):
    """Slow for its first steps, then fast: each window of the first repeat finds the
    run too short again (its pace measured so far keeps rising)."""

    def __init__(self, slow_steps: int):
        self.calls, self.slow_steps = 0, slow_steps

    def __call__(self, batch) -> None:
        self.calls += 1
        time.sleep(0.004 if self.calls <= self.slow_steps else 0.0002)


def test_a_lengthened_run_says_so_once_not_per_window(caplog):
    asked = []
    with caplog.at_level(logging.INFO, logger="runner.loop"):
        result = run_loop(OnDevice(endless(), torch.device("cpu")), SettlingStep(7),
                          NullLogger(), LoopOptions(
                              total_steps=20, warmup_steps=2, log_every=5, repeats=3,
                              min_window_seconds=0.05, extend=asked.append))
    assert len(asked) > 1  # lengthened at several windows, as the pace settled
    assert result.steps == asked[-1]
    said = [r for r in caplog.records if LENGTHENED in r.getMessage()
            and r.levelno >= logging.INFO]
    assert len(said) == 1, [r.getMessage() for r in said]


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and WARMUP in r.getMessage()]


@pytest.mark.slow
def test_a_short_inference_is_not_warned_about_its_warm_up(tmp_path: Path, cache_dir: Path,
                                                           caplog):
    """Predictions of a few images (fewer steps than run.warmup_steps): the point is the
    outputs; the figure's flags say it is from few steps, the console does not."""
    small = [o for o in SMALL_DATASET if not o.startswith("run.warmup_steps=")]  # 5 steps
    base = [*small, "loader.batch_size=32", "task=infer", "logger=none",
            "diagnose=false", "run.timeline=false", "run.progress=false"]
    with caplog.at_level(logging.INFO, logger="runner"):
        m = run_in_process(*base, run_dir=tmp_path / "plain")
    assert m["status"] == "ok" and m["steps"] == 2
    assert warnings_of(caplog) == []
    assert any(f.startswith("few timed steps") for f in m["flags"])  # still on record
    for asked in ("task.write_outputs=false", "run.warmup_steps=5"):  # a speed figure
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="runner"):
            run_in_process(*base, asked, run_dir=tmp_path / asked.split("=")[0])
        assert len(warnings_of(caplog)) == 1, asked


def runner_console(*args: str, cwd: Path, cache: Path) -> str:
    """stdout and stderr of ``python -m runner`` with wandb left to speak (no WANDB_SILENT)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(PYTHONPATH=str(REPO), RUNNER_CACHE=str(cache), WANDB_MODE="offline")
    proc = subprocess.run([sys.executable, "-m", "runner", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_wandb_offline_is_one_line_of_ours_per_run_and_once_per_sweep(tmp_path: Path):
    common = [*SMALL_DATASET, "run.steps=3", "run.warmup_steps=1", "diagnose=false",
              "run.progress=false", "run.timeline=false"]
    out = runner_console(*common, "hydra.run.dir=run", cwd=tmp_path, cache=tmp_path / "c")
    assert "You can sync this run" not in out and "Syncing run" not in out
    assert out.count("wandb sync") == 1  # ours: where the offline run is, how to upload it
    line = next(x for x in out.splitlines() if "wandb sync" in x)
    assert str(tmp_path / "run" / "wandb" / "offline-run-") in line
    assert [x for x in out.splitlines() if "wandb:" in x] == [line]

    out = runner_console("-m", *common, "loader.batch_size=4,8", "hydra.sweep.dir=sweep",
                         cwd=tmp_path, cache=tmp_path / "c")
    assert out.count("wandb sync") == 1  # the sweep's one command for all its jobs
    assert "upload them all with: wandb sync sweep/*/wandb/offline-run-*" in out
    assert len(list((tmp_path / "sweep").glob("*/wandb/offline-run-*"))) == 2
