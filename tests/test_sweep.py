"""Sweeps, the report, the bottleneck verdict and the profiler."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest

from runner.report import main as report_main
from runner.report import write_report
from tests.conftest import SMALL_DATASET, read_metrics, run_cli, wandb_records

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_sweep_survives_skips_and_failures_and_reports(tmp_path: Path, cache_dir: Path):
    proc = run_cli("-m", *SMALL_DATASET, "model=none", "logger=none", "diagnose=false",
                   "run.steps=4", "loader=folder,memmap", "prefetch=none,gpu",
                   "loader.shuffle_block=1,0", "hydra.sweep.dir=sweep", cwd=tmp_path,
                   check=False)
    jobs = sorted(glob.glob(str(tmp_path / "sweep" / "*" / "metrics.json")))
    assert len(jobs) == 8  # every job left its result, after and despite the failures
    statuses = [json.loads(Path(j).read_text())["status"] for j in jobs]
    assert statuses.count("ok") == 2 and statuses.count("skipped") == 2
    assert statuses.count("failed") == 4  # shuffle_block=0 is refused in each of those jobs
    assert proc.returncode != 0  # and the sweep as a whole says so, at its end
    for j in jobs:
        m = json.loads(Path(j).read_text())
        if m["status"] == "skipped":
            assert "prefetch=gpu" in m["reason"] and "CUDA" in m["reason"]
        if m["status"] == "failed":
            assert "loader.shuffle_block=0 is invalid" in m["reason"]

    assert report_main([str(tmp_path / "sweep"), "--baseline",
                        "loader=folder,prefetch=none,loader.shuffle_block=1"]) == 0
    report = (tmp_path / "sweep" / "report.md").read_text()
    assert "| run | loader | prefetch | loader.shuffle_block | status | images/s |" in report
    assert report.count("| failed |") == 4 and report.count("| skipped |") == 2
    assert "loader.shuffle_block=0 is invalid" in report
    for name in ("throughput.png", "step_time.png"):
        assert (tmp_path / "sweep" / name).read_bytes()[:8] == PNG


def test_report_compares_against_the_slowest_and_a_baseline(tmp_path: Path):
    def fake(job: str, loader: str, rate: float, batch: int):
        folder = tmp_path / "sw" / job
        folder.mkdir(parents=True)
        (folder / "metrics.json").write_text(json.dumps({
            "status": "ok", "images_per_sec": rate, "ms_per_step": 1000 * batch / rate,
            "data_wait_frac": 0.5, "data_wait_ms": 5.0, "copy_ms": 1.0, "compute_ms": 2.0,
            "overrides": [f"loader={loader}", f"loader.batch_size={batch}", "model=none"],
            "config": {"loader": {"name": loader, "batch_size": batch},
                       "dataset": {"image_size": [224, 224]}},
            "bottleneck": {"stage": "decode", "sentence": f"data-bound: {loader}"},
        }))

    fake("0", "folder", 100.0, 32)
    fake("1", "folder", 150.0, 64)
    fake("2", "memmap", 5000.0, 32)
    fake("3", "memmap", 9000.0, 64)
    out, table = write_report([tmp_path / "sw"], baseline="loader=memmap,loader.batch_size=32")
    lines = table.splitlines()
    assert lines[0] == ("| run | loader | loader.batch_size | status | images/s | ms/step | "
                        "data wait | vs slowest | vs run 2 | bottleneck |")
    assert "| 3 | memmap | 64 | ok | 9,000 |" in lines[5]
    assert "| 90.00x | 1.80x | decode |" in lines[5]  # 9000/100 and 9000/5000
    assert "model" not in lines[0]  # constant options are not columns
    assert "- 3: data-bound: memmap" in (out / "report.md").read_text()


@pytest.mark.slow
def test_the_verdict_names_decode_for_a_slow_folder_decoder(tmp_path: Path, cache_dir: Path):
    run_cli(*SMALL_DATASET, "model=none", "logger=none", "loader.decoder=pil",
            "run.steps=6", "hydra.run.dir=run", cwd=tmp_path)
    b = read_metrics(tmp_path / "run")["bottleneck"]
    assert b["bound"] == "data" and b["stage"] == "decode"
    assert set(b["ceilings"]) == {"read", "decode", "collate"}
    assert b["sentence"].startswith("data-bound: pipeline") and "slowest stage decode" in b["sentence"]


@pytest.mark.slow
def test_the_verdict_names_the_model_when_data_is_in_ram(tmp_path: Path, cache_dir: Path):
    run_cli(*SMALL_DATASET, "loader=ram", "model=resnet18", "logger=none", "run.steps=6",
            "hydra.run.dir=run", cwd=tmp_path)
    m = read_metrics(tmp_path / "run")
    b = m["bottleneck"]
    assert b["bound"] == "model" and b["stage"] == "model"
    assert b["ceilings"]["gather"] > b["ceilings"]["model"]
    assert b["sentence"].startswith("model-bound: pipeline")


@pytest.mark.slow
def test_diagnose_false_skips_the_burst(tmp_path: Path, cache_dir: Path):
    run_cli(*SMALL_DATASET, "model=none", "logger=none", "diagnose=false", "run.steps=3",
            "hydra.run.dir=run", cwd=tmp_path)
    assert "bottleneck" not in read_metrics(tmp_path / "run")


@pytest.mark.slow
def test_the_profiler_writes_a_chrome_trace_with_the_stages(tmp_path: Path, cache_dir: Path):
    run_cli(*SMALL_DATASET, "profile=true", "logger=none", "diagnose=false", "run.steps=12",
            "hydra.run.dir=run", cwd=tmp_path)
    m = read_metrics(tmp_path / "run")
    trace = json.loads(Path(m["trace"]).read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"data_wait", "copy", "compute"} <= names


@pytest.mark.slow
def test_each_sweep_job_is_one_wandb_run_in_the_sweeps_group(tmp_path: Path, cache_dir: Path):
    run_cli("-m", *SMALL_DATASET, "model=none", "diagnose=false", "run.steps=3",
            "loader=folder,memmap", "hydra.sweep.dir=sweep", cwd=tmp_path)
    runs = sorted(glob.glob(str(tmp_path / "sweep" / "*" / "wandb" / "offline-run-*" / "*.wandb")))
    assert len(runs) == 2
    seen = []
    for file in runs:
        run = next(r.run for r in wandb_records(file) if r.WhichOneof("record_type") == "run")
        config = {u.key: json.loads(u.value_json) for u in run.config.update}
        seen.append(config["loader.name"])
        assert run.run_group == "sweep"
    assert sorted(seen) == ["folder", "memmap"]


def test_a_cpu_model_slowed_by_its_loader_is_told_so():
    from runner.config import Storage, compose
    from runner.diagnose import verdict

    cfg = compose(["loader=folder", "model=tiny"])
    assert cfg.loader.name is Storage.folder and cfg.loader.num_workers == 2
    figures = {"images_per_sec": 300.0, "data_wait_frac": 0.03}
    ceilings = {"read": 50000.0, "decode": 1000.0, "collate": 90000.0, "model": 600.0}
    v = verdict(cfg, figures, ceilings, cpu=True)
    assert v.bound == "model" and "alone the model runs 2.0x faster" in v.sentence
    assert "loader=memmap" in v.sentence
    assert "alone the model" not in verdict(cfg, figures, ceilings, cpu=False).sentence
