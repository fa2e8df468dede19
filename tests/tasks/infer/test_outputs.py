"""runner/tasks/infer/outputs.py: what inference writes row by row (task.postprocess checked on
every batch, files.txt aligned with the arrays, aliases kept inside the run folder, writer
threads on the run's GPU)."""

from __future__ import annotations

import csv
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from runner.common.errors import ConfigError
from runner.config.schema import (
    ModelConfig,
)
from runner.data.sources.listing import list_images
from runner.data.storage import STORAGES
from runner.job.compose import compose
from runner.model.networks import build_model
from tests.conftest import (
    encode,
    make_tree,
    photo,
    read_metrics,
    run_cli,
    run_in_process,
)

BASE = ["task=infer", "logger=none", "diagnose=false", "run.timeline=false",
        "dataset.image_size=[32,32]", "loader.batch_size=4", "run.warmup_steps=0"]

HELPERS = '''
import numpy as np


def as_probs(output, batch):
    return {"probs": output.float() * 0 + 7}


def one_row(output, batch):
    return {"first": output.float()[:1, 0]}


def raises(output, batch):
    raise ValueError("boom\\non two lines")


def a_list(output, batch):
    return [output]


def an_array(output, batch):
    return {"x": np.zeros(len(output))}


def width_by_batch(output, batch):
    return {"x": output.float()[:, : output.shape[0] % 3 + 1]}


def named_by_batch(output, batch):
    return {f"x{output.shape[0]}": output.float()[:, 0]}
'''

@pytest.fixture
def labelled(tmp_path: Path) -> Path:
    files = {f"{c}/{k}.jpg": encode(photo(40, 52, 10 * i + k))
             for i, c in enumerate(["cat", "dog", "owl"]) for k in range(5)}
    return make_tree(tmp_path / "labelled", files)

@pytest.fixture
def helpers(tmp_path: Path, monkeypatch) -> str:
    """A module of task.postprocess functions, importable as ``align_post``."""
    folder = tmp_path / "helpers"
    folder.mkdir()
    (folder / "align_post.py").write_text(HELPERS)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(__import__("sys").modules, "align_post", raising=False)
    return "align_post"

def post_run(labelled: Path, run_dir: Path, target: str, *more: str) -> dict:
    return run_in_process(*BASE, f"dataset.path={labelled}", "run.epochs=1",
                          f"task.postprocess={target}", *more, run_dir=run_dir)

def test_a_postprocess_name_of_a_built_in_output_is_refused(labelled, helpers, tmp_path):
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"task.postprocess=.*'probs'.*built-in") as e:
        post_run(labelled, run, f"{helpers}:as_probs", "task.outputs=[probs]")
    assert "\n" not in str(e.value)
    assert not (run / "tiny.probs.npy").exists()  # not overwritten, not even made

def test_a_postprocess_that_returns_one_row_is_refused_before_anything_is_written(
        labelled, helpers, tmp_path):
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"task.postprocess=.*'first'.*batch of 2 images"):
        post_run(labelled, run, f"{helpers}:one_row", "task.outputs=[logits]")
    assert not list(run.glob("*.npy")) and not (run / "files.txt").exists()

@pytest.mark.slow
@pytest.mark.parametrize("function, said", [
    ("raises", "raised ValueError: boom on two lines"),
    ("a_list", "returned a list"),
    ("an_array", "'x' as a ndarray"),
    ("width_by_batch", "other names or row shapes"),
    ("named_by_batch", "other names or row shapes"),
])
def test_a_wrong_postprocess_fails_in_one_line_naming_it(labelled, helpers, tmp_path,
                                                         function, said):
    with pytest.raises(ConfigError, match=r"task.postprocess=") as e:
        post_run(labelled, tmp_path / "run", f"{helpers}:{function}",
                 "task.outputs=[logits]")
    assert said in str(e.value) and "\n" not in str(e.value)

def test_a_right_postprocess_still_writes_its_rows(labelled, tmp_path):
    m = post_run(labelled, tmp_path / "run", "tests.nets:top_logit", "task.outputs=[logits]")
    assert m["status"] == "ok"
    top = np.load(tmp_path / "run" / "tiny.top_logit.npy")
    logits = np.load(tmp_path / "run" / "tiny.logits.npy")
    np.testing.assert_allclose(top, logits.max(axis=1), rtol=1e-5)

ODD = ["a.jpg", "b\nc.jpg", "d\re.jpg", "f\u2028g.jpg", '"quoted".jpg', "h,i.jpg", "j.jpg"]

def test_odd_names_keep_files_txt_and_the_csv_aligned(tmp_path: Path):
    src = make_tree(tmp_path / "odd", {n: encode(photo(40, 52, k)) for k, n in enumerate(ODD)})
    names = [str(Path(p).relative_to(src))
             for p, _ in list_images(compose([*BASE, f"dataset.path={src}"]).dataset,
                                     src).samples]
    assert sorted(names) == sorted(ODD)
    run = tmp_path / "run"
    m = run_in_process(*BASE, f"dataset.path={src}", "run.epochs=1",
                       "task.outputs=[topk,logits]", run_dir=run)
    assert m["status"] == "ok"
    raw = (run / "files.txt").read_bytes().decode("utf-8")
    lines = raw.split("\n")[:-1]
    assert len(lines) == len(ODD) == np.load(run / "tiny.logits.npy").shape[0]
    # the rule of the outputs module (runner.tasks.infer.outputs.read_file_line)
    assert [json.loads(line) if line.startswith('"') else line for line in lines] == names
    assert "\r" not in raw and "\u2028" not in raw  # no reader splits a line in two
    with open(run / "predictions.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [r["file"] for r in rows] == names
    assert [int(r["index"]) for r in rows] == list(range(len(ODD)))


CPU = torch.device("cpu")

QUIET_INFER = ["task=infer", "logger=none", "diagnose=false", "run.timeline=false",
        "dataset.image_size=[32,32]", "loader.batch_size=4", "run.warmup_steps=0",
        "run.progress=false", "run.epochs=1"]

def rows(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))

def save_tiny(path: Path, seed: int, classes: int = 3) -> Path:
    torch.manual_seed(seed)
    torch.save(build_model(ModelConfig("tiny"), classes, CPU)[1].state_dict(), path)
    return path


GOOD = [f"{k:02d}.jpg" for k in range(10) if k not in (1, 9)]

def test_an_undecodable_image_leaves_no_row_in_the_arrays_or_files_txt(with_broken: Path,
                                                                      tmp_path: Path):
    weights = save_tiny(tmp_path / "w.pt", 1, classes=1000)
    over = [*QUIET_INFER, f"dataset.path={with_broken}", "task.outputs=[topk,probs,logits]",
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

def test_an_alias_with_dots_cannot_write_outside_the_run_folder(tmp_path: Path):
    data = make_tree(tmp_path / "data", {f"{k}.jpg": encode(photo(40, 52, k))
                                         for k in range(4)})
    with pytest.raises(ConfigError, match="alias"):
        run_in_process(*QUIET_INFER, f"dataset.path={data}", "task.outputs=[probs]",
                       "+models=[{name:tiny,alias:../evil},{name:tiny,alias:b}]",
                       run_dir=tmp_path / "run")
    assert not (tmp_path / "evil.probs.npy").exists()
    assert compose(["task=infer", "model.alias=my-model_v2.1"]).model.alias == "my-model_v2.1"


def test_writer_threads_bind_to_the_runs_gpu(monkeypatch):
    """Each writer thread makes the run's GPU its current device before any CUDA call (an
    index-less ``cuda`` resolved on the main thread), so under torchrun no writer opens a
    context on GPU 0."""
    from runner.tasks.infer.outputs import Outputs

    bound = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda index: bound.append((index, threading.current_thread().name)))
    outputs = Outputs({}, threads=2, device=torch.device("cuda"))
    try:
        outputs.pool.submit(lambda: None).result()
    finally:
        outputs.pool.shutdown(wait=True)
    assert bound and all(index == 3 and name.startswith("outputs") for index, name in bound)

    bound.clear()
    outputs = Outputs({}, threads=1, device=torch.device("cuda", 1))
    outputs.pool.submit(lambda: None).result()
    outputs.pool.shutdown(wait=True)
    assert [index for index, _ in bound] == [1]

    bound.clear()
    cpu = Outputs({}, threads=1, device=CPU)
    cpu.pool.submit(lambda: None).result()
    cpu.pool.shutdown(wait=True)
    assert bound == []  # a CPU run touches no CUDA API


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.parametrize("loader", ["folder", "memmap"])
def test_an_infer_run_over_a_non_utf8_file_name_keeps_every_prediction(
        tmp_path: Path, cache_dir: Path, loader: str):
    root = make_tree(tmp_path / "tree", {f"a/{k}.jpg": encode(photo(40, 40, index=k))
                                         for k in range(5)})
    odd = os.path.join(os.fsencode(root / "a"), b"caf\xe9-\xff.jpg")  # latin-1 bytes
    with open(odd, "wb") as f:
        f.write(encode(photo(40, 40, index=9)))
    run_cli(f"dataset.path={root}", "dataset.image_size=[32,32]", f"loader={loader}",
            "loader.batch_size=4", "loader.num_workers=0", "task=infer", "model=tiny",
            "logger=none", "run.warmup_steps=1", "run.progress=false", "hydra.run.dir=run",
            cwd=tmp_path)
    assert read_metrics(tmp_path / "run")["status"] == "ok"
    with open(tmp_path / "run" / "predictions.csv", encoding="utf-8", newline="") as f:
        names = [row["file"] for row in csv.DictReader(f)]
    assert len(names) == 6
    assert any(r"caf\xe9-\xff.jpg" in name for name in names)
