"""``task=infer``'s top-k CSV: its columns, its rows, its parts joined, its ranks merged.

What is written and when is runner/tasks/infer/outputs.py's; this module is the CSV format."""

from __future__ import annotations

import csv
import io
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runner.common.atomic import replacing
from runner.common.text import printable

HEADER = ("index,file,label,label_name,pred,pred_name,prob,topk_classes,topk_names,"
          "topk_probs\n")


def csv_rows(f: Any, index: list[int], label: list[int], probs: list[list[float]],
             classes: list[list[int]], name_of: Callable[[int], str],
             model_name: Callable[[int], str], dataset_name: Callable[[int], str]) -> None:
    """One batch's rows (HEADER's columns) into the open text file ``f``: ``label_name`` is
    the dataset's name of the label, ``pred_name``/``topk_names`` the model's. Rows end in
    ``\\n``; a name with a newline, a carriage return, a comma or a quote is quoted (the csv
    module's rule), so it is read back whole by a CSV reader (opened with ``newline=""``)."""
    buf = io.StringIO()
    rows = csv.writer(buf)  # its "\r\n" terminator: fields with \r or \n are quoted
    for i, y, p, c in zip(index, label, probs, classes):
        buf.seek(0)
        buf.truncate()
        rows.writerow([i, printable(name_of(i)), y, printable(dataset_name(y)), c[0],
                       printable(model_name(c[0])), f"{p[0]:.6f}", " ".join(map(str, c)),
                       " ".join(printable(model_name(k)) for k in c),
                       " ".join(f"{v:.6f}" for v in p)])
        f.write(buf.getvalue()[:-2] + "\n")


def rank_file(file_name: str, rank: int) -> str:
    """``predictions.csv`` -> ``predictions.rank1.csv``: one file per rank."""
    path = Path(file_name)
    return f"{path.stem}.rank{rank}{path.suffix}"


def merge_rank_files(run_dir: Path, world: int) -> None:
    """Join every rank's prediction files into one, rank by rank: the CSVs (top-k,
    detections) with their header once, the COCO results files (``*.rank<r>.json``) as
    one array."""
    from runner.tasks.infer.coco_results import join_results

    for first in sorted(Path(run_dir).glob("*.rank0.json")):
        parts = [first.with_name(first.name.replace(".rank0.json", f".rank{r}.json"))
                 for r in range(world)]
        join_results(first.with_name(first.name.replace(".rank0.json", ".json")),
                     [p for p in parts if p.is_file()])
        for part in parts:
            part.unlink(missing_ok=True)
    for first in sorted(Path(run_dir).glob("*.rank0.csv")):
        base = first.name.replace(".rank0.csv", ".csv")
        parts = [first.with_name(base.replace(".csv", f".rank{r}.csv")) for r in range(world)]
        with open(first, encoding="utf-8", newline="") as f:
            header = f.readline()
        join_csv(first.with_name(base), parts, header=header, skip_header=True)
        for part in parts:
            part.unlink()


def join_csv(target: Path, parts: list[Path], header: str, skip_header: bool = False) -> None:
    """``header`` and then every part, in order, written whole into ``target``: byte for
    byte (``newline=""``: a carriage return inside a quoted name stays one)."""
    with replacing(target) as tmp, open(tmp, "w", encoding="utf-8", newline="") as out:
        out.write(header)
        for part in parts:
            with open(part, encoding="utf-8", newline="") as f:
                if skip_header:
                    f.readline()
                shutil.copyfileobj(f, out)
