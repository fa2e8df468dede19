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


def test_both_benches_print_one_measurement_of_the_overhead(monkeypatch, capsys):
    """``bench overhead`` and ``bench loaders`` (section 5, its targets) quote the figure of
    one function, ``overhead_figure``, with the same defaults: never two figures 2x apart."""
    import argparse

    from runner.bench import loaders, overhead
    from runner.bench.cli import command_line

    figure = loaders.overhead_figure(items=1_000, batch_size=50, rounds=2, repeats=1,
                                     workers=1)
    assert len(figure["rounds"]) == 2
    assert figure["ratio"]["min"] <= figure["ratio"]["median"] <= figure["ratio"]["max"]
    ratios = [o["dataloader_s"] / o["runner_s"] for o in figure["rounds"]]
    assert figure["ratio"]["median"] == pytest.approx(sum(ratios) / 2)
    # the overhead bench's defaults are the loaders bench's section 5
    args = command_line().parse_args(["overhead"])
    assert (args.items, args.batch_size, args.rounds, args.workers) == (
        loaders.OVERHEAD_ITEMS, loaders.OVERHEAD_BATCH, loaders.OVERHEAD_ROUNDS,
        loaders.OVERHEAD_WORKERS)
    calls = []
    monkeypatch.setattr(loaders, "overhead_figure", lambda *a, **k: calls.append(a) or figure)
    monkeypatch.setattr(overhead, "overhead_figure", loaders.overhead_figure)
    out = overhead.bench_overhead(argparse.Namespace(items=1_000, batch_size=50, rounds=2,
                                                     workers=1))
    assert out["targets"][0]["median"] == figure["ratio"]["median"] and calls
    (check,) = [c for c in loaders.loader_targets({"rates": {"per_item_dataloader": 1.0,
                                                             "naive_folder": 1.0},
                                                   "overhead": figure})
                if "per-batch overhead" in c[0]]
    assert check[1] == figure["ratio"]["median"]
    printed = capsys.readouterr().out
    assert printed.count("runner batched / DataLoader, per-batch overhead") == 1
