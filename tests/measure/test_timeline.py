"""timeline.png/json: every process's stages over a few steps after warm-up."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from runner.measure import timeline
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


@pytest.mark.process
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
    trace = json.loads(Path(m["timeline_trace"]).read_text())  # the same lanes, for Perfetto
    # the same lanes, and the system's counters' lane (runner/measure/counters.py)
    assert {e["args"]["name"] for e in trace["traceEvents"]
            if e["name"] == "thread_name"} - {"counters"} == lanes
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


class StandInEvent:
    """A CUDA timing event as the timeline reads it: the device time it ran at (s)."""

    def __init__(self, at: float):
        self.at = at

    def elapsed_time(self, later: StandInEvent) -> float:
        return (later.at - self.at) * 1e3  # ms, as torch.cuda.Event's


def test_the_copy_and_compute_streams_are_drawn_as_lanes_of_their_own(tmp_path: Path,
                                                                    monkeypatch):
    """Device spans (stand-in events: this test runs without CUDA) become two lanes below
    the host's, at the host times the anchor maps them to, resolved only at the end."""
    timeline.enable(tmp_path / ".t")
    try:
        t0 = time.perf_counter()
        # the anchor ran at device time 100 s, host time t0: device time d is host t0 + d - 100
        monkeypatch.setitem(timeline._anchor, "event", StandInEvent(100.0))
        monkeypatch.setitem(timeline._anchor, "host", t0)
        timeline.record("wait", t0, t0 + 0.002)
        timeline.record("step", t0 + 0.002, t0 + 0.003)  # the launch, on the host
        for k in range(2):  # the next batch's copy overlaps this step's compute
            a = 100.0 + 0.010 * k
            timeline.record_device(timeline.COPY_STREAM, "copy", StandInEvent(a + 0.001),
                                   StandInEvent(a + 0.004))
            timeline.record_device(timeline.COMPUTE_STREAM, "compute",
                                   StandInEvent(a + 0.004), StandInEvent(a + 0.009))
        assert len(timeline._device) == 4  # kept as events until the timeline is drawn
        out = timeline.write(tmp_path, [(t0, t0 + 0.010), (t0 + 0.010, t0 + 0.020)], 0, "t")
        data = json.loads((tmp_path / "timeline.json").read_text())
        lanes = [s["lane"] for s in data["spans"]]
        assert {timeline.COPY_STREAM, timeline.COMPUTE_STREAM, "main"} == set(lanes)
        copies = [s for s in data["spans"] if s["lane"] == timeline.COPY_STREAM]
        computes = [s for s in data["spans"] if s["lane"] == timeline.COMPUTE_STREAM]
        assert [(s["start"], s["end"]) for s in copies] == [
            pytest.approx((1.0, 4.0)), pytest.approx((11.0, 14.0))]
        assert [s["stage"] for s in computes] == ["compute", "compute"]
        assert computes[1]["start"] == pytest.approx(14.0)
        assert out["timeline_busy"][timeline.COMPUTE_STREAM] == pytest.approx(0.5)
        # drawn below the host's lanes: workers, main, then copy and compute
        order = sorted(["worker 0", timeline.COMPUTE_STREAM, "main", timeline.COPY_STREAM],
                       key=timeline._lane_order)
        assert order == ["worker 0", "main", timeline.COPY_STREAM, timeline.COMPUTE_STREAM]
        assert (tmp_path / "timeline.png").read_bytes()[:8] == PNG
    finally:
        timeline.disable()
    assert timeline._device == [] and timeline._anchor == {}


def test_a_cpu_run_records_no_device_lane(tmp_path: Path):
    from types import SimpleNamespace

    from runner.tasks.loop import StepTrace

    timeline.enable(tmp_path / ".t")
    try:
        result = SimpleNamespace(warmup_steps=0, steps=0, step_spans=[])
        trace = StepTrace(result, augments=False)
        t0 = time.perf_counter() - 1.0  # the step ends when it is recorded
        trace.record(t0, t0 + 0.001, t0 + 0.002, t0 + 0.003)  # no events: the CPU
        assert timeline._device == [] and timeline._anchor == {}
        assert {s[1] for s in timeline.collect(0, float("inf"))} == {"wait", "copy", "step"}
    finally:
        timeline.disable()


@pytest.mark.process
@pytest.mark.cuda
def test_a_cuda_run_draws_its_copy_and_compute_streams(tmp_path: Path, cache_dir: Path):
    run_cli(*SMALL_DATASET, "prefetch=gpu", "loader=memmap", "logger=none",
            "diagnose=false", "run.steps=12", "hydra.run.dir=run", cwd=tmp_path)
    m = read_metrics(tmp_path / "run")
    data = json.loads(Path(m["timeline_json"]).read_text())
    by_lane = {}
    for s in data["spans"]:
        by_lane.setdefault(s["lane"], []).append(s)
    copies = [s for s in by_lane[timeline.COPY_STREAM] if s["stage"] == "copy"]
    computes = [s for s in by_lane[timeline.COMPUTE_STREAM] if s["stage"] == "compute"]
    assert copies and len(computes) >= 3
    end = data["steps"][-1][1]
    for s in copies + computes:  # resolved onto the host's clock, inside the steps shown
        assert -1.0 <= s["start"] <= s["end"] <= end + 1.0
    assert Path(m["timeline"]).read_bytes()[:8] == PNG


def test_the_timeline_is_also_a_chrome_trace_with_a_named_thread_per_lane(tmp_path: Path,
                                                                          monkeypatch):
    """timeline.trace.json: one complete event per span of timeline.json (µs, never
    negative), a named thread per lane, the GPU's streams a process of their own; declared
    in metrics.json's schema."""
    from runner.measure.metrics import problems

    timeline.enable(tmp_path / ".t")
    try:
        t0 = time.perf_counter()
        monkeypatch.setitem(timeline._anchor, "event", StandInEvent(100.0))
        monkeypatch.setitem(timeline._anchor, "host", t0)
        timeline.record("wait", t0 - 0.001, t0 + 0.002)  # begins before the first step
        timeline.record("step", t0 + 0.002, t0 + 0.006)
        timeline.record("model", t0 + 0.002, t0 + 0.004, sub="model a")
        timeline.record_device(timeline.COPY_STREAM, "copy", StandInEvent(100.001),
                               StandInEvent(100.003))
        timeline.record_device(timeline.COMPUTE_STREAM, "compute", StandInEvent(100.003),
                               StandInEvent(100.008))
        out = timeline.write(tmp_path, [(t0, t0 + 0.010)], 0, "a title")
    finally:
        timeline.disable()
    spans = json.loads((tmp_path / "timeline.json").read_text())["spans"]
    assert out["timeline_trace"] == str(tmp_path / "timeline.trace.json")
    trace = json.loads(Path(out["timeline_trace"]).read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(spans) == 5
    for e, s in zip(events, spans):
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid"} <= set(e)
        assert e["name"] == s["stage"] and e["ts"] >= 0 and e["dur"] >= 0
        assert e["ts"] == pytest.approx(s["start"] * 1e3)  # µs, timeline.json's ms
        assert e["dur"] == pytest.approx((s["end"] - s["start"]) * 1e3)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
               if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(threads.values()) == sorted({s["lane"] for s in spans})
    lane_of = {(e["pid"], e["tid"]): threads[(e["pid"], e["tid"])] for e in events}
    assert [lane_of[(e["pid"], e["tid"])] for e in events] == [s["lane"] for s in spans]
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
                 if e["ph"] == "M" and e["name"] == "process_name"}
    assert processes[next(p for (p, _), n in threads.items() if n == "main/model a")] == "main"
    gpu = {p for (p, _), n in threads.items() if n in timeline.DEVICE_LANES}
    assert len(gpu) == 1 and processes[gpu.pop()] == "GPU"
    assert {p for p, _ in threads} == set(processes)  # every lane in a named process
    assert problems({"timeline_trace": out["timeline_trace"]}) == []


class NvtxSpy:
    def __init__(self):
        self.calls: list[str] = []

    def push(self, name: str) -> int:
        self.calls.append(f"+{name}")
        return 0

    def pop(self) -> int:
        self.calls.append("-")
        return 0


@pytest.mark.parametrize("cuda", [True, False])
def test_stages_are_nvtx_ranges_only_where_cuda_is_available(tmp_path: Path, monkeypatch,
                                                             cuda: bool):
    """Where CUDA is available the loop's stages (as the timeline names them) and the
    spans are NVTX ranges, balanced; where it is not, NVTX is never called."""
    import torch

    from runner.measure.profile import stage_range

    spy = NvtxSpy()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", spy.push)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", spy.pop)
    monkeypatch.setitem(timeline._state, "nvtx", None)  # asked again under the patch
    stage = stage_range(False)
    for name in ("data_wait", "copy", "compute"):
        with stage(name):
            pass
    timeline.enable(tmp_path / ".t")
    try:
        with timeline.span("collate"):
            pass
    finally:
        timeline.disable()
    if cuda:
        assert spy.calls == ["+wait", "-", "+copy", "-", "+step", "-", "+collate", "-"]
    else:
        assert spy.calls == []
    timeline._state["nvtx"] = None  # the next test asks the real torch


@pytest.mark.cuda
def test_a_cuda_run_marks_its_stages_as_nvtx_ranges(tmp_path: Path, cache_dir: Path,
                                                    monkeypatch):
    import torch

    from tests.conftest import run_in_process

    pushed: list[str] = []
    push, pop = torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
    depth = [0]

    def spy_push(name: str):
        pushed.append(name)
        depth[0] += 1
        return push(name)  # the real NVTX call: it must not fail on a real device

    def spy_pop():
        depth[0] -= 1
        return pop()

    monkeypatch.setattr(torch.cuda.nvtx, "range_push", spy_push)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", spy_pop)
    m = run_in_process(*SMALL_DATASET, "device=cuda", "loader=memmap", "prefetch=cpu",
                       "logger=none", "diagnose=false", "run.steps=6", run_dir=tmp_path / "run")
    assert m["status"] == "ok"
    assert {"wait", "copy", "step", "gather"} <= set(pushed) and depth[0] == 0
    trace = json.loads(Path(m["timeline_trace"]).read_text())
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {timeline.COMPUTE_STREAM, "main"} <= lanes
