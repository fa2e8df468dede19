"""runner/tasks/infer/predictions.py: every rank's files merged into one at the end of a
distributed inference (the top-k and detections CSVs, the COCO results files)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from runner.tasks.infer.coco_results import write_results
from runner.tasks.infer.predictions import merge_rank_files


def test_every_ranks_csv_and_results_file_merge_into_one(tmp_path: Path):
    header = "index,file,count,classes,names,scores,boxes\n"
    rows = {0: ['0,a.jpg,1,0,cat,0.90000,"1.00,2.00,3.00,4.00"\n'], 1: ["1,b.jpg,0,,,,\n"]}
    for rank, lines in rows.items():
        (tmp_path / f"detections.rank{rank}.csv").write_text(header + "".join(lines))
    write_results(tmp_path / "detections.rank0.json",
                  [{"image_id": 0, "category_id": 0, "bbox": [1.0, 2.0, 2.0, 2.0],
                    "score": 0.9}])
    write_results(tmp_path / "detections.rank1.json", [])  # a rank of no detections
    merge_rank_files(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["detections.csv", "detections.json"]
    with open(tmp_path / "detections.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [r["file"] for r in table] == ["a.jpg", "b.jpg"]
    assert table[0]["boxes"] == "1.00,2.00,3.00,4.00"
    merged = json.loads((tmp_path / "detections.json").read_text())
    assert [r["image_id"] for r in merged] == [0]
