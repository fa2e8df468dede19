"""``python -m runner.bench yolo`` (runner/bench/yolo.py): ultralytics' own YOLO dataloader
against the runner's folder and packed paths, the same images decoded and letterboxed
alike; a missing ultralytics says how to install it and fails its targets."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from runner.bench.yolo import INSTALL, TARGETS, missing, yolo_targets


def rows(ultra: float, folder: float, packed: float, first: float = 1.0) -> dict:
    """A round's rows at these second-epoch rates; their first epochs at ``first`` times."""
    def row(rate):
        return {"startup_s": 0.1, "first_batch_s": 0.2, "epoch_images_per_s": rate * first,
                "steady_images_per_s": rate, "images": 48, "boxes": 100,
                "shapes": [(3, 64, 64)]}

    return {"ultralytics": row(ultra), "folder": row(folder), "packed": row(packed)}


def test_the_targets_are_folder_2x_and_packed_3x_medians_of_rounds(capsys):
    rounds = [rows(100, 210, 290), rows(100, 190, 330), rows(100, 250, 310)]
    checks = yolo_targets(rounds)
    assert TARGETS == {"folder": 2.0, "packed": 3.0}
    assert [(c["ratio"], c["met"]) for c in checks] == [(2.1, True), (3.1, True)]
    assert yolo_targets([rows(100, 190, 400)])[0]["met"] is False
    out = capsys.readouterr().out
    assert "folder / ultralytics (2nd epoch images/s)" in out
    assert "1st epoch images/s" in out and "2nd epoch images/s" in out


def test_the_targets_compare_the_second_epoch_after_warm_up(capsys):
    """The first epoch carries one-off costs (the runner's batch buffers faulted in, a
    worker pool's prefetch during the first batch's wait): the ratios are the second's."""
    ultra = {"epoch_images_per_s": 150.0}
    rounds = [rows(100, 310, 320, first=0.5)]  # every row's first epoch at half its rate
    rounds[0]["ultralytics"].update(ultra)  # ultralytics' first epoch faster than ours
    checks = yolo_targets(rounds)
    assert [round(c["ratio"], 2) for c in checks] == [3.1, 3.2]
    assert all(c["met"] for c in checks)


def test_two_epochs_are_counted_apart_and_must_be_the_same_work(monkeypatch):
    from runner.bench import yolo

    clock = iter([0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0])  # t0, then each batch's arrival
    monkeypatch.setattr(yolo.time, "perf_counter", lambda: next(clock))
    batches = [(4, 2), (4, 3), (2, 1), (4, 2), (4, 3), (2, 1)]  # (images, boxes), 2 epochs
    got = yolo.count_epochs(iter(batches), 10, lambda b: b[0], lambda b: b[1],
                            lambda b: (3, 8, 8))
    assert (got["images"], got["boxes"], got["first_batch_s"]) == (10, 6, 1.0)
    assert got["epoch_images_per_s"] == 6 / 2.0  # after the first batch, to the boundary
    assert got["steady_images_per_s"] == 10 / 5.0  # the boundary (t=3) to the last batch (t=8)
    ticks = iter(range(100))
    monkeypatch.setattr(yolo.time, "perf_counter", lambda: float(next(ticks)))
    with pytest.raises(RuntimeError, match="not the same work"):
        yolo.count_epochs(iter(batches[:5]), 10, lambda b: b[0], lambda b: b[1],
                          lambda b: (3, 8, 8))


def test_a_target_past_the_decode_bound_is_said_out_of_reach(capsys):
    """Where decoding alone is under a target's ratio, no per-epoch decoder meets it: the
    failed target says so with the bound; one within the bound says nothing more."""
    from runner.bench.yolo import DECODE

    def with_bound(rate):
        row = rows(100, 160, 170)
        row[DECODE] = {**row["folder"], "steady_images_per_s": rate, "boxes": None}
        return row

    checks = yolo_targets([with_bound(180), with_bound(175), with_bound(185)])
    assert [c["met"] for c in checks] == [False, False]
    assert all("decoding each JPEG alone, nothing else, is 1.80x" in c["why"] for c in checks)
    assert "out of reach" in capsys.readouterr().out
    checks = yolo_targets([with_bound(400)])
    assert all("why" not in c for c in checks)


def test_without_ultralytics_the_row_says_how_to_install_it_and_fails(capsys, monkeypatch):
    import subprocess

    import runner.bench.yolo as yolo

    asked = []

    def probe(argv, **kwargs):  # the interpreter's answer: no ultralytics
        asked.append(argv)
        return subprocess.CompletedProcess(argv, 1)

    monkeypatch.setattr(yolo.subprocess, "run", probe)
    why = missing("/some/python")
    assert asked[0][0] == "/some/python" and "find_spec('ultralytics')" in asked[0][-1]
    assert why == f"not installed: {INSTALL}" and "pip install ultralytics" in why
    rounds = [{"folder": rows(1, 1, 1)["folder"], "packed": rows(1, 1, 1)["packed"]}]
    checks = yolo_targets(rounds, why)
    assert [c["met"] for c in checks] == [False, False]
    assert INSTALL in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.process
def test_one_round_reads_the_same_images_and_boxes_letterboxed_alike(tmp_path: Path):
    pytest.importorskip("ultralytics")
    import numpy as np
    import torch
    from ultralytics.cfg import get_cfg
    from ultralytics.data.build import build_yolo_dataset

    from runner.bench.yolo import bench_yolo
    from runner.config.schema import Crop, Decoder
    from runner.data.decode.decoders import ImageDecoder

    args = argparse.Namespace(size=96, images=30, height=60, width=100, batch_size=4,
                              workers=2, rounds=1, cache_dir=tmp_path / "cache",
                              ultralytics_python=sys.executable, overrides=[],
                              out=tmp_path / "out")
    result = bench_yolo(args)
    (row,) = result["rounds"]
    assert set(row) == {"ultralytics", "folder", "packed", "decode bound"}
    assert row["decode bound"]["images"] == row["folder"]["images"]
    work = {(r["images"], r["boxes"]) for k, r in row.items() if k != "decode bound"}
    assert len(work) == 1  # the same work
    assert {tuple(s) for r in row.values() for s in r["shapes"]} == {(3, 96, 96)}
    assert [c["what"].split(" /")[0] for c in result["targets"]] == ["folder", "packed"]
    # one image as ultralytics letterboxes it and as the runner's folder does
    images = Path(result["dataset"]) / "images" / "train"
    cfg = get_cfg(overrides={"imgsz": 96, "rect": False, "task": "detect"})
    dataset = build_yolo_dataset(cfg, str(images), 4, {"names": {0: "a", 1: "b", 2: "c"},
                                                       "nc": 3, "channels": 3}, mode="val")
    item = dataset[0]
    theirs = item["img"].to(torch.int32)
    mine = ImageDecoder(Decoder.pil, (96, 96), Crop.letterbox)(
        Path(item["im_file"]).read_bytes()).to(torch.int32)
    assert theirs.shape == mine.shape
    pad = (theirs == 114).all(0) & (mine == 114).all(0)
    assert pad[:10].all() and pad[-10:].all()  # 100 x 60 -> 96 x 58: grey above and below
    assert np.abs((theirs - mine).numpy()).mean() < 4  # cv2's INTER_AREA against PIL's


@pytest.mark.process
def test_an_interpreter_without_ultralytics_is_told_apart(tmp_path):
    python = tmp_path / "python"  # the bench's interpreter with no site-packages
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")
    python.chmod(0o755)
    assert missing(str(python)) == f"not installed: {INSTALL}"
