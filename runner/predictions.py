"""``task=infer`` output: top-k predictions written to predictions.csv by a thread pool.

The loop only starts a non-blocking device-to-host copy of a few small tensors and hands
them over; a writer thread waits for that copy (a CUDA event) and formats and writes the
rows, so disk writes never stall the device. Each batch becomes one part file, and ``close``
joins the parts in batch order into predictions.csv.
"""

from __future__ import annotations

import csv
import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from runner.config import TaskConfig, TaskName
from runner.data.storage.listing import printable
from runner.distributed import Ranks

HEADER = ("index,file,label,label_name,pred,pred_name,prob,topk_classes,topk_names,"
          "topk_probs\n")


class PredictionWriter:
    """Writes predictions off the loop's path.

    Args:
        run_dir: predictions.csv goes here.
        name_of: dataset index -> file name, for the ``file`` column.
        threads: writer threads.
        max_pending: batches in flight before ``submit`` waits (bounds host memory).
        file_name: the CSV's name in ``run_dir``.
        classes: class names, by index (the dataset's folders), for the ``*_name`` columns.
    """

    def __init__(self, run_dir: Path, name_of: Callable[[int], str], threads: int = 2,
                 max_pending: int = 16, file_name: str = "predictions.csv",
                 classes: list[str] | None = None):
        self.classes = list(classes or [])
        self.path = Path(run_dir) / file_name
        self.parts = Path(run_dir) / f".{Path(file_name).stem}.parts"
        self.parts.mkdir(parents=True, exist_ok=True)
        self.name_of = name_of
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="predictions")
        self.slots = threading.Semaphore(max_pending)
        self.futures: list[Future] = []
        self.rows = 0
        self.error: BaseException | None = None

    def submit(self, index: torch.Tensor, label: torch.Tensor, probs: torch.Tensor,
               classes: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Queue one batch: (N,) index and label, (N, k) top-k probabilities and classes;
        rows where ``valid`` is False (padding of a distributed shard) are left out here,
        on the host, so the device never syncs to filter them."""
        self._raise_failed()
        self.slots.acquire()
        fields = (index, label, probs.float(), classes) + ((valid,) if valid is not None else ())
        host = [t.to("cpu", non_blocking=True) for t in fields]
        ready = None
        if probs.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        part = self.parts / f"{len(self.futures):08d}.csv"
        self.futures.append(self.pool.submit(self._write, part, host, ready))

    def _write(self, part: Path, host: list[torch.Tensor], ready) -> int:
        try:
            if ready is not None:
                ready.synchronize()  # the copy above was asynchronous
            if len(host) == 5:  # drop padding rows
                keep = host.pop()
                host = [t[keep] for t in host]
            index, label, probs, classes = (t.tolist() for t in host)
            with open(part, "w", newline="", encoding="utf-8") as f:
                rows = csv.writer(f)
                name = self._class_name
                for i, y, p, c in zip(index, label, probs, classes):
                    rows.writerow([i, printable(self.name_of(i)), y, name(y), c[0], name(c[0]),
                                   f"{p[0]:.6f}", " ".join(map(str, c)),
                                   " ".join(printable(name(k)) for k in c),
                                   " ".join(f"{v:.6f}" for v in p)])
            return len(index)
        except BaseException as e:
            self.error = e
            raise
        finally:
            self.slots.release()

    def _class_name(self, k: int) -> str:
        return self.classes[k] if 0 <= k < len(self.classes) else str(k)

    def _raise_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"writing predictions failed: {self.error}") from self.error

    def close(self) -> int:
        """Wait for every write, join the parts into predictions.csv; returns the row count."""
        self.pool.shutdown(wait=True)
        self._raise_failed()
        self.rows = sum(f.result() for f in self.futures)
        parts = [self.parts / f"{k:08d}.csv" for k in range(len(self.futures))]
        join_csv(self.path, parts, header=HEADER)
        shutil.rmtree(self.parts, ignore_errors=True)
        return self.rows


def prediction_writers(task: TaskConfig, names: list[str], run_dir: Path, ranks: Ranks,
                       name_of: Callable[[int], str], classes: list[str]
                       ) -> dict[str, PredictionWriter]:
    """``task=infer``: a writer per model, ``predictions.csv`` (``predictions_<model>.csv``
    with several); under torch.distributed one file per rank, merged at the end."""
    if task.name is not TaskName.infer or not task.write_predictions:
        return {}
    writers = {}
    for name in names:
        file = "predictions.csv" if len(names) == 1 else f"predictions_{name}.csv"
        if ranks.enabled:
            file = rank_file(file, ranks.rank)
        writers[name] = PredictionWriter(run_dir, name_of, task.writer_threads,
                                         file_name=file, classes=classes)
    return writers


def rank_file(file_name: str, rank: int) -> str:
    """``predictions.csv`` -> ``predictions.rank1.csv``: one file per rank."""
    path = Path(file_name)
    return f"{path.stem}.rank{rank}{path.suffix}"


def merge_rank_files(run_dir: Path, world: int) -> None:
    """Join every rank's prediction files into one, rank by rank, header once."""
    for first in sorted(Path(run_dir).glob("*.rank0.csv")):
        base = first.name.replace(".rank0.csv", ".csv")
        parts = [first.with_name(base.replace(".csv", f".rank{r}.csv")) for r in range(world)]
        with open(first, encoding="utf-8") as f:
            header = f.readline()
        join_csv(first.with_name(base), parts, header=header, skip_header=True)
        for part in parts:
            part.unlink()


def join_csv(target: Path, parts: list[Path], header: str, skip_header: bool = False) -> None:
    """``header`` and then every part, in order, written whole into ``target``."""
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as out:
        out.write(header)
        for part in parts:
            with open(part, encoding="utf-8") as f:
                if skip_header:
                    f.readline()
                shutil.copyfileobj(f, out)
    os.replace(tmp, target)
