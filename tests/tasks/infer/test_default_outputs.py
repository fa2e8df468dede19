"""``task.outputs`` unset: each model writes what its kind of target gives
(``TargetKind.outputs``): a detector its detections, a classifier its top-k; and a user's own
detector (``model.target``, torchvision's detection protocol) trains and serves its boxes."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.common.errors import ConfigError
from runner.config.schema import ModelConfig, ModelFamily, ModelSource, Targets
from tests.conftest import run_in_process

QUIET = ["logger=none", "diagnose=false", "run.timeline=false", "run.progress=false",
         "run.warmup_steps=0", "loader.batch_size=4"]
BOXES = ["dataset.targets=auto", "dataset.num_images=12", "dataset.image_size=[64,64]"]
OWN = ["model=custom", "model.target=tests.model.own_detector:tiny_detector"]


def test_a_detector_writes_its_detections_unasked(tmp_path: Path):
    run = tmp_path / "run"
    run_in_process("task=infer", *QUIET, *BOXES, "model.name=ssdlite320_mobilenet_v3_large",
                   run_dir=run)
    assert (run / "detections.json").is_file() and (run / "detections.csv").is_file()
    assert not list(run.glob("predictions*.csv"))


def test_a_classifier_writes_its_top_k_unasked_as_before(tmp_path: Path):
    run = tmp_path / "run"
    run_in_process("task=infer", *QUIET, "model=tiny", "dataset.image_size=[32,32]",
                   run_dir=run)
    assert list(run.glob("predictions*.csv")) and not list(run.glob("detections*"))


def test_models_that_give_different_outputs_are_asked_to_name_them(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"tiny: topk; ssdlite320_mobilenet_v3_large: "
                                          r"detections\): name what to keep"):
        run_in_process("task=infer", *QUIET, *BOXES,
                       "models=[tiny,ssdlite320_mobilenet_v3_large]", run_dir=tmp_path / "r")


def test_a_users_own_detector_is_a_detector_by_the_data_or_by_model_family():
    from runner.model.families import family_of_config

    own = ModelConfig("custom", source=ModelSource.custom, target="m:f")
    assert family_of_config(own, Targets.auto).name is ModelFamily.detector
    assert family_of_config(own, Targets.none).name is ModelFamily.classifier
    told = ModelConfig("custom", source=ModelSource.custom, target="m:f",
                       family=ModelFamily.detector)
    assert family_of_config(told, Targets.none).name is ModelFamily.detector


@pytest.mark.slow  # a training run and an inference run: 1-3 minutes on 2 loaded cores
def test_a_users_own_detector_trains_validates_and_serves_its_boxes(tmp_path: Path):
    """model.target names a module of torchvision's detection protocol: it trains on the
    boxes with its own losses, is validated by mAP, and its checkpoint (model.weights)
    serves detections by default."""
    import json

    import torch

    train = tmp_path / "train"
    got = run_in_process("task=train", *QUIET, *BOXES, *OWN, "run.epochs=1", run_dir=train)
    assert "val_map" in json.dumps(got) or (train / "checkpoint-best.pt").is_file()
    saved = torch.load(train / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert any(k.startswith("cls.") for k in saved["model"])  # the user's own keys
    serve = tmp_path / "serve"
    run_in_process("task=infer", *QUIET, *BOXES, *OWN, f"model.weights={train}/checkpoint.pt",
                   run_dir=serve)
    rows = json.loads((serve / "detections.json").read_text())
    assert rows and all(len(r["bbox"]) == 4 and 0 <= r["score"] <= 1 for r in rows)


def own_model(target: str, targets: Targets = Targets.none, **kw):
    import torch

    from runner.model.families import build_family_model

    cfg = ModelConfig("custom", source=ModelSource.custom, target=target, **kw)
    torch.manual_seed(0)
    return build_family_model(cfg, 3, torch.device("cpu"), train=False, targets=targets).eval()


def probe(model, *outputs):
    """What task=infer keeps of ``model``'s output (its reducer bound to its family, as
    the infer task binds it), and the reducer."""
    import contextlib

    import torch

    from runner.config.schema import Output, TaskConfig, TaskName
    from runner.model.families import family_of
    from runner.model.networks import split_input
    from runner.tasks.infer.outputs import Reduce, output_shapes

    task = TaskConfig(TaskName.infer, outputs=[Output(o) for o in outputs or ["topk"]], topk=2)
    reduce = Reduce(task, split_input(model)[1], family_of(model))
    x = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8)
    return output_shapes(reduce, model, x, contextlib.nullcontext, task, "own"), reduce, x


def test_a_classifier_whose_scores_come_as_a_feature_map_gets_its_top_k():
    """The outputs are the model's family's (runner/model/families.py's record), not a
    guess from its output's shape: a user's classifier whose scores come as [B, C, 1, 1]
    (a 4-d output, as a segmenter's) writes its top-k, read as [B, C]."""
    import torch

    model = own_model("tests.nets:ConvHead")
    shapes, reduce, x = probe(model)  # task.outputs as settled: the classifier's topk
    assert {k: s for k, (s, _) in shapes.items()} == {"topk_probs": (2,), "topk_classes": (2,)}
    reduce.start()
    with torch.inference_mode():
        kept = reduce(model(x), None)
        want = torch.softmax(model(x).flatten(1).float(), dim=1).topk(2, dim=1)
    assert torch.equal(kept["topk_classes"], want.indices)
    assert torch.allclose(kept["topk_probs"], want.values)


def test_per_pixel_scores_of_a_model_told_a_classifier_are_refused_naming_the_family():
    with pytest.raises(ConfigError, match=r"gave \[2, 3, 16, 16\].*model.family=segmenter"):
        probe(own_model("tests.nets:PerPixel"))


def test_a_users_segmenter_is_one_by_its_family_and_gives_masks():
    """model.family=segmenter: its masks, and class outputs refused in one line."""
    shapes, _, _ = probe(own_model("tests.nets:PerPixel", family=ModelFamily.segmenter),
                         "masks")
    assert shapes["masks"][0] == (16, 16)
    with pytest.raises(ConfigError, match=r"model own is a segmenter: it gives masks"):
        probe(own_model("tests.nets:PerPixel", family=ModelFamily.segmenter), "topk")


def test_a_users_classifier_with_a_feature_map_head_writes_its_top_k_unasked(tmp_path: Path):
    """task=infer end to end: the reducer bound to the family of the model it built."""
    import csv

    run = tmp_path / "run"
    run_in_process("task=infer", *QUIET, "model=custom", "model.target=tests.nets:ConvHead",
                   "dataset.image_size=[32,32]", "dataset.num_images=8", run_dir=run)
    rows = list(csv.DictReader((run / "predictions.csv").open(newline="")))
    assert len(rows) == 8 and all(0 <= int(r["pred"]) < 10 for r in rows)
