"""runner/tasks/train/validation.py: a detector's validation gives mAP and mAP@0.5 over every
validation image (its eval-mode predictions against each batch's boxes), a shard's padding
rows left out."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from runner.config.schema import AmpConfig, AmpName
from runner.model.detectors import Detector, build_detector
from runner.tasks.train.validation import Validation

pytest.importorskip("torchmetrics")
pytest.importorskip("pycocotools")

from runner.tasks.train.detection_metrics import DetectionMAP  # noqa: E402

CPU = torch.device("cpu")
CLASSES = ["circle", "square", "triangle"]


class FakeData:
    """The validation data path's interface: its batches, device, classes."""

    def __init__(self, batches: list[TensorDict]):
        self.batches, self.device, self.classes, self.closed = batches, CPU, CLASSES, False

    def device_batches(self):
        yield from self.batches

    def close(self) -> None:
        self.closed = True


def batch(boxes: list[list[tuple]], valid: list[bool] | None = None) -> TensorDict:
    """Images of (x1, y1, x2, y2, label) boxes, in the data side's padded layout."""
    b, m = len(boxes), max(len(r) for r in boxes)
    out = torch.zeros(b, m, 4)
    labels = torch.full((b, m), -1)
    for i, rows in enumerate(boxes):
        for j, row in enumerate(rows):
            out[i, j], labels[i, j] = torch.tensor(row[:4], dtype=torch.float32), row[4]
    fields = {"image": torch.zeros(b, 3, 32, 32, dtype=torch.uint8),
              "label": torch.zeros(b, dtype=torch.long), "index": torch.arange(b),
              "boxes": out, "box_labels": labels,
              "box_count": torch.tensor([len(r) for r in boxes])}
    if valid is not None:
        fields["valid"] = torch.tensor(valid)
    return TensorDict(fields, batch_size=[b])


class Scripted(nn.Module):
    """A network that answers each call with the next of the given detections."""

    detections_per_img = 5

    def __init__(self, answers: list[list[dict[str, torch.Tensor]]]):
        super().__init__()
        self.answers = iter(answers)
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, images):
        return next(self.answers)


def answer(rows: list[tuple]) -> dict[str, torch.Tensor]:
    """torchvision's per-image result of (x1, y1, x2, y2, label, score) rows (labels as
    the dataset's: no background in this model's convention)."""
    t = torch.tensor(rows, dtype=torch.float32).reshape(-1, 6)
    return {"boxes": t[:, :4], "labels": t[:, 4].long(), "scores": t[:, 5]}


A, B = (2, 2, 20, 20, 0), (5, 8, 30, 28, 2)


def test_a_detectors_validation_is_its_map_over_every_image_without_the_padding_rows():
    batches = [batch([[A], [B]]), batch([[B, A], [A]], valid=[True, False])]
    answers = [[answer([(*A, 0.9)]), answer([(*B, 0.8)])],
               [answer([(*B, 0.7), (*A, 0.6)]),
                answer([(*A[:4], 1, 0.99), (0, 0, 31, 31, 1, 0.9)])]]  # a padding row's
    model = Detector(Scripted(answers), "retinanet_resnet50_fpn", 3).train()
    validation = Validation(FakeData(batches), model, AmpConfig(AmpName.off), CLASSES)
    got = validation()
    assert set(got) == {"map", "map_50"}
    assert got == {"map": pytest.approx(1.0), "map_50": pytest.approx(1.0)}
    assert model.training  # back in the mode it was in


def test_a_real_detectors_figures_are_the_metrics_on_its_eval_predictions():
    torch.manual_seed(0)
    model = build_detector("fasterrcnn_mobilenet_v3_large_320_fpn", 3, (32, 32)).train()
    batches = [batch([[A], [B, A]]), batch([[B], []])]
    got = Validation(FakeData(batches), model, AmpConfig(AmpName.off), CLASSES)()
    metric = DetectionMAP()
    model.eval()
    with torch.no_grad():
        for b in batches:
            metric.update(model(b["image"]), b)
    want = metric.compute()
    for key in ("map", "map_50"):
        assert (math.isnan(got[key]) and math.isnan(want[key])) or got[key] == want[key]
    assert 0.0 <= want["map_50"] <= 1.0


def test_a_detectors_validation_without_torchmetrics_is_refused_before_training(monkeypatch):
    """The metric's package missing is an Unavailable when validation is made, not after
    the first epoch's training."""
    import builtins

    from runner.common.errors import Unavailable

    real = builtins.__import__

    def no_torchmetrics(name, *args, **kwargs):
        if name.startswith("torchmetrics"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchmetrics)
    model = Detector(Scripted([]), "retinanet_resnet50_fpn", 3)
    with pytest.raises(Unavailable, match=r"pip install -e '\.\[detection\]'"):
        Validation(FakeData([]), model, AmpConfig(AmpName.off), CLASSES)


def test_a_detector_is_validated_on_whole_images_and_a_classifier_on_centre_crops():
    """A centre crop of a non-square image cuts the boxes at its sides away: a detector's
    validation reads whole images, letterboxed (or stretched when it trained on
    dataset.crop=whole), whatever the training crop; a classifier's, centre crops."""
    from runner.config.schema import Crop
    from runner.job.compose import compose
    from runner.tasks.train.validation import validation_config

    boxes = validation_config(compose(["dataset.targets=auto", "dataset.crop=random",
                                       "model.name=ssdlite320_mobilenet_v3_large"]))
    classes = validation_config(compose(["dataset.crop=random", "dataset.val_fraction=0.2"]))
    assert boxes.dataset.crop is Crop.letterbox and classes.dataset.crop is Crop.center
    whole = validation_config(compose(["dataset.targets=auto", "dataset.crop=whole",
                                       "model.name=ssdlite320_mobilenet_v3_large"]))
    assert whole.dataset.crop is Crop.whole


def test_a_segmenter_is_validated_on_whole_images_as_it_trained_and_is_served():
    """Masks are scored on whole images: letterboxed where the run trained letterboxed (as
    task=infer serves its checkpoint), stretched where it trained stretched or on crops."""
    from runner.config.schema import Crop
    from runner.job.compose import compose
    from runner.tasks.checkpoint import INPUT_KEYS
    from runner.tasks.train.validation import validation_config

    def crop(trained: str) -> Crop:
        return validation_config(compose(["dataset.targets=masks", f"dataset.crop={trained}",
                                          "model.name=lraspp_mobilenet_v3_large"])).dataset.crop

    assert "dataset.crop" in INPUT_KEYS  # the served crop is the trained one
    assert crop("letterbox") is Crop.letterbox
    assert crop("whole") is Crop.whole
    assert crop("random") is Crop.whole and crop("center") is Crop.whole


def test_a_classifier_at_chance_or_on_one_class_is_said_to_have_not_learned():
    from runner.tasks.train.validation import not_learning

    classes = ["cat", "dog", "fox"]
    collapsed = not_learning(0.33, [9, 0, 0], classes)
    assert "predicts 'cat' for 100% of the validation images" in collapsed
    assert "recipe=small_folder" in collapsed and "model.weights=" in collapsed
    assert "at chance (1/3 = 33%)" in not_learning(0.4, [3, 3, 3], classes)
    assert not_learning(0.8, [3, 3, 3], classes) is None  # learned
    assert not_learning(0.9, [], ["only"]) is None  # one class: said elsewhere


def test_validation_counts_each_classs_top1_predictions():
    class Always(nn.Module):  # a collapsed classifier: class 2 for every image
        def forward(self, x):
            return torch.tensor([0.0, 0.1, 5.0]).repeat(len(x), 1)

    rows = [TensorDict({"image": torch.zeros(4, 3, 8, 8, dtype=torch.uint8),
                        "label": torch.tensor([0, 1, 2, 0])}, batch_size=[4])]
    validation = Validation(FakeData(rows), Always(), AmpConfig(AmpName.off), CLASSES)
    got = validation()
    assert got["top1"] == 0.25 and validation.predicted == [0, 0, 4]
    assert "predicts 'triangle' for 100%" in validation.not_learning(got["top1"])


@pytest.mark.slow
def test_a_training_run_that_learns_nothing_ends_with_the_warning(tmp_path, cache_dir, caplog):
    import logging

    from tests.conftest import encode, make_tree, photo, run_in_process

    tree = make_tree(tmp_path / "data", {f"{c}/{k}.jpg": encode(photo(32, 32, 10 * i + k))
                                         for i, c in enumerate("abc") for k in range(6)})
    with caplog.at_level(logging.WARNING):
        run_in_process(f"dataset.path={tree}", "dataset.image_size=[16,16]",
                       "dataset.val_fraction=0.5", "task.lr=1e-9", "loader.batch_size=3",
                       "logger=none", "diagnose=false", "run.progress=false",
                       run_dir=tmp_path / "run")
    assert "the model has not learned" in caplog.text
