"""``loader=webdataset``: the ``webdataset`` library's own pipeline on ``loader=shards``' shards,
measured the runner's way (the rival of the runner's shard reader, in ``sweep=rivals``).

The shard set is opened as ``loader=shards`` opens it (a local folder, a URL, or an image
folder written as shards once), so both read the same tars over the same link. The pipeline
is what a WebDataset user writes, with the settings its documentation recommends:
``wds.WebDataset`` over the shard URLs (local paths; a bucket's shards as ``pipe:curl`` of
presigned URLs, its documented way to read an object store) with ``shardshuffle`` and
``split_by_worker``, a 1,000-sample shuffle buffer, decoding and batching in
``loader.num_workers`` ``WebLoader`` workers, then ``unbatched().shuffle(1000).batched()``
in the main process (its recipe to mix the workers' samples and hand out full batches).
Under torchrun it follows the docs' advice for DDP: ``resampled=True`` with
``with_epoch(steps)``, so every rank yields the same number of batches (samples drawn with
replacement: an epoch is not each image once). The crop is the runner's own decoder's
(``dataset.crop``, ``dataset.crop_fraction``, as ``loader=shards``; random crops draw from
the pipeline's random numbers). Its order is its own, so a resume goes on at the right
step but not with the batches an uninterrupted run reads; it keeps no node-local cache
(each epoch reads the shards again). No presigned URL is logged: a failure names the shard.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from runner.common.errors import UserError
from runner.config.schema import DatasetConfig, LoaderConfig, StorageName
from runner.data.decode.decoders import CPU_DECODERS
from runner.data.order import BatchOrder
from runner.data.protocol import StorageKind
from runner.data.storage.rival import RivalStorage, RivalUnavailable
from runner.data.storage.shards import ShardsStorage, open_shards

log = logging.getLogger(__name__)

SHUFFLE_BUFFER = 1000  # webdataset's documented default buffer
URL_DAYS = 7  # how long a presigned URL of a bucket's shard stays valid


def check_webdataset() -> None:
    try:
        import webdataset  # noqa: F401
    except ImportError as e:
        raise RivalUnavailable("loader=webdataset needs the webdataset library: "
                               "pip install webdataset") from e


def shard_urls(storage: ShardsStorage, dataset: DatasetConfig) -> list[str]:
    """The URL webdataset opens for each shard: its local path, or for a bucket a
    ``pipe:curl`` of a presigned URL (the credentials stay with boto3, which signs it)."""
    source = storage.source
    if not source.remote:
        return [str(source.path(k)) for k in range(len(source.names))]
    if shutil.which("curl") is None:
        raise RivalUnavailable("loader=webdataset reads a bucket through curl (its pipe: "
                               "URLs): apt-get install curl")
    url = source.url
    if url.scheme in ("http", "https"):
        return [f"pipe:curl -s --fail {url.child(name)}" for name in source.names]
    if url.scheme != "s3":
        raise RivalUnavailable(f"loader=webdataset reads local, http(s) and s3 shards, not "
                               f"{url.scheme}://: use loader=shards")
    import boto3

    client = boto3.client("s3", endpoint_url=dataset.endpoint_url)
    return ["pipe:curl -s --fail '" + client.generate_presigned_url(
        "get_object", Params={"Bucket": url.bucket, "Key": url.key(name)},
        ExpiresIn=URL_DAYS * 86400) + "'" for name in source.names]


class WebDatasetStorage(RivalStorage, ShardsStorage):
    """A shard set read by webdataset's pipeline (``own_loader``), probed whole by the
    verdict as one stage."""

    stage = "webdataset"

    def __init__(self, shards: ShardsStorage, loader: LoaderConfig, dataset: DatasetConfig):
        self.__dict__.update(shards.__dict__)
        self.workers = loader.num_workers
        self.urls = shard_urls(shards, dataset)
        self.shard_name = dict(zip(self.urls, self.source.names))
        self.position = {name: i for i, (name, _) in enumerate(self.samples)}

    def own_loader(self, order: BatchOrder, device: torch.device) -> WebDatasetBatches:
        return WebDatasetBatches(self, order)

    def close(self) -> None:
        RivalStorage.close(self)
        ShardsStorage.close(self)


def stack(samples: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of (image, position) samples: images stacked, positions a tensor."""
    images, index = zip(*samples)
    return torch.stack(images), torch.tensor(index, dtype=torch.int64)


class WebDatasetBatches:
    """One epoch of webdataset's pipeline per iteration, as the runner's loaders yield
    batches: ``({image, label, index}, skipped files)``."""

    def __init__(self, storage: WebDatasetStorage, order: BatchOrder):
        self.storage, self.order = storage, order
        self.labels = storage.label_tensor()
        self.steps = len(order)

    def __len__(self) -> int:
        return self.steps

    def _sample(self, sample: dict) -> tuple[torch.Tensor, int]:
        name = self.storage.shard_name.get(sample["__url__"], sample["__url__"])
        return self.storage.decode(sample["jpg"]), \
            self.storage.position[f"{name}/{sample['__key__']}"]

    def _loader(self):
        import webdataset as wds

        order, distributed = self.order, self.order.world > 1
        buffer = SHUFFLE_BUFFER if order.shuffle else 0
        dataset = wds.WebDataset(
            self.storage.urls, resampled=distributed, empty_check=False,
            shardshuffle=(len(self.storage.urls) if order.shuffle else False)
            if not distributed else None,
            nodesplitter=wds.split_by_node, workersplitter=wds.split_by_worker,
            seed=order.seed + order.epoch)
        dataset = dataset.shuffle(buffer).map(self._sample).batched(
            order.batch_size, collation_fn=stack, partial=True)
        loader = wds.WebLoader(dataset, batch_size=None, num_workers=self.storage.workers)
        loader = loader.unbatched().shuffle(buffer).batched(
            order.batch_size, collation_fn=stack, partial=not order.drop_last)
        return loader.with_epoch(self.steps) if distributed else loader

    def __iter__(self):
        skip = self.order.begin_epoch()  # batches of a resumed epoch already done
        try:
            for k, (image, index) in enumerate(self._loader()):
                if k >= self.steps:
                    break
                if k >= skip:
                    yield {"image": image, "label": self.labels[index], "index": index}, []
        except (KeyError, OSError, ValueError, RuntimeError) as e:
            raise WebDatasetStopped(
                f"webdataset's pipeline stopped: {type(e).__name__} reading "
                f"{self.storage.root} (use loader=shards, which retries, checks each "
                "sample's CRC and skips what it cannot read)") from None

    def close(self) -> None:
        """Nothing held between epochs: each iteration builds its pipeline."""


class WebDatasetStopped(UserError, RuntimeError):
    """webdataset's pipeline failed; the message names the shard set (never a presigned
    URL) and the alternative."""


def open_webdataset(loader: LoaderConfig, dataset: DatasetConfig, path: Path | str,
                    progress: bool = True) -> WebDatasetStorage:
    """The shard set at ``path`` (as loader=shards opens it) for webdataset's pipeline."""
    check_webdataset()
    return WebDatasetStorage(open_shards(loader, dataset, path, progress), loader, dataset)


KIND = StorageKind(
    name=StorageName.webdataset,
    open=open_webdataset,
    storage=WebDatasetStorage,
    summary="the rival: the webdataset library's own pipeline on loader=shards' shards",
    decoders=CPU_DECODERS,
    own_loader=True,
    autotune=False,
    advice={"webdataset": "webdataset's pipeline is one stage the runner cannot look inside; "
                          "compare it with loader=shards on the same shards in python -m "
                          "runner -m sweep=rivals"},
    urls=True,
)
