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
