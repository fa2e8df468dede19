"""amp=fp16 training: a GradScaler's skipped first step never corrupts the optimizer (the
fused SGD kernel runs on the CPU too, so this is tested without a GPU)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from runner.config.schema import ModelConfig, TaskConfig, TaskName
from runner.model.networks import build_model
from runner.tasks import TrainStep
from runner.tasks.train.optim import AveragedNetwork, Ema, build_optimizer, optimizer_options

# weight decay on every parameter, as the reference SGD below has it
CFG = TaskConfig(TaskName.train, lr=0.1, momentum=0.9, weight_decay=5e-4,
                 decay_norm_and_bias=True)
CPU = torch.device("cpu")


def poison_the_allocator(model: nn.Module) -> None:
    """Free NaN-filled blocks the size of each parameter, so a buffer made with
    ``empty_like`` next is likely to start as NaN rather than as fresh zeros."""
    blocks = [torch.full_like(p, float("nan")) for p in model.parameters() for _ in range(4)]
    del blocks


def train(model: nn.Module, optimizer, steps: int, overflow_at: set[int]) -> list[float]:
    """``steps`` steps under a GradScaler; at the steps in ``overflow_at`` one gradient is
    made infinite after backward, as an fp16 overflow would."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for k in range(steps):
        x = torch.randn(32, 16, generator=generator)
        y = torch.randint(0, 4, (32,), generator=generator)
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if k in overflow_at:
            next(model.parameters()).grad[0, 0] = float("inf")
        if k == 0:
            poison_the_allocator(model)
        scaler.step(optimizer)
        scaler.update()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "for-loop"])
def test_an_overflowing_first_step_is_skipped_and_the_next_steps_match_a_reference(fused):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    ours = build_optimizer(model, CFG, CPU, options={"fused": fused} if fused else
                           {"foreach": False})
    theirs = torch.optim.SGD(reference.parameters(), lr=CFG.lr, momentum=CFG.momentum,
                             weight_decay=CFG.weight_decay, foreach=False)
    ours_losses = train(model, ours, 5, overflow_at={0})
    reference_losses = train(reference, theirs, 5, overflow_at={0})
    assert all(torch.isfinite(torch.tensor(ours_losses)))
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p, q, atol=1e-6), (p - q).abs().max()
    assert ours_losses == pytest.approx(reference_losses, abs=1e-6)


def test_momentum_buffers_start_at_zero():
    model = nn.Linear(3, 2)
    optimizer = build_optimizer(model, CFG, CPU)
    buffers = [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
    assert all(b is not None and not b.any() for b in buffers)


class Ops(TorchDispatchMode):
    """Every aten op run inside, with the devices of its tensor arguments."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, set[str]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        devices: set[str] = set()

        def visit(x):
            if isinstance(x, torch.Tensor):
                devices.add(str(x.device))
            elif isinstance(x, (list, tuple)):
                for y in x:
                    visit(y)

        visit(args)
        visit(list((kwargs or {}).values()))
        self.ops.append((str(func), devices))
        return func(*args, **(kwargs or {}))

def normed(layers: int, seed: int = 0) -> nn.Module:
    """Linear + batch norm blocks: float parameters and buffers, and an integer buffer
    (num_batches_tracked) per block."""
    torch.manual_seed(seed)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(4, 4),
                                                               nn.BatchNorm1d(4))])

def ops_of_updates(layers: int) -> list[list[tuple[str, set[str]]]]:
    net = normed(layers)
    ema = Ema(net, 0.99)
    out = []
    for _ in range(3):  # the first update (a copy), then two averaging ones
        with torch.no_grad():
            for t in [*net.parameters(), *net.buffers()]:
                t.add_(1)
        with Ops() as seen:
            ema.update(net)
        out.append(seen.ops)
    return out

def test_an_ema_update_reads_nothing_back_moves_nothing_and_is_one_kernel_per_kind():
    small, large = ops_of_updates(1), ops_of_updates(12)
    for ops in small + large:
        names = [name for name, _ in ops]
        assert not any("_local_scalar_dense" in n or "item" in n or "is_nonzero" in n
                       for n in names), names  # nothing read back to the host
        assert not any("_to_copy" in n or n.startswith("aten.copy_") or "_copy_from" in n
                       for n in names), names  # nothing moved
        assert not any(n.split(".")[1] in ("scalar_tensor", "lift_fresh", "empty", "zeros",
                                           "full", "ones", "detach")
                       for n in names), names  # no tensor made or detached per update
        assert all(len(devices) <= 1 for _, devices in ops)  # never across devices
        assert all(n.startswith("aten._foreach_") for n in names), names
    # as many ops for 12 blocks (48 parameters and buffers) as for one: foreach kernels
    assert [len(ops) for ops in small] == [len(ops) for ops in large]
    # the averaging updates: floats lerped, the integer count copied
    assert sorted(name for name, _ in small[1]) == ["aten._foreach_copy_.default",
                                                    "aten._foreach_lerp_.Scalar"]

def test_the_ema_is_the_warmed_up_average_of_parameters_and_buffers():
    decay = 0.2  # the cap is reached at the third update: min(0.2, 3 / 12)
    net = normed(1)
    ema = Ema(net, decay)
    tensors = dict(net.named_parameters()) | dict(net.named_buffers())
    expected: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(0)
    for n in range(5):
        with torch.no_grad():
            for t in tensors.values():
                if t.is_floating_point():
                    t.copy_(torch.randn(t.shape, generator=g))
                else:
                    t.add_(3)  # batch norm's count
        d = min(decay, (1 + n) / (10 + n))
        for name, t in tensors.items():
            if n == 0 or not t.is_floating_point():  # the first update copies; counts too
                expected[name] = t.detach().clone()
            else:
                expected[name] = d * expected[name] + (1 - d) * t.detach()
        ema.update(net)
        assert ema.updates == n + 1
    averaged = dict(ema.model.module.named_parameters()) | dict(
        ema.model.module.named_buffers())
    assert set(averaged) == set(expected)
    for name, value in expected.items():
        assert torch.allclose(averaged[name], value, atol=1e-6), name
    assert int(averaged["1.num_batches_tracked"]) == 15
    assert ema.model.module is not net and not any(
        p.requires_grad for p in ema.model.parameters())

def test_an_ema_loads_an_averaged_model_checkpoint_and_its_own(tmp_path: Path):
    from torch.optim.swa_utils import AveragedModel

    net = normed(2)
    old = AveragedModel(net, use_buffers=True)  # what the runner saved before
    for _ in range(3):
        with torch.no_grad():
            for p in net.parameters():
                p.mul_(0.9)
        old.update_parameters(net)
    old_state = {"model": old.state_dict(), "updates": 3}
    assert "n_averaged" in old_state["model"]
    ema = Ema(normed(2, seed=5), 0.9)
    ema.load_state_dict(old_state)
    assert ema.updates == 3
    for (name, a), b in zip(ema.model.state_dict().items(), old.module.state_dict().values()):
        assert torch.equal(a, b), name

    # the new format: AveragedModel's keys (module.<name>) without n_averaged
    torch.save(ema.state_dict(), tmp_path / "ema.pt")
    saved = torch.load(tmp_path / "ema.pt", weights_only=True)
    assert set(saved["model"]) == {f"module.{k}" for k in net.state_dict()}
    again = Ema(normed(2, seed=7), 0.9)
    again.load_state_dict(saved)
    assert again.updates == 3
    for a, b in zip(again.model.state_dict().values(), ema.model.state_dict().values()):
        assert torch.equal(a, b)
    x = torch.randn(3, 4)
    again.model.eval()
    assert isinstance(again.model, AveragedNetwork)
    assert torch.equal(again.model(x), again.model.module(x))  # called like the network


def test_fp16_training_takes_the_fused_no_sync_optimizer_on_cuda():
    assert optimizer_options(torch.device("cuda")) == {"fused": True}
    assert optimizer_options(CPU) == {}
    step = TrainStep(build_model(ModelConfig("tiny"), 3, CPU), TaskConfig(TaskName.train), 4)
    assert not step.optimizer.defaults.get("fused")
