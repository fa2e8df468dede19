"""``dataset.crop=letterbox``: the whole image, aspect kept, resized to fit
``dataset.image_size`` and padded with grey 114; its boxes follow (a hand-derived case and
torchvision v2's ``resize`` then ``pad`` on ``BoundingBoxes``, within a pixel), on every
storage, and served boxes go back into the source's pixels (COCOeval: ground truth served
as predictions scores 1)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as TF

from runner.config.schema import Crop, DatasetConfig, Decoder, Targets
from runner.data.decode.boxgeometry import Window, map_boxes, shown_window, to_source
from runner.data.decode.decoders import (
    PAD_VALUE,
    ImageDecoder,
    letterbox_place,
    letterbox_window,
)


def jpeg(h: int, w: int, seed: int = 0, quality: int = 95) -> bytes:
    g = np.random.default_rng(seed)
    small = g.integers(0, 255, (max(h // 8, 1), max(w // 8, 1), 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((w, h), Image.BILINEAR)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def test_hand_derived_letterbox_of_a_wide_image():
    """100 x 200 into 64 x 64: scale 0.32, the picture 32 x 64 at row 16, grey above and
    below; the box (20, 10, 60, 50) lands at (6.4, 19.2, 19.2, 32)."""
    assert letterbox_place(100, 200, 64, 64) == (16, 0, 32, 64)
    window = Window(*letterbox_window((0.0, 0.0, 100.0, 200.0), (64, 64)))
    assert window == Window(-50.0, 0.0, 200.0, 200.0)
    boxes, labels = map_boxes(torch.tensor([[20.0, 10, 60, 50]]), torch.tensor([3]),
                              window, (64, 64))
    assert boxes[0].tolist() == pytest.approx([6.4, 19.2, 19.2, 32.0])
    assert labels.tolist() == [3]
    decoder = ImageDecoder(Decoder.pil, (64, 64), Crop.letterbox)
    image, shown, flip, hw = decoder.decode_window(jpeg(100, 200))
    assert image.shape == (3, 64, 64) and hw == (100, 200) and not flip
    assert shown == pytest.approx(tuple(vars(window).values()))
    assert (image[:, :16] == PAD_VALUE).all() and (image[:, 48:] == PAD_VALUE).all()
    assert not (image[:, 16:48] == PAD_VALUE).all()
    # a tall image: the pads left and right, the odd one-pixel rest on the right
    assert letterbox_place(200, 99, 64, 64) == (0, 16, 64, 32)
    assert letterbox_place(200, 103, 64, 64) == (0, 15, 64, 33)


@pytest.mark.parametrize("hw,size", [((300, 400), (128, 160)), ((480, 270), (96, 96)),
                                     ((123, 457), (64, 80)), ((64, 64), (128, 96))])
def test_pixels_and_boxes_equal_torchvision_resize_then_pad(hw, size):
    """torchvision v2: ``resize`` to the letterbox's picture size, then ``pad`` by the
    letterbox's pads (fill 114), on the image and its ``BoundingBoxes`` alike."""
    data = jpeg(*hw, seed=hw[0])
    decoder = ImageDecoder(Decoder.pil, size, Crop.letterbox)
    image, window, _, _ = decoder.decode_window(data)
    top, left, nh, nw = letterbox_place(*hw, *size)
    pads = [left, top, size[1] - nw - left, size[0] - nh - top]
    source = TF.pil_to_tensor(Image.open(io.BytesIO(data)).convert("RGB"))
    theirs = TF.pad(TF.resize(source, [nh, nw], antialias=True), pads, fill=PAD_VALUE)
    assert image.shape == theirs.shape
    assert (image.int() - theirs.int()).abs().max() <= 2  # resize kernels' rounding
    g = torch.Generator().manual_seed(1)
    xy = torch.rand(50, 2, generator=g) * torch.tensor([hw[1], hw[0]])
    wh = torch.rand(50, 2, generator=g) * torch.tensor([hw[1], hw[0]]) * 0.5 + 4
    boxes = torch.cat([xy, torch.minimum(xy + wh, torch.tensor([hw[1], hw[0]]))], 1)
    labels = torch.arange(50)
    mine, kept = map_boxes(boxes, labels, Window(*window), size)
    bb = tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=hw)
    tv = TF.pad(TF.resize(bb, [nh, nw]), pads).as_subclass(torch.Tensor)
    assert torch.allclose(mine, tv[kept], atol=1.0)  # the bound
    assert torch.allclose(mine, tv[kept], atol=1e-3)  # in fact: float rounding
    assert len(kept) >= 45  # only boxes under a pixel once shrunk go
    # and served boxes go back to the source's pixels
    back = to_source(mine[None], torch.tensor([list(window)]), size)[0]
    assert torch.allclose(back, boxes[kept], atol=1e-3)


@pytest.mark.parametrize("decoder,draft", [(Decoder.region, False), (Decoder.simplejpeg, True)])
def test_a_large_source_is_decoded_at_the_dct_scale_its_letterbox_allows(monkeypatch, decoder,
                                                                         draft):
    """A 216 x 384 source letterboxed to 128 x 128 shows a 72 x 128 picture: a 1/2-scale
    decode (108 x 192) still holds it. The scale was asked against the whole square (128
    high: 216 / 2 is under it), so a letterbox never took one; at 1080x1920 -> 640 that
    is a full decode where a half one does. Boxes and pixels stay those of torchvision's
    resize and pad."""
    from runner.data.decode import decoders

    if not decoders.DECODERS[decoder].available():
        pytest.skip(f"loader.decoder={decoder.value} is not installed here")
    hw, size = (216, 384), (128, 128)
    data = jpeg(*hw, seed=3)
    import simplejpeg

    scales = []
    real_region, real_simple = decoders.decode_region, simplejpeg.decode_jpeg

    def region(data, header, box, need):
        scales.append(decoders.region_scale(box, need))
        return real_region(data, header, box, need)

    def simple(data, **kwargs):  # libjpeg's scale: the decoded height against the source's
        out = real_simple(data, **kwargs)
        scales.append(hw[0] // out.shape[0])
        return out

    monkeypatch.setattr(decoders, "decode_region", region)
    monkeypatch.setattr(simplejpeg, "decode_jpeg", simple)
    image, window, _, _ = ImageDecoder(decoder, size, Crop.letterbox, draft=draft
                                       ).decode_window(data)
    assert scales == [2]
    top, left, nh, nw = letterbox_place(*hw, *size)
    assert (top, nh, nw) == (28, 72, 128)
    source = TF.pil_to_tensor(Image.open(io.BytesIO(data)).convert("RGB"))
    theirs = TF.pad(TF.resize(source, [nh, nw], antialias=True),
                    [left, top, size[1] - nw - left, size[0] - nh - top], fill=PAD_VALUE)
    assert (image.int() - theirs.int()).abs().float().mean() < 2
    boxes = torch.tensor([[40.0, 30, 200, 150]])
    mine, _ = map_boxes(boxes, torch.tensor([0]), Window(*window), size)
    bb = tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=hw)
    tv = TF.pad(TF.resize(bb, [nh, nw]), [left, top]).as_subclass(torch.Tensor)
    assert torch.allclose(mine, tv, atol=1.0)


@pytest.mark.parametrize("hw,size,crop,direct", [
    ((96, 128), (128, 128), Crop.letterbox, True),
    ((128, 72), (128, 128), Crop.letterbox, True),
    ((80, 96), (80, 96), Crop.whole, True),
    ((96, 128), (64, 64), Crop.letterbox, True),  # a 1/2-scale decode is its 48 x 64 picture
    ((100, 130), (64, 64), Crop.letterbox, False),  # 50 x 65 at 1/2 for 49 x 64: resized
    ((80, 96), (64, 96), Crop.whole, False)])
def test_a_window_that_needs_no_resize_is_decoded_straight_into_its_slot(monkeypatch, hw, size,
                                                                          crop, direct):
    """The region binding writes a window the letterbox (or whole crop) places unchanged
    straight into the batch slot as CHW planes at its place, the pads filled around it: no
    HWC image, no copy (``place`` is never called), and the slot's bytes are those of the
    decode-then-place path, pads included. One that needs a resize still takes ``place``."""
    from runner.data.decode import decoders

    if not decoders.DECODERS[Decoder.region].available():
        pytest.skip("loader.decoder=region is not built here")
    data = jpeg(*hw, seed=hw[1])
    decoder = ImageDecoder(Decoder.region, size, crop)
    placed = []
    real_place = ImageDecoder.place

    def place(self, *args, **kwargs):
        placed.append(args[1].shape)
        return real_place(self, *args, **kwargs)

    monkeypatch.setattr(ImageDecoder, "place", place)
    slots = torch.full((2, 3, *size), 7, dtype=torch.uint8)  # stale bytes in the slot
    image, window, flip, got_hw = decoder.decode_window(data, None, slots[1])
    assert (placed == []) == direct
    assert image.data_ptr() == slots[1].data_ptr() and (slots[0] == 7).all()
    reference, ref_window, _, _ = decoder.decode_window(data)  # the old path: place
    assert torch.equal(slots[1], reference)
    assert window == ref_window and not flip and got_hw == hw


def test_the_binding_writes_planes_at_any_strides():
    """``decode_batch``'s planar item with plane and row strides: the CHW window of a larger
    image, each plane where the strides say, nothing outside it touched; strides that would
    overlap their rows, or a destination too short, are refused."""
    from runner.data.decode import decoders

    if not decoders.DECODERS[Decoder.region].available():
        pytest.skip("loader.decoder=region is not built here")
    from runner.data.decode import _jpegregion

    data = jpeg(40, 56, seed=5)
    hwc = torch.frombuffer(_jpegregion.decode(data, 1, 0, 0, 40, 56), dtype=torch.uint8)
    chw = hwc.view(40, 56, 3).permute(2, 0, 1)
    big = torch.zeros((3, 64, 80), dtype=torch.uint8)
    dest = memoryview(big.numpy()).cast("B")[10 * 80 + 12 :]
    assert _jpegregion.decode_batch([(data, 1, 0, 0, 40, 56, dest, True, 64 * 80, 80)]) == [None]
    assert torch.equal(big[:, 10:50, 12:68], chw)
    big[:, 10:50, 12:68] = 0
    assert (big == 0).all()  # nothing written outside the window
    with pytest.raises(ValueError, match="overlap"):
        _jpegregion.decode_batch([(data, 1, 0, 0, 40, 56, dest, True, 56 * 39, 80)])
    with pytest.raises(ValueError, match="smaller"):
        _jpegregion.decode_batch([(data, 1, 0, 0, 40, 56, bytearray(3 * 40 * 56 - 1), True)])


def test_the_binding_writes_hwc_rows_at_any_row_stride():
    """``decode_batch``'s HWC item with a row stride: the window's rows at their place in a
    larger HWC image (a channels-last slot), nothing else touched, whole scanlines written
    straight in or a cropped window copied; too short a stride or buffer refused."""
    from runner.data.decode import decoders

    if not decoders.DECODERS[Decoder.region].available():
        pytest.skip("loader.decoder=region is not built here")
    from runner.data.decode import _jpegregion

    data = jpeg(40, 56, seed=3)
    for top, left, h, w in [(0, 0, 40, 56), (8, 16, 24, 32)]:  # whole rows; a crop
        alone = torch.frombuffer(_jpegregion.decode(data, 1, top, left, h, w),
                                 dtype=torch.uint8).view(h, w, 3)  # the window's own decode
        big = torch.zeros((64, 80, 3), dtype=torch.uint8)
        dest = memoryview(big.numpy()).cast("B")[(10 * 80 + 12) * 3 :]
        item = (data, 1, top, left, h, w, dest, False, 0, 80 * 3)
        assert _jpegregion.decode_batch([item]) == [None]
        assert torch.equal(big[10 : 10 + h, 12 : 12 + w], alone)
        big[10 : 10 + h, 12 : 12 + w] = 0
        assert (big == 0).all()  # nothing written outside the window
    with pytest.raises(ValueError, match="overlap"):
        _jpegregion.decode_batch([(data, 1, 0, 0, 40, 56, bytearray(10**5), False, 0, 56 * 3 - 1)])
    with pytest.raises(ValueError, match="smaller"):
        _jpegregion.decode_batch([(data, 1, 0, 0, 40, 56, bytearray(39 * 200 + 56 * 3 - 1),
                                   False, 0, 200)])


def test_a_packed_letterbox_fills_channels_last_batches_with_the_same_pixels(tmp_path,
                                                                             monkeypatch):
    """Where the binding decodes each picture straight into its slot, packed's batches are
    channels-last (HWC rows written in place, no split into planes): pixels, pads and boxes
    equal to the contiguous batches' of the planar decode; random crops stay contiguous."""
    from runner.data import build_data_path
    from runner.data.decode import decoders
    from runner.data.storage.packed import PackedStorage
    from runner.job.compose import compose

    if not decoders.DECODERS[Decoder.region].available():
        pytest.skip("loader.decoder=region is not built here")
    coco_set(tmp_path / "coco")
    base = [f"dataset.path={tmp_path / 'coco'}", "dataset.targets=coco", "loader=packed",
            "dataset.image_size=[64,64]", f"dataset.cache_dir={tmp_path / 'cache'}",
            "loader.batch_size=4", "loader.decoder=region", "loader.decode_threads=2"]

    def epoch(*extra: str) -> list[dict]:
        data = build_data_path(compose([*base, *extra]), torch.device("cpu"), epochs=1,
                               progress=False, every_image=True)
        try:
            return [{k: batch[k].clone(memory_format=torch.preserve_format)
                     for k in ("image", "boxes", "index")} for batch in data.device_batches()]
        finally:
            data.close()

    for store in (["dataset.store_side=longer", "dataset.store_size=64"],  # no resize
                  ["dataset.store_size=96"],  # each picture resized into place
                  ["dataset.store_side=longer", "dataset.store_size=64",
                   "loader.group_aspect=true"]):  # batches at their bins' shapes
        fast = epoch(*store)
        assert all(b["image"].permute(0, 2, 3, 1).is_contiguous()
                   and not b["image"].is_contiguous() for b in fast)
        monkeypatch.setattr(PackedStorage, "channels_last", property(lambda self: False))
        planar = epoch(*store)
        monkeypatch.undo()
        assert all(b["image"].is_contiguous() for b in planar)
        for a, b in zip(fast, planar, strict=True):
            assert torch.equal(a["index"], b["index"]) and torch.equal(a["boxes"], b["boxes"])
            assert torch.equal(a["image"], b["image"])
    config = compose([*base, "dataset.crop=random", "dataset.store_size=96"])
    from runner.data.storage import build_storage, resolve_dataset

    assert not build_storage(config.loader, config.dataset,
                             resolve_dataset(config.dataset)).channels_last


@pytest.mark.parametrize("hw", [(37, 56), (9, 12000), (70, 640)])
def test_planes_are_the_interleaved_decode_at_any_row_batch(hw):
    """The binding reads scanlines in batches sized to keep its row buffer in cache (16
    rows of a 640-wide picture, 2 of a 12000-wide one, a short last batch): every row
    lands in its planes, the last included, as the interleaved decode has it."""
    from runner.data.decode import decoders

    if not decoders.DECODERS[Decoder.region].available():
        pytest.skip("loader.decoder=region is not built here")
    from runner.data.decode import _jpegregion

    h, w = hw
    data = jpeg(h, w, seed=7)
    hwc = torch.frombuffer(_jpegregion.decode(data, 1, 0, 0, h, w), dtype=torch.uint8)
    planes = bytearray(3 * h * w)
    assert _jpegregion.decode_batch([(data, 1, 0, 0, h, w, planes, True)]) == [None]
    got = torch.frombuffer(planes, dtype=torch.uint8).view(3, h, w)
    assert torch.equal(got, hwc.view(h, w, 3).permute(2, 0, 1))


def test_shown_window_is_the_decoders():
    decoder = ImageDecoder(Decoder.pil, (96, 128), Crop.letterbox)
    _, window, _, hw = decoder.decode_window(jpeg(300, 170))
    assert tuple(vars(shown_window(hw, (96, 128), Crop.letterbox, 1.0)).values()) == \
        pytest.approx(window)


def test_detection_targets_default_to_the_letterbox_and_centre_is_said(caplog):
    from runner.job.compose import compose

    assert DatasetConfig(targets=Targets.yolo).crop is Crop.letterbox
    assert DatasetConfig().crop is Crop.center
    assert DatasetConfig(targets=Targets.yolo, crop=Crop.whole).crop is Crop.whole
    with caplog.at_level(logging.WARNING):
        assert compose(["dataset.targets=yolo"]).dataset.crop is Crop.letterbox
        assert "centre crop" not in caplog.text
        assert compose(["dataset.targets=yolo", "dataset.crop=center"]).dataset.crop \
            is Crop.center
    assert caplog.text.count("centre crop cuts away boxes") == 1


def test_validation_of_a_detector_is_letterboxed():
    from runner.job.compose import compose
    from runner.tasks.train.validation import validation_config

    config = compose(["dataset.targets=yolo", "dataset.val_fraction=0.2", "dataset.crop=random"])
    assert validation_config(config).dataset.crop is Crop.letterbox


def coco_set(root: Path) -> dict[str, tuple[int, list[list[float]]]]:
    """Non-square images in COCO layout; file name -> (image id, xyxy boxes)."""
    sizes = {"a.jpg": (90, 150), "b.jpg": (160, 90), "c.jpg": (100, 100), "d.jpg": (70, 130)}
    (root / "val2017").mkdir(parents=True)
    images, annotations, truth = [], [], {}
    for k, (name, (h, w)) in enumerate(sizes.items()):
        (root / "val2017" / name).write_bytes(jpeg(h, w, seed=k))
        images.append({"id": 11 + k, "file_name": name, "height": h, "width": w})
        rows = [[4 + k, 6, 4 + k + w // 2, 6 + h // 3], [w // 3, h // 2, w - 2, h - 3]]
        truth[name] = (11 + k, rows)
        for j, (x1, y1, x2, y2) in enumerate(rows):
            annotations.append({"id": 10 * k + j + 1, "image_id": 11 + k,
                                "category_id": (2, 5)[j], "bbox": [x1, y1, x2 - x1, y2 - y1],
                                "area": (x2 - x1) * (y2 - y1), "iscrowd": 0})
    (root / "annotations").mkdir()
    (root / "annotations" / "instances_val2017.json").write_text(json.dumps({
        "images": images, "annotations": annotations,
        "categories": [{"id": 2, "name": "bicycle"}, {"id": 5, "name": "airplane"}]}))
    return truth


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["folder", "packed", "shards", "memmap", "ram"])
def test_every_storage_letterboxes_and_serves_boxes_in_the_source_frame(tmp_path, loader):
    """Each storage's batches: grey pads where the letterbox puts them, the boxes where
    the source's boxes land in it (within a pixel: a store decodes its own resized copy),
    and those boxes served through ``ServedFrame`` score 1 in COCOeval against the set's
    own json."""
    pytest.importorskip("pycocotools")
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    from runner.data import build_data_path
    from runner.job.compose import compose
    from runner.tasks.infer.coco_results import ServedFrame, result_rows, write_results

    truth = coco_set(tmp_path / "coco")
    size = (48, 64)
    config = compose([f"dataset.path={tmp_path / 'coco'}", "dataset.targets=coco",
                      f"loader={loader}", f"dataset.image_size=[{size[0]},{size[1]}]",
                      f"dataset.cache_dir={tmp_path / 'cache'}", "loader.batch_size=4",
                      "loader.decoder=pil"])
    assert config.dataset.crop is Crop.letterbox  # the detectors' default
    data = build_data_path(config, torch.device("cpu"), epochs=1, progress=False,
                           every_image=True)
    frame = ServedFrame(data.storage.targets, config.dataset, lambda i: "")
    rows = []
    try:
        for batch in data.device_batches():
            index = batch["index"].numpy()
            windows = torch.from_numpy(frame.source_windows(index))
            for k, i in enumerate(index.tolist()):
                name = Path(data.storage.name_of(i)).name
                image_id, gt = truth[name]
                hw = tuple(int(v) for v in windows[k, 2:])
                top, left, nh, nw = letterbox_place(*frame._size(i), *size)
                image = batch["image"][k]
                pad = torch.ones(size, dtype=torch.bool)  # a store's own copy: a pixel more
                pad[max(top - 1, 0): top + nh + 1, max(left - 1, 0): left + nw + 1] = False
                assert (image[:, pad] == PAD_VALUE).all(), (loader, name, hw)
                n = int(batch["box_count"][k])
                expected, _ = map_boxes(torch.tensor(gt, dtype=torch.float32),
                                        torch.arange(len(gt)),
                                        Window(*windows[k].tolist()), size)
                assert torch.allclose(batch["boxes"][k, :n], expected, atol=1.0), loader
            served = to_source(batch["boxes"], windows.to(torch.float32), size)
            preds = {"boxes": served, "box_labels": batch["box_labels"],
                     "box_scores": torch.ones(batch["box_labels"].shape),
                     "box_count": batch["box_count"]}
            rows += result_rows([frame.image_id(int(i)) for i in index], preds,
                                frame.context()["category_ids"])
    finally:
        data.close()
    write_results(tmp_path / "r.json", rows)
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(tmp_path / "coco" / "annotations" / "instances_val2017.json"))
        check = COCOeval(gt, gt.loadRes(str(tmp_path / "r.json")), "bbox")
        check.evaluate()
        check.accumulate()
        check.summarize()
    # the folder decodes the source itself: exact; a store's copy at its own size rounds
    # each edge by up to a pixel of the 64 px output, which costs some IoU > 0.9 matches
    assert check.stats[1] == pytest.approx(1.0)  # mAP@0.5
    if loader == "folder":
        assert check.stats[0] == pytest.approx(1.0)


def test_memmap_refuses_a_letterbox_of_a_larger_store(tmp_path):
    from runner.common.errors import ConfigError
    from runner.config.schema import LoaderConfig, StorageName
    from runner.data.storage.memmap import decoding_folder

    dataset = DatasetConfig(targets=Targets.yolo, image_size=[32, 32], store_size=64)
    with pytest.raises(ConfigError, match="dataset.store_size=64"):
        decoding_folder(LoaderConfig(name=StorageName.memmap), dataset, tmp_path)


def test_served_boxes_reaching_into_the_pads_are_clipped_to_the_source(tmp_path):
    """A letterbox's pads lie outside the source image: a predicted box that reaches into
    them is served clipped to the image (ultralytics' ``clip_boxes`` does the same)."""
    from runner.data.sources.detection import DetectionTargets, ImageTargets
    from runner.tasks.infer.coco_results import ServedFrame
    from runner.tasks.infer.kinds.detections import DetectionsWriter
    from runner.tasks.infer.kinds.kind import WriterContext

    items = [ImageTargets(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), 100, 200, 7)]
    frame = ServedFrame(DetectionTargets(items, "coco"),
                        DatasetConfig(image_size=[64, 64], crop=Crop.letterbox), lambda i: "")
    ctx = WriterContext(tmp_path, "m", 1, lambda i: "a.jpg", lambda i: "a.jpg", ["c"], ["c"],
                        "predictions.csv", True, **frame.context())
    writer = DetectionsWriter(ctx, {})
    # 100 x 200 in 64 x 64: the picture in rows 16..48; a box from row 8 (the pad) to 40,
    # one wholly inside (rows 20..30, columns 10..20)
    kept = {"boxes": np.array([[[4.0, 8, 60, 40], [10, 20, 20, 30]]], dtype=np.float32),
            "box_scores": np.array([[0.9, 0.8]], dtype=np.float32),
            "box_labels": np.array([[0, 0]]), "box_count": np.array([2])}
    writer.write(0, np.array([0]), np.array([0]), kept)
    writer.flush()
    from runner.tasks.infer.coco_results import join_parts

    join_parts(tmp_path / "r.json", [tmp_path / ".detections.parts" / "00000000.json"])
    rows = json.loads((tmp_path / "r.json").read_text())
    assert [r["bbox"] for r in rows] == [[12.5, 0.0, 175.0, 75.0], [31.25, 12.5, 31.25, 31.25]]


def test_the_gpu_decoder_refuses_the_letterbox_in_one_line():
    from runner.common.errors import ConfigError
    from runner.config.schema import LoaderConfig, StorageName
    from runner.data.storage import settle_loader

    with pytest.raises(ConfigError, match="loader.decoder=nvjpeg has no dataset.crop=letterbox"):
        settle_loader(LoaderConfig(name=StorageName.folder, decoder=Decoder.nvjpeg),
                      DatasetConfig(crop=Crop.letterbox))


def test_a_detector_on_photos_without_labels_is_letterboxed_unless_asked(caplog):
    from runner.job.compose import compose

    detector = ["model.name=ssdlite320_mobilenet_v3_large", "task=infer"]
    assert compose(detector).dataset.crop is Crop.letterbox
    assert compose(["task=infer"]).dataset.crop is Crop.center  # a classifier
    with caplog.at_level(logging.WARNING):
        assert compose([*detector, "dataset.crop=center"]).dataset.crop is Crop.center
    assert caplog.text.count("centre crop cuts away") == 1


def test_a_packed_store_at_the_letterbox_size_decodes_straight_into_the_batch(tmp_path,
                                                                              monkeypatch):
    """A store kept at the letterbox's long side (``dataset.store_side=longer``) holds each
    picture at the size the letterbox places it: the batch decode writes every one into
    its slot as planes (``place`` is never called) and the batches are byte for byte
    those of decoding to an image and placing it."""
    from runner.data import build_data_path
    from runner.data.decode import decoders
    from runner.job.compose import compose

    if not decoders.DECODERS[Decoder.region].available():
        pytest.skip("loader.decoder=region is not built here")
    coco_set(tmp_path / "coco")
    config = compose([f"dataset.path={tmp_path / 'coco'}", "dataset.targets=coco",
                      "loader=packed", "dataset.image_size=[64,64]",
                      "dataset.store_side=longer", "dataset.store_size=64",
                      f"dataset.cache_dir={tmp_path / 'cache'}", "loader.batch_size=4",
                      "loader.decoder=region", "loader.decode_threads=1"])

    def epoch() -> list[dict]:
        data = build_data_path(config, torch.device("cpu"), epochs=1, progress=False,
                               every_image=True)
        try:
            return [{k: batch[k].clone() for k in ("image", "boxes", "index")}
                    for batch in data.device_batches()]
        finally:
            data.close()

    placed = []
    real_place = ImageDecoder.place
    monkeypatch.setattr(ImageDecoder, "place",
                        lambda self, *a, **k: placed.append(1) or real_place(self, *a, **k))
    direct = epoch()
    assert placed == [] and sum(len(b["index"]) for b in direct) == 4
    monkeypatch.setattr(ImageDecoder, "direct", lambda self, *a: None)  # the old path
    old = epoch()
    assert len(placed) == 4
    for a, b in zip(direct, old):
        assert torch.equal(a["index"], b["index"]) and torch.equal(a["boxes"], b["boxes"])
        assert torch.equal(a["image"], b["image"])
        assert (a["image"] == PAD_VALUE).any()  # the pads were filled around the pictures


def test_a_packed_crop_without_a_seed_is_worked_out_once_per_stored_size(tmp_path):
    """``fixed_geometry``: the crop of a store's image depends on the decoder and the stored
    size alone where there is no crop seed, so a second epoch works nothing out again; what
    it hands out is ``crop_geometry``'s own answer; a random crop is never cached."""
    from runner.data.storage import build_storage, resolve_dataset
    from runner.data.storage.packed import crop_geometry, fixed_geometry
    from runner.job.compose import compose

    coco_set(tmp_path / "coco")
    config_args = [f"dataset.path={tmp_path / 'coco'}", "dataset.targets=coco",
                   "loader=packed", "dataset.image_size=[64,64]",
                   "dataset.store_side=longer", "dataset.store_size=64",
                   f"dataset.cache_dir={tmp_path / 'cache'}", "loader.decoder=region"]
    config = compose(config_args)
    storage = build_storage(config.loader, config.dataset, resolve_dataset(config.dataset))
    if not storage.native_batches:
        pytest.skip("loader.decoder=region is not built here")
    out = torch.empty((len(storage), *storage.item_shape), dtype=torch.uint8)
    fixed_geometry.cache_clear()
    storage.decode_slice(out, range(len(storage)), list(range(len(storage))))
    sizes = {(storage.heights[i], storage.widths[i]) for i in range(len(storage))}
    assert fixed_geometry.cache_info().misses == len(sizes) == 4
    first = out.clone()
    storage.decode_slice(out, range(len(storage)), list(range(len(storage))))
    assert fixed_geometry.cache_info().misses == 4 and torch.equal(out, first)
    decoder = storage.decoder_for(0)
    hw = (storage.heights[0], storage.widths[0])
    assert fixed_geometry(decoder, hw) == crop_geometry(decoder, hw, None)
    random = ImageDecoder(Decoder.region, (64, 64), Crop.random)
    assert crop_geometry(random, hw, 1) != crop_geometry(random, hw, 2)  # seeds: not cached
    config = compose([*config_args, "dataset.crop=random"])
    storage = build_storage(config.loader, config.dataset, resolve_dataset(config.dataset))
    fixed_geometry.cache_clear()  # a random crop with no seed (the decode probe's) is drawn
    storage.decode_slice(out, range(len(storage)), list(range(len(storage))))  # each time
    assert fixed_geometry.cache_info().currsize == 0
