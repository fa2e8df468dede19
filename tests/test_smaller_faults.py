"""Issue 50's smaller faults: a model named beside models=[...] that would not run, a
checkpoint of several ranks that says it kept the last partial batch, an inference resume
refused with a sentence about the learning rate, and a killed run's record that says
``running`` forever."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runner.common.errors import ConfigError, UserError
from runner.job.compose import compose, job_refusal
from tests.conftest import (
    REPO,
    SMALL_DATASET,
    encode,
    make_tree,
    photo,
    read_metrics,
    run_cli,
    run_in_process,
    stopped_after,
)

# --- a: model= beside models=[...] -----------------------------------------------------------


def test_a_model_named_beside_models_that_do_not_hold_it_is_refused():
    with pytest.raises(ConfigError, match=r"^model=resnet18 and models=\[tiny\]: .* so "
                                          r"resnet18 would not run: add it, "
                                          r"models=\[resnet18,tiny\], or drop model="):
        compose(["task=infer", "model=resnet18", "models=[{name: tiny}]"])
    assert job_refusal(["task=infer", "model.name=resnet50", "models=[tiny]"]).startswith(
        "model.name=resnet50 and models=[tiny]")
    # the model among the entries, a preset that only sets the entries' source, no model=
    for fine in (["model=resnet18", "models=[tiny,resnet18]"], ["model=custom",
                 "models=[{name:a,target:tests.nets:TwoLayer}]"], ["models=[tiny,resnet18]"]):
        assert job_refusal(["task=infer", *fine]) is None, fine


# --- b: a checkpoint of 2 ranks resumed on 1 -------------------------------------------------

TWO_RANKS = [o for o in SMALL_DATASET if not o.startswith(("dataset.num_images", "loader.batch"))] \
    + ["dataset.num_images=44", "loader.batch_size=4", "model=custom",
       "model.target=tests.nets:TwoLayer", "logger=none", "diagnose=false",
       "run.timeline=false"]  # 44 images, 2 ranks x 4: 5 steps an epoch, 4 images dropped


@pytest.mark.slow
def test_a_checkpoint_of_two_ranks_records_its_drop_and_resumes_on_one(tmp_path: Path,
                                                                       cache_dir: Path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_SILENT": "true",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
         "-m", "runner", *TWO_RANKS, "run.epochs=1", "hydra.run.dir=two"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    saved = torch.load(tmp_path / "two" / "checkpoint.pt", weights_only=True)
    assert saved["world"] == 2 and saved["steps"] == saved["steps_per_epoch"] == 5
    assert saved["config"]["loader"]["drop_last"] is True  # what the 2 ranks did
    # the same command on one process, one epoch more: batch 8 and the last batch dropped
    one = run_in_process(*TWO_RANKS, "run.epochs=2", f"resume={tmp_path / 'two'}",
                         run_dir=tmp_path / "one")
    assert one["status"] == "ok" and one["start_step"] == 5 and one["steps"] == 5
    resumed = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=True)
    assert resumed["config"]["loader"]["batch_size"] == 8
    assert resumed["config"]["loader"]["drop_last"] is True
    # a checkpoint written before this record (drop_last: false from 2 ranks) resumes too
    saved["config"]["loader"]["drop_last"] = False
    torch.save(saved, tmp_path / "older.pt")
    older = run_in_process(*TWO_RANKS, "run.epochs=2", f"resume={tmp_path / 'older.pt'}",
                           run_dir=tmp_path / "older")
    assert older["status"] == "ok" and older["start_step"] == 5


# --- c: an inference resume's refusal speaks of inference -----------------------------------


def test_an_inference_resume_refused_says_what_an_inference_keeps(tmp_path: Path):
    data = make_tree(tmp_path / "data", {f"{c}/{k}.jpg": encode(photo(40, 52, 10 * i + k))
                                         for i, c in enumerate(["cat", "dog", "owl"])
                                         for k in range(5)})
    over = ["task=infer", "logger=none", "diagnose=false", "run.timeline=false",
            "dataset.image_size=[32,32]", "loader.batch_size=4", "run.warmup_steps=0",
            "run.progress=false", "run.epochs=1", f"dataset.path={data}"]
    stopped_after(2, over, tmp_path / "run")
    with pytest.raises(UserError) as refused:
        run_in_process(*over, "loader.batch_size=2", "resume=auto", run_dir=tmp_path / "run")
    message = str(refused.value)
    assert "\n" not in message and "learning rate" not in message and "schedule" not in message
    assert message.startswith("resume=auto: ") and "state of an inference" in message
    assert "loader.batch_size: checkpoint 4, this run 2" in message


# --- d: a run killed by SIGKILL ---------------------------------------------------------------


def test_a_record_tells_a_dead_owner_from_a_live_one():
    import socket

    from runner.launch.outcome import owner_gone, settled

    here = socket.gethostname()
    now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    live = {"status": "running", "pid": os.getpid(), "host": here, "started_at": now}
    assert not owner_gone(live) and settled(live) == live
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = {**live, "pid": child.pid, "steps": 7}
    assert owner_gone(dead)
    assert settled(dead)["status"] == "died" and f"pid {child.pid} on {here}" in \
        settled(dead)["reason"]
    # a live process under the pid, started after the record: the pid was reused
    assert owner_gone({**live, "started_at": "2001-01-01T00:00:00+0000"})
    # another machine's run, or a record without its host: this machine cannot tell
    assert not owner_gone({**dead, "host": "elsewhere"})
    assert not owner_gone({k: v for k, v in dead.items() if k != "host"})
    assert settled({**dead, "status": "ok"})["status"] == "ok"


@pytest.mark.slow
def test_a_run_killed_by_sigkill_is_reported_dead_and_the_next_run_says_so(
        tmp_path: Path, cache_dir: Path, capsys):
    from runner import report

    args = [*SMALL_DATASET, "model=tiny", "logger=none", "diagnose=false"]
    run_cli(*args, "run.steps=1", "hydra.run.dir=warm", cwd=tmp_path)  # the dataset, made
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", *args, "run.steps=100000", "run.log_every=2",
         "resume=auto", "hydra.run.dir=killed"],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        time.sleep(0.3)
        try:
            if read_metrics(tmp_path / "killed").get("images_per_sec"):
                break
        except (OSError, ValueError):
            continue
    proc.kill()  # SIGKILL, in the loop: nothing runs after this
    proc.wait(timeout=30)
    left = read_metrics(tmp_path / "killed")
    assert left["status"] == "running" and left["pid"] == proc.pid and left["host"]

    assert report.main([str(tmp_path / "killed"), "--out", str(tmp_path / "report")]) == 0
    text = (tmp_path / "report" / "report.md").read_text()
    assert "1 died" in text and f"(died): its process (pid {proc.pid} on " in text

    again = run_cli(*args, "run.steps=2", "resume=auto", "hydra.run.dir=killed",
                    cwd=tmp_path)
    said = again.stdout + again.stderr
    assert f"the run before in killed died: its process (pid {proc.pid} on " in said
    kept = json.loads((tmp_path / "killed" / "metrics.1.json").read_text())
    assert kept["status"] == "died" and kept["images_per_sec"] == left["images_per_sec"]
    assert read_metrics(tmp_path / "killed")["status"] == "ok"


def test_a_refused_resume_does_not_stand_for_the_parts_that_ran(tmp_path: Path):
    """Finished, then a resume refused before any step (another crop), then resume=auto as
    first asked: the figures kept are those of the part that ran the steps, not the refused
    record's (which has none: the run's figures vanished from metrics.json and the report)."""
    import json

    from runner.launch.outcome import previous_record

    (tmp_path / "metrics.1.json").write_text(json.dumps(
        {"status": "ok", "images_per_sec": 1387.0, "steps": 3}))
    (tmp_path / "metrics.2.json").write_text(json.dumps(
        {"status": "failed", "reason": "checkpoint of another run (dataset.crop_fraction)"}))
    assert previous_record(tmp_path)["images_per_sec"] == 1387.0
    (tmp_path / "metrics.3.json").write_text(json.dumps(
        {"status": "interrupted", "images_per_sec": 900.0}))
    assert previous_record(tmp_path)["images_per_sec"] == 900.0  # the latest that ran
