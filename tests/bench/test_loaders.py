"""``python -m runner.bench loaders`` section 5 / ``bench overhead``: which loop is fastest,
every loop on the same items, each with its cost per batch (no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.bench.cli import main
from runner.bench.loaders import LOOPS, per_batch_overhead


def test_every_loop_is_timed_on_the_same_items_with_its_cost_per_batch():
    o = per_batch_overhead(n=2_000, batch_size=50, repeats=1, workers=1)
    assert o["items"] == 2_000 and o["batch_size"] == 50 and o["workers"] == 1
    for key, _ in LOOPS:
        assert o[key] > 0
        assert o["per_batch_us"][key] == pytest.approx(1e6 * o[key] / 40)  # 40 batches


@pytest.mark.slow
def test_the_overhead_bench_prints_every_loops_row(tmp_path: Path, capsys):
    main(["overhead", "--items", "3000", "--batch-size", "30", "--rounds", "1",
          "--workers", "1", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    for _, what in LOOPS:
        assert what in printed
    result = json.loads(next(tmp_path.glob("overhead-*.json")).read_text())
    (round_,) = result["rounds"]
    assert set(round_["per_batch_us"]) == {key for key, _ in LOOPS}
