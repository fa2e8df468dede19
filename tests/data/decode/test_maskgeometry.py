"""Masks follow the pixels: the runner's crops, resizes, flips and letterbox move a mask as
torchvision v2 moves a ``tv_tensors.Mask`` (exactly), onto the pixels the decoders cut, on
a batch on the device, and a prediction goes back into the source frame."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as TF

from runner.config.schema import Crop, Decoder
from runner.data.decode.boxgeometry import Window, center_windows, decoder_window
from runner.data.decode.crops import BatchAugment, Boxes
from runner.data.decode.decoders import ImageDecoder
from runner.data.decode.maskgeometry import (
    Placement,
    letterbox_layout,
    letterbox_mask,
    map_mask,
    map_masks,
    mask_to_source,
)
from runner.data.sources.masklabels import IGNORE

HW = (300, 400)
SIZE = (128, 160)
SEEDS = list(range(12))
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def blocks(hw=HW, cell: int = 25, seed: int = 0) -> torch.Tensor:
    """A [H, W] uint8 mask of class ids in square cells (ids 0..5, some 255)."""
    g = torch.Generator().manual_seed(seed)
    h, w = hw
    ids = torch.randint(0, 6, (h // cell + 1, w // cell + 1), generator=g).to(torch.uint8)
    ids[0, 1] = IGNORE
    return ids.repeat_interleave(cell, 0).repeat_interleave(cell, 1)[:h, :w].contiguous()


def v2_mask(mask, window: Window, size, flip: bool) -> torch.Tensor:
    out = TF.resized_crop(tv_tensors.Mask(mask), int(window.top), int(window.left),
                          int(window.height), int(window.width), list(size))
    return (TF.horizontal_flip(out) if flip else out).as_subclass(torch.Tensor)


@pytest.mark.parametrize("seed", SEEDS[:6])
def test_a_random_crop_moves_the_mask_as_torchvision_v2(seed):
    decoder = ImageDecoder(Decoder.pil, SIZE, Crop.random)
    window, flip = decoder_window(decoder, HW, seed)
    mask = blocks()
    got = map_mask(mask, window, SIZE, flip)
    assert got.dtype == torch.uint8 and got.shape == SIZE
    assert torch.equal(got, v2_mask(mask, window, SIZE, flip))
    assert set(got.unique().tolist()) <= set(mask.unique().tolist())  # never a blended id


def test_whole_image_resize_and_centre_crop_equal_torchvision_v2():
    mask = blocks()
    whole, _ = decoder_window(ImageDecoder(Decoder.pil, SIZE, Crop.whole), HW)
    assert torch.equal(map_mask(mask, whole, SIZE),
                       TF.resize(tv_tensors.Mask(mask), list(SIZE)).as_subclass(torch.Tensor))
    assert torch.equal(map_mask(mask, whole, SIZE, flip=True),
                       TF.horizontal_flip(TF.resize(tv_tensors.Mask(mask), list(SIZE))))
    centre, _ = decoder_window(ImageDecoder(Decoder.pil, SIZE, Crop.center, fraction=1.0), HW)
    assert torch.equal(map_mask(mask, centre, SIZE), v2_mask(mask, centre, SIZE, False))


def mask_png(mask: torch.Tensor) -> bytes:
    """An RGB image whose colour is its class (id * 40), for a decoder to cut."""
    rgb = (mask.clamp(max=6) * 40).to(torch.uint8)[..., None].expand(-1, -1, 3).numpy()
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(rgb)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("crop,seed", [(Crop.random, s) for s in SEEDS[:6]]
                         + [(Crop.center, None), (Crop.whole, None)])
def test_the_mask_lands_on_the_pixels_the_decoder_cuts(crop, seed):
    """The decoder's own crop of an image painted by its mask: inside each cell (away from
    the blended edges) the pixels' colour is the mask's class."""
    mask = blocks(cell=40)
    decoder = ImageDecoder(Decoder.pil, SIZE, crop, fraction=0.875)
    image = decoder(mask_png(mask), seed)
    window, flip = decoder_window(decoder, HW, seed)
    got = map_mask(mask, window, SIZE, flip).long().clamp(max=6)
    colour = image.float().mean(0)
    # a pixel whose 5x5 neighbourhood is one class is away from an edge (a reduction's
    # antialiasing blends over more than a pixel; the border's unseen neighbours count as
    # another class)
    pad = torch.nn.functional.pad(got[None, None].float(), (2, 2, 2, 2), value=-1.0)
    same = (torch.nn.functional.max_pool2d(pad, 5, 1) == -torch.nn.functional.max_pool2d(
        -pad, 5, 1))[0, 0]
    assert same.float().mean() > 0.5
    assert (colour[same] - got[same] * 40).abs().max() <= 2


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_on_the_device_equals_each_image_through_v2(device):
    """BatchAugment's crops (the decoders' windows for the same seeds, flips included) and
    the centre windows of a store: one gather equals v2 image by image, exactly."""
    masks = torch.stack([blocks(seed=k, cell=7 + k) for k in SEEDS]).to(device)
    draws = {k: v.to(device) for k, v in BatchAugment.draws(SEEDS).items()}
    crops = BatchAugment(SIZE).boxes(len(SEEDS), *HW, torch.device(device), draws=draws)
    out = map_masks(masks, crops, SIZE)
    assert out.device.type == device and out.dtype == torch.uint8
    assert crops.flip.any() and not crops.flip.all()
    for k in range(len(SEEDS)):
        window = Window(*(float(getattr(crops, f)[k]) for f in ("top", "left", "height",
                                                                  "width")))
        assert torch.equal(out[k].cpu(), v2_mask(masks[k].cpu(), window, SIZE,
                                                 bool(crops.flip[k])))
    centre = map_masks(masks, center_windows(len(SEEDS), HW, SIZE, 0.875, device), SIZE)
    one = center_windows(1, HW, SIZE, 0.875)
    window = Window(float(one.top), float(one.left), float(one.height), float(one.width))
    for k in range(len(SEEDS)):
        assert torch.equal(centre[k].cpu(), v2_mask(masks[k].cpu(), window, SIZE, False))


def test_odd_scales_and_a_one_pixel_window_equal_v2():
    """Enlargements, reductions, the 2x and 1x special cases of PyTorch's nearest kernel."""
    mask = blocks((97, 131), cell=3)
    cases = [(0, 0, 97, 131), (5, 7, 64, 80), (10, 3, 32, 40), (1, 2, 1, 1), (3, 9, 61, 17)]
    for top, left, h, w in cases:
        for size in [(64, 80), (33, 129), (7, 5)]:
            crops = Boxes(*(torch.tensor([float(v)]) for v in (top, left, h, w)),
                          torch.tensor([False]))
            assert torch.equal(map_masks(mask[None], crops, size)[0],
                               v2_mask(mask, Window(top, left, h, w), size, False)), \
                ((top, left, h, w), size)


def test_letterbox_layout_is_ultralytics_and_pads_with_ignore():
    assert letterbox_layout((300, 400), (128, 128)) == Placement(16, 0, 96, 128)
    assert letterbox_layout((400, 300), (128, 128)) == Placement(0, 16, 128, 96)
    # odd padding: ultralytics' round(d/2 - 0.1) before, the rest after (43 -> 21 + 22)
    assert letterbox_layout((100, 300), (64, 64)) == Placement(21, 0, 21, 64)
    assert letterbox_layout((64, 64), (64, 64)) == Placement(0, 0, 64, 64)
    mask = blocks()
    place = letterbox_layout(HW, (128, 128))
    out = letterbox_mask(mask, place, (128, 128))
    assert out.shape == (128, 128)
    assert (out[:16] == IGNORE).all() and (out[16 + 96 :] == IGNORE).all()
    expected = TF.resize(tv_tensors.Mask(mask), [96, 128]).as_subclass(torch.Tensor)
    assert torch.equal(out[16 : 16 + 96], expected)


def test_a_prediction_goes_back_to_the_source_frame_hand_derived():
    """A 40x40 window at (10, 20) of a 100x100 source, predicted at 20x20: each prediction
    pixel is a 2x2 block of source pixels; outside the window, IGNORE."""
    pred = torch.arange(400, dtype=torch.int64).reshape(20, 20) % 250
    out = mask_to_source(pred, Window(10, 20, 40, 40), (100, 100))
    assert out.shape == (100, 100)
    assert out[10, 20] == pred[0, 0] and out[11, 21] == pred[0, 0]
    assert out[12, 20] == pred[1, 0] and out[49, 59] == pred[19, 19]
    assert out[10 + 2 * 7 + 1, 20 + 2 * 3] == pred[7, 3]
    assert (out[:10] == IGNORE).all() and (out[50:] == IGNORE).all()
    assert (out[:, :20] == IGNORE).all() and (out[:, 60:] == IGNORE).all()
    # flipped: the prediction's column j is the window's column 19 - j
    flipped = mask_to_source(pred.flip(-1), Window(10, 20, 40, 40), (100, 100), flip=True)
    assert torch.equal(flipped, out)
    # 1.5 source pixels per prediction pixel: source centres 0.5, 1.5, 2.5 fall in the
    # prediction's footprints [0, 1.5), [1.5, 3), [1.5, 3): rows and columns 0, 1, 1
    small = torch.tensor([[1, 2], [3, 4]])
    up = mask_to_source(small, Window(0, 0, 3, 3), (3, 3))
    assert up.tolist() == [[1, 2, 2], [3, 4, 4], [3, 4, 4]]


def test_letterboxed_prediction_back_to_source_is_the_whole_image():
    mask = blocks(cell=50)
    place = letterbox_layout(HW, (150, 200))  # exactly half: 150x200, no padding
    assert place == Placement(0, 0, 150, 200)
    place = letterbox_layout(HW, (200, 200))
    boxed = letterbox_mask(mask, place, (200, 200))
    back = mask_to_source(boxed, Window(0, 0, *HW), HW, placement=place)
    assert back.shape == HW
    assert (back == mask).float().mean() > 0.97  # a cell's edge moves by under a pixel
    assert not (back == IGNORE).logical_and(mask != IGNORE).any()  # no padding leaks in


def test_an_integer_reduction_round_trips_exactly():
    mask = blocks(cell=20)  # cells a multiple of the 4x reduction
    window = Window(20, 40, 200, 320)
    small = map_mask(mask, window, (50, 80))
    back = mask_to_source(small, window, HW)
    assert torch.equal(back[20:220, 40:360], mask[20:220, 40:360])


@pytest.mark.parametrize("hw,size", [(HW, (128, 128)), ((100, 300), (64, 64)),
                                     ((300, 200), (96, 128))])
def test_a_letterbox_decode_places_the_mask_on_its_pixels_and_ignores_the_pads(hw, size):
    """The decoder's letterbox window (reaching over the pads) takes the mask to where the
    pixels went: ``letterbox_mask`` at ultralytics' layout, the pads ``IGNORE`` (was: the
    window stretched over the pads, which v2's crop filled with class 0)."""
    mask = TF.resize(tv_tensors.Mask(blocks(cell=40)), list(hw)).as_subclass(torch.Tensor)
    decoder = ImageDecoder(Decoder.pil, size, Crop.letterbox)
    image, window, flip, upright = decoder.decode_window(mask_png(mask))  # as a decode's
    assert upright == hw and window[0] + window[1] < 0  # over the pads
    got = map_mask(mask, Window(*window), size, flip)
    place = letterbox_layout(hw, size)
    assert torch.equal(got, letterbox_mask(mask, place, size))
    pads = torch.ones(size, dtype=torch.bool)
    pads[place.top : place.top + place.height, place.left : place.left + place.width] = False
    assert pads.any() and (got[pads] == IGNORE).all()
    assert (image[:, pads] == 114).all() and (image[:, ~pads] != 114).any()  # its grey
