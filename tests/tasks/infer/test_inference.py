"""task=infer as users run it: unlabelled folders and manifests, every image format, several
models with their own weights, classes and normalization, every output checked against the
model run directly, masks at the source size, and a stopped run resumed byte for byte."""

from __future__ import annotations

import csv
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tensordict import TensorDict

from runner.common.errors import ConfigError, UserError
from runner.config.schema import ModelConfig, TaskConfig, TaskName
from runner.data.sources.listing import UNLABELLED, list_images
from runner.data.storage import STORAGES
from runner.job.compose import compose
from runner.model.networks import build_model
from runner.tasks import InferStep
from runner.tasks.infer.outputs import ModelWriter, Outputs, Reduce
from tests.conftest import (
    REPO,
    encode,
    make_tree,
    photo,
    predictions,
    read_metrics,
    run_in_process,
    stopped_after,
)

CPU = torch.device("cpu")
BASE = ["task=infer", "logger=none", "diagnose=false", "run.timeline=false",
        "dataset.image_size=[32,32]", "loader.batch_size=4", "run.warmup_steps=0"]


def sixteen_bit_png(index: int) -> bytes:
    gray = (photo(40, 52, index=index)[..., 0].astype(np.uint16) * 257)
    import io

    buf = io.BytesIO()
    Image.fromarray(gray).save(buf, "PNG")  # mode I;16
    return buf.getvalue()


@pytest.fixture
def flat(tmp_path: Path) -> Path:
    """A flat folder of unlabelled images in every format PIL reads, a sub-folder, a broken
    file and a file that is not an image."""
    return make_tree(tmp_path / "flat", {
        "a.jpg": encode(photo(40, 52, 0)), "b.png": encode(photo(44, 50, 1), "PNG"),
        "c.webp": encode(photo(40, 60, 2), "WEBP"), "d.bmp": encode(photo(36, 48, 3), "BMP"),
        "e.tiff": encode(photo(40, 40, 4), "TIFF"), "f.gif": encode(photo(40, 52, 5), "GIF"),
        "g_gray.jpg": encode(photo(40, 52, 6), mode="L"), "h16.png": sixteen_bit_png(7),
        "sub/i.jpg": encode(photo(48, 64, 8)), "zz_broken.jpg": b"\xff\xd8\xff not really",
        "notes.txt": b"not an image",
    })


def rows(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_a_flat_folder_is_read_unlabelled_in_sorted_order_with_every_format(flat: Path,
                                                                               caplog):
    listing = list_images(compose(BASE).dataset, flat)
    names = [str(Path(p).relative_to(flat)) for p, _ in listing.samples]
    assert names == ["a.jpg", "b.png", "c.webp", "d.bmp", "e.tiff", "f.gif", "g_gray.jpg",
                     "h16.png", "sub/i.jpg", "zz_broken.jpg"]
    assert {label for _, label in listing.samples} == {UNLABELLED} and not listing.classes
    assert "notes.txt" in caplog.text  # said, not silently left out


def test_inference_on_a_flat_folder_decodes_every_format_and_skips_the_broken(flat: Path,
                                                                              tmp_path: Path):
    m = run_in_process(*BASE, f"dataset.path={flat}", "run.epochs=1", run_dir=tmp_path / "run")
    assert m["status"] == "ok"
    got = rows(tmp_path / "run" / "predictions.csv")
    assert [r["file"] for r in got] == ["a.jpg", "b.png", "c.webp", "d.bmp", "e.tiff",
                                        "f.gif", "g_gray.jpg", "h16.png", "sub/i.jpg"]
    assert all(r["label"] == "-1" and r["label_name"] == "" for r in got)
    assert len(m["skipped_files"]) == 1 and "zz_broken.jpg" in str(m["skipped_files"][0])


def test_a_sixteen_bit_image_becomes_eight_bit_rgb(flat: Path):
    cfg = compose([*BASE, f"dataset.path={flat}"])
    storage = STORAGES[cfg.loader.name].open(cfg.loader, cfg.dataset, flat, False)
    k = storage.names().index("h16.png")
    image = storage[k].image
    assert image.dtype == torch.uint8 and image.shape == (3, 32, 32)
    assert torch.equal(image[0], image[1]) and int(image.max()) > 100  # not all-255 or 0


@pytest.mark.parametrize("form", ["csv-names", "csv-indices", "jsonl", "csv-unlabelled"])
def test_a_manifest_lists_files_with_or_without_labels(tmp_path: Path, form: str):
    files = {f"imgs/{k}.jpg": encode(photo(40, 52, k)) for k in range(6)}
    make_tree(tmp_path / "data", files)
    labels = ["cat", "dog", "cat", "bird", "dog", "cat"]
    manifest = tmp_path / "data" / ("list.jsonl" if form == "jsonl" else "list.csv")
    order = [3, 0, 5, 1, 4, 2]  # the manifest's order, not sorted
    if form == "jsonl":
        manifest.write_text("".join(json.dumps({"path": f"imgs/{k}.jpg", "label": labels[k]})
                                    + "\n" for k in order))
    elif form == "csv-unlabelled":
        manifest.write_text("path\n" + "".join(f"imgs/{k}.jpg\n" for k in order))
    else:
        classes = sorted(set(labels))
        value = (lambda k: labels[k]) if form == "csv-names" else \
            (lambda k: classes.index(labels[k]))
        manifest.write_text("path,label\n" + "".join(f"imgs/{k}.jpg,{value(k)}\n"
                                                    for k in order))
    listing = list_images(compose(BASE).dataset, manifest)
    assert [Path(p).name for p, _ in listing.samples] == [f"{k}.jpg" for k in order]
    if form == "csv-unlabelled":
        assert not listing.classes and {y for _, y in listing.samples} == {UNLABELLED}
        return
    names = listing.classes if form != "csv-indices" else ["bird", "cat", "dog"]
    assert [names[y] for _, y in listing.samples] == [labels[k] for k in order]


@pytest.mark.slow  # eight runs: train and infer on four storages
def test_train_and_infer_on_a_manifest_on_every_storage(tmp_path: Path, cache_dir: Path):
    files = {f"imgs/{k}.jpg": encode(photo(40, 52, k)) for k in range(8)}
    make_tree(tmp_path / "data", files)
    manifest = tmp_path / "data" / "list.csv"
    manifest.write_text("path,label\n" + "".join(f"imgs/{k}.jpg,{'ab'[k % 2]}\n"
                                                for k in range(8)))
    m = run_in_process(*[b for b in BASE if b != "task=infer"], "task=train",
                       f"dataset.manifest={manifest}", "run.steps=2",
                       run_dir=tmp_path / "train")
    assert m["status"] == "ok" and m["loss_last"] is not None
    for loader in ("folder", "packed", "memmap", "ram"):
        run = tmp_path / f"infer-{loader}"
        m = run_in_process(*BASE, f"loader={loader}", f"dataset.manifest={manifest}",
                           "run.epochs=1", run_dir=run)
        assert m["status"] == "ok", (loader, m.get("error"))
        got = rows(run / "predictions.csv")
        assert [r["file"] for r in got] == [f"imgs/{k}.jpg" for k in range(8)], loader
        assert [r["label_name"] for r in got] == ["ab"[k % 2] for k in range(8)]


def test_training_refuses_unlabelled_images(flat: Path, tmp_path: Path):

    with pytest.raises(ConfigError, match="needs labelled images"):
        run_in_process(*[b for b in BASE if b != "task=infer"], "task=train",
                       f"dataset.path={flat}", "run.steps=1", run_dir=tmp_path / "run")


@pytest.fixture
def labelled(tmp_path: Path) -> Path:
    files = {f"{c}/{k}.jpg": encode(photo(40, 52, 10 * i + k))
             for i, c in enumerate(["cat", "dog", "owl"]) for k in range(5)}
    return make_tree(tmp_path / "labelled", files)


def direct(cfg_overrides: list[str], path: Path, model: torch.nn.Module) -> tuple:
    """Every image of ``path`` decoded as the run decodes it, and the model's logits and
    classifier inputs on them, computed here."""
    cfg = compose(cfg_overrides)
    storage = STORAGES[cfg.loader.name].open(cfg.loader, cfg.dataset, path, False)
    images = torch.stack([storage[i].image for i in range(len(storage))])
    seen = {}
    network = model[1]
    linear = [m for m in network.modules() if isinstance(m, torch.nn.Linear)][-1]
    handle = linear.register_forward_pre_hook(lambda mod, args: seen.update(x=args[0]))
    with torch.inference_mode():
        logits = model(images).float()
    handle.remove()
    return logits, seen["x"].flatten(1)


@pytest.mark.slow
def test_every_output_matches_the_model_run_directly(labelled: Path, tmp_path: Path):
    """Two models in one pass, each with its own weights, class count, class names and
    normalization; probs, logits, embeddings and top-k equal the models run directly."""
    torch.manual_seed(1)
    a = build_model(ModelConfig("tiny"), 12, CPU).eval()  # a 12-class checkpoint
    b = build_model(ModelConfig("tiny"), 3, CPU).eval()
    torch.save(a[1].state_dict(), tmp_path / "a.pt")
    torch.save(b[1].state_dict(), tmp_path / "b.pt")
    (tmp_path / "a.txt").write_text("".join(f"thing{k}\n" for k in range(12)))
    models = (f"+models=[{{name:tiny,weights:{tmp_path / 'a.pt'},alias:a,"
              f"classes:{tmp_path / 'a.txt'}}},{{name:tiny,weights:{tmp_path / 'b.pt'},"
              "alias:b,mean:[0.5,0.5,0.5],std:[0.25,0.25,0.25]}]")
    over = [*BASE, f"dataset.path={labelled}", "run.epochs=1", "task.topk=3",
            "task.outputs=[topk,probs,logits,embeddings]", models]
    m = run_in_process(*over, run_dir=tmp_path / "run")
    assert m["status"] == "ok"
    run = tmp_path / "run"
    names = (run / "files.txt").read_text().splitlines()
    assert names == [f"{c}/{k}.jpg" for c in ["cat", "dog", "owl"] for k in range(5)]
    b_norm = build_model(ModelConfig("tiny", weights=str(tmp_path / "b.pt"),
                                     mean=[0.5] * 3, std=[0.25] * 3), 3, CPU).eval()
    for label, model, count in (("a", a, 12), ("b", b_norm, 3)):
        logits, embeddings = direct(over, labelled, model)
        got = np.load(run / f"{label}.logits.npy", mmap_mode="r")
        assert got.shape == (15, count)
        np.testing.assert_allclose(got, logits.numpy(), atol=1e-5)
        np.testing.assert_allclose(np.load(run / f"{label}.probs.npy"),
                                   torch.softmax(logits, 1).numpy(), atol=1e-6)
        np.testing.assert_allclose(np.load(run / f"{label}.embeddings.npy"),
                                   embeddings.numpy(), atol=1e-5)
        csv_rows = rows(run / f"predictions_{label}.csv")
        assert [int(r["pred"]) for r in csv_rows] == logits.argmax(1).tolist()
        assert [r["label_name"] for r in csv_rows] == [n.split("/")[0] for n in names]
        first = csv_rows[0]
        pred_names = [f"thing{k}" for k in range(12)] if label == "a" else ["cat", "dog", "owl"]
        assert first["pred_name"] == pred_names[int(first["pred"])]
    # normalization is the model's own: b with ImageNet's would give other logits
    b_imagenet, _ = direct(over, labelled, b)
    assert not np.allclose(np.load(run / "b.logits.npy"), b_imagenet.numpy(), atol=1e-3)


def test_an_embedding_layer_and_a_postprocess_are_written(labelled: Path, tmp_path: Path):
    over = [*BASE, f"dataset.path={labelled}", "run.epochs=1",
            "task.outputs=[embeddings]", "task.embed_layer=features.2",
            "task.postprocess=tests.nets:top_logit"]
    m = run_in_process(*over, run_dir=tmp_path / "run")
    assert m["status"] == "ok"
    emb = np.load(tmp_path / "run" / "tiny.embeddings.npy")
    assert emb.shape == (15, 64)  # features.2's 64 channels, averaged over the image
    top = np.load(tmp_path / "run" / "tiny.top_logit.npy")
    logits = np.load(tmp_path / "run" / "tiny.embeddings.npy")  # written beside
    assert top.shape == (15,) and logits.shape[0] == 15
    assert not (tmp_path / "run" / "predictions.csv").exists()  # topk was not asked


@pytest.mark.slow
def test_masks_are_written_at_the_source_size(tmp_path: Path):
    sizes = [(40, 52), (60, 36), (33, 47)]
    src = make_tree(tmp_path / "scenes", {f"s{k}.jpg": encode(photo(h, w, k))
                                          for k, (h, w) in enumerate(sizes)})
    torch.manual_seed(0)
    cfg = ModelConfig("lraspp_mobilenet_v3_large", num_classes=4)
    model = build_model(cfg, 0, CPU, train=False).eval()
    torch.save(model[1].state_dict(), tmp_path / "seg.pt")
    over = [*BASE, f"dataset.path={src}", "run.epochs=1", "dataset.crop=whole",
            "dataset.image_size=[64,64]", "model.name=lraspp_mobilenet_v3_large",
            f"model.weights={tmp_path / 'seg.pt'}", "task.outputs=[masks]"]
    m = run_in_process(*over, run_dir=tmp_path / "run")
    assert m["status"] == "ok"
    cfgc = compose(over)
    storage = STORAGES[cfgc.loader.name].open(cfgc.loader, cfgc.dataset, src, False)
    images = torch.stack([storage[i].image for i in range(len(storage))])
    with torch.inference_mode():
        classes = model(images)["out"].argmax(1).to(torch.uint8).numpy()
    for k, (h, w) in enumerate(sizes):
        mask = Image.open(tmp_path / "run" / "masks" / "lraspp_mobilenet_v3_large" /
                          f"s{k}.jpg.png")  # the source name, .png added
        assert mask.size == (w, h) and mask.mode == "L"
        expected = Image.fromarray(classes[k]).resize((w, h), Image.NEAREST)
        assert np.array_equal(np.asarray(mask), np.asarray(expected))


def test_masks_of_a_classifier_are_refused_in_one_line(labelled: Path, tmp_path: Path):

    with pytest.raises(ConfigError, match="masks need a segmentation model"):
        run_in_process(*BASE, f"dataset.path={labelled}", "run.epochs=1",
                       "task.outputs=[masks]", run_dir=tmp_path / "run")


@pytest.mark.slow
@pytest.mark.parametrize("older", [False, True], ids=["partial", "older-runner-names"])
def test_a_stopped_inference_run_resumes_to_the_same_bytes(labelled: Path, tmp_path: Path,
                                                          monkeypatch, older: bool):
    """A stopped run's arrays and files.txt carry .partial (no reader takes them for whole
    ones); a resume finishes them to the bytes of an uninterrupted run, also from a run
    an older runner wrote under the final names."""

    over = [*BASE, f"dataset.path={labelled}", "run.epochs=1",
            "task.outputs=[topk,probs,embeddings]"]
    whole = run_in_process(*over, run_dir=tmp_path / "whole")
    assert whole["status"] == "ok"
    stopped_after(2, over, tmp_path / "parts")
    state = json.loads((tmp_path / "parts" / "infer-state.json").read_text())
    assert state["steps"] == 2 and not (tmp_path / "parts" / "predictions.csv").exists()
    finals = ("tiny.probs.npy", "tiny.embeddings.npy", "files.txt")
    parts = tmp_path / "parts"
    assert not any((parts / name).exists() for name in finals)
    assert all((parts / f"{name}.partial").is_file() for name in finals)
    assert {Path(f).name for f in read_metrics(parts)["outputs"]["tiny"]} >= \
        {"tiny.probs.npy.partial", "tiny.embeddings.npy.partial"}
    if older:  # an older runner kept the final names while the run went on
        for name in finals:
            (parts / f"{name}.partial").rename(parts / name)
    m = run_in_process(*over, "resume=auto", run_dir=tmp_path / "parts")
    assert m["status"] == "ok" and m["start_step"] == 2
    for name in ("predictions.csv", "tiny.probs.npy", "tiny.embeddings.npy", "files.txt"):
        assert (tmp_path / "parts" / name).read_bytes() == \
            (tmp_path / "whole" / name).read_bytes(), name
    assert read_metrics(tmp_path / "parts")["status"] == "ok"
    assert not list(parts.glob("*.partial"))


KILLED_RUN = """
import sys, time
import runner.tasks.infer.outputs, runner.tasks
runner.tasks.infer.outputs.STATE_SECONDS = 0.0
call = runner.tasks.InferStep.__call__
def slow(self, batch):
    time.sleep(0.05)
    call(self, batch)
runner.tasks.InferStep.__call__ = slow
sys.argv = ["runner", *sys.argv[1:]]
import runpy
runpy.run_module("runner", run_name="__main__")
"""


@pytest.mark.process
def test_inference_killed_with_sigkill_resumes_from_its_saved_state(tmp_path: Path):
    """SIGKILL leaves no time to save: the state saved every few seconds of work (every
    step here) lets resume=auto go on from there, to the bytes of an uninterrupted run."""
    import os
    import signal

    files = {f"{c}/{k:02d}.jpg": encode(photo(40, 52, 10 * i + k))
             for i, c in enumerate(["cat", "dog"]) for k in range(20)}
    data = make_tree(tmp_path / "data", files)
    over = [*BASE, f"dataset.path={data}", "loader.batch_size=2", "run.epochs=1",
            "task.outputs=[topk,probs,embeddings]", "run.progress=false"]
    killed = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RUN, *over, f"hydra.run.dir={killed}"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    state, steps = killed / "infer-state.json", 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if state.is_file():
            steps = json.loads(state.read_text())["steps"]
            if steps >= 4:
                break
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert 4 <= steps < 20, steps  # killed mid-run with progress saved
    m = run_in_process(*over, "resume=auto", run_dir=killed)
    assert m["status"] == "ok" and m["start_step"] >= 4
    assert run_in_process(*over, run_dir=tmp_path / "whole")["status"] == "ok"
    for name in ("predictions.csv", "tiny.probs.npy", "tiny.embeddings.npy", "files.txt"):
        assert (killed / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name


@pytest.fixture
def twelve(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "data", {f"{c}/{k}.jpg": encode(photo(40, 52, 10 * i + k))
                                         for i, c in enumerate(["a", "b"]) for k in range(6)})

@pytest.mark.slow
def test_an_inference_resume_logs_one_story(twelve: Path, tmp_path: Path, caplog):
    """It never says "no checkpoint, starting fresh" and then "resuming"."""
    import logging

    over = ["task=infer", "model=tiny", "logger=none", "diagnose=false", "run.timeline=false",
            f"dataset.path={twelve}", "dataset.image_size=[32,32]", "loader.batch_size=2",
            "run.warmup_steps=0", "task.outputs=[probs]"]
    with caplog.at_level(logging.INFO, logger="runner"):
        stopped_after(2, over, tmp_path / "run")
    assert "no inference state" in caplog.text and "resuming" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="runner"):
        assert run_in_process(*over, "resume=auto", run_dir=tmp_path / "run")["status"] == "ok"
    assert "resuming: 2 of the plan's 6 steps done" in caplog.text
    assert "starting fresh" not in caplog.text and "no checkpoint" not in caplog.text


def test_an_inference_resume_refused_says_what_an_inference_keeps(tmp_path: Path):
    data = make_tree(tmp_path / "data", {f"{c}/{k}.jpg": encode(photo(40, 52, 10 * i + k))
                                         for i, c in enumerate(["cat", "dog", "owl"])
                                         for k in range(5)})
    over = ["task=infer", "logger=none", "diagnose=false", "run.timeline=false",
            "dataset.image_size=[32,32]", "loader.batch_size=4", "run.warmup_steps=0",
            "run.progress=false", "run.epochs=1", f"dataset.path={data}"]
    stopped_after(2, over, tmp_path / "run")
    with pytest.raises(UserError) as refused:
        run_in_process(*over, "loader.batch_size=2", "resume=auto", run_dir=tmp_path / "run")
    message = str(refused.value)
    assert "\n" not in message and "learning rate" not in message and "schedule" not in message
    assert message.startswith("resume=auto: ") and "state of an inference" in message
    assert "loader.batch_size: checkpoint 4, this run 2" in message


QUIET_INFER = ["task=infer", "logger=none", "diagnose=false", "run.timeline=false",
        "dataset.image_size=[32,32]", "loader.batch_size=4", "run.warmup_steps=0",
        "run.progress=false", "run.epochs=1"]

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
    over = [*QUIET_INFER, f"dataset.path={data}", f"model.weights={a}",
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

@pytest.mark.slow
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
    over = [*QUIET_INFER, f"dataset.path={data}", f"model.weights={weights}"]
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

@pytest.mark.slow
def test_a_finished_run_asked_for_more_says_so_and_refuses(tmp_path: Path):
    """A finished run resumed with another output used to report ok and write nothing."""
    data = make_tree(tmp_path / "data", {f"{k}.jpg": encode(photo(40, 52, k))
                                         for k in range(6)})
    over = [*QUIET_INFER, f"dataset.path={data}", "task.outputs=[topk]"]
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
    over = [*QUIET_INFER, f"dataset.path={data}", f"model.weights={weights}"]
    assert run_in_process(*over, "resume=auto", run_dir=tmp_path / "run")["status"] == "ok"
    before = os.stat(weights)
    save_tiny(weights, 2)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    message = resume_refused(tmp_path / "run", over)
    assert "finished" in message and "model.weights" in message, message

@pytest.mark.slow
def test_inference_ignores_drop_last_and_says_so_once(tmp_path: Path, caplog):
    data = make_tree(tmp_path / "data", {f"{k:02d}.jpg": encode(photo(40, 52, k))
                                         for k in range(15)})  # 3 batches of 4, then 3
    with caplog.at_level(logging.WARNING):
        m = run_in_process(*QUIET_INFER, f"dataset.path={data}", "loader.drop_last=true",
                           "task.outputs=[topk,probs]", run_dir=tmp_path / "run")
    assert m["status"] == "ok" and m["config"]["loader"]["drop_last"] is False
    got = rows(tmp_path / "run" / "predictions.csv")
    assert [r["file"] for r in got] == [f"{k:02d}.jpg" for k in range(15)]
    probs = np.load(tmp_path / "run" / "tiny.probs.npy")
    assert probs.shape == (15, 1000) and (probs.sum(axis=1) > 0.99).all()  # no zero row
    assert caplog.text.count("loader.drop_last") == 1, caplog.text
    assert compose(["task=train", "loader.drop_last=true"]).loader.drop_last is True


GOOD = [f"{k:02d}.jpg" for k in range(10) if k not in (1, 9)]

@pytest.mark.slow
def test_a_resumed_run_with_undecodable_images_writes_the_same_bytes(with_broken: Path,
                                                                    tmp_path: Path):
    over = [*QUIET_INFER, f"dataset.path={with_broken}", "task.outputs=[topk,probs,embeddings]"]
    assert run_in_process(*over, run_dir=tmp_path / "whole")["status"] == "ok"
    stopped_after(1, over, tmp_path / "parts")
    m = run_in_process(*over, "resume=auto", run_dir=tmp_path / "parts")
    assert m["status"] == "ok" and m["start_step"] == 1
    for name in ("predictions.csv", "tiny.probs.npy", "tiny.embeddings.npy", "files.txt"):
        assert (tmp_path / "parts" / name).read_bytes() == \
            (tmp_path / "whole" / name).read_bytes(), name
    assert np.load(tmp_path / "parts" / "tiny.probs.npy").shape[0] == len(GOOD)


QUICK = ["dataset.image_size=[16,16]", "loader.batch_size=4", "run.warmup_steps=1",
         "run.progress=false", "logger=none", "model=tiny", "loader.num_workers=0"]


@pytest.mark.slow
def test_an_inference_names_its_classes_from_a_list(image_tree: Path, tmp_path: Path):
    """model.classes=[...] in a task=infer run: the outputs' identity records the list (it
    took the list for a file's path and failed with a TypeError)."""
    run_dir = tmp_path / "infer"
    run_in_process("task=infer", f"dataset.path={image_tree}", "model.classes=[x,y,z]",
                   "run.steps=2", "diagnose=false", *QUICK, run_dir=run_dir)
    assert {r["pred_name"] for r in predictions(run_dir)} <= {"x", "y", "z"}


COMMON = ["logger=none", "diagnose=false", "run.timeline=false", "dataset.image_size=[32,32]",
          "loader.batch_size=16", "loader.shuffle=false", "run.warmup_steps=0",
          "run.progress=false"]

INFER = ["task=infer", *COMMON, "run.epochs=1"]

BROKEN = b"\xff\xd8\xff not really a JPEG"

def folder(root: Path, bad: range) -> Path:
    """48 images in sorted order (three classes of 16), those of ``bad`` undecodable."""
    files = {}
    for k in range(48):
        files[f"{'abc'[k // 16]}/{k:02d}.jpg"] = BROKEN if k in bad else \
            encode(photo(40, 52, k))
    return make_tree(root, files)

def check_finished(run_dir: Path, m: dict, over: list[str], bad: int = 16) -> None:
    assert m["status"] == "ok", m.get("error")
    assert m["steps"] == 3 and m["predictions"] == 32
    assert len(m["skipped_files"]) == bad
    assert len(rows(run_dir / "predictions.csv")) == 32
    assert not list(run_dir.glob("*.partial")) and not list(run_dir.glob(".*.parts"))
    state = json.loads((run_dir / "infer-state.json").read_text())
    assert state["complete"] is True and state["steps"] == 3
    for path in m["outputs"]["tiny"]:
        assert Path(path).exists(), path
    again = run_in_process(*over, "resume=auto", run_dir=run_dir)
    assert again["status"] == "ok" and again["predictions"] == 32  # finished, and it is

@pytest.mark.slow
@pytest.mark.parametrize("where, bad", [("middle", range(16, 32)), ("last", range(32, 48))])
def test_inference_with_a_whole_batch_undecodable_finishes_its_outputs(tmp_path: Path,
                                                                       where: str, bad: range):
    data = folder(tmp_path / "data", bad)
    over = [*INFER, f"dataset.path={data}"]
    m = run_in_process(*over, run_dir=tmp_path / "run")
    check_finished(tmp_path / "run", m, over)
    assert {Path(p).name for p in m["skipped_files"]} == {f"{k:02d}.jpg" for k in bad}

@pytest.mark.slow
def test_inference_over_a_truncated_shard_finishes_its_outputs(tmp_path: Path, cache_dir):
    from runner.data.storage.tarformat import ShardWriter, write_manifest

    shards = tmp_path / "shards"
    entries = []
    for part in range(3):  # a shard of 16 samples each
        writer = ShardWriter(shards, pattern=f"part{part}-{{:06d}}.tar")
        for k in range(16):
            data = encode(photo(40, 52, 16 * part + k))
            writer.add(f"{16 * part + k:08d}", data, part, 40, 52, f"{16 * part + k:02d}.jpg",
                       16 * part + k)
        entries += writer.close()
    write_manifest(shards, entries, ["a", "b", "c"])
    middle = shards / entries[1]["name"]
    with open(middle, "r+b") as f:  # cut off after its first member's header
        f.truncate(1024)
    over = [*INFER, f"dataset.path={shards}", "loader=shards"]
    m = run_in_process(*over, run_dir=tmp_path / "run")
    check_finished(tmp_path / "run", m, over)
    assert all(entries[1]["name"] in s for s in m["skipped_files"])


def test_infer_drops_padding_rows_on_the_host_and_counts_after_warm_up(tmp_path: Path):
    model = build_model(ModelConfig("tiny"), 3, CPU).eval()
    shapes = {"topk_probs": ((2,), np.dtype("float32")),
              "topk_classes": ((2,), np.dtype("int64"))}
    writer = ModelWriter(tmp_path, "tiny", 9, shapes, lambda i: f"f{i}", str, ["a", "b", "c"],
                         ["a", "b", "c"], "predictions.csv", create=True)
    task = TaskConfig(TaskName.infer, topk=2)
    step = InferStep({"tiny": model}, task, {"tiny": Reduce(task, None)},
                     Outputs({"tiny": writer}))

    def batch(start: int, valid: list[bool] | None = None) -> TensorDict:
        fields = {"image": torch.randint(0, 256, (3, 3, 32, 32), dtype=torch.uint8),
                  "label": torch.zeros(3, dtype=torch.int64),
                  "index": torch.arange(start, start + 3)}
        if valid is not None:
            fields["valid"] = torch.tensor(valid)
        return TensorDict(fields, batch_size=[3])

    step(batch(0))  # warm-up
    step.start_timing()
    step(batch(3))
    step(batch(6, [True, True, False]))  # the last row pads a distributed shard
    figures = step.close()
    assert figures["models"]["tiny"]["images_per_sec"] is not None
    with open(tmp_path / "predictions.csv", newline="") as f:
        assert [int(r["index"]) for r in csv.DictReader(f)] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert step.images == 5  # 3 + 2 after warm-up, the padding row not counted


@pytest.mark.slow
def test_a_checkpoint_is_served_at_the_inputs_it_was_trained_on(tmp_path: Path, cache_dir,
                                                                 caplog):
    """Trained at 32 px on a generated set of 24 images: task=infer with it as model.weights
    served at the default 224 px on a new 2,000-image set without a word. Now the
    checkpoint's inputs (size, crop, mean/std, the generated set's parameters) are served,
    said once; a key the command line gives is kept, and said once."""
    train = ["model=tiny", "dataset.num_images=24", "dataset.num_classes=3",
             "dataset.source_size=[40,48]", "dataset.image_size=[32,32]", "dataset.crop=whole",
             "model.mean=[0.5,0.5,0.5]", "model.std=[0.25,0.25,0.25]", "loader.batch_size=8",
             "loader.num_workers=0", "logger=none", "diagnose=false", "run.steps=2",
             "run.progress=false", "run.warmup_steps=0"]
    run_in_process(*train, run_dir=tmp_path / "train")
    weights = tmp_path / "train" / "checkpoint.pt"
    serve = ["task=infer", "model=tiny", f"model.weights={weights}", "loader.num_workers=0",
             "logger=none", "diagnose=false", "run.progress=false", "run.warmup_steps=0"]
    with caplog.at_level(logging.INFO):
        m = run_in_process(*serve, run_dir=tmp_path / "serve")
    dataset, model = m["config"]["dataset"], m["config"]["model"]
    assert dataset["image_size"] == [32, 32] and dataset["crop"] == "whole"
    assert dataset["num_images"] == 24 and dataset["source_size"] == [40, 48]
    assert model["mean"] == [0.5, 0.5, 0.5] and model["std"] == [0.25, 0.25, 0.25]
    assert m["images"] == 24
    said = [r.getMessage() for r in caplog.records if "served as it was trained" in
            r.getMessage()]
    assert len(said) == 1 and "dataset.image_size=[32, 32]" in said[0]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        m = run_in_process(*serve, "dataset.image_size=[48,48]", run_dir=tmp_path / "other")
    assert m["config"]["dataset"]["image_size"] == [48, 48]
    assert m["config"]["dataset"]["num_images"] == 24
    (kept,) = [r.getMessage() for r in caplog.records if "trained otherwise" in r.getMessage()]
    assert "dataset.image_size=[48, 48] (trained: [32, 32])" in kept
