"""runner/job/run.py: the run folder (made, in use, read-only, a file), a signal, a full disk at
the end: each one line, no result lost."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.launch.outcome import RunDirClaim
from tests.conftest import (
    REPO,
    SMALL_DATASET,
    read_metrics,
    run_cli,
    sitecustomize,
    stray_processes,
)


def one_error_line(proc: subprocess.CompletedProcess, expect: str) -> str:
    """The run exited 2 with one line naming ``expect``, and no traceback."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    lines = [line for line in out.splitlines() if "ERROR" in line or line.startswith("error:")]
    assert len(lines) == 1 and expect in lines[0], out
    return lines[0]

@pytest.mark.process
@pytest.mark.slow  # python -m runner in a subprocess
def test_hydra_run_dir_naming_a_file_is_one_line(tmp_path: Path):
    (tmp_path / "afile").write_text("not a folder")
    proc = run_cli("hydra.run.dir=afile", "logger=none", cwd=tmp_path, check=False,
                   timeout=120)
    one_error_line(proc, "hydra.run.dir=afile names a file, not a folder")

READ_ONLY = """
    import errno, os
    _mkdir, _open = os.mkdir, os.open
    RO = {ro!r}
    def under(path):
        return os.path.abspath(os.fsdecode(path)).startswith(RO)
    def mkdir(path, *a, **k):
        if under(path):
            raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(path))
        return _mkdir(path, *a, **k)
    def open_(path, flags, *a, **k):
        if under(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(path))
        return _open(path, flags, *a, **k)
    os.mkdir, os.open = mkdir, open_
"""

@pytest.mark.process
@pytest.mark.slow  # python -m runner in a subprocess, three times
@pytest.mark.parametrize("where", ["working folder", "output folder", "existing output folder"])
def test_a_read_only_run_folder_is_one_line(tmp_path: Path, where: str):
    """Tests run as root, where permission bits stop nothing: the run's process is made to
    see a read-only folder (its os.mkdir and os.open refuse, as the kernel would)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    env = sitecustomize(tmp_path / "site", READ_ONLY.format(ro=str(ro) + os.sep))
    common = ["logger=none", "model=none", "run.steps=1", "run.progress=false"]
    if where == "working folder":  # the default hydra.run.dir, under the working folder
        proc = run_cli(*common, cwd=ro, env=env, check=False, timeout=120)
        line = one_error_line(proc, "Permission denied")
        assert f"the working folder {ro} is read-only" in line
        assert not (ro / "outputs").exists()
    else:
        if where == "existing output folder":
            (ro / "out").mkdir()
        proc = run_cli(f"hydra.run.dir={ro}/out", *common, cwd=tmp_path, env=env,
                       check=False, timeout=120)
        line = one_error_line(proc, "Permission denied")
        assert f"hydra.run.dir={ro}/out" in line and "a folder you can write" in line

def test_a_run_folder_that_can_be_made_is_unchanged(tmp_path: Path, monkeypatch):
    """The check makes no run folder of its own beyond the fixed part of the default."""
    from runner.launch.outcome import RunDirUnusable, check_run_folder

    monkeypatch.chdir(tmp_path)
    check_run_folder([])
    assert [p.name for p in (tmp_path / "outputs" / "runs").iterdir()] == []

    def refuse(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", "outputs")

    monkeypatch.setattr(os, "mkdir", refuse)
    with pytest.raises(RunDirUnusable, match="elsewhere: Permission denied"):
        check_run_folder(["hydra.run.dir=elsewhere"])


@pytest.mark.process
@pytest.mark.slow
def test_runs_started_together_get_their_own_folders(tmp_path: Path, cache_dir: Path):
    run_cli(*SMALL_DATASET, "model=none", "logger=none", "run.steps=1", "hydra.run.dir=warm",
            cwd=tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_SILENT": "true"}
    args = [sys.executable, "-m", "runner", *SMALL_DATASET, "model=none", "logger=none",
            "diagnose=false", "run.steps=3"]
    procs = [subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    found = sorted((tmp_path / "outputs").rglob("metrics.json"))
    assert len(found) == 2 and found[0].parent != found[1].parent
    pids = {read_metrics(f.parent)["pid"] for f in found}
    assert pids == {p.pid for p in procs}  # each its own metrics.json, none overwritten

@pytest.mark.process
@pytest.mark.slow
@pytest.mark.parametrize("prefix", ["", "+", "++"])
def test_a_run_folder_in_use_is_refused_and_its_results_kept(tmp_path: Path, cache_dir: Path,
                                                            prefix: str):
    run_dir = tmp_path / "busy"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / "metrics.json").write_text('{"status": "ok", "images_per_sec": 123.0}')
    (run_dir / ".hydra" / "overrides.yaml").write_text("- the live run's own\n")
    (run_dir / "runner.log").write_text("the live run's log\n")
    with RunDirClaim(run_dir):  # a live run holds it
        proc = run_cli(*SMALL_DATASET, "model=none", "logger=none",
                       f"{prefix}hydra.run.dir={run_dir}", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    out = proc.stdout + proc.stderr
    assert "in use by another run" in out and "Traceback" not in out
    assert read_metrics(run_dir)["images_per_sec"] == 123.0  # not overwritten
    # refused before Hydra wrote anything there: the live run's files are as they were
    assert (run_dir / ".hydra" / "overrides.yaml").read_text() == "- the live run's own\n"
    assert (run_dir / "runner.log").read_text() == "the live run's log\n"

@pytest.mark.process
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_run_keeps_its_steps_and_leaves_no_process(
        tmp_path: Path, cache_dir: Path, sig: signal.Signals):
    run_cli(*SMALL_DATASET, "model=none", "logger=none", "run.steps=1", "hydra.run.dir=warm",
            cwd=tmp_path)
    marker = f"hydra.run.dir={tmp_path}/stopped"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", *SMALL_DATASET, "prefetch=cpu", "loader.num_workers=2",
         "model=tiny", "logger=none", "run.steps=100000", "run.log_every=5", marker],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    for line in proc.stdout:
        if "warm-up) on" in line or time.time() > deadline:
            break
    time.sleep(2.0)
    proc.send_signal(sig)
    start = time.time()
    proc.communicate(timeout=30)
    assert time.time() - start < 15
    assert proc.returncode == 128 + sig
    time.sleep(0.5)
    assert stray_processes(marker) == []  # workers and threads stopped
    m = read_metrics(tmp_path / "stopped")
    assert m["status"] == "interrupted" and m["reason"] == f"interrupted by {sig.name}"
    assert m["steps"] > 0 and m["images_per_sec"] > 0

def test_results_are_never_lost_to_a_full_disk_at_the_end(tmp_path: Path, monkeypatch, capsys):
    from runner.launch import outcome

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(outcome, "write_json", full)
    with pytest.raises(OSError):
        outcome.save_metrics(tmp_path / "metrics.json", {"status": "ok", "images_per_sec": 9.5})
    printed = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert printed["images_per_sec"] == 9.5
