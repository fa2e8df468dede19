"""runner/model/detectors.py: torchvision's detectors behind the uint8 input, their batched
transform, the padded targets and predictions, a training step of each."""

from __future__ import annotations

import math

import pytest
import torch
from torchvision.models.detection.transform import GeneralizedRCNNTransform

from runner.common.errors import ConfigError
from runner.model.detectors import (
    DETECTORS,
    BatchedTransform,
    as_padded,
    as_targets,
    build_detector,
    head_classes,
    total_loss,
)

SLOW = {"retinanet_resnet50_fpn", "fcos_resnet50_fpn"}  # resnet50 backbones


def padded_batch(size: int) -> dict[str, torch.Tensor]:
    """Three images: two boxes, one box (and a padding row), none."""
    s = float(size)
    return {
        "boxes": torch.tensor([[[4, 6, s / 2, s / 2 + 3], [10, 10, s - 2, s - 5]],
                               [[1, 1, s / 3, s / 4], [0, 0, 0, 0]],
                               [[0, 0, 0, 0], [0, 0, 0, 0]]]),
        "box_labels": torch.tensor([[0, 2], [1, -1], [-1, -1]]),
        "box_count": torch.tensor([2, 1, 0]),
    }


def test_padded_targets_become_torchvisions_lists_without_padding_or_empty_boxes():
    batch = padded_batch(64)
    batch["boxes"][0, 1] = torch.tensor([10.0, 10.0, 10.0, 30.0])  # no width: left out
    out = as_targets(batch, offset=1)
    assert [len(t["boxes"]) for t in out] == [1, 1, 0]
    assert torch.equal(out[0]["boxes"], batch["boxes"][0, :1])
    assert out[0]["labels"].tolist() == [1] and out[1]["labels"].tolist() == [2]
    assert out[2]["boxes"].shape == (0, 4) and out[2]["labels"].dtype == torch.int64
    assert as_targets(batch)[1]["labels"].tolist() == [1]  # no background: as they are


def test_predictions_are_padded_to_the_models_most_detections():
    results = [
        {"boxes": torch.tensor([[1.0, 2, 3, 4], [5, 6, 7, 8]]), "scores": torch.tensor([0.9, 0.5]),
         "labels": torch.tensor([3, 1])},
        {"boxes": torch.zeros((0, 4)), "scores": torch.zeros(0),
         "labels": torch.zeros(0, dtype=torch.int64)},
    ]
    out = as_padded(results, max_detections=4, offset=1)
    assert out["boxes"].shape == (2, 4, 4) and out["box_scores"].shape == (2, 4)
    assert out["box_count"].tolist() == [2, 0]
    assert out["box_labels"].tolist() == [[2, 0, -1, -1], [-1, -1, -1, -1]]
    assert torch.equal(out["boxes"][0, :2], results[0]["boxes"])
    assert out["boxes"][0, 2:].abs().sum() == 0 and out["box_scores"][1].abs().sum() == 0
    cut = as_padded(results, max_detections=1)
    assert cut["box_count"].tolist() == [1, 0] and cut["box_labels"].tolist() == [[3], [-1]]
    assert as_padded(results)["boxes"].shape == (2, 2, 4)  # the batch's most


@pytest.mark.parametrize("fixed", [False, True])
@pytest.mark.parametrize("size", [(64, 96), (100, 70)])
def test_the_batched_transform_gives_torchvisions_tensors_and_boxes(size, fixed):
    """The same normalized, resized, padded batch and rescaled boxes as torchvision's
    per-image transform, whether the run's size is kept or changed."""
    torch.manual_seed(0)
    images = torch.rand(3, 3, *size)
    targets = as_targets(padded_batch(60))
    for min_size, max_size in ((min(size), max(size)), (80, 120)):
        kwargs = {"size_divisible": 1, "fixed_size": (72, 56)} if fixed else {}
        stock = GeneralizedRCNNTransform(min_size, max_size, [0.4, 0.5, 0.6], [0.2, 0.25, 0.3],
                                         **kwargs)
        ours = BatchedTransform(min_size, max_size, [0.4, 0.5, 0.6], [0.2, 0.25, 0.3], **kwargs)
        want, want_targets = stock(list(images), targets)
        got, got_targets = ours(images, targets)
        assert got.image_sizes == want.image_sizes
        torch.testing.assert_close(got.tensors, want.tensors)
        for g, w in zip(got_targets, want_targets):
            torch.testing.assert_close(g["boxes"], w["boxes"])
            assert torch.equal(g["labels"], w["labels"])
    assert targets[0]["boxes"][0, 2] == 30.0  # the caller's dicts are left alone


@pytest.mark.slow  # over 10 s on 2 cores: out of the unit tier
def test_a_detector_takes_uint8_at_the_runs_size_as_torchvision_takes_floats():
    torch.manual_seed(0)
    model = build_detector("fasterrcnn_mobilenet_v3_large_320_fpn", 3, (64, 96)).eval()
    network = model[1]
    assert (network.transform.min_size, network.transform.max_size) == ((64,), 96)
    assert network.roi_heads.box_predictor.cls_score.out_features == 4  # + background
    images = torch.randint(0, 256, (2, 3, 64, 96), dtype=torch.uint8)
    with torch.no_grad():
        got = model(images)
        ours = network.transform
        network.transform = GeneralizedRCNNTransform(64, 96, ours.image_mean, ours.image_std)
        want = network(list(images.float() / 255))
    assert got["boxes"].shape == (2, 100, 4)
    assert got["box_count"].tolist() == [len(w["scores"]) for w in want]
    for i, w in enumerate(want):
        n = len(w["scores"])
        torch.testing.assert_close(got["boxes"][i, :n], w["boxes"])
        assert got["box_labels"][i, :n].tolist() == (w["labels"] - 1).tolist()


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in DETECTORS])
def test_each_detectors_head_follows_its_class_convention(name: str):
    network = build_detector(name, 5, (64, 64))[1]
    if name.startswith("fasterrcnn"):
        classes = network.roi_heads.box_predictor.cls_score.out_features
    elif name.startswith("ssd"):
        classes = network.head.classification_head.num_columns
    else:
        classes = network.head.classification_head.num_classes
    assert classes == head_classes(name, 5) == (6 if DETECTORS[name].background else 5)


def one_step(name: str, size: int) -> tuple[dict[str, torch.Tensor], float]:
    """One SGD step on a batch of three images (one without boxes): its losses, and how
    far the weights moved."""
    torch.manual_seed(0)
    model = build_detector(name, 3, (size, size)).train()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    images = torch.randint(0, 256, (3, 3, size, size), dtype=torch.uint8)
    losses = model(images, padded_batch(size))
    loss = total_loss(losses)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    moved = sum(float((p.detach() - b).abs().sum()) for p, b in zip(model.parameters(), before))
    return losses, moved


@pytest.mark.slow  # over 10 s on 2 cores: out of the unit tier
def test_one_training_step_of_ssdlite_at_64_pixels():
    losses, moved = one_step("ssdlite320_mobilenet_v3_large", 64)
    assert tuple(losses) == DETECTORS["ssdlite320_mobilenet_v3_large"].losses
    assert math.isfinite(float(total_loss(losses).detach())) and moved > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DETECTORS))
def test_one_training_step_of_each_detector_at_128_pixels(name: str):
    losses, moved = one_step(name, 128)
    assert set(losses) == set(DETECTORS[name].losses)
    assert math.isfinite(float(total_loss(losses).detach())) and moved > 0


@pytest.mark.slow  # over 10 s on 2 cores: out of the unit tier
def test_a_detector_loads_a_local_state_dict_and_refuses_another_class_count(tmp_path):
    name = "ssdlite320_mobilenet_v3_large"
    torch.manual_seed(1)
    saved = build_detector(name, 3, (64, 64))
    path = tmp_path / "det.pt"
    torch.save(saved[1].state_dict(), path)  # torchvision's own keys
    loaded = build_detector(name, 3, (64, 64), weights=str(path))
    for (k, v), w in zip(saved[1].state_dict().items(), loaded[1].state_dict().values()):
        assert torch.equal(v, w), k
    with pytest.raises(ConfigError, match="different number of classes"):
        build_detector(name, 4, (64, 64), weights=str(path))
    other = build_detector(name, 4, (64, 64), weights=str(path), replace_head=True)
    head = "head.regression_head.module_list.0.1.weight"  # the box head: no class count
    assert torch.equal(other[1].state_dict()[head], saved[1].state_dict()[head])


def test_an_unknown_detector_is_a_config_error_naming_the_choices():
    with pytest.raises(ConfigError, match="did you mean retinanet_resnet50_fpn"):
        build_detector("retinanet_resnet50", 3, (64, 64))


def test_under_autocast_the_network_still_gets_float32_images():
    """torchvision's detectors take float32 images under autocast (their convolutions cast
    themselves): the uint8 layer runs outside it, and the padded outputs stay float32."""
    model = build_detector("ssdlite320_mobilenet_v3_large", 3, (64, 64)).train()
    seen = []
    model[1].transform.register_forward_pre_hook(lambda _, args: seen.append(args[0].dtype))
    images = torch.randint(0, 256, (3, 3, 64, 64), dtype=torch.uint8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = model(images, padded_batch(64))
        model.eval()
        with torch.no_grad():
            out = model(images)
    assert seen == [torch.float32, torch.float32]
    assert math.isfinite(float(total_loss(losses).detach()))
    assert out["boxes"].dtype == out["box_scores"].dtype == torch.float32


def test_a_classifiers_checkpoint_given_to_a_detector_is_named_so_not_told_replace_head(
        tmp_path):
    """A classifier's runner checkpoint (10 class names) as a detector's model.weights:
    model.replace_head would not make it load (it replaces a detector's class head, not a
    backbone), so the one line says what the file is and what to do instead."""
    import torchvision

    from runner.config.schema import ModelConfig
    from runner.model.detectors import detector_classes

    name = "fasterrcnn_mobilenet_v3_large_320_fpn"
    cfg = ModelConfig(name=name, weights=str(tmp_path / "classifier.pt"))
    state = torchvision.models.resnet18(num_classes=10).state_dict()
    with pytest.raises(ConfigError, match=rf"classifier.pt is not a {name} checkpoint: .* "
                                          r"tensors are missing .* \(e.g. \S+: a "
                                          r"classifier's\?\).*drop model.weights") as e:
        detector_classes(cfg, 3, state, [str(k) for k in range(10)], True)
    assert "set model.replace_head=true" not in str(e.value)
    # a detector's own weights of another class count still get the hint
    own = build_detector(name, 10, (64, 64))[1].state_dict()
    with pytest.raises(ConfigError, match="model.replace_head=true"):
        detector_classes(cfg, 3, own, [str(k) for k in range(10)], True)


def test_a_detector_under_bf16_autocast_matches_its_float32_losses_and_boxes():
    """amp=bf16 applies to a detector as to a classifier: its input layer stays in float32
    (autocast off around it), its network runs under autocast, and its losses agree with
    float32 eager within bfloat16's tolerance (runner/model/amp.py); its eval predictions come
    back padded and in float32, as without autocast."""
    from runner.config.schema import AmpConfig, AmpName
    from runner.model.amp import autocast, tolerance
    from runner.model.detectors import build_detector, total_loss

    torch.manual_seed(0)
    model = build_detector("ssdlite320_mobilenet_v3_large", 3, (64, 64))
    x = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8)
    targets = {"boxes": torch.tensor([[[4.0, 6.0, 40.0, 50.0]], [[10.0, 10.0, 30.0, 20.0]]]),
               "box_labels": torch.tensor([[0], [2]]), "box_count": torch.tensor([1, 1])}
    bf16 = AmpConfig(AmpName.bf16)
    torch.manual_seed(1)
    eager = total_loss(model.train()(x, targets))
    torch.manual_seed(1)
    with autocast(bf16, torch.device("cpu")):
        mixed = total_loss(model(x, targets)).float()
    assert float(eager) == pytest.approx(float(mixed),
                                         rel=20 * tolerance(torch.bfloat16, torch.device("cpu")))
    model.eval()
    with torch.no_grad():
        plain = model(x)
        with autocast(bf16, torch.device("cpu")):
            half = model(x)
    assert half["boxes"].dtype == torch.float32  # read back as float32, as the model's
    # a random head's scores sit at its threshold: how many pass differs, the layout not
    assert half["boxes"].shape[1:] == plain["boxes"].shape[1:] and half["boxes"].isfinite().all()


def test_a_whole_model_backend_is_refused_for_a_detector_in_one_line_naming_inductor():
    """torchscript, tensorrt and onnxruntime compile a whole model, which a detector's
    forward (boxes in, dicts out) does not suit: one line names compile=inductor (which
    compiles its backbone) and compile=eager; inductor itself is accepted, at config time
    (train's check_target_task) as at build time (check_compiles)."""
    import dataclasses

    from runner.common.errors import ConfigError
    from runner.config.schema import CompileConfig, CompileName, ModelFamily
    from runner.job.compose import compose
    from runner.model.compile import check_compiles
    from runner.model.families import FAMILIES
    from runner.tasks.train.training import check_target_task

    detector = FAMILIES[ModelFamily.detector]
    for name in (CompileName.torchscript, CompileName.tensorrt, CompileName.onnxruntime):
        with pytest.raises(ConfigError, match=rf"compile={name.value} does not compile a "
                                              r"detector \(model det: .*\); use compile="
                                              r"inductor, which compiles its backbone alone, "
                                              r"or compile=eager"):
            check_compiles(detector, CompileConfig(name), "det")
    check_compiles(detector, CompileConfig(CompileName.inductor), "det")
    check_compiles(detector, CompileConfig(CompileName.eager), "det")
    check_compiles(FAMILIES[ModelFamily.classifier], CompileConfig(CompileName.torchscript),
                   "c")
    config = compose(["task=train", "model.name=ssdlite320_mobilenet_v3_large",
                      "dataset.targets=auto"])
    check_target_task(dataclasses.replace(config, compile=CompileConfig(CompileName.inductor)))
    with pytest.raises(ConfigError, match=r"compile=torchscript does not compile a detector "
                                          r"\(model ssdlite320_mobilenet_v3_large: .*use "
                                          r"compile=inductor"):
        check_target_task(dataclasses.replace(
            config, compile=CompileConfig(CompileName.torchscript)))
