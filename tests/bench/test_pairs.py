"""``python -m runner.bench pairs``: detection's pairs from the folder against the one-file
stores, on the same images and boxes, cold and warm (no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.bench.cli import main
from runner.bench.pairs import pair_stores
from runner.config.schema import StorageName


def test_the_pairs_compare_the_folder_with_every_one_file_store_that_carries_boxes():
    stores = pair_stores()
    assert stores[0] is StorageName.folder and StorageName.packed in stores
    assert StorageName.memmap not in stores  # decoded once: not a pairs-per-epoch reader


@pytest.mark.slow
def test_the_pairs_bench_reads_the_same_images_and_boxes_from_every_store(tmp_path: Path,
                                                                         capsys):
    status = main(["pairs", "--images", "40", "--height", "96", "--width", "128",
                   "--size", "64", "--batch-size", "8", "--rounds", "1",
                   "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "out")])
    assert status in (0, 1)  # 1: a target missed, which a loaded machine may do
    printed = capsys.readouterr().out
    result = json.loads(next((tmp_path / "out").glob("pairs-*.json")).read_text())
    (round_,) = result["rounds"]
    stores = [s.value for s in pair_stores()]
    assert {key.split("/")[0] for key in round_} == set(stores)
    read = {(r["images"], r["boxes"]) for r in round_.values()}
    assert len(read) == 1  # every store, cold or warm: the same images and boxes
    ((images, boxes),) = read
    assert images == 32 and boxes > 0  # the train split of 40 (val_fraction 0.2)
    assert len(result["targets"]) == 2 * (len(stores) - 1)
    assert "packed / folder, warm page cache" in printed
