"""runner/launch/outcome.py: a run's record (running, dead, killed, refused) and the command that
continues it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import (
    REPO,
    SMALL_DATASET,
    read_metrics,
    run_cli,
)


@pytest.mark.process
def test_a_record_tells_a_dead_owner_from_a_live_one():
    import socket

    from runner.launch.outcome import owner_gone, settled

    here = socket.gethostname()
    now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    live = {"status": "running", "pid": os.getpid(), "host": here, "started_at": now}
    assert not owner_gone(live) and settled(live) == live
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = {**live, "pid": child.pid, "steps": 7}
    assert owner_gone(dead)
    assert settled(dead)["status"] == "died" and f"pid {child.pid} on {here}" in \
        settled(dead)["reason"]
    # a live process under the pid, started after the record: the pid was reused
    assert owner_gone({**live, "started_at": "2001-01-01T00:00:00+0000"})
    # another machine's run, or a record without its host: this machine cannot tell
    assert not owner_gone({**dead, "host": "elsewhere"})
    assert not owner_gone({k: v for k, v in dead.items() if k != "host"})
    assert settled({**dead, "status": "ok"})["status"] == "ok"

@pytest.mark.process
@pytest.mark.slow
def test_a_run_killed_by_sigkill_is_reported_dead_and_the_next_run_says_so(
        tmp_path: Path, cache_dir: Path, capsys):
    from runner import report

    args = [*SMALL_DATASET, "model=tiny", "logger=none", "diagnose=false"]
    run_cli(*args, "run.steps=1", "hydra.run.dir=warm", cwd=tmp_path)  # the dataset, made
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", *args, "run.steps=100000", "run.log_every=2",
         "resume=auto", "hydra.run.dir=killed"],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        time.sleep(0.3)
        try:
            if read_metrics(tmp_path / "killed").get("images_per_sec"):
                break
        except (OSError, ValueError):
            continue
    proc.kill()  # SIGKILL, in the loop: nothing runs after this
    proc.wait(timeout=30)
    left = read_metrics(tmp_path / "killed")
    assert left["status"] == "running" and left["pid"] == proc.pid and left["host"]

    assert report.main([str(tmp_path / "killed"), "--out", str(tmp_path / "report")]) == 0
    text = (tmp_path / "report" / "report.md").read_text()
    assert "1 died" in text and f"(died): its process (pid {proc.pid} on " in text

    again = run_cli(*args, "run.steps=2", "resume=auto", "hydra.run.dir=killed",
                    cwd=tmp_path)
    said = again.stdout + again.stderr
    assert f"the run before in killed died: its process (pid {proc.pid} on " in said
    kept = json.loads((tmp_path / "killed" / "metrics.1.json").read_text())
    assert kept["status"] == "died" and kept["images_per_sec"] == left["images_per_sec"]
    assert read_metrics(tmp_path / "killed")["status"] == "ok"

def test_a_refused_resume_does_not_stand_for_the_parts_that_ran(tmp_path: Path):
    """Finished, then a resume refused before any step (another crop), then resume=auto as
    first asked: the figures kept are those of the part that ran the steps, not the refused
    record's (which has none: the run's figures vanished from metrics.json and the report)."""
    import json

    from runner.launch.outcome import previous_record

    (tmp_path / "metrics.1.json").write_text(json.dumps(
        {"status": "ok", "images_per_sec": 1387.0, "steps": 3}))
    (tmp_path / "metrics.2.json").write_text(json.dumps(
        {"status": "failed", "reason": "checkpoint of another run (dataset.crop_fraction)"}))
    assert previous_record(tmp_path)["images_per_sec"] == 1387.0
    (tmp_path / "metrics.3.json").write_text(json.dumps(
        {"status": "interrupted", "images_per_sec": 900.0}))
    assert previous_record(tmp_path)["images_per_sec"] == 900.0  # the latest that ran


@pytest.mark.process
@pytest.mark.slow
def test_a_killed_run_leaves_a_running_record_with_its_windows(tmp_path: Path,
                                                               cache_dir: Path):
    run_cli(*SMALL_DATASET, "model=none", "logger=none", "run.steps=1", "hydra.run.dir=warm",
            cwd=tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", *SMALL_DATASET, "model=tiny", "logger=none",
         "run.steps=100000", "run.log_every=2", "hydra.run.dir=killed"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        time.sleep(0.5)
        try:
            m = read_metrics(tmp_path / "killed")
        except (OSError, ValueError):
            continue
        if m.get("images_per_sec"):
            break
    proc.kill()  # SIGKILL: nothing runs after this
    proc.wait(timeout=30)
    m = read_metrics(tmp_path / "killed")
    assert m["status"] == "running" and m["pid"] == proc.pid
    assert m["images_per_sec"] > 0 and m["steps"] > 0  # the windows timed before the kill

def test_the_continue_command_is_quoted_for_a_shell(monkeypatch):
    import shlex

    from runner.launch.outcome import stopped_line

    monkeypatch.setattr(sys, "argv", ["runner", "dataset.path=/data/my images", "run.epochs=3"])
    line = stopped_line({"reason": "interrupted by SIGTERM", "steps": 5,
                         "run_dir": "/runs/a run"})
    argv = shlex.split(line.split("continue with: ", 1)[1])
    assert argv == ["python", "-m", "runner", "dataset.path=/data/my images", "run.epochs=3",
                    "resume=auto", "hydra.run.dir=/runs/a run"]


def test_the_results_line_names_a_detection_runs_files(tmp_path: Path):
    from runner.launch.outcome import where

    for name in ("metrics.json", "detections.json", "detections.csv",
                 "detections.categories.json"):
        (tmp_path / name).write_text("{}")
    (line,) = where(tmp_path, {}, None)
    assert line.endswith("(metrics.json, detections.categories.json, detections.csv, "
                         "detections.json)")
