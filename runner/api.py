"""``runner.pipeline(...)``: the runner's data path in your own training loop.

The same storage, loader, prefetch and device placement a config selects for
``python -m runner`` (they are built by the same code, ``runner.run.Job``), as an iterable
of device batches plus its measurement::

    pipeline = runner.pipeline(loader="memmap", prefetch="gpu", dataset_path="/data/train")
    model = torch.nn.Sequential(pipeline.input_layer(), my_net).to(pipeline.device)
    for epoch in range(10):
        for batch in pipeline:          # a TensorDict on pipeline.device
            loss = criterion(model(batch["image"]), batch["label"])
            ...
    print(pipeline.summary())          # images/s, data wait, as the runner reports them

Keyword options are config overrides: a group by name (``loader="memmap"``), anything else
with its first ``_`` as the dot (``dataset_path=...`` is ``dataset.path``,
``loader_batch_size=128`` is ``loader.batch_size``); strings in Hydra's override syntax
may be given as positional arguments too (``"loader.num_workers=4"``).
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

GROUPS = ("loader", "prefetch", "amp", "compile", "model", "task", "logger", "sweep")
TOP_LEVEL = ("device", "seed", "diagnose", "profile", "models", "resume")


def _value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_value(v) for v in value) + "]"
    return str(value)


def overrides_for(*overrides: str, **options: Any) -> list[str]:
    """Hydra overrides from ``pipeline``'s arguments."""
    out = list(overrides)
    for key, value in options.items():
        if key not in GROUPS and key not in TOP_LEVEL:
            head, _, rest = key.partition("_")
            if not rest:
                raise TypeError(f"pipeline() got {key}={value!r}: name a config key as "
                                "section_key, e.g. dataset_path or loader_batch_size")
            key = f"{head}.{rest}"
        out.append(f"{key}={_value(value)}")
    return out


class Pipeline:
    """Device batches of a dataset, one epoch per iteration, measured as the runner does.

    Attributes:
        config: the validated ``Config``.
        device: where batches arrive.
        classes: class names, by label.
        storage: the storage (folder, memmap or ram).
    """

    def __init__(self, *overrides: str, **options: Any):
        from runner.config import compose
        from runner.run import Job

        self.config = compose(overrides_for(*overrides, **options))
        self._scratch = tempfile.TemporaryDirectory(prefix="runner-pipeline-")
        self._job = Job(self.config, Path(self._scratch.name), hydra_cfg=None)
        self.device = self._job._setup_device()
        self.storage = self._job._setup_storage()
        self.classes = list(self.storage.classes)
        quiet = logging.getLogger("runner")
        level, quiet.level = quiet.level, logging.ERROR  # the run-length notes are the CLI's
        try:
            self._stream, _, _ = self._job._setup_data(self.storage, self.device)
        finally:
            quiet.setLevel(level)
        self._stream.epochs = 1  # one epoch per iteration: the caller's loop counts epochs
        self._augment = self._job._augment(self.storage)
        self.batches = 0
        self.images = 0
        self.wait_seconds = 0.0
        self.seconds = 0.0
        self.warmup = self.config.run.warmup_steps  # batches left out of the figures

    def input_layer(self) -> torch.nn.Module:
        """The runner's first layer: uint8 in, normalized float out, on the model's device
        (put it in front of your network: ``nn.Sequential(pipeline.input_layer(), net)``)."""
        from runner.model import UInt8Input

        return UInt8Input(self.config.model.channels_last)

    def __len__(self) -> int:
        return len(self._stream.loader)

    def __iter__(self) -> Iterator[TensorDict]:
        from runner.loader import count_images
        from runner.prefetch import build_prefetcher

        batches = iter(build_prefetcher(self.config.prefetch, self._stream, self.device))
        try:
            last = time.perf_counter()
            while True:
                batch = next(batches, None)
                got = time.perf_counter()
                if batch is None:
                    return
                n = count_images(batch)
                batch = batch.to(self.device, non_blocking=True)
                if self._augment is not None:
                    batch["image"] = self._augment(batch["image"])
                self.batches += 1
                timed = self.batches > self.warmup
                yield batch
                now = time.perf_counter()
                if timed:  # this batch's wait, and everything until the next request
                    self.wait_seconds += got - last
                    self.seconds += now - last
                    self.images += n
                last = now
        finally:
            if hasattr(batches, "close"):
                batches.close()

    def summary(self) -> dict[str, Any]:
        """images/s of the loop around the batches (your step included) after the first
        ``run.warmup_steps`` batches, and the share of that time spent waiting for data."""
        return {
            "images_per_sec": self.images / self.seconds if self.seconds else None,
            "data_wait_frac": self.wait_seconds / self.seconds if self.seconds else None,
            "timed_images": self.images,
            "batches": self.batches,
            "device": str(self.device),
            "loader": self.config.loader.name.value,
            "prefetch": self.config.prefetch.name.value,
        }

    def close(self) -> None:
        self._scratch.cleanup()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def pipeline(*overrides: str, **options: Any) -> Pipeline:
    """The data path a config selects, as an iterable of device batches (see the module's
    docstring)."""
    return Pipeline(*overrides, **options)
