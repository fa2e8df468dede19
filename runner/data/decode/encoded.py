"""``loader.decoder=nvjpeg`` on the storage side: items are the files' bytes, undecoded.

The storage reads each file into a 1-D uint8 tensor (the file's own buffer, the crop seed
appended in place) and packs a batch of them into one buffer plus offsets (in a loader
worker, straight into shared memory); the batch is not pinned (nvJPEG reads it on the
host): the bytes are copied once between the read and the decoder.
``runner.data.device.nvjpeg.GpuDecodedBatches`` decodes them on the GPU.
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
        tail = (-1 if seed is None else seed).to_bytes(SEED_BYTES, "little", signed=True)
        if isinstance(data, bytearray):  # a file read whole: the seed appended in place
            data.extend(tail)
        else:
            data = bytearray(data) + tail
        return torch.frombuffer(data, dtype=torch.uint8)

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
        out = None
        if torch.utils.data.get_worker_info() is not None:
            # in a loader worker: packed straight into shared memory, as default_collate
            # does, so the batch crosses to the main process without another copy
            total = int(offsets[-1])
            out = images[0].new(images[0]._typed_storage()._new_shared(total)).resize_(total)
        return {"jpeg": torch.cat(images, out=out), "jpeg_offsets": offsets,
                "crop_seed": seeds}


SEED_BYTES = 8
