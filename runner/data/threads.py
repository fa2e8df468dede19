"""Cores and threads: how many cores this process may use, and how helper threads share them.

Every part of the data path that sizes a pool (decode threads, conversion workers, the
default dataset's generator, the stage probes of the verdict) asks ``cores()``, which honours
the CPU affinity mask (``taskset``, a container's cpuset, a SLURM allocation);
``os.cpu_count()`` counts the machine's cores and would oversubscribe such a process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch


def cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def uses_openmp() -> bool:
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def one_core_for_this_thread() -> None:
    """Run this helper thread's torch ops on one core, leaving the main thread's alone.

    With OpenMP, PyTorch's default CPU backend, every thread that runs a parallel op gets
    its own team of worker threads, and the main thread's team spins between ops: on a
    small machine the two teams fight for the cores (measured here: a batched gather ran at
    15,000 images/s from a second thread, 120,000 from the main thread). The OpenMP thread
    count is per thread; ``torch.set_num_threads`` also sets the default that a thread
    copies the first time it asks, so the caller fixes the main thread's count before this
    runs (``main_thread_count``), and restores it when its helpers end.
    """
    if uses_openmp():
        torch.set_num_threads(1)


def main_thread_count() -> int:
    """The main thread's intra-op thread count, fixed now (before helper threads start and
    change the default they copy); hand it to ``restore_thread_count`` afterwards."""
    return torch.get_num_threads()


def restore_thread_count(count: int) -> None:
    """The default thread count back to ``count`` for threads started later."""
    if uses_openmp():
        torch.set_num_threads(count)


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads (None: as it is)."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
