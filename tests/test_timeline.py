"""timeline.png/json: every process's stages over a few steps after warm-up."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from runner import timeline
from tests.conftest import SMALL_DATASET, read_metrics, run_cli

PNG = b"\x89PNG\r\n\x1a\n"


def test_spans_are_recorded_only_when_enabled_and_clipped_to_the_window(tmp_path: Path):
    timeline.disable()
    with timeline.span("decode"):
        pass
    assert timeline.collect(0, float("inf")) == []  # off: nothing recorded
    timeline.enable(tmp_path / ".t")
    try:
        t0 = time.perf_counter()
        timeline.record("wait", t0, t0 + 0.010)
        timeline.record("step", t0 + 0.010, t0 + 0.030)
        timeline.record("decode", t0 - 1.0, t0 - 0.5)  # long before the steps shown
        out = timeline.write(tmp_path, [(t0, t0 + 0.030)], 0, "test")
        data = json.loads((tmp_path / "timeline.json").read_text())
        assert [s["stage"] for s in data["spans"]] == ["wait", "step"]
        assert data["spans"][1]["start"] == pytest.approx(10.0, abs=1e-6)
        assert out["timeline_busy"]["main"] == pytest.approx(1.0)
        assert (tmp_path / "timeline.png").read_bytes()[:8] == PNG
    finally:
        timeline.disable()


@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "lanes", "stages"), [
    (["loader.num_workers=2"], {"worker 0", "worker 1", "main"},
     {"read", "decode", "collate", "wait", "copy", "step"}),
    (["loader=memmap", "prefetch=cpu"], {"main", "main/prefetch"}, {"gather", "wait", "step"}),
])
def test_a_run_draws_each_process_and_thread_as_a_lane(tmp_path: Path, cache_dir: Path,
                                                       overrides, lanes, stages):
    run_cli(*SMALL_DATASET, *overrides, "logger=none", "diagnose=false", "run.steps=10",
            "hydra.run.dir=run", cwd=tmp_path)
    m = read_metrics(tmp_path / "run")
    data = json.loads(Path(m["timeline_json"]).read_text())
    assert {s["lane"] for s in data["spans"]} == lanes
    assert stages <= {s["stage"] for s in data["spans"]}
    assert len(data["steps"]) == 4  # a few consecutive steps after warm-up
    assert Path(m["timeline"]).read_bytes()[:8] == PNG
    assert not (tmp_path / "run" / ".timeline").exists()  # the workers' scratch is gone


@pytest.mark.parametrize("lanes", [1, 4])
def test_the_legend_never_covers_the_axis_label(lanes: int):
    names = [f"lane {k}" for k in range(lanes)]
    data = {"title": "test", "steps": [(0.0, 10.0), (10.0, 20.0)],
            "spans": [{"lane": n, "stage": s, "start": 2.0 * k, "end": 2.0 * k + 1.5}
                      for n in names for k, s in enumerate(("wait", "copy", "step", "decode"))]}
    fig = timeline.figure(data, names)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (ax,) = fig.axes
    legend = ax.get_legend().get_window_extent(renderer)
    for text in (ax.xaxis.label, *ax.get_xticklabels(), *ax.get_yticklabels()):
        assert not legend.overlaps(text.get_window_extent(renderer)), text.get_text()
    import matplotlib.pyplot as plt

    plt.close(fig)
