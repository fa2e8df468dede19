"""End to end: ``python -m runner`` runs, writes metrics.json, logs to wandb offline."""

from __future__ import annotations

import csv
import glob
import json
from pathlib import Path

import pytest
import torch

from runner.job.logger import summary_of
from tests.conftest import (
    SMALL_DATASET,
    encode,
    make_tree,
    photo,
    read_metrics,
    run_cli,
    wandb_records,
)

pytestmark = pytest.mark.process  # every test here starts a process

REQUIRED = {"status", "reason", "images_per_sec", "ms_per_step", "data_wait_frac", "steps",
            "images", "skipped_files", "config"}


@pytest.mark.slow
def test_train_run_writes_metrics_and_learns(tmp_path: Path, cache_dir: Path):
    run_cli(*SMALL_DATASET, "logger=none", "run.epochs=4", "hydra.run.dir=run",
            cwd=tmp_path)
    m = read_metrics(tmp_path / "run")
    assert REQUIRED <= set(m)
    assert m["status"] == "ok" and m["reason"] is None
    assert m["steps"] == 4 * 8 and m["images"] == 4 * 60  # 60 images, batch 8: 8 steps/epoch
    assert m["timed_steps"] == m["steps"] - 1  # one warm-up step excluded
    assert m["images_per_sec"] > 0 and m["ms_per_step"] > 0 and 0 <= m["data_wait_frac"] <= 1
    assert m["skipped_files"] == []
    assert m["config"]["loader"]["batch_size"] == 8 and m["config"]["task"]["name"] == "train"
    assert m["loss_last"] < m["loss_first"]  # the default dataset is learnable
    assert (tmp_path / "run" / ".hydra" / "config.yaml").exists()
    assert (cache_dir / "datasets").is_dir()  # the default dataset went to the cache


@pytest.mark.slow
def test_infer_run_writes_every_prediction(tmp_path: Path, image_tree: Path):
    run_cli("task=infer", f"dataset.path={image_tree}", "dataset.image_size=[32,32]",
            "loader.batch_size=4", "loader.num_workers=2", "logger=none", "run.progress=false",
            "run.warmup_steps=1", "task.topk=2", "hydra.run.dir=run", cwd=tmp_path)
    m = read_metrics(tmp_path / "run")
    assert m["status"] == "ok" and m["predictions"] == 18 == m["images"]
    with open(tmp_path / "run" / "predictions.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(int(r["index"]) for r in rows) == list(range(18))
    first = rows[0]
    assert first["file"].endswith((".jpg", ".JPEG", ".PNG")) and first["label"] in "012"
    probs = [float(p) for p in first["topk_probs"].split()]
    assert len(probs) == 2 and probs[0] >= probs[1] and float(first["prob"]) == probs[0]
    assert not (tmp_path / "run" / ".predictions.parts").exists()


@pytest.mark.slow
def test_data_only_run_and_corrupt_files_are_reported(tmp_path: Path):
    good = encode(photo(48, 64))
    tree = make_tree(tmp_path / "data", {
        "a/1.jpg": good, "a/2.jpg": good, "a/broken.jpg": good[:100], "b/3.jpg": good,
        "b/4.jpg": good, "b/empty.jpeg": b"",
    })
    proc = run_cli("model=none", f"dataset.path={tree}", "dataset.image_size=[32,32]",
                   "loader.batch_size=2", "loader.decoder=simplejpeg", "logger=none",
                   "run.progress=false", "run.warmup_steps=0", "run.window_seconds=0",
                   "hydra.run.dir=run", cwd=tmp_path)
    m = read_metrics(tmp_path / "run")
    assert m["status"] == "ok" and m["images"] == 4
    assert [Path(p).name for p in m["skipped_files"]] == ["broken.jpg", "empty.jpeg"]
    assert m["skipped_count"] == 2
    assert "skipped undecodable file" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_missing_dataset_is_refused_with_the_path_and_no_run_folder(tmp_path: Path):
    proc = run_cli(f"dataset.path={tmp_path}/nope", "logger=none", "hydra.run.dir=run",
                   cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: dataset.path='{tmp_path}/nope' does not exist")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
@pytest.mark.parametrize(("override", "why"), [("device=cuda", "no CUDA device"),
                                               ("loader.decoder=nvjpeg", "needs CUDA")])
def test_cuda_only_runs_are_skipped_with_a_reason(tmp_path: Path, image_tree: Path,
                                                  override: str, why: str):
    proc = run_cli(override, f"dataset.path={image_tree}", "logger=none", "hydra.run.dir=run",
                   cwd=tmp_path)
    assert proc.returncode == 0
    m = read_metrics(tmp_path / "run")
    assert m["status"] == "skipped" and why in m["reason"]


@pytest.mark.slow
def test_wandb_offline_run_holds_the_config_and_no_secret(tmp_path: Path, image_tree: Path):
    secret = "wandb-key-0123456789abcdef0123456789abcdef"
    run_cli(f"dataset.path={image_tree}", "dataset.image_size=[32,32]", "loader.batch_size=6",
            "run.warmup_steps=1", "run.log_every=1", "run.progress=false", "hydra.run.dir=run",
            cwd=tmp_path, env={"WANDB_API_KEY": secret})
    offline = glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(offline) == 1
    records = wandb_records(offline[0])
    config = {u.key: u.value_json for r in records if r.WhichOneof("record_type") == "run"
              for u in r.run.config.update}
    assert config["loader.batch_size"] == "6" and config["model.name"] == '"tiny"'
    logged = [r for r in records if r.WhichOneof("record_type") == "history"]
    keys = {i.key or ".".join(i.nested_key) for r in logged for i in r.history.item}
    assert {"window/images_per_sec", "window/ms_per_step", "window/loss"} <= keys

    # the summary the dashboard shows: every summary update, replayed in order
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update({i.key or ".".join(i.nested_key): json.loads(i.value_json)
                            for i in r.summary.update})
    shown = {k: v for k, v in summary.items() if not k.startswith("_")}
    metrics = json.loads(json.dumps(summary_of(read_metrics(tmp_path / "run"))))
    assert shown == metrics  # same keys, same values: one set of figures everywhere
    assert shown["images_per_sec"] == read_metrics(tmp_path / "run")["images_per_sec"]
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), f"secret written to {path}"


@pytest.mark.slow
def test_memmap_converts_once_then_reuses(tmp_path: Path, cache_dir: Path):
    # a store larger than the output serves centre crops (a window of it) and random ones
    # (of the whole stored side) alike: one conversion for a training and a validation run
    larger = ("loader=memmap", "logger=none", "dataset.store_size=56")
    first = run_cli(*SMALL_DATASET, *larger, "hydra.run.dir=a", cwd=tmp_path)
    assert "memmap store ready" in first.stdout + first.stderr
    second = run_cli(*SMALL_DATASET, *larger, "dataset.crop=random", "hydra.run.dir=b",
                     cwd=tmp_path)
    assert "memmap store ready" not in second.stdout + second.stderr  # reused
    for run in ("a", "b"):
        m = read_metrics(tmp_path / run)
        assert m["status"] == "ok" and m["images"] == 60 and m["config"]["loader"]["name"] == "memmap"
    assert len(list((cache_dir / "memmap").glob("*/meta.json"))) == 1


@pytest.mark.slow
def test_ram_run_and_its_defaults(tmp_path: Path, cache_dir: Path):
    run_cli(*SMALL_DATASET, "loader=ram", "model=none", "logger=none", "run.window_seconds=0",
            "hydra.run.dir=run", cwd=tmp_path)
    m = read_metrics(tmp_path / "run")
    assert m["status"] == "ok" and m["images"] == 60
    assert m["config"]["loader"]["batched"] is True and m["config"]["loader"]["num_workers"] == 0


@pytest.mark.slow
def test_nvjpeg_with_a_decode_once_loader_is_a_config_error(tmp_path: Path):
    proc = run_cli("loader=memmap", "loader.decoder=nvjpeg", "hydra.run.dir=run", cwd=tmp_path,
                   check=False)
    assert proc.returncode == 2 and "loader.decoder=nvjpeg is invalid for loader=memmap" in proc.stdout + proc.stderr


@pytest.mark.process
@pytest.mark.slow
def test_a_detector_trains_and_validates_from_a_memmap_store_with_device_crops(tmp_path: Path):
    """loader=memmap with dataset.targets: the train split decoded once into a store with
    its boxes beside it (at a store_size larger than the output: the device cuts each
    batch's random crops and flips, the boxes moved with them), validated after the epoch
    (validation reads the folder)."""
    common = ["dataset.targets=auto", "model.name=fasterrcnn_mobilenet_v3_large_320_fpn",
              "dataset.image_size=[40,40]", "dataset.store_size=48", "dataset.num_images=10",
              "loader=memmap", "dataset.crop=random", "loader.batch_size=4", "logger=none",
              "diagnose=false", f"dataset.cache_dir={tmp_path / 'cache'}"]
    run_cli(*common, "run.epochs=1", "hydra.run.dir=train", cwd=tmp_path,
            env={"OMP_NUM_THREADS": "1"})
    m = read_metrics(tmp_path / "train")
    assert m["status"] == "ok" and m["epochs"][0]["val_map_50"] is not None
    stores = sorted(p.parent.name for p in (tmp_path / "cache" / "memmap").glob("*/meta.json"))
    assert len(stores) == 1 and "-48x48-" in stores[0] and "-yolo-" in stores[0]


@pytest.mark.process
@pytest.mark.slow
def test_a_detector_trains_validates_and_serves_on_the_generated_shapes(tmp_path: Path):
    """dataset.targets=auto with no dataset.path: the shapes dataset is made, a detector
    trains on its train split and is validated on its val split (val_map in metrics.json,
    checkpoint-best.pt by it), then task=infer writes COCO results pycocotools loads."""
    pytest.importorskip("pycocotools")
    from pycocotools.coco import COCO

    common = ["dataset.targets=auto", "model.name=fasterrcnn_mobilenet_v3_large_320_fpn",
              "dataset.image_size=[48,48]", "dataset.num_images=20", "loader.batch_size=4",
              "logger=none", "diagnose=false", f"dataset.cache_dir={tmp_path / 'cache'}"]
    env = {"OMP_NUM_THREADS": "1"}
    run_cli(*common, "run.epochs=1", "hydra.run.dir=train", cwd=tmp_path, env=env)
    m = read_metrics(tmp_path / "train")
    assert m["status"] == "ok" and m["epochs"][0]["val_map_50"] is not None
    assert (tmp_path / "train" / "checkpoint-best.pt").is_file()
    run_cli(*common, "task=infer", "task.outputs=[detections]", "hydra.run.dir=infer",
            f"model.weights={tmp_path / 'train' / 'checkpoint-best.pt'}", cwd=tmp_path, env=env)
    out = tmp_path / "infer"
    rows = (out / "detections.csv").read_text().splitlines()
    assert rows[0].startswith("index,file,count") and len(rows) == 1 + 16  # the train split
    truth = COCO()
    truth.dataset = {"images": [{"id": k} for k in range(16)], "annotations": [],
                     "categories": json.loads((out / "detections.categories.json").read_text())}
    truth.createIndex()
    truth.loadRes(str(out / "detections.json"))  # a results file COCO's tools take
