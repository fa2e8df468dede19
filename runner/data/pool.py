"""Worker processes for one-off data preparation (default dataset, memmap, re-encoding)."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from runner.data.threads import cores


class WorkerDied(RuntimeError):
    """A worker process ended abruptly (killed by a signal: SIGKILL when out of memory,
    SIGBUS when a mapped file could not be written, SIGSEGV in a decoder)."""


def _die_with_parent(parent: int, initializer: Callable[[], None] | None) -> None:
    """Worker start-up: end when the process that started the pool ends, however it ends.

    A killed parent (SIGKILL, the OOM killer) cannot shut its pool down; without this its
    workers would wait on their queue for ever, holding the terminal's pipes open.
    """
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(1)
    if initializer is not None:
        initializer()


def _run_all(fn: Callable[[Any], Any], jobs: list) -> list:
    return [fn(job) for job in jobs]


def parallel_imap(fn: Callable[[Any], Any], jobs: list, workers: int | None = None,
                  chunksize: int = 1, initializer: Callable[[], None] | None = None
                  ) -> Iterator[Any]:
    """``fn`` over ``jobs`` in forked worker processes, results in completion order.

    Fork: the workers inherit what the caller set up (a file mapping to write into, a
    storage to decode with) instead of receiving pickled copies. One worker (or one job)
    runs inline, without a pool. A worker that dies raises ``WorkerDied`` at once: a
    ``multiprocessing.Pool`` would wait for its result for ever. At most two chunks per
    worker are in flight, so stopping early (an error, Ctrl-C) waits for little.
    """
    workers = workers or min(cores(), len(jobs))
    if workers <= 1:
        yield from map(fn, jobs)
        return
    chunks = [jobs[k : k + chunksize] for k in range(0, len(jobs), chunksize)]
    pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("fork"),
                               initializer=_die_with_parent, initargs=(os.getpid(), initializer))
    pending: set = set()
    try:
        queued = iter(chunks)
        for chunk in queued:
            pending.add(pool.submit(_run_all, fn, chunk))
            if len(pending) >= 2 * workers:
                break
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                yield from future.result()
                chunk = next(queued, None)
                if chunk is not None:
                    pending.add(pool.submit(_run_all, fn, chunk))
    except BrokenProcessPool as e:
        codes = [p.exitcode for p in getattr(pool, "_processes", {}).values()
                 if p.exitcode not in (None, 0)]
        raise WorkerDied(
            f"a worker process died (exit codes {codes or 'unknown'}; a negative code is the "
            "signal that killed it: -9 out of memory, -7 a mapped file that could not be "
            "written, -11 a crash in native code); what finished before it is kept") from e
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
