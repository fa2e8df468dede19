"""task=train as people train: the optimizer's groups, the schedule per optimizer step,
gradient accumulation and clipping, label smoothing, the EMA, all resumed exactly; the
recipes compose."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from runner.config.schema import OptimizerName, ScheduleName, TaskConfig, TaskName
from runner.job.compose import compose
from runner.model.networks import UInt8Input
from runner.tasks import TrainStep, checkpoint
from runner.tasks.train.optim import Ema, param_groups

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
    assert checkpoint.OPTIMIZER_KEYS == ("task.weight_decay", "task.momentum",
                                         "task.nesterov", "task.betas", "task.eps")
