"""dataset.targets: a detection set listed with its boxes, its splits, the generated shapes, and
the boxes through loader=folder's decoders and both of its loaders (checked against
torchvision's transforms v2 on the window each image was cut from)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from runner.common.errors import ConfigError
from runner.config.schema import Crop, Decoder, LoaderConfig, OnCorrupt, Split, StorageName, Targets
from runner.data.decode.boxgeometry import Window
from runner.data.decode.decoders import ImageDecoder
from runner.data.sources.detection import has_val_split, list_detection
from runner.data.sources.files import Files
from runner.data.sources.shapes import ShapesSpec, ensure_shapes
from runner.data.storage.folder import FolderStorage
from runner.job.compose import compose
from tests.conftest import make_loader
from tests.data.decode.test_boxgeometry import assert_same, torchvision_boxes
from tests.data.sources.test_labels import yolo_tree


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    return ensure_shapes(ShapesSpec(num_images=24, seed=3), tmp_path_factory.mktemp("cache"),
                         progress=False)


def dataset_config(path: Path, **kw):
    return dataclasses.replace(compose([]).dataset, path=str(path), targets=Targets.yolo, **kw)


def test_the_split_folders_give_train_and_val_each_image_with_its_own_boxes(shapes: Path):
    from runner.data.sources.labels import read_labels

    train = list_detection(dataset_config(shapes), shapes)
    val = list_detection(dataset_config(shapes, split=Split.val), shapes)
    assert len(train.samples) + len(val.samples) == 24 and len(val.samples) > 0
    assert not {p for p, _ in train.samples} & {p for p, _ in val.samples}
    assert train.classes == ["circle", "square", "triangle"]
    truth = {**read_labels(shapes, "yolo", "train").targets,
             **read_labels(shapes, "yolo", "val").targets}
    for listing in (train, val):
        assert len(listing.targets) == len(listing.samples)
        for (path, label), target in zip(listing.samples, listing.targets.items):
            assert label == 0 and torch.equal(target.boxes, truth[path].boxes)
    assert has_val_split(dataset_config(shapes))


def test_a_layout_without_split_folders_is_split_by_val_fraction_in_step(tmp_path: Path):
    sizes = {f"{k}.jpg": (40, 30) for k in range(8)}
    labels = {str(k): f"{k % 3} 0.5 0.5 0.{k + 1} 0.5\n" for k in range(8)}
    root = yolo_tree(tmp_path / "d", labels, sizes)
    cfg = dataset_config(root, val_fraction=0.25)
    assert not has_val_split(dataset_config(root))  # nothing to validate on by itself
    train, val = list_detection(cfg, root), list_detection(
        dataclasses.replace(cfg, split=Split.val), root)
    assert len(train.samples) == 6 and len(val.samples) == 2
    for listing in (train, val):
        for (path, _), target in zip(listing.samples, listing.targets.items):
            k = int(Path(path).stem)  # the box written for this image: width 0.(k+1) of 40
            assert target.labels.tolist() == [k % 3]
            assert target.boxes[0, 2] - target.boxes[0, 0] == pytest.approx(40 * (k + 1) / 10)


def test_a_layout_with_only_a_val_split_trains_on_it_and_does_not_validate_on_it(
        tmp_path: Path):
    """COCO's val2017 alone (annotations/instances_val2017.json): training reads those
    images, so validating on the same ones would score the training data: no validation."""
    from tests.data.sources.test_labels import coco

    coco(tmp_path, [{"id": 1, "image_id": 1, "category_id": 7, "bbox": [10, 20, 30, 40],
                     "iscrowd": 0}])
    cfg = dataclasses.replace(dataset_config(tmp_path), targets=Targets.coco)
    assert len(list_detection(cfg, tmp_path).samples) == 2
    assert not has_val_split(cfg)


@pytest.mark.parametrize("crop", [Crop.center, Crop.random])
@pytest.mark.parametrize("decoder", [Decoder.pil, Decoder.simplejpeg])
def test_boxes_follow_the_decoders_window_as_torchvision_v2_maps_them(shapes: Path, crop,
                                                                       decoder):
    """Each item's boxes are its labels through the window and flip its image was cut
    from: torchvision v2's resized_crop (and horizontal_flip) of the same BoundingBoxes."""
    decode = ImageDecoder(decoder, (96, 112), crop)
    storage = FolderStorage(Files(list_detection(dataset_config(shapes), shapes)), decode,
                            OnCorrupt.skip)
    seen_boxes = 0
    for index in range(len(storage)):
        seed = 1000 + index if crop is Crop.random else None
        item = storage[(index, seed)] if seed is not None else storage[index]
        data = bytearray(Path(storage.samples[index][0]).read_bytes())
        image, window, flip, hw_read = decode.decode_window(data, seed)
        assert torch.equal(image, item.image)
        target = storage.targets[index]
        hw = (target.height, target.width) if target.height else image.shape[-2:]
        assert not target.height or tuple(hw) == hw_read  # YOLO's: the images' own sizes
        expected = torchvision_boxes(target.boxes, target.labels, hw, Window(*window),
                                     (96, 112), flip)
        assert_same((item.boxes, item.box_labels), expected)
        seen_boxes += len(item.boxes)
    assert seen_boxes > 10


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_carry_the_boxes_padded_through_either_loader(shapes: Path, workers):
    """The decode threads (no workers) and the DataLoader's workers hand over the same
    padded boxes: rows past an image's count are 0 and -1."""
    decode = ImageDecoder(Decoder.pil, (64, 64), Crop.center)
    storage = FolderStorage(Files(list_detection(dataset_config(shapes), shapes)), decode,
                            OnCorrupt.skip)
    cfg = LoaderConfig(name=StorageName.folder, batch_size=5, num_workers=workers,
                       shuffle=False)
    batches = [b for b, _ in make_loader(storage, cfg)]
    for batch in batches:
        m = batch["boxes"].shape[1]
        assert batch["boxes"].shape == (len(batch["index"]), m, 4)
        for row, (index, count) in enumerate(zip(batch["index"].tolist(),
                                                 batch["box_count"].tolist())):
            item = storage[index]
            assert torch.equal(batch["boxes"][row, :count], item.boxes)
            assert batch["box_labels"][row, count:].eq(-1).all()
            assert batch["boxes"][row, count:].eq(0).all()


def test_bad_labels_are_reported_as_skipped_files(tmp_path: Path):
    sizes = {"a.jpg": (40, 30), "b.jpg": (40, 30)}
    root = yolo_tree(tmp_path / "d", {"a": "0 0.5 0.5 0.2 0.2\n", "ghost": "1 0.5 0.5 0.1 0.1\n"},
                     sizes)
    storage = FolderStorage(Files(list_detection(dataset_config(root), root)),
                            ImageDecoder(Decoder.pil, (24, 24)), OnCorrupt.skip)
    assert len(storage) == 2  # b.jpg has no label file: an image with no boxes
    assert [Path(s.path).name for s in storage.known_skipped] == ["ghost.txt"]


@pytest.mark.parametrize("overrides,says", [
    (["loader=webdataset"], "through loader=folder.* so far, not loader=webdataset"),
    (["loader.decoder=nvjpeg"], "CPU decoders"),
    (["task.augment.auto=randaugment"], "task.augment.auto"),
    (["dataset.path=s3://bucket/x"], "local folder.*prepare shards dataset.targets=yolo .*"
                                      "read that with loader=shards"),
])
def test_what_boxes_cannot_follow_yet_is_refused_in_one_line(overrides, says):
    with pytest.raises(ConfigError, match=says):
        compose(["dataset.targets=yolo", *overrides])


def test_shards_at_a_url_carry_their_boxes_and_are_accepted():
    config = compose(["dataset.targets=yolo", "loader=shards", "dataset.path=s3://bucket/x"])
    assert config.loader.name is StorageName.shards


def test_prepare_picks_among_the_stores_that_carry_boxes(shapes: Path, tmp_path: Path):
    """prepare's advice for a detection set names only stores that take dataset.targets
    (memmap and ram among them: a ragged side store of boxes)."""
    from runner import prepare

    overrides = [f"dataset.path={shapes}", "dataset.targets=yolo", "dataset.image_size=[32,32]",
                 f"dataset.cache_dir={tmp_path / 'cache'}", "run.progress=false"]
    names = [k.name.value for k, _ in prepare.store_sizes(prepare.compose(overrides)).stores]
    from runner.data.storage import STORAGES

    assert {"packed", "memmap", "ram"} <= set(names)
    assert all(STORAGES[StorageName(n)].boxes for n in names)


def test_boxes_given_for_another_size_than_the_files_are_scaled_to_it(tmp_path: Path):
    """A COCO JSON whose width and height are not the file's (a resized copy of the images,
    say): its boxes are scaled to the decoded image's size before they follow the crop."""
    import json

    from PIL import Image

    (tmp_path / "val").mkdir()
    Image.new("RGB", (80, 60), (40, 90, 120)).save(tmp_path / "val" / "a.jpg")
    (tmp_path / "annotations").mkdir()
    (tmp_path / "annotations" / "instances_val.json").write_text(json.dumps({
        "images": [{"id": 7, "file_name": "a.jpg", "width": 160, "height": 120}],
        "annotations": [{"id": 1, "image_id": 7, "category_id": 3, "bbox": [40, 30, 80, 60],
                         "iscrowd": 0, "area": 4800}],
        "categories": [{"id": 3, "name": "thing"}]}))
    cfg = dataclasses.replace(dataset_config(tmp_path), targets=Targets.coco, split=Split.val)
    storage = FolderStorage(Files(list_detection(cfg, tmp_path)),
                            ImageDecoder(Decoder.pil, (60, 80), Crop.whole), OnCorrupt.skip)
    item = storage[0]  # the whole 80 x 60 file at its own size: the JSON's box halved
    assert item.boxes.tolist() == [[20.0, 15.0, 60.0, 45.0]] and item.box_labels.tolist() == [0]


def test_split_val_on_a_layout_without_splits_is_refused_not_read_whole(tmp_path: Path):
    """task=infer dataset.split=val on a layout with no val split (and no
    dataset.val_fraction to hold one out): refused in one line, by the full listing and
    by the quick one a store opens with, not every image read as if it were val."""
    from runner.data.sources.detection import quick_detection
    from runner.data.sources.listing import DatasetError, list_images
    from tests.data.sources.test_labels import coco

    root = yolo_tree(tmp_path / "d", {"a": "0 0.5 0.5 0.2 0.2\n"}, {"a.jpg": (64, 64)})
    cfg = dataset_config(root, split=Split.val)
    for listing in (list_detection, quick_detection):
        with pytest.raises(DatasetError, match=r"dataset.split=val: dataset.path=.*/d has no "
                                               r"val split of its own.*drop dataset.split"):
            listing(cfg, root)
    assert len(list_detection(dataset_config(root), root).samples) == 1  # without it: all
    coco(tmp_path / "c", [])  # instances_val2017.json: a val split
    assert len(list_detection(dataclasses.replace(cfg, targets=Targets.coco), tmp_path / "c"
                              ).samples) == 2
    classes = tmp_path / "classes"
    for name in ("cat/a.jpg", "dog/b.jpg"):
        (classes / name).parent.mkdir(parents=True, exist_ok=True)
        (classes / name).write_bytes(b"")
    plain = dataclasses.replace(cfg, targets=Targets.none)
    with pytest.raises(DatasetError, match=r"dataset.split=val: .* has no val split .*all its "
                                           r"2 images"):
        list_images(plain, classes)
