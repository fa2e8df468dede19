"""Output kinds are records (runner/tasks/infer/kinds/): every ``Output`` has one; a new kind is
its enum value and its module, run for real; ``task.reduce_on`` and ``task.writer_threads``
change where the work is done, never what is written."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from runner.common.errors import ConfigError
from runner.config.schema import ModelConfig, Output
from runner.job.compose import compose
from runner.model.networks import build_model
from tests.conftest import REPO, encode, make_tree, photo, run_in_process

BASE = ["task=infer", "logger=none", "diagnose=false", "run.timeline=false",
        "dataset.image_size=[32,32]", "loader.batch_size=4", "run.warmup_steps=0",
        "run.epochs=1"]


def test_every_output_has_a_complete_record_in_its_module():
    from runner.tasks.infer.kinds import OUTPUT_KINDS, built_in_keys, kind_of
    from runner.tasks.infer.kinds.kind import DETECTIONS, FEATURES, LOGITS, OutputKind

    assert set(OUTPUT_KINDS) == set(Output)
    for name, kind in OUTPUT_KINDS.items():
        assert isinstance(kind, OutputKind) and kind.name is name
        assert (REPO / "runner" / "tasks" / "infer" / "kinds" / f"{name.value}.py").is_file()
        assert kind.keys and callable(kind.reduce) and callable(kind.writer) and kind.files
        assert kind.needs in (LOGITS, FEATURES, DETECTIONS)
        assert all(kind_of(key) is kind for key in kind.keys)
        assert name.value in built_in_keys()


MARGIN = '''"""``task.outputs=[margin]``: how far the top class leads the second (a test's kind)."""

import torch

from runner.config.schema import Output
from runner.tasks.infer.kinds.kind import OutputKind, RowsWriter


def reduce(logits, task):
    top = torch.softmax(logits.float(), dim=1).topk(2, dim=1).values
    return {"margin": top[:, 0] - top[:, 1]}


KIND = OutputKind(Output.margin, ("margin",), reduce, RowsWriter,
                  files="<model>.margin.npy: top-1 probability minus top-2, per image")
'''


@pytest.mark.process
@pytest.mark.slow  # a copy of the package, a run in a subprocess
def test_an_output_kind_is_its_enum_value_and_its_module(tmp_path: Path):
    """What adding an output kind takes, run for real: a copy of the package with one more
    ``Output`` value and one more module; an inference asked for it writes it, and its rows
    are what its reduction gives on the probabilities written beside it."""
    copy = tmp_path / "checkout"
    shutil.copytree(REPO / "runner", copy / "runner",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "conf", copy / "conf")
    config = copy / "runner" / "config" / "schema.py"
    text = config.read_text()
    line = '    masks = "masks"'
    at = text.index("class Output(")  # Output's own member (Targets has a masks too)
    assert line in text[at:]
    config.write_text(text[:at] + text[at:].replace(line, line + '\n    margin = "margin"', 1))
    (copy / "runner" / "tasks" / "infer" / "kinds" / "margin.py").write_text(MARGIN)
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "runner", *BASE, "dataset.num_images=10",
         "dataset.num_classes=3", "dataset.source_size=[40,48]", "run.progress=false",
         "task.outputs=[probs,margin]", f"hydra.run.dir={run}"],
        cwd=copy, env={"PYTHONPATH": str(copy), "RUNNER_CACHE": str(tmp_path / "cache"),
                       "PATH": "/usr/bin:/bin", "WANDB_SILENT": "true"},
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    probs = np.load(run / "tiny.probs.npy")
    margin = np.load(run / "tiny.margin.npy")
    assert probs.shape == (10, 3) and margin.shape == (10,)
    ranked = np.sort(probs, axis=1)
    np.testing.assert_array_equal(margin, ranked[:, -1] - ranked[:, -2])


@pytest.fixture
def labelled(tmp_path: Path) -> Path:
    files = {f"{c}/{k}.jpg": encode(photo(40, 52, 10 * i + k))
             for i, c in enumerate(["cat", "dog", "owl"]) for k in range(5)}
    return make_tree(tmp_path / "labelled", files)


def written(run: Path) -> dict[str, bytes]:
    """Every file an inference wrote that holds its outputs, by name (not its logs)."""
    keep = (".csv", ".npy", ".png", ".txt")
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and p.name.endswith(keep) and "hydra" not in p.parts}


@pytest.mark.slow
def test_reducing_on_the_host_and_writing_synchronously_write_the_same_bytes(
        labelled: Path, tmp_path: Path):
    """Every output (top-k CSV, probabilities, logits, embeddings) reduced on the device or
    on the host, written by threads or on the loop's thread: the same files, byte for byte,
    and the figures say how each ran."""
    torch.manual_seed(3)
    model = build_model(ModelConfig("tiny"), 3, torch.device("cpu")).eval()
    torch.save(model[1].state_dict(), tmp_path / "w.pt")
    over = [*BASE, f"dataset.path={labelled}", f"model.weights={tmp_path / 'w.pt'}",
            "task.topk=2", "task.outputs=[topk,probs,logits,embeddings]"]
    runs = {}
    for reduce_on in ("device", "host"):
        for threads in (2, 0):
            run = tmp_path / f"{reduce_on}-{threads}"
            m = run_in_process(*over, f"task.reduce_on={reduce_on}",
                               f"task.writer_threads={threads}", run_dir=run)
            assert m["status"] == "ok" and m["predictions"] == 15
            assert m["config"]["task"]["reduce_on"] == reduce_on
            runs[(reduce_on, threads)] = written(run)
    first = runs[("device", 2)]
    assert {"predictions.csv", "tiny.probs.npy", "tiny.logits.npy",
            "tiny.embeddings.npy", "files.txt"} <= set(first)
    for key, files in runs.items():
        assert files == first, key


@pytest.mark.cuda
def test_on_a_gpu_the_hosts_reduction_gives_the_devices_outputs(labelled: Path,
                                                                 tmp_path: Path):
    """On CUDA the host's softmax is the CPU's and the device's the GPU's: the same classes,
    probabilities within float rounding; logits and embeddings copied as they are."""
    torch.manual_seed(3)
    model = build_model(ModelConfig("tiny"), 3, torch.device("cpu")).eval()
    torch.save(model[1].state_dict(), tmp_path / "w.pt")
    over = [*BASE, f"dataset.path={labelled}", f"model.weights={tmp_path / 'w.pt'}",
            "task.outputs=[topk,probs,logits,embeddings]"]
    got = {}
    for reduce_on in ("device", "host"):
        run = tmp_path / reduce_on
        m = run_in_process(*over, f"task.reduce_on={reduce_on}", run_dir=run)
        assert m["status"] == "ok"  # on the GPU: a run takes CUDA where there is one
        got[reduce_on] = run
    for name in ("probs", "logits", "embeddings"):
        np.testing.assert_allclose(np.load(got["host"] / f"tiny.{name}.npy"),
                                   np.load(got["device"] / f"tiny.{name}.npy"), atol=1e-6)
    rows = [(got[r] / "predictions.csv").read_text().splitlines() for r in got]
    assert [r.split(",")[4] for r in rows[0]] == [r.split(",")[4] for r in rows[1]]


@pytest.mark.slow
def test_masks_reduced_on_the_host_are_the_devices(tmp_path: Path):
    src = make_tree(tmp_path / "scenes", {f"s{k}.jpg": encode(photo(40 + 4 * k, 52, k))
                                          for k in range(3)})
    torch.manual_seed(0)
    model = build_model(ModelConfig("lraspp_mobilenet_v3_large", num_classes=4), 0,
                        torch.device("cpu"), train=False).eval()
    torch.save(model[1].state_dict(), tmp_path / "seg.pt")
    over = [*BASE, f"dataset.path={src}", "dataset.crop=whole", "dataset.image_size=[64,64]",
            "model.name=lraspp_mobilenet_v3_large", f"model.weights={tmp_path / 'seg.pt'}",
            "task.outputs=[masks]"]
    got = {}
    for reduce_on, threads in (("device", 2), ("host", 0)):
        run = tmp_path / reduce_on
        m = run_in_process(*over, f"task.reduce_on={reduce_on}",
                           f"task.writer_threads={threads}", run_dir=run)
        assert m["status"] == "ok"
        got[reduce_on] = written(run)
    assert len([k for k in got["device"] if k.endswith(".png")]) == 3
    assert got["host"] == got["device"]


def test_a_negative_writer_thread_count_is_refused_in_one_line():

    with pytest.raises(ConfigError, match=r"task.writer_threads.*>= 0"):
        compose(["task=infer", "task.writer_threads=-1"])


CPU = torch.device("cpu")

QUIET_INFER = ["task=infer", "logger=none", "diagnose=false", "run.timeline=false",
        "dataset.image_size=[32,32]", "loader.batch_size=4", "run.warmup_steps=0",
        "run.progress=false", "run.epochs=1"]

@pytest.mark.slow
def test_two_images_of_one_name_get_a_mask_each(tmp_path: Path):
    """photo.jpg and photo.png used to both become masks/<model>/photo.png."""
    src = make_tree(tmp_path / "scenes", {"photo.jpg": encode(photo(40, 52, 0)),
                                          "photo.png": encode(photo(60, 36, 1), "PNG")})
    torch.manual_seed(0)
    model = build_model(ModelConfig("lraspp_mobilenet_v3_large", num_classes=4), 0, CPU,
                        train=False).eval()
    torch.save(model[1].state_dict(), tmp_path / "seg.pt")
    m = run_in_process(*QUIET_INFER, f"dataset.path={src}", "dataset.crop=whole",
                       "dataset.image_size=[64,64]", "model.name=lraspp_mobilenet_v3_large",
                       f"model.weights={tmp_path / 'seg.pt'}", "task.outputs=[masks]",
                       run_dir=tmp_path / "run")
    assert m["status"] == "ok"
    masks = tmp_path / "run" / "masks" / "lraspp_mobilenet_v3_large"
    assert sorted(p.name for p in masks.iterdir()) == ["photo.jpg.png", "photo.png.png"]
    assert Image.open(masks / "photo.jpg.png").size == (52, 40)  # each at its own source size
    assert Image.open(masks / "photo.png.png").size == (36, 60)
