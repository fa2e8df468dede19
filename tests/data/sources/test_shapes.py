"""The default detection dataset: deterministic, its boxes what was drawn, written once in
the YOLO layout that labels.py reads back."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from runner.data.sources import shapes
from runner.data.sources.labels import read_labels
from runner.data.sources.shapes import GAP, ShapesSpec, background, ensure_shapes, make_sample

SPEC = ShapesSpec(num_images=40, height=96, width=128)


def test_samples_are_deterministic_and_some_have_no_objects():
    a, b = make_sample(SPEC, 5), make_sample(SPEC, 5)
    assert np.array_equal(a.image, b.image) and np.array_equal(a.boxes, b.boxes)
    assert not np.array_equal(a.image, make_sample(SPEC, 6).image)
    assert not np.array_equal(a.image, make_sample(ShapesSpec(40, 96, 128, seed=1), 5).image)
    counts = [len(make_sample(SPEC, i).labels) for i in range(SPEC.num_images)]
    assert 0 in counts and max(counts) > 1 and max(counts) <= SPEC.max_objects
    assert {int(k) for i in range(SPEC.num_images) for k in make_sample(SPEC, i).labels} == \
        {0, 1, 2}


def test_boxes_are_the_extent_of_the_pixels_drawn():
    """Independently of how the labels are made: the pixels that differ from the
    background are exactly the objects, each inside its box and reaching its edges."""
    seen = 0
    for index in range(SPEC.num_images):
        sample = make_sample(SPEC, index)
        bg = (background(SPEC, index) * 255 + 0.5).astype(np.uint8)
        drawn = (sample.image != bg).any(-1)
        covered = np.zeros_like(drawn)
        for (x1, y1, x2, y2), label in zip(sample.boxes.astype(int).tolist(),
                                           sample.labels.tolist()):
            covered[y1:y2, x1:x2] = True
            # around the box (objects are GAP pixels apart): the drawn pixels' extent
            y0, x0 = max(y1 - GAP + 1, 0), max(x1 - GAP + 1, 0)
            near = drawn[y0 : y2 + GAP - 1, x0 : x2 + GAP - 1]
            rows, cols = np.flatnonzero(near.any(1)), np.flatnonzero(near.any(0))
            found = (x0 + cols[0], y0 + rows[0], x0 + cols[-1] + 1, y0 + rows[-1] + 1)
            assert np.allclose(found, (x1, y1, x2, y2), atol=1), (index, found)
            # the class is the shape: the share of its box a shape fills
            fill = drawn[y1:y2, x1:x2].mean()
            expected = {0: (0.7, 0.85), 1: (0.97, 1.0), 2: (0.3, 0.62)}[label]
            assert expected[0] <= fill <= expected[1], (index, label, fill)
            seen += 1
        assert not (drawn & ~covered).any()  # nothing drawn outside the boxes
    assert seen > 40


def test_written_once_in_the_yolo_layout_and_read_back(tmp_path: Path, monkeypatch):
    root = ensure_shapes(SPEC, tmp_path, progress=False)
    assert json.loads((root / "dataset.json").read_text())["classes"] == list(shapes.CLASSES)
    val = SPEC.val_indices()
    assert len(val) == 8
    for split in ("train", "val"):
        labels = read_labels(root, split=split)
        assert labels.format == "yolo" and labels.classes == list(shapes.CLASSES)
        assert labels.skipped == [] and not labels.counts
        assert len(labels.targets) == (8 if split == "val" else 32)
        for path, target in labels.targets.items():
            index = int(Path(path).stem)
            assert (index in val) == (split == "val")
            sample = make_sample(SPEC, index)
            assert torch.allclose(target.boxes, torch.from_numpy(sample.boxes), atol=0.01)
            assert target.labels.tolist() == sample.labels.tolist()
            if len(sample.labels) and index % 8 == 0:  # the JPEG holds the drawn pixels
                with Image.open(path) as img:
                    decoded = np.asarray(img.convert("RGB")).astype(int)
                error = np.abs(decoded - sample.image).mean()
                assert error < 8 and error < np.abs(decoded - background(
                    SPEC, index) * 255).mean() / 2  # the shapes are in the file

    def must_not_generate(*args, **kwargs):
        raise AssertionError("a cached dataset was generated again")

    monkeypatch.setattr(shapes, "write_parallel", must_not_generate)
    assert ensure_shapes(SPEC, tmp_path, progress=False) == root


def test_an_interrupted_generation_resumes(tmp_path: Path, monkeypatch):
    spec = ShapesSpec(num_images=6, height=48, width=48)
    real = shapes._write_one
    written = []

    def stop_after_three(args):
        if len(written) == 3:
            raise KeyboardInterrupt
        written.append(args[2])
        return real(args)

    monkeypatch.setattr(shapes, "_write_one", stop_after_three)
    with pytest.raises(KeyboardInterrupt):
        ensure_shapes(spec, tmp_path, progress=False)
    assert not (tmp_path / "datasets" / spec.name).exists()
    written.clear()
    monkeypatch.setattr(shapes, "_write_one", lambda args: written.append(args[2]) or real(args))
    root = ensure_shapes(spec, tmp_path, progress=False)
    assert len(written) == 3 and len(list(root.glob("images/*/*.jpg"))) == 6
    assert len(list(root.glob("labels/*/*.txt"))) == 6


def test_the_mask_is_the_pixels_each_shape_was_drawn_on():
    for index in range(12):
        sample = make_sample(SPEC, index)
        bg = (background(SPEC, index) * 255 + 0.5).astype(np.uint8)
        drawn = (sample.image != bg).any(-1)
        assert sample.mask.dtype == np.uint8 and sample.mask.shape == drawn.shape
        # a shape's colour can match the background at a pixel by chance: nearly all
        assert ((sample.mask > 0) == drawn).mean() > 0.999
        for (x1, y1, x2, y2), label in zip(sample.boxes.astype(int).tolist(),
                                           sample.labels.tolist()):
            inside = sample.mask[y1:y2, x1:x2]
            assert set(np.unique(inside).tolist()) <= {0, label + 1}
            assert (inside == label + 1).any()


def test_the_masks_set_is_written_beside_its_images_and_read_back(tmp_path: Path):
    from runner.data.sources.masklabels import load_mask, read_masks

    spec = ShapesSpec(num_images=10, height=48, width=64, masks=True)
    root = ensure_shapes(spec, tmp_path, progress=False)
    assert root.name.startswith("shapes-masks-v1-") and not (root / "labels").exists()
    meta = json.loads((root / "dataset.json").read_text())
    assert meta["classes"] == ["background", "circle", "square", "triangle"]
    found = {split: read_masks(root, split=split) for split in ("train", "val")}
    assert sum(len(f.targets) for f in found.values()) == 10
    for f in found.values():
        assert f.classes == meta["classes"] and not f.skipped
        for image, target in f.targets.items():
            index = int(Path(image).stem)
            assert np.array_equal(load_mask(target), make_sample(spec, index).mask)
    # the same images as the boxes' set (the same spec otherwise)
    image = next(iter(found["train"].targets))
    boxes_root = ensure_shapes(ShapesSpec(num_images=10, height=48, width=64), tmp_path,
                               progress=False)
    assert (boxes_root / Path(image).relative_to(root)).read_bytes() == Path(image).read_bytes()
