"""Input normalization, defined once, and ``loader.host_dtype``: where it runs.

Every model takes uint8 NCHW; its first layer (``UInt8Input``, runner/model/networks.py) converts
and normalizes on the model's device with ``normalize``: ``(x / 255 - mean) / std`` per
channel, as one multiply-add ``x * scale + shift`` (``affine``), so only uint8 bytes cross
from the loader.

``loader.host_dtype=float16|float32`` does what most training scripts do instead (ToTensor
and Normalize in the DataLoader's workers): ``HostConvert`` turns each batch's uint8 images
into normalized floats of that dtype, computed in that dtype by the same ``normalize`` with
the model's ``model.mean``/``model.std``, on the host, before the copy, into reused buffers
(page-locked when batches are pinned, so the copy stays asynchronous). It runs on the
thread that takes batches from the loader: the prefetch thread with ``prefetch=cpu|gpu``,
the loop's own with ``prefetch=none`` (its time is then in the data wait). The copy then
moves 2x (float16) or 4x (float32) the bytes, and the input layer, given a floating batch,
only casts it to its compute dtype. So

    python -m runner -m loader.host_dtype=uint8,float16,float32 dataset.image_size=[224,224],[512,512]

answers "convert before or after the copy?": ``copy_ms`` holds the copy per step
(``prefetch_copy_ms`` with ``prefetch=gpu``, where it overlaps the step), and
``host_convert_ms`` the host's conversion per step.

A float batch carries normalized values, so what works on pixels after the copy cannot
follow it: device-side crops of decode-once stores (``dataset.crop=random``, a larger
``dataset.store_size``), ``task.augment``, a decoder on the GPU and the rivals' own
pipelines are refused with ``loader.host_dtype=uint8`` as the fix; so are several models
of different normalizations (one host conversion serves them all).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from runner.common.errors import ConfigError
from runner.config.schema import Config, HostDtype
from runner.data.loading.buffers import BufferPool

HOST_DTYPES: dict[HostDtype, torch.dtype | None] = {
    HostDtype.uint8: None,  # the bytes as they are
    HostDtype.float16: torch.float16,
    HostDtype.float32: torch.float32,
}


def affine(mean: Sequence[float], std: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift), shaped (1, 3, 1, 1), with ``x * scale + shift == (x/255 - mean)/std``
    for uint8 pixels ``x`` (``mean``/``std`` in 0..1 pixel units)."""
    mean = torch.tensor([float(v) for v in mean]).view(1, 3, 1, 1) * 255
    std = torch.tensor([float(v) for v in std]).view(1, 3, 1, 1) * 255
    return 1.0 / std, -mean / std


def normalize(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, dtype: torch.dtype,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 pixels -> normalized ``dtype``, computed in ``dtype``: the one definition of
    the input normalization (the model's input layer and the host both call it).

    Args:
        x: uint8 (N, 3, H, W).
        scale, shift: from ``affine``.
        dtype: the result's dtype, and the one the arithmetic is done in.
        out: a (N, 3, H, W) tensor of ``dtype`` to write into (no temporary batch).
    """
    scale, shift = scale.to(x.device, dtype), shift.to(x.device, dtype)
    if out is None:  # contiguous NCHW whatever the batch's layout (a channels-last batch's
        # images come as models have always had them; the cast does the reordering)
        return torch.addcmul(shift, x.to(dtype, memory_format=torch.contiguous_format), scale)
    out.copy_(x)
    return out.mul_(scale).add_(shift)


def host_dtype_problem(config: Config) -> str | None:
    """Why ``loader.host_dtype`` cannot convert on the host for this config, or None."""
    from runner.config.rules import model_configs
    from runner.data.decode.decoders import DECODERS
    from runner.data.storage import STORAGES

    if HOST_DTYPES[config.loader.host_dtype] is None:
        return None
    if STORAGES[config.loader.name].own_loader:
        return (f"loader={config.loader.name.value} brings its own pipeline, which hands "
                "over its own batches")
    if DECODERS[config.loader.decoder].cuda:
        return f"loader.decoder={config.loader.decoder.value} decodes on the GPU"
    if config.task.name.trains and config.task.augment.active:
        return "task.augment works on uint8 pixels on the device, after the copy"
    norms = {(tuple(m.mean), tuple(m.std)) for m in model_configs(config)}
    if len(norms) > 1:
        return ("the models normalize differently (model.mean/std), and one host "
                "conversion serves them all")
    return None


def check_host_dtype(config: Config) -> None:
    """A ConfigError naming the fix when ``loader.host_dtype`` cannot run here."""
    problem = host_dtype_problem(config)
    if problem is not None:
        raise ConfigError(f"loader.host_dtype={config.loader.host_dtype.value} converts and "
                          f"normalizes on the host before the copy, but {problem}: use "
                          "loader.host_dtype=uint8")


class HostConvert:
    """uint8 batches -> normalized float batches on the host (``loader.host_dtype``).

    Args:
        dtype: float16 or float32.
        mean, std: the model's normalization (0..1 pixel units).
        pin: write into page-locked memory (batches go to CUDA).
        batch_size: the full batch's rows (the buffers' size).
    """

    def __init__(self, dtype: torch.dtype, mean: Sequence[float], std: Sequence[float],
                 pin: bool, batch_size: int):
        self.dtype, self.pin, self.batch_size = dtype, pin, batch_size
        self.scale, self.shift = affine(mean, std)
        self.scale, self.shift = self.scale.to(dtype), self.shift.to(dtype)
        self.pools: dict[tuple[int, ...], BufferPool] = {}  # by image shape
        self.seconds = 0.0  # converting, all batches so far
        self.batches = 0

    def __call__(self, batch: TensorDict) -> TensorDict:
        if "image" not in batch.keys():  # a batch of no decodable image: nothing to convert
            return batch
        started = time.perf_counter()
        images = batch["image"]
        n, shape = images.shape[0], tuple(images.shape[1:])
        pool = self.pools.get(shape)
        if pool is None:
            pool = self.pools[shape] = BufferPool((max(self.batch_size, n), *shape),
                                                  self.dtype, pin=self.pin)
        out = normalize(images, self.scale, self.shift, self.dtype, out=pool.take(n))
        converted = batch.copy()  # the loader's own TensorDict (and buffer) is left as it is
        converted.set("image", out)
        self.seconds += time.perf_counter() - started
        self.batches += 1
        return converted

    def over(self, source: Iterable[TensorDict]) -> Iterator[TensorDict]:
        """Each batch of ``source``, converted; closing this closes ``source``'s iterator."""
        iterator = iter(source)
        try:
            for batch in iterator:
                yield self(batch)
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    def figures(self, steps: int) -> dict[str, Any]:
        """The host's conversion time per step."""
        return {"host_convert_ms": 1000 * self.seconds / max(steps, 1)}


class Converted:
    """An iterable of batches, each converted on the host as it is taken."""

    def __init__(self, source: Iterable[TensorDict], convert: HostConvert):
        self.source, self.convert = source, convert

    def __iter__(self) -> Iterator[TensorDict]:
        return self.convert.over(self.source)


def as_batches_come(config: Config, images: torch.Tensor) -> torch.Tensor:
    """uint8 ``images`` (a storage's example) as the run's batches bring them: converted on
    the host with ``loader.host_dtype``, so what compiles, traces or probes a model sees the
    dtype the loop will feed it."""
    convert = host_convert(config, pin=False)
    if convert is None:
        return images
    return convert(TensorDict({"image": images}, [len(images)]))["image"].clone()


def host_convert(config: Config, pin: bool) -> HostConvert | None:
    """The host conversion ``loader.host_dtype`` asks for (None: uint8, nothing to do),
    with the normalization of the run's model(s)."""
    from runner.config.rules import model_configs

    dtype = HOST_DTYPES[config.loader.host_dtype]
    if dtype is None:
        return None
    check_host_dtype(config)
    model = model_configs(config)[0]
    return HostConvert(dtype, model.mean, model.std, pin, config.loader.batch_size)
