"""``loader.group_aspect``: batches of one aspect-ratio bin (torchvision's
GroupedBatchSampler, ultralytics' rect), every image once per epoch, the order a function
of the seed and epoch (a resume reads the rest of the same epoch), on one rank or several;
each bin's batches at the bin's shape (ultralytics' rect shapes), boxes following
(torchvision v2) and served back in the source's pixels.

The sizes are 128 with 96x128 images, not 64 with 48x64: a bin's shape is rounded up to a
multiple of 32 (ultralytics' stride), so 48 would round up to the square 64."""

from __future__ import annotations

import bisect
from pathlib import Path

import pytest
import torch

from runner.data.order import BatchOrder, aspect_bins, unpad


def test_bins_are_torchvisions_quantization():
    """torchvision's references: ``bins = 2 ** linspace(-1, 1, 2k + 1)``, then
    ``bisect_right(sorted(bins), w / h)`` per image."""
    sizes = [(100, 400), (100, 200), (100, 150), (100, 100), (150, 100), (300, 100),
             (100, 126), (100, 125), (0, 0)]
    edges = sorted((2 ** torch.linspace(-1, 1, 7)).tolist())
    expected = [bisect.bisect_right(edges, w / h) if h else bisect.bisect_right(edges, 1.0)
                for h, w in sizes]
    assert aspect_bins(sizes).tolist() == expected
    assert len(set(expected)) >= 5


def orders(bins, batch, world, drop_last, shuffle=True, seed=7):
    return [BatchOrder(len(bins), batch, shuffle=shuffle, drop_last=drop_last, seed=seed,
                       rank=r, world=world, bins=bins) for r in range(world)]


def epoch_rows(order: BatchOrder, epoch: int, skip: int = 0) -> list[list[int]]:
    order.set_epoch(epoch, skip)
    return [row.tolist() for row in order.batches()]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_batch_is_one_bin_and_every_image_read_once(world, drop_last, shuffle):
    g = torch.Generator().manual_seed(0)
    bins = torch.randint(0, 5, (203,), generator=g)
    ranks = orders(bins, 6, world, drop_last, shuffle)
    for epoch in range(3):
        per_rank = [epoch_rows(o, epoch) for o in ranks]
        assert {len(rows) for rows in per_rank} == {len(ranks[0])}  # same steps everywhere
        seen = []
        for step in range(len(ranks[0])):
            step_bins = set()
            for rows in per_rank:
                row = rows[step]
                assert 0 < len(row) <= 6
                real = [unpad(i)[0] for i in row]
                step_bins |= set(bins[real].tolist())
                seen += [i for i in row if i >= 0]
            assert len(step_bins) == 1  # a global batch of one bin, on every rank
        assert len(seen) == len(set(seen))  # no image twice
        if not drop_last:
            assert sorted(seen) == list(range(len(bins)))  # every image once
        else:
            assert all(len(rows[s]) == 6 for rows in per_rank for s in range(len(rows)))


def test_the_order_is_a_function_of_seed_and_epoch_and_resumes_exactly():
    bins = aspect_bins([(100, 60 + 7 * (k % 13)) for k in range(150)])
    assert len(torch.unique(bins)) >= 3
    first, again = orders(bins, 8, 1, False)[0], orders(bins, 8, 1, False)[0]
    epoch2 = epoch_rows(first, 2)
    assert epoch_rows(again, 2) == epoch2  # a fresh order: the same epoch
    assert epoch_rows(again, 3) != epoch2  # another epoch: another order
    resumed = orders(bins, 8, 1, False)[0]
    assert epoch_rows(resumed, 2, skip=5) == epoch2[5:]  # a resume at step 5
    assert epoch_rows(orders(bins, 8, 1, False, seed=8)[0], 2) != epoch2
    # several ranks: the global batch of a step is the same set whatever the world size
    one = epoch_rows(orders(bins, 8, 1, True)[0], 1)
    two = [epoch_rows(o, 1) for o in orders(bins, 4, 2, True)]
    assert [sorted(r) for r in one] == [sorted(a + b) for a, b in zip(*two)]


def test_the_loader_groups_a_detection_folder_and_refuses_what_it_cannot(tmp_path: Path):
    from runner.common.errors import ConfigError
    from runner.data import build_data_path
    from runner.job.compose import compose
    from tests.data.decode.test_letterbox import coco_set

    coco_set(tmp_path / "coco")  # 150x90, 90x160, 100x100, 130x70: three bins
    base = [f"dataset.path={tmp_path / 'coco'}", "dataset.targets=coco", "loader=folder",
            "dataset.image_size=[32,32]", "loader.batch_size=2", "loader.group_aspect=true",
            f"dataset.cache_dir={tmp_path / 'cache'}", "loader.decoder=pil", "task.name=train",
            "loader.drop_last=false"]  # every image, the short batches of each bin too
    config = compose(base)
    data = build_data_path(config, torch.device("cpu"), epochs=2, progress=False)
    try:
        sizes = {i: data.storage.targets.source_size(i) for i in range(len(data.storage))}
        bins = aspect_bins([sizes[i] for i in range(len(sizes))])
        counted = []
        for batch in data:
            index = batch["index"].tolist()
            assert len(set(bins[index].tolist())) == 1, index
            counted += index
        assert sorted(counted) == sorted(list(range(4)) * 2)
    finally:
        data.close()
    with pytest.raises(ConfigError, match="dataset.crop=center"):
        compose([*base, "dataset.crop=center"])
    plain = tmp_path / "plain" / "a"
    plain.mkdir(parents=True)
    for k in range(3):
        (plain / f"{k}.jpg").write_bytes((tmp_path / "coco" / "val2017" / "a.jpg").read_bytes())
    with pytest.raises(ConfigError, match="detection labels"):
        build_data_path(compose([f"dataset.path={tmp_path / 'plain'}", "loader=folder",
                                 "loader.group_aspect=true", "dataset.crop=whole",
                                 f"dataset.cache_dir={tmp_path / 'cache'}"]),
                        torch.device("cpu"), epochs=1, progress=False)


# --- each bin's batches at the bin's shape (ultralytics' rect) -------------------------

def ultralytics_shape(hws: list[tuple[int, int]], imgsz: int, stride: int = 32):
    """ultralytics' ``set_rectangle`` batch shape for images of sizes ``hws`` (its formula,
    ``pad=0.0``, as its training sets use; an epsilon against float noise in the ceil)."""
    import numpy as np

    ar = np.array([h / w for h, w in hws])
    shape = [1, 1]
    if ar.max() < 1:
        shape = [ar.max(), 1]
    elif ar.min() > 1:
        shape = [1, 1 / ar.min()]
    return tuple(int(v) for v in np.ceil(np.array(shape) * imgsz / stride - 1e-9) * stride)


def test_bin_shapes_are_ultralytics_rect_shapes_over_each_bins_images():
    from runner.data.order import bin_shapes

    sizes = [(480, 640), (640, 480), (640, 640), (427, 640), (500, 640), (640, 300),
             (0, 0), (600, 640), (1000, 640), (320, 640)]
    bins = aspect_bins(sizes)
    shapes = bin_shapes(sizes, bins, (640, 640))
    for b in torch.unique(bins).tolist():
        members = [s for s, k in zip(sizes, bins.tolist()) if k == b and s[0]]
        expected = ultralytics_shape(members or [(1, 1)], 640)
        assert {tuple(shapes[i].tolist()) for i in range(len(sizes)) if bins[i] == b} == \
            {expected}, (b, members)
    as_list = [tuple(s) for s in shapes.tolist()]
    assert as_list[0] == (512, 640)  # 4:3 with 500x640 (the bin's squarest) in its bin
    assert as_list[1] == (640, 480) and as_list[2] == (640, 640) and as_list[6] == (640, 640)
    assert as_list[9] == (320, 640) and as_list[5] == (640, 320)
    alone = bin_shapes([(480, 640), (640, 480)], aspect_bins([(480, 640), (640, 480)]),
                       (640, 640))
    assert alone.tolist() == [[480, 640], [640, 480]]  # the brief's 640 case, exactly
    # a bin's shape never exceeds the output, and every image of it fits (fills a side)
    assert (shapes <= 640).all() and (shapes % 32 == 0).all()


def mixed_set(root: Path) -> dict[str, tuple[int, int, list[list[int]]]]:
    """A COCO set of 4:3 landscape, 3:4 portrait, 3:2 landscape and square images
    (image_size 128: the bins' shapes 96x128, 128x96, 128x128); name -> (id, hw, boxes)."""
    import json

    from tests.data.decode.test_letterbox import jpeg

    sizes = [(96, 128), (128, 96), (128, 128), (96, 128), (84, 126), (150, 112),
             (128, 96), (90, 90), (192, 256), (96, 128)]
    (root / "val2017").mkdir(parents=True)
    images, annotations, truth = [], [], {}
    for k, (h, w) in enumerate(sizes):
        name = f"{k}.jpg"
        (root / "val2017" / name).write_bytes(jpeg(h, w, seed=k))
        images.append({"id": 20 + k, "file_name": name, "height": h, "width": w})
        rows = [[3 + k, 5, 3 + k + w // 2, 5 + h // 3], [w // 3, h // 2, w - 2, h - 3]]
        truth[name] = (20 + k, (h, w), rows)
        for j, (x1, y1, x2, y2) in enumerate(rows):
            annotations.append({"id": 10 * k + j + 1, "image_id": 20 + k, "category_id": 3,
                                "bbox": [x1, y1, x2 - x1, y2 - y1],
                                "area": (x2 - x1) * (y2 - y1), "iscrowd": 0})
    (root / "annotations").mkdir()
    (root / "annotations" / "instances_val2017.json").write_text(json.dumps({
        "images": images, "annotations": annotations,
        "categories": [{"id": 3, "name": "car"}]}))
    return truth


def rect_shape_of(hw: tuple[int, int]) -> tuple[int, int]:
    """The bin shape mixed_set's image of ``hw`` is letterboxed to at 128."""
    return (96, 128) if hw[1] > 1.2 * hw[0] else (128, 96) if hw[0] > 1.2 * hw[1] \
        else (128, 128)


@pytest.mark.slow
@pytest.mark.parametrize("loader,path", [
    ("folder", ["loader.num_workers=0"]),  # decode threads into reused buffers
    ("folder", ["loader.num_workers=1"]),  # a worker, collated per batch
    ("folder", ["loader.decode_threads=0", "loader.batched=true"]),  # one gather per batch
    ("packed", ["loader.num_workers=0"]),  # the binding's batch decode
    ("folder", ["dataset.crop=whole"]),  # resized to the bin's shape, no pads
])
def test_letterboxed_batches_take_their_bins_shape_and_boxes_follow(tmp_path, loader, path):
    """loader.group_aspect with the letterbox: each batch at its bin's shape (4:3 images
    at 96x128, not padded to 128x128), never mixing bins; images and boxes equal
    torchvision v2's resize then pad into that shape (boxes within a pixel; a packed
    store's own copy rounds by a pixel more). With dataset.crop=whole: its resize alone."""
    import io

    from PIL import Image
    from torchvision import tv_tensors
    from torchvision.transforms.v2 import functional as TF

    from runner.config.schema import Crop
    from runner.data import build_data_path
    from runner.data.decode.decoders import PAD_VALUE, letterbox_place
    from runner.job.compose import compose

    truth = mixed_set(tmp_path / "coco")
    config = compose([f"dataset.path={tmp_path / 'coco'}", "dataset.targets=coco",
                      f"loader={loader}", "dataset.image_size=[128,128]",
                      f"dataset.cache_dir={tmp_path / 'cache'}", "loader.batch_size=2",
                      "loader.decoder=pil", "loader.group_aspect=true", "task.name=train",
                      "loader.drop_last=false", *path])
    data = build_data_path(config, torch.device("cpu"), epochs=2, progress=False)
    shapes, seen = set(), []
    try:
        for batch in data:
            names = [Path(data.storage.name_of(i)).name for i in batch["index"].tolist()]
            shape = tuple(batch["image"].shape[-2:])
            assert {rect_shape_of(truth[n][1]) for n in names} == {shape}, (names, shape)
            shapes.add(shape)
            for k, name in enumerate(names):
                seen.append(name)
                _, hw, rows = truth[name]
                top, left, nh, nw = letterbox_place(*hw, *shape) \
                    if config.dataset.crop is Crop.letterbox else (0, 0, *shape)
                pads = [left, top, shape[1] - nw - left, shape[0] - nh - top]
                bb = tv_tensors.BoundingBoxes(torch.tensor(rows, dtype=torch.float32),
                                              format="XYXY", canvas_size=hw)
                theirs = TF.pad(TF.resize(bb, [nh, nw]), pads).as_subclass(torch.Tensor)
                n = int(batch["box_count"][k])
                assert n == len(rows)
                assert torch.allclose(batch["boxes"][k, :n], theirs, atol=1.0), name
                image = batch["image"][k]
                if loader == "folder":  # the source decoded itself: the same pixels
                    data_bytes = (tmp_path / "coco" / "val2017" / name).read_bytes()
                    source = TF.pil_to_tensor(Image.open(io.BytesIO(data_bytes)))
                    want = TF.pad(TF.resize(source, [nh, nw], antialias=True), pads,
                                  fill=PAD_VALUE)
                    assert (image.int() - want.int()).abs().max() <= 2, name
                else:  # the pads where the letterbox puts them, a pixel's slack
                    pad = torch.ones(shape, dtype=torch.bool)
                    pad[max(top - 1, 0): top + nh + 1, max(left - 1, 0): left + nw + 1] = False
                    assert (image[:, pad] == PAD_VALUE).all(), name
    finally:
        data.close()
    assert shapes == {(96, 128), (128, 96), (128, 128)}
    assert sorted(seen) == sorted(list(truth) * 2)  # every image once per epoch


def test_stores_decoded_once_refuse_in_one_line():
    from runner.common.errors import ConfigError
    from runner.job.compose import compose

    for loader in ("memmap", "ram"):
        with pytest.raises(ConfigError, match=f"group_aspect=true with loader={loader}: its "
                                              "images are decoded once"):
            compose([f"loader={loader}", "dataset.targets=coco", "loader.group_aspect=true"])


class HalfDetector(torch.nn.Module):
    """torchvision's detection protocol: predicts the middle half of whatever input it is
    given (one box, class 0, score 1), and records the input shapes it saw."""

    seen: list[tuple[int, int]] = []

    def __init__(self, num_classes: int):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(1))

    def forward(self, images, targets=None):
        out = []
        for image in images:
            h, w = image.shape[-2:]
            HalfDetector.seen.append((h, w))
            box = torch.tensor([[w / 4, h / 4, 3 * w / 4, 3 * h / 4]]) + self.bias * 0
            out.append({"boxes": box, "labels": torch.zeros(1, dtype=torch.int64),
                        "scores": torch.ones(1)})
        return out


def half_detector(num_classes: int) -> HalfDetector:
    return HalfDetector(num_classes)


@pytest.mark.slow
def test_served_boxes_of_rect_batches_are_in_the_source_frame(tmp_path):
    """task=infer with loader.group_aspect: the model sees each bin's shape, and its boxes
    are served in the source's pixels through that shape's letterbox: the middle half of
    a 96x128 input of a 4:3 image (no pads) is the middle half of the source."""
    import json

    from runner.data.decode.decoders import letterbox_place
    from tests.conftest import run_in_process

    truth = mixed_set(tmp_path / "coco")
    HalfDetector.seen.clear()
    run = tmp_path / "run"
    run_in_process("task=infer", f"dataset.path={tmp_path / 'coco'}", "dataset.targets=coco",
                   "loader=folder", "dataset.image_size=[128,128]", "loader.batch_size=2",
                   "loader.group_aspect=true", f"dataset.cache_dir={tmp_path / 'cache'}",
                   "model=custom", f"model.target={__name__}:half_detector", "logger=none",
                   "diagnose=false", "run.timeline=false", "run.progress=false",
                   "run.warmup_steps=0", run_dir=run)
    assert set(HalfDetector.seen) == {(96, 128), (128, 96), (128, 128)}
    rows = {r["image_id"]: r["bbox"] for r in json.loads((run / "detections.json").read_text())}
    for name, (image_id, (h, w), _) in truth.items():
        shape = rect_shape_of((h, w))
        top, left, nh, nw = letterbox_place(h, w, *shape)
        sy, sx = nh / h, nw / w  # input pixels per source pixel
        x1, y1 = (shape[1] / 4 - left) / sx, (shape[0] / 4 - top) / sy
        x2, y2 = (3 * shape[1] / 4 - left) / sx, (3 * shape[0] / 4 - top) / sy
        x1, y1, x2, y2 = max(x1, 0), max(y1, 0), min(x2, w), min(y2, h)
        assert rows[image_id] == pytest.approx([x1, y1, x2 - x1, y2 - y1], abs=0.02), name
    assert rows[20] == pytest.approx([32, 24, 64, 48], abs=0.02)  # 96x128: unpadded
