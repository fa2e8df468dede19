"""``dataset.targets=masks``: the masks record wired through the data path (the generated
shapes set's masks follow the decode and the device crop, batched as ``mask``), a segmenter
trained on them and validated by mean IoU, and ``task=infer`` writing masks unasked."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import run_in_process

SMALL = ["dataset.targets=masks", "dataset.num_images=12", "dataset.crop=whole",
         "loader.batch_size=4", "run.progress=false"]


def test_a_masks_batch_carries_each_images_mask_through_its_decode(tmp_path: Path):
    """At the source size, a whole image's mask is its PNG, pixel for pixel; at another
    size, the v2 NEAREST resize of it (maskgeometry's ``map_mask``)."""
    import runner
    from runner.data.decode.boxgeometry import Window
    from runner.data.decode.maskgeometry import map_mask

    for size in ((160, 160), (64, 96)):
        p = runner.pipeline(*SMALL, f"dataset.image_size=[{size[0]},{size[1]}]",
                            f"dataset.cache_dir={tmp_path}", loader="folder")
        batch = next(iter(p))
        assert batch["mask"].shape == (4, *size) and batch["mask"].dtype == torch.uint8
        for row, index in enumerate(batch["index"].tolist()):
            name = p.storage.name_of(index)  # images/train/000003.jpg
            png = Path(p.storage.root).parent.parent / "masks" / "train" / \
                Path(name).with_suffix(".png").name
            source = torch.from_numpy(np.array(Image.open(png)))
            want = map_mask(source, Window(0, 0, *source.shape), size)
            assert torch.equal(batch["mask"][row].cpu(), want), (size, name)
        p.close()


def test_a_device_crop_moves_a_masks_batch_with_its_pixels():
    from runner.config.schema import TargetName
    from runner.data.decode.crops import CenterCrop
    from runner.data.decode.maskgeometry import map_masks
    from runner.data.path import crop_targets
    from runner.data.targets import TARGETS, carried

    mask = torch.arange(2 * 8 * 8, dtype=torch.int64).remainder(7).to(torch.uint8).view(2, 8, 8)
    batch = {"image": torch.zeros(2, 3, 8, 8, dtype=torch.uint8), "mask": mask.clone()}
    kind = carried(batch.keys())
    assert kind is TARGETS[TargetName.masks]
    crop = CenterCrop((4, 4), 0.5)
    crop_targets(crop, batch, None, kind.follow)
    from runner.data.decode.boxgeometry import center_windows

    assert torch.equal(batch["mask"], map_masks(mask, center_windows(2, (8, 8), (4, 4), 0.5),
                                                (4, 4)))


@pytest.mark.slow  # a segmenter's epoch and an inference pass: 1-2 minutes on 2 loaded cores
def test_a_segmenter_trains_on_masks_validates_by_miou_and_serves_masks(tmp_path: Path):
    quiet = ["logger=none", "diagnose=false", "run.timeline=false", "run.warmup_steps=0",
             "dataset.image_size=[64,64]", f"dataset.cache_dir={tmp_path / 'cache'}", *SMALL]
    train = tmp_path / "train"
    run_in_process("task=train", "model.name=lraspp_mobilenet_v3_large", "run.epochs=1",
                   *quiet, run_dir=train)
    metrics = json.loads((train / "metrics.json").read_text())
    text = json.dumps(metrics)
    assert "val_miou" in text and "val_pixel_accuracy" in text
    assert (train / "checkpoint-best.pt").is_file()  # kept by val_miou, the kind's figure
    serve = tmp_path / "serve"
    run_in_process("task=infer", "model.name=lraspp_mobilenet_v3_large",
                   f"model.weights={train / 'checkpoint.pt'}", *quiet, run_dir=serve)
    written = sorted((serve / "masks").rglob("*.png"))
    assert written and np.array(Image.open(written[0])).shape == (160, 160)  # source size


def test_a_segmenter_head_smaller_than_the_masks_classes_is_refused(tmp_path: Path):
    """model.num_classes=2 on the shapes masks' 4 classes (ids 0..3): one line before any
    step, as for a classifier (was the loss's ``Target 3 is out of bounds``)."""
    from runner.common.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model.num_classes=2, and the data's labels run "
                                          r"to 3 \(4 classes: background, circle") as e:
        run_in_process("task=train", "model.name=lraspp_mobilenet_v3_large",
                       "model.num_classes=2", "logger=none", "diagnose=false",
                       "dataset.image_size=[32,32]", f"dataset.cache_dir={tmp_path}", *SMALL,
                       run_dir=tmp_path / "run")
    assert "\n" not in str(e.value)


def test_class_balance_weighs_each_class_by_its_share_of_the_batch():
    """``task.class_balance=p``: the loss is torch's cross-entropy with each class weighted by
    its share of the batch's labelled pixels to the power -p (255 and a distributed
    shard's padding rows left out, a class the batch lacks at 1); 0 is the plain loss."""
    from runner.config.schema import TaskConfig
    from runner.model.families import balance_weights, mask_loss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 8, 8, generator=g)
    mask = torch.zeros(3, 8, 8, dtype=torch.uint8)
    mask[:, :2, :3] = 1  # class 1: 6 of 64 pixels an image; class 3 absent
    mask[:, 5, :] = 2
    mask[:, 7, 7] = 255
    batch = {"mask": mask, "valid": torch.tensor([True, True, False])}
    labelled = mask[:2][mask[:2] != 255].long()
    share = torch.bincount(labelled, minlength=4).float() / labelled.numel()
    expected_w = torch.tensor([share[0] ** -0.5, share[1] ** -0.5, share[2] ** -0.5, 1.0])
    target = mask.long().clone()
    target[2] = 255
    assert torch.allclose(balance_weights(target, 4, 0.5), expected_w)
    want = torch.nn.functional.cross_entropy(logits, target, ignore_index=255,
                                             weight=expected_w)
    got = mask_loss(logits, batch, TaskConfig(class_balance=0.5))
    assert torch.allclose(got, want)
    plain = torch.nn.functional.cross_entropy(logits, target, ignore_index=255)
    assert torch.allclose(mask_loss(logits, batch, TaskConfig()), plain)
    assert not torch.allclose(got, plain)


def test_class_balance_is_refused_for_a_model_that_is_not_a_segmenter(tmp_path: Path):
    from runner.common.errors import ConfigError

    with pytest.raises(ConfigError, match=r"task.class_balance=0.5 weighs a segmenter's "
                                          r"pixels by class, and model.name=resnet18 is a "
                                          r"classifier") as e:
        run_in_process("task=train", "model.name=resnet18", "task.class_balance=0.5",
                       "logger=none", "diagnose=false", "dataset.image_size=[32,32]",
                       f"dataset.cache_dir={tmp_path}", "dataset.num_images=16",
                       run_dir=tmp_path / "run")
    assert "\n" not in str(e.value)
