"""runner/data/sources/labelcache.py: a YOLO folder's label files parsed once, the next
listing reading none of them (nor an image header) while their stats are the recorded
ones; an edited file read again; a damaged cache never trusted; COCO's image sizes too."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import pytest

from runner.config.schema import Targets
from runner.data.sources import labels as labels_module
from runner.data.sources.detection import list_detection
from runner.data.sources.labelcache import cache_file
from runner.data.sources.labels import read_coco, read_yolo
from runner.job.compose import compose
from tests.data.sources.test_labels import box, coco_json, image, yolo_tree

LINES = {f"i{k}": f"{k % 3} 0.5 0.5 0.{k + 1} 0.5\n" for k in range(6)}


@pytest.fixture
def counted(monkeypatch) -> dict[str, int]:
    """Calls of the label parser and of the image header reader."""
    calls = {"parse": 0, "size": 0}
    parse, size = labels_module._parse_yolo, labels_module.upright_size

    def counting_parse(*a):
        calls["parse"] += 1
        return parse(*a)

    def counting_size(*a):
        calls["size"] += 1
        return size(*a)

    monkeypatch.setattr(labels_module, "_parse_yolo", counting_parse)
    monkeypatch.setattr(labels_module, "upright_size", counting_size)
    return calls


def folder(tmp_path: Path) -> Path:
    return yolo_tree(tmp_path / "d", {**LINES, "bad": "0 0.5 0.5\n"},
                     {**{f"i{k}.jpg": (40 + k, 30) for k in range(6)}, "bad.jpg": (8, 8)})


def test_a_second_listing_reads_no_label_file_and_gives_the_same_targets(tmp_path, counted,
                                                                          caplog):
    root, cache = folder(tmp_path), tmp_path / "cache"
    first = read_yolo(root, cache_dir=cache)
    assert counted == {"parse": 7, "size": 6}
    assert cache_file(cache, root / "labels").is_file()
    with caplog.at_level(logging.WARNING):
        second = read_yolo(root, cache_dir=cache)
    assert counted == {"parse": 7, "size": 6}  # nothing read again
    assert second.classes == first.classes and second.counts == first.counts
    assert [s.error for s in second.skipped] == [s.error for s in first.skipped]
    assert any("malformed" in r.getMessage() for r in caplog.records)  # said again
    for path, target in first.targets.items():
        got = second.targets[path]
        assert got.boxes.equal(target.boxes) and got.labels.equal(target.labels)
        assert (got.height, got.width, got.image_id) == (target.height, target.width,
                                                         target.image_id)


def test_an_edited_label_file_is_read_again_by_its_size_or_its_mtime(tmp_path, counted):
    root, cache = folder(tmp_path), tmp_path / "cache"
    read_yolo(root, cache_dir=cache)
    edited = root / "labels" / "i1.txt"
    edited.write_text("2 0.5 0.5 0.9 0.9\n0 0.1 0.1 0.1 0.1\n")  # another size
    got = read_yolo(root, cache_dir=cache)
    assert counted["parse"] == 8
    assert got.targets[str(root / "images" / "i1.jpg")].labels.tolist() == [2, 0]
    same_size = root / "labels" / "i2.txt"
    before = same_size.stat()
    same_size.write_text(LINES["i2"].replace("0.5 0.5", "0.4 0.5"))  # one digit changed
    os.utime(same_size, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    got = read_yolo(root, cache_dir=cache)
    assert counted["parse"] == 9
    box2 = got.targets[str(root / "images" / "i2.jpg")].boxes[0].tolist()
    assert box2[0] == pytest.approx((0.4 - 0.15) * 42)


def test_a_damaged_cache_is_not_trusted_and_is_rewritten(tmp_path, counted, caplog):
    root, cache = folder(tmp_path), tmp_path / "cache"
    truth = read_yolo(root, cache_dir=cache)
    file = cache_file(cache, root / "labels")
    for damage in (b'{"version": 1, "sour', b"\x00" * 50, b'{"version": 1, "source": 3}'):
        file.write_bytes(damage)
        with caplog.at_level(logging.WARNING):
            got = read_yolo(root, cache_dir=cache)
        assert any("damaged" in r.getMessage() for r in caplog.records)
        assert {p: t.labels.tolist() for p, t in got.targets.items()} == \
            {p: t.labels.tolist() for p, t in truth.targets.items()}
        caplog.clear()
    parses = counted["parse"]
    read_yolo(root, cache_dir=cache)  # rewritten whole: trusted again
    assert counted["parse"] == parses
    # an entry that is not what the module writes, under a good stat: read again
    import json

    data = json.loads(file.read_text())
    data["files"]["i3.txt"][1] = ["x"]
    file.write_text(json.dumps(data))
    got = read_yolo(root, cache_dir=cache)
    assert counted["parse"] == parses + 1
    assert got.targets[str(root / "images" / "i3.jpg")].labels.tolist() == [0]


def test_a_folder_runs_listing_keeps_its_cache_in_dataset_cache_dir(tmp_path, counted):
    root, cache = folder(tmp_path), tmp_path / "cache"
    cfg = dataclasses.replace(compose([]).dataset, path=str(root), targets=Targets.yolo,
                              cache_dir=str(cache))
    first = list_detection(cfg, root)
    parses = counted["parse"]
    second = list_detection(cfg, root)
    assert counted["parse"] == parses and list(cache.glob("labels/*.json"))
    assert second.samples == first.samples


def test_cocos_image_sizes_are_read_once_by_their_stat(tmp_path, counted):
    for name in ("a.jpg", "b.jpg"):
        image(tmp_path / "val" / name, 64, 48)
    file = coco_json(tmp_path, [{"id": 1, "file_name": "a.jpg", "height": 48, "width": 64},
                                {"id": 2, "file_name": "b.jpg", "height": 48, "width": 64}],
                     [box(1, 1, [1, 1, 10, 10])])
    read_coco(file, cache_dir=tmp_path / "cache")
    assert counted["size"] == 2
    read_coco(file, cache_dir=tmp_path / "cache")
    assert counted["size"] == 2
    image(tmp_path / "val" / "b.jpg", 48, 64)  # replaced: another size, read again
    got = read_coco(file, cache_dir=tmp_path / "cache")
    assert counted["size"] == 3 and got.counts["size_mismatch"] == 1
