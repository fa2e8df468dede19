"""task=infer gives no silent wrong answers (issue 37): a resume never mixes two runs' rows,
inference never drops images, an undecodable image leaves no row, a model's alias never
writes outside the run folder, and two images never share one mask."""

from __future__ import annotations

import csv
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from runner.common.errors import ConfigError, UserError
from runner.config.schema import ModelConfig
from runner.data.storage import STORAGES
from runner.job.compose import compose
from runner.model.networks import build_model
from tests.conftest import encode, make_tree, photo, run_in_process, stopped_after

CPU = torch.device("cpu")
BASE = ["task=infer", "logger=none", "diagnose=false", "run.timeline=false",
        "dataset.image_size=[32,32]", "loader.batch_size=4", "run.warmup_steps=0",
        "run.progress=false", "run.epochs=1"]


def rows(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def save_tiny(path: Path, seed: int, classes: int = 3) -> Path:
    torch.manual_seed(seed)
    torch.save(build_model(ModelConfig("tiny"), classes, CPU)[1].state_dict(), path)
    return path


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> tuple[Path, list[str], Path, Path]:
    """A labelled folder of 15 images, two weights files, and a run over it with weights A
    stopped after 2 of its 4 batches: (the run folder, its overrides, A, B)."""
    tmp = tmp_path_factory.mktemp("stopped")
    data = make_tree(tmp / "data", {f"{c}/{k}.jpg": encode(photo(40, 52, 10 * i + k))
                                    for i, c in enumerate(["cat", "dog", "owl"])
                                    for k in range(5)})
    a, b = save_tiny(tmp / "a.pt", 1), save_tiny(tmp / "b.pt", 2)
    over = [*BASE, f"dataset.path={data}", f"model.weights={a}",
            "task.outputs=[topk,probs]"]
    stopped_after(2, over, tmp / "run")
    return tmp / "run", over, a, b


def resume_refused(run_dir: Path, over: list[str], *changed: str) -> str:
    """The one-line refusal of ``over`` changed by ``changed``, resumed into ``run_dir``."""
    with pytest.raises(UserError) as refused:
        run_in_process(*over, *changed, "resume=auto", run_dir=run_dir)
    message = str(refused.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("change, key, old, new", [
    ("model.weights=B", "model.weights", "a.pt", "b.pt"),
    ("+models=[{name:tiny,weights:A,alias:a},{name:tiny,weights:B,alias:b}]", "models",
     "['tiny']", "['a', 'b']"),
    ("task.outputs=[topk,probs,embeddings]", "task.outputs", "['topk', 'probs']",
     "['topk', 'probs', 'embeddings']"),
    ("task.topk=2", "task.topk", "5", "2"),
    ("model.mean=[0.5,0.5,0.5]", "model.mean", "0.485", "0.5"),
    ("amp=bf16", "amp.name", "off", "bf16"),
    ("compile=torchscript", "compile.name", "eager", "torchscript"),
    ("model.channels_last=true", "model.channels_last", "False", "True"),
    ("dataset.crop_fraction=1.0", "dataset.crop_fraction", "0.875", "1.0"),
    ("task.reduce_on=host", "task.reduce_on", "None", "host"),
])
def test_a_resume_that_would_change_an_output_is_refused_naming_the_key(
        stopped, tmp_path: Path, change: str, key: str, old: str, new: str):
    """Rows of weights A and weights B (or a model, an output added at the resume) would
    end up in one output under a metrics.json naming the resume's settings."""
    source, over, a, b = stopped
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    change = change.replace("A", str(a)).replace("B", str(b))
    message = resume_refused(run_dir, over, change)
    assert key in message and old in message and new in message, message
    assert "stopped" in message
    assert not (run_dir / "predictions.csv").exists()  # nothing joined, nothing mixed
    assert not list(run_dir.glob("*.embeddings.npy")) and not (run_dir / "a.probs.npy").exists()


def test_weights_rewritten_in_place_are_refused_at_the_resume(tmp_path: Path):
    """The same model.weights path with other contents (a retrained model saved over it)."""
    data = make_tree(tmp_path / "data", {f"{k}.jpg": encode(photo(40, 52, k))
                                         for k in range(8)})
    weights = save_tiny(tmp_path / "w.pt", 1)
    over = [*BASE, f"dataset.path={data}", f"model.weights={weights}"]
    stopped_after(1, over, tmp_path / "run")
    before = os.stat(weights)
    save_tiny(weights, 2)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    message = resume_refused(tmp_path / "run", over)
    assert "model.weights" in message and "modified" in message and "stopped" in message
    assert not (tmp_path / "run" / "predictions.csv").exists()


def test_the_same_settings_still_resume(stopped, tmp_path: Path):
    source, over, _, _ = stopped
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    m = run_in_process(*over, "resume=auto", run_dir=run_dir)
    assert m["status"] == "ok" and m["start_step"] == 2
    assert len(rows(run_dir / "predictions.csv")) == 15
    assert np.load(run_dir / "tiny.probs.npy").shape == (15, 3)


def test_a_finished_run_asked_for_more_says_so_and_refuses(tmp_path: Path):
    """A finished run resumed with another output used to report ok and write nothing."""
    data = make_tree(tmp_path / "data", {f"{k}.jpg": encode(photo(40, 52, k))
                                         for k in range(6)})
    over = [*BASE, f"dataset.path={data}", "task.outputs=[topk]"]
    assert run_in_process(*over, "resume=auto", run_dir=tmp_path / "run")["status"] == "ok"
    asked = [*over[:-1], "task.outputs=[topk,probs]"]
    message = resume_refused(tmp_path / "run", asked)
    assert "finished" in message and "task.outputs" in message, message
    assert "['topk']" in message and "['topk', 'probs']" in message
    assert not (tmp_path / "run" / "tiny.probs.npy").exists()
    # the same settings again: the finished run stands
    assert run_in_process(*over, "resume=auto", run_dir=tmp_path / "run")["status"] == "ok"


def test_a_finished_run_whose_weights_changed_is_not_reported_as_done(tmp_path: Path):
    data = make_tree(tmp_path / "data", {f"{k}.jpg": encode(photo(40, 52, k))
                                         for k in range(6)})
    weights = save_tiny(tmp_path / "w.pt", 1)
    over = [*BASE, f"dataset.path={data}", f"model.weights={weights}"]
    assert run_in_process(*over, "resume=auto", run_dir=tmp_path / "run")["status"] == "ok"
    before = os.stat(weights)
    save_tiny(weights, 2)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    message = resume_refused(tmp_path / "run", over)
    assert "finished" in message and "model.weights" in message, message


# --- 2. loader.drop_last ---------------------------------------------------------------------

def test_inference_ignores_drop_last_and_says_so_once(tmp_path: Path, caplog):
    data = make_tree(tmp_path / "data", {f"{k:02d}.jpg": encode(photo(40, 52, k))
                                         for k in range(15)})  # 3 batches of 4, then 3
    with caplog.at_level(logging.WARNING):
        m = run_in_process(*BASE, f"dataset.path={data}", "loader.drop_last=true",
                           "task.outputs=[topk,probs]", run_dir=tmp_path / "run")
    assert m["status"] == "ok" and m["config"]["loader"]["drop_last"] is False
    got = rows(tmp_path / "run" / "predictions.csv")
    assert [r["file"] for r in got] == [f"{k:02d}.jpg" for k in range(15)]
    probs = np.load(tmp_path / "run" / "tiny.probs.npy")
    assert probs.shape == (15, 1000) and (probs.sum(axis=1) > 0.99).all()  # no zero row
    assert caplog.text.count("loader.drop_last") == 1, caplog.text
    assert compose(["task=train", "loader.drop_last=true"]).loader.drop_last is True


# --- 3. undecodable images -------------------------------------------------------------------

@pytest.fixture
def with_broken(tmp_path: Path) -> Path:
    """Ten images in sorted order, two of them broken: one in the first batch of 4, one in
    the third."""
    files = {f"{k:02d}.jpg": encode(photo(40, 52, k)) for k in range(10)}
    files["01.jpg"] = b"\xff\xd8\xff not really a JPEG"
    files["09.jpg"] = b"not an image at all"
    return make_tree(tmp_path / "data", files)


GOOD = [f"{k:02d}.jpg" for k in range(10) if k not in (1, 9)]


def test_an_undecodable_image_leaves_no_row_in_the_arrays_or_files_txt(with_broken: Path,
                                                                      tmp_path: Path):
    weights = save_tiny(tmp_path / "w.pt", 1, classes=1000)
    over = [*BASE, f"dataset.path={with_broken}", "task.outputs=[topk,probs,logits]",
            f"model.weights={weights}"]
    m = run_in_process(*over, run_dir=tmp_path / "run")
    assert m["status"] == "ok" and len(m["skipped_files"]) == 2
    run = tmp_path / "run"
    assert (run / "files.txt").read_text().splitlines() == GOOD
    assert [r["file"] for r in rows(run / "predictions.csv")] == GOOD
    logits = np.load(run / "tiny.logits.npy")
    assert logits.shape == (8, 1000) and np.load(run / "tiny.probs.npy").shape == (8, 1000)
    # row i is the image on line i of files.txt: the model run on that image here
    cfg = compose(over)
    storage = STORAGES[cfg.loader.name].open(cfg.loader, cfg.dataset, with_broken, False)
    model = build_model(ModelConfig("tiny", weights=str(weights)), 1000, CPU).eval()
    names = storage.names()
    images = torch.stack([storage[names.index(name)].image for name in GOOD])
    with torch.inference_mode():
        np.testing.assert_allclose(logits, model(images).float().numpy(), atol=1e-5)
    assert not list(run.glob(".written*"))  # the run's own bookkeeping is gone


def test_a_resumed_run_with_undecodable_images_writes_the_same_bytes(with_broken: Path,
                                                                    tmp_path: Path):
    over = [*BASE, f"dataset.path={with_broken}", "task.outputs=[topk,probs,embeddings]"]
    assert run_in_process(*over, run_dir=tmp_path / "whole")["status"] == "ok"
    stopped_after(1, over, tmp_path / "parts")
    m = run_in_process(*over, "resume=auto", run_dir=tmp_path / "parts")
    assert m["status"] == "ok" and m["start_step"] == 1
    for name in ("predictions.csv", "tiny.probs.npy", "tiny.embeddings.npy", "files.txt"):
        assert (tmp_path / "parts" / name).read_bytes() == \
            (tmp_path / "whole" / name).read_bytes(), name
    assert np.load(tmp_path / "parts" / "tiny.probs.npy").shape[0] == len(GOOD)


# --- 4. aliases ------------------------------------------------------------------------------

@pytest.mark.parametrize("alias", ["../evil", "sub/name", "..", ".hidden", "a\\b", ""])
def test_an_alias_that_is_not_a_plain_name_is_refused_at_the_config_check(alias: str):
    for over in ([f"model.alias='{alias}'"], [f"+models=[{{name:tiny,alias:'{alias}'}}]"]):
        with pytest.raises(ConfigError, match="alias") as refused:
            compose(["task=infer", *over])
        assert "\n" not in str(refused.value)


def test_an_alias_with_dots_cannot_write_outside_the_run_folder(tmp_path: Path):
    data = make_tree(tmp_path / "data", {f"{k}.jpg": encode(photo(40, 52, k))
                                         for k in range(4)})
    with pytest.raises(ConfigError, match="alias"):
        run_in_process(*BASE, f"dataset.path={data}", "task.outputs=[probs]",
                       "+models=[{name:tiny,alias:../evil},{name:tiny,alias:b}]",
                       run_dir=tmp_path / "run")
    assert not (tmp_path / "evil.probs.npy").exists()
    assert compose(["task=infer", "model.alias=my-model_v2.1"]).model.alias == "my-model_v2.1"


# --- 5. masks --------------------------------------------------------------------------------

def test_two_images_of_one_name_get_a_mask_each(tmp_path: Path):
    """photo.jpg and photo.png used to both become masks/<model>/photo.png."""
    src = make_tree(tmp_path / "scenes", {"photo.jpg": encode(photo(40, 52, 0)),
                                          "photo.png": encode(photo(60, 36, 1), "PNG")})
    torch.manual_seed(0)
    model = build_model(ModelConfig("lraspp_mobilenet_v3_large", num_classes=4), 0, CPU,
                        train=False).eval()
    torch.save(model[1].state_dict(), tmp_path / "seg.pt")
    m = run_in_process(*BASE, f"dataset.path={src}", "dataset.crop=whole",
                       "dataset.image_size=[64,64]", "model.name=lraspp_mobilenet_v3_large",
                       f"model.weights={tmp_path / 'seg.pt'}", "task.outputs=[masks]",
                       run_dir=tmp_path / "run")
    assert m["status"] == "ok"
    masks = tmp_path / "run" / "masks" / "lraspp_mobilenet_v3_large"
    assert sorted(p.name for p in masks.iterdir()) == ["photo.jpg.png", "photo.png.png"]
    assert Image.open(masks / "photo.jpg.png").size == (52, 40)  # each at its own source size
    assert Image.open(masks / "photo.png.png").size == (36, 60)
