"""``loader.decoder=nvjpeg`` on the storage side: items are the files' bytes, undecoded.

The storage reads each file into a 1-D uint8 tensor and packs a batch of them into one
buffer plus offsets; ``runner.data.device.nvjpeg.GpuDecodedBatches`` decodes them on the GPU.
"""

from __future__ import annotations

import torch

from runner.data.decode.decoders import ImageDecoder


class ReadBytes:
    """The "decoder" of nvjpeg runs: the file's bytes as a 1-D uint8 tensor.

    Args:
        image_decoder: the CPU decoder with the run's output size and crop; it decodes the
            storage's example images and the files nvjpeg cannot read.
    """

    item_shape = None  # encoded bytes: every file has its own length

    def __init__(self, image_decoder: ImageDecoder):
        self.image_decoder = image_decoder

    def __call__(self, data: bytearray, seed: int | None = None) -> torch.Tensor:
        """The bytes, then 8 bytes of the image's random-crop seed (-1: none): the GPU draws
        its crop from the same seed as a CPU decode would (``pack`` splits them off)."""
        seed = -1 if seed is None else seed
        tail = torch.frombuffer(bytearray(seed.to_bytes(SEED_BYTES, "little", signed=True)),
                                dtype=torch.uint8)
        return torch.cat([torch.frombuffer(data, dtype=torch.uint8), tail])

    @staticmethod
    def pack(images: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Variable-length byte tensors -> one tensor plus offsets (one buffer to move), and
        each image's crop seed."""
        seeds = torch.tensor([int.from_bytes(b[-SEED_BYTES:].numpy().tobytes(), "little",
                                             signed=True) for b in images], dtype=torch.int64)
        images = [b[:-SEED_BYTES] for b in images]
        lengths = torch.tensor([len(b) for b in images], dtype=torch.int64)
        offsets = torch.zeros(len(images) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        return {"jpeg": torch.cat(images), "jpeg_offsets": offsets, "crop_seed": seeds}


SEED_BYTES = 8
