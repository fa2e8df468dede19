"""Boxes follow the pixels: the runner's crops, resizes and flips map boxes as torchvision's
transforms v2 maps ``tv_tensors.BoundingBoxes`` through the same crops (within a pixel), and
onto the pixels the decoders and the device's augmentation really produce."""

from __future__ import annotations

import io
from dataclasses import fields

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from runner.config.schema import Crop, Decoder
from runner.data.decode.boxgeometry import (
    MIN_SIDE,
    PAD_LABEL,
    Window,
    center_windows,
    cut_window,
    decoder_window,
    map_boxes,
    map_padded,
    pad,
    unpad,
)
from runner.data.decode.crops import BatchAugment, Boxes, CenterCrop
from runner.data.decode.decoders import Box, ImageDecoder

HW = (300, 400)
SIZE = (128, 160)
SEEDS = range(12)


def random_boxes(n: int, hw=HW, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Boxes of every size, some reaching the image's edges."""
    g = torch.Generator().manual_seed(seed)
    h, w = hw
    xy = torch.rand(n, 2, generator=g) * torch.tensor([w, h])
    wh = torch.rand(n, 2, generator=g) ** 2 * torch.tensor([w, h]) * 0.6 + 0.5
    boxes = torch.cat([xy, torch.minimum(xy + wh, torch.tensor([w, h]))], 1)
    return boxes, torch.randint(0, 5, (n,), generator=g)


def torchvision_boxes(boxes, labels, hw, window: Window, size, flip: bool):
    """torchvision v2: resized_crop with the same window, the flip, then ClampBoundingBoxes and
    SanitizeBoundingBoxes with its defaults (what MIN_SIDE keeps to), its recommended ending:
    without the clamp, float32 rounding (150 * (160 / 150) = 160.00002) puts a box's edge a
    hair past the canvas, and Sanitize drops it."""
    bb = tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=hw)
    out = TF.resized_crop(bb, int(window.top), int(window.left), int(window.height),
                          int(window.width), list(size))
    if flip:
        out = TF.horizontal_flip(out)
    return sanitized(out, labels)


def sanitized(out, labels):
    kept = v2.SanitizeBoundingBoxes()({"boxes": v2.ClampBoundingBoxes()(out), "labels": labels})
    return kept["boxes"].as_subclass(torch.Tensor), kept["labels"]


def assert_same(mine, theirs):
    (boxes, labels), (tv_boxes, tv_labels) = mine, theirs
    assert labels.tolist() == tv_labels.tolist()
    assert torch.allclose(boxes, tv_boxes, atol=1.0)  # the bound
    assert torch.allclose(boxes, tv_boxes, atol=1e-3)  # what it is in fact: float rounding


@pytest.mark.parametrize("fraction", [0.875, 1.0, 0.5])
def test_center_crops_equal_torchvision_center_crop_and_resize(fraction):
    boxes, labels = random_boxes(300)
    decoder = ImageDecoder(Decoder.pil, SIZE, Crop.center, fraction=fraction)
    window, flip = decoder_window(decoder, HW)
    assert not flip
    mine = map_boxes(boxes, labels, window, SIZE)
    assert 0 < len(mine[1]) < len(labels)  # some boxes left the crop
    assert_same(mine, torchvision_boxes(boxes, labels, HW, window, SIZE, False))
    # torchvision's own centre crop of that window's size cuts the same window
    bb = tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=HW)
    out = TF.resize(TF.center_crop(bb, [int(window.height), int(window.width)]), list(SIZE))
    assert_same(mine, sanitized(out, labels))


@pytest.mark.parametrize("seed", SEEDS)
def test_random_resized_crops_and_flips_equal_torchvision(seed):
    boxes, labels = random_boxes(200, seed=seed)
    decoder = ImageDecoder(Decoder.pil, SIZE, Crop.random)
    window, flip = decoder_window(decoder, HW, seed)
    mine = map_boxes(boxes, labels, window, SIZE, flip)
    assert_same(mine, torchvision_boxes(boxes, labels, HW, window, SIZE, flip))


def test_the_seeds_cover_flips_and_crops_that_drop_boxes():
    decoder = ImageDecoder(Decoder.pil, SIZE, Crop.random)
    flips = {decoder_window(decoder, HW, s)[1] for s in SEEDS}
    assert flips == {True, False}


def test_flip_alone_and_whole_image_equal_torchvision():
    boxes, labels = random_boxes(100, seed=3)
    window, _ = decoder_window(ImageDecoder(Decoder.pil, SIZE, Crop.whole), HW)
    assert window == Window(0, 0, *HW)
    for flip in (False, True):
        mine = map_boxes(boxes, labels, window, SIZE, flip)
        assert len(mine[1]) > 75  # only boxes under a pixel once shrunk go
        assert_same(mine, torchvision_boxes(boxes, labels, HW, window, SIZE, flip))


def test_the_drop_rule_is_min_side_output_pixels():
    boxes = torch.tensor([[0.0, 0, 10, 10], [0, 0, 10, 0.9], [0, 0, 10, 1.0],
                          [-5, -5, -1, -1], [95, 0, 130, 10], [99.5, 0, 130, 10]])
    labels = torch.arange(6)
    out, kept = map_boxes(boxes, labels, Window(0, 0, 100, 100), (100, 100))
    assert MIN_SIDE == 1.0
    assert kept.tolist() == [0, 2, 4]  # 0.9 high: dropped; outside: dropped; 0.5 left: dropped
    assert out[2].tolist() == [95, 0, 100, 10]  # clipped to the output


def test_a_reduced_scale_decode_cuts_its_window_in_source_pixels():
    box = Box(10.3, 20.6, 100.2, 150.7)
    assert cut_window(box, HW) == Window(10, 21, 100, 151)
    # at half scale the window is cut on the half-size image: (5, 10, 50, 75) there
    assert cut_window(box, HW, (150, 200)) == Window(10, 20, 100, 150)


# --- onto the pixels -------------------------------------------------------------------------

def rectangles_png(hw=HW) -> tuple[bytes, torch.Tensor, torch.Tensor]:
    """White rectangles on black, and their boxes (the pixels they cover)."""
    h, w = hw
    boxes = torch.tensor([[20.0, 30, 120, 110], [200, 40, 380, 100], [150, 150, 260, 280],
                          [0, 230, 60, 300], [300, 160, 400, 260]])
    img = np.zeros((h, w, 3), np.uint8)
    for x1, y1, x2, y2 in boxes.int().tolist():
        img[y1:y2, x1:x2] = 255
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "PNG")
    return buf.getvalue(), boxes, torch.arange(len(boxes))


def assert_boxes_on_pixels(image: torch.Tensor, boxes: torch.Tensor, slivers: torch.Tensor):
    """Each box is the extent of the bright pixels around it (within 1 px), and every
    bright pixel is in a box or a sliver too thin to keep (its edge blurred)."""
    bright = image.float().mean(0) > 127
    h, w = bright.shape
    for x1, y1, x2, y2 in boxes.tolist():
        y0, x0 = max(int(y1) - 2, 0), max(int(x1) - 2, 0)
        near = bright[y0 : int(y2) + 3, x0 : int(x2) + 3]
        rows, cols = torch.nonzero(near.any(1)).flatten(), torch.nonzero(near.any(0)).flatten()
        found = [x0 + cols[0], y0 + rows[0], x0 + cols[-1] + 1, y0 + rows[-1] + 1]
        assert torch.allclose(torch.tensor(found, dtype=torch.float32),
                              torch.tensor([x1, y1, x2, y2]), atol=1.0), (found, (x1, y1, x2, y2))
    covered = torch.zeros_like(bright)
    for x1, y1, x2, y2 in slivers.tolist():
        covered[max(int(y1) - 1, 0) : int(y2) + 2, max(int(x1) - 1, 0) : int(x2) + 2] = True
    assert not (bright & ~covered).any()


@pytest.mark.parametrize("seed", range(6))
def test_boxes_land_on_the_pixels_the_decoder_cuts(seed):
    data, boxes, labels = rectangles_png()
    decoder = ImageDecoder(Decoder.pil, SIZE, Crop.random)
    image = decoder(data, seed)
    window, flip = decoder_window(decoder, HW, seed)
    mapped, _ = map_boxes(boxes, labels, window, SIZE, flip)
    slivers, _ = map_boxes(boxes, labels, window, SIZE, flip, min_side=1e-6)
    assert_boxes_on_pixels(image, mapped, slivers)


def test_center_crop_boxes_land_on_the_decoded_pixels():
    data, boxes, labels = rectangles_png()
    decoder = ImageDecoder(Decoder.pil, SIZE, Crop.center, fraction=0.875)
    window, _ = decoder_window(decoder, HW)
    mapped, _ = map_boxes(boxes, labels, window, SIZE)
    slivers, _ = map_boxes(boxes, labels, window, SIZE, min_side=1e-6)
    assert_boxes_on_pixels(decoder(data), mapped, slivers)


# --- the padded batch, on the device ---------------------------------------------------------

def test_pad_and_unpad():
    boxes = [torch.ones(2, 4), torch.zeros(0, 4), 2 * torch.ones(3, 4)]
    labels = [torch.tensor([1, 2]), torch.zeros(0, dtype=torch.int64), torch.tensor([0, 0, 4])]
    batch = pad(boxes, labels)
    assert batch["boxes"].shape == (3, 3, 4) and batch["boxes"].dtype == torch.float32
    assert batch["box_labels"].dtype == torch.int64 and batch["box_count"].tolist() == [2, 0, 3]
    assert batch["box_labels"].tolist() == [[1, 2, -1], [-1, -1, -1], [0, 0, 4]]
    assert batch["boxes"][0, 2].tolist() == [0, 0, 0, 0] and PAD_LABEL == -1
    for (b, lab), b0, l0 in zip(unpad(batch["boxes"], batch["box_labels"], batch["box_count"]),
                                boxes, labels):
        assert torch.equal(b, b0) and torch.equal(lab, l0)
    assert pad([torch.zeros(0, 4)], [torch.zeros(0, dtype=torch.int64)])["boxes"].shape == \
        (1, 1, 4)
    assert pad(boxes, labels, max_boxes=5)["boxes"].shape == (3, 5, 4)
    with pytest.raises(ValueError, match="more than max_boxes=2"):
        pad(boxes, labels, max_boxes=2)


def test_gather_padded_from_a_ragged_table_equals_pad_of_its_rows():
    """memmap's and ram's side store: rows ``starts[k]`` to ``starts[k] + counts[k]`` of a
    flat table per image (room left unused past each count), gathered for any slots in any
    order as ``pad`` pads the same rows."""
    from runner.data.decode.boxgeometry import gather_padded

    per_image = [random_boxes(n, seed=n) for n in (3, 0, 5, 1, 0, 2)]
    room = [n + 2 for n in (3, 0, 5, 1, 0, 2)]  # each slot with room to spare
    starts = torch.tensor([0, *room]).cumsum(0)[:-1]
    table = torch.full((sum(room), 4), -7.0)
    labels = torch.full((sum(room),), -7, dtype=torch.int64)
    for (b, lab), start in zip(per_image, starts.tolist()):
        table[start : start + len(b)], labels[start : start + len(b)] = b, lab
    counts = torch.tensor([len(b) for b, _ in per_image])
    for slots in ([0, 1, 2, 3, 4, 5], [2, 2, 0], [4, 1], [5]):
        index = torch.tensor(slots)
        got = gather_padded(table, labels, starts[index], counts[index])
        expected = pad([per_image[k][0] for k in slots], [per_image[k][1] for k in slots])
        assert got.keys() == expected.keys()
        for key in got:
            assert torch.equal(got[key], expected[key]), (slots, key)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def on(device: str, crops: Boxes) -> Boxes:
    return Boxes(*(getattr(crops, f.name).to(device) for f in fields(Boxes)))


@pytest.mark.parametrize("device", DEVICES)
def test_device_random_crops_move_the_padded_boxes_as_per_image(device):
    """BatchAugment's crops of a store (the windows the decoders cut for the same seeds) move
    a padded batch's boxes as map_boxes moves each image's, and as torchvision does."""
    n = len(SEEDS)
    per_image = [random_boxes(int(k) % 7 * 9, seed=k) for k in SEEDS]  # 0 to 54 boxes
    batch = {k: v.to(device) for k, v in pad([b for b, _ in per_image],
                                             [lab for _, lab in per_image]).items()}
    aug = BatchAugment(SIZE)
    draws = {k: v.to(device) for k, v in BatchAugment.draws(list(SEEDS)).items()}
    crops = aug.boxes(n, *HW, torch.device(device), draws=draws)
    out = map_padded(batch["boxes"], batch["box_labels"], batch["box_count"], crops, SIZE)
    assert out[0].device.type == device
    out_boxes, out_labels, counts = (t.cpu() for t in out)
    crops, batch = on("cpu", crops), {k: v.cpu() for k, v in batch.items()}
    assert out_boxes.shape == batch["boxes"].shape
    decoder = ImageDecoder(Decoder.pil, SIZE, Crop.random)
    rows = unpad(out_boxes, out_labels, counts)
    for k, ((b, lab), (got_b, got_l)) in enumerate(zip(per_image, rows)):
        window, flip = decoder_window(decoder, HW, SEEDS[k])
        assert bool(crops.flip[k]) == flip
        assert (crops.top[k], crops.left[k], crops.height[k], crops.width[k]) == \
            (window.top, window.left, window.height, window.width)
        expected = map_boxes(b, lab, window, SIZE, flip)
        assert torch.equal(got_b, expected[0]) and torch.equal(got_l, expected[1])
        assert_same((got_b, got_l), torchvision_boxes(b, lab, HW, window, SIZE, flip))
        m = int(counts[k])  # past the count: padding
        assert (out_labels[k, m:] == PAD_LABEL).all() and (out_boxes[k, m:] == 0).all()
    assert counts.sum() < batch["box_count"].sum()  # the crops dropped some


@pytest.mark.parametrize("device", DEVICES)
def test_device_random_crops_boxes_land_on_the_augmented_pixels(device):
    data, boxes, labels = rectangles_png()
    with Image.open(io.BytesIO(data)) as img:
        store = torch.from_numpy(np.asarray(img.convert("RGB"))).permute(2, 0, 1)
    seeds = list(range(6))
    images = store[None].expand(len(seeds), -1, -1, -1).contiguous().to(device)
    aug = BatchAugment(SIZE)
    draws = {k: v.to(device) for k, v in BatchAugment.draws(seeds).items()}
    crops = aug.boxes(len(seeds), *HW, torch.device(device), draws=draws)
    out = aug.apply(images, crops).cpu()  # one grid_sample for the batch
    batch = {k: v.to(device) for k, v in pad([boxes] * len(seeds),
                                             [labels] * len(seeds)).items()}
    kept = [t.cpu() for t in map_padded(batch["boxes"], batch["box_labels"],
                                        batch["box_count"], crops, SIZE)]
    slivers = [t.cpu() for t in map_padded(batch["boxes"], batch["box_labels"],
                                           batch["box_count"], crops, SIZE, min_side=1e-6)]
    for k, ((b, _), (s, _)) in enumerate(zip(unpad(*kept), unpad(*slivers))):
        assert_boxes_on_pixels(out[k], b, s)


def test_device_center_crop_of_a_larger_store_equals_torchvision():
    store_hw, size = (256, 256), (224, 224)
    boxes, labels = random_boxes(150, store_hw, seed=9)
    windows = center_windows(2, store_hw, size, 0.875)
    batch = pad([boxes, boxes[:40]], [labels, labels[:40]])
    rows = unpad(*map_padded(batch["boxes"], batch["box_labels"], batch["box_count"], windows,
                             size))
    bb = tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=store_hw)
    assert_same(rows[0], sanitized(TF.center_crop(bb, list(size)), labels))
    # and the pixels CenterCrop keeps are that window
    images = torch.arange(256 * 256, dtype=torch.int32).reshape(1, 1, 256, 256)
    top, left = int(windows.top[0]), int(windows.left[0])
    assert torch.equal(CenterCrop(size, 0.875)(images), images[..., top : top + 224,
                                                                left : left + 224])


def test_one_images_mapping_is_the_batched_mappings_bit_for_bit():
    """``map_boxes`` (one image, in numpy: the decode threads' path) and ``_map`` (windows
    broadcast over a batch, in torch: the device's path) are the same float32 arithmetic, so
    a box lands on the same pixel whichever path crops it: equal bits, kept boxes alike."""
    from runner.data.decode.boxgeometry import _map

    g = np.random.default_rng(0)
    for _ in range(2000):
        n = int(g.integers(0, 7))
        b = torch.from_numpy(g.uniform(-30, 670, (n, 4)).astype(np.float32))
        b = torch.cat([torch.minimum(b[:, :2], b[:, 2:]), torch.maximum(b[:, :2], b[:, 2:])], 1)
        if g.random() < 0.3:
            b = b.round()
        window = Window(*g.uniform([-100, -100, 50, 50], [200, 200, 900, 900]).tolist())
        size = (int(g.choice([96, 128, 480, 640])), int(g.choice([96, 128, 333, 640])))
        flip = bool(g.random() < 0.5)
        labels = torch.arange(n)
        mapped, kept = map_boxes(b, labels, window, size, flip)
        theirs, keep = _map(b, window.top, window.left, window.height, window.width, size,
                            torch.tensor(flip) if flip else None, MIN_SIDE)
        assert mapped.dtype == torch.float32 and torch.equal(mapped, theirs[keep])
        assert torch.equal(kept, labels[keep])
