"""A segmenter's validation figures: mean IoU over the epoch's pixels, as torchvision's
segmentation reference computes it from one confusion matrix, 255 ignored."""

from __future__ import annotations

import math

import pytest
import torch

from runner.tasks.train.segmentation_metrics import SegmentationIoU


def reference(preds: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """torchvision references/segmentation/utils.py's ConfusionMatrix: a bincount of
    target * k + prediction over the pixels whose target is a class; IoU per class."""
    keep = (targets >= 0) & (targets < k)
    h = torch.bincount(k * targets[keep] + preds[keep], minlength=k * k).reshape(k, k)
    h = h.double()
    return torch.diag(h) / (h.sum(1) + h.sum(0) - torch.diag(h))


def test_miou_over_batches_equals_one_confusion_matrix_with_ignored_pixels():
    g = torch.Generator().manual_seed(0)
    k = 5
    targets = torch.randint(0, k, (6, 20, 24), generator=g)
    targets[:, :3] = 255
    logits = torch.randn(6, k, 20, 24, generator=g)
    logits[:, :, 5:] += torch.nn.functional.one_hot(targets[:, 5:].clamp(max=k - 1), k
                                                    ).permute(0, 3, 1, 2) * 2.0
    metric = SegmentationIoU(k)
    for a in range(0, 6, 2):  # three batches
        metric.update(logits[a : a + 2], targets[a : a + 2])
    got = metric.compute()
    expected = reference(logits.argmax(1), targets, k)
    assert torch.allclose(torch.tensor(got["iou"], dtype=torch.float64), expected)
    assert math.isclose(got["miou"], float(expected.mean()), rel_tol=1e-6)  # float32 IoU
    keep = targets != 255
    accuracy = float((logits.argmax(1)[keep] == targets[keep]).double().mean())
    assert math.isclose(got["pixel_accuracy"], accuracy, rel_tol=1e-9)
    assert 0.3 < got["miou"] < 1.0  # the logits lean to the truth below row 5
    # the mean of per-batch figures would differ: the epoch is one matrix
    metric.reset()
    assert math.isnan(metric.compute()["miou"])


def test_a_class_absent_from_targets_and_predictions_is_left_out_of_the_mean():
    targets = torch.tensor([[[0, 0, 1, 1], [0, 255, 1, 1]]])
    preds = torch.tensor([[[0, 1, 1, 1], [0, 3, 1, 1]]])  # class 2 nowhere; 3 only where ignored
    metric = SegmentationIoU(4)
    metric.update(preds, targets)
    got = metric.compute()
    # class 0: TP 2, FP 0, FN 1 -> 2/3; class 1: TP 4, FP 1 -> 4/5
    assert got["iou"][:2] == pytest.approx([2 / 3, 4 / 5])
    assert math.isnan(got["iou"][2]) and math.isnan(got["iou"][3])
    assert got["miou"] == pytest.approx((2 / 3 + 4 / 5) / 2)
    assert got["pixel_accuracy"] == pytest.approx(6 / 7)


def test_mismatched_shapes_are_refused_with_the_shapes():
    metric = SegmentationIoU(3)
    with pytest.raises(ValueError, match=r"\(1, 4, 4\) and targets \(1, 5, 5\)"):
        metric.update(torch.zeros(1, 3, 4, 4), torch.zeros(1, 5, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="logits of 2 classes"):
        metric.update(torch.zeros(1, 2, 4, 4), torch.zeros(1, 4, 4, dtype=torch.long))


@pytest.mark.slow  # a MobileNetV3 trained two steps: ~10 s on 2 free cores
def test_the_pieces_train_torchvisions_segmenter_on_the_generated_masks(tmp_path):
    """The generated masks, read back, cut by the device's random crops with their images'
    windows, train lraspp_mobilenet_v3_large (random init) a few steps, and the metric
    takes its output: the pieces fit together before the training loop wires them."""
    import numpy as np
    from PIL import Image
    from torchvision.models.segmentation import lraspp_mobilenet_v3_large

    from runner.data.decode.crops import BatchAugment
    from runner.data.decode.maskgeometry import map_masks
    from runner.data.sources.masklabels import load_mask, read_masks
    from runner.data.sources.shapes import ShapesSpec, ensure_shapes

    root = ensure_shapes(ShapesSpec(num_images=6, height=48, width=48, masks=True), tmp_path,
                         progress=False)
    found = read_masks(root, split="train")
    images = torch.stack([torch.from_numpy(np.asarray(Image.open(p).convert("RGB")))
                          .permute(2, 0, 1) for p in found.targets])
    masks = torch.stack([torch.from_numpy(load_mask(t)) for t in found.targets.values()])
    size, seeds = (64, 64), list(range(len(images)))
    augment = BatchAugment(size)
    crops = augment.boxes(len(seeds), 48, 48, torch.device("cpu"),
                          draws=BatchAugment.draws(seeds))
    x = augment.apply(images, crops).float() / 255
    y = map_masks(masks, crops, size).long()
    torch.manual_seed(0)
    model = lraspp_mobilenet_v3_large(weights=None, weights_backbone=None,
                                      num_classes=len(found.classes))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        logits = model(x)["out"]
        loss = torch.nn.functional.cross_entropy(logits, y, ignore_index=255)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert logits.shape == (len(seeds), 4, *size) and torch.isfinite(loss)
    metric = SegmentationIoU(len(found.classes))
    metric.update(logits, y)
    assert 0.0 <= metric.compute()["miou"] <= 1.0
