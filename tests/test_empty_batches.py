"""A batch none of whose images decodes is still read (issue 50, item 1): inference over 48
images, 16 in a row undecodable (a whole batch of 16, in the middle or last; a truncated
shard), finishes its outputs (predictions.csv, the state complete) and lists the 16 in
skipped_files; training counts the epoch whole, so its checkpoint says so and a resume
does not read the epoch again."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from tests.conftest import encode, make_tree, photo, run_in_process

COMMON = ["logger=none", "diagnose=false", "run.timeline=false", "dataset.image_size=[32,32]",
          "loader.batch_size=16", "loader.shuffle=false", "run.warmup_steps=0",
          "run.progress=false"]
INFER = ["task=infer", *COMMON, "run.epochs=1"]
BROKEN = b"\xff\xd8\xff not really a JPEG"


def rows(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def folder(root: Path, bad: range) -> Path:
    """48 images in sorted order (three classes of 16), those of ``bad`` undecodable."""
    files = {}
    for k in range(48):
        files[f"{'abc'[k // 16]}/{k:02d}.jpg"] = BROKEN if k in bad else \
            encode(photo(40, 52, k))
    return make_tree(root, files)


def check_finished(run_dir: Path, m: dict, over: list[str], bad: int = 16) -> None:
    assert m["status"] == "ok", m.get("error")
    assert m["steps"] == 3 and m["predictions"] == 32
    assert len(m["skipped_files"]) == bad
    assert len(rows(run_dir / "predictions.csv")) == 32
    assert not list(run_dir.glob("*.partial")) and not list(run_dir.glob(".*.parts"))
    state = json.loads((run_dir / "infer-state.json").read_text())
    assert state["complete"] is True and state["steps"] == 3
    for path in m["outputs"]["tiny"]:
        assert Path(path).exists(), path
    again = run_in_process(*over, "resume=auto", run_dir=run_dir)
    assert again["status"] == "ok" and again["predictions"] == 32  # finished, and it is


@pytest.mark.parametrize("where, bad", [("middle", range(16, 32)), ("last", range(32, 48))])
def test_inference_with_a_whole_batch_undecodable_finishes_its_outputs(tmp_path: Path,
                                                                       where: str, bad: range):
    data = folder(tmp_path / "data", bad)
    over = [*INFER, f"dataset.path={data}"]
    m = run_in_process(*over, run_dir=tmp_path / "run")
    check_finished(tmp_path / "run", m, over)
    assert {Path(p).name for p in m["skipped_files"]} == {f"{k:02d}.jpg" for k in bad}


def test_inference_over_a_truncated_shard_finishes_its_outputs(tmp_path: Path, cache_dir):
    from runner.data.storage.tarformat import ShardWriter, write_manifest

    shards = tmp_path / "shards"
    entries = []
    for part in range(3):  # a shard of 16 samples each
        writer = ShardWriter(shards, pattern=f"part{part}-{{:06d}}.tar")
        for k in range(16):
            data = encode(photo(40, 52, 16 * part + k))
            writer.add(f"{16 * part + k:08d}", data, part, 40, 52, f"{16 * part + k:02d}.jpg",
                       16 * part + k)
        entries += writer.close()
    write_manifest(shards, entries, ["a", "b", "c"])
    middle = shards / entries[1]["name"]
    with open(middle, "r+b") as f:  # cut off after its first member's header
        f.truncate(1024)
    over = [*INFER, f"dataset.path={shards}", "loader=shards"]
    m = run_in_process(*over, run_dir=tmp_path / "run")
    check_finished(tmp_path / "run", m, over)
    assert all(entries[1]["name"] in s for s in m["skipped_files"])


def test_training_counts_an_epoch_with_an_undecodable_batch_whole(tmp_path: Path):
    data = folder(tmp_path / "data", range(16, 32))  # class b: every image broken
    over = ["task=train", *COMMON, f"dataset.path={data}", "run.epochs=2"]
    m = run_in_process(*over, run_dir=tmp_path / "run")
    assert m["status"] == "ok" and m["steps"] == 6 and len(m["skipped_files"]) == 16
    state = torch.load(tmp_path / "run" / "checkpoint.pt", map_location="cpu",
                       weights_only=False)
    assert state["epoch"] == 2 and state["steps"] == 6
    again = run_in_process(*over, "resume=auto", run_dir=tmp_path / "run")
    assert again["status"] == "ok" and again["steps"] == 6  # finished: not read again
    more = run_in_process(*over[:-1], "run.epochs=3", "resume=auto", run_dir=tmp_path / "run")
    assert more["start_step"] == 6 and more["steps"] == 3  # the third epoch alone
