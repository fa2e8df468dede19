"""The ``environment`` block: in a real run's metrics.json, its report and its wandb config;
a field that cannot be read is null, never an error."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import PIL.features
import pytest
import torch

from runner.data.threads import cores
from runner.job import environment
from runner.job.logger import summary_of
from runner.report import write_report
from tests.conftest import SMALL_DATASET, run_in_process, wandb_records


@pytest.fixture
def fresh_environment():
    environment._collected.cache_clear()
    yield
    environment._collected.cache_clear()


@pytest.mark.process  # wandb's service
def test_a_run_records_its_environment_in_metrics_report_and_wandb(tmp_path: Path,
                                                                    cache_dir: Path):
    run_dir = tmp_path / "run"
    m = run_in_process(*SMALL_DATASET, "run.steps=3", "logger=wandb", "logger.mode=offline",
                       "diagnose=false", run_dir=run_dir)
    assert m["status"] == "ok"
    saved = json.loads((run_dir / "metrics.json").read_text())
    env = saved["environment"]
    assert env["pillow_libjpeg_turbo"] is PIL.features.check_feature("libjpeg_turbo")
    assert env["torch"] == torch.__version__ and env["cuda"] == torch.version.cuda
    assert env["cpu_cores"] == cores()
    assert env["cuda_available"] is torch.cuda.is_available()
    if not torch.cuda.is_available():
        assert env["gpu_name"] is None and env["gpu_memory_gib"] is None
    import simplejpeg  # a decoder the runner depends on: its version is known

    assert env["simplejpeg"] == simplejpeg.__version__
    assert env["cpu_model"]  # /proc/cpuinfo names it on Linux

    # the report says which machine
    _, _ = write_report([run_dir])
    report = (run_dir / "report.md").read_text()
    assert f"Machine: {env['cpu_model']}, {env['cpu_cores']} cores" in report
    assert "libjpeg-turbo" in report

    # wandb: in the run's config, not its summary (the summary is the figures)
    offline = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(offline) == 1
    config = {u.key: json.loads(u.value_json) for r in wandb_records(offline[0])
              if r.WhichOneof("record_type") == "run" for u in r.run.config.update}
    assert config["environment.torch"] == torch.__version__
    assert config["environment.pillow_libjpeg_turbo"] is env["pillow_libjpeg_turbo"]
    assert not any(k.startswith("environment") for k in summary_of(saved))


def test_a_field_that_cannot_be_read_is_null(monkeypatch, fresh_environment):
    def broken(*args, **kwargs):
        raise OSError("not here")

    monkeypatch.setattr(PIL.features, "check_feature", broken)
    monkeypatch.setattr(environment, "_cpu_model", broken)
    env = environment.collect()
    assert env["pillow_libjpeg_turbo"] is None and env["cpu_model"] is None
    assert env["pillow"] == PIL.__version__ and env["torch"] == torch.__version__
    assert "(unknown)" in environment.summary(env)  # said, not guessed


def test_a_part_that_fails_whole_leaves_the_others(monkeypatch, fresh_environment):
    def broken():
        raise ImportError("no torch here")

    monkeypatch.setattr(environment, "PARTS", (environment._cpu, broken, environment._pillow))
    env = environment.collect()
    assert env["pillow"] == PIL.__version__ and env["cpu_cores"] == cores()
    assert "torch" not in env or env["torch"] is None
    environment.summary(env)  # a summary of a partial block does not raise


def test_collected_once_per_process(monkeypatch, fresh_environment):
    calls = []
    real = environment._cpu

    def counted():
        calls.append(1)
        return real()

    monkeypatch.setattr(environment, "PARTS", (counted,))
    first = environment.collect()
    first["cpu_cores"] = -1  # a caller's copy: the cached block is not changed
    assert environment.collect()["cpu_cores"] == cores()
    assert len(calls) == 1


def test_python_m_runner_environment_prints_the_block(capsys):
    assert environment.main() == 0
    printed = capsys.readouterr().out.splitlines()
    env = environment.collect()
    assert printed[0] == environment.summary(env)
    assert any(line.split() == ["pillow_libjpeg_turbo", str(env["pillow_libjpeg_turbo"])]
               for line in printed)
