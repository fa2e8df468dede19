"""Worker processes for one-off data preparation (default dataset, memmap, re-encoding)."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Iterator
from typing import Any


def parallel_imap(fn: Callable[[Any], Any], jobs: list, workers: int | None = None,
                  chunksize: int = 1, initializer: Callable[[], None] | None = None
                  ) -> Iterator[Any]:
    """``fn`` over ``jobs`` in forked worker processes, results in completion order.

    Fork: the workers inherit what the caller set up (a file mapping to write into, a
    storage to decode with) instead of receiving pickled copies. One worker (or one job)
    runs inline, without a pool.
    """
    workers = workers or min(os.cpu_count() or 1, len(jobs))
    if workers <= 1:
        yield from map(fn, jobs)
        return
    with mp.get_context("fork").Pool(workers, initializer=initializer) as pool:
        yield from pool.imap_unordered(fn, jobs, chunksize=chunksize)

