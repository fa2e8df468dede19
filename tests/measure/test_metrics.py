"""metrics.json against its one declaration (runner/measure/metrics.py): real runs, in process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.common.errors import UserError
from runner.measure.metrics import Metrics, problems
from tests.conftest import SMALL_DATASET, read_metrics, run_in_process

BASE = [*SMALL_DATASET, "logger=none", "run.timeline=true"]


def checked(run_dir: Path, returned: dict) -> dict:
    """The record on disk, every key declared with its type (and the same as returned)."""
    record = read_metrics(run_dir)
    assert problems(record) == []
    assert problems(json.loads(json.dumps(returned, default=str))) == []
    assert set(record) == set(returned)
    return record


@pytest.mark.slow
def test_a_train_run_writes_only_declared_keys(tmp_path: Path, cache_dir: Path):
    m = run_in_process(*BASE, "run.epochs=2", "dataset.val_fraction=0.2", "task.ema_decay=0.9",
                       run_dir=tmp_path / "run")
    record = checked(tmp_path / "run", m)
    assert record["status"] == "ok"
    # the task's own keys are there: its losses, its epochs, the EMA's validation, its file
    for key in ("loss_first", "epochs", "val_ema_top1", "optimizer_ms", "checkpoint",
                "bottleneck", "timeline"):
        assert key in record, key


@pytest.mark.slow
def test_an_infer_run_writes_only_declared_keys(tmp_path: Path, cache_dir: Path):
    m = run_in_process(*BASE, "task=infer", "task.outputs=[topk,probs]", "run.epochs=1",
                       run_dir=tmp_path / "run")
    record = checked(tmp_path / "run", m)
    assert record["predictions"] == 60 and "models" in record and "write_wait_frac" in record


@pytest.mark.slow
def test_a_data_only_run_and_a_resumed_one_write_only_declared_keys(tmp_path: Path,
                                                                      cache_dir: Path):
    m = run_in_process(*BASE, "model=none", "run.steps=4", run_dir=tmp_path / "run")
    record = checked(tmp_path / "run", m)
    assert "loss_first" not in record and "models" not in record
    m = run_in_process(*BASE, "run.steps=3", run_dir=tmp_path / "train")
    m = run_in_process(*BASE, "run.steps=5", "resume=auto", run_dir=tmp_path / "train")
    assert checked(tmp_path / "train", m)["start_step"] == 3


def test_a_failed_run_writes_only_declared_keys(tmp_path: Path, cache_dir: Path):
    with pytest.raises(UserError):
        run_in_process(*BASE, f"dataset.path={tmp_path / 'nowhere'}", run_dir=tmp_path / "run")
    record = read_metrics(tmp_path / "run")
    assert record["status"] == "failed" and record["user_error"] is True
    assert problems(record) == []


def test_problems_names_an_undeclared_key_and_a_wrong_type():
    assert problems({"status": "ok", "images_per_sec": None, "steps": 3}) == []
    found = problems({"status": 1, "images_per_sec": "fast", "speed": 3, "steps": True})
    assert [f.split(":")[0] for f in found] == ["status", "images_per_sec", "speed", "steps"]
    assert "not declared" in found[2]


def test_every_declared_key_has_its_one_line_meaning():
    source = Path(__import__("runner.measure.metrics").measure.metrics.__file__).read_text()
    for key in Metrics.__annotations__:
        line = next(x for x in source.splitlines() if x.strip().startswith(f"{key}:"))
        assert "#" in line and line.split("#", 1)[1].strip(), key


def test_a_detectors_validation_figures_are_declared():
    """val_map and val_map_50 (the EMA's too): a float, or null where nothing was measured."""
    record = {"val_map": 0.31, "val_map_50": None, "val_ema_map": 0.2, "val_ema_map_50": 0.5}
    assert problems(record) == []
