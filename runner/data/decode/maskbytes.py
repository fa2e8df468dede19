"""A mask's bytes in a store: a segmentation target as the storages carry it, kind-blind.

packed and shards keep each image's encoded bytes and decode them every epoch; a mask
rides beside them as one more blob (the masks record's ``to_blob``,
runner/data/targets/target_masks.py): ``encode_mask`` writes the [H, W] uint8 class-id mask
(at the stored image's upright size, 255 = ignore) as a one-channel PNG (lossless: a class id is
never blurred into another, as JPEG would; zlib makes the flat regions of a mask small,
a few hundred bytes to a few KB), and ``decode_mask`` gives the array back, bit for bit.
The store never looks inside (FFCV's fields: a store carries a field's bytes without
knowing what they mean).

``blob_size`` reads a blob's size from the PNG's header (IHDR: width and height at bytes
16..24) without decoding. The source size a served mask goes back to
(runner/data/decode/maskgeometry.py: ``mask_to_source``) is the store's own record
(packed.py's ``blobindex.bin``), as the blob is at the stored size.

memmap and ram keep decoded, deterministically cropped images at a fixed size; their
masks are the same crop of the mask (``maskgeometry.map_mask`` with the store's window),
a fixed-shape uint8 array per image beside the pixels, not a blob.
"""

from __future__ import annotations

import io
import struct

import numpy as np

from runner.data.sources.masklabels import MaskTarget, load_mask, read_mask_file

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# zlib level, PIL's default: on a 640x480 mask of 8 regions (a shared 2-core machine),
# level 1 wrote 6.0 KB in 7.3 ms and read back in 1.9 ms, 6 wrote 4.1 KB in 8.1 ms and
# read back in 2.3 ms, 9 wrote 3.0 KB in 31 ms: 6 is a third smaller than 1 for little
# more time, and 9's 4x write time is paid once per mask for a store of any size
COMPRESS_LEVEL = 6


def encode_mask(mask: np.ndarray) -> bytes:
    """An [H, W] uint8 class-id mask as PNG bytes (mode L, lossless)."""
    from PIL import Image

    array = np.ascontiguousarray(mask)
    if array.ndim != 2 or array.dtype != np.uint8:
        raise ValueError(f"a mask is [H, W] uint8 class ids, not {array.dtype} {array.shape}")
    buf = io.BytesIO()
    Image.fromarray(array, "L").save(buf, "PNG", compress_level=COMPRESS_LEVEL)
    return buf.getvalue()


def target_blob(target: MaskTarget, num_classes: int | None = None) -> bytes:
    """The blob a store keeps for an image's mask: its mask made (a PNG read, COCO's
    shapes rasterised; ids past ``num_classes`` 255) and encoded."""
    return encode_mask(load_mask(target, num_classes))


def decode_mask(blob: bytes | bytearray | memoryview) -> np.ndarray:
    """The [H, W] uint8 mask ``encode_mask`` wrote (or any grey or palette PNG of ids)."""
    return read_mask_file(io.BytesIO(bytes(blob)))


def blob_size(blob: bytes | bytearray | memoryview) -> tuple[int, int]:
    """(height, width) of the mask in ``blob``: the source image's upright size, from the
    PNG header alone."""
    head = bytes(blob[:24])
    if len(head) < 24 or head[:8] != PNG_SIGNATURE or head[12:16] != b"IHDR":
        raise ValueError("not a PNG mask blob (no PNG signature and IHDR header)")
    width, height = struct.unpack(">II", head[16:24])
    return height, width
