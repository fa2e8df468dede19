"""The data path's device stage: a decoded store's crops on the device move a detection
batch's boxes with its pixels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from runner.config.schema import Crop, Decoder, TargetName
from runner.data.decode.boxgeometry import Window, decoder_window, unpad
from runner.data.decode.decoders import ImageDecoder
from runner.data.targets import TARGETS
from tests.data.decode.test_boxgeometry import assert_same, torchvision_boxes

SIZE = (48, 56)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    from runner.data.sources.shapes import ShapesSpec, ensure_shapes

    return ensure_shapes(ShapesSpec(num_images=30, height=64, width=80, seed=4),
                         tmp_path_factory.mktemp("shapes"), progress=False)


CROPS = {"random": ["dataset.crop=random"],
         "centre of a larger store": ["dataset.crop=center", "dataset.store_size=72"],
         "random of a larger store": ["dataset.crop=random", "dataset.store_size=72"]}


@pytest.mark.parametrize("crop", list(CROPS))
@pytest.mark.parametrize("loader,device", [
    ("memmap", "cpu"), ("ram", "cpu"),
    pytest.param("memmap", "cuda", marks=pytest.mark.cuda)])
def test_the_device_crops_move_a_stores_boxes_as_torchvision_v2_does(shapes: Path,
                                                                      tmp_path: Path,
                                                                      loader: str, device: str,
                                                                      crop: str):
    """Each finished batch's boxes are its stored boxes through the window and flip a
    folder's decode cuts for the same image and seed (the crops the device cuts the pixels
    by), as torchvision v2's resized_crop + horizontal_flip + SanitizeBoundingBoxes map
    them: within a pixel, the same boxes kept."""
    from runner.data import build_data_path
    from runner.job.compose import compose

    config = compose(["dataset.targets=yolo", f"dataset.path={shapes}", "model=none",
                      "logger=none", f"dataset.cache_dir={tmp_path / 'cache'}",
                      f"dataset.image_size=[{SIZE[0]},{SIZE[1]}]", "loader.batch_size=5",
                      "loader.num_workers=0", f"loader={loader}", *CROPS[crop]])
    data = build_data_path(config, torch.device(device), epochs=1, progress=False)
    random = config.dataset.crop is Crop.random
    decoder = ImageDecoder(Decoder.pil, SIZE, config.dataset.crop,
                           fraction=config.dataset.crop_fraction)
    kept = total = 0
    flips = set()
    try:
        assert data.augment is not None and data.storage.boxes is not None
        for batch in data:
            host = batch.clone().to("cpu")  # (finish works in place)
            out = data.finish(data.to_device(batch))
            assert out["boxes"].device.type == device
            out = out.to("cpu")
            assert out["image"].shape[-2:] == SIZE
            hw = tuple(host["image"].shape[-2:])
            seeds = data.stream.order.seeds_for(host["index"], 0)
            stored = unpad(host["boxes"], host["box_labels"], host["box_count"])
            for row, ((boxes, labels), (got_b, got_l)) in enumerate(zip(stored, unpad(
                    out["boxes"], out["box_labels"], out["box_count"]))):
                window, flip = decoder_window(decoder, hw, seeds[row] if random else None)
                assert_same((got_b, got_l),
                            torchvision_boxes(boxes, labels, hw, window, SIZE, flip))
                flips.add(flip)
                kept, total = kept + len(got_l), total + len(labels)
    finally:
        data.close()
    assert total > 20 and kept > 0
    if random:
        assert flips == {True, False} and kept < total  # flipped some, cropped some away
    else:  # a store larger than the output: its centre window, resized
        assert hw != SIZE and decoder_window(decoder, hw)[0] != Window(0, 0, *hw)


def test_a_batch_without_crop_draws_cuts_its_pixels_and_boxes_by_the_same_draws():
    """``crop_targets`` draws the random crops itself when a batch carries none, and hands
    them back for the pixels: the boxes follow the crops the images are cut by."""
    from runner.data.decode.boxgeometry import map_padded, pad
    from runner.data.decode.crops import BatchAugment
    from runner.data.path import crop_targets

    augment = BatchAugment(SIZE)
    targets = pad([torch.tensor([[10.0, 10, 60, 50]])] * 4, [torch.tensor([1])] * 4)
    batch = TensorDict({"image": torch.zeros(4, 3, 64, 80, dtype=torch.uint8), **targets},
                       batch_size=[4])
    torch.manual_seed(0)
    draws = crop_targets(augment, batch, None, TARGETS[TargetName.boxes].follow)
    assert draws is not None and draws["crop_uniforms"].shape[0] == 4
    windows = augment.boxes(4, 64, 80, torch.device("cpu"), draws=draws)
    expected = map_padded(targets["boxes"], targets["box_labels"], targets["box_count"],
                          windows, SIZE)
    assert torch.equal(batch["boxes"], expected[0])
    assert torch.equal(batch["box_count"], expected[2])
