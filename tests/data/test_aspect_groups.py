"""``loader.group_aspect``: batches of one aspect-ratio bin (torchvision's
GroupedBatchSampler, ultralytics' rect), every image once per epoch, the order a function
of the seed and epoch (a resume reads the rest of the same epoch), on one rank or several."""

from __future__ import annotations

import bisect
from pathlib import Path

import pytest
import torch

from runner.data.order import BatchOrder, aspect_bins, unpad


def test_bins_are_torchvisions_quantization():
    """torchvision's references: ``bins = 2 ** linspace(-1, 1, 2k + 1)``, then
    ``bisect_right(sorted(bins), w / h)`` per image."""
    sizes = [(100, 400), (100, 200), (100, 150), (100, 100), (150, 100), (300, 100),
             (100, 126), (100, 125), (0, 0)]
    edges = sorted((2 ** torch.linspace(-1, 1, 7)).tolist())
    expected = [bisect.bisect_right(edges, w / h) if h else bisect.bisect_right(edges, 1.0)
                for h, w in sizes]
    assert aspect_bins(sizes).tolist() == expected
    assert len(set(expected)) >= 5


def orders(bins, batch, world, drop_last, shuffle=True, seed=7):
    return [BatchOrder(len(bins), batch, shuffle=shuffle, drop_last=drop_last, seed=seed,
                       rank=r, world=world, bins=bins) for r in range(world)]


def epoch_rows(order: BatchOrder, epoch: int, skip: int = 0) -> list[list[int]]:
    order.set_epoch(epoch, skip)
    return [row.tolist() for row in order.batches()]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_batch_is_one_bin_and_every_image_read_once(world, drop_last, shuffle):
    g = torch.Generator().manual_seed(0)
    bins = torch.randint(0, 5, (203,), generator=g)
    ranks = orders(bins, 6, world, drop_last, shuffle)
    for epoch in range(3):
        per_rank = [epoch_rows(o, epoch) for o in ranks]
        assert {len(rows) for rows in per_rank} == {len(ranks[0])}  # same steps everywhere
        seen = []
        for step in range(len(ranks[0])):
            step_bins = set()
            for rows in per_rank:
                row = rows[step]
                assert 0 < len(row) <= 6
                real = [unpad(i)[0] for i in row]
                step_bins |= set(bins[real].tolist())
                seen += [i for i in row if i >= 0]
            assert len(step_bins) == 1  # a global batch of one bin, on every rank
        assert len(seen) == len(set(seen))  # no image twice
        if not drop_last:
            assert sorted(seen) == list(range(len(bins)))  # every image once
        else:
            assert all(len(rows[s]) == 6 for rows in per_rank for s in range(len(rows)))


def test_the_order_is_a_function_of_seed_and_epoch_and_resumes_exactly():
    bins = aspect_bins([(100, 60 + 7 * (k % 13)) for k in range(150)])
    assert len(torch.unique(bins)) >= 3
    first, again = orders(bins, 8, 1, False)[0], orders(bins, 8, 1, False)[0]
    epoch2 = epoch_rows(first, 2)
    assert epoch_rows(again, 2) == epoch2  # a fresh order: the same epoch
    assert epoch_rows(again, 3) != epoch2  # another epoch: another order
    resumed = orders(bins, 8, 1, False)[0]
    assert epoch_rows(resumed, 2, skip=5) == epoch2[5:]  # a resume at step 5
    assert epoch_rows(orders(bins, 8, 1, False, seed=8)[0], 2) != epoch2
    # several ranks: the global batch of a step is the same set whatever the world size
    one = epoch_rows(orders(bins, 8, 1, True)[0], 1)
    two = [epoch_rows(o, 1) for o in orders(bins, 4, 2, True)]
    assert [sorted(r) for r in one] == [sorted(a + b) for a, b in zip(*two)]


def test_the_loader_groups_a_detection_folder_and_refuses_what_it_cannot(tmp_path: Path):
    from runner.common.errors import ConfigError
    from runner.data import build_data_path
    from runner.job.compose import compose
    from tests.data.decode.test_letterbox import coco_set

    coco_set(tmp_path / "coco")  # 150x90, 90x160, 100x100, 130x70: three bins
    base = [f"dataset.path={tmp_path / 'coco'}", "dataset.targets=coco", "loader=folder",
            "dataset.image_size=[32,32]", "loader.batch_size=2", "loader.group_aspect=true",
            f"dataset.cache_dir={tmp_path / 'cache'}", "loader.decoder=pil", "task.name=train",
            "loader.drop_last=false"]  # every image, the short batches of each bin too
    config = compose(base)
    data = build_data_path(config, torch.device("cpu"), epochs=2, progress=False)
    try:
        sizes = {i: data.storage.targets.source_size(i) for i in range(len(data.storage))}
        bins = aspect_bins([sizes[i] for i in range(len(sizes))])
        counted = []
        for batch in data:
            index = batch["index"].tolist()
            assert len(set(bins[index].tolist())) == 1, index
            counted += index
        assert sorted(counted) == sorted(list(range(4)) * 2)
    finally:
        data.close()
    with pytest.raises(ConfigError, match="dataset.crop=center"):
        compose([*base, "dataset.crop=center"])
    plain = tmp_path / "plain" / "a"
    plain.mkdir(parents=True)
    for k in range(3):
        (plain / f"{k}.jpg").write_bytes((tmp_path / "coco" / "val2017" / "a.jpg").read_bytes())
    with pytest.raises(ConfigError, match="detection labels"):
        build_data_path(compose([f"dataset.path={tmp_path / 'plain'}", "loader=folder",
                                 "loader.group_aspect=true", "dataset.crop=whole",
                                 f"dataset.cache_dir={tmp_path / 'cache'}"]),
                        torch.device("cpu"), epochs=1, progress=False)
