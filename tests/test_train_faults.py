"""No silent wrong answers in training (issue 37): a resumed run trains with the learning
rate and plan it was given, and a loss that turns NaN fails the run at its step, keeps the
last good checkpoint and leaves a metrics.json that is valid JSON."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from tests.conftest import SMALL_DATASET, run_in_process

COMMON = [*SMALL_DATASET, "logger=none", "diagnose=false", "run.timeline=false"]


def strict_json(path: Path) -> dict:
    """The file as JSON, refusing NaN and Infinity (which JSON does not have)."""
    def refuse(name: str) -> None:
        raise ValueError(f"{path.name} holds {name}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


class Rates:
    """The learning rate of every parameter group in force at each training step (the
    rate that step's optimizer update uses), and the last step object."""

    def __init__(self, monkeypatch):
        import runner.tasks

        self.before: list[list[float]] = []
        self.step = None
        real = runner.tasks.TrainStep.__call__
        rates = self

        def call(self, batch) -> None:
            rates.step = self
            rates.before.append([g["lr"] for g in self.optimizer.param_groups])
            real(self, batch)

        monkeypatch.setattr(runner.tasks.TrainStep, "__call__", call)


def fresh_rates(lr: float, updates: int, **task) -> list[float]:
    """The learning rate at each optimizer step of a fresh schedule over ``updates``."""
    from runner.config.schema import TaskConfig, TaskName
    from runner.tasks.train.optim import build_schedule

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    schedule = build_schedule(optimizer, TaskConfig(TaskName.train, lr=lr, **task), updates, 8)
    rates = []
    for _ in range(updates + 1):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return rates  # [k]: in force at update k (the last: after the plan's last update)


def test_a_resume_with_another_lr_and_a_longer_plan_applies_both(tmp_path: Path,
                                                                 cache_dir: Path, monkeypatch,
                                                                 caplog):
    """6 steps of cosine at task.lr=0.05, resumed with task.lr=0.5 over run.steps=12: steps
    7..12 run at the rates of a fresh cosine of 12 steps at 0.5 (not the checkpoint's 0.05,
    not a cosine of 6 steps climbing back from 0), and metrics.json's lr_last is the
    optimizer's."""
    schedule = ["task.schedule=cosine", "task.warmup_steps=2", "task.min_lr=0.001"]
    run_in_process(*COMMON, *schedule, "task.lr=0.05", "run.steps=6", run_dir=tmp_path / "a")
    rates = Rates(monkeypatch)
    with caplog.at_level(logging.INFO, logger="runner"):
        resumed = run_in_process(*COMMON, *schedule, "task.lr=0.5", "run.steps=12",
                                 f"resume={tmp_path / 'a'}", run_dir=tmp_path / "b")
    monkeypatch.undo()
    assert resumed["status"] == "ok" and resumed["start_step"] == 6 and resumed["steps"] == 6
    expected = fresh_rates(0.5, 12, schedule=_cosine(), warmup_steps=2, min_lr=0.001)
    assert len(rates.before) == 6
    for k, groups in enumerate(rates.before):  # every parameter group, at step 7 + k
        assert groups == pytest.approx([expected[6 + k]] * len(groups), rel=1e-12, abs=0), k
    final = [g["lr"] for g in rates.step.optimizer.param_groups]
    assert final == pytest.approx([expected[12]] * len(final), rel=1e-12, abs=0)
    written = strict_json(tmp_path / "b" / "metrics.json")
    assert written["lr_last"] == pytest.approx(final[0], rel=1e-12, abs=0)
    assert written["config"]["task"]["lr"] == 0.5
    said = [r.getMessage() for r in caplog.records if "applied" in r.getMessage()]
    assert len(said) == 1 and "task.lr 0.05 -> 0.5" in said[0] and "6 -> 12" in said[0], said
    # its own checkpoint resumes as it was saved: the same rate, nothing said as changed
    caplog.clear()
    rates = Rates(monkeypatch)
    with caplog.at_level(logging.INFO, logger="runner"):
        more = run_in_process(*COMMON, *schedule, "task.lr=0.5", "run.steps=14",
                              f"resume={tmp_path / 'b'}", run_dir=tmp_path / "c")
    monkeypatch.undo()
    assert more["status"] == "ok" and more["start_step"] == 12
    expected = fresh_rates(0.5, 14, schedule=_cosine(), warmup_steps=2, min_lr=0.001)
    assert [g[0] for g in rates.before] == pytest.approx(expected[12:14], rel=1e-12, abs=0)


def _cosine():
    from runner.config.schema import ScheduleName

    return ScheduleName.cosine


def test_a_resume_that_would_train_another_model_is_still_refused_in_one_line(
        tmp_path: Path, cache_dir: Path):
    from runner.tasks.checkpoint import CheckpointError

    run_in_process(*COMMON, "run.steps=3", run_dir=tmp_path / "a")
    with pytest.raises(CheckpointError, match="task.optimizer: checkpoint 'sgd', this run "
                                              "'adamw'") as refused:
        run_in_process(*COMMON, "run.steps=6", "task.optimizer=adamw",
                       f"resume={tmp_path / 'a'}", run_dir=tmp_path / "b")
    assert "\n" not in str(refused.value)


def test_a_resumed_step_takes_the_new_lr_and_plan_from_the_optimizer_step_it_reached(
        tmp_path: Path):
    """The same at the step's level (no run folder): a checkpoint of 4 of a 4-step plan at
    lr 0.1, restored into a step of an 8-step plan at lr 0.3 (one-cycle, which keeps its
    own rates in the optimizer's groups)."""
    from runner.config.schema import ScheduleName, TaskConfig, TaskName
    from runner.tasks import TrainStep, checkpoint
    from tests.tasks.train.test_training import batches, small_model

    old = TaskConfig(TaskName.train, lr=0.1, schedule=ScheduleName.onecycle)
    new = TaskConfig(TaskName.train, lr=0.3, schedule=ScheduleName.onecycle)
    first = TrainStep(small_model(), old, total_steps=4)
    data = batches(8)
    for batch in data[:4]:
        first(batch)
    path = checkpoint.save(tmp_path / "c.pt", first, 1, 4, {}, {})
    second = TrainStep(small_model(seed=5), new, total_steps=4, plan_steps=8)
    checkpoint.restore(second, torch.load(path, weights_only=True))
    straight = TrainStep(small_model(), new, total_steps=8)  # the schedule alone is compared
    for batch in data[:4]:
        straight(batch)
    for batch in data[4:]:
        assert second.lr == pytest.approx(straight.lr, rel=1e-12, abs=0)
        second(batch)
        straight(batch)
    assert second.lr == pytest.approx(straight.lr, rel=1e-12, abs=0)
    assert [g["max_lr"] for g in second.optimizer.param_groups] == [0.3, 0.3]


# --- a loss that turns NaN ----------------------------------------------------------------


def nan_from(monkeypatch, step: int) -> None:
    """The loss of the run's ``step``-th step (1-based) is NaN; its backward makes the
    weights NaN, so every loss after it is NaN too, as in a real divergence."""
    import runner.tasks

    real = runner.tasks.TrainStep.loss

    def loss(self, logits, batch):
        value = real(self, logits, batch)
        return value * float("nan") if self.steps == step - 1 else value

    monkeypatch.setattr(runner.tasks.TrainStep, "loss", loss)


def finite_state(path: Path) -> dict:
    state = torch.load(path, weights_only=True)
    for name, tensor in state["model"].items():
        if tensor.is_floating_point():
            assert torch.isfinite(tensor).all(), f"{path.name}: {name} is not finite"
    return state


def test_a_nan_loss_fails_the_run_at_its_step_and_keeps_the_good_checkpoint(
        tmp_path: Path, cache_dir: Path, monkeypatch):
    nan_from(monkeypatch, 5)
    run_dir = tmp_path / "run"
    error = None
    try:
        run_in_process(*COMMON, "run.steps=10", "task.checkpoint_every_steps=2",
                       run_dir=run_dir)
    except Exception as e:  # the run's failure, re-raised after metrics.json is written
        error = e
    metrics = strict_json(run_dir / "metrics.json")
    assert metrics["status"] == "failed", metrics.get("reason")
    assert error is not None and metrics["reason"] == str(error)
    assert "step 5" in metrics["reason"] and "nan" in metrics["reason"], metrics["reason"]
    assert "\n" not in metrics["reason"]
    assert finite_state(run_dir / "checkpoint.pt")["steps"] == 4  # the last good one


def test_a_nan_in_the_last_steps_fails_before_the_final_checkpoint(tmp_path: Path,
                                                                   cache_dir: Path,
                                                                   monkeypatch):
    """The last step's loss is NaN: no log point reads it before the run ends; the end
    reads it and writes no checkpoint of NaN weights over the epoch's."""
    from runner.common.errors import Diverged

    nan_from(monkeypatch, 16)
    run_dir = tmp_path / "run"
    with pytest.raises(Diverged):
        run_in_process(*COMMON, "run.epochs=2", "task.checkpoint_every=1",
                       "run.log_every=100", "run.repeats=1", run_dir=run_dir)
    metrics = strict_json(run_dir / "metrics.json")
    assert metrics["status"] == "failed" and "step 16" in metrics["reason"], metrics
    assert finite_state(run_dir / "checkpoint.pt")["steps"] == 8


def test_a_nan_found_while_a_signal_stops_the_run_fails_it(tmp_path: Path, cache_dir: Path,
                                                          monkeypatch):
    """SIGTERM after a NaN loss: the stop reads the losses, and the run is failed at the
    NaN's step (not interrupted, with a continue command and no checkpoint of NaNs)."""
    import os
    import signal

    import runner.tasks
    from runner.common.errors import Diverged

    nan_from(monkeypatch, 3)
    real = runner.tasks.TrainStep.__call__

    def call(self, batch) -> None:
        real(self, batch)
        if self.steps == 4:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler stops after this step

    monkeypatch.setattr(runner.tasks.TrainStep, "__call__", call)
    run_dir = tmp_path / "run"
    with pytest.raises(Diverged):
        run_in_process(*COMMON, "run.steps=10", "run.log_every=100", "run.repeats=1",
                       run_dir=run_dir)
    metrics = strict_json(run_dir / "metrics.json")
    assert metrics["status"] == "failed" and "step 3" in metrics["reason"], metrics
    assert not (run_dir / "checkpoint.pt").exists()


def test_a_learning_rate_that_diverges_fails_the_run(tmp_path: Path, cache_dir: Path):
    """No injection: task.lr=1e30 blows the weights up within a few steps."""
    from runner.common.errors import Diverged

    run_dir = tmp_path / "run"
    with pytest.raises(Diverged):
        run_in_process(*COMMON, "run.steps=12", "task.lr=1e30", run_dir=run_dir)
    metrics = strict_json(run_dir / "metrics.json")
    assert metrics["status"] == "failed" and "step " in metrics["reason"], metrics
    assert not (run_dir / "checkpoint.pt").exists()  # no checkpoint of blown-up weights


def test_the_step_fails_at_the_read_after_a_nan_and_names_the_first_such_step():
    from runner.common.errors import Diverged
    from runner.config.schema import TaskConfig, TaskName
    from runner.tasks import TrainStep
    from tests.tasks.train.test_training import batches, small_model

    step = TrainStep(small_model(), TaskConfig(TaskName.train), total_steps=6)
    data = batches(6)
    for batch in data[:2]:
        step(batch)
    assert math.isfinite(step.read()["loss"])
    step.losses[2] = float("inf")  # as the step would store it, on the device
    step.steps = 4
    with pytest.raises(Diverged, match="the loss is inf at step 3"):
        step.read()
    with pytest.raises(Diverged, match="step 3"):  # once found, the same error
        step.close()


def test_json_files_hold_null_for_non_finite_numbers(tmp_path: Path):
    from runner.common.atomic import write_json

    path = tmp_path / "x.json"
    write_json(path, {"loss": float("nan"), "rows": [{"top1": float("inf")}, -math.inf, 1.5],
                      "n": 3, "ok": True, "np": __import__("numpy").float32("nan")})
    assert strict_json(path) == {"loss": None, "rows": [{"top1": None}, None, 1.5], "n": 3,
                                 "ok": True, "np": None}
