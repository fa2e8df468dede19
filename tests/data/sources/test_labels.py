"""Detection targets read as people have them: the YOLO layout and COCO's instances JSON,
each with its bad cases counted and reported with a reason, never a crash."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from PIL import Image

from runner.data.protocol import SkippedFile
from runner.data.sources.labels import detect_format, read_coco, read_labels, read_yolo
from runner.data.sources.listing import DatasetError


def image(path: Path, w: int, h: int, orientation: int = 1) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGB", (w, h), (90, 120, 30))
    if orientation != 1:
        exif = Image.Exif()
        exif[0x0112] = orientation
        img.save(path, exif=exif)
    else:
        img.save(path)
    return path


def yolo_tree(root: Path, labels: dict[str, str], sizes: dict[str, tuple[int, int]],
              names: list[str] | None = ("cat", "dog", "bird")) -> Path:
    for name, (w, h) in sizes.items():
        image(root / "images" / name, w, h)
    (root / "labels").mkdir(parents=True, exist_ok=True)
    for stem, text in labels.items():
        (root / "labels" / f"{stem}.txt").parent.mkdir(parents=True, exist_ok=True)
        (root / "labels" / f"{stem}.txt").write_text(text)
    if names is not None:
        (root / "data.yaml").write_text("names: [" + ", ".join(names) + "]\n")
    return root


def reasons(skipped: list[SkippedFile]) -> list[str]:
    return [s.error for s in skipped]


def test_yolo_boxes_in_source_pixels_with_names_and_empty_or_missing_label_files(tmp_path):
    root = yolo_tree(tmp_path, {"a": "0 0.5 0.5 0.2 0.5\n2 0.25 0.125 0.1 0.25\n", "b": ""},
                     {"a.jpg": (100, 80), "b.png": (50, 50), "c.jpg": (60, 40)})
    labels = read_labels(root)
    assert labels.format == "yolo" and labels.classes == ["cat", "dog", "bird"]
    assert list(labels.targets) == [str(root / "images" / n) for n in ("a.jpg", "b.png",
                                                                       "c.jpg")]
    a = labels.targets[str(root / "images" / "a.jpg")]
    assert (a.height, a.width) == (80, 100)
    assert torch.allclose(a.boxes, torch.tensor([[40.0, 20, 60, 60], [20, 0, 30, 20]]))
    assert a.boxes.dtype == torch.float32 and a.labels.dtype == torch.int64
    assert a.labels.tolist() == [0, 2]
    for name in ("b.png", "c.jpg"):  # an empty label file, and none: no boxes
        t = labels.targets[str(root / "images" / name)]
        assert t.boxes.shape == (0, 4) and t.labels.shape == (0,)
    assert labels.counts["no_label_file"] == 1 and labels.skipped == []


def test_yolo_bad_input_is_counted_and_reported_with_its_reason(tmp_path, caplog):
    text = "\n".join([
        "0 0.5 0.5 0.2 0.2",      # fine
        "0 0.5 0.5",              # too few values
        "x 0.5 0.5 0.2 0.2",      # not a class id
        "1 nan 0.5 0.2 0.2",      # not finite
        "5 0.5 0.5 0.2 0.2",      # class out of range (3 names)
        "-1 0.5 0.5 0.2 0.2",     # class out of range
        "1 0.5 0.5 0 0.2",        # degenerate: zero width
        "2 0.95 0.5 0.2 0.2",     # reaches outside: clipped to x2 = 100
        "1 1.5 0.5 0.2 0.2",      # wholly outside: nothing left once clipped
    ])
    root = yolo_tree(tmp_path, {"a": text, "orphan": "0 0.5 0.5 0.1 0.1\n"}, {"a.jpg": (100, 50)})
    with caplog.at_level(logging.INFO, logger="runner.data.sources.labels"):
        labels = read_yolo(root)
    a = labels.targets[str(root / "images" / "a.jpg")]
    assert a.labels.tolist() == [0, 2]
    assert torch.allclose(a.boxes[1], torch.tensor([85.0, 20, 100, 30]))
    assert labels.counts == {"malformed": 3, "class_out_of_range": 2, "degenerate": 2,
                             "clipped": 1, "label_without_image": 1}
    why = reasons(labels.skipped)
    assert len(why) == 8
    assert any("line 2: 3 values" in w for w in why)
    assert any("line 3:" in w and "not a class id" in w for w in why)
    assert any("line 5: class 5 is out of range (3 classes: 0..2)" in w for w in why)
    assert any("line 6: class -1 is out of range" in w for w in why)
    assert sum("no area inside the 100x50 image" in w for w in why) == 2
    orphan = [s for s in labels.skipped if s.path.endswith("orphan.txt")]
    assert len(orphan) == 1 and "no image orphan.*" in orphan[0].error
    # each kind said once, with its count
    said = [r.getMessage() for r in caplog.records]
    assert sum("1 boxes reaching outside their image (clipped to it)" in m for m in said) == 1
    assert sum("3 malformed label entries" in m for m in said) == 1


def test_yolo_polygons_exif_sizes_and_classes_without_names(tmp_path):
    root = tmp_path / "ds"
    image(root / "images" / "r.jpg", 40, 20, orientation=6)  # stored 40x20, upright 20x40
    (root / "labels").mkdir(parents=True)
    (root / "labels" / "r.txt").write_text("4 0.5 0.5 0.5 0.5\n1 0.1 0.2 0.3 0.1 0.2 0.6\n")
    labels = read_yolo(root)
    r = labels.targets[str(root / "images" / "r.jpg")]
    assert (r.height, r.width) == (40, 20)  # the upright size the runner decodes
    assert torch.allclose(r.boxes, torch.tensor([[5.0, 10, 15, 30], [2, 4, 6, 24]]))
    assert labels.classes == ["0", "1", "2", "3", "4"] and labels.skipped == []
    # two images of one stem share its label file
    image(root / "images" / "r.png", 10, 10)
    both = read_yolo(root)
    assert [both.targets[str(root / "images" / n)].labels.tolist() for n in ("r.jpg", "r.png")
            ] == [[4, 1], [4, 1]]
    assert not both.counts


def test_yolo_split_folders_and_classes_txt(tmp_path):
    for split in ("train", "val"):
        image(tmp_path / "images" / split / f"{split}1.jpg", 10, 10)
        (tmp_path / "labels" / split).mkdir(parents=True)
        (tmp_path / "labels" / split / f"{split}1.txt").write_text("1 0.5 0.5 1 1\n")
    (tmp_path / "labels" / "classes.txt").write_text("a\nb\n")
    val = read_labels(tmp_path, "yolo", split="val")
    assert list(val.targets) == [str(tmp_path / "images" / "val" / "val1.jpg")]
    assert val.classes == ["a", "b"] and val.skipped == []  # classes.txt is no image's labels
    # the images folder itself, as ultralytics' data.yaml names it
    train = read_yolo(tmp_path / "images" / "train")
    assert [t.labels.tolist() for t in train.targets.values()] == [[1]]
    # Roboflow's <split>/images layout
    image(tmp_path / "rf" / "valid" / "images" / "x.jpg", 10, 10)
    (tmp_path / "rf" / "valid" / "labels").mkdir(parents=True)
    (tmp_path / "rf" / "valid" / "labels" / "x.txt").write_text("0 0.5 0.5 0.5 0.5\n")
    assert read_labels(tmp_path / "rf", split="valid").num_boxes == 1


def test_unreadable_image_size_is_skipped_with_its_boxes(tmp_path):
    root = yolo_tree(tmp_path, {"bad": "0 0.5 0.5 0.2 0.2\n"}, {})
    (root / "images").mkdir(exist_ok=True)
    (root / "images" / "bad.jpg").write_bytes(b"not an image")
    labels = read_yolo(root)
    assert labels.targets == {} and labels.counts["unreadable_size"] == 1
    assert "its size cannot be read" in labels.skipped[0].error


def coco(tmp_path: Path, annotations: list, images: list | None = None) -> Path:
    folder = tmp_path / "val2017"
    image(folder / "1.jpg", 100, 80)
    image(folder / "2.jpg", 64, 64)
    (tmp_path / "annotations").mkdir(exist_ok=True)
    payload = {
        "images": images or [{"id": 1, "file_name": "1.jpg", "height": 80, "width": 100},
                             {"id": 2, "file_name": "2.jpg", "height": 64, "width": 64}],
        "annotations": annotations,
        "categories": [{"id": 7, "name": "dog"}, {"id": 3, "name": "cat"}],
    }
    file = tmp_path / "annotations" / "instances_val2017.json"
    file.write_text(json.dumps(payload))
    return file


def test_coco_boxes_contiguous_categories_and_crowds_left_out(tmp_path):
    coco(tmp_path, [
        {"id": 1, "image_id": 1, "category_id": 7, "bbox": [10, 20, 30, 40], "iscrowd": 0},
        {"id": 2, "image_id": 1, "category_id": 3, "bbox": [0, 0, 5.5, 5], "iscrowd": 0},
        {"id": 3, "image_id": 1, "category_id": 3, "bbox": [0, 0, 50, 50], "iscrowd": 1},
    ])
    assert detect_format(tmp_path) == "coco"
    labels = read_labels(tmp_path)
    assert labels.format == "coco" and labels.classes == ["cat", "dog"]  # by category id
    assert labels.category_ids == [3, 7]  # each class's own id, to serve detections by
    assert labels.root == tmp_path / "val2017"
    one = labels.targets[str(tmp_path / "val2017" / "1.jpg")]
    assert torch.allclose(one.boxes, torch.tensor([[10.0, 20, 40, 60], [0, 0, 5.5, 5]]))
    assert one.labels.tolist() == [1, 0] and one.image_id == 1
    two = labels.targets[str(tmp_path / "val2017" / "2.jpg")]
    assert two.boxes.shape == (0, 4) and (two.height, two.width) == (64, 64)
    assert labels.counts == {"crowd": 1} and labels.skipped == []


def test_coco_bad_input_is_counted_and_reported_with_its_reason(tmp_path):
    image(tmp_path / "val2017" / "extra.jpg", 8, 8)  # on disk, not in the JSON
    file = coco(tmp_path, [
        {"id": 1, "image_id": 9, "category_id": 7, "bbox": [1, 1, 2, 2]},    # no such image
        {"id": 2, "image_id": 1, "category_id": 99, "bbox": [1, 1, 2, 2]},   # no category
        {"id": 3, "image_id": 1, "category_id": 7, "bbox": [1, 1, 2]},       # malformed
        {"id": 4, "image_id": 1, "category_id": 7, "bbox": [1, 1, 0, 5]},    # degenerate
        {"id": 5, "image_id": 1, "category_id": 7, "bbox": [90, 70, 20, 20]},  # clipped
        {"id": 6, "image_id": 1, "category_id": 7, "bbox": [1, 1, "a", 2]},  # malformed
        {"id": 7, "image_id": [1], "category_id": 7, "bbox": [1, 1, 2, 2]},  # not an id
        {"id": 8, "image_id": 1, "category_id": {"a": 1}, "bbox": [1, 1, 2, 2]},  # nor this
        [1, 2],                                                              # not an object
    ], images=[{"id": 1, "file_name": "1.jpg", "height": 80, "width": 100},
               {"id": 3, "file_name": "gone.jpg", "height": 8, "width": 8}])
    labels = read_coco(file)
    one = labels.targets[str(tmp_path / "val2017" / "1.jpg")]
    assert torch.allclose(one.boxes, torch.tensor([[90.0, 70, 100, 80]]))
    assert labels.counts == {"annotation_without_image": 2, "class_out_of_range": 2,
                             "malformed": 3, "degenerate": 1, "clipped": 1,
                             "image_missing": 1, "not_annotated": 2}
    why = reasons(labels.skipped)
    assert any("annotation 1: image_id 9 is not in 'images'" in w for w in why)
    assert any("annotation 2: category_id 99 is not among the 2 categories" in w for w in why)
    assert any("annotation 3: bbox [1, 1, 2] is not 4 finite numbers" in w for w in why)
    assert any("no area inside the 100x80 image" in w for w in why)
    missing = [s for s in labels.skipped if s.path.endswith("gone.jpg")]
    assert len(missing) == 1 and "not on disk" in missing[0].error
    assert {Path(s.path).name for s in labels.skipped if "not listed in" in s.error} == \
        {"2.jpg", "extra.jpg"}


def test_which_coco_file_and_unknown_layouts(tmp_path):
    coco(tmp_path, [])
    (tmp_path / "annotations" / "instances_train2017.json").write_text("{}")
    with pytest.raises(DatasetError, match="several COCO annotation files"):
        read_labels(tmp_path)
    assert read_labels(tmp_path, split="val").root == tmp_path / "val2017"
    with pytest.raises(DatasetError, match="is not COCO instances JSON"):
        read_labels(tmp_path, split="train")
    (tmp_path / "plain").mkdir()
    with pytest.raises(DatasetError, match="holds no detection labels"):
        read_labels(tmp_path / "plain")
    with pytest.raises(DatasetError, match="not one of auto, yolo, coco"):
        read_labels(tmp_path, "voc")


def test_coco_images_found_beside_the_annotations_despite_a_missing_first_one(tmp_path):
    file = coco(tmp_path, [], images=[
        {"id": 5, "file_name": "0-gone.jpg", "height": 8, "width": 8},
        {"id": 1, "file_name": "1.jpg", "height": 80, "width": 100}])
    image(tmp_path / "images" / "unrelated.jpg", 8, 8)  # another candidate folder
    labels = read_coco(file)
    assert labels.root == tmp_path / "val2017"
    assert labels.counts["image_missing"] == 1
    (tmp_path / "elsewhere").mkdir()
    moved = tmp_path / "elsewhere" / file.name
    file.rename(moved)
    with pytest.raises(DatasetError, match="its first image 0-gone.jpg is in none of"):
        read_coco(moved)


def test_an_ultralytics_set_named_after_itself_gives_its_class_names(tmp_path: Path, caplog):
    """coco128's names are in coco128.yaml, not data.yaml: read from there (another YAML
    file without names, or not YAML at all, is passed over); a set with no names file says
    once that its classes are the ids seen."""
    import logging

    labels = {"a": "0 0.5 0.5 0.2 0.2\n", "b": "1 0.5 0.5 0.2 0.2\n"}
    root = yolo_tree(tmp_path / "coco128", labels, {"a.jpg": (40, 30), "b.jpg": (40, 30)},
                     names=None)
    (root / "notes.yaml").write_text("- just: a list\n")
    (root / "coco128.yaml").write_text("path: .\nnames:\n  0: person\n  1: bicycle\n")
    assert read_labels(root).classes == ["person", "bicycle"]
    (root / "coco128.yaml").unlink()
    other = yolo_tree(tmp_path / "nameless", labels, {"a.jpg": (40, 30), "b.jpg": (40, 30)},
                      names=None)
    with caplog.at_level(logging.WARNING):
        assert read_labels(other).classes == ["0", "1"]
        read_labels(other)
    assert caplog.text.count("no class names") == 1


def coco_json(tmp_path: Path, images: list[dict], annotations: list[dict]) -> Path:
    (tmp_path / "annotations").mkdir(exist_ok=True)
    file = tmp_path / "annotations" / "instances_val.json"
    file.write_text(json.dumps({"images": images, "annotations": annotations,
                                "categories": [{"id": 3, "name": "thing"}]}))
    return file


def box(ann_id: int, image_id: int, bbox: list[float]) -> dict:
    return {"id": ann_id, "image_id": image_id, "category_id": 3, "bbox": bbox, "iscrowd": 0}


def test_coco_sizes_are_the_upright_images_a_resized_copy_is_scaled_another_shape_skipped(
        tmp_path, caplog):
    """COCO's width and height are the upright image's (EXIF applied): the same size is
    used as it is, a copy resized with its shape kept is scaled (said, INFO), any other
    size (a height that is not the file's, an EXIF-rotated JPEG whose JSON gives its
    stored size) is skipped with its boxes, counted and said once."""
    image(tmp_path / "val" / "same.jpg", 160, 120)
    image(tmp_path / "val" / "half.jpg", 80, 60)  # the JSON's 160x120, halved
    image(tmp_path / "val" / "tall.jpg", 160, 120)  # the JSON says 160 high
    image(tmp_path / "val" / "turned.jpg", 160, 120, orientation=6)  # upright 120x160
    sizes = {"same.jpg": (120, 160), "half.jpg": (120, 160), "tall.jpg": (160, 160),
             "turned.jpg": (120, 160)}  # (height, width) the JSON gives
    images = [{"id": k, "file_name": name, "height": h, "width": w}
              for k, (name, (h, w)) in enumerate(sizes.items(), 1)]
    file = coco_json(tmp_path, images, [box(k, k, [40, 30, 80, 60]) for k in range(1, 5)])
    with caplog.at_level(logging.INFO):
        labels = read_coco(file)
    assert {Path(p).name for p in labels.targets} == {"same.jpg", "half.jpg"}
    half = labels.targets[str(tmp_path / "val" / "half.jpg")]
    assert (half.height, half.width) == (120, 160)  # the JSON's frame, scaled when decoded
    assert labels.counts == {"resized": 1, "size_mismatch": 2}
    why = {Path(s.path).name: s.error for s in labels.skipped}
    assert "gives 160x160 (width x height), the upright image is 160x120" in why["tall.jpg"]
    assert "skipped with its 1 box" in why["tall.jpg"]
    assert "stored size of an EXIF-rotated image" in why["turned.jpg"]
    said = [r.getMessage() for r in caplog.records if "upright image's" in r.getMessage()]
    assert len(said) == 1 and ": 2 images whose JSON width x height" in said[0]


def test_coco_one_file_under_two_ids_is_skipped_and_counted_never_one_entry_dropped(tmp_path):
    image(tmp_path / "val" / "a.jpg", 64, 64)
    image(tmp_path / "val" / "b.jpg", 64, 64)
    file = coco_json(tmp_path, [
        {"id": 1, "file_name": "a.jpg", "height": 64, "width": 64},
        {"id": 2, "file_name": "a.jpg", "height": 64, "width": 64},
        {"id": 3, "file_name": "b.jpg", "height": 64, "width": 64}],
        [box(1, 1, [1, 1, 10, 10]), box(2, 2, [5, 5, 10, 10]), box(3, 2, [20, 20, 5, 5]),
         box(4, 3, [2, 2, 4, 4])])
    labels = read_coco(file)
    assert [Path(p).name for p in labels.targets] == ["b.jpg"]
    assert labels.counts == {"duplicate_file": 2}
    why = sorted(s.error for s in labels.skipped)
    assert all("lists this file under 2 ids (1, 2)" in w for w in why)
    assert "skipped with the 1 box of id 1" in why[0] and "the 2 boxes of id 2" in why[1]


def test_coco_two_images_sharing_one_id_are_skipped_and_counted_never_merged(tmp_path):
    image(tmp_path / "val" / "a.jpg", 64, 64)
    image(tmp_path / "val" / "b.jpg", 64, 64)
    image(tmp_path / "val" / "c.jpg", 64, 64)
    file = coco_json(tmp_path, [
        {"id": 5, "file_name": "a.jpg", "height": 64, "width": 64},
        {"id": 5, "file_name": "b.jpg", "height": 64, "width": 64},
        {"id": 6, "file_name": "c.jpg", "height": 64, "width": 64}],
        [box(1, 5, [1, 1, 10, 10]), box(2, 6, [2, 2, 4, 4])])
    labels = read_coco(file)
    assert [Path(p).name for p in labels.targets] == ["c.jpg"]
    assert labels.counts == {"duplicate_id": 2}  # neither is 'not listed' on disk
    assert {Path(s.path).name for s in labels.skipped} == {"a.jpg", "b.jpg"}
    assert all("lists id 5 for 2 images (a.jpg, b.jpg)" in s.error for s in labels.skipped)


def test_a_yolo_split_without_its_labels_folder_is_refused_not_given_the_top_labels(tmp_path):
    """images/val without labels/val: the top labels/ (the training images' boxes, or
    none) is not the split's; refused in one line naming both folders."""
    yolo_tree(tmp_path, {"a": "0 0.5 0.5 0.2 0.2\n"}, {"a.jpg": (64, 64)})
    image(tmp_path / "images" / "val" / "v.jpg", 64, 64)
    with pytest.raises(DatasetError, match=r"the val split's images \(.*images/val\) have no "
                                           r"labels folder \(.*labels/val is missing\)"):
        read_labels(tmp_path, split="val")
    (tmp_path / "labels" / "val").mkdir()
    assert len(read_labels(tmp_path, split="val").targets) == 1  # images/val's own labels
    other = tmp_path / "other"  # the other layout: <split>/images and <split>/labels
    image(other / "val" / "images" / "w.jpg", 64, 64)
    with pytest.raises(DatasetError, match="val/labels is missing"):
        read_yolo(other, "val")


def test_a_byte_order_mark_is_read_as_ultralytics_reads_it_no_box_lost(tmp_path):
    bom = "\ufeff"
    root = yolo_tree(tmp_path, {"a": f"{bom}1 0.5 0.5 0.2 0.2\n0 0.25 0.25 0.1 0.1\n"},
                     {"a.jpg": (100, 100)}, names=None)
    (root / "labels" / "classes.txt").write_text(f"{bom}cat\ndog\n", encoding="utf-8")
    labels = read_yolo(root)
    one = labels.targets[str(root / "images" / "a.jpg")]
    assert one.labels.tolist() == [1, 0] and labels.counts == {}
    assert labels.classes == ["cat", "dog"]


def test_a_set_whose_label_files_are_all_empty_is_said_clearly(tmp_path, caplog):
    root = yolo_tree(tmp_path, {"a": "", "b": "\n"}, {"a.jpg": (64, 64), "b.jpg": (64, 64)})
    with caplog.at_level(logging.WARNING):
        labels = read_yolo(root)
    assert labels.num_boxes == 0
    said = [r.getMessage() for r in caplog.records if "none of its 2 images has a box" in
            r.getMessage()]
    assert len(said) == 1 and "trains on nothing" in said[0]
