"""runner/tasks/train/detection_metrics.py: mAP and mAP@0.5 of hand-made boxes whose
figures are known."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from runner.common.errors import Unavailable

pytest.importorskip("torchmetrics")
pytest.importorskip("pycocotools")

from runner.tasks.train.detection_metrics import DetectionMAP  # noqa: E402


def padded(rows: list[list[tuple]], scored: bool, k: int = 3) -> dict[str, torch.Tensor]:
    """Images of (x1, y1, x2, y2, label[, score]) rows, padded to ``k`` with junk past the
    count (the metric must never read it)."""
    b = len(rows)
    boxes = torch.tensor([5.0, 5.0, 9.0, 9.0]).repeat(b, k, 1)  # a box of class 0, scored
    labels = torch.zeros((b, k), dtype=torch.long)  # high: a false positive if it were read
    scores = torch.full((b, k), 0.99)
    for i, image in enumerate(rows):
        for j, row in enumerate(image):
            boxes[i, j] = torch.tensor(row[:4], dtype=torch.float32)
            labels[i, j] = row[4]
            if scored:
                scores[i, j] = row[5]
    out = {"boxes": boxes, "box_labels": labels,
           "box_count": torch.tensor([len(r) for r in rows])}
    if scored:
        out["box_scores"] = scores
    return out


TRUTH = [[(0, 0, 100, 100, 0), (150, 150, 200, 220, 1)], [(10, 20, 60, 90, 1)]]


def figures(predictions: list[list[tuple]], truth=TRUTH) -> dict[str, float]:
    metric = DetectionMAP()
    metric.update(padded(predictions, scored=True), padded(truth, scored=False))
    return metric.compute()


def test_perfect_predictions_score_one():
    perfect = [[(*r, 0.9) for r in image] for image in TRUTH]
    out = figures(perfect)
    assert out["map"] == pytest.approx(1.0) and out["map_50"] == pytest.approx(1.0)
    assert out["map_75"] == pytest.approx(1.0) and out["mar_100"] == pytest.approx(1.0)


def test_a_box_at_iou_0_63_counts_at_0_5_but_not_at_0_75():
    # shifted 23 px across a 100 px box: IoU 77/123 = 0.626, a match at thresholds 0.50,
    # 0.55 and 0.60 of COCO's ten: 3/10 for its class; the other class is perfect
    shifted = [[(23, 0, 123, 100, 0, 0.9), (150, 150, 200, 220, 1, 0.9)],
               [(10, 20, 60, 90, 1, 0.8)]]
    out = figures(shifted)
    assert out["map_50"] == pytest.approx(1.0)
    assert out["map_75"] == pytest.approx(0.5)  # class 0 at 0, class 1 at 1
    assert out["map"] == pytest.approx((0.3 + 1.0) / 2)


def test_a_false_positive_counts_only_when_it_outranks_the_match():
    truth = [[(0, 0, 100, 100, 0)]]
    below = [[(0, 0, 100, 100, 0, 0.9), (300, 300, 350, 350, 0, 0.5)]]
    above = [[(0, 0, 100, 100, 0, 0.5), (300, 300, 350, 350, 0, 0.9)]]
    assert figures(below, truth)["map_50"] == pytest.approx(1.0)
    # precision 1/2 at recall 1, and COCO's interpolation keeps 1/2 at every recall point
    assert figures(above, truth)["map_50"] == pytest.approx(0.5)
    wrong_class = [[(0, 0, 100, 100, 1, 0.9)]]
    assert figures(wrong_class, truth)["map_50"] == pytest.approx(0.0)


def test_the_figure_is_the_epochs_not_a_mean_of_its_batches():
    metric = DetectionMAP()
    truth = [[(0, 0, 100, 100, 0)], [(0, 0, 50, 50, 0)]]
    # batch 1 finds its box (alone: AP 1); batch 2 misses its box with a confident false
    # positive (alone: AP 0). Together: FP 0.9 then TP 0.8 of 2 boxes: precision 1/2 up to
    # recall 1/2, so 51 of COCO's 101 recall points at 1/2
    metric.update(padded([[(0, 0, 100, 100, 0, 0.8)]], True), padded(truth[:1], False))
    metric.update(padded([[(200, 200, 260, 260, 0, 0.9)]], True), padded(truth[1:], False))
    assert metric.images == 2
    assert metric.compute()["map_50"] == pytest.approx(0.5 * 51 / 101)
    metric.reset()
    assert all(math.isnan(v) for v in metric.compute().values())


def test_images_without_boxes_count_and_nothing_to_measure_is_nan():
    truth = [[(0, 0, 100, 100, 0)], []]
    # the empty image's detection outranks the match: a false positive
    preds = [[(0, 0, 100, 100, 0, 0.5)], [(10, 10, 40, 40, 0, 0.9)]]
    assert figures(preds, truth)["map_50"] == pytest.approx(0.5)
    assert math.isnan(figures([[]], [[]])["map"])


def test_without_torchmetrics_the_metric_is_unavailable_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchmetrics.detection", None)
    with pytest.raises(Unavailable, match=r"\.\[detection\]"):
        DetectionMAP()


# --- the figures of every rank's images (issue 64) ------------------------------------------

# five images: (x1, y1, x2, y2, label[, score]) rows, their detections near misses and hits
SPLIT_TRUTH = [[(0, 0, 40, 40, 0)], [(10, 10, 50, 60, 1), (60, 60, 90, 90, 0)],
               [(5, 5, 30, 25, 1)], [], [(20, 20, 70, 70, 0)]]
SPLIT_PREDS = [[(2, 0, 40, 42, 0, 0.9), (50, 50, 60, 60, 1, 0.3)],
               [(10, 12, 52, 60, 1, 0.8), (61, 58, 90, 92, 0, 0.55)],
               [(5, 5, 20, 25, 1, 0.7)], [(1, 1, 9, 9, 0, 0.6)],
               [(22, 20, 70, 66, 0, 0.45), (0, 0, 10, 10, 1, 0.35)]]


def split_figures(order: list[int]) -> tuple[dict[str, float], int]:
    """The five images fed one by one in ``order``, each with its index."""
    metric = DetectionMAP()
    for i in order:
        metric.update(padded([SPLIT_PREDS[i]], True), padded([SPLIT_TRUTH[i]], False),
                      torch.tensor([i]))
    return metric.compute(), metric.counted


def test_images_given_with_their_indices_score_the_same_in_any_order():
    """What a gathered split relies on: its images in the dataset's order again, so the
    figures equal one process's to the bit (COCO's ranking of tied scores follows the
    images' order)."""
    straight, counted = split_figures([0, 1, 2, 3, 4])
    assert counted == 5 and 0 < straight["map"] < 1
    assert split_figures([3, 1, 4, 0, 2])[0] == straight


def _split_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    import torchmetrics.metric

    def own_sync(*args, **kwargs):  # each rank's images would be gathered a second time
        raise AssertionError("torchmetrics' own sync ran")

    torchmetrics.metric.gather_all_tensors = own_sync  # (a spawned process: its own copy)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        mine = [0, 2, 4] if rank == 0 else [1, 3]  # three images and two: uneven
        figures, counted = split_figures(mine)
        torch.save({"figures": figures, "counted": counted}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.process
@pytest.mark.ranks
def test_two_ranks_holding_uneven_shares_get_the_figures_of_every_image(tmp_path):
    """Three images on rank 0 and two on rank 1 (a split that does not divide by the
    world): each rank gets the figures one process gets from all five, gathered once.
    torchmetrics' own sync gathered one collective per image and gloo aborted ("Received
    data size doesn't match expected size"); left on beside the gather, it would have
    counted every image twice (a tie-heavy detector's mAP moved: 7.10e-5 to 6.84e-5)."""
    import torch.multiprocessing as mp

    from tests.launch.test_distributed import free_port

    out = str(tmp_path / "rank")
    mp.spawn(_split_rank, args=(free_port(), out), nprocs=2)
    alone, _ = split_figures([0, 1, 2, 3, 4])
    for rank in (0, 1):
        got = torch.load(f"{out}.{rank}", weights_only=False)
        assert got["counted"] == 5
        assert got["figures"] == alone
