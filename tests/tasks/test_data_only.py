"""model=none (runner/tasks/data_only.py): a data-only run runs the length asked, or is lengthened
and says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import encode, make_tree, photo, read_metrics, run_in_process


@pytest.fixture
def twelve(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "data", {f"{c}/{k}.jpg": encode(photo(40, 52, 10 * i + k))
                                         for i, c in enumerate(["a", "b"]) for k in range(6)})

DATA_ONLY = ["model=none", "logger=none", "diagnose=false", "run.timeline=false",
             "dataset.image_size=[32,32]", "loader.batch_size=4", "run.warmup_steps=0",
             "run.window_seconds=5"]

@pytest.mark.parametrize("length, steps", [("run.epochs=1", 3), ("run.steps=2", 2)])
def test_a_data_only_run_runs_the_length_asked_and_flags_it_short(twelve: Path, tmp_path: Path,
                                                                  length: str, steps: int):
    m = run_in_process(*DATA_ONLY, f"dataset.path={twelve}", length, run_dir=tmp_path / "run")
    assert m["status"] == "ok" and m["steps"] == steps
    assert any(f.startswith("short windows") for f in m["flags"]), m["flags"]

def test_a_data_only_run_with_no_length_asked_is_still_lengthened(twelve: Path, tmp_path: Path):
    m = run_in_process(*DATA_ONLY, f"dataset.path={twelve}", "run.window_seconds=0.2",
                       run_dir=tmp_path / "run")
    assert m["status"] == "ok" and m["steps"] > 3
    assert read_metrics(tmp_path / "run")["steps"] == m["steps"]
