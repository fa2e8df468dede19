"""``python -m runner.selfcheck``: what it says without a GPU, what it refuses, and its rows'
code run on the CPU (their speed claims mean nothing there; their code paths do)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import runner.bench.selfcheck as selfcheck
from runner.bench.selfcheck import CHECKS, Row, harness, main

ROOT = Path(__file__).resolve().parents[1]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(),
                             reason="checks the behaviour without CUDA")


def quick_ddp(monkeypatch) -> list[str]:
    """The one row that runs without CUDA, replaced by a quick one that records its call
    (its own torchrun run is exercised by tests/launch/test_distributed.py)."""
    ran: list[str] = []
    for check in CHECKS:
        if check.name == "ddp":
            monkeypatch.setattr(check, "run", lambda a: ran.append("ddp") or [
                Row("ddp row", True, "ran")])
    return ran


@no_cuda
def test_without_cuda_every_gpu_row_is_untested_and_listed_apart(monkeypatch, capsys):
    ran = quick_ddp(monkeypatch)
    assert main([]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("runner.selfcheck certifies torch ")
    assert "no CUDA device" in lines[0] and "supports torch>=" in lines[0]
    assert ran == ["ddp"]  # the rows that need no GPU still run
    summary = next(line for line in lines if " passed, " in line)
    assert summary.startswith("1 passed, 0 failed, ")
    untested = out.split("untested here:")[1].splitlines()
    gpu_rows = [c.name for c in CHECKS if c.cuda]
    for name in gpu_rows:
        assert any(line.startswith("UNTESTED") and f" {name} " in line for line in untested)
    assert int(summary.split(", ")[2].split()[0]) == len(gpu_rows)


def test_a_missing_package_is_named_once_with_the_rows_it_leaves_untested(monkeypatch,
                                                                          capsys):
    quick_ddp(monkeypatch)
    monkeypatch.setattr(selfcheck.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch_tensorrt" else object())
    monkeypatch.setattr(harness, "DEVICE", "cpu")  # every row may run: none is asked
    main(["--only", "ddp"])
    missing = [line for line in capsys.readouterr().out.splitlines()
               if line.startswith("missing:")]
    assert missing == ["missing: torch_tensorrt (untested: tensorrt, tensorrt-job)"]


def test_an_asked_row_that_cannot_run_fails(monkeypatch, capsys):
    monkeypatch.setattr(selfcheck.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch_tensorrt" else object())
    monkeypatch.setattr(harness, "DEVICE", "cpu")  # past the GPU's absence: the package
    assert main(["--only", "tensorrt"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "torch_tensorrt not installed" in out


def test_missing_project_dependencies_stop_it_with_one_line(monkeypatch, capsys):
    real = selfcheck.importlib.util.find_spec
    monkeypatch.setattr(selfcheck.importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensordict" else real(name, *a))
    monkeypatch.setattr(harness, "DEVICE", "cpu")
    assert main([]) == 2
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("missing the project's dependencies tensordict:")


def test_list_names_every_row_and_what_fails_it(capsys):
    assert main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [c.name for c in CHECKS]
    assert all(len(line) > 40 for line in lines)  # each says its claim


def test_each_row_that_ran_shows_the_seconds_it_took(monkeypatch, capsys):
    """A row's time runs from its check's previous row (or the check's start); the rows
    left untested show none."""
    import time

    def two_rows(args) -> list[Row]:
        time.sleep(0.3)
        first = Row("slow row", True, "ran")
        return [first, Row("quick row", True, "ran")]

    for check in CHECKS:
        if check.name == "ddp":
            monkeypatch.setattr(check, "run", two_rows)
    monkeypatch.setattr(selfcheck.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch_tensorrt" else object())
    monkeypatch.setattr(harness, "DEVICE", "cpu")
    assert main(["--only", "ddp", "tensorrt", "--no-build"]) == 1
    out = capsys.readouterr().out
    summary = out.split(" untested in ")[1].splitlines()[1:]
    times = dict(re.fullmatch(r"PASS +([\d.]+) s  (\w+ row) +ran", line).group(2, 1)
                 for line in summary if line.startswith("PASS"))
    assert float(times["slow row"]) >= 0.3 and float(times["quick row"]) < 0.2, out
    # the asked row that could not run took no time: a blank where the seconds go
    failed = [line for line in summary if line.startswith("FAIL")]
    assert len(failed) == 1 and re.fullmatch(r"FAIL {16}tensorrt +torch_tensorrt not installed",
                                             failed[0]), out


@pytest.mark.process
def test_the_command_says_a_missing_dependency_in_one_line():
    # the package's import needs the project's dependencies; the command names the missing one
    code = ("import sys; sys.modules['tensordict'] = None; from runner.selfcheck import main; "
            "raise SystemExit(main([]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stdout.splitlines() == [
        "missing the project's dependencies tensordict: bring them as wheels (README, "
        "'Self-check on an offline GPU node') and run again"]


def test_the_bench_runs_it_as_a_sub_command(capsys):
    from runner.bench.cli import main as bench

    assert bench(["selfcheck", "--list"]) == 0
    via_bench = capsys.readouterr().out
    assert main(["--list"]) == 0
    assert via_bench == capsys.readouterr().out and "tensorrt-job" in via_bench


def test_the_region_decoder_is_built_from_the_source_pyproject_names():
    from runner.bench.selfcheck.node import region_extension

    name, source = region_extension()
    assert source.is_file() and source.suffix == ".c", source
    assert ROOT.joinpath(*name.split(".")[:-1]).is_dir(), name


@pytest.mark.process
@pytest.mark.slow
def test_the_rows_code_runs_on_the_cpu(tmp_path: Path):
    """The resume and infer rows end to end on the CPU (RUNNER_SELFCHECK_DEVICE=cpu):
    their code paths work, and the resume row's claim holds there too."""
    env = {**os.environ, "RUNNER_SELFCHECK_DEVICE": "cpu", "RUNNER_CACHE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "runner.selfcheck", "--only", "resume",
                           "infer"], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    out = proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    rows = out.split(" untested in ")[1].splitlines()[1:]
    assert len(rows) == 3 and all(row.startswith("PASS") for row in rows), out


def test_a_sync_says_whether_the_data_path_or_the_step_made_it_and_where(monkeypatch):
    from runner.bench.selfcheck.harness import SyncError, _steps

    monkeypatch.setattr(harness, "DEVICE", "cpu")
    sync = "called a synchronizing CUDA operation"

    class Batches:
        def __iter__(self):
            for k in range(20):
                if k == 5:
                    raise RuntimeError(sync)
                yield k

    with pytest.raises(SyncError, match=r"data path, .*test_selfcheck.py:\d+ \(__iter__\)"):
        _steps(Batches(), lambda batch: None, 8, sync_check=True)

    calls = []

    def step(batch) -> None:
        calls.append(batch)
        if batch == 4:
            raise RuntimeError(sync)

    with pytest.raises(SyncError, match=r"step, .*test_selfcheck.py:\d+ \(step\)"):
        _steps(list(range(20)), step, 8, sync_check=True)
    assert len(calls) == 11  # the steps after the sync still ran

    def other(batch) -> None:
        raise RuntimeError("CUDA out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):  # not a sync: raised as it is
        _steps(list(range(20)), other, 8, sync_check=True)


@pytest.mark.cuda
@pytest.mark.slow
def test_selfcheck_passes_on_a_gpu():
    from runner.selfcheck import main

    assert main(["--batch-size", "64", "--only", "prefetch", "transfers", "fp16"]) == 0
