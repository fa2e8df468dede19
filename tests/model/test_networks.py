"""Your model, your weights, your training script: any torchvision or timm classifier, your
own nn.Module, local weights, checkpoints and resume, readable predictions, runner.pipeline."""

from __future__ import annotations

import csv
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runner.common.errors import ConfigError, Unavailable
from runner.config.schema import ModelConfig, ModelSource
from runner.job.compose import compose
from runner.model.networks import build_model
from tests.conftest import (
    REPO,
    SMALL_DATASET,
    encode,
    make_tree,
    photo,
    read_metrics,
    run_cli,
    run_in_process,
)

CPU = torch.device("cpu")
UINT8 = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mobilenet_v3_small", "efficientnet_b0", "squeezenet1_1",
                                  "regnet_y_400mf"])
def test_any_torchvision_classifier_with_the_datasets_classes(name: str):
    model = build_model(compose([f"model.name={name}"]).model, 7, CPU).eval()
    with torch.inference_mode():
        assert model(UINT8).shape == (2, 7)  # uint8 in, the head sized to the classes


def test_an_unknown_model_name_is_a_config_error_with_suggestions():
    with pytest.raises(ConfigError, match=r"model.name=resnet5 .*did you mean resnet50"):
        compose(["model.name=resnet5"])


@pytest.mark.slow
def test_timm_models_build_or_skip_naming_the_install(monkeypatch):
    cfg = compose(["model=timm", "model.name=resnet18"]).model
    assert cfg.source is ModelSource.timm
    try:
        import timm  # noqa: F401
    except ImportError:
        with pytest.raises(Unavailable, match=r"pip install -e '\.\[timm\]'"):
            build_model(cfg, 4, CPU)
        return
    model = build_model(cfg, 4, CPU).eval()
    with torch.inference_mode():
        assert model(UINT8).shape == (2, 4)
    monkeypatch.setitem(sys.modules, "timm", None)  # as if not installed
    with pytest.raises(Unavailable, match=r"pip install -e '\.\[timm\]'"):
        build_model(cfg, 4, CPU)


@pytest.mark.slow
def test_your_own_module_by_import_path_with_keyword_arguments():
    cfg = compose(["model=custom", "model.target=tests.nets:TwoLayer", "+model.kwargs.width=12"]
                  ).model
    model = build_model(cfg, 3, CPU)
    assert model[1].width == 12 and model(UINT8).shape == (2, 3)
    with pytest.raises(ConfigError, match="package.module:Class"):
        compose(["model=custom"])
    with pytest.raises(ConfigError, match="cannot be imported"):
        build_model(compose(["model=custom", "model.target=tests.nets:Nope"]).model, 3, CPU)
    with pytest.raises(ConfigError, match="not a torch.nn.Module"):
        build_model(compose(["model=custom", "model.target=tests.nets:not_a_module"]).model,
                    3, CPU)


def test_local_weights_load_and_a_mismatch_names_the_keys(tmp_path: Path):
    source = build_model(ModelConfig("tiny"), 3, CPU)
    torch.save(source[1].state_dict(), tmp_path / "w.pt")
    loaded = build_model(ModelConfig("tiny", weights=str(tmp_path / "w.pt")), 3, CPU)
    for a, b in zip(source.parameters(), loaded.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ConfigError, match=r"head\.weight has shape \(3, 128\).*\(5, 128\)"):
        build_model(ModelConfig("tiny", weights=str(tmp_path / "w.pt"), num_classes=5), 5, CPU)
    # training on 5 classes from 3-class weights: a new head only when asked, and said
    with pytest.raises(ConfigError, match="has 3 classes, the dataset 5.*replace_head=true"):
        build_model(ModelConfig("tiny", weights=str(tmp_path / "w.pt")), 5, CPU)
    tuned = build_model(ModelConfig("tiny", weights=str(tmp_path / "w.pt"), replace_head=True),
                        5, CPU)
    assert tuned[1].head.out_features == 5
    assert torch.equal(tuned[1].features[0][0].weight, source[1].features[0][0].weight)
    with pytest.raises(ConfigError, match=r"missing keys: .*unexpected keys: features"):
        build_model(ModelConfig("resnet18", weights=str(tmp_path / "w.pt")), 3, CPU)
    with pytest.raises(ConfigError, match="no such file"):
        build_model(ModelConfig("tiny", weights=str(tmp_path / "none.pt")), 3, CPU)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "resnet18", "mobilenet_v3_small"])
def test_inference_sizes_the_head_from_the_weights(tmp_path: Path, name: str):
    """A 1000-class (here 12-class) checkpoint runs on a 3-class or unlabelled folder."""
    source = build_model(ModelConfig(name), 12, CPU).eval()
    torch.save(source[1].state_dict(), tmp_path / "w.pt")
    for dataset_classes in (3, 0):
        model = build_model(ModelConfig(name, weights=str(tmp_path / "w.pt")),
                            dataset_classes, CPU, train=False).eval()
        assert model.num_classes == 12
        x = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8)
        with torch.no_grad():
            assert torch.equal(model(x), source(x))


def test_each_model_normalizes_and_resizes_on_its_own(tmp_path: Path):
    """model.mean/std in 0..1 pixel units; model.image_size resizes on the device."""
    from runner.model.networks import UInt8Input

    x = torch.randint(0, 256, (2, 3, 40, 40), dtype=torch.uint8)
    layer = UInt8Input(mean=[0.5, 0.5, 0.5], std=[0.25, 0.5, 1.0])
    expected = (x.float() / 255 - 0.5) / torch.tensor([0.25, 0.5, 1.0]).view(1, 3, 1, 1)
    assert torch.allclose(layer(x), expected, atol=1e-5)
    resized = UInt8Input(size=(24, 32))(x)
    assert resized.shape == (2, 3, 24, 32)
    direct = torch.nn.functional.interpolate(UInt8Input()(x), size=(24, 32), mode="bilinear",
                                             antialias=True, align_corners=False)
    assert torch.allclose(resized, direct)


def test_a_model_larger_than_the_decode_raises_the_decode_size():
    cfg = compose(["task=infer", "dataset.image_size=[64,64]",
                   "+models=[tiny,{name:tiny,alias:big,image_size:[96,80]}]"])
    assert list(cfg.dataset.image_size) == [96, 80]


@pytest.mark.slow
def test_infer_reads_in_dataset_order_unless_asked():
    assert compose(["task=infer"]).loader.shuffle is False
    assert compose(["task=train"]).loader.shuffle is True
    assert compose(["task=infer", "loader.shuffle=true"]).loader.shuffle is True
    with pytest.raises(ConfigError, match="resume=.*needs task=train"):
        compose(["task=infer", "resume=x.pt"])


@pytest.mark.process
@pytest.mark.slow
def test_train_checkpoint_resume_continues_the_loss_then_infer_with_its_weights(
        tmp_path: Path, cache_dir: Path):
    common = [*SMALL_DATASET, "logger=none", "diagnose=false"]
    run_cli(*common, "run.epochs=6", "task.checkpoint_every=2", "hydra.run.dir=first",
            cwd=tmp_path)
    first = read_metrics(tmp_path / "first")
    saved = torch.load(tmp_path / "first" / "checkpoint.pt", weights_only=True)
    assert saved["epoch"] == 6 and {"model", "optimizer", "scaler", "config"} <= set(saved)
    # run.epochs is the whole run's: 8 after a checkpoint at 6 trains 2 more on purpose
    run_cli(*common, "run.epochs=8", f"resume={tmp_path}/first", "hydra.run.dir=resumed",
            cwd=tmp_path)
    resumed = read_metrics(tmp_path / "resumed")
    fresh_start = first["loss_first"]
    # the resumed run starts where the first stopped, far below a fresh start
    assert resumed["loss_first"] < 0.6 * fresh_start
    assert resumed["loss_first"] <= 1.5 * first["loss_last"]  # no jump back up
    assert torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=True)["epoch"] == 8

    run_cli(*common, "task=infer", f"model.weights={tmp_path}/resumed/checkpoint.pt",
            "hydra.run.dir=infer", cwd=tmp_path)
    with open(tmp_path / "infer" / "predictions.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["index"]) for r in rows] == list(range(60))  # dataset order
    assert all(r["label_name"] and r["pred_name"] and len(r["topk_names"].split()) == 3
               for r in rows)
    correct = sum(r["label"] == r["pred"] for r in rows) / len(rows)
    assert correct > 0.5  # trained weights, not random ones


@pytest.mark.process
@pytest.mark.slow
def test_a_validation_folder_reports_top1_each_epoch(tmp_path: Path, cache_dir: Path):
    val = make_tree(tmp_path / "val", {f"{c}/{k}.jpg": encode(photo(48, 48, index=k))
                                       for c in ("class_000", "class_001", "class_002")
                                       for k in range(3)})
    run_cli(*SMALL_DATASET, "logger=none", "diagnose=false", "run.epochs=2",
            f"dataset.val_path={val}", "hydra.run.dir=run", cwd=tmp_path)
    m = read_metrics(tmp_path / "run")
    assert [e["epoch"] for e in m["epochs"]] == [1, 2]
    assert all(0.0 <= e["val_top1"] <= 1.0 for e in m["epochs"])
    assert m["val_top1"] == m["epochs"][-1]["val_top1"]


def test_the_pipeline_gives_device_batches_of_every_image_each_epoch(image_tree: Path):
    import runner

    with runner.pipeline(loader="folder", dataset_path=str(image_tree),
                         dataset_image_size=[32, 32], loader_batch_size=4,
                         run_warmup_steps=1) as pipeline:
        assert pipeline.classes == ["Dog", "bird", "cat"]
        for _ in range(2):
            seen = []
            for batch in pipeline:
                assert batch["image"].dtype == torch.uint8 and batch.device == pipeline.device
                seen += batch["index"].tolist()
            assert sorted(seen) == list(range(18))
        figures = pipeline.summary()
        assert figures["images_per_sec"] > 0 and figures["batches"] == 10
        x = pipeline.input_layer()(batch["image"])
        assert x.dtype == torch.float32 and abs(float(x.mean())) < 3


def readme_script() -> str:
    text = (REPO / "docs" / "training.md").read_text()
    match = re.search(r"<!-- train-script -->\s*```python\n(.*?)```", text, re.S)
    assert match, "docs/training.md lost its training script"
    return match.group(1)


def test_the_readme_script_is_about_30_lines():
    assert 20 <= len(readme_script().strip().splitlines()) <= 40


@pytest.mark.process
@pytest.mark.slow
def test_the_readme_training_script_runs_as_written(tmp_path: Path, cache_dir: Path):
    root = make_tree(tmp_path / "data", {f"c{c}/{k}.jpg": encode(photo(64, 80, index=9 * c + k))
                                         for c in range(3) for k in range(12)})
    (tmp_path / "train.py").write_text(readme_script())
    proc = subprocess.run([sys.executable, "train.py", str(root)], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"epoch 1: loss \d", proc.stdout)
    assert re.search(r"epoch 3: +\d+%\|", proc.stderr)  # the pipeline's bar of each epoch
    assert "images/s" in proc.stdout


@pytest.mark.slow
def test_training_on_a_single_class_is_warned_about(tmp_path: Path, cache_dir: Path, caplog):

    from tests.conftest import run_in_process

    tree = make_tree(tmp_path / "data", {f"only/{k}.jpg": encode(photo(32, 32, k))
                                         for k in range(4)})
    with caplog.at_level(logging.WARNING):
        run_in_process(f"dataset.path={tree}", "dataset.image_size=[16,16]",
                       "loader.batch_size=2", "logger=none", "diagnose=false",
                       "run.progress=false", run_dir=tmp_path / "run")
    assert "the dataset has one class (only)" in caplog.text


def test_a_checkpoint_of_exactly_the_probe_class_count_is_sized_right(tmp_path: Path):
    from runner.model.networks import PROBE_CLASSES

    for count in PROBE_CLASSES:
        source = build_model(ModelConfig("tiny"), count, CPU)
        torch.save(source[1].state_dict(), tmp_path / "w.pt")
        model = build_model(ModelConfig("tiny", weights=str(tmp_path / "w.pt")), 0, CPU,
                            train=False)
        assert model.num_classes == count


def test_a_model_resize_runs_under_cpu_bfloat16():
    from runner.model.networks import UInt8Input

    x = torch.randint(0, 256, (2, 3, 40, 40), dtype=torch.uint8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = UInt8Input(size=(24, 24))(x)
    assert y.shape == (2, 3, 24, 24) and y.dtype == torch.bfloat16


@pytest.fixture
def twelve(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "data", {f"{c}/{k}.jpg": encode(photo(40, 52, 10 * i + k))
                                         for i, c in enumerate(["a", "b"]) for k in range(6)})

@pytest.mark.slow
@pytest.mark.parametrize("task", ["train", "infer"])
def test_an_image_size_the_model_cannot_take_names_the_setting_and_the_size(
        twelve: Path, tmp_path: Path, task: str):
    from runner.common.errors import ConfigError

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

def test_weights_files_of_one_name_in_two_folders_get_their_folders_in_the_names(tmp_path: Path):
    from runner.config.rules import model_configs
    from runner.job.compose import compose

    cfg = compose(["task=infer", "+models=[{name:tiny,weights:/x/a/best.pt},"
                   "{name:tiny,weights:/x/b/best.pt}]"])
    assert [m.label for m in model_configs(cfg)] == ["tiny-a-best", "tiny-b-best"]

def test_one_weights_file_twice_asks_for_an_alias_not_other_weights(tmp_path: Path):
    from runner.common.errors import ConfigError
    from runner.config.rules import model_configs
    from runner.job.compose import compose

    with pytest.raises(ConfigError, match="one weights file /x/best.pt.*give each entry an alias"):
        model_configs(compose(["task=infer", "+models=[{name:tiny,weights:/x/best.pt},"
                               "{name:tiny,weights:/x/best.pt}]"]))


@pytest.mark.slow
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


DETECTOR = "fasterrcnn_mobilenet_v3_large_320_fpn"  # the quickest of the four to build


def test_a_detector_name_builds_the_detector_at_the_batches_size(tmp_path: Path):
    from runner.model.detectors import Detector
    from runner.model.families import build_family_model

    cfg = compose([f"model.name={DETECTOR}"]).model  # a name the config accepts
    torch.manual_seed(0)
    model = build_family_model(cfg, 3, CPU, image_size=(32, 48))
    assert isinstance(model, Detector) and model.training
    assert model.num_classes == 3 and model.class_names is None
    assert model._runner_name == model[1]._runner_name == DETECTOR
    transform = model[1].transform
    assert (transform.min_size, transform.max_size) == ((32,), 48)  # not resized again
    assert model[1].roi_heads.box_predictor.cls_score.out_features == 4  # + background
    # model.image_size is the size it runs at, whatever the batches'
    own = build_family_model(ModelConfig(DETECTOR, image_size=[40, 40]), 3, CPU, image_size=(32, 48))
    assert (own[1].transform.min_size, own[1].transform.max_size) == ((40,), 40)
    with pytest.raises(ConfigError, match=r"model.image_size=\[H,W\]"):
        build_family_model(cfg, 3, CPU)


def test_a_detectors_weights_load_and_give_its_class_count(tmp_path: Path):
    from runner.model.families import build_family_model

    torch.manual_seed(1)
    source = build_family_model(ModelConfig(DETECTOR), 3, CPU, image_size=(64, 64))
    path = tmp_path / "w.pt"
    torch.save(source[1].state_dict(), path)  # torchvision's keys, a plain state_dict
    # inference on unlabelled images: the class count read off the head (3 + background)
    loaded = build_family_model(ModelConfig(DETECTOR, weights=str(path)), 0, CPU, train=False,
                         image_size=(64, 64))
    assert loaded.num_classes == 3
    for (k, v), w in zip(source[1].state_dict().items(), loaded[1].state_dict().values()):
        assert torch.equal(v, w), k
    with pytest.raises(ConfigError, match="model.replace_head=true"):
        build_family_model(ModelConfig(DETECTOR, weights=str(path)), 5, CPU, image_size=(64, 64))
    tuned = build_family_model(ModelConfig(DETECTOR, weights=str(path), replace_head=True), 5, CPU,
                        image_size=(64, 64))
    assert tuned.num_classes == 5
    assert tuned[1].roi_heads.box_predictor.cls_score.out_features == 6


def test_a_segmenter_from_scratch_keeps_its_batchnorm_statistics_up():
    """LR-ASPP's MobileNetV3 sets BatchNorm momentum 0.01, which lags a random network's
    running statistics (val mIoU 0.23 against 0.54 after 300 steps): trained from scratch
    its family builds it at 0.1; served, it keeps torchvision's own."""
    from runner.config.schema import ModelConfig
    from runner.model.families import FAMILIES, SCRATCH_BN_MOMENTUM, ModelFamily

    build = FAMILIES[ModelFamily.segmenter].build
    cfg = ModelConfig(name="lraspp_mobilenet_v3_large")

    def momenta(model):
        return {m.momentum for m in model.modules()
                if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}

    assert momenta(build(cfg, 3, torch.device("cpu"), True, (64, 64))) == {SCRATCH_BN_MOMENTUM}
    assert 0.01 in momenta(build(cfg, 3, torch.device("cpu"), False, (64, 64)))
