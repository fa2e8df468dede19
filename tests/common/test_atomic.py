"""runner/common/atomic.py: a file is published whole, or the old one stays."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from runner.common.atomic import replacing, temporary, write_atomic


def test_a_file_is_replaced_whole_and_no_temporary_stays(tmp_path: Path):
    path = tmp_path / "predictions.csv"
    path.write_text("old\n")
    with replacing(path) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".") and tmp != path
        tmp.write_text("new\n")
        assert path.read_text() == "old\n"  # a reader sees the old file until the end
    assert path.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["predictions.csv"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path):
    path = tmp_path / "checkpoint.pt"
    write_atomic(path, b"old")
    with pytest.raises(OSError), replacing(path) as tmp:
        tmp.write_bytes(b"half")
        raise OSError("disk full")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def test_a_temporary_keeps_its_suffix_when_asked(tmp_path: Path):
    assert temporary(tmp_path / "a.pt2", keep_suffix=True).suffix == ".pt2"
    assert temporary(tmp_path / "a.pt2").name.startswith(".a.pt2.tmp")


def strict_json(path: Path) -> dict:
    """The file as JSON, refusing NaN and Infinity (which JSON does not have)."""
    def refuse(name: str) -> None:
        raise ValueError(f"{path.name} holds {name}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)

def test_json_files_hold_null_for_non_finite_numbers(tmp_path: Path):
    from runner.common.atomic import write_json

    path = tmp_path / "x.json"
    write_json(path, {"loss": float("nan"), "rows": [{"top1": float("inf")}, -math.inf, 1.5],
                      "n": 3, "ok": True, "np": __import__("numpy").float32("nan")})
    assert strict_json(path) == {"loss": None, "rows": [{"top1": None}, None, 1.5], "n": 3,
                                 "ok": True, "np": None}
