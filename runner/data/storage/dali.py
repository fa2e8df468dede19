"""``loader=dali``: NVIDIA DALI's own pipeline over ``dataset.path``, measured the runner's way.

A user choosing a data path asks whether the runner's loader beats what they would use
otherwise; this storage answers on their own data, in the same loop, figures and verdict.
The pipeline is what a DALI user writes: ``fn.readers.file`` (DALI's reader, its own
seeded shuffle: a full permutation after every epoch, ``shuffle_after_epoch``; disjoint
shards under torchrun), the image decoder (``decoders.image`` for center crops,
``decoders.image_random_crop`` for random-resized crops, which decodes only the crop's
window), a resize (for centre crops: the shorter side to ``dataset.image_size`` /
``dataset.crop_fraction``, so the crop is the share every storage takes) and
``crop_mirror_normalize`` to uint8 CHW (the runner's batch: uint8 NCHW, labels, indices;
random crops and flips from DALI's own random numbers, not the runner's per-image crop
seeds). On CUDA
the decoder is DALI's mixed (nvJPEG) one and the images arrive on the GPU, handed over
without a copy; on the CPU, its CPU decoders. It runs with one thread per core (or
``loader.decode_threads``), like the runner's decode threads.

Corrupt files: DALI cannot skip a sample inside a pipeline (its maintainers: the reader
has no way to replace it, NVIDIA/DALI#3913); one undecodable file stops the pipeline for
good ("Current pipeline object is no longer valid"). So the runner screens the files
first, once per run: a file that is empty, not a JPEG or PNG with a readable header, or a
JPEG without its end-of-image marker (a truncated file) is left out and reported as
skipped, as the runner's own loaders report theirs. A file that passes the screen and still
fails inside DALI (corrupt entropy-coded data) fails the run with DALI's message, which
names the file where DALI does; a sweep goes on. DALI's own order is not the runner's
permutation, so a resumed ``loader=dali`` run continues at the right step but not with the
exact batches of an uninterrupted one.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from runner.common.errors import UserError
from runner.common.text import printable
from runner.config.schema import Crop, DatasetConfig, LoaderConfig, StorageName
from runner.data.decode.decoders import CPU_DECODERS
from runner.data.order import BatchOrder
from runner.data.protocol import StorageKind
from runner.data.sources.listing import DatasetError
from runner.data.storage.folder import FolderStorage, open_folder
from runner.data.storage.rival import (
    RivalStorage,
    RivalUnavailable,
    screen_file,
    screen_samples,
)
from runner.data.threads import cores

log = logging.getLogger(__name__)


class DaliStopped(UserError, RuntimeError):
    """DALI's pipeline stopped on a file it could not decode; the message says which, when
    DALI does, and the fix."""


def check_dali() -> None:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError as e:
        raise RivalUnavailable(
            "loader=dali needs NVIDIA DALI: pip install -e '.[dali]' (the "
            "nvidia-dali-cuda130 wheel; it runs on the CPU too)") from e


class DaliStorage(RivalStorage):
    """The screened image folder, read and decoded by DALI's pipeline (``loader.name``
    dali). Its loader is DALI's (``own_loader``): one stage the runner cannot look
    inside, probed whole by the verdict (``probes``)."""

    stage = "dali"

    def __init__(self, folder: FolderStorage, loader: LoaderConfig, dataset: DatasetConfig):
        check_dali()
        start = time.perf_counter()
        kept, skipped = screen_samples(folder, "DALI",
                                       (screen_file(path) for path, _ in folder.samples))
        if not kept:
            raise DatasetError(f"no file of {folder.root} passes the screen for DALI")
        log.info("screened %d files for DALI in %.1f s: %d left out (DALI stops on a file it "
                 "cannot decode)", len(folder.samples), time.perf_counter() - start,
                 len(skipped))
        self._serve(folder, kept, skipped)
        self.dataset = dataset
        self.threads = loader.decode_threads or cores()

    def own_loader(self, order: BatchOrder, device: torch.device) -> DaliBatches:
        return DaliBatches(self, order, device)


def _pipeline(storage: DaliStorage, order: BatchOrder, device: torch.device):
    from nvidia.dali import fn, pipeline_def, types

    crop, fraction = storage.dataset.crop, storage.dataset.crop_fraction
    h, w = (int(v) for v in storage.dataset.image_size)
    cuda = device.type == "cuda"

    @pipeline_def
    def pipe():
        jpegs, index = fn.readers.file(
            files=[p for p, _ in storage.samples], labels=list(range(len(storage))),
            shard_id=order.rank, num_shards=order.world, random_shuffle=False,
            shuffle_after_epoch=order.shuffle, pad_last_batch=True, name="Reader",
            seed=order.seed + 1)
        decoder = "mixed" if cuda else "cpu"
        if crop is Crop.random:
            images = fn.decoders.image_random_crop(
                jpegs, device=decoder, output_type=types.RGB, random_area=[0.08, 1.0],
                random_aspect_ratio=[3 / 4, 4 / 3], num_attempts=10)
            images = fn.resize(images, size=[h, w], antialias=True)
            mirror = fn.random.coin_flip()
        else:
            images = fn.decoders.image(jpegs, device=decoder, output_type=types.RGB)
            # resize so the output is dataset.crop_fraction of the shorter side, then crop:
            # the centre crop every storage takes (256 then 224 at 0.875)
            images = fn.resize(images, mode="not_smaller", size=[h / fraction, w / fraction],
                               antialias=True)
            mirror = 0
        images = fn.crop_mirror_normalize(images, crop=[h, w], dtype=types.UINT8,
                                          output_layout="CHW", mirror=mirror)
        return images, index

    return pipe(batch_size=order.batch_size, num_threads=storage.threads,
                device_id=(device.index or 0) if cuda else None,
                seed=order.seed * 1009 + order.rank, prefetch_queue_depth=2)


class DaliBatches:
    """One epoch of DALI batches per iteration, as the runner's loaders yield them:
    ``({image, label, index[, valid]}, skipped files)``.

    Under torchrun the iterator fills a shard's last batch with repeated samples (every
    shard yields the same number of batches, as DDP needs); those rows are marked not
    ``valid`` and not counted, as the runner's own padding is. In one process the last
    batch is short, as the runner's own loaders give it.
    """

    def __init__(self, storage: DaliStorage, order: BatchOrder, device: torch.device):
        from nvidia.dali.plugin.base_iterator import LastBatchPolicy
        from nvidia.dali.plugin.pytorch import DALIGenericIterator

        self.storage, self.order = storage, order
        self.labels = torch.tensor([label for _, label in storage.samples], dtype=torch.int64)
        n, r, s = len(storage), order.rank, order.world
        self.shard = n * (r + 1) // s - n * r // s  # DALI's shard: [n r / s, n (r + 1) / s)
        pipe = _pipeline(storage, order, device)
        pipe.build()
        # one process: a short last batch, as the runner's own loaders give; torchrun: every
        # rank the same number of full batches, the fill marked not valid
        policy = (LastBatchPolicy.DROP if order.drop_last else
                  LastBatchPolicy.FILL if order.world > 1 else LastBatchPolicy.PARTIAL)
        self.iterator = DALIGenericIterator(pipe, ["image", "index"], reader_name="Reader",
                                            last_batch_policy=policy,
                                            auto_reset=True)
        self.batches = len(self.iterator)
        self.pipe = pipe

    def __len__(self) -> int:
        return self.batches

    def close(self) -> None:
        """Stop DALI's threads now (a sweep's next job runs in this process)."""
        if self.pipe is not None:
            self.iterator = None
            self.pipe._shutdown()
            self.pipe = None

    def __iter__(self):
        skip = self.order.begin_epoch()  # batches of a resumed epoch already done
        bs = self.order.batch_size
        try:
            for k, out in enumerate(self.iterator):
                if k < skip:
                    continue
                image, index = out[0]["image"], out[0]["index"].flatten().to(torch.int64)
                index = index.cpu()
                batch = {"image": image, "label": self.labels[index], "index": index}
                real = self.shard - k * bs  # rows of this shard left at this batch
                if real < len(index):
                    batch["valid"] = torch.arange(len(index)) < real
                yield batch, []
        except RuntimeError as e:
            raise DaliStopped(f"DALI's pipeline stopped: {_dali_reason(str(e))} (DALI cannot "
                              "skip a file it fails to decode: remove it from "
                              f"{printable(str(self.storage.root))}, or use a runner loader, "
                              "which skips and counts such files)") from e


def _dali_reason(message: str) -> str:
    """What DALI says went wrong, without its pipeline traceback: the lines after
    "encountered:" (they name the file where DALI knows it), else the first lines."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if "encountered:" in lines:
        after = lines[lines.index("encountered:") + 1 :]
        cause = [line for line in after if not line.startswith("Current pipeline")]
        return "; ".join(cause[:3])
    return "; ".join(lines[:3])


def open_dali(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
              progress: bool = True) -> DaliStorage:
    """The folder at ``path`` for NVIDIA DALI's own pipeline (the rival, measured the
    runner's way)."""
    check_dali()  # before listing the folder: a clear skip when DALI is not installed
    if dataset.crop in (Crop.whole, Crop.letterbox):
        raise RivalUnavailable(f"loader=dali has no dataset.crop={dataset.crop.value} (the "
                               "whole image resized without a crop): use loader=folder, "
                               "packed, shards, memmap or ram for detection and dense outputs")
    return DaliStorage(open_folder(loader, dataset, path, progress), loader, dataset)


KIND = StorageKind(
    name=StorageName.dali,
    open=open_dali,
    storage=DaliStorage,
    summary="the rival: NVIDIA DALI's own pipeline (reader, decoder, crops) over the folder",
    decoders=CPU_DECODERS,  # only for the example images models are built with
    own_loader=True,
    autotune=False,
    advice={"dali": "DALI's pipeline is one stage the runner cannot look inside (read, "
                    "decode and crop together); compare it with loader=packed, memmap or ram "
                    "in python -m runner -m sweep=rivals"},
)
