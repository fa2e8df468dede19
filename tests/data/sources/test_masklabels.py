"""Segmentation targets read as people have them: images/ and masks/ side by side, and
COCO's polygons and RLE through pycocotools, bad cases counted and reported, never silent."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from runner.config.schema import DatasetConfig, Split
from runner.data.sources.listing import DatasetError
from runner.data.sources.masklabels import (
    IGNORE,
    MaskTarget,
    detect_mask_format,
    list_masks,
    load_mask,
    read_coco_masks,
    read_mask_file,
    read_masks,
    render_coco,
)


def image(path: Path, w: int, h: int, orientation: int = 1) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGB", (w, h), (90, 120, 30))
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    img.save(path, exif=exif)
    return path


def mask(path: Path, ids: np.ndarray, mode: str = "L") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if mode == "P":  # VOC's kind: the palette index is the class, the colour is for people
        img = Image.fromarray(ids.astype(np.uint8), "P")
        img.putpalette([v for k in range(256) for v in (k, 255 - k, 7 * k % 256)])
    elif mode == "I;16":
        img = Image.fromarray(ids.astype(np.uint16))
    else:
        img = Image.fromarray(ids.astype(np.uint8), mode)
    img.save(path)
    return path


def ids(h: int, w: int, seed: int = 0, top: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, top, (h, w)).astype(np.uint8)


def test_folder_masks_read_as_class_ids_with_names_and_palette_and_16_bit(tmp_path):
    a, b, c = ids(8, 10, 0), ids(6, 6, 1), ids(5, 7, 2)
    a[0, 0] = IGNORE
    image(tmp_path / "images" / "a.jpg", 10, 8)
    image(tmp_path / "images" / "sub" / "b.png", 6, 6)
    image(tmp_path / "images" / "c.jpg", 7, 5)
    mask(tmp_path / "masks" / "a.png", a)
    mask(tmp_path / "masks" / "sub" / "b.png", b, "P")
    mask(tmp_path / "masks" / "c.png", c, "I;16")
    (tmp_path / "data.yaml").write_text("names: [background, cat, dog]\n")
    found = read_masks(tmp_path)
    assert found.format == "pairs" and found.classes == ["background", "cat", "dog"]
    assert list(found.targets) == [str(tmp_path / "images" / n) for n in
                                   ("a.jpg", "c.jpg", "sub/b.png")]
    assert not found.skipped
    got = [load_mask(t) for t in found.targets.values()]
    for mine, theirs in zip(got, (a, c, b)):
        assert mine.dtype == np.uint8 and np.array_equal(mine, theirs)
    t = found.targets[str(tmp_path / "images" / "a.jpg")]
    assert (t.height, t.width) == (8, 10)


def test_folder_bad_input_is_counted_and_reported(tmp_path, caplog):
    image(tmp_path / "images" / "ok.jpg", 10, 8)
    mask(tmp_path / "masks" / "ok.png", ids(8, 10))
    image(tmp_path / "images" / "nomask.jpg", 10, 8)
    image(tmp_path / "images" / "small.jpg", 10, 8)
    mask(tmp_path / "masks" / "small.png", ids(4, 5))  # not its image's size
    image(tmp_path / "images" / "colour.jpg", 10, 8)
    Image.new("RGB", (10, 8)).save(tmp_path / "masks" / "colour.png")
    mask(tmp_path / "masks" / "orphan.png", ids(3, 3))
    image(tmp_path / "images" / "broken.jpg", 10, 8)
    (tmp_path / "masks" / "broken.png").write_bytes(b"not a png")
    (tmp_path / "classes.txt").write_text("bg\nthing\nother\n")
    with caplog.at_level(logging.WARNING):
        found = read_masks(tmp_path)
    assert list(found.targets) == [str(tmp_path / "images" / "ok.jpg")]
    assert found.classes == ["bg", "thing", "other"]
    # its id is its place among the images (broken, colour, nomask, ok, small), as YOLO's
    assert found.targets[str(tmp_path / "images" / "ok.jpg")].image_id == 3
    assert {k: v for k, v in found.counts.items() if v} == {
        "image_without_mask": 1, "size_mismatch": 1, "not_class_ids": 1,
        "mask_without_image": 1, "unreadable": 1}
    why = {Path(s.path).name: s.error for s in found.skipped}
    assert "no mask nomask.png" in why["nomask.jpg"]
    assert "5x4, its image 10x8" in why["small.png"]
    assert "RGB" in why["colour.png"]
    assert all(s.label for s in found.skipped)
    assert "1 images without a mask (skipped)" in caplog.text


def test_exif_rotated_image_takes_a_mask_of_its_upright_size(tmp_path):
    image(tmp_path / "images" / "r.jpg", 10, 6, orientation=6)  # upright: 6 wide, 10 high
    mask(tmp_path / "masks" / "r.png", ids(10, 6))
    image(tmp_path / "images" / "s.jpg", 10, 6, orientation=6)
    mask(tmp_path / "masks" / "s.png", ids(6, 10))  # the stored frame: not upright
    found = read_masks(tmp_path, classes=["a", "b", "c"])
    assert [Path(p).name for p in found.targets] == ["r.jpg"]
    assert found.counts["size_mismatch"] == 1


def test_classes_from_the_masks_and_out_of_range_ids_ignored(tmp_path, caplog):
    m = ids(6, 6, top=2)
    m[0, 0], m[1, 1] = 4, IGNORE
    image(tmp_path / "images" / "a.jpg", 6, 6)
    mask(tmp_path / "masks" / "a.png", m)
    with caplog.at_level(logging.WARNING):
        found = read_masks(tmp_path)
    assert found.classes == ["0", "1", "2", "3", "4"]  # 255 is not a class
    assert "no class names" in caplog.text
    target = next(iter(found.targets.values()))
    clipped = load_mask(target, num_classes=3)
    assert clipped[0, 0] == IGNORE and clipped[1, 1] == IGNORE
    assert np.array_equal(clipped[2:], m[2:])


def test_ids_beyond_the_named_classes_are_counted_and_said_once(tmp_path, caplog):
    """Three named classes and masks holding ids 4 and 7: those pixels are ignored (255),
    never silently: one warning counts the masks, names their files, the ids and the
    class count; a mask within the classes is not counted."""
    (tmp_path / "data.yaml").write_text("names: [bg, a, b]\n")
    for name, bad in (("a", 4), ("b", 7), ("c", None)):
        m = ids(6, 8, top=2)
        if bad is not None:
            m[0, 0] = bad
        m[5, 7] = IGNORE
        image(tmp_path / "images" / f"{name}.jpg", 8, 6)
        mask(tmp_path / "masks" / f"{name}.png", m)
    with caplog.at_level(logging.WARNING):
        found = read_masks(tmp_path)
        listing = list_masks(DatasetConfig(), tmp_path)
    assert found.classes == ["bg", "a", "b"] and len(found.targets) == 3  # none skipped
    assert found.counts["out_of_range"] == 2
    said = [r.getMessage() for r in caplog.records if "beyond" in r.getMessage()]
    assert len(said) == 2  # once per read: read_masks, then the listing's
    line = said[0]
    assert "2 masks with ids beyond the classes" in line and "a.png" in line \
        and "b.png" in line and "c.png" not in line
    assert "ids 4, 7 at or beyond the 3 named classes (0..2)" in line
    got = listing.targets.mask(0)  # a.png, as the batches get it
    assert got[0, 0] == IGNORE and got[5, 7] == IGNORE
    assert np.array_equal(got[2:5], ids(6, 8, top=2)[2:5])


def test_split_folders_and_the_listing(tmp_path):
    for split, n in (("train", 3), ("val", 2)):
        for k in range(n):
            image(tmp_path / "images" / split / f"{k}.jpg", 6, 4)
            mask(tmp_path / "masks" / split / f"{k}.png", ids(4, 6, k))
    (tmp_path / "data.yaml").write_text("names: [bg, a, b]\n")
    assert detect_mask_format(tmp_path, "val") == "pairs"
    val = list_masks(DatasetConfig(split=Split.val), tmp_path)
    assert len(val.samples) == 2 and "val split" in val.how
    assert val.classes == ["bg", "a", "b"] and len(val.targets) == 2
    assert np.array_equal(val.targets.mask(1), ids(4, 6, 1))
    assert val.targets.source_size(0) == (4, 6)
    train = list_masks(DatasetConfig(split=Split.train), tmp_path)
    assert [Path(p).name for p, _ in train.samples] == ["0.jpg", "1.jpg", "2.jpg"]
    # a flat layout split by val_fraction: targets follow their samples
    flat = tmp_path / "flat"
    for k in range(10):
        image(flat / "images" / f"{k}.jpg", 6, 4)
        mask(flat / "masks" / f"{k}.png", np.full((4, 6), k % 3, np.uint8))
    held = list_masks(DatasetConfig(val_fraction=0.3, split=Split.val), flat, "pairs")
    assert len(held.samples) == 3
    for k, (path, _) in enumerate(held.samples):
        assert (held.targets.mask(k) == int(Path(path).stem) % 3).all()


# --- COCO ---------------------------------------------------------------------------------

def coco_tree(root: Path, annotations: list[dict], images: list[tuple[int, str, int, int]],
              categories=((3, "cat"), (7, "dog"), (9, "bird"))) -> Path:
    for _, name, h, w in images:
        image(root / "val2017" / name, w, h)
    data = {"images": [{"id": i, "file_name": n, "height": h, "width": w}
                       for i, n, h, w in images],
            "annotations": annotations,
            "categories": [{"id": i, "name": n} for i, n in categories]}
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    (root / "annotations" / "instances_val2017.json").write_text(json.dumps(data))
    return root


def square(x0, y0, x1, y1) -> list[list[float]]:
    return [[x0, y0, x1, y0, x1, y1, x0, y1]]


def runs(binary: np.ndarray) -> list[int]:
    """COCO's uncompressed RLE of a binary mask: run lengths in column-major order, the
    first of zeros."""
    flat = binary.flatten(order="F")
    edges = np.flatnonzero(np.diff(flat)) + 1
    lengths = np.diff(np.concatenate([[0], edges, [flat.size]])).tolist()
    return ([0] if flat[0] else []) + lengths


def test_coco_polygons_and_rle_agree_with_pycocotools_ann_to_mask(tmp_path):
    from pycocotools import mask as coco_mask
    from pycocotools.coco import COCO

    h, w = 20, 30
    blob = np.zeros((h, w), np.uint8, order="F")
    blob[12:18, 2:9] = 1
    compressed = coco_mask.encode(np.asfortranarray(blob))
    compressed["counts"] = compressed["counts"].decode()
    other = np.zeros((h, w), np.uint8)
    other[10:16, 12:19] = 1
    uncompressed = {"size": [h, w], "counts": runs(other)}
    anns = [{"id": 1, "image_id": 5, "category_id": 3, "segmentation": square(2, 2, 10, 8)},
            {"id": 2, "image_id": 5, "category_id": 9, "segmentation": compressed},
            {"id": 3, "image_id": 5, "category_id": 7, "segmentation": uncompressed},
            {"id": 4, "image_id": 5, "category_id": 7, "segmentation": square(20, 2, 28, 8),
             "iscrowd": 1}]
    root = coco_tree(tmp_path, anns, [(5, "a.jpg", h, w)])
    found = read_masks(root)
    assert found.format == "coco"
    assert found.classes == ["background", "cat", "dog", "bird"]
    assert found.category_ids == [0, 3, 7, 9]
    got = load_mask(next(iter(found.targets.values())))
    coco = COCO(str(root / "annotations" / "instances_val2017.json"))
    for ann, cls in zip(coco.loadAnns([1, 2, 3]), (1, 3, 2)):
        theirs = coco.annToMask(ann).astype(bool)
        assert theirs.any()
        assert (got[theirs] == cls).all(), cls
    crowd = coco.annToMask(coco.loadAnns([4])[0]).astype(bool)
    assert (got[crowd] == IGNORE).all()
    covered = np.zeros((h, w), bool)
    for ann in coco.loadAnns([1, 2, 3, 4]):
        covered |= coco.annToMask(ann).astype(bool)
    assert (got[~covered] == 0).all()
    assert found.counts["crowd"] == 1


def test_coco_overlaps_of_two_classes_are_ignored_one_class_kept():
    shapes = ((square(0, 0, 6, 6), 1, False), (square(3, 3, 9, 9), 2, False),
              (square(5, 0, 9, 3), 2, False), (square(6, 0, 10, 2), 2, False))
    out = render_coco(shapes, 10, 10)
    assert out[1, 1] == 1 and out[7, 7] == 2
    assert out[4, 4] == IGNORE  # cat and dog
    assert out[1, 7] == 2  # two dogs: a dog
    # the order does not matter
    assert np.array_equal(out, render_coco(tuple(reversed(shapes)), 10, 10))


def test_coco_bad_input_is_counted_and_reported(tmp_path):
    anns = [{"id": 1, "image_id": 1, "category_id": 3, "segmentation": square(0, 0, 4, 4)},
            {"id": 2, "image_id": 99, "category_id": 3, "segmentation": square(0, 0, 4, 4)},
            {"id": 3, "image_id": 1, "category_id": 4, "segmentation": square(0, 0, 4, 4)},
            {"id": 4, "image_id": 1, "category_id": 3, "segmentation": [[1, 2, 3]]},
            {"id": 5, "image_id": 1, "category_id": 3, "bbox": [0, 0, 2, 2]},
            {"id": 6, "image_id": 1, "category_id": 3,
             "segmentation": {"size": [5, 5], "counts": "abc"}}]
    root = coco_tree(tmp_path, anns, [(1, "a.jpg", 8, 8), (2, "b.jpg", 8, 8)])
    (root / "val2017" / "b.jpg").unlink()
    image(root / "val2017" / "extra.jpg", 8, 8)
    found = read_masks(root)
    assert list(found.targets) == [str(root / "val2017" / "a.jpg")]
    assert {k: v for k, v in found.counts.items() if v} == {
        "annotation_without_image": 1, "class_out_of_range": 1, "malformed": 3,
        "image_missing": 1, "not_annotated": 1}
    errors = " | ".join(s.error for s in found.skipped)
    assert "an RLE of size [5, 5], its image 8x8" in errors
    assert "3 points or more" in errors
    target = found.targets[str(root / "val2017" / "a.jpg")]
    assert len(target.shapes) == 1 and load_mask(target)[:4, :4].all()


def test_an_image_without_annotations_is_all_background_and_unknown_layouts_refused(tmp_path):
    root = coco_tree(tmp_path / "c", [], [(1, "a.jpg", 4, 6)])
    found = read_coco_masks(root)
    assert (load_mask(next(iter(found.targets.values()))) == 0).all()
    with pytest.raises(DatasetError, match="images/ and masks/ side by side"):
        read_masks(tmp_path / "nothing")


def test_read_mask_file_takes_a_file_object_and_refuses_colour(tmp_path):
    path = mask(tmp_path / "m.png", ids(3, 4))
    with open(path, "rb") as f:
        assert np.array_equal(read_mask_file(f), ids(3, 4))
    Image.new("RGB", (2, 2)).save(tmp_path / "c.png")
    with pytest.raises(ValueError, match="not a mask of class ids"):
        load_mask(MaskTarget(2, 2, 0, file=str(tmp_path / "c.png")))


def test_unset_path_is_the_generated_masks_set_with_its_own_split(tmp_path):
    from runner.data.sources.masklabels import default_masks_path

    dataset = DatasetConfig(num_images=10, cache_dir=str(tmp_path), split=Split.val)
    root = default_masks_path(dataset, progress=False)
    listing = list_masks(dataset, root)
    assert "val split" in listing.how and len(listing.samples) == 2
    assert listing.classes == ["background", "circle", "square", "triangle"]
    assert listing.targets.num_classes == 4
