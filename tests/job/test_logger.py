"""logger=wandb honours its users' settings: the wandb environment first, then the logger.*
keys given, then wandb's settings files, then the runner's defaults (offline, project
runner); a sweep's runs grouped by the sweep and named by what it sweeps; the timeline, the
validation of each epoch and the checkpoint where a user looks. Each run is read back from
its offline ``.wandb`` file (wandb's own Record protobuf: ``tests.conftest.wandb_records``;
wandb 0.31 no longer ships a Python reader of the file, its DataStore is gone)."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest

from runner.job.logger import init_args, scrubbed, summary_of, swept
from tests.conftest import SMALL_DATASET, compose_config, read_metrics, run_cli, wandb_records

DEFAULTS = {"mode": "offline", "project": "runner", "group": "the-sweep", "job_type": "train",
            "name": "loader=memmap", "dir": "/runs/a"}
UNSET = {"mode": None, "project": None, "entity": None, "group": None, "tags": None}


def test_the_wandb_environment_wins_then_the_keys_given_then_the_settings_files():
    # nothing set anywhere: the runner's defaults, offline first
    assert init_args(UNSET, DEFAULTS, {}) == DEFAULTS
    # what the environment sets wins over a key given, and is passed on as it is (wandb
    # reads its environment once per process)
    env = {"WANDB_MODE": "disabled", "WANDB_PROJECT": "p", "WANDB_TAGS": "a,b",
           "WANDB_RUN_GROUP": "g", "WANDB_ENTITY": "e", "WANDB_JOB_TYPE": "j",
           "WANDB_NAME": "n", "WANDB_DIR": "/w"}
    given = {**UNSET, "mode": "online", "project": "mine", "tags": ["x"]}
    assert init_args(given, DEFAULTS, env) == {
        "mode": "disabled", "project": "p", "tags": ["a", "b"], "group": "g", "entity": "e",
        "job_type": "j", "name": "n", "dir": "/w"}
    # a key given stands where the environment is silent
    expected = {**DEFAULTS, "mode": "online", "tags": ["x"], "project": "p"}
    assert init_args(given, DEFAULTS, {"WANDB_PROJECT": "p"}) == expected
    # wandb's settings files (`wandb online`) come before the runner's offline default,
    # never before a key given
    assert "mode" not in init_args(UNSET, DEFAULTS, {}, {"mode"})
    assert init_args({**UNSET, "mode": "offline"}, DEFAULTS, {}, {"mode"})["mode"] == "offline"
    # an empty variable is no setting
    assert init_args(UNSET, DEFAULTS, {"WANDB_MODE": ""})["mode"] == "offline"


def test_the_schema_sets_no_logger_key_so_none_overrides_the_environment():
    from runner.job.compose import to_config

    logger = to_config(compose_config()).logger
    assert (logger.mode, logger.project, logger.entity, logger.group, logger.tags) == (
        None, None, None, None, None)
    assert logger.log_checkpoint is False
    given = to_config(compose_config("logger.mode=online", "logger.tags=[a,b]")).logger
    assert given.mode.value == "online" and list(given.tags) == ["a", "b"]


def test_a_sweeps_run_is_named_by_the_overrides_that_vary_only():
    sweep = ["loader=folder,memmap", "model=none", "run.steps=3", "prefetch=none,cpu",
             "dataset.source_size=[96,128]"]
    job = ["loader=memmap", "model=none", "run.steps=3", "prefetch=cpu",
           "dataset.source_size=[96,128]", "resume=auto"]
    assert swept(job, sweep, {"resume"}) == "loader=memmap,prefetch=cpu"
    # a sweep by config (sweep=loaders: hydra.sweeper.params) or a sweeper's trials: what is
    # not a constant of the command line varies
    assert swept(["sweep=loaders", "loader=ram", "prefetch=gpu"], ["sweep=loaders"]) == \
        "loader=ram,prefetch=gpu"
    assert swept(job[:2], None) == "loader=memmap,model=none"  # unknown: every override


def test_no_secret_reaches_the_config_or_the_name():
    config = {"dataset.path": "https://alice:hunter2@data.example.com/train?x=1",
              "dataset.val_path": "s3://bucket/val?X-Amz-Signature=abc123&X-Amz-Credential=k",
              "model.kwargs.api_key": "k-123", "model.kwargs.hf_token": "t-1",
              "model.kwargs.secret_key": "s-9", "model.kwargs.num_tokens": 77,
              "loader.batch_size": 64, "model.weights": "/models/r50.pt"}
    clean = scrubbed(config)
    text = json.dumps(clean)
    for secret in ("alice", "hunter2", "abc123", "k-123", "t-1", "s-9"):
        assert secret not in text
    assert clean["dataset.path"] == "https://***@data.example.com/train?x=1"
    assert clean["loader.batch_size"] == 64 and clean["model.weights"] == "/models/r50.pt"
    assert clean["model.kwargs.num_tokens"] == 77  # a name that only looks like one
    assert scrubbed("dataset.path=http://u:p@h/x,loader=folder") == \
        "dataset.path=http://***@h/x,loader=folder"


def offline_run(run_dir: Path) -> tuple[Path, list]:
    files = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1, files
    return Path(files[0]), wandb_records(files[0])


def kind(records: list, name: str) -> list:
    return [getattr(r, name) for r in records if r.WhichOneof("record_type") == name]


def history(records: list) -> list[dict]:
    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in h.item}
            for h in kind(records, "history")]


@pytest.mark.process
@pytest.mark.slow
def test_a_run_honours_the_wandb_environment_and_logs_what_users_look_at(tmp_path: Path,
                                                                        cache_dir: Path):
    secret = "wandb-key-0123456789abcdef0123456789abcdef"
    env = {"WANDB_MODE": "offline", "WANDB_PROJECT": "myproj", "WANDB_TAGS": "a,b",
           "WANDB_RUN_GROUP": "mygroup", "WANDB_API_KEY": secret}
    run_cli(*SMALL_DATASET, "dataset.val_fraction=0.2", "run.epochs=2", "diagnose=false",
            "logger.log_checkpoint=true", "logger.mode=online", "logger.project=other",
            "hydra.run.dir=run", cwd=tmp_path, env=env)
    assert read_metrics(tmp_path / "run")["status"] == "ok"
    _, records = offline_run(tmp_path / "run")  # offline: the environment over logger.mode
    (run,) = kind(records, "run")
    assert (run.project, list(run.tags), run.run_group, run.job_type) == (
        "myproj", ["a", "b"], "mygroup", "train")
    assert "run.epochs=2" in run.display_name  # alone: its overrides
    rows = history(records)
    # timeline.png, as an image
    (picture,) = [r for r in rows if "images/timeline/_type" in r]
    assert picture["images/timeline/_type"] == "image-file"
    assert picture["images/timeline/format"] == "png"
    # each epoch's validation, against its epoch
    epochs = [(r["epoch"], r["val/top1"]) for r in rows if "val/top1" in r]
    assert [e for e, _ in epochs] == [1, 2]
    metrics = read_metrics(tmp_path / "run")
    assert [v for _, v in epochs] == [row["val_top1"] for row in metrics["epochs"]]
    # the summary stays metrics.json's figures: no image, epoch or validation row in it
    summary = {i.key or ".".join(i.nested_key) for u in kind(records, "summary")
               for i in u.update}
    assert {k for k in summary if not k.startswith("_")} <= set(summary_of(metrics))
    # the checkpoint, as an artifact
    (artifact,) = kind(records, "artifact")
    assert artifact.type == "model" and artifact.name.startswith("checkpoint-")
    assert any(e.path == "checkpoint.pt" for e in artifact.manifest.contents)
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), f"secret written to {path}"


@pytest.mark.process
@pytest.mark.slow
def test_wandb_mode_disabled_writes_no_run(tmp_path: Path, cache_dir: Path):
    proc = run_cli(*SMALL_DATASET, "model=none", "run.steps=4", "diagnose=false",
                   "run.timeline=false", "hydra.run.dir=run", cwd=tmp_path,
                   env={"WANDB_MODE": "disabled"})
    assert read_metrics(tmp_path / "run")["status"] == "ok"
    assert not list((tmp_path / "run").rglob("*.wandb"))
    assert not (tmp_path / "run" / "wandb").exists()
    assert "wandb sync" not in proc.stdout + proc.stderr  # no run to upload


@pytest.mark.process
@pytest.mark.slow
def test_a_sweeps_runs_are_grouped_by_it_and_named_by_what_it_sweeps(tmp_path: Path,
                                                                     cache_dir: Path,
                                                                     monkeypatch):
    for var in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_RUN_GROUP", "WANDB_NAME", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    run_cli("-m", *SMALL_DATASET, "model=none", "diagnose=false", "run.steps=3",
            "run.timeline=false", "loader=folder,memmap", "hydra.sweep.dir=sweep",
            cwd=tmp_path)
    names = {}
    for job in sorted((tmp_path / "sweep").glob("*/metrics.json")):
        _, records = offline_run(job.parent)  # nothing set: offline, project runner
        (run,) = kind(records, "run")
        assert (run.project, run.run_group, run.job_type) == ("runner", "sweep", "train")
        names[run.display_name] = json.loads(job.read_text())["config"]["loader"]["name"]
    assert names == {"loader=folder": "folder", "loader=memmap": "memmap"}


def test_a_wandb_setting_wandb_refuses_is_one_line_naming_the_values(tmp_path: Path,
                                                                     monkeypatch, caplog):
    """WANDB_MODE=garbage was pydantic's 4-line ValidationError: one line naming the
    variable, its value and the values it takes; the run goes on without wandb."""
    import logging

    from runner.config.schema import LoggerConfig, LoggerName
    from runner.job.logger import build_logger

    monkeypatch.setenv("WANDB_MODE", "garbage")
    with caplog.at_level(logging.WARNING):
        logger = build_logger(LoggerConfig(name=LoggerName.wandb), tmp_path, {}, None, None)
    (line,) = [r.getMessage() for r in caplog.records if "could not start" in r.getMessage()]
    assert "\n" not in line and "pydantic" not in line
    assert "WANDB_MODE='garbage' is refused by wandb: use 'online', 'offline'" in line
    logger.log({"a": 1.0}, 1)  # a logger that does nothing
    logger.close("ok")


@pytest.mark.process
def test_the_wandb_environment_set_after_a_run_in_the_same_process_is_honoured(
        tmp_path: Path, monkeypatch, caplog):
    """wandb reads its environment at its first setup in a process: a second run (a
    notebook's, an in-process sweep's) with WANDB_MODE changed in between took wandb's
    ``online`` ("No API key configured") where the variable said otherwise."""
    import logging

    from runner.config.schema import LoggerConfig, LoggerName
    from runner.job.logger import build_logger

    monkeypatch.delenv("WANDB_MODE", raising=False)
    first = build_logger(LoggerConfig(name=LoggerName.wandb), tmp_path / "a", {}, None, None)
    first.close("ok")
    monkeypatch.setenv("WANDB_MODE", "garbage")
    with caplog.at_level(logging.WARNING):
        build_logger(LoggerConfig(name=LoggerName.wandb), tmp_path / "b", {}, None,
                     None).close("ok")
    (line,) = [r.getMessage() for r in caplog.records if "could not start" in r.getMessage()]
    assert "WANDB_MODE='garbage' is refused by wandb" in line and "API key" not in line
    monkeypatch.setenv("WANDB_MODE", "disabled")
    third = build_logger(LoggerConfig(name=LoggerName.wandb), tmp_path / "c", {}, None, None)
    assert third.inner.mode == "disabled"
    third.close("ok")
