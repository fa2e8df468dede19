"""A mask's bytes in a store: PNG bytes that give the same mask back, bit for bit, and the
source size from the header alone."""

from __future__ import annotations

import numpy as np
import pytest

from runner.data.decode.maskbytes import blob_size, decode_mask, encode_mask, target_blob
from runner.data.sources.masklabels import IGNORE, MaskTarget


def test_a_mask_round_trips_through_its_png_blob():
    rng = np.random.default_rng(0)
    mask = rng.integers(0, 254, (37, 53)).astype(np.uint8)
    mask[:5, :7] = IGNORE
    blob = encode_mask(mask)
    assert blob[:4] == b"\x89PNG"
    back = decode_mask(memoryview(blob))  # a store hands out views of its buffer
    assert back.dtype == np.uint8 and np.array_equal(back, mask)
    assert blob_size(blob) == (37, 53)


def test_flat_masks_are_small_and_bad_input_is_refused():
    mask = np.zeros((480, 640), np.uint8)
    mask[100:300, 200:500] = 3
    assert len(encode_mask(mask)) < 2000
    with pytest.raises(ValueError, match="uint8"):
        encode_mask(mask.astype(np.int64))
    with pytest.raises(ValueError, match="not a PNG mask blob"):
        blob_size(b"\xff\xd8\xff" + bytes(30))


def test_a_coco_target_becomes_the_blob_of_its_rasterised_mask():
    target = MaskTarget(6, 8, 1, shapes=(([[0, 0, 4, 0, 4, 4, 0, 4]], 2, False),
                                         ([[5, 0, 8, 0, 8, 6, 5, 6]], 7, False)))
    back = decode_mask(target_blob(target, num_classes=3))
    assert back.shape == (6, 8) and blob_size(target_blob(target)) == (6, 8)
    assert (back[:4, :4] == 2).all() and (back[:, 5:] == IGNORE).all()  # 7 >= 3 classes
    assert (back[4:, :4] == 0).all()
