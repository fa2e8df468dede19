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
    """The rows that run without CUDA (ddp, map-ranks), each replaced by a quick one that
    records its call (ddp's own torchrun run is exercised by tests/launch/test_distributed.py,
    map-ranks' ranks below)."""
    ran: list[str] = []
    for check in CHECKS:
        if not check.cuda:
            monkeypatch.setattr(check, "run", lambda a, name=check.name: ran.append(name) or [
                Row(f"{name} row", True, "ran")])
    return ran


@no_cuda
def test_without_cuda_every_gpu_row_is_untested_and_listed_apart(monkeypatch, capsys):
    ran = quick_ddp(monkeypatch)
    assert main([]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("runner.selfcheck certifies torch ")
    assert "no CUDA device" in lines[0] and "supports torch>=" in lines[0]
    assert ran == ["map-ranks", "ddp"]  # the rows that need no GPU still run
    summary = next(line for line in lines if " passed, " in line)
    assert summary.startswith("2 passed, 0 failed, ")
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
    assert len(failed) == 1 and re.fullmatch(
        r"FAIL {16}tensorrt +torch_tensorrt not installed; where it is installed .*",
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
        "missing the project's dependencies tensordict: bring them as wheels (docs/gpu.md, "
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


# --- a failed row names its innermost cause and line (issue 53, item 1) ----------------------

def _raise_stop() -> None:
    raise StopIteration  # the innermost cause: the row must name this line


def _exhausted():
    yield 0
    _raise_stop()  # inside a generator: the caller gets "generator raised StopIteration"


def test_a_row_that_fails_names_its_innermost_cause_and_line(monkeypatch, capsys):
    def failing(args) -> list[Row]:
        batches = _exhausted()
        next(batches)
        next(batches)  # RuntimeError("generator raised StopIteration") from StopIteration
        return []

    for check in CHECKS:
        if check.name == "ddp":
            monkeypatch.setattr(check, "run", failing)
    monkeypatch.setattr(harness, "DEVICE", "cpu")
    assert main(["--only", "ddp", "--no-build"]) == 1
    failed = [line for line in capsys.readouterr().out.split(" untested in ")[1].splitlines()
              if line.startswith("FAIL")]
    line = _raise_stop.__code__.co_firstlineno + 1
    assert len(failed) == 1, failed
    assert re.search(rf"StopIteration, .*test_selfcheck\.py:{line} \(_raise_stop\)",
                     failed[0]), failed[0]
    assert "reached the harness as RuntimeError: generator raised StopIteration" in failed[0]


def test_the_rows_a_check_yielded_before_it_failed_are_kept(monkeypatch, capsys):
    def half(args):
        yield Row("first row", True, "ran")
        raise OSError("the second path broke")

    for check in CHECKS:
        if check.name == "ddp":
            monkeypatch.setattr(check, "run", half)
    monkeypatch.setattr(harness, "DEVICE", "cpu")
    assert main(["--only", "ddp", "--no-build"]) == 1
    summary = capsys.readouterr().out.split(" untested in ")[1].splitlines()[1:]
    assert [line.split()[0] for line in summary] == ["PASS", "FAIL"], summary
    assert "first row" in summary[0]
    assert re.search(r"OSError, .*test_selfcheck\.py:\d+ \(half\): the second path broke",
                     summary[1]), summary[1]


def test_a_sync_wrapped_in_another_error_is_found_by_its_cause(monkeypatch):
    """A sync raised in the data path reaches the harness wrapped (a thread's error re-raised,
    a generator's RuntimeError): still a SyncError, naming the sync's own line."""
    from runner.bench.selfcheck.harness import SyncError, _steps

    monkeypatch.setattr(harness, "DEVICE", "cpu")

    def synced() -> None:
        raise RuntimeError("called a synchronizing CUDA operation")

    def batches():
        for k in range(20):
            if k == 5:
                try:
                    synced()
                except RuntimeError as e:
                    raise RuntimeError("the prefetch thread failed") from e
            yield k

    line = synced.__code__.co_firstlineno + 1
    with pytest.raises(SyncError, match=rf"data path, .*test_selfcheck\.py:{line} \(synced\)"
                                        r": called a synchronizing"):
        _steps(batches(), lambda batch: None, 8, sync_check=True)


def test_a_recipe_whose_pipeline_fails_to_build_keeps_the_rows_already_collected(monkeypatch):
    import argparse

    from runner.bench.selfcheck import train_rows

    monkeypatch.setattr(harness, "DEVICE", "cpu")
    built = []

    class Fake:
        def close(self) -> None:
            pass

    def pipeline(*overrides: str):
        built.append(overrides)
        if len(built) == 2:
            raise ValueError("no such store")
        return Fake()

    monkeypatch.setattr(train_rows, "_pipeline", pipeline)
    monkeypatch.setattr(train_rows, "_train_step", lambda p, n: lambda batch: None)
    monkeypatch.setattr(train_rows, "_steps", lambda *a, **k: 1.0)
    rows = train_rows.check_sync(argparse.Namespace(size=224, batch_size=256))
    assert len(rows) == len(train_rows.RECIPES) == len(built)
    assert [r.ok for r in rows] == [True, False] + [True] * (len(rows) - 2)
    assert re.search(r"ValueError, .*test_selfcheck\.py:\d+ \(pipeline\): no such store",
                     rows[1].figure), rows[1].figure
    # the sync row's images are small: the shape does not decide whether an op syncs
    assert all("dataset.image_size=[64,128]" in o for o in built)


# --- --budget: what would not fit is untested, said so (item 5) ------------------------------

def test_budget_skips_the_checks_that_would_not_fit_and_lists_them_untested(monkeypatch,
                                                                            capsys):
    import time

    from runner.bench.selfcheck.harness import Check

    ran = []

    def run(name: str, sleep: float):
        def rows(args) -> list[Row]:
            ran.append(name)
            time.sleep(sleep)
            return [Row(f"{name} row", True, "ran")]
        return rows

    checks = [Check("first", "takes a second", run("first", 1.0), cuda=False, seconds=0.1),
              # fits the budget at the start, not after the first check's second
              Check("second", "expects 2.5 s", run("second", 0), cuda=False, seconds=2.5),
              Check("third", "expects 0.1 s", run("third", 0), cuda=False, seconds=0.1),
              Check("huge", "expects an hour", run("huge", 0), cuda=False, seconds=3600)]
    monkeypatch.setattr(selfcheck, "CHECKS", checks)
    assert main(["--budget", "3", "--no-build"]) == 0
    out = capsys.readouterr().out
    assert ran == ["first", "third"], out
    assert out.split(" passed, ")[0].splitlines()[-1] == "2", out
    untested = out.split("untested here:")[1].splitlines()
    skipped = [line for line in untested if line.startswith("UNTESTED")]
    assert len(skipped) == 2, out
    left = re.search(r"second +skipped by --budget 3 s: expected 2\.5 s, ([\d.]+) s left",
                     skipped[0])
    assert left and float(left.group(1)) < 2.5, skipped[0]
    assert re.search(r"huge +skipped by --budget 3 s: expected 3600 s", skipped[1]), skipped[1]


def test_budget_refuses_a_bad_value_in_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--budget", "-5"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m runner.selfcheck: error: argument --budget: '-5' is "
                              "not a number of seconds above 0"), err


def test_every_check_declares_its_expected_seconds_and_the_listing_shows_them(capsys):
    assert main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for check, line in zip(CHECKS, lines):
        assert 0 < check.seconds < 600
        assert re.search(rf"^{re.escape(check.name)} +(GPU|any) +{check.seconds:g} s  ", line)


# --- the rows of the claims added since the H200 run (item 4) -------------------------------

def test_the_rows_of_the_new_claims_are_listed():
    names = [c.name for c in CHECKS]
    assert {"timeline", "reduce-on", "host-dtype", "onnxruntime-gpu"} <= set(names)


@pytest.mark.slow
def test_the_reduce_on_row_runs_on_the_cpu_and_its_claim_holds(monkeypatch):
    """task.reduce_on=device against host on the CPU: the same top-k and masks, fewer bytes
    (those a GPU would copy to the host)."""
    import argparse

    from runner.bench.selfcheck.model_rows import check_reduce_on

    monkeypatch.setattr(harness, "DEVICE", "cpu")
    rows = list(check_reduce_on(argparse.Namespace(size=224, batch_size=256)))
    assert [r.ok for r in rows] == [True, True], [r.figure for r in rows]
    assert "topk_classes 100.00% equal" in rows[0].figure
    assert "masks 100.00% equal" in rows[1].figure


@pytest.mark.slow  # over 10 s on 2 cores: out of the unit tier
def test_the_reduce_on_row_fails_when_host_gives_other_outputs(monkeypatch):
    import argparse

    from runner.bench.selfcheck.model_rows import check_reduce_on
    from runner.tasks.infer import outputs

    monkeypatch.setattr(harness, "DEVICE", "cpu")
    real = outputs.Reduce.__call__

    def shifted(self, out, batch):
        kept = real(self, out, batch)
        return {k: v + 1 if self.on_host else v for k, v in kept.items()}

    monkeypatch.setattr(outputs.Reduce, "__call__", shifted)
    rows = list(check_reduce_on(argparse.Namespace(size=224, batch_size=256)))
    assert [r.ok for r in rows] == [False, False], [r.figure for r in rows]


def test_the_rows_whose_claims_need_cuda_say_so_on_the_cpu(monkeypatch):
    """Untested on the CPU, with the reason: the timeline's device lanes are CUDA events, a
    copy to the CPU moves nothing, onnxruntime's CUDA provider is CUDA's."""
    import argparse

    from runner.bench.selfcheck.copy_rows import check_host_dtype, check_timeline
    from runner.bench.selfcheck.model_rows import check_onnxruntime

    pytest.importorskip("onnxruntime")
    monkeypatch.setattr(harness, "DEVICE", "cpu")
    args = argparse.Namespace(size=224, batch_size=256)
    for check, reason in ((check_timeline, "CUDA events"), (check_host_dtype, "moves nothing"),
                          (check_onnxruntime, "CUDA")):
        rows = check(args)
        assert len(rows) == 1 and rows[0].ok is None and reason in rows[0].figure, rows


# --- recipe=quick's device stage makes no tensor from a host value (item 2) -----------------

@pytest.mark.slow
def test_recipe_quick_device_stage_makes_no_tensor_from_host_values(tmp_path):
    """What the sync row cannot see on the CPU, checked where it can be: recipe=quick's work
    on the device after the copy (memmap's random crops, batched as on a GPU, then
    task.augment's colour jitter with its hue shift in torch) hands no operation a tensor made
    from a Python value (on a GPU a blocking host copy each step, as kornia's hsv_to_rgb
    was)."""
    from runner.api import Pipeline
    from runner.data.path import CROP_DRAWS
    from tests.data.device.test_augment import HostTensors

    pipeline = Pipeline("recipe=quick", "loader=memmap", "prefetch=none", "device=cpu",
                        "model=none", "logger=none", "run.progress=false",
                        "dataset.num_images=48", "dataset.image_size=[64,128]",
                        "loader.batch_size=8")
    try:
        data = pipeline.data
        assert data.augment is not None and data.train_augment is not None
        assert data.train_augment.colour  # quick's colour jitter
        batch = data.to_device(next(iter(data)))
        draws = {k: batch[k] for k in CROP_DRAWS if k in batch.keys()}
        assert draws  # the crops' draws travel with the batch
        known = list(batch.values(include_nested=True, leaves_only=True))
        data.train_augment(batch.clone())  # once before: first-use constants
        with HostTensors(*known) as log:
            batch["image"] = data.augment(batch["image"], draws)  # the GPU's batched crops
            data.train_augment(batch)
        assert log.host == [], log.host
        assert batch["image"].shape[-2:] == (64, 128)
    finally:
        pipeline.close()


def test_topk_classes_that_tie_count_as_equal_within_float_rounding():
    """On an H200 the reduce-on row failed at 96.9% "equal" classes on one forward: tied
    bf16 logits let each side's topk list either class first, and the GPU's and the CPU's
    softmax differ by 1e-8, which exact equality took for a real difference."""
    from runner.bench.selfcheck.model_rows import tied_ranks

    device = torch.tensor([[0.01000002, 0.01, 0.005]])
    host = torch.tensor([[0.01, 0.01000002, 0.005]])  # the tie, listed the other way
    assert tied_ranks(device, host).tolist() == [[True, True, True]]
    other = torch.tensor([[0.01, 0.0099, 0.005]])  # a real difference at rank 1 is one
    assert tied_ranks(device, other).tolist() == [[True, False, True]]
    assert not (device == host).all()  # what the row compared before


def test_the_header_names_the_commit_that_ran(monkeypatch, tmp_path: Path):
    """An earlier commit quoted 8,511 img/s on the same H200 path and nobody could say which
    commit: the header names it, from .git or, in a copy without one, RUNNER_COMMIT."""
    from runner.bench.selfcheck import node

    head = (ROOT / ".git").is_dir() and (ROOT / ".git" / "HEAD").read_text()
    if head:
        assert node.commit() != "" and "unknown" not in node.commit()
    monkeypatch.setattr(node, "ROOT", tmp_path)  # a copy without .git
    monkeypatch.delenv("RUNNER_COMMIT", raising=False)
    assert "unknown commit" in node.commit()
    monkeypatch.setenv("RUNNER_COMMIT", "abc1234")
    assert node.commit() == "abc1234" and "commit abc1234" in node.header()


# --- issue 64: detector rows, the whole self-check in one call, its table in a file ------------

def test_the_whole_selfcheck_fits_ten_minutes_on_the_gpu_node():
    """``--budget 600`` runs every row the node can run (it has no torch_tensorrt): their
    expected seconds and the header's fit, so none is skipped for time."""
    runs = [c for c in CHECKS if "torch_tensorrt" not in c.packages]
    assert selfcheck.HEADER_SECONDS + sum(c.seconds for c in runs) <= selfcheck.NODE_BUDGET
    assert selfcheck.NODE_BUDGET <= 600


def test_the_detector_rows_are_listed_gpu_only_and_fail_on_a_sync(monkeypatch):
    import argparse

    from runner.bench.selfcheck import train_rows
    from runner.bench.selfcheck.harness import SyncError

    (check,) = [c for c in CHECKS if c.name == "detector-sync"]
    assert check.cuda and "amp=fp16" in check.claim and "boxes" in check.claim

    class Closed:
        def close(self):
            pass

    monkeypatch.setattr(train_rows, "_pipeline", lambda *o: Closed())
    monkeypatch.setattr(train_rows, "_train_step", lambda p, n: None)
    calls = []

    def steps(pipeline, step, n, sync_check):
        calls.append(sync_check)
        if len(calls) == 2:
            raise SyncError("step, runner/model/detectors.py:1 (loss): a sync")
        return 12.0

    monkeypatch.setattr(train_rows, "_steps", steps)
    rows = train_rows.check_detector_sync(argparse.Namespace(batch_size=64))
    assert [r.ok for r in rows] == [True, False, True] and all(calls)
    assert "amp=bf16" in rows[1].check and "a sync" in rows[1].figure


def test_out_writes_the_table_with_the_header_and_the_command(monkeypatch, tmp_path, capsys):
    from runner.bench.selfcheck.harness import Check

    monkeypatch.setattr(selfcheck, "CHECKS", [
        Check("quick", "passes", lambda a: [Row("quick row", True, "42 img/s")], cuda=False,
              seconds=0.1)])
    out = tmp_path / "notes" / "selfcheck.txt"
    assert main(["--no-build", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("runner.selfcheck certifies torch ")
    assert f"$ python -m runner.selfcheck --no-build --out {out}" in text
    assert "1 passed, 0 failed, 0 untested" in text and "quick row  42 img/s" in text
    assert f"the table: {out}" in capsys.readouterr().out


def test_the_tensorrt_rows_say_how_to_run_them_where_it_is_installed(monkeypatch, capsys):
    monkeypatch.setattr(selfcheck, "CHECKS", [c for c in CHECKS if "torch_tensorrt" in c.packages])
    real = selfcheck.importlib.util.find_spec
    monkeypatch.setattr(selfcheck.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch_tensorrt" else real(name, *a))
    monkeypatch.setattr(harness, "DEVICE", "cpu")  # as on a GPU node: the rows could run
    assert main(["--no-build"]) == 0
    untested = capsys.readouterr().out.split("untested here:")[1]
    for name in ("tensorrt", "tensorrt-job"):
        line = next(x for x in untested.splitlines() if f" {name} " in x)
        assert ("torch_tensorrt not installed; where it is installed (pip install "
                "torch-tensorrt" in line and "--only tensorrt tensorrt-job" in line), line


# --- issue 64: the rows of detectors and segmenters (target_rows.py) --------------------------

def test_the_target_rows_are_listed_with_where_they_run():
    by_name = {c.name: c for c in CHECKS}
    assert by_name["map-ranks"].cuda is False  # a correctness row: it runs on the CPU too
    assert by_name["bf16-targets"].cuda and by_name["boxes-on-device"].cuda
    assert "gloo" in by_name["map-ranks"].claim and "float32 on the CPU" in \
        by_name["bf16-targets"].claim and "host sync" in by_name["boxes-on-device"].claim


def tiny_detections(autocast: bool, shift: float = 0.0, bump: float = 0.0):
    """A small conv net's detections (a box and a score per cell of its output) on smooth
    images, in float32 or under the CPU's bf16 autocast: boxes and scores as torchmetrics'
    lists, ``shift`` px added to every box, ``bump`` to every score."""
    g = torch.Generator().manual_seed(0)
    net = torch.nn.Conv2d(3, 5, 5, stride=4)
    with torch.no_grad():
        net.weight.copy_(torch.randn(net.weight.shape, generator=g) * 0.3)
        images = torch.nn.functional.interpolate(torch.rand(2, 3, 6, 6, generator=g),
                                                 size=(64, 64), mode="bilinear")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = net(images).float()
    cells = torch.arange(out.shape[-1], dtype=torch.float32) * 4 + 2
    cy, cx = torch.meshgrid(cells, cells, indexing="ij")
    lists = []
    for o in out:
        box = torch.stack([cx - 8, cy - 8, cx + 8, cy + 8], -1).view(-1, 4)
        box = box + 2 * o[:4].permute(1, 2, 0).reshape(-1, 4) + shift
        keep = slice(None, None, 7)  # sparse, as boxes left after NMS: fewer near scores
        lists.append({"boxes": box[keep], "scores": o[4].sigmoid().flatten()[keep] + bump,
                      "labels": torch.zeros(box[keep].shape[0], dtype=torch.long)})
    return lists


def test_detections_under_bf16_match_float32_and_moved_boxes_or_scores_do_not():
    from runner.bench.selfcheck.target_rows import compare_detections

    reference = tiny_detections(autocast=False)
    same = compare_detections(reference, tiny_detections(autocast=True))
    assert same.compared >= 8 and same.holds(), str(same)
    assert same.worst_score_diff > 0  # bf16 did round: the two sides differ a little
    moved = compare_detections(reference, tiny_detections(autocast=True, shift=3.0))
    assert not moved.holds() and moved.matched == 0, str(moved)  # IoU 0.68 < 0.9
    scored = compare_detections(reference, tiny_detections(autocast=True, bump=0.1))
    assert not scored.holds(), str(scored)


def test_tied_scores_are_left_out_of_the_detections_compared():
    """An untrained SSDlite scores every anchor 0.25: which tied box NMS keeps is arbitrary
    on either side, so tied boxes are not compared (the anchors' scores are)."""
    from runner.bench.selfcheck.target_rows import compare_detections

    reference = tiny_detections(autocast=False)
    for image in reference:
        image["scores"] = torch.full_like(image["scores"], 0.25)
    tied = compare_detections(reference, tiny_detections(autocast=True, shift=3.0))
    assert tied.compared == 0 and tied.tied == 20 and "all tie" in str(tied)


@pytest.mark.slow
def test_masks_under_bf16_on_the_cpu_match_float32_and_other_masks_do_not():
    """LR-ASPP, the segmenter the row trains, in float32 and under the CPU's bf16
    autocast: its masks alike within the row's tolerance; masks 5% apart are not."""
    from runner.bench.selfcheck.target_rows import PIXELS_ALIKE, compare_masks
    from runner.config.schema import ModelConfig
    from runner.model.families import build_family_model
    from runner.model.networks import main_output

    torch.manual_seed(0)
    model = build_family_model(ModelConfig("lraspp_mobilenet_v3_large", num_classes=4), 0,
                               torch.device("cpu"), train=False).eval()
    images = torch.randint(0, 256, (2, 3, 96, 96), dtype=torch.uint8)
    with torch.no_grad():
        reference = main_output(model(images)).argmax(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            other = main_output(model(images)).float().argmax(1)
    alike = compare_masks(reference, other)
    assert alike.holds() and alike.pixels == 2 * 96 * 96, str(alike)
    changed = reference.clone()
    changed.view(-1)[: int(0.05 * changed.numel())] += 1
    apart = compare_masks(reference, changed)
    assert not apart.holds() and apart.alike < PIXELS_ALIKE


@pytest.mark.slow
def test_the_boxes_on_device_row_runs_on_the_cpu_and_fails_on_a_box_astray(monkeypatch):
    """Its code on the CPU (the sync check is CUDA's): the letterboxed store and the device
    crops pass; a replay whose mosaic centre is a pixel off (boxes the device did not
    move) fails both."""
    import argparse

    from runner.bench.selfcheck import target_rows

    monkeypatch.setattr(harness, "DEVICE", "cpu")
    args = argparse.Namespace(size=224, batch_size=256)
    rows = target_rows.check_boxes_on_device(args)
    assert [r.ok for r in rows] == [True, True], [r.figure for r in rows]
    assert "letterbox" in rows[0].check and "within 0 px" in rows[0].figure
    real = target_rows._on_cpu

    def off_by_one(x):
        moved = real(x)
        if hasattr(moved, "cx"):
            moved.cx = torch.where(moved.cx > 20, moved.cx - 1, moved.cx)
        return moved

    monkeypatch.setattr(target_rows, "_on_cpu", off_by_one)
    assert [r.ok for r in target_rows.check_boxes_on_device(args)] == [False, False]


@pytest.mark.process
@pytest.mark.ranks
@pytest.mark.slow
def test_the_map_ranks_row_runs_on_the_cpu_and_its_claim_holds(monkeypatch):
    """Two gloo ranks spawned on the CPU, 7 and 6 of 13 validation images: the mAP they
    gather is one process's (before the fix, torchmetrics' own sync aborted gloo on the
    uneven shares)."""
    import argparse

    from runner.bench.selfcheck import target_rows

    monkeypatch.setattr(harness, "DEVICE", "cpu")
    (row,) = target_rows.check_map_ranks(argparse.Namespace(size=224, batch_size=256))
    assert row.ok, row.figure
    assert "13 images, 7 + 6 on the ranks" in row.figure and "max |diff| 0 " in row.figure


def test_the_target_rows_honour_budget_and_land_in_the_out_table(monkeypatch, tmp_path):
    """Item 4 for the new rows: in the --out table when they run; a --budget under one's
    expected seconds leaves it untested, said in the table, and the others still run."""
    import dataclasses

    names = ("boxes-on-device", "bf16-targets", "map-ranks")
    checks = [dataclasses.replace(c, cuda=False, run=lambda a, n=c.name: [
        Row(f"{n} row", True, "ran")]) for c in CHECKS if c.name in names]
    assert [c.name for c in checks] == list(names)
    monkeypatch.setattr(selfcheck, "CHECKS", checks)
    table = tmp_path / "selfcheck.md"
    assert main(["--no-build", "--out", str(table)]) == 0
    text = table.read_text()
    assert all(f"{n} row" in text for n in names) and "3 passed, 0 failed" in text
    budget = next(c.seconds for c in checks if c.name == "bf16-targets") - 5
    assert main(["--no-build", "--budget", f"{budget:g}", "--out", str(table)]) == 0
    text = table.read_text()
    assert re.search(rf"UNTESTED +bf16-targets +skipped by --budget {budget:g} s: expected "
                     r"\d+ s", text), text
    assert "boxes-on-device row" in text and "map-ranks row" in text


@pytest.mark.parametrize(("ranks", "ok"), [
    ([(0.5, 7), (0.5, 6)], True),
    ([(0.49, 7), (0.49, 6)], False),  # another figure
    ([(0.5, 7), (0.5, 7)], False),  # an image counted twice
    ([(0.5, 7), (0.5, 5)], False),  # an image lost
])
def test_the_map_ranks_row_fails_on_another_figure_or_count(monkeypatch, ranks, ok):
    import argparse

    from runner.bench.selfcheck import target_rows

    monkeypatch.setattr(harness, "DEVICE", "cpu")
    monkeypatch.setattr(target_rows, "_validation",
                        lambda device, ranks=None: ({"map": 0.5, "map_50": 0.75}, 13))

    def spawned(world, device, out):
        for rank, (figure, counted) in enumerate(ranks):
            torch.save({"figures": {"map": figure, "map_50": 0.75}, "counted": counted},
                       f"{out}.{rank}")

    monkeypatch.setattr(target_rows, "_spawn_ranks", spawned)
    (row,) = target_rows.check_map_ranks(argparse.Namespace(size=224, batch_size=256))
    assert row.ok is ok, row.figure


def test_a_rank_that_fails_is_named_by_its_error(monkeypatch):
    import argparse

    from runner.bench.selfcheck import target_rows

    monkeypatch.setattr(harness, "DEVICE", "cpu")
    monkeypatch.setattr(target_rows, "_validation",
                        lambda device, ranks=None: ({"map": 0.5, "map_50": 0.75}, 13))

    def broken(world, device, out):
        raise RuntimeError("\n\n-- Process 1 terminated with the following error:\nTraceback "
                           "(most recent call last):\n  File \"x.py\", line 1\nValueError: "
                           "rank one broke\n")

    monkeypatch.setattr(target_rows, "_spawn_ranks", broken)
    (row,) = target_rows.check_map_ranks(argparse.Namespace(size=224, batch_size=256))
    assert row.ok is False and row.figure == "RuntimeError: ValueError: rank one broke"


def test_the_detection_rows_say_how_to_run_them_without_the_detection_extra(monkeypatch,
                                                                            capsys):
    """A node's wheelhouse (docs/gpu.md) may lack torchmetrics and pycocotools: the rows
    that score boxes and masks are untested, saying which wheels to bring."""
    monkeypatch.setattr(selfcheck, "CHECKS", [c for c in CHECKS
                                              if c.name in ("map-ranks", "bf16-targets")])
    real = selfcheck.importlib.util.find_spec
    monkeypatch.setattr(selfcheck.importlib.util, "find_spec",
                        lambda name, *a: None if name == "pycocotools" else real(name, *a))
    monkeypatch.setattr(harness, "DEVICE", "cpu")
    assert main(["--no-build"]) == 0
    untested = capsys.readouterr().out.split("untested here:")[1]
    for name in ("map-ranks", "bf16-targets"):
        line = next(x for x in untested.splitlines() if f" {name} " in x)
        assert "pycocotools not installed; bring them as wheels" in line, line
