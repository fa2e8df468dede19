"""``python -m runner.bench infer``'s ablation: every change has its row, in order, and the
shares of the gain add up (no timing is asserted: this box's figures are noise)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.bench.ablation import NAIVE, Row, chain, shares, user_models


def test_shares_are_each_rows_gain_over_the_one_before_and_add_up():
    rows = [Row("a", [], [10.0, 12.0, 11.0]), Row("b", [], [30.0, 31.0, 29.0]),
            Row("c", [], [25.0, 26.0, 27.0]), Row("d", [], [61.0, 59.0, 60.0])]
    table = shares(rows)
    assert [t["images_per_sec"] for t in table] == [11.0, 30.0, 26.0, 60.0]
    assert [t["gain"] for t in table] == [0.0, 19.0, -4.0, 34.0]
    assert table[0]["share"] is None and (table[1]["min"], table[1]["max"]) == (29.0, 31.0)
    assert sum(t["share"] for t in table[1:]) == pytest.approx(1.0)
    assert table[2]["share"] == pytest.approx(-4 / 49)  # a change that cost speed
    assert all(t["share"] is None for t in shares([Row("a", [], [5.0]), Row("b", [], [5.0])]))
    # b's rounds (29-31) clear a's (10-12); c's (25-27) do not overlap b's either; a row
    # whose range meets the one above's is within the noise
    assert [t["within_noise"] for t in table] == [False, False, False, False]
    noisy = shares([Row("a", [], [10.0, 20.0]), Row("b", [], [18.0, 30.0])])
    assert noisy[1]["within_noise"]


def test_the_users_own_models_are_told_from_the_stand_ins():
    assert user_models(["model=resnet50"]) and user_models(["model.weights=/m.pt"])
    assert user_models(["models=[resnet18,resnet50]"]) and user_models(["+models=[a]"])
    assert not user_models(["dataset.path=/data", "loader=memmap"])


@pytest.mark.slow  # seven rows, six of them runner jobs in subprocesses
def test_the_ablation_runs_every_row_on_the_users_model(tmp_path: Path, capsys):
    from runner.bench.cli import main

    status = main(["infer", "--part", "ablation", "--size", "32", "--batch-size", "4",
                   "--images", "16", "--rounds", "1", "--seconds", "0.5", "--workers", "1",
                   "--compile", "torchscript", "--outputs", "topk", "--out", str(tmp_path),
                   "model=tiny", "dataset.num_images=24", "dataset.num_classes=3",
                   "dataset.source_size=[40,48]"])
    assert status == 0
    printed = capsys.readouterr().out
    names = [r.name for r in chain(4, 1, 2, "torchscript")]
    assert names[0] == NAIVE and len(names) == 7
    for name in names:
        assert name in printed
    result = json.loads(next(tmp_path.glob("infer-*.json")).read_text())
    table = result["ablation"]["rows"]
    assert [t["row"] for t in table] == names
    assert result["ablation"]["models"] == ["tiny"]
    for t in table:
        assert len(t["rounds"]) == 1 and t["images_per_sec"] > 0
    medians = [t["images_per_sec"] for t in table]
    assert sum(t["gain"] for t in table) == pytest.approx(medians[-1] - medians[0])
    assert sum(t["share"] for t in table[1:]) == pytest.approx(1.0)
