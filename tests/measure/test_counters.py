"""The system's counters (runner/measure/counters.py): read from /proc, checked against what
a run did: a cold file set read from disk, more workers than cores."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from runner.measure import counters
from runner.measure.metrics import problems
from tests.conftest import SMALL_DATASET, run_in_process

pytestmark = pytest.mark.skipif(not Path("/proc/self/io").exists(),
                                reason="no /proc/<pid>/io here (not Linux, or no task I/O accounting)")

FIELDS = ("iowait_frac", "ctx_switches_per_sec", "ctx_switches_involuntary_per_sec",
          "page_faults_major_per_sec", "page_faults_minor_per_sec", "disk_read_bytes",
          "disk_read_mb_per_sec", "main_cpu", "worker_cpu", "peak_rss_bytes",
          "workers_peak_rss_bytes")


def cold_files(folder: Path, count: int = 8, size: int = 2 << 20) -> list[Path]:
    """Files written, synced and dropped from the page cache: a read goes to the disk."""
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for k in range(count):
        path = folder / f"f{k}.bin"
        with open(path, "wb") as f:
            f.write(os.urandom(size))
            f.flush()
            os.fsync(f.fileno())
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        files.append(path)
    return files


def test_a_cold_read_counts_its_bytes_and_every_field(tmp_path: Path):
    files = cold_files(tmp_path / "cold")
    before = counters.sample()
    for path in files:
        path.read_bytes()
    figures = counters.delta(before, counters.sample()).figures()
    assert set(FIELDS) <= set(figures)
    # the page cache held none of it: what was read came from the block device
    assert figures["disk_read_bytes"] >= sum(p.stat().st_size for p in files) // 2
    assert figures["peak_rss_bytes"] > 0
    if not figures["iowait_frac"]:
        pytest.skip("iowait was 0: the disk served 16 MB faster than a 10 ms tick "
                    "(bytes read counted all the same)")
    assert figures["iowait_frac"] > 0


def test_counts_add_up_over_windows_and_peaks_stay_peaks():
    a = counters.Counts(seconds=1.0, main={"ctx_voluntary": 10, "peak_rss_bytes": 5},
                        iowait_ticks=1, all_ticks=10, known=True)
    b = counters.Counts(seconds=1.0, main={"ctx_voluntary": 30, "peak_rss_bytes": 3},
                        workers={"7": {"cpu_seconds": 1.0}}, iowait_ticks=3, all_ticks=10,
                        known=True)
    a.add(b)
    figures = a.figures()
    assert figures["ctx_switches_per_sec"] == 20 and figures["peak_rss_bytes"] == 5
    assert figures["iowait_frac"] == pytest.approx(0.2)
    assert figures["worker_cpu"] == [0.5]
    assert counters.Counts().figures() == {}  # nothing counted: no figure


def test_gpu_counters_are_skipped_with_a_reason_off_cuda():
    import torch

    assert counters.open_nvml(torch.device("cpu")) == (None, None)


BASE = [*SMALL_DATASET, "logger=none", "model=none", "diagnose=false", "run.window_seconds=0"]


@pytest.mark.slow
def test_a_cold_page_cache_run_reads_from_disk(tmp_path: Path, cache_dir: Path):
    m = run_in_process(*BASE, "dataset.page_cache=cold", "run.steps=24", "run.timeline=true",
                       run_dir=tmp_path / "run")
    assert problems(m) == []
    assert set(FIELDS) <= set(m)
    if m.get("page_cache") != "cold":
        pytest.skip(f"the page cache could not be made cold here: {m.get('page_cache_note')}")
    assert m["disk_read_bytes"] > 0  # the evicted files were read again, from the disk
    # the timeline has the counters as a lane, and the trace as counter tracks
    data = json.loads((tmp_path / "run" / "timeline.json").read_text())
    assert data["counters"] and "MB/s read" in data["counters"][0]["label"]
    trace = json.loads((tmp_path / "run" / "timeline.trace.json").read_text())
    assert any(e["ph"] == "C" and e["name"] == "disk_read_bytes" for e in trace["traceEvents"])


@pytest.mark.slow
def test_more_workers_than_cores_switch_context_more(tmp_path: Path, cache_dir: Path):
    """Worker processes beyond the cores are preempted: their involuntary context switches
    count, where a loop beside one decode thread (fewer threads than cores) is not switched
    out. (The total of voluntary and involuntary switches was no measure of it: the decode
    threads' hand-offs made as many a second, and the comparison failed one run in two.)"""
    cores = len(os.sched_getaffinity(0))
    many = 2 * cores + 2
    rates = {}
    for workers, extra in ((0, "loader.decode_threads=1"), (many, f"loader.num_workers={many}")):
        m = run_in_process(*BASE, f"loader.num_workers={workers}", extra, "run.steps=40",
                           run_dir=tmp_path / f"w{workers}")
        rates[workers] = m["ctx_switches_involuntary_per_sec"]
        assert len(m["worker_cpu"]) == workers
    assert rates[many] > rates[0], rates


@pytest.mark.process
def test_context_switches_count_every_thread_of_the_process():
    """A run's decode threads switch context as much as its loop: their switches count
    (/proc/self/status alone counts the main thread's), those of threads that have ended
    included; a child process's threads are summed from its tasks."""
    import subprocess
    import sys
    import threading
    import time

    before = counters.process("self")["ctx_voluntary"]

    def sleeper():
        for _ in range(300):
            time.sleep(0.0002)

    threads = [threading.Thread(target=sleeper) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()  # ended: their counts stay in the process's
    assert counters.process("self")["ctx_voluntary"] - before >= 2 * 300
    code = ("import threading, time, sys\n"  # two threads that switch, alive till stdin ends
            "done = threading.Event()\n"
            "def f():\n    [time.sleep(0.0002) for _ in range(300)]\n    done.wait()\n"
            "ts = [threading.Thread(target=f) for _ in range(2)]\n"
            "[t.start() for t in ts]\nsys.stdin.read()\ndone.set()\n[t.join() for t in ts]\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while counters.process(child.pid)["ctx_voluntary"] < 2 * 300:
            assert time.monotonic() < deadline, counters.process(child.pid)
            time.sleep(0.05)
    finally:
        child.communicate(b"")


def test_each_window_the_loop_logs_carries_the_counters():
    """What the loop logs per window (wandb's window/ history) and adds up for metrics.json."""
    import time

    import torch

    from runner.measure.clock import SHARED_SAMPLE_SECONDS, StepClock

    clock = StepClock(torch.device("cpu"))
    time.sleep(SHARED_SAMPLE_SECONDS)
    clock.open_window()
    clock.step_done(8)
    time.sleep(SHARED_SAMPLE_SECONDS * 1.5)
    figures = clock.close_window().figures()
    assert set(FIELDS) <= set(figures)
    assert figures["worker_cpu"] == [] and figures["peak_rss_bytes"] > 0
