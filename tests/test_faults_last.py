"""Issue 37's last faults: what the user sets is what runs, a model's size need named, a
live run's folder left alone, messages that point the right way, memory checked against
the real limit, a refused store's reserved space released."""

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


@pytest.mark.parametrize("task", ["train", "infer"])
def test_an_image_size_the_model_cannot_take_names_the_setting_and_the_size(
        twelve: Path, tmp_path: Path, task: str):
    from runner.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        run_in_process("model=tiny", f"task={task}", "logger=none", "diagnose=false",
                       f"dataset.path={twelve}", "dataset.image_size=[1,1]", "run.steps=2",
                       run_dir=tmp_path / "run")
    message = str(e.value)
    assert "dataset.image_size=[1, 1] is too small for model tiny" in message
    side = int(message.split("the smallest square size it takes is ")[1].split(":")[0])
    assert f"dataset.image_size=[{side},{side}]" in message
    # the size it names works
    m = run_in_process("model=tiny", f"task={task}", "logger=none", "diagnose=false",
                       f"dataset.path={twelve}", f"dataset.image_size=[{side},{side}]",
                       "run.steps=2", run_dir=tmp_path / "ok")
    assert m["status"] == "ok"
