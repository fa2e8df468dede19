"""amp=fp16 training: a GradScaler's skipped first step never corrupts the optimizer (the
fused SGD kernel runs on the CPU too, so this is tested without a GPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from runner.config.schema import TaskConfig, TaskName
from runner.tasks.train.optim import build_optimizer

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
