"""``runner.pipeline(...)``: the runner's data path in your own training loop.

The same storage, loader, prefetch and device placement a config selects for
``python -m runner`` (both build it with ``runner.data.build_data_path``), as an iterable
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

Each epoch shows a progress bar of its steps on stderr (``tqdm``, as ``python -m runner``
does), so a slow step is seen from the first batch rather than at the epoch's end;
``run_progress=False`` turns it and the one-off bars (the default dataset, a conversion) off.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
from tensordict import TensorDict
from tqdm import tqdm

from runner.data import build_data_path
from runner.job.compose import compose
from runner.launch.distributed import Ranks, pick_device

GROUPS = ("loader", "prefetch", "amp", "compile", "model", "task", "logger", "sweep")
TOP_LEVEL = ("device", "seed", "diagnose", "models", "resume")


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
        data: the data path (``runner.data.DataPath``), built as ``python -m runner``
            builds it.
        device: where batches arrive.
        classes: class names, by label.
        storage: the storage (``loader=``).
    """

    def __init__(self, *overrides: str, **options: Any):
        self.config = compose(overrides_for(*overrides, **options))
        if self.config.loader.drop_last is None:  # your own loop gets every image (the
            self.config.loader.drop_last = False  # runner's training drops a short batch)
        ranks = Ranks()
        self.device = pick_device(self.config.device.value, ranks)
        self.progress = self.config.run.progress and ranks.main
        self.data = build_data_path(self.config, self.device, epochs=1,
                                    progress=self.config.run.progress)
        self.epochs = 0  # epochs started
        self.storage = self.data.storage
        self.classes = list(self.data.classes)
        self.batches = 0
        self.images = 0
        self.wait_seconds = 0.0
        self.seconds = 0.0
        self.warmup = self.config.run.warmup_steps  # batches left out of the figures

    def input_layer(self) -> torch.nn.Module:
        """The runner's first layer: uint8 in, normalized float out, on the model's device
        (put it in front of your network: ``nn.Sequential(pipeline.input_layer(), net)``)."""
        from runner.model.networks import UInt8Input

        return UInt8Input(self.config.model.channels_last)

    def __len__(self) -> int:
        return self.data.steps_per_epoch

    def __iter__(self) -> Iterator[TensorDict]:
        batches = iter(self.data)
        self.epochs += 1
        bar = tqdm(total=len(self), unit="step", desc=f"epoch {self.epochs}", leave=False,
                   disable=not self.progress, dynamic_ncols=True)
        try:
            last = time.perf_counter()
            while True:
                batch = next(batches, None)
                got = time.perf_counter()
                if batch is None:
                    return
                n = self.data.count(batch)
                batch = self.data.finish(self.data.to_device(batch))
                self.batches += 1
                timed = self.batches > self.warmup
                yield batch
                bar.update()
                now = time.perf_counter()
                if timed:  # this batch's wait, and everything until the next request
                    self.wait_seconds += got - last
                    self.seconds += now - last
                    self.images += n
                last = now
        finally:
            bar.close()
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
            "skipped_files": self.data.skipped,
        }

    def close(self) -> None:
        self.data.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def pipeline(*overrides: str, **options: Any) -> Pipeline:
    """The data path a config selects, as an iterable of device batches (see the module's
    docstring)."""
    return Pipeline(*overrides, **options)
