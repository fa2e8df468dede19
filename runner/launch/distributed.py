"""More than one device: torch.distributed under ``torchrun`` (or a SLURM job via submitit).

``torchrun --nproc_per_node=N -m runner ...`` starts N copies of the runner; each finds its
rank in the environment, joins a process group (gloo on CPU, nccl on CUDA), drives one
device, loads its own shard of every epoch (``runner.data.loading.loader.BatchOrder``) and trains one
DistributedDataParallel replica. Rank 0 alone writes the run's outputs, with figures
gathered from every rank. Each job of a sweep creates and destroys its own group.

Every rank runs the same number of batches (training drops what no whole global batch
holds; validation and inference pad and mask), so no collective waits on a rank that ran
out. On several nodes (``--nnodes``) a rank also knows its node (torchrun's GROUP_RANK,
else NODE_RANK) and its place on it (LOCAL_RANK of LOCAL_WORLD_SIZE): the ranks of a node
sit side by side in each global batch (``Ranks.slot``), so a sharded storage deals each
node its own lanes of shards and the node fetches about its share of a bucket, into a
cache its ranks share (runner/data/order.py, runner/data/sources/shardcache.py). A checkpoint
resumed on another world size keeps its global batch (runner/tasks/checkpoint.py).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import hashlib
import itertools
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ranks:
    """Where this process stands: ``rank`` of ``world`` overall, ``local`` of
    ``local_world`` on its node, node ``node`` (of ``nodes``)."""

    rank: int = 0
    world: int = 1
    local: int = 0
    node: int = 0
    local_world: int = 1
    place: int | None = None  # node x local_world + local, where the launcher says both

    @property
    def nodes(self) -> int:
        return max(1, self.world // self.local_world)

    @property
    def slot(self) -> int:
        """This rank's place in a global batch: the ranks of one node side by side (its
        lanes of a sharded storage, runner/data/order.py), whatever ranks they were given."""
        return self.rank if self.place is None else self.place

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def local_main(self) -> bool:
        return self.local == 0


def ranks_from_env() -> Ranks:
    """torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK), else a multi-task SLURM job
    started by submitit (whose helper exports the same variables), else one process."""
    env = os.environ
    if "RANK" not in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        with contextlib.suppress(Exception):  # not inside a submitit job: one process
            from submitit.helpers import TorchDistributedEnvironment

            TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local, local_world = int(env.get("LOCAL_RANK", "0")), int(env.get("LOCAL_WORLD_SIZE", "0"))
        if not local_world or world % local_world:  # not said, or unequal nodes: one node
            return Ranks(rank, world, local, 0, world)
        # torchrun's GROUP_RANK (its node's place in the rendezvous), else NODE_RANK
        node = int(env.get("GROUP_RANK", env.get("NODE_RANK", rank // local_world)))
        return Ranks(rank, world, local, node, local_world, node * local_world + local)
    return Ranks()


# long enough for the local main rank to decode a large dataset while the others wait
TIMEOUT = datetime.timedelta(hours=2)

_store: dist.Store | None = None  # the rendezvous store, one connection per process
_jobs = itertools.count()  # jobs run in the same order on every rank: the same numbers
_job_view: dist.Store | None = None  # the current job's prefix of the store


def _job_store(ranks: Ranks) -> dist.Store:
    """This job's view of the rendezvous store: its own key prefix.

    Every job of a sweep joins a new group on the same store; under one prefix, a rank
    would read a peer's address left over from the previous job and fail to connect.
    """
    global _store, _job_view
    if _store is None:
        agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun
        _store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                               ranks.world, is_master=ranks.main and not agent_hosts,
                               timeout=TIMEOUT)
    _job_view = dist.PrefixStore(f"runner/job{next(_jobs)}", _store)
    return _job_view


@contextlib.contextmanager
def process_group(ranks: Ranks, device_type: str) -> Iterator[None]:
    """Join the group for one job and leave it cleanly afterwards (also on errors). A rank
    that fails posts its reason to the store before it leaves (``peer_failure``)."""
    if not ranks.enabled:
        yield
        return
    backend = "nccl" if device_type == "cuda" else "gloo"
    device = {"device_id": torch.device("cuda", torch.cuda.current_device())} \
        if backend == "nccl" else {}
    dist.init_process_group(backend=backend, store=_job_store(ranks), rank=ranks.rank,
                            world_size=ranks.world, timeout=TIMEOUT, **device)
    log.info("rank %d of %d joined a %s process group", ranks.rank, ranks.world, backend)
    try:
        yield
        dist.barrier()  # leave together: no rank starts the next job's group alone
    except BaseException as e:
        from runner.launch.outcome import one_line

        if not isinstance(e, KeyboardInterrupt):  # a signal stops every rank: no failure
            post_failure(ranks, f"rank {ranks.rank} failed: {one_line(e)}")
        raise
    finally:
        dist.destroy_process_group()


def post_failure(ranks: Ranks, reason: str) -> None:
    """Leave this rank's failure in the rendezvous store, which outlives the rank, in the
    order failures happened (the store's counter): the peers of a failing rank see only a
    closed connection, or torchrun's SIGTERM; rank 0 reads the first real reason."""
    if _job_view is None:
        return
    with contextlib.suppress(Exception):
        order = _job_view.add("failures", 1)
        _job_view.set(f"failed/{order}", reason)


def agree_to_stop(ranks: Ranks, mine: bool, device: torch.device) -> bool:
    """Whether any rank was asked to stop (a collective: every rank calls it at the same
    step, where the loop synchronizes anyway)."""
    flag = torch.tensor([int(mine)], device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())  # note: a sync point, at a log point only


@contextlib.contextmanager
def agreed_stops(ranks: Ranks, signals: Any, device: torch.device
                 ) -> Iterator[tuple[Any, bool]]:
    """While the block (the loop) runs, signals (``runner.launch.outcome.Signals``) are only
    recorded, and the loop stops between two steps, never inside one: a stop in the middle
    of a step (after the optimizer's update, before the step is counted) would leave a
    checkpoint one update behind its weights. Yields the loop's ``stop_requested`` and
    whether to ask it after every step (one process) or only at log points (torch.distributed:
    the ranks agree there, all at the same step, with one small all-reduce)."""
    if signals is None:
        yield None, False
        return
    signals.defer = True

    def stop_requested() -> str | None:
        if not ranks.enabled:
            return signals.received
        if agree_to_stop(ranks, signals.received is not None, device):
            return signals.received or "a signal to another rank"
        return None

    try:
        yield stop_requested, not ranks.enabled
    finally:
        signals.defer = False


def leave_together(ranks: Ranks, timeout: float = 120.0) -> None:
    """Stopped by a signal: wait (through the store, no collective) until every rank has
    stopped, so none exits while rank 0 still writes the checkpoint and the figures
    (torchrun stops the other workers as soon as one exits)."""
    if _job_view is None:
        return
    with contextlib.suppress(Exception):
        _job_view.add("stopped", 1)
        deadline = time.monotonic() + timeout
        while _job_view.add("stopped", 0) < ranks.world and time.monotonic() < deadline:
            time.sleep(0.05)


def first_failure(wait: float = 3.0) -> str | None:
    """The first failure any rank of this job posted, waiting up to ``wait`` seconds for
    one (a peer's failure can reach this rank as an echo before the peer posts it)."""
    if _job_view is None:
        return None
    deadline = time.monotonic() + wait
    with contextlib.suppress(Exception):
        while not _job_view.check(["failed/1"]):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)
        return _job_view.get("failed/1").decode(errors="replace")
    return None


def barrier(ranks: Ranks) -> None:
    if ranks.enabled:
        dist.barrier()


def gather(ranks: Ranks, value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (just ``[value]`` without a group)."""
    if not ranks.enabled:
        return [value]
    out: list[Any] = [None] * ranks.world
    dist.all_gather_object(out, value)
    return out


def broadcast(ranks: Ranks, value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    if not ranks.enabled:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def parameter_digest(model: torch.nn.Module) -> str:
    """A hash of every parameter: equal on every rank when the replicas are in sync."""
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def local_module(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module inside torch.compile and DistributedDataParallel wrappers (to run
    it in one process, with no collectives)."""
    from torch.nn.parallel import DistributedDataParallel

    model = getattr(model, "_orig_mod", model)
    return model.module if isinstance(model, DistributedDataParallel) else model


def scratch_dirs_for_other_ranks(argv: list[str]) -> list[str]:
    """Under torchrun only rank 0 writes into outputs/: the other ranks' Hydra folders (its
    config copies and log) go to a scratch folder instead."""
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        return argv
    scratch = tempfile.mkdtemp(prefix=f"runner-rank{rank}-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    kept = [a for a in argv if a.split("=", 1)[0].lstrip("+")
            not in ("hydra.run.dir", "hydra.sweep.dir")]
    return [*kept, f"hydra.run.dir={scratch}", f"hydra.sweep.dir={scratch}"]


def pick_device(want: str, ranks: Ranks) -> torch.device:
    """The device a run asks for (``auto``: CUDA when there is one), one GPU per local rank
    (torchrun, SLURM); an ``Unavailable`` when it asks for CUDA on a machine without."""
    from runner.common.errors import Unavailable

    if want == "cuda" and not torch.cuda.is_available():
        raise Unavailable("device=cuda but no CUDA device is available here")
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want != "cuda":
        return torch.device(want)
    device = torch.device("cuda", ranks.local % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def replicate(model: torch.nn.Module, ranks: Ranks, device: torch.device) -> torch.nn.Module:
    """A DistributedDataParallel replica of ``model`` for training under torch.distributed."""
    if not ranks.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index]
                                   if device.type == "cuda" else None)
