"""Stopped, resumed, exactly: a run stopped at any step and resumed sees the same batches
(same images, same crops) and computes the same losses as one that never stopped."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from runner.common.errors import Interrupted
from runner.tasks import TrainStep, checkpoint
from tests.conftest import (
    REPO,
    SMALL_DATASET,
    encode,
    job_dir,
    make_tree,
    photo,
    predictions,
    read_metrics,
    run_cli,
    run_in_process,
)
from tests.tasks.train.test_training import small_model, task

COMMON = [*SMALL_DATASET, "logger=none", "diagnose=false", "run.timeline=false",
          "dataset.crop=random", "run.epochs=3"]  # 60 images, batch 8: 8 steps an epoch


class Recorder:
    """Every training step's batch (image indices, a checksum of its pixels) and loss; a
    SIGTERM (as the signal handler raises it) before step ``stop_at``, or during the
    validation after epoch ``stop_in_validation``."""

    def __init__(self, monkeypatch, stop_at: int | None = None,
                 stop_in_validation: int | None = None):
        import runner.tasks

        self.steps: list[tuple[tuple[int, ...], int, float]] = []
        self.epochs_validated = 0
        real_step, real_validate = runner.tasks.TrainStep.__call__, runner.tasks.train.validation.Validation.__call__
        recorder = self

        def step(self, batch) -> None:
            if stop_at is not None and len(recorder.steps) == stop_at:
                raise Interrupted("SIGTERM")
            real_step(self, batch)
            recorder.steps.append((tuple(batch["index"].tolist()),
                                   int(batch["image"].long().sum()),
                                   float(self.losses[self.steps - 1])))

        def validate(self) -> float:
            recorder.epochs_validated += 1
            if recorder.epochs_validated == stop_in_validation:
                raise Interrupted("SIGTERM")
            return real_validate(self)

        monkeypatch.setattr(runner.tasks.TrainStep, "__call__", step)
        monkeypatch.setattr(runner.tasks.train.validation.Validation, "__call__", validate)


def read_metrics_file(path: Path) -> dict:

    return json.loads(path.read_text())


@pytest.fixture
def val_tree(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "val", {f"class_00{c}/{k}.jpg": encode(photo(48, 64, 5 * c + k))
                                        for c in range(3) for k in range(2)})


def run(monkeypatch, run_dir: Path, *overrides: str, **stop) -> Recorder:
    recorder = Recorder(monkeypatch, **stop)
    try:
        run_in_process(*COMMON, *overrides, run_dir=run_dir)
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    return recorder


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["folder", "memmap"])
@pytest.mark.parametrize("stop", [{"stop_at": 1}, {"stop_at": 5}, {"stop_at": 8},
                                  {"stop_in_validation": 2}],
                         ids=["first-step", "mid-epoch", "epoch-boundary", "in-validation"])
def test_a_stopped_and_resumed_run_sees_the_same_batches_and_losses(
        tmp_path: Path, cache_dir: Path, monkeypatch, val_tree: Path, loader: str, stop: dict):
    common = [f"loader={loader}", f"dataset.val_path={val_tree}"]
    straight = run(monkeypatch, tmp_path / "straight", *common)
    assert len(straight.steps) == 24
    first = run(monkeypatch, tmp_path / "run", *common, **stop)
    stopped = read_metrics(tmp_path / "run")
    assert stopped["status"] == "interrupted" and Path(stopped["checkpoint"]).is_file()
    second = run(monkeypatch, tmp_path / "run", *common, "resume=auto")
    resumed = read_metrics(tmp_path / "run")
    done = len(first.steps)
    assert resumed["status"] == "ok" and resumed["start_step"] == done
    assert read_metrics_file(tmp_path / "run" / "metrics.1.json")["status"] == "interrupted"
    assert resumed["steps"] == 24 - done  # the plan is the whole run's: only what was left
    together = first.steps + second.steps
    assert [s[:2] for s in together] == [s[:2] for s in straight.steps]  # images and crops
    assert [s[2] for s in together] == pytest.approx([s[2] for s in straight.steps],
                                                     abs=1e-6)


@pytest.mark.slow
def test_65_default_images_train_two_whole_batches_of_64_and_resume_exactly(
        tmp_path: Path, cache_dir: Path, monkeypatch, caplog):
    """A last training batch of one image failed BatchNorm: unset loader.drop_last leaves
    each epoch's last short batch out (said once, with the count), so 65 images at batch 64
    are one step of 64 an epoch, on the same 64 images whether the run stopped or not;
    validation keeps every image."""
    common = ["model=tiny", "dataset.num_images=65", "dataset.image_size=[32,32]",
              "dataset.source_size=[48,64]",
              "loader.num_workers=0", "logger=none", "diagnose=false", "run.timeline=false",
              "run.progress=false", "run.warmup_steps=0", "run.epochs=2",
              "dataset.val_fraction=0.2"]  # 52 to train on, 13 to validate on
    def run(monkeypatch, run_dir: Path, *overrides: str, **stop) -> Recorder:
        recorder = Recorder(monkeypatch, **stop)
        try:
            run_in_process(*overrides, run_dir=run_dir)  # not COMMON: drop_last unset
        except KeyboardInterrupt:
            pass
        monkeypatch.undo()
        return recorder

    with caplog.at_level(logging.INFO):
        straight = run(monkeypatch, tmp_path / "straight", *common, "loader.batch_size=16")
    assert [len(s[0]) for s in straight.steps] == [16] * 6  # 52 = 3 x 16 + 4 left out
    said = [r.getMessage() for r in caplog.records if "leaves out its last" in r.getMessage()]
    assert len(said) == 1 and "its last 4 image(s)" in said[0], said
    common = [c for c in common if not c.startswith("dataset.val_fraction")]
    straight = run(monkeypatch, tmp_path / "whole", *common)
    assert [len(s[0]) for s in straight.steps] == [64, 64]
    first = run(monkeypatch, tmp_path / "run", *common, stop_at=1)
    second = run(monkeypatch, tmp_path / "run", *common, "resume=auto")
    assert read_metrics(tmp_path / "run")["status"] == "ok"
    together = first.steps + second.steps
    assert [s[:2] for s in together] == [s[:2] for s in straight.steps]
    assert [s[2] for s in together] == pytest.approx([s[2] for s in straight.steps], abs=1e-6)
    # task=infer reads every image
    m = run_in_process(*common, "task=infer", "run.epochs=1", run_dir=tmp_path / "infer")
    assert m["images"] == 65


@pytest.mark.slow
def test_resume_auto_starts_fresh_goes_on_and_leaves_a_finished_run_alone(
        tmp_path: Path, cache_dir: Path):
    fresh = run_in_process(*COMMON, "resume=auto", "run.epochs=1", run_dir=tmp_path / "run")
    assert fresh["status"] == "ok" and "resumed_from" not in fresh and fresh["steps"] == 8
    more = run_in_process(*COMMON, "resume=auto", "run.epochs=2", run_dir=tmp_path / "run")
    assert more["resumed_from"].endswith("checkpoint.pt") and more["start_step"] == 8
    assert more["steps"] == 8  # the second epoch only
    again = run_in_process(*COMMON, "resume=auto", "run.epochs=2", run_dir=tmp_path / "run")
    assert again == read_metrics(tmp_path / "run") == more  # finished: nothing redone


@pytest.mark.slow
def test_a_checkpoint_of_another_run_is_refused_naming_the_difference(tmp_path: Path,
                                                                      cache_dir: Path):
    from runner.tasks.checkpoint import CheckpointError

    run_in_process(*COMMON, "run.epochs=1", run_dir=tmp_path / "first")
    with pytest.raises(CheckpointError, match="global batch is 8 images .* a global batch of 4"):
        run_in_process(*COMMON, "loader.batch_size=4", f"resume={tmp_path}/first",
                       run_dir=tmp_path / "second")
    with pytest.raises(CheckpointError, match="nothing is left"):
        run_in_process(*COMMON, "run.epochs=1", f"resume={tmp_path}/first",
                       run_dir=tmp_path / "third")


def test_an_epoch_resumed_at_a_batch_continues_the_same_permutation():
    from runner.data.order import BatchOrder

    whole = BatchOrder(30, 4, shuffle=True, drop_last=False, seed=2)
    whole.set_epoch(5)
    rows = [b.tolist() for b in whole.batches()]
    for skip in (0, 1, 7, 8):
        part = BatchOrder(30, 4, shuffle=True, drop_last=False, seed=2)
        part.set_epoch(5, skip)
        assert [b.tolist() for b in part.batches()] == rows[skip:]


def test_device_crops_are_drawn_from_each_images_crop_seed():
    from runner.data.decode.crops import BatchAugment
    from runner.data.decode.decoders import crop_uniforms
    from runner.data.order import BatchOrder
    from runner.data.path import crop_draws

    def draws_of(seed: int, epoch: int, index: list[int]) -> torch.Tensor:
        order = BatchOrder(100, 4, shuffle=True, drop_last=False, seed=seed)
        order.set_epoch(epoch)
        next(iter(order.batches()))  # the order is in that epoch now
        draw = crop_draws(BatchAugment((8, 8)), order, pin=False)
        return draw(epoch, 0, torch.tensor(index))["crop_uniforms"]

    first = draws_of(0, 3, [5, 9, 2])
    assert torch.equal(first, draws_of(0, 3, [5, 9, 2]))  # a resumed run draws the same
    assert torch.equal(first[1], draws_of(0, 3, [9])[0])  # per image, not per position
    assert not torch.equal(first, draws_of(0, 4, [5, 9, 2]))  # a new epoch, new crops
    assert not torch.equal(first, draws_of(1, 3, [5, 9, 2]))  # another run seed
    # what a folder or packed decode of image 9 in that epoch draws (the order's seed)
    order = BatchOrder(100, 4, shuffle=True, drop_last=False, seed=0)
    order.set_epoch(3)
    next(iter(order.batches()))
    seed = order.seeds_for(torch.tensor([9]))[0]
    assert torch.equal(first[1], torch.tensor(crop_uniforms(seed), dtype=torch.float64))


@pytest.mark.slow
def test_checkpoints_every_few_steps_only_the_latest_kept_or_none_at_all(tmp_path: Path,
                                                                        cache_dir: Path):
    one_epoch = [*COMMON, "run.epochs=1"]  # 8 steps
    run_in_process(*one_epoch, "task.checkpoint_every_steps=3", "task.keep_checkpoints=true",
                   run_dir=tmp_path / "kept")
    kept = sorted(p.name for p in (tmp_path / "kept").glob("checkpoint-*.pt"))
    assert kept == ["checkpoint-00000003.pt", "checkpoint-00000006.pt",
                    "checkpoint-00000008.pt"]  # every 3 steps, and the end
    third = torch.load(tmp_path / "kept" / kept[0], weights_only=True)
    assert third["steps"] == 3  # a SIGKILL after step 5 would lose 2 steps, not the run
    run_in_process(*one_epoch, "task.checkpoint_every_steps=3", run_dir=tmp_path / "latest")
    assert [p.name for p in (tmp_path / "latest").glob("checkpoint*.pt")] == ["checkpoint.pt"]
    none = run_in_process(*one_epoch, "task.checkpoint=false", run_dir=tmp_path / "none")
    assert none["checkpoint"] is None and not list((tmp_path / "none").glob("checkpoint*"))


RECORDING = """
    import json, os, time
    import runner.tasks
    from runner.common.errors import Interrupted

    real = runner.tasks.TrainStep.__call__
    done = [0]

    def step(self, batch):
        stop = int(os.environ.get("STOP_AT", "-1"))
        if done[0] == stop:
            raise Interrupted("SIGTERM")
        real(self, batch)
        time.sleep(float(os.environ.get("SLEEP", "0")))  # a slower step: time to signal
        done[0] += 1
        with open(os.environ["RECORD"] + "." + os.environ.get("RANK", "0"), "a") as f:
            f.write(json.dumps([batch["index"].tolist(), int(batch["image"].long().sum()),
                                float(self.losses[self.steps - 1])]) + "\\n")

    runner.tasks.TrainStep.__call__ = step
"""


@pytest.mark.process
@pytest.mark.ranks
@pytest.mark.slow
@pytest.mark.parametrize(("loader", "stop"), [("memmap", 1), ("memmap", 2), ("folder", 3)],
                         ids=["first-step", "mid-epoch", "epoch-boundary"])
def test_two_torchrun_ranks_stopped_and_resumed_see_what_an_uninterrupted_run_sees(
        tmp_path: Path, cache_dir: Path, loader: str, stop: int):
    import os
    import subprocess
    import sys

    from tests.conftest import sitecustomize

    env = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1",
           **sitecustomize(tmp_path / "inject", RECORDING)}
    common = [*COMMON, f"loader={loader}", "run.epochs=2"]  # 2 ranks: 3 whole steps an epoch
    # (the in-validation stop point is covered in one process: under torchrun a signal
    # during validation is acted on at the same step boundary as any other)

    def torchrun(record: str, stop: int, *extra: str) -> int:
        run_env = {**env, "RECORD": str(tmp_path / record), "STOP_AT": str(stop)}
        return subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
             "--standalone", "-m", "runner", *common, *extra],
            cwd=tmp_path, env=run_env, capture_output=True, text=True, timeout=300).returncode

    def steps(record: str, rank: int) -> list:
        path = tmp_path / f"{record}.{rank}"
        return [json.loads(line) for line in path.read_text().splitlines()] \
            if path.exists() else []

    assert torchrun("straight", -1, "hydra.run.dir=straight") == 0
    assert torchrun("first", stop, "resume=auto", "hydra.run.dir=run") != 0
    assert read_metrics(tmp_path / "run")["status"] == "interrupted"
    assert torchrun("second", -1, "resume=auto", "hydra.run.dir=run") == 0
    assert read_metrics(tmp_path / "run")["start_step"] == stop
    for rank in (0, 1):
        straight = steps("straight", rank)
        together = steps("first", rank) + steps("second", rank)
        assert len(straight) == 6 and len(steps("first", rank)) == stop
        assert [s[:2] for s in together] == [s[:2] for s in straight]
        assert [s[2] for s in together] == pytest.approx([s[2] for s in straight], abs=1e-5)


@pytest.mark.process
@pytest.mark.slow
def test_a_sweep_started_again_keeps_its_finished_jobs_and_runs_the_rest(tmp_path: Path,
                                                                       cache_dir: Path):

    sweep = ["-m", *SMALL_DATASET, "model=none", "logger=none", "diagnose=false",
             "run.steps=3", "loader=folder,memmap,ram", "hydra.sweep.dir=sweep"]
    run_cli(*sweep, cwd=tmp_path)
    jobs = [job_dir(tmp_path / "sweep", f"loader={name}") for name in ("folder", "memmap", "ram")]
    before = {k: read_metrics(job) for k, job in enumerate(jobs)}
    (jobs[1] / "metrics.json").unlink()  # as if stopped before job 1 ended
    (jobs[2] / "metrics.json").write_text(
        '{"status": "interrupted", "overrides": []}')  # stopped halfway through job 2
    proc = run_cli(*sweep, cwd=tmp_path)
    after = {k: read_metrics(job) for k, job in enumerate(jobs)}
    assert after[0] == before[0]  # finished ok with the same overrides: kept as it was
    assert "finished already" in proc.stdout + proc.stderr
    for k in (1, 2):  # run again
        assert after[k]["status"] == "ok" and after[k]["started_at"] >= before[k]["started_at"]
        assert after[k]["pid"] != before[k]["pid"]


@pytest.mark.process
@pytest.mark.slow
def test_a_resumed_run_continues_the_same_wandb_run(tmp_path: Path, cache_dir: Path):
    from tests.conftest import sitecustomize

    env = {**sitecustomize(tmp_path / "inject", RECORDING), "RECORD": str(tmp_path / "rec")}
    args = [*SMALL_DATASET, "diagnose=false", "run.epochs=2", "resume=auto",
            "hydra.run.dir=run"]
    stopped = run_cli(*args, cwd=tmp_path, env={**env, "STOP_AT": "5"}, check=False)
    assert stopped.returncode == 143 and "continue with: python -m runner" in \
        stopped.stdout + stopped.stderr
    run_cli(*args, cwd=tmp_path, env={**env, "STOP_AT": "-1"})
    ids = {p.name.split("-")[-1] for p in (tmp_path / "run" / "wandb").glob("offline-run-*")}
    assert len(list((tmp_path / "run" / "wandb").glob("offline-run-*"))) == 2
    assert len(ids) == 1  # both parts logged to one wandb run
    assert read_metrics(tmp_path / "run")["start_step"] == 5


@pytest.mark.process
@pytest.mark.ranks
@pytest.mark.slow
def test_a_sigterm_to_torchrun_stops_every_rank_at_one_step_and_the_resume_is_exact(
        tmp_path: Path, cache_dir: Path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import sitecustomize

    env = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1",
           **sitecustomize(tmp_path / "inject", RECORDING), "STOP_AT": "-1"}
    common = [*COMMON, "loader=memmap", "run.epochs=8", "run.log_every=2"]  # 24 steps a rank
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               "--standalone", "-m", "runner", *common]

    def steps(record: str, rank: int) -> list:
        path = tmp_path / f"{record}.{rank}"
        return [json.loads(line) for line in path.read_text().splitlines()] \
            if path.exists() else []

    subprocess.run([*command, "hydra.run.dir=straight"], cwd=tmp_path, timeout=300,
                   env={**env, "RECORD": str(tmp_path / "straight")}, capture_output=True)
    proc = subprocess.Popen([*command, "resume=auto", "hydra.run.dir=run"], cwd=tmp_path,
                            env={**env, "RECORD": str(tmp_path / "first"), "SLEEP": "0.2"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(steps("first", 0)) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # as SLURM or docker stop would, to torchrun
    proc.wait(timeout=120)
    stopped = read_metrics(tmp_path / "run")
    first = [steps("first", r) for r in (0, 1)]
    assert stopped["status"] == "interrupted"
    assert len(first[0]) == len(first[1]) < 24  # both ranks stopped at the same step
    assert stopped["checkpoint"] and torch.load(stopped["checkpoint"], weights_only=True)[
        "steps"] == len(first[0])
    subprocess.run([*command, "resume=auto", "hydra.run.dir=run"], cwd=tmp_path, timeout=300,
                   env={**env, "RECORD": str(tmp_path / "second")}, capture_output=True)
    assert read_metrics(tmp_path / "run")["status"] == "ok"
    for rank in (0, 1):
        together = first[rank] + steps("second", rank)
        straight = steps("straight", rank)
        assert [s[:2] for s in together] == [s[:2] for s in straight]
        assert [s[2] for s in together] == pytest.approx([s[2] for s in straight], abs=1e-5)


@pytest.mark.slow
def test_a_preempted_submitit_job_saves_then_hands_over_to_requeue_and_resumes(
        tmp_path: Path, cache_dir: Path, monkeypatch):
    """submitit warns a SLURM job of a preemption or its time limit with SIGUSR2 and its
    handler requeues the job (Hydra's submitit launcher resubmits the same overrides into
    the same job folder). Here a stand-in for that handler checks what the run had saved
    when it was called; the requeued job is the same command again."""
    import os
    import signal

    import runner.tasks

    requeued = []

    def submitit_handler(signum, frame):  # what submitit installs in a job
        requeued.append(read_metrics(tmp_path / "job"))

    previous = signal.signal(signal.SIGUSR2, submitit_handler)
    real_step, seen = runner.tasks.TrainStep.__call__, []

    def step(self, batch):
        if len(seen) == 6:
            os.kill(os.getpid(), signal.SIGUSR2)  # the preemption warning, mid-epoch
        real_step(self, batch)
        seen.append(float(self.losses[self.steps - 1]))

    monkeypatch.setattr(runner.tasks.TrainStep, "__call__", step)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_in_process(*COMMON, "resume=auto", run_dir=tmp_path / "job")
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert len(requeued) == 1  # handed over once, after the run was saved:
    assert requeued[0]["status"] == "interrupted" and "SIGUSR2" in requeued[0]["reason"]
    # the signal came during step 7: the run finished that step, then stopped and saved
    assert torch.load(requeued[0]["checkpoint"], weights_only=True)["steps"] == 7
    monkeypatch.undo()
    again = run_in_process(*COMMON, "resume=auto", run_dir=tmp_path / "job")  # the requeue
    assert again["status"] == "ok" and again["start_step"] == 7 and again["steps"] == 17


SLOW_STEPS = """
    import os, time
    import runner.tasks

    real = runner.tasks.TrainStep.__call__

    def step(self, batch):
        real(self, batch)
        time.sleep(float(os.environ.get("SLEEP", "0")))
        with open(os.environ["RECORD"], "a") as f:
            f.write("%r\\n" % float(self.losses[self.steps - 1]))

    runner.tasks.TrainStep.__call__ = step
"""


@pytest.mark.process
@pytest.mark.slow
def test_hydras_submitit_launcher_requeues_a_preempted_job_which_resumes_exactly(
        tmp_path: Path, cache_dir: Path):
    """The whole protocol on the CPU: Hydra's submitit launcher (local executor), SIGUSR2 to
    the job (what SLURM sends before a preemption or the time limit), submitit's requeue of
    the same job into the same folder, and resume=auto there."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import sitecustomize, stray_processes

    env = {**os.environ, "WANDB_SILENT": "true", **sitecustomize(tmp_path / "inject", SLOW_STEPS)}
    command = [sys.executable, "-m", "runner", "-m", "hydra/launcher=submitit_local",
               *COMMON, "run.epochs=4", "resume=auto"]  # 32 steps
    subprocess.run([*command, f"hydra.sweep.dir={tmp_path}/straight"], cwd=tmp_path,
                   env={**env, "RECORD": str(tmp_path / "straight.txt")}, timeout=300,
                   capture_output=True)
    record = tmp_path / "preempted.txt"
    sweep = subprocess.Popen([*command, f"hydra.sweep.dir={tmp_path}/sweep"], cwd=tmp_path,
                             env={**env, "RECORD": str(record), "SLEEP": "0.15"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while (not record.exists() or len(record.read_text().splitlines()) < 5) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    jobs = stray_processes("submitit.core._submit")
    jobs = [pid for pid in jobs if str(tmp_path / "sweep") in
            Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")]
    assert len(jobs) == 1
    os.kill(int(jobs[0]), signal.SIGUSR2)  # the preemption warning
    assert sweep.wait(timeout=240) == 0
    (job,) = [d for d in (tmp_path / "sweep").iterdir() if (d / "metrics.json").is_file()]
    first, final = read_metrics_file(job / "metrics.1.json"), read_metrics(job)
    assert first["status"] == "interrupted" and "SIGUSR2" in first["reason"]
    assert final["status"] == "ok" and final["start_step"] == first["steps"] > 0
    assert final["start_step"] + final["steps"] == 32
    losses = [float(x) for x in record.read_text().split()]
    straight = [float(x) for x in (tmp_path / "straight.txt").read_text().split()]
    assert losses == pytest.approx(straight, abs=1e-6)  # as if it had never stopped


@pytest.mark.process
@pytest.mark.slow
def test_a_sweep_stopped_by_sigterm_keeps_its_finished_jobs_when_started_again(
        tmp_path: Path, cache_dir: Path):
    import os
    import signal
    import subprocess
    import sys

    command = [sys.executable, "-m", "runner", "-m", *SMALL_DATASET, "model=none",
               "logger=none", "diagnose=false", "run.steps=4000", "run.window_seconds=0",
               "loader=memmap,ram,folder", "hydra.sweep.dir=sweep"]
    env = {**os.environ, "WANDB_SILENT": "true"}
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180

    def started(name: str) -> bool:
        try:
            return read_metrics(job_dir(tmp_path / "sweep", f"loader={name}")) is not None
        except (AssertionError, FileNotFoundError, OSError, ValueError):
            return False

    while not (started("memmap") and started("ram") and read_metrics(
            job_dir(tmp_path / "sweep", "loader=memmap"))["status"] == "ok") \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)  # during job 1
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "continue with: python -m runner -m" in out
    jobs = {name: job_dir(tmp_path / "sweep", f"loader={name}") for name in ("memmap", "ram")}
    kept = read_metrics(jobs["memmap"])
    assert read_metrics(jobs["ram"])["status"] == "interrupted"
    again = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0
    assert read_metrics(jobs["memmap"]) == kept  # finished: not run again
    assert all(read_metrics(job_dir(tmp_path / "sweep", f"loader={name}"))["status"] == "ok"
               for name in ("ram", "folder"))


@pytest.mark.slow
def test_resume_refuses_another_dataset_or_crop_naming_the_difference(tmp_path: Path,
                                                                      cache_dir: Path):
    from runner.tasks.checkpoint import CheckpointError

    source = make_tree(tmp_path / "src", {f"c{c}/{k:02d}.jpg": encode(photo(48, 64, 10 * c + k))
                                          for c in range(3) for k in range(10)})
    common = [f"dataset.path={source}", "dataset.image_size=[32,32]", "loader.batch_size=8",
              "loader.num_workers=0", "run.warmup_steps=1", "run.progress=false", "logger=none",
              "diagnose=false", "run.timeline=false"]
    run_in_process(*common, "run.epochs=1", run_dir=tmp_path / "first")
    resume = f"resume={tmp_path / 'first'}"
    for k in range(8):  # 8 images added: another permutation, another plan
        (source / "c0" / f"new{k}.jpg").write_bytes(encode(photo(48, 64, 90 + k)))
    with pytest.raises(CheckpointError, match=r"other data \(images: checkpoint 30, this run 38"):
        run_in_process(*common, "run.epochs=2", resume, run_dir=tmp_path / "second")
    for k in range(8):
        (source / "c0" / f"new{k}.jpg").unlink()
    (source / "c1" / "03.jpg").rename(source / "c1" / "03b.jpg")  # as many files, renamed
    with pytest.raises(CheckpointError, match="renamed, replaced or relabelled"):
        run_in_process(*common, "run.epochs=2", resume, run_dir=tmp_path / "third")
    (source / "c1" / "03b.jpg").rename(source / "c1" / "03.jpg")
    with pytest.raises(CheckpointError, match="dataset.crop: checkpoint 'center', this run "
                                              "'random'"):
        run_in_process(*common, "run.epochs=2", "dataset.crop=random", resume,
                       run_dir=tmp_path / "fourth")
    more = run_in_process(*common, "run.epochs=2", resume, run_dir=tmp_path / "fifth")
    # the same data: it goes on, after the first epoch's 3 whole batches of 8 (30 images:
    # training drops the short last one)
    assert more["status"] == "ok" and more["start_step"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("left", ["running", "interrupted"],
                         ids=["killed-after-the-last-checkpoint", "stopped-in-the-verdict"])
def test_resume_auto_finishes_a_run_stopped_after_its_last_step(tmp_path: Path,
                                                                cache_dir: Path, left: str):

    common = [*SMALL_DATASET, "logger=none", "diagnose=false", "run.timeline=false",
              "dataset.crop=random", "run.epochs=1", "resume=auto"]
    run_dir = tmp_path / "run"
    done = run_in_process(*common, run_dir=run_dir)
    record = read_metrics(run_dir)
    record["status"] = left  # what a SIGKILL (or a SIGTERM in the verdict) left behind
    (run_dir / "metrics.json").write_text(json.dumps(record))
    again = run_in_process(*common, run_dir=run_dir)  # the requeue
    assert again["status"] == "ok" and again["finished_before"] is True
    assert again["images_per_sec"] == done["images_per_sec"]  # the part that ran the steps
    assert read_metrics(run_dir)["status"] == "ok"
    # a finished run restarted with its overrides in another order does nothing either
    third = run_in_process(*reversed(common), run_dir=run_dir)
    assert third == read_metrics(run_dir) == again


@pytest.mark.process
@pytest.mark.slow
def test_a_sweep_given_one_more_value_runs_only_the_new_job(tmp_path: Path, cache_dir: Path):
    """Job folders are named by their overrides: a value added to a swept list does not
    shift the others onto another job's folder (which re-ran and overwrote them)."""

    sweep = ["-m", *SMALL_DATASET, "model=none", "logger=none", "diagnose=false",
             "run.steps=3", "hydra.sweep.dir=sweep"]
    run_cli(*sweep, "loader=folder,memmap", cwd=tmp_path)
    before = {n: read_metrics(job_dir(tmp_path / "sweep", f"loader={n}"))
              for n in ("folder", "memmap")}
    run_cli(*sweep, "loader=folder,packed,memmap", cwd=tmp_path)
    for name, record in before.items():
        assert read_metrics(job_dir(tmp_path / "sweep", f"loader={name}")) == record
    assert read_metrics(job_dir(tmp_path / "sweep", "loader=packed"))["status"] == "ok"
    assert len(list((tmp_path / "sweep").glob("*/metrics.json"))) == 3


def test_a_checkpoint_of_another_device_takes_this_devices_optimizer_options():
    """A CUDA run's checkpoint holds fused=True in its param groups, a CPU run's
    fused=None: after loading, the groups carry this run's device options (a CPU
    checkpoint resumed under fp16 on CUDA crashed at its first step otherwise)."""
    import torch

    from runner.config.schema import ModelConfig, TaskConfig, TaskName
    from runner.model.networks import build_model
    from runner.tasks import TrainStep, checkpoint
    from runner.tasks.train.optim import optimizer_options

    step = TrainStep(build_model(ModelConfig("tiny"), 3, torch.device("cpu")),
                     TaskConfig(TaskName.train), total_steps=2)
    saved = step.optimizer.state_dict()
    for group in saved["param_groups"]:
        group["fused"], group["foreach"] = True, False  # as a CUDA run saved them
    state = {"model": checkpoint.unwrapped_network(step.model).state_dict(), "optimizer": saved,
             "epoch": 1, "steps": 2}
    checkpoint.restore(step, state, "elsewhere.pt")
    expected = optimizer_options(torch.device("cpu"))
    for group in step.optimizer.param_groups:
        assert group["fused"] == expected.get("fused") and group["foreach"] == \
            expected.get("foreach")


@pytest.mark.slow
def test_a_recipe_with_adamw_cosine_mixup_ema_and_dropout_resumes_exactly(
        tmp_path: Path, cache_dir: Path, monkeypatch):
    """Optimizer, schedule, EMA, scaler, augmentation draws and dropout's random state all
    continue where they stopped: the resumed run ends with the uninterrupted run's weights."""
    import torch

    recipe = ["model=custom", "model.target=tests.nets:Dropping", "task.optimizer=adamw",
              "task.lr=0.01", "task.schedule=cosine", "task.warmup_steps=3",
              "task.augment.mixup=0.4", "task.augment.color_jitter=0.2",
              "task.ema_decay=0.9", "run.epochs=2"]
    straight = run(monkeypatch, tmp_path / "straight", *recipe)
    run(monkeypatch, tmp_path / "run", *recipe, stop_at=5)
    second = run(monkeypatch, tmp_path / "run", *recipe, "resume=auto")
    assert len(second.steps) == 16 - 5
    a = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=True)
    b = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    for key in a["model"]:
        assert torch.allclose(a["model"][key], b["model"][key], atol=1e-6), key
    for key in a["ema"]["model"]:
        assert torch.allclose(a["ema"]["model"][key].float(), b["ema"]["model"][key].float(),
                              atol=1e-6), key
    assert [s[2] for s in straight.steps][5:] == pytest.approx([s[2] for s in second.steps],
                                                               abs=1e-6)


# --- what a resume refuses, applies or ignores: every key of the schema, one list ---------

def schema_keys(schema=None, prefix: str = "") -> list[str]:
    """Every leaf key of the config schema (``task.augment.mixup``, ``seed``)."""
    import dataclasses
    import typing

    from runner.config.schema import Config

    schema = schema or Config
    hints = typing.get_type_hints(schema)
    keys = []
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            keys += schema_keys(kind, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def test_every_schema_key_is_refused_applied_fitted_or_free_at_a_resume():
    """A key added to runner/config/schema.py fails here until it is put in one of checkpoint's
    lists: refused when it differs (MUST_MATCH), applied with a log line, or free."""
    from runner.tasks import checkpoint

    lists = {name: getattr(checkpoint, name) for name in (
        "MUST_MATCH", "SCHEDULE_KEYS", "OPTIMIZER_KEYS", "APPLIED_KEYS", "FITTED_KEYS",
        "FREE_KEYS")}
    listed = [k for keys in lists.values() for k in keys]
    schema = schema_keys()
    assert sorted(set(schema) - set(listed)) == []  # in no list: decide what a resume does
    assert sorted(set(listed) - set(schema)) == []  # a list names a key that is not there
    twice = sorted({k for k in listed if listed.count(k) > 1})
    assert twice == []


def config_of(*overrides: str):
    from runner.job.compose import to_config
    from tests.conftest import compose_config

    return to_config(compose_config(*SMALL_DATASET, "logger=none", *overrides))


@pytest.mark.slow
@pytest.mark.parametrize("change", ["dataset.crop_fraction=1.0", "model.mean=[0.5,0.5,0.5]",
                                    "model.std=[0.5,0.5,0.5]", "dataset.store_quality=75",
                                    "dataset.val_fraction=0.2", "loader=memmap"])
def test_a_resume_that_changes_the_images_is_refused_naming_the_key(tmp_path: Path, change):
    from runner.config.schema import to_plain
    from runner.tasks import checkpoint

    path = tmp_path / "checkpoint.pt"
    torch.save({"model": {}, "optimizer": {}, "scaler": {}, "epoch": 1,
                "config": to_plain(config_of())}, path)
    checkpoint.load(path, config_of())  # the same settings: it fits
    key = change.split("=")[0]
    key = "loader.name" if key == "loader" else key
    with pytest.raises(checkpoint.CheckpointError, match=rf"another run \({key}: checkpoint"):
        checkpoint.load(path, config_of(change))


def test_a_resume_applies_a_changed_augmentation_or_loss_with_one_line_each(tmp_path: Path,
                                                                            caplog):
    import logging

    from runner.config.schema import to_plain
    from runner.tasks import checkpoint

    path = tmp_path / "checkpoint.pt"
    torch.save({"model": {}, "optimizer": {}, "scaler": {}, "epoch": 1,
                "config": to_plain(config_of("loader.decoder=pil"))}, path)
    changes = ["task.label_smoothing=0.1", "task.augment.mixup=0.2", "amp=bf16",
               "task.clip_grad_norm=1.0", "loader.decoder=simplejpeg"]
    with caplog.at_level(logging.INFO, logger="runner"):
        checkpoint.load(path, config_of(*changes))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume: ")]
    assert sorted(lines) == sorted([  # in the schema's order (runner/config/schema.py)
        "resume: task.augment.mixup 0.0 -> 0.2: this run's value is applied from here on",
        "resume: task.label_smoothing 0.0 -> 0.1: this run's value is applied from here on",
        "resume: task.clip_grad_norm 0.0 -> 1.0: this run's value is applied from here on",
        "resume: amp.name off -> bf16: this run's value is applied from here on",
        "resume: loader.decoder pil -> simplejpeg: this run's value is applied from here on",
    ])


@pytest.mark.process
def test_a_half_written_checkpoint_of_a_killed_run_is_removed(tmp_path: Path, caplog):
    from runner.tasks import checkpoint

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f".checkpoint.pt.tmp{gone.pid}"
    live = tmp_path / f".checkpoint.pt.tmp{os.getpid()}"  # a live run's write: kept
    other = tmp_path / "notes.tmp1"
    for f in (stale, live, other):
        f.write_bytes(b"x" * 100)
    task = SimpleNamespace(checkpoint=True)
    with caplog.at_level(logging.INFO, logger="runner"):
        checkpoint.Checkpointer(task, tmp_path, {}, None)
    assert not stale.exists() and live.exists() and other.exists()
    said = [r.getMessage() for r in caplog.records if "half-written" in r.getMessage()]
    assert len(said) == 1 and stale.name in said[0]


TWO_RANKS = [o for o in SMALL_DATASET if not o.startswith(("dataset.num_images", "loader.batch"))] \
    + ["dataset.num_images=44", "loader.batch_size=4", "model=custom",
       "model.target=tests.nets:TwoLayer", "logger=none", "diagnose=false",
       "run.timeline=false"]  # 44 images, 2 ranks x 4: 5 steps an epoch, 4 images dropped

@pytest.mark.process
@pytest.mark.ranks
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


TRAIN_RUN = [*SMALL_DATASET, "logger=none", "diagnose=false", "run.timeline=false"]

@pytest.mark.slow
def test_a_resume_that_would_train_another_model_is_still_refused_in_one_line(
        tmp_path: Path, cache_dir: Path):
    from runner.tasks.checkpoint import CheckpointError

    run_in_process(*TRAIN_RUN, "run.steps=3", run_dir=tmp_path / "a")
    with pytest.raises(CheckpointError, match="task.optimizer: checkpoint 'sgd', this run "
                                              "'adamw'") as refused:
        run_in_process(*TRAIN_RUN, "run.steps=6", "task.optimizer=adamw",
                       f"resume={tmp_path / 'a'}", run_dir=tmp_path / "b")
    assert "\n" not in str(refused.value)


class FakeCuda:
    """``count`` GPUs, one random state each (bytes full of the index), set calls kept."""

    def __init__(self, count: int, current: int = 0):
        self.count, self.current = count, current
        self.sets: list[tuple[int, torch.Tensor]] = []

    def index(self, device) -> int:
        if isinstance(device, torch.device):
            return self.current if device.index is None else device.index
        if isinstance(device, str):
            return self.index(torch.device(device))
        return int(device)

    def get_rng_state(self, device="cuda") -> torch.Tensor:
        i = self.index(device)
        if i >= self.count:
            raise RuntimeError(f"invalid device ordinal {i}")
        return torch.full((16,), i, dtype=torch.uint8)

    def set_rng_state(self, state: torch.Tensor, device="cuda") -> None:
        i = self.index(device)
        if i >= self.count:  # as torch.cuda.default_generators[i] fails
            raise IndexError(f"no CUDA device {i}: {self.count} visible")
        self.sets.append((i, state.clone()))

    def patch(self, monkeypatch) -> FakeCuda:
        import torch.cuda.random as cuda_random

        fakes = {"is_available": lambda: True, "is_initialized": lambda: True,
                 "device_count": lambda: self.count, "current_device": lambda: self.current,
                 "get_rng_state": self.get_rng_state, "set_rng_state": self.set_rng_state}
        for name, fake in fakes.items():
            monkeypatch.setattr(torch.cuda, name, fake)
            if hasattr(cuda_random, name):
                monkeypatch.setattr(cuda_random, name, fake)
        return self

def test_a_checkpoint_from_an_8_gpu_node_resumes_on_a_1_gpu_node(tmp_path: Path, monkeypatch):
    step = TrainStep(small_model(), task(lr=0.1), total_steps=2)
    node = FakeCuda(8, current=5).patch(monkeypatch)  # this rank drove cuda:5 of 8
    path = checkpoint.save(tmp_path / "c.pt", step, 1, 2, {}, {})
    rng = checkpoint.load(path)["rng"]  # weights_only: the format loads safely
    assert rng["rank"] == 0 and rng["world"] == 1
    assert list(rng["cuda"]) == [0]  # one state, the run's device's: not 8
    assert torch.equal(rng["cuda"][0], node.get_rng_state(5))
    # the device given wins over the current one
    assert torch.equal(checkpoint.rng_state(torch.device("cuda", 2))["cuda"][0],
                       node.get_rng_state(2))

    small = FakeCuda(1, current=0).patch(monkeypatch)
    checkpoint.restore_rng({"rng": rng})
    assert [(i, int(s[0])) for i, s in small.sets] == [(0, 5)]  # cuda:5's state on cuda:0
    assert torch.equal(torch.get_rng_state(), rng["cpu"][0])

def test_an_older_checkpoint_with_every_gpus_state_resumes_on_fewer(monkeypatch):
    states = [torch.full((16,), i, dtype=torch.uint8) for i in range(8)]
    old = {"rng": {"cpu": torch.get_rng_state(), "cuda": states}}  # get_rng_state_all's
    one = FakeCuda(1).patch(monkeypatch)
    checkpoint.restore_rng(old)
    assert [(i, int(s[0])) for i, s in one.sets] == [(0, 0)]
    two = FakeCuda(2, current=1).patch(monkeypatch)
    checkpoint.restore_rng(old)
    assert [(i, int(s[0])) for i, s in two.sets] == [(1, 1)]  # this device's entry
    beyond = FakeCuda(4, current=3).patch(monkeypatch)
    checkpoint.restore_rng({"rng": {"cpu": torch.get_rng_state(), "cuda": states[:2]}})
    assert [(i, int(s[0])) for i, s in beyond.sets] == [(3, 0)]  # none for it: the first

def cpu_seed(seed: int) -> None:
    """The CPU generator seeded (torch.manual_seed would seed the fake GPUs too)."""
    torch.random.default_generator.manual_seed(seed)

def test_each_rank_restores_its_own_random_state_and_no_other(monkeypatch, caplog):
    cuda = FakeCuda(2).patch(monkeypatch)
    saved = {}
    for rank in (0, 1):  # each rank on its own GPU, its own CPU seed
        monkeypatch.setattr(checkpoint, "_rank_world", lambda rank=rank: (rank, 2))
        cuda.current = rank
        cpu_seed(100 + rank)
        saved[rank] = checkpoint.rng_state()
        assert saved[rank]["rank"] == rank and list(saved[rank]["cuda"]) == [rank]
    both = {"rank": 0, "world": 2, "cpu": {r: saved[r]["cpu"][r] for r in (0, 1)},
            "cuda": {r: saved[r]["cuda"][r] for r in (0, 1)}}

    for rank in (0, 1):  # every rank's states in the checkpoint: each takes its own
        monkeypatch.setattr(checkpoint, "_rank_world", lambda rank=rank: (rank, 2))
        cuda.current, cuda.sets = rank, []
        cpu_seed(7)
        checkpoint.restore_rng({"rng": both})
        assert torch.equal(torch.get_rng_state(), saved[rank]["cpu"][rank])
        assert [(i, int(s[0])) for i, s in cuda.sets] == [(rank, rank)]

    # rank 0's checkpoint (under torchrun rank 0 alone writes): rank 1 keeps its own seed's
    monkeypatch.setattr(checkpoint, "_rank_world", lambda: (1, 2))
    cuda.current, cuda.sets = 1, []
    cpu_seed(7)
    mine = torch.get_rng_state()
    with caplog.at_level(logging.INFO, logger="runner"):
        checkpoint.restore_rng({"rng": saved[0]})
    assert torch.equal(torch.get_rng_state(), mine) and cuda.sets == []
    assert "rank 1 draws from its own seed" in caplog.text

    # a world of another size: nobody restores, with a warning
    monkeypatch.setattr(checkpoint, "_rank_world", lambda: (0, 1))
    cuda.current = 0
    caplog.clear()
    checkpoint.restore_rng({"rng": saved[0]})
    assert torch.equal(torch.get_rng_state(), mine) and cuda.sets == []
    assert "2 process(es), this run has 1" in caplog.text


QUICK = ["dataset.image_size=[16,16]", "loader.batch_size=4", "run.warmup_steps=1",
         "run.progress=false", "logger=none", "model=tiny", "loader.num_workers=0"]


@pytest.mark.slow
def test_a_checkpoint_names_the_classes_it_predicts(image_tree: Path, tmp_path: Path):
    """Trained on class folders, then given as model.weights to infer on the same images
    unlabelled: pred_name is the class folders' names, not 0, 1, 2."""
    train = tmp_path / "train"
    run_in_process(f"dataset.path={image_tree}", "run.steps=2", "diagnose=false", *QUICK,
                   run_dir=train)
    infer = tmp_path / "infer"
    run_in_process("task=infer", f"dataset.path={image_tree}", "dataset.labels=none",
                   f"model.weights={train / 'checkpoint.pt'}", "diagnose=false", *QUICK,
                   run_dir=infer)
    rows = predictions(infer)
    assert rows and {r["label_name"] for r in rows} == {""}  # the images are unlabelled
    assert {r["pred_name"] for r in rows} <= {"bird", "cat", "Dog"}
    assert set(rows[0]["topk_names"].split()) == {"bird", "cat", "Dog"}


class ListedImages:
    """A storage as data_fingerprint reads one: names, labels, classes, maybe groups."""

    def __init__(self, groups: list[int] | None = None):
        self.classes = ["a", "b"]
        if groups is not None:
            self.order_groups, self.group_block = groups, 4

    def __len__(self) -> int:
        return 6

    def name_of(self, i: int) -> str:
        return f"{i}.jpg"

    def label_tensor(self) -> torch.Tensor:
        return torch.tensor([0, 1] * 3)


def test_a_resume_that_would_read_the_same_files_in_another_order_is_refused():
    """A packed store read from a far disk in blocks of its file (BatchOrder's groups), then
    resumed on a local disk image by image: the same files, another order; refused naming
    what decides. The same order resumes; a checkpoint from before orders were recorded too."""
    from runner.tasks.checkpoint import CheckpointError

    far, local = ListedImages([0, 3, 6]), ListedImages()
    saved = {"data": checkpoint.data_fingerprint(far)}
    assert saved["data"]["order"] == "2 groups, 4 mixed at a time"
    with pytest.raises(CheckpointError, match="another order .*dataset.far_disk"):
        checkpoint.check_data(saved, local, "run/checkpoint.pt")
    checkpoint.check_data(saved, ListedImages([0, 3, 6]), "run/checkpoint.pt")
    older = {"data": {k: v for k, v in saved["data"].items() if k != "order"}}
    checkpoint.check_data(older, local, "run/checkpoint.pt")


@pytest.mark.parametrize(("cut", "says"), [(0, "is empty (0 bytes)"),
                                            (0.5, "is truncated or damaged"),
                                            (10, "is truncated or damaged")])
def test_a_truncated_or_empty_checkpoint_says_so_and_how_to_get_a_good_one(
        tmp_path: Path, cut: float, says: str):
    """Was ``cannot be read: [Errno 22] Invalid argument`` or an empty reason; the same
    words for model.weights."""
    from runner.model.networks import read_weights_file

    good = tmp_path / "good.pt"
    torch.save({"model": {"w": torch.zeros(1000)}, "optimizer": {}, "scaler": {},
                "epoch": 0}, good)
    data = good.read_bytes()
    bad = tmp_path / "bad.pt"
    bad.write_bytes(data[: int(cut * len(data)) if isinstance(cut, float) else cut])
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load(bad)
    line = str(e.value)
    assert says in line and "copy it again" in line and "checkpoint-best.pt" in line
    assert "\n" not in line and "miniz" not in line
    with pytest.raises(Exception, match=re.escape(says)):
        read_weights_file(str(bad))


def test_a_checkpoint_keeps_a_coco_sets_category_ids_and_serving_reads_them_mapped(tmp_path):
    """data_fingerprint keeps each class's COCO category id (a storage's targets'), so
    task=infer serves a checkpoint's classes under the ids it was trained with; none for
    a set without them, a plain state_dict or a file that is not there."""
    from types import SimpleNamespace

    coco = ListedImages()
    coco.targets = SimpleNamespace(category_ids=[3, 90])
    data = checkpoint.data_fingerprint(coco)
    assert data["category_ids"] == [3, 90] and data["class_names"] == ["a", "b"]
    assert "category_ids" not in checkpoint.data_fingerprint(ListedImages())
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": {"w": torch.zeros(2)}, "epoch": 1, "data": data}, path)
    assert checkpoint.saved_category_ids(path) == [3, 90]
    torch.save({"w": torch.zeros(2)}, tmp_path / "plain.pt")
    assert checkpoint.saved_category_ids(tmp_path / "plain.pt") is None
    assert checkpoint.saved_category_ids(tmp_path / "none.pt") is None
    assert checkpoint.saved_category_ids(None) is None
