"""``loader.decoder=nvjpeg``: a stage above the loader that decodes each batch on the GPU.

The storage's items are raw bytes (runner/data/decode/encoded.py), packed per batch into one
uint8 tensor and its offsets. ``GpuDecodedBatches`` wraps the loader and, batch by batch,
decodes every JPEG in
one ``torchvision.io.decode_jpeg(list, device="cuda")`` call, then applies the EXIF
orientation and the crop and resize on the GPU, with the geometry the CPU decoders use:
images of one size, crop window and flip (a centre-cropped folder of one image size: the
whole batch) are resized in one call, not one call each.
What nvjpeg cannot read (PNG, CMYK, a file it rejects) is decoded on the CPU by PIL and
moved over; what nothing can read is skipped and counted, as everywhere else.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from runner.data.decode.decoders import (
    Box,
    CorruptImageError,
    apply_orientation,
    pixel_window,
    read_jpeg_header,
)
from runner.data.loading.loader import shutdown_workers
from runner.data.protocol import SkippedFile
from runner.data.storage.folder import FolderStorage


class GpuDecodedBatches:
    """Wraps a loader of encoded batches; yields batches decoded on ``device``.

    Args:
        loader: yields ({jpeg, jpeg_offsets, label, index}, skipped) per batch.
        storage: the folder storage whose items are bytes (``ReadBytes``); its
            ``decode.image_decoder`` gives the output size and crop and decodes the CPU
            fallbacks.
        device: the CUDA device that decodes.
    """

    def __init__(self, loader, storage: FolderStorage, device: torch.device):
        self.loader = loader
        self.storage = storage
        self.device = device
        self.decoder = storage.decode.image_decoder
        self.cpu_fallbacks = 0  # images nvJPEG refused, decoded on the CPU instead

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[dict | None, list[SkippedFile]]]:
        iterator, finished = iter(self.loader), False
        try:
            for batch, skipped in iterator:
                if batch is None:
                    yield None, skipped
                else:
                    yield self.decode_batch(batch, skipped)
            finished = True
        finally:  # an epoch that ends keeps persistent workers for the next (a stream's
            if not finished:  # end shuts them down through ``loader``); one cut short not
                shutdown_workers(self.loader, iterator)

    def decode_batch(self, batch: dict, skipped: list[SkippedFile]):
        offsets = batch["jpeg_offsets"].tolist()
        data = [batch["jpeg"][offsets[k] : offsets[k + 1]] for k in range(len(offsets) - 1)]
        seeds = batch["crop_seed"].tolist() if "crop_seed" in batch else [-1] * len(data)
        headers = [read_jpeg_header(memoryview(d.numpy())) for d in data]
        on_gpu = [k for k, h in enumerate(headers) if h is not None and h.components in (1, 3)]
        images: list[torch.Tensor | None] = [None] * len(data)
        groups: dict[tuple, list[tuple[int, torch.Tensor, Box]]] = {}
        for k, img in zip(on_gpu, self._nvjpeg([data[k] for k in on_gpu])):
            if img is not None:  # upright, then grouped by size, crop window and flip
                img = apply_orientation(img, headers[k].orientation)
                box, flip = self.decoder.box_for(*img.shape[-2:], _seed(seeds[k]))
                key = (*img.shape[-2:], pixel_window(box, *img.shape[-2:]), flip)
                groups.setdefault(key, []).append((k, img, box))
        for (_, _, _, flip), members in groups.items():  # one resize per group
            done = self.decoder.finish_many([img for _, img, _ in members], members[0][2],
                                            flip)
            for row, (k, _, _) in enumerate(members):
                images[k] = done[row]
        for k in range(len(data)):
            if images[k] is None:  # nvjpeg could not: PIL on the CPU, or skip
                images[k] = self._cpu_fallback(data[k], int(batch["index"][k]), skipped,
                                               _seed(seeds[k]))
        keep = [k for k, img in enumerate(images) if img is not None]
        if not keep:
            return None, skipped
        index = torch.tensor(keep)
        out = {"image": torch.stack([images[k] for k in keep])}
        for key in ("label", "index"):
            if key in batch:
                out[key] = self._to_device(batch[key][index])
        if "valid" in batch:  # stays on the host: counted there (no sync), moved with the
            out["valid"] = batch["valid"][index]  # batch's other host tensors afterwards
        return out, skipped

    def _nvjpeg(self, data: list[torch.Tensor]) -> list[torch.Tensor | None]:
        from torchvision.io import ImageReadMode, decode_jpeg

        if not data:
            return []
        try:  # one call for the batch: nvjpeg's batched decode
            return decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device)
        except RuntimeError:  # one bad file fails the call: find it, one by one
            out = []
            for d in data:
                try:
                    out.append(decode_jpeg(d, mode=ImageReadMode.RGB, device=self.device))
                except RuntimeError:
                    out.append(None)
            return out

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """To the device from pinned memory: an asynchronous copy, not a sync each."""
        if self.device.type == "cuda":
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    def _cpu_fallback(self, data: torch.Tensor, index: int, skipped: list[SkippedFile],
                      seed: int | None = None) -> torch.Tensor | None:
        raw = bytearray(data.numpy().tobytes())
        try:
            image = self._to_device(self.decoder(raw, seed))
        except CorruptImageError as e:
            self.storage.check_stored(index, raw)  # a store's own damage is not a skip
            skipped.append(self.storage.undecodable(self.storage.samples[index][0], e, index))
            return None
        self.cpu_fallbacks += 1
        return image


def _seed(seed: int) -> int | None:
    """An image's crop seed as the decoders take it (-1 in a batch: a centre crop, none)."""
    return seed if seed >= 0 else None
