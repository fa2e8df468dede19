"""Issue 42's three fixes, shown on the CPU: the EMA's update never syncs with the device
(foreach kernels, a host count), a checkpoint's random states are the rank's own device's
(a resume on fewer GPUs works), and DDP all-reduces once per accumulated optimizer step."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from runner.tasks import TrainStep, checkpoint
from runner.tasks.train.optim import AveragedNetwork, Ema
from tests.tasks.train.test_training import batches, small_model, task

# --- the EMA ----------------------------------------------------------------------------


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


# --- random states ----------------------------------------------------------------------


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


@pytest.fixture(autouse=True)
def keep_cpu_rng():
    state = torch.get_rng_state()
    yield
    torch.set_rng_state(state)


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


# --- DDP and gradient accumulation ------------------------------------------------------


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
