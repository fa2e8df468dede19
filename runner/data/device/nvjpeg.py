"""``loader.decoder=nvjpeg``: a stage above the loader that decodes each batch on the GPU.

The storage's items are raw bytes (runner/data/decode/encoded.py), packed per batch into one
uint8 buffer and its offsets (in shared memory, unpinned: the one copy of the bytes on their
way to nvJPEG). ``GpuDecodedBatches`` wraps the loader and, on a thread of its own with its
own CUDA stream, ``ahead`` batches in front of the loop (what the CPU decoders get from
their workers), decodes every JPEG of a batch in one ``torchvision.io.decode_jpeg(list,
device="cuda")`` call, then turns each upright, crops and resizes it on the GPU with the
geometry the CPU decoders use:

- a batch whose images share one size, crop window and flip (a centre-cropped folder of
  one image size) is resized in one ``interpolate`` call, the CPU path's filter;
- any other batch (random crops, images of many sizes) in one batched resample
  (``resample_batch``): per image, antialiased-bilinear weights for its own window, built
  on the GPU, applied as two batched matmuls. The same filter as ``interpolate(...,
  antialias=True)``, so the same pixels within a unit of rounding, without the chain of
  small kernels per image that a crop-and-resize each costs.

Which GPU decoder (measured on an H200 with 16 cores, batches of 128 JPEGs already in host
memory, ``runner.selfcheck``'s probe): torchvision's batched decode 19,200 img/s at 480x640
(100 kB files) and 23,600 at 256x341; nvImageCodec 0.9 14,700 and 17,700 (its hardware
decoder 13,300 and 17,500); two threads calling torchvision at once 12,900 (its decode
holds a process-wide lock: one decode thread, not several). torchvision it is, on one
thread. What nvJPEG cannot read (PNG, CMYK, a file it rejects) is decoded on the CPU by
PIL and moved over; what nothing can read is skipped and counted, as everywhere else.
A packed store's images are stored upright at sizes its index holds: no header is parsed.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from runner.data.decode.decoders import (
    Box,
    CorruptImageError,
    JpegHeader,
    apply_orientation,
    pixel_window,
    read_jpeg_header,
)
from runner.data.device.prefetch import CpuPrefetcher
from runner.data.loading.loader import shutdown_workers
from runner.data.protocol import SkippedFile
from runner.data.storage.folder import FolderStorage
from runner.data.threads import bind_cuda, cuda_index
from runner.measure import timeline


class GpuDecodedBatches:
    """Wraps a loader of encoded batches; yields batches decoded on ``device``.

    Args:
        loader: yields ({jpeg, jpeg_offsets, label, index}, skipped) per batch.
        storage: the folder storage whose items are bytes (``ReadBytes``); its
            ``decode.image_decoder`` gives the output size and crop and decodes the CPU
            fallbacks.
        device: the CUDA device that decodes.
        ahead: batches decoded ahead of the one handed out, on a thread of this stage
            (0: decoded on the caller's thread when asked for).
    """

    def __init__(self, loader, storage: FolderStorage, device: torch.device, ahead: int = 2):
        self.loader = loader
        self.storage = storage
        self.device = device
        self.ahead = ahead
        self.decoder = storage.decode.image_decoder
        self.cpu_fallbacks = 0  # images nvJPEG refused, decoded on the CPU instead
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if cuda and ahead > 0 else None
        self.index = cuda_index(device) if cuda else None
        # a packed store's index holds each stored (upright, RGB) image's size (a shard
        # set's index does not vouch for upright RGB: its headers are parsed)
        upright = getattr(storage, "stored_upright", False)
        self.stored_hw = ((storage.heights, storage.widths) if upright else (None, None))

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[dict | None, list[SkippedFile]]]:
        if self.ahead <= 0:
            for out, skipped, _ in self._decoded():
                yield out, skipped
            return
        for out, skipped, ready in CpuPrefetcher(self._decoded(), depth=self.ahead):
            if ready is not None and out is not None:  # made on this stage's stream: the
                here = torch.cuda.current_stream(self.device)  # consumer's waits for it on
                here.wait_event(ready)  # the device, and the allocator keeps the blocks
                for tensor in out.values():  # until that stream is done with them
                    if tensor.is_cuda:
                        tensor.record_stream(here)
            yield out, skipped

    def _decoded(self) -> Iterator[tuple[dict | None, list[SkippedFile], object]]:
        """The loader's batches decoded (on the decode thread when ``ahead``), each with the
        event its GPU work ends at (None without a stream of its own)."""
        bind_cuda(self.index if self.stream is not None else None)
        iterator, finished = iter(self.loader), False
        try:
            for batch, skipped in iterator:
                if batch is None:
                    yield None, skipped, None
                    continue
                ready = None
                with timeline.span("decode"):
                    if self.stream is None:
                        out, skipped = self.decode_batch(batch, skipped)
                    else:
                        with torch.cuda.stream(self.stream):
                            out, skipped = self.decode_batch(batch, skipped)
                            ready = torch.cuda.Event()
                            ready.record(self.stream)
                yield out, skipped, ready
            finished = True
        finally:  # an epoch that ends keeps persistent workers for the next (a stream's
            if not finished:  # end shuts them down through ``loader``); one cut short not
                shutdown_workers(self.loader, iterator)

    def headers(self, batch: dict, data: list[torch.Tensor]) -> list[JpegHeader | None]:
        """Each image's size, channels and orientation: a packed store's from its index,
        a file's from its header (a few microseconds of Python each)."""
        heights, widths = self.stored_hw
        if heights is not None:
            return [JpegHeader(heights[i], widths[i], 3) for i in batch["index"].tolist()]
        return [read_jpeg_header(memoryview(d.numpy())) for d in data]

    def decode_batch(self, batch: dict, skipped: list[SkippedFile]):
        offsets = batch["jpeg_offsets"].tolist()
        data = [batch["jpeg"][offsets[k] : offsets[k + 1]] for k in range(len(offsets) - 1)]
        seeds = batch["crop_seed"].tolist() if "crop_seed" in batch else [-1] * len(data)
        headers = self.headers(batch, data)
        on_gpu = [k for k, h in enumerate(headers) if h is not None and h.components in (1, 3)]
        images: list[torch.Tensor | None] = [None] * len(data)
        decoded = []  # (k, upright image, box, flip)
        for k, img in zip(on_gpu, self._nvjpeg([data[k] for k in on_gpu])):
            if img is not None:
                img = apply_orientation(img, headers[k].orientation)
                decoded.append((k, img, *self.decoder.box_for(*img.shape[-2:],
                                                               _seed(seeds[k]))))
        for rows, done in self._finish(decoded):
            for row, k in enumerate(rows):
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

    def _finish(self, decoded: list[tuple[int, torch.Tensor, Box, bool]]
                ) -> Iterator[tuple[list[int], torch.Tensor]]:
        """(rows, N x C x H x W images) for the decoded images: one ``finish_many`` for a
        batch of one size, window and flip; otherwise one batched resample for all."""
        if not decoded:
            return
        keys = {(*img.shape[-2:], pixel_window(box, *img.shape[-2:]), flip)
                for _, img, box, flip in decoded}
        rows = [k for k, _, _, _ in decoded]
        if len(keys) == 1 or decoded[0][1].device.type == "cpu":
            if len(keys) == 1:
                _, _, box, flip = decoded[0]
                yield rows, self.decoder.finish_many([img for _, img, _, _ in decoded], box,
                                                     flip)
            else:  # the CPU stand-in of the tests: image by image, the CPU path's pixels
                yield rows, torch.stack([self.decoder.finish(img, box, flip)
                                         for _, img, box, flip in decoded])
            return
        for part in padded_parts([img.shape for _, img, _, _ in decoded]):
            members = [decoded[k] for k in part]
            yield [rows[k] for k in part], resample_batch(
                [img for _, img, _, _ in members],
                [pixel_window(box, *img.shape[-2:]) for _, img, box, _ in members],
                [flip for _, _, _, flip in members], tuple(self.decoder.size))

    def _nvjpeg(self, data: list[torch.Tensor]) -> list[torch.Tensor | None]:
        from torchvision.io import ImageReadMode, decode_jpeg

        if not data:
            return []
        if self.stream is not None:
            # torchvision allocates the outputs on this stream but decodes on a stream of
            # its own that does not wait for this one: a block this stream freed while its
            # last resample still reads it could be written under it. The decode thread
            # waits for its own previous batch (not the model's step) first.
            self.stream.synchronize()
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
        raw = bytearray(data.numpy())
        try:
            image = self._to_device(self.decoder(raw, seed))
        except CorruptImageError as e:
            self.storage.check_stored(index, raw)  # a store's own damage is not a skip
            skipped.append(self.storage.undecodable(self.storage.samples[index][0], e, index))
            return None
        self.cpu_fallbacks += 1
        return image


# the most bytes one batched resample pads its images into (float32): a photo of 4000 x 3000
# among 256 small ones would pad all 256 to its size (about 49 GB)
PADDED_BYTES = 1 << 30


def padded_parts(shapes: list[torch.Size], limit: int = PADDED_BYTES) -> list[list[int]]:
    """The positions of images of ``shapes`` (C x H x W) in parts that each pad into at
    most ``limit`` bytes of float32 (smallest images first, so like sizes share a part);
    an image larger than the limit alone is a part of its own."""
    order = sorted(range(len(shapes)), key=lambda k: shapes[k][-2] * shapes[k][-1])
    parts: list[list[int]] = []
    height = width = 0
    for k in order:
        c, h, w = shapes[k][-3:]
        hh, ww = max(height, h), max(width, w)
        if parts and (len(parts[-1]) + 1) * c * hh * ww * 4 <= limit:
            parts[-1].append(k)
            height, width = hh, ww
        else:
            parts.append([k])
            height, width = h, w
    return parts


def resample_weights(start: torch.Tensor, length: torch.Tensor, out: int, size: int
                     ) -> torch.Tensor:
    """N x ``out`` x ``size`` weights that resize each row's window [start, start + length)
    of an axis of ``size`` pixels to ``out`` pixels: antialiased bilinear, the triangle
    filter ``interpolate(..., mode="bilinear", antialias=True, align_corners=False)`` uses
    (support 1 when enlarging, the scale when reducing; each output's weights normalised over
    the window's pixels), zero outside the window."""
    length = length.to(torch.float32)
    scale = length / out  # [N]
    reduce = scale >= 1.0
    support = torch.where(reduce, scale, torch.ones_like(scale))
    centre = scale[:, None] * (torch.arange(out, device=start.device) + 0.5)  # [N, out]
    pixel = torch.arange(size, device=start.device)[None, :] - start[:, None]  # [N, size]
    x = (pixel[:, None, :] + 0.5 - centre[:, :, None]) / support[:, None, None]
    weights = (1.0 - x.abs()).clamp_(min=0.0)
    inside = (pixel >= 0) & (pixel < length[:, None])
    weights *= inside[:, None, :]
    return weights / weights.sum(-1, keepdim=True).clamp_(min=1e-12)


def resample_batch(imgs: list[torch.Tensor], windows: list[tuple[int, int, int, int]],
                   flips: list[bool], size: tuple[int, int]) -> torch.Tensor:
    """Each CHW uint8 image's integer window (top, left, height, width) resized to ``size``
    (and flipped where asked) as one N x C x H x W uint8 batch: images of several sizes
    padded into one tensor, each image's own antialiased-bilinear weights for each axis
    (``resample_weights``), applied as two batched matmuls (rows, then columns). The filter
    of ``resize_crop_many``; where the weights sum in another order a pixel may round the
    other way (one unit of 255)."""
    device = imgs[0].device
    height = max(img.shape[-2] for img in imgs)
    width = max(img.shape[-1] for img in imgs)
    if all(img.shape[-2:] == (height, width) for img in imgs):
        batch = torch.stack(imgs).float()
    else:  # padding is outside every window: its weights are zero
        batch = torch.zeros((len(imgs), imgs[0].shape[0], height, width), device=device)
        for k, img in enumerate(imgs):
            batch[k, :, : img.shape[-2], : img.shape[-1]] = img
    box = torch.tensor(windows, dtype=torch.float32).to(device, non_blocking=True)
    rows = resample_weights(box[:, 0], box[:, 2], size[0], height)  # [N, h, H]
    cols = resample_weights(box[:, 1], box[:, 3], size[1], width)  # [N, w, W]
    flip = torch.tensor(flips, dtype=torch.bool).to(device, non_blocking=True)
    cols = torch.where(flip[:, None, None], cols.flip(1), cols)  # a flip: columns reversed
    out = torch.matmul(torch.matmul(rows[:, None], batch), cols.transpose(1, 2)[:, None])
    return out.round_().clamp_(0, 255).to(torch.uint8)


def _seed(seed: int) -> int | None:
    """An image's crop seed as the decoders take it (-1 in a batch: a centre crop, none)."""
    return seed if seed >= 0 else None
