"""Cores and threads: how many cores this process may use, and how helper threads share them.

Every part of the data path that sizes a pool (decode threads, conversion workers, the
default dataset's generator, the stage probes of the verdict) asks ``cores()``, which honours
the CPU affinity mask (``taskset``, a container's cpuset, a SLURM allocation);
``os.cpu_count()`` counts the machine's cores and would oversubscribe such a process.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

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


def cuda_index(device: torch.device) -> int:
    """The index of a CUDA device: an index-less ``cuda`` is the current device of the
    thread that asks (ask on the main thread, before helper threads start)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def bind_cuda(index: int | None) -> None:
    """Make CUDA device ``index`` this helper thread's current device (None: nothing to
    bind). A new thread starts on device 0: without this, a thread that launches copies or
    records events under torchrun on several GPUs would open a context on GPU 0."""
    if index is not None:
        torch.cuda.set_device(index)  # an int: torch refuses an index-less device here


def main_thread_count() -> int:
    """The main thread's intra-op thread count, fixed now (before helper threads start and
    change the default they copy); hand it to ``restore_thread_count`` afterwards."""
    return torch.get_num_threads()


def restore_thread_count(count: int) -> None:
    """The default thread count back to ``count`` for threads started later."""
    if uses_openmp():
        torch.set_num_threads(count)


@contextlib.contextmanager
def one_core_pool(threads: int, name: str = "runner") -> Iterator[ThreadPoolExecutor]:
    """A pool of ``threads`` helper threads, each running torch ops on one core; when it
    ends (its pending work cancelled), later threads get the main thread's count again."""
    count = main_thread_count()
    pool = ThreadPoolExecutor(threads, thread_name_prefix=name,
                              initializer=one_core_for_this_thread)
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        restore_thread_count(count)


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


# A copy (a gather) smaller than this runs in the caller's thread. Measured on the 2-core
# CI machine (tests' neighbours busy): handing a gather to two threads and waiting costs
# ~45 us; gathers of 0.01-4 MB took 4-110 us inline and 46-190 us through the threads
# (1.7-12x slower); only past ~10 MB did the threads come within 10% (a copy is bound by
# memory bandwidth, which a second core shares). Inline, the copy runs on one core, as
# the threads' do, so a busy machine cannot stall it on an OpenMP team either.
POOL_MIN_BYTES = 4 << 20


class RowPool:
    """Row-wise work on a batch (a gather, crops) split over the cores by the runner's own
    threads, each running torch ops on one core.

    Why not torch's own intra-op threads: their OpenMP teams wait for each other at every
    op's end by spinning, and when another process shares the cores (a second job, a rank
    without ``OMP_NUM_THREADS``) one descheduled team member stalls all the others. Measured
    here beside a two-thread matmul loop on 2 cores: a batched gather of 64 images at
    5,000-19,000 images/s through OpenMP, 45,000 through two such threads. The threads
    release the GIL inside the ops, so on an idle machine they use every core too.

    Args:
        threads: how many (default: the cores this process may use).
        min_rows: batches of fewer rows than this per thread run in the caller's thread.
    """

    def __init__(self, threads: int | None = None, min_rows: int = 4):
        self.threads = threads or cores()
        self.min_rows = min_rows
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                count = main_thread_count()  # fixed before the helpers change the default
                self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="runner-rows",
                                                    initializer=one_core_for_this_thread)
                ready = threading.Barrier(self.threads)
                for f in [self._executor.submit(ready.wait) for _ in range(self.threads)]:
                    f.result()  # every thread started, and set to one core
                restore_thread_count(count)
            return self._executor

    def run(self, fn: Callable[[int, int], object], rows: int, nbytes: int | None = None) -> None:
        """``fn(start, end)`` over ``rows`` rows, one contiguous slice per thread; in the
        caller's thread when the work is a copy of fewer than ``POOL_MIN_BYTES`` bytes
        (``nbytes``): a hand-off to the threads and back costs more than such a copy."""
        parts = min(self.threads, rows // self.min_rows)
        if parts <= 1 or (nbytes is not None and nbytes < POOL_MIN_BYTES):
            with torch_threads(1):  # the caller's thread, on one core too
                fn(0, rows)
            return
        step = -(-rows // parts)
        futures = [self._pool().submit(fn, a, min(a + step, rows)) for a in range(0, rows, step)]
        for f in futures:
            f.result()

    def close(self) -> None:
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
