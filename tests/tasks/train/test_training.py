"""task=train as people train: the optimizer's groups, the schedule per optimizer step,
gradient accumulation and clipping, label smoothing, the EMA, all resumed exactly; the
recipes compose."""

from __future__ import annotations

import contextlib
import json
import logging
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn

from runner.config.schema import ModelFamily, OptimizerName, ScheduleName, TaskConfig, TaskName
from runner.job.compose import compose
from runner.model.networks import UInt8Input
from runner.tasks import TrainStep, checkpoint
from runner.tasks.train.optim import Ema, param_groups
from tests.conftest import SMALL_DATASET, encode, make_tree, photo, run_in_process

CPU = torch.device("cpu")


def small_model(seed: int = 0, norm: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Flatten(), nn.Linear(3 * 4 * 4, 8)]
    if norm:
        layers += [nn.LayerNorm(8)]
    return nn.Sequential(UInt8Input(), nn.Sequential(*layers, nn.ReLU(), nn.Linear(8, 3)))


def batches(n: int, size: int = 4, seed: int = 0) -> list[TensorDict]:
    g = torch.Generator().manual_seed(seed)
    return [TensorDict({"image": torch.randint(0, 256, (size, 3, 4, 4), generator=g,
                                               dtype=torch.uint8),
                        "label": torch.randint(0, 3, (size,), generator=g)},
                       batch_size=[size]) for _ in range(n)]


def task(**kwargs) -> TaskConfig:
    return TaskConfig(TaskName.train, **kwargs)


def test_no_weight_decay_on_norms_and_biases_unless_asked():
    model = small_model(norm=True)
    decayed, plain = param_groups(model, 0.05, decay_all=False)
    assert decayed["weight_decay"] == 0.05 and plain["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decayed["params"])  # the Linear weights only
    assert len(plain["params"]) == 4  # two biases, the LayerNorm's weight and bias
    assert len(param_groups(model, 0.05, decay_all=True)) == 1


@pytest.mark.parametrize("optimizer", [OptimizerName.sgd, OptimizerName.adamw])
def test_warmup_then_cosine_per_optimizer_step(optimizer: OptimizerName):
    cfg = task(optimizer=optimizer, lr=0.1, schedule=ScheduleName.cosine, warmup_steps=4,
               min_lr=0.001)
    step = TrainStep(small_model(), cfg, total_steps=20)
    lrs = []
    for batch in batches(20):
        lrs.append(step.lr)
        step(batch)
    ramp = [0.1 * (1 / 5 + (1 - 1 / 5) * k / 4) for k in range(4)]
    assert lrs[:4] == pytest.approx(ramp)  # linear from lr/(warmup+1) up to lr
    assert lrs[4] == pytest.approx(0.1)
    cosine = [0.001 + (0.1 - 0.001) * (1 + math.cos(math.pi * k / 16)) / 2 for k in range(16)]
    assert lrs[4:] == pytest.approx(cosine, rel=1e-6)
    assert step.read()["lr"] == pytest.approx(step.lr)  # logged with the loss


def test_the_schedule_spans_the_whole_plan_of_a_resumed_run():
    """A run resumed after 10 of 20 steps has 10 steps left but the schedule of 20."""
    cfg = task(lr=0.1, schedule=ScheduleName.cosine)
    step = TrainStep(small_model(), cfg, total_steps=10, plan_steps=20)
    for batch in batches(10):
        step(batch)
    assert step.lr == pytest.approx(0.1 * (1 + math.cos(math.pi * 10 / 20)) / 2)


def test_accumulated_gradients_equal_one_step_on_the_whole_batch():
    cfg = task(lr=0.5, momentum=0.0, weight_decay=0.0)
    two = batches(2, size=4)
    whole = TensorDict({k: torch.cat([b[k] for b in two]) for k in ("image", "label")},
                       batch_size=[8])
    accumulated = TrainStep(small_model(), task(lr=0.5, momentum=0.0, weight_decay=0.0,
                                                accumulate=2), total_steps=2)
    for batch in two:
        accumulated(batch)
    once = TrainStep(small_model(), cfg, total_steps=1)
    once(whole)
    for p, q in zip(accumulated.model.parameters(), once.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    assert accumulated.micro == 0 and accumulated.schedule.last_epoch == 1  # one update


def test_gradients_are_clipped_to_the_global_norm():
    cfg = task(lr=1.0, momentum=0.0, weight_decay=0.0, clip_grad_norm=0.01)
    step = TrainStep(small_model(), cfg, total_steps=1)
    before = [p.detach().clone() for p in step.model.parameters()]
    step(batches(1)[0])
    moved = torch.cat([(p.detach() - b).flatten() for p, b in zip(step.model.parameters(),
                                                                  before)])
    assert moved.norm() == pytest.approx(0.01, rel=1e-4)  # lr 1: the step is the gradient


def test_label_smoothing_changes_the_loss_as_torch_defines_it():
    batch = batches(1)[0]
    plain = TrainStep(small_model(), task(), total_steps=1)
    smooth = TrainStep(small_model(), task(label_smoothing=0.2), total_steps=1)
    with torch.no_grad():
        logits = plain.model(batch["image"])
    plain(batch)
    smooth(batch)
    expected = nn.functional.cross_entropy(logits, batch["label"], label_smoothing=0.2)
    assert float(smooth.losses[0]) == pytest.approx(float(expected), rel=1e-5)
    assert abs(float(smooth.losses[0]) - float(plain.losses[0])) > 1e-4


def test_the_ema_follows_the_weights_with_a_warmed_up_decay():
    step = TrainStep(small_model(), task(lr=0.1, ema_decay=0.9), total_steps=3)
    network = step.model[1]
    expected = [p.detach().clone() for p in network.parameters()]
    for k, batch in enumerate(batches(3)):
        step(batch)
        if k == 0:  # AveragedModel's first update copies
            expected = [p.detach().clone() for p in network.parameters()]
        else:
            decay = min(0.9, (1 + k) / (10 + k))
            expected = [decay * e + (1 - decay) * p.detach()
                        for e, p in zip(expected, network.parameters())]
    for e, a in zip(expected, step.ema.model.module.parameters()):
        assert torch.allclose(e, a, atol=1e-6)


def test_a_resumed_run_continues_schedule_ema_and_optimizer_exactly(tmp_path: Path):
    cfg = task(optimizer=OptimizerName.adamw, lr=0.01, schedule=ScheduleName.onecycle,
               ema_decay=0.5, accumulate=2, clip_grad_norm=1.0, label_smoothing=0.1)
    data = batches(8)
    straight = TrainStep(small_model(), cfg, total_steps=8)
    for batch in data:
        straight(batch)
    first = TrainStep(small_model(), cfg, total_steps=4, plan_steps=8)
    for batch in data[:4]:
        first(batch)
    path = checkpoint.save(tmp_path / "c.pt", first, 0.5, 4, {}, {})
    second = TrainStep(small_model(seed=3), cfg, total_steps=4, plan_steps=8)
    checkpoint.restore(second, torch.load(path, weights_only=False))
    for batch in data[4:]:
        second(batch)
    assert second.lr == pytest.approx(straight.lr)
    for p, q in zip(second.model.parameters(), straight.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    for p, q in zip(second.ema.model.parameters(), straight.ema.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_an_ema_needs_no_sync_and_counts_on_the_host():
    ema = Ema(nn.Linear(2, 2), 0.999)
    assert ema.current_decay() == pytest.approx(0.1)  # (1 + 0) / (10 + 0)
    ema.update(nn.Linear(2, 2))
    assert ema.updates == 1 and ema.current_decay() == pytest.approx(2 / 11)


@pytest.mark.parametrize("recipe", ["quick", "resnet_imagenet", "vit_adamw"])
def test_every_recipe_composes_into_a_training_run(recipe: str):
    cfg = compose([f"recipe={recipe}"])
    assert cfg.task.name is TaskName.train and cfg.task.schedule is not ScheduleName.constant


@pytest.mark.slow  # five epochs with validation
def test_the_quick_recipe_trains_with_validation_and_keeps_the_best(tmp_path: Path,
                                                                    cache_dir: Path):
    from tests.conftest import SMALL_DATASET, run_in_process

    m = run_in_process("recipe=quick", *SMALL_DATASET, "logger=none", "diagnose=false",
                       "run.epochs=2", run_dir=tmp_path / "run")
    assert m["status"] == "ok"
    assert {"val_top1", "val_top5", "val_loss", "val_ema_top1"} <= set(m)
    assert len(m["epochs"]) == 2 and m["lr_last"] < 0.2
    assert m["images"] == 2 * 54  # 60 images, 6 held out: never trained on
    assert m["data_wait_frac"] >= 0  # the validation's pause is in no data wait
    assert (tmp_path / "run" / "checkpoint-best.pt").is_file()


def test_a_held_out_split_is_the_same_every_time_and_never_trained_on():
    from runner.config.schema import Split
    from runner.data.sources.listing import list_images
    from runner.data.storage import resolve_dataset

    cfg = compose(["dataset.num_images=60", "dataset.num_classes=3",
                   "dataset.source_size=[96,128]", "dataset.val_fraction=0.2"])
    import dataclasses

    path = resolve_dataset(cfg.dataset, progress=False)
    train = list_images(cfg.dataset, path).samples
    val = list_images(dataclasses.replace(cfg.dataset, split=Split.val), path).samples
    assert len(val) == 12 and len(train) == 48 and not set(train) & set(val)
    assert list_images(cfg.dataset, path).samples == train  # seeded: the same split
    with pytest.raises(Exception, match="needs task=train"):
        compose(["task=infer", "dataset.val_fraction=0.1"])


# --- task.augment: a draw per image, reproducible by batch position ---------------------------

def flat_batch(colours: list[int], size: int = 16) -> TensorDict:
    """Images of one flat grey level each, labelled by their position."""
    n = len(colours)
    image = torch.tensor(colours, dtype=torch.uint8).view(n, 1, 1, 1).expand(n, 3, size, size)
    return TensorDict({"image": image.contiguous(), "label": torch.arange(n)}, batch_size=[n])


def augment(**kwargs):
    from runner.config.schema import AugmentConfig
    from runner.data.device.augment import TrainAugment

    start = kwargs.pop("start_step", 0)
    return TrainAugment(AugmentConfig(**kwargs), seed=0, start_step=start)


@pytest.mark.parametrize("kwargs", [{"color_jitter": 0.4}, {"auto": "randaugment"},
                                    {"auto": "trivialaugment"}, {"erasing": 1.0}])
def test_each_image_gets_its_own_draw_and_a_batch_position_the_same(kwargs):
    from runner.config.schema import AutoAugmentName

    if "auto" in kwargs:
        kwargs = {**kwargs, "auto": AutoAugmentName(kwargs["auto"])}
    photo = torch.randint(0, 256, (3, 16, 16), dtype=torch.uint8, generator=torch.Generator()
                          .manual_seed(0))
    def batch() -> TensorDict:
        return TensorDict({"image": photo.expand(8, 3, 16, 16).clone(),
                           "label": torch.zeros(8, dtype=torch.long)}, batch_size=[8])
    first = augment(**kwargs)
    a, b = batch(), batch()
    first(a)
    first(b)  # the next step: other draws
    distinct = {bytes(img.numpy().tobytes()) for img in a["image"]}
    assert len(distinct) >= 3  # not one draw for the whole batch
    assert not torch.equal(a["image"], b["image"])
    resumed = augment(**kwargs, start_step=1)  # a run resumed at step 1
    c = batch()
    resumed(c)
    assert torch.equal(c["image"], b["image"])


def test_mixup_mixes_each_image_with_its_partner_by_its_own_weight():
    colours = [0, 40, 80, 120, 160, 200, 240, 20]
    batch = flat_batch(colours)
    augment(mixup=0.4)(batch)
    mix, partner = batch["mix"], batch["label_b"]
    assert len(set(mix.tolist())) > 3 and ((0 <= mix) & (mix <= 1)).all()
    for i in range(8):
        expected = (1 - mix[i]) * colours[i] + mix[i] * colours[int(partner[i])]
        assert abs(int(batch["image"][i, 0, 0, 0]) - expected) <= 1


def test_cutmix_pastes_a_box_whose_area_is_the_partners_weight():
    colours = [0, 40, 80, 120, 160, 200, 240, 20]
    batch = flat_batch(colours, size=32)
    augment(cutmix=1.0)(batch)
    for i in range(8):
        j = int(batch["label_b"][i])
        if j == i:
            continue
        share = (batch["image"][i, 0] == colours[j]).float().mean()
        assert abs(float(share) - float(batch["mix"][i])) < 0.02


def test_the_loss_of_a_mixed_batch_weighs_both_labels():
    step = TrainStep(small_model(), task(label_smoothing=0.1), total_steps=1)
    b = batches(1)[0]
    b["label_b"] = (b["label"] + 1) % 3
    b["mix"] = torch.tensor([0.0, 0.25, 0.5, 1.0])
    with torch.no_grad():
        logits = step.model(b["image"]).float()
    ce = nn.functional.cross_entropy
    expected = ((1 - b["mix"]) * ce(logits, b["label"], reduction="none", label_smoothing=0.1)
                + b["mix"] * ce(logits, b["label_b"], reduction="none", label_smoothing=0.1))
    assert float(step.loss(logits, b)) == pytest.approx(float(expected.mean()), rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["memmap", "folder"])
def test_a_run_with_augmentation_trains_and_validates_without_it(tmp_path: Path,
                                                                 cache_dir: Path, loader):
    from runner.tasks.train.validation import validation_config
    from tests.conftest import SMALL_DATASET, run_in_process

    over = [*SMALL_DATASET, f"loader={loader}", "dataset.crop=random", "logger=none",
            "diagnose=false", "run.steps=4", "task.augment.color_jitter=0.3",
            "task.augment.mixup=0.2", "task.augment.cutmix=1.0", "task.augment.erasing=0.25",
            "task.augment.auto=trivialaugment"]
    assert not validation_config(compose(over)).task.augment.active
    import runner.data.device.augment

    calls = []
    real = runner.data.device.augment.TrainAugment.__call__

    def counted(self, batch):
        calls.append(batch["image"].shape[0])
        real(self, batch)

    runner.data.device.augment.TrainAugment.__call__ = counted
    try:
        m = run_in_process(*over, "task.ema_decay=0.9", run_dir=tmp_path / "run")
    finally:
        runner.data.device.augment.TrainAugment.__call__ = real
    assert m["status"] == "ok" and m["loss_last"] is not None
    assert len(calls) == m["steps"]  # every training batch, on every storage
    # what the recipe costs, timed on its own: the augmentation, the optimizer, the EMA
    assert m["augment_ms"] > 0 and m["optimizer_ms"] > 0 and m["ema_ms"] > 0


@pytest.mark.slow
def test_one_cycle_takes_any_warm_up_and_short_plans():
    for warmup, total in ((1, 10), (1, 100), (0, 3), (5, 6)):
        step = TrainStep(small_model(), task(schedule=ScheduleName.onecycle,
                                             warmup_steps=warmup), total_steps=total)
        for batch in batches(total):
            step(batch)
        assert math.isfinite(step.lr)


def test_a_stop_in_the_middle_of_an_accumulation_resumes_the_same_update(tmp_path: Path):
    cfg = task(lr=0.1, accumulate=2, schedule=ScheduleName.cosine)
    data = batches(6)
    straight = TrainStep(small_model(), cfg, total_steps=6)
    for batch in data:
        straight(batch)
    first = TrainStep(small_model(), cfg, total_steps=3, plan_steps=6)
    for batch in data[:3]:  # stopped with one batch's gradients waiting
        first(batch)
    assert first.micro == 1
    path = checkpoint.save(tmp_path / "c.pt", first, 0.5, 3, {}, {})
    second = TrainStep(small_model(seed=9), cfg, total_steps=3, plan_steps=6)
    checkpoint.restore(second, torch.load(path, weights_only=True))
    for batch in data[3:]:
        second(batch)
    for p, q in zip(second.model.parameters(), straight.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_a_runs_last_partial_accumulation_is_applied():
    step = TrainStep(small_model(), task(lr=0.1, accumulate=4), total_steps=3)
    before = [p.detach().clone() for p in step.model.parameters()]
    for batch in batches(3):
        step(batch)
    assert all(torch.equal(p, b) for p, b in zip(step.model.parameters(), before))
    step.close(complete=True)
    assert not all(torch.equal(p, b) for p, b in zip(step.model.parameters(), before))


def test_an_adamw_checkpoint_of_another_device_loads_with_this_devices_options(tmp_path: Path):
    step = TrainStep(small_model(), task(optimizer=OptimizerName.adamw), total_steps=2)
    for batch in batches(2):
        step(batch)
    state = torch.load(checkpoint.save(tmp_path / "c.pt", step, 1, 2, {}, {}),
                       weights_only=True)
    for group in state["optimizer"]["param_groups"]:
        group["fused"] = True  # as a CUDA run wrote it
    again = TrainStep(small_model(), task(optimizer=OptimizerName.adamw), total_steps=2)
    checkpoint.restore(again, state)
    assert all(g["fused"] is None for g in again.optimizer.param_groups)
    again(batches(1)[0])  # and it steps


def test_a_new_optimizer_is_its_enum_value_and_one_record(monkeypatch):
    """RMSprop registered as an optimizer of its own (a value of an enum and its record):
    the run builds it with the keys its record names, one-cycle cycles its momentum as the
    record says, and a few steps train with it."""
    from enum import Enum

    from runner.tasks.train.optim import OPTIMIZERS, OptimizerKind

    extra = Enum("OptimizerName", {"rmsprop": "rmsprop"})
    monkeypatch.setitem(OPTIMIZERS, extra.rmsprop, OptimizerKind(
        extra.rmsprop, torch.optim.RMSprop, keys=("momentum", "eps"),
        cycles_momentum=lambda cfg: cfg.momentum > 0))
    cfg = task(optimizer=extra.rmsprop, lr=0.01, momentum=0.5, eps=1e-6,
               schedule=ScheduleName.onecycle)
    step = TrainStep(small_model(), cfg, total_steps=6)
    assert isinstance(step.optimizer, torch.optim.RMSprop)
    assert {g["eps"] for g in step.optimizer.param_groups} == {1e-6}
    assert step.schedule.cycle_momentum  # the record's answer, not SGD's
    before = [p.detach().clone() for p in step.model.parameters()]
    data = batches(6)
    for batch in data:
        step(batch)
    step.close()
    assert all(torch.isfinite(p).all() for p in step.model.parameters())
    assert any(not torch.equal(p, b) for p, b in zip(step.model.parameters(), before))
    assert step.schedule.last_epoch == 6
    for group in step.optimizer.param_groups:  # a resume sets the record's keys again
        group["eps"] = 1.0
    step.apply_config(rebuild_schedule=True, updates=6)
    assert {g["eps"] for g in step.optimizer.param_groups} == {1e-6}


def test_a_new_schedule_is_its_enum_value_and_one_record(monkeypatch):
    """An exponential decay registered as a schedule of its own runs after the warm-up,
    reading the key its record names."""
    from enum import Enum

    from runner.tasks.train.optim import SCHEDULES, ScheduleKind

    extra = Enum("ScheduleName", {"exponential": "exponential"})
    monkeypatch.setitem(SCHEDULES, extra.exponential, ScheduleKind(
        extra.exponential, lambda optimizer, cfg, span: torch.optim.lr_scheduler.ExponentialLR(
            optimizer, gamma=cfg.step_gamma), keys=("step_gamma",)))
    cfg = task(lr=0.1, schedule=extra.exponential, step_gamma=0.5, warmup_steps=2)
    step = TrainStep(small_model(), cfg, total_steps=6)
    lrs = []
    for batch in batches(6):
        lrs.append(step.lr)
        step(batch)
    assert lrs == pytest.approx([0.1 / 3, 0.1 * 2 / 3, 0.1, 0.05, 0.025, 0.0125])


def test_every_optimizer_and_schedule_has_a_record_whose_keys_are_task_keys():
    from runner.tasks.train.optim import OPTIMIZERS, SCHEDULES

    assert set(OPTIMIZERS) == set(OptimizerName) and set(SCHEDULES) == set(ScheduleName)
    fields = set(TaskConfig.__dataclass_fields__)
    for kind in [*OPTIMIZERS.values(), *SCHEDULES.values()]:
        assert set(kind.keys) <= fields, kind.name
    assert set(checkpoint.OPTIMIZER_KEYS) == {"task.weight_decay", "task.momentum",
                                              "task.nesterov", "task.betas", "task.eps"}


TRAIN_RUN = [*SMALL_DATASET, "logger=none", "diagnose=false", "run.timeline=false"]

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

@pytest.mark.slow
def test_a_resume_with_another_lr_and_a_longer_plan_applies_both(tmp_path: Path,
                                                                 cache_dir: Path, monkeypatch,
                                                                 caplog):
    """6 steps of cosine at task.lr=0.05, resumed with task.lr=0.5 over run.steps=12: steps
    7..12 run at the rates of a fresh cosine of 12 steps at 0.5 (not the checkpoint's 0.05,
    not a cosine of 6 steps climbing back from 0), and metrics.json's lr_last is the
    optimizer's."""
    schedule = ["task.schedule=cosine", "task.warmup_steps=2", "task.min_lr=0.001"]
    run_in_process(*TRAIN_RUN, *schedule, "task.lr=0.05", "run.steps=6", run_dir=tmp_path / "a")
    rates = Rates(monkeypatch)
    with caplog.at_level(logging.INFO, logger="runner"):
        resumed = run_in_process(*TRAIN_RUN, *schedule, "task.lr=0.5", "run.steps=12",
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
        more = run_in_process(*TRAIN_RUN, *schedule, "task.lr=0.5", "run.steps=14",
                              f"resume={tmp_path / 'b'}", run_dir=tmp_path / "c")
    monkeypatch.undo()
    assert more["status"] == "ok" and more["start_step"] == 12
    expected = fresh_rates(0.5, 14, schedule=_cosine(), warmup_steps=2, min_lr=0.001)
    assert [g[0] for g in rates.before] == pytest.approx(expected[12:14], rel=1e-12, abs=0)

def _cosine():
    from runner.config.schema import ScheduleName

    return ScheduleName.cosine

def test_a_resumed_step_takes_the_new_lr_and_plan_from_the_optimizer_step_it_reached(
        tmp_path: Path):
    """The same at the step's level (no run folder): a checkpoint of 4 of a 4-step plan at
    lr 0.1, restored into a step of an 8-step plan at lr 0.3 (one-cycle, which keeps its
    own rates in the optimizer's groups)."""
    from runner.config.schema import ScheduleName, TaskConfig, TaskName
    from runner.tasks import TrainStep, checkpoint

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

@pytest.mark.slow
def test_a_nan_loss_fails_the_run_at_its_step_and_keeps_the_good_checkpoint(
        tmp_path: Path, cache_dir: Path, monkeypatch):
    nan_from(monkeypatch, 5)
    run_dir = tmp_path / "run"
    error = None
    try:
        run_in_process(*TRAIN_RUN, "run.steps=10", "task.checkpoint_every_steps=2",
                       run_dir=run_dir)
    except Exception as e:  # the run's failure, re-raised after metrics.json is written
        error = e
    metrics = strict_json(run_dir / "metrics.json")
    assert metrics["status"] == "failed", metrics.get("reason")
    assert error is not None and metrics["reason"] == str(error)
    assert "step 5" in metrics["reason"] and "nan" in metrics["reason"], metrics["reason"]
    assert "\n" not in metrics["reason"]
    assert finite_state(run_dir / "checkpoint.pt")["steps"] == 4  # the last good one

@pytest.mark.slow
def test_a_nan_in_the_last_steps_fails_before_the_final_checkpoint(tmp_path: Path,
                                                                   cache_dir: Path,
                                                                   monkeypatch):
    """The last step's loss is NaN: no log point reads it before the run ends; the end
    reads it and writes no checkpoint of NaN weights over the epoch's."""
    from runner.common.errors import Diverged

    nan_from(monkeypatch, 16)
    run_dir = tmp_path / "run"
    with pytest.raises(Diverged):
        run_in_process(*TRAIN_RUN, "run.epochs=2", "task.checkpoint_every=1",
                       "run.log_every=100", "run.repeats=1", run_dir=run_dir)
    metrics = strict_json(run_dir / "metrics.json")
    assert metrics["status"] == "failed" and "step 16" in metrics["reason"], metrics
    assert finite_state(run_dir / "checkpoint.pt")["steps"] == 8

@pytest.mark.slow
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
        run_in_process(*TRAIN_RUN, "run.steps=10", "run.log_every=100", "run.repeats=1",
                       run_dir=run_dir)
    metrics = strict_json(run_dir / "metrics.json")
    assert metrics["status"] == "failed" and "step 3" in metrics["reason"], metrics
    assert not (run_dir / "checkpoint.pt").exists()

@pytest.mark.slow
def test_a_learning_rate_that_diverges_fails_the_run(tmp_path: Path, cache_dir: Path):
    """No injection: task.lr=1e30 blows the weights up within a few steps."""
    from runner.common.errors import Diverged

    run_dir = tmp_path / "run"
    with pytest.raises(Diverged):
        run_in_process(*TRAIN_RUN, "run.steps=12", "task.lr=1e30", run_dir=run_dir)
    metrics = strict_json(run_dir / "metrics.json")
    assert metrics["status"] == "failed" and "step " in metrics["reason"], metrics
    assert not (run_dir / "checkpoint.pt").exists()  # no checkpoint of blown-up weights

def test_the_step_fails_at_the_read_after_a_nan_and_names_the_first_such_step():
    from runner.common.errors import Diverged
    from runner.config.schema import TaskConfig, TaskName
    from runner.tasks import TrainStep

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


class FakeDDP(nn.Module):
    """DDP's interface: a ``no_sync`` context; the flag is read at forward and backward."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.local = False
        self.entered = 0
        self.forwards: list[bool] = []
        self.backwards: list[bool] = []
        next(module.parameters()).register_hook(self._backward)

    def _backward(self, grad: torch.Tensor) -> None:
        self.backwards.append(self.local)

    @contextlib.contextmanager
    def no_sync(self):
        self.local, self.entered = True, self.entered + 1
        try:
            yield
        finally:
            self.local = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards.append(self.local)
        return self.module(x)

# accumulate=3 over 7 batches: 1, 2, 4, 5 local; 3 and 6 end an update, 7 ends the run
LOCAL = [True, True, False, True, True, False, False]

def test_accumulated_batches_skip_the_all_reduce_but_an_updates_last_and_the_runs_last():
    ddp = FakeDDP(small_model())
    step = TrainStep(ddp, task(lr=0.1, accumulate=3), total_steps=7)
    for batch in batches(7):
        step(batch)
    assert ddp.forwards == LOCAL and ddp.backwards == LOCAL and ddp.entered == 4
    assert step.micro == 1  # the 7th batch waits for close
    step.close()
    assert step.micro == 0 and step.schedule.last_epoch == 3
    # behind torch.compile too (its wrapper hands no_sync through)
    assert TrainStep(torch.compile(FakeDDP(small_model())), task(accumulate=2),
                     total_steps=4)._no_sync is not None
    # a plain model: no context at all
    assert TrainStep(small_model(), task(accumulate=3), total_steps=7)._no_sync is None

def test_a_checkpoint_mid_accumulation_under_ddp_says_its_gradients_are_local(
        tmp_path: Path, caplog):
    step = TrainStep(FakeDDP(small_model()), task(lr=0.1, accumulate=3), total_steps=7)
    for batch in batches(4):
        step(batch)
    path = checkpoint.save(tmp_path / "c.pt", step, 0.5, 4, {}, {})
    state = checkpoint.load(path)
    assert state["micro"] == 1 and state["local_grads"] is True
    again = TrainStep(FakeDDP(small_model(1)), task(lr=0.1, accumulate=3), total_steps=3,
                      plan_steps=7)
    with caplog.at_level(logging.WARNING, logger="runner"):
        checkpoint.restore(again, state)
    assert again.micro == 1 and "rank 0's alone" in caplog.text
    for batch in batches(3):  # the resumed 5th batch is local, the 6th ends the update
        again(batch)
    assert again.model.forwards == [True, False, False]

@pytest.fixture
def gloo_world_of_one():
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()

@pytest.mark.ranks
def test_real_ddp_all_reduces_once_per_optimizer_step_and_trains_the_same(gloo_world_of_one):
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(small_model())
    step = TrainStep(ddp, task(lr=0.1, accumulate=3), total_steps=7)
    reduced: list[int] = []  # the batches (1-based) whose backward all-reduced

    def count(state, bucket):
        reduced.append(step.steps + 1)
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())  # world of one: the mean is the gradient itself
        return fut

    ddp.register_comm_hook(None, count)
    plain = TrainStep(small_model(), task(lr=0.1, accumulate=3), total_steps=7)
    for batch in batches(7):
        step(batch)
        plain(batch)
    step.close()
    plain.close()
    assert sorted(set(reduced)) == [3, 6, 7]
    for p, q in zip(ddp.module.parameters(), plain.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


QUICK = ["dataset.image_size=[16,16]", "loader.batch_size=4", "run.warmup_steps=1",
         "run.progress=false", "logger=none", "model=tiny", "loader.num_workers=0"]

@pytest.mark.slow
def test_training_says_model_classes_is_not_its_classes(image_tree: Path, tmp_path: Path,
                                                        caplog):
    """model.classes names an inference's outputs: a training run given it says, in one
    warning, that the data's classes are used (it was ignored without a word)."""
    with caplog.at_level(logging.WARNING, logger="runner"):
        run_in_process(f"dataset.path={image_tree}", "model.classes=[x]", "run.steps=2",
                       "diagnose=false", *QUICK, run_dir=tmp_path / "train")
    said = [r.getMessage() for r in caplog.records if "model.classes" in r.getMessage()]
    assert len(said) == 1 and "not used in training" in said[0] and "cat" in said[0], said


COMMON = ["logger=none", "diagnose=false", "run.timeline=false", "dataset.image_size=[32,32]",
          "loader.batch_size=16", "loader.shuffle=false", "run.warmup_steps=0",
          "run.progress=false"]

BROKEN = b"\xff\xd8\xff not really a JPEG"

def folder(root: Path, bad: range) -> Path:
    """48 images in sorted order (three classes of 16), those of ``bad`` undecodable."""
    files = {}
    for k in range(48):
        files[f"{'abc'[k // 16]}/{k:02d}.jpg"] = BROKEN if k in bad else \
            encode(photo(40, 52, k))
    return make_tree(root, files)

@pytest.mark.slow
def test_training_counts_an_epoch_with_an_undecodable_batch_whole(tmp_path: Path):
    data = folder(tmp_path / "data", range(16, 32))  # class b: every image broken
    over = ["task=train", *COMMON, f"dataset.path={data}", "run.epochs=2"]
    m = run_in_process(*over, run_dir=tmp_path / "run")
    assert m["status"] == "ok" and m["steps"] == 6 and len(m["skipped_files"]) == 16
    state = torch.load(tmp_path / "run" / "checkpoint.pt", map_location="cpu",
                       weights_only=False)
    assert state["epoch"] == 2 and state["steps"] == 6
    again = run_in_process(*over, "resume=auto", run_dir=tmp_path / "run")
    assert again["status"] == "ok" and again["steps"] == 6  # finished: not read again
    more = run_in_process(*over[:-1], "run.epochs=3", "resume=auto", run_dir=tmp_path / "run")
    assert more["start_step"] == 6 and more["steps"] == 3  # the third epoch alone


# --- a detector (runner/model/detectors.py): its own losses, the same bookkeeping ----------

DETECTOR = "fasterrcnn_mobilenet_v3_large_320_fpn"  # the quickest of the four
DET_SIZE = 32


def detector(seed: int = 0) -> nn.Module:
    from runner.model.detectors import build_detector

    torch.manual_seed(seed)
    return build_detector(DETECTOR, 3, (DET_SIZE, DET_SIZE), **SMALL_RCNN)


# fewer proposals and sampled boxes than torchvision's (2000 and 512): a step in a second
SMALL_RCNN = {"rpn_pre_nms_top_n_train": 100, "rpn_post_nms_top_n_train": 50,
              "rpn_pre_nms_top_n_test": 50, "rpn_post_nms_top_n_test": 20,
              "rpn_batch_size_per_image": 32, "box_batch_size_per_image": 32}


def detection_batches(n: int, size: int = 2, seed: int = 0) -> list[TensorDict]:
    """Batches in the data side's layout: boxes padded to the batch's most (one image of
    each batch without any), labels padded with -1, ``label`` 0."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        count = torch.randint(1, 4, (size,), generator=g)
        count[-1] = 0
        m = int(count.max())
        xy = torch.rand(size, m, 2, generator=g) * DET_SIZE / 2
        wh = 8 + torch.rand(size, m, 2, generator=g) * DET_SIZE / 3
        boxes = torch.cat([xy, xy + wh], dim=2)
        labels = torch.randint(0, 3, (size, m), generator=g)
        pad = torch.arange(m)[None, :] >= count[:, None]
        boxes[pad], labels[pad] = 0.0, -1
        out.append(TensorDict({
            "image": torch.randint(0, 256, (size, 3, DET_SIZE, DET_SIZE), generator=g,
                                   dtype=torch.uint8),
            "label": torch.zeros(size, dtype=torch.long), "index": torch.arange(size),
            "boxes": boxes, "box_labels": labels, "box_count": count}, batch_size=[size]))
    return out


@pytest.mark.slow  # over 10 s on 2 cores: out of the unit tier
def test_a_detectors_step_trains_on_the_sum_of_its_losses():
    from runner.model.detectors import total_loss

    data = detection_batches(2)
    reference = detector()
    torch.manual_seed(7)  # Faster R-CNN samples its proposals
    with torch.no_grad():
        first = total_loss(reference.train()(data[0]["image"], data[0]))
    step = TrainStep(detector(), task(lr=0.01, accumulate=2, clip_grad_norm=1.0),
                     total_steps=2)
    assert step.family.name is ModelFamily.detector
    before = [p.detach().clone() for p in step.model.parameters()]
    torch.manual_seed(7)
    step(data[0])
    assert step.micro == 1 and step.schedule.last_epoch == 0  # accumulated as a classifier's
    assert all(torch.equal(p, b) for p, b in zip(step.model.parameters(), before))
    step(data[1])
    assert step.micro == 0 and step.schedule.last_epoch == 1
    assert float(step.losses[0]) == pytest.approx(float(first), rel=1e-5)
    assert all(math.isfinite(v) for v in step.losses.tolist())
    assert step.read()["loss"] == pytest.approx(float(step.losses.mean()), rel=1e-6)
    assert any(not torch.equal(p, b) for p, b in zip(step.model.parameters(), before))
    # behind a compiled model's wrapper (its eager model as _orig_mod) still a detector's
    from runner.model.compile import Traced

    boxes = ModelFamily.detector
    assert TrainStep(Traced(reference, reference), task(), total_steps=1).family.name is boxes
    assert TrainStep(small_model(), task(), total_steps=1).family.name is not boxes


@pytest.mark.slow  # 8 steps of Faster R-CNN: 5 s on one core, 25-45 s on 2 loaded ones
def test_a_resumed_detector_run_gives_the_straight_runs_weights(tmp_path: Path):
    """Stopped after 2 of 4 steps (the EMA, a one-cycle schedule, Faster R-CNN's random
    proposal sampling: its random state restored) and resumed: the straight run's weights."""
    cfg = task(optimizer=OptimizerName.adamw, lr=0.001, schedule=ScheduleName.onecycle,
               ema_decay=0.5, clip_grad_norm=1.0)
    data = detection_batches(4, seed=1)
    straight = TrainStep(detector(), cfg, total_steps=4)
    torch.manual_seed(11)
    for batch in data:
        straight(batch)
    first = TrainStep(detector(), cfg, total_steps=2, plan_steps=4)
    torch.manual_seed(11)
    for batch in data[:2]:
        first(batch)
    path = checkpoint.save(tmp_path / "c.pt", first, 0.5, 2, {}, {})
    second = TrainStep(detector(seed=3), cfg, total_steps=2, plan_steps=4)
    state = torch.load(path, weights_only=False)
    checkpoint.restore(second, state)
    checkpoint.restore_rng(state)
    for batch in data[2:]:
        second(batch)
    assert second.lr == pytest.approx(straight.lr)
    for p, q in zip(second.model.state_dict().values(), straight.model.state_dict().values()):
        assert torch.allclose(p.float(), q.float(), atol=1e-6)
    for p, q in zip(second.ema.model.parameters(), straight.ema.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


@pytest.mark.parametrize("override, named", [
    ("task.augment.mixup=0.2", "task.augment.mixup=0.2"),
    ("task.augment.cutmix=1.0", "task.augment.cutmix=1.0"),
    ("compile=torchscript", "compile=torchscript"),  # inductor compiles its backbone
    ("loader.host_dtype=float16", "loader.host_dtype=float16"),
    ("task.best_metric=val_top5", "task.best_metric=val_top5"),
])
def test_a_detector_refuses_what_its_boxes_cannot_follow(override: str, named: str):
    from runner.common.errors import ConfigError
    from runner.tasks.train.training import check_target_task

    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        check_target_task(compose(["task=train", f"model.name={DETECTOR}",
                                     "dataset.targets=auto", override]))
    check_target_task(compose(["task=train", "model=tiny", override]))  # a classifier's


def test_a_detector_without_boxes_and_boxes_without_a_detector_are_refused():
    from runner.common.errors import ConfigError
    from runner.tasks.train.training import check_target_task

    with pytest.raises(ConfigError, match="set dataset.targets=auto"):
        check_target_task(compose(["task=train", f"model.name={DETECTOR}"]))
    with pytest.raises(ConfigError, match="model.name=tiny is not a detector"):
        check_target_task(compose(["task=train", "model=tiny", "dataset.targets=auto"]))
    check_target_task(compose(["task=train", "model=none", "dataset.targets=auto"]))


def test_a_detectors_epochs_record_map_and_keep_the_best_by_it():
    """on_epoch_end: val_map and val_map_50 per epoch (an epoch with nothing to measure,
    NaN, never the best), checkpoint-best.pt by val_map unless task.best_metric says."""
    from types import SimpleNamespace

    from runner.measure.metrics import NullLogger
    from runner.tasks.train.training import TrainTask

    def run(*overrides: str) -> tuple[TrainTask, list[int]]:
        figures = iter([{"map": math.nan, "map_50": math.nan}, {"map": 0.2, "map_50": 0.5},
                        {"map": 0.1, "map_50": 0.6}, {"map": 0.3, "map_50": 0.4}])
        written: list[int] = []
        train = TrainTask.__new__(TrainTask)
        train.config = compose(["task=train", f"model.name={DETECTOR}", *overrides])
        train.ctx = SimpleNamespace(logger=NullLogger(), data=SimpleNamespace(steps_per_epoch=2))
        train.validation = lambda model=None: next(figures)
        train.step, train.best, train.epoch_figures = SimpleNamespace(ema=None), None, []
        train.saves = SimpleNamespace(
            write=lambda step, done, per_epoch, losses, name: written.append(done // 2),
            after_epoch=lambda *args: None)
        for epoch in range(1, 5):
            train.on_epoch_end(epoch)
        return train, written

    from runner.tasks import results

    train, written = run()
    assert written == [2, 4] and train.best == 0.3
    got = results.epochs(train.epoch_figures)  # the figures metrics.json gets
    assert got["val_map"] == 0.3 and got["val_map_50"] == 0.4 and len(got["epochs"]) == 4
    assert math.isnan(got["epochs"][0]["val_map"])
    assert run("task.best_metric=val_map_50")[1] == [2, 3]


def test_a_detectors_ema_is_validated_as_a_detector():
    """The EMA's averaged network goes through validation behind a Detector of its own
    (padded predictions, the same uint8 layer): before any update it is the model's
    weights, so its figures are the model's."""
    from types import SimpleNamespace

    from runner.config.schema import AmpConfig, AmpName
    from runner.measure.metrics import NullLogger
    from runner.tasks.train.training import TrainTask
    from runner.tasks.train.validation import Validation

    pytest.importorskip("torchmetrics")
    step = TrainStep(detector(), task(ema_decay=0.5), total_steps=1)
    data = SimpleNamespace(device_batches=lambda: iter(detection_batches(1, seed=2)),
                           device=CPU, classes=["a", "b", "c"], close=lambda: None)
    train = TrainTask.__new__(TrainTask)
    train.config = compose(["task=train", f"model.name={DETECTOR}"])
    train.ctx = SimpleNamespace(logger=NullLogger(), data=SimpleNamespace(steps_per_epoch=1))
    train.validation = Validation(data, step.model, AmpConfig(AmpName.off), data.classes)
    train.step, train.best, train.epoch_figures, train.saves = step, None, [], None
    train.on_epoch_end(1)
    (row,) = train.epoch_figures
    assert set(row) == {"epoch", "val_map", "val_map_50", "val_ema_map", "val_ema_map_50"}
    for key in ("map", "map_50"):
        a, b = row[f"val_{key}"], row[f"val_ema_{key}"]
        assert a == b or (math.isnan(a) and math.isnan(b))
