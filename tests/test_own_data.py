"""Your own data, start to finish: a checkpoint names the classes it predicts, model.classes
as a list, a dataset folder that is not there (or holds no image) refused before any run
folder, and a verdict from too few steps said on the console."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import pytest

from runner.common.errors import ConfigError
from runner.job.compose import compose, refusal
from tests.conftest import run_cli, run_in_process

QUICK = ["dataset.image_size=[16,16]", "loader.batch_size=4", "run.warmup_steps=1",
         "run.progress=false", "logger=none", "model=tiny", "loader.num_workers=0"]


def predictions(run_dir: Path) -> list[dict]:
    with open(run_dir / "predictions.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_a_checkpoint_names_the_classes_it_predicts(image_tree: Path, tmp_path: Path):
    """Trained on class folders, then given as model.weights to infer on the same images
    unlabelled: pred_name is the class folders' names, not 0, 1, 2."""
    train = tmp_path / "train"
    run_in_process(f"dataset.path={image_tree}", "run.steps=2", "diagnose=false", *QUICK,
                   run_dir=train)
    infer = tmp_path / "infer"
    run_in_process("task=infer", f"dataset.path={image_tree}", "dataset.labels=none",
                   f"model.weights={train / 'checkpoint.pt'}", "diagnose=false", *QUICK,
                   run_dir=infer)
    rows = predictions(infer)
    assert rows and {r["label_name"] for r in rows} == {""}  # the images are unlabelled
    assert {r["pred_name"] for r in rows} <= {"bird", "cat", "Dog"}
    assert set(rows[0]["topk_names"].split()) == {"bird", "cat", "Dog"}


def test_model_classes_takes_a_list_as_well_as_a_file(tmp_path: Path):
    from runner.tasks.infer.outputs import model_classes

    cfg = compose(["model.classes=[cat,dog,bird]"]).model
    assert cfg.classes == ["cat", "dog", "bird"]
    assert model_classes(cfg, 3, []) == ["cat", "dog", "bird"]
    names = tmp_path / "names.txt"
    names.write_text("a\nb\n")
    assert model_classes(compose([f"model.classes={names}"]).model, 2, []) == ["a", "b"]
    with pytest.raises(ConfigError, match="has 3 names, model tiny has 2"):
        model_classes(cfg, 2, [])
    with pytest.raises(ConfigError, match="model.classes=.*a list of names"):
        compose(["model.classes=[]"])
    # the names a checkpoint was trained with come after model.classes, before the data's
    plain = compose([]).model
    assert model_classes(plain, 2, ["x", "y"], ["cat", "dog"]) == ["cat", "dog"]
    assert model_classes(plain, 2, ["x", "y"], None) == ["x", "y"]


def test_an_inference_names_its_classes_from_a_list(image_tree: Path, tmp_path: Path):
    """model.classes=[...] in a task=infer run: the outputs' identity records the list (it
    took the list for a file's path and failed with a TypeError)."""
    run_dir = tmp_path / "infer"
    run_in_process("task=infer", f"dataset.path={image_tree}", "model.classes=[x,y,z]",
                   "run.steps=2", "diagnose=false", *QUICK, run_dir=run_dir)
    assert {r["pred_name"] for r in predictions(run_dir)} <= {"x", "y", "z"}


def test_a_missing_or_empty_dataset_folder_is_refused_before_any_run_folder(tmp_path: Path):
    missing = tmp_path / "nope"
    empty = tmp_path / "empty"
    (empty / "cat").mkdir(parents=True)
    (empty / "cat" / "notes.txt").write_text("no image")
    assert refusal([f"dataset.path={missing}"]).startswith(f"dataset.path='{missing}' does "
                                                            "not exist")
    assert "holds no images" in refusal([f"dataset.path={empty}"])
    assert "dataset.val_path=" in refusal([f"dataset.val_path={missing}"])
    assert "does not exist" in refusal([f"dataset.manifest={missing}.csv"])
    # a URL is not probed here (the job checks it with one request)
    assert "exist" not in (refusal(["dataset.path=s3://bucket/none", "loader=shards"]) or "")
    proc = run_cli(f"dataset.path={empty}", "logger=none", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: dataset.path='{empty}' holds no images (.jpg .jpeg .jpe .jfif .png .webp "
        ".bmp .dib .tif .tiff .gif) in it or its sub-folders: point it at your image folder "
        "(one sub-folder per class, or the images themselves)"]
    assert not (tmp_path / "outputs").exists()


def test_a_verdict_from_too_few_steps_says_so_on_the_console(image_tree: Path,
                                                             tmp_path: Path, caplog):
    caplog.set_level(logging.INFO)
    m = run_in_process(f"dataset.path={image_tree}", "task=infer", "run.steps=3",
                       "task.write_outputs=false", *QUICK, run_dir=tmp_path / "run")
    assert any(f.startswith("few timed steps") for f in m["flags"])
    said = [r.getMessage() for r in caplog.records if "the verdict comes from" in r.getMessage()]
    assert len(said) == 1 and "few timed steps (2;" in said[0]


def test_training_says_model_classes_is_not_its_classes(image_tree: Path, tmp_path: Path,
                                                        caplog):
    """model.classes names an inference's outputs: a training run given it says, in one
    warning, that the data's classes are used (it was ignored without a word)."""
    with caplog.at_level(logging.WARNING, logger="runner"):
        run_in_process(f"dataset.path={image_tree}", "model.classes=[x]", "run.steps=2",
                       "diagnose=false", *QUICK, run_dir=tmp_path / "train")
    said = [r.getMessage() for r in caplog.records if "model.classes" in r.getMessage()]
    assert len(said) == 1 and "not used in training" in said[0] and "cat" in said[0], said
