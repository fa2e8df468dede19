"""LitData and MosaicML Streaming: the anchors users pick for data in a bucket, as rows of
``python -m runner.bench remote`` (runner/bench/remote.py).

The same work as the shards rows, each library with its own format and tool:

- the same images: the stored JPEG bytes and labels of the bench's shards (``stored_samples``),
  in the shards' order (``python -m runner.prepare shards`` already mixed the classes), written
  once by each library's own writer: ``litdata.optimize`` (its chunks and ``index.json``) and
  Streaming's ``MDSWriter`` (MDS shards and ``index.json``), uncompressed (JPEG does not
  compress), in chunks / shards of the bench's shard size (``--shard-mb``): as many objects
  per byte as the shards, so no row gets fewer, larger requests than another. (LitData's
  README suggests 64 MB chunks for ImageNet; at the bench's 2,000 images that would be one
  chunk, read by one worker.) Both store the JPEG as ``bytes`` and the label as ``int``: the
  libraries' own image types would decode the whole image with their decoder, so each row
  would measure a different decoder;
- the files land in the folder rclone serves as S3 (a bucket each: ``litdata``, ``mds``) and
  are read through the same delay line as the shards, at 0/10/50 ms;
- each is read with the settings its documentation gives: LitData's ``StreamingDataset``
  (``storage_options`` with the ``endpoint_url`` and keys, its README's way to a custom S3
  endpoint; ``cache_dir`` a fresh folder; ``shuffle=True``; ``max_pre_download`` and the
  rest at their defaults, as its own ImageNet benchmark (benchmarks/litdata/
  stream_imagenet.py) reads) in its ``StreamingDataLoader``; Streaming's
  ``StreamingDataset`` (``S3_ENDPOINT_URL``, its docs' way to an S3-compatible store;
  ``local`` a fresh folder; ``shuffle=True``, ``batch_size`` given to the dataset as its
  docs ask; ``predownload``, ``shuffle_algo`` and the rest at their defaults: "Streaming's
  default parameters give great performance out-of-the-box") in a torch ``DataLoader``;
- one worker process per core (``cores()``: the runner's decode threads, and webdataset's
  workers), ``batch_size`` the bench's, the last partial batch kept;
- decoded by the runner's own decoder to the same centre crop at the same size
  (``Decode``: ``ImageDecoder(region, size, 0.875)``, as the webdataset row);
- two epochs from one dataset: the first from an empty local cache (cold), the second from
  what the library kept (warm). images/s counts from each epoch's first batch on, as the
  runner's rows do; the first batch's wait is returned on its own;
- in a fresh interpreter per measurement (``read_apart``), as a training script runs them:
  the bench's own process has run obstore, whose runtime LitData's forked workers cannot use.

Two adaptations to a loopback server, each with the library's source named where it is
made (``read_litdata``, ``read_streaming``): LitData's obstore client is let use http://, and
Streaming's parent-process S3 client is dropped (its own ``clean_up``) before its workers
fork, so they do not share one keep-alive connection.

A library that is not installed gives its row's reason (``not installed: pip install
...``) in place of a figure, and its targets fail. LitData is part of ``.[dev]``; the extra
``.[peers]`` adds Streaming, not part of ``.[dev]``: mosaicml-streaming pins numpy<2.2 and
transformers<5 (downgrading .[dev]'s numpy and huggingface_hub) and brings Oracle's,
Azure's and Google's SDKs, ~0.7 GB: install it in a venv of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runner.config.schema import Decoder
from runner.data.storage.tarformat import SHARD_LIST

LITDATA, STREAMING = "litdata", "streaming"
PEERS = (LITDATA, STREAMING)
INSTALL = {LITDATA: "pip install litdata (part of .[dev])",
           STREAMING: "pip install mosaicml-streaming (.[peers]; it pins numpy<2.2)"}
MODULE = {LITDATA: "litdata", STREAMING: "streaming"}
BUCKET = {LITDATA: "litdata", STREAMING: "mds"}  # the folder under the served root


def missing(peer: str) -> str | None:
    """Why ``peer`` cannot run here (``not installed: pip install ...``), or None."""
    import importlib.util

    if importlib.util.find_spec(MODULE[peer]) is None:
        return f"not installed: {INSTALL[peer]}"
    return None


def stored_samples(shards: Path) -> Iterator[tuple[str, bytes, int]]:
    """(key, the stored JPEG's bytes, label) of every sample of a shard set, in its order."""
    manifest = json.loads((shards / "manifest.json").read_text())
    for entry in manifest[SHARD_LIST]:
        index = json.loads((shards / entry["index"]).read_text())
        data = (shards / entry["name"]).read_bytes()
        for key, off, size, label in zip(index["keys"], index["offsets"], index["sizes"],
                                         index["labels"]):
            yield key, data[off:off + size], int(label)


def _litdata_sample(item: tuple[str, int, int, int]) -> dict:
    """``litdata.optimize``'s function: one sample's bytes from its shard (a top-level
    function: optimize's workers import it)."""
    path, off, size, label = item
    with open(path, "rb") as f:
        f.seek(off)
        return {"jpg": f.read(size), "cls": label}


def write_litdata(shards: Path, out: Path, chunk_bytes: int) -> Path:
    """The shard set's samples as LitData's optimized chunks in ``out``, by
    ``litdata.optimize``."""
    import litdata

    manifest = json.loads((shards / "manifest.json").read_text())
    inputs = []
    for entry in manifest[SHARD_LIST]:
        index = json.loads((shards / entry["index"]).read_text())
        inputs += [(str(shards / entry["name"]), off, size, int(label)) for off, size, label
                   in zip(index["offsets"], index["sizes"], index["labels"])]
    # one worker writes the chunks in the shards' order (the classes already mixed); forked
    # (its default, spawn, re-imports the caller's __main__) and the process's start method
    # put back after (optimize sets it for the whole process, every later DataLoader's)
    import multiprocessing

    method = multiprocessing.get_start_method(allow_none=True)
    try:
        litdata.optimize(fn=_litdata_sample, inputs=inputs, output_dir=str(out),
                         chunk_bytes=chunk_bytes, num_workers=1, reorder_files=False,
                         mode="overwrite", start_method="fork")
    finally:
        multiprocessing.set_start_method(method, force=True)
    return out


def write_mds(shards: Path, out: Path, size_limit: int) -> Path:
    """The shard set's samples as Streaming's MDS shards in ``out``, by ``MDSWriter``."""
    from streaming import MDSWriter

    with MDSWriter(out=str(out), columns={"jpg": "bytes", "cls": "int"},
                   size_limit=size_limit) as writer:
        for _key, data, label in stored_samples(shards):
            writer.write({"jpg": data, "cls": label})
    return out


def write_peers(shards: Path, served: Path, shard_bytes: int) -> dict[str, str | None]:
    """Each installed library's format of the shard set in its bucket under ``served``;
    per library, None or why it has no row (not installed, or its writer's error)."""
    why: dict[str, str | None] = {}
    for peer, write in ((LITDATA, write_litdata), (STREAMING, write_mds)):
        why[peer] = missing(peer)
        if why[peer] is None:
            try:
                write(shards, served / BUCKET[peer], shard_bytes)
            except Exception as e:  # its row says why, the others still run
                why[peer] = f"its writer failed: {type(e).__name__}: {e}"
    return why


class Decode:
    """A sample dict's JPEG to the runner's centre crop (``ImageDecoder``), with its label:
    what each worker runs, built on first use in the worker."""

    def __init__(self, size: tuple[int, int]):
        self.size, self.decoder = tuple(size), None

    def __call__(self, sample: dict) -> tuple[torch.Tensor, int]:
        if self.decoder is None:
            from runner.data.decode.decoders import ImageDecoder

            self.decoder = ImageDecoder(Decoder.region, self.size, fraction=0.875)
        return self.decoder(bytes(sample["jpg"])), int(sample["cls"])

    def __getstate__(self) -> dict:
        return {"size": self.size, "decoder": None}


@dataclass
class Epochs:
    """What reading a library's dataset for some epochs gave."""

    rates: list[float] = field(default_factory=list)  # images/s of each epoch
    first_batch_s: float = 0.0  # from opening the dataset to its first batch
    labels: list[list[int]] = field(default_factory=list)  # each epoch's labels, as read
    shapes: set[tuple[int, ...]] = field(default_factory=set)  # the images' shapes


def timed_epochs(loader, epochs: int, t0: float) -> Epochs:
    """images/s of each epoch of ``loader`` (batches of (images, labels)) from its first batch
    on, as ``remote.epoch_rate`` counts the runner's."""
    out = Epochs()
    for _ in range(epochs):
        start, timed, labels = None, 0, []
        for images, batch_labels in loader:
            if not out.first_batch_s:
                out.first_batch_s = time.perf_counter() - t0
            if start is None:  # the epoch's first batch is its warm-up
                start = time.perf_counter()
            else:
                timed += len(batch_labels)
            labels += [int(v) for v in batch_labels]
            out.shapes.add(tuple(images.shape[1:]))
        out.rates.append(timed / max(time.perf_counter() - start, 1e-9) if start else 0.0)
        out.labels.append(labels)
    return out


@contextmanager
def environment(**values: str):
    """``values`` in os.environ while the block runs (the workers it forks inherit them),
    the previous values put back after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def read_litdata(endpoint: str, cache: Path, size: tuple[int, int], batch_size: int,
                 workers: int, epochs: int = 2) -> Epochs:
    """``epochs`` epochs of LitData's ``StreamingDataset`` over ``s3://litdata`` at
    ``endpoint``, its cache in ``cache`` (emptied first: epoch 1 is cold).

    Its workers fetch chunks with obstore (when installed, as here: .[dev] has it), through an
    ``S3Store`` it builds from the boto3 client's endpoint with its own client options
    (litdata/streaming/downloader.py, ``_OBSTORE_CLIENT_OPTIONS``: timeout and pool only, no
    ``allow_http``), so an http:// endpoint fails with reqwest's ``BadScheme``, and obstore's
    ``AWS_ALLOW_HTTP`` is not read when client options are given. A loopback server is
    http://, a real bucket https://: ``allow_http`` is added to those options while this
    reads (its forked workers inherit them), the rest of LitData's path unchanged."""
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.streaming import downloader

    shutil.rmtree(cache, ignore_errors=True)
    keys = {"aws_access_key_id": os.environ.get("AWS_ACCESS_KEY_ID", "anonymous"),
            "aws_secret_access_key": os.environ.get("AWS_SECRET_ACCESS_KEY", "anonymous")}
    options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
    if isinstance(options, dict):  # the dict every S3Store of its gets, changed in place
        options["allow_http"] = "true"
    try:
        t0 = time.perf_counter()
        dataset = StreamingDataset(f"s3://{BUCKET[LITDATA]}", cache_dir=str(cache),
                                   shuffle=True, transform=Decode(size),
                                   storage_options={"endpoint_url": endpoint, **keys})
        loader = StreamingDataLoader(dataset, batch_size=batch_size, num_workers=workers)
        return timed_epochs(loader, epochs, t0)
    finally:
        if isinstance(options, dict):
            options.pop("allow_http", None)


def read_streaming(endpoint: str, cache: Path, size: tuple[int, int], batch_size: int,
                   workers: int, epochs: int = 2) -> Epochs:
    """``epochs`` epochs of Streaming's ``StreamingDataset`` over ``s3://mds`` at ``endpoint``
    (``S3_ENDPOINT_URL``), its shards in ``cache`` (emptied first: epoch 1 is cold).

    Its ``Stream`` keeps one ``S3Downloader`` (streaming/base/stream.py: ``self._downloader =
    CloudDownloader.get(remote)``) whose boto3 client, made in this process to fetch
    ``index.json``, is dropped only when pickled (storage/download.py, ``__getstate__``):
    DataLoader workers forked after it share its pooled keep-alive connection, and over
    http:// two workers read each other's answers (seen here: a shard file holding another
    shard's bytes, and a 60 s read timeout before the first batch). The library's own reset
    (``clean_up()``, what its retries call) drops that client before the workers fork; each
    then makes its own."""
    from streaming.base.util import clean_stale_shared_memory
    from torch.utils.data import DataLoader

    shutil.rmtree(cache, ignore_errors=True)
    clean_stale_shared_memory()  # a previous dataset's, in this process
    with environment(S3_ENDPOINT_URL=endpoint):
        t0 = time.perf_counter()
        dataset = _MDSImages(Decode(size), remote=f"s3://{BUCKET[STREAMING]}",
                             local=str(cache), shuffle=True, batch_size=batch_size)
        for stream in dataset.streams:  # no connection shared by the forked workers
            downloader = getattr(stream, "_downloader", None)
            if downloader is not None:
                downloader.clean_up()
        loader = DataLoader(dataset, batch_size=batch_size, num_workers=workers)
        return timed_epochs(loader, epochs, t0)


def _MDSImages(decode: Decode, **kwargs):  # noqa: N802 (a class, made once streaming is in)
    """Streaming's dataset with ``decode`` on each sample (its docs' way: a subclass whose
    ``__getitem__`` transforms what the base returns)."""
    global _mds_class
    if _mds_class is None:
        from streaming import StreamingDataset

        class MDSImages(StreamingDataset):
            def __init__(self, decode: Decode, **kw):
                super().__init__(**kw)
                self.decode = decode

            def __getitem__(self, index: int):
                return self.decode(super().__getitem__(index))

        _mds_class = MDSImages
    return _mds_class(decode, **kwargs)


_mds_class = None

READERS = {LITDATA: read_litdata, STREAMING: read_streaming}


def read_apart(peer: str, endpoint: str, cache: Path, size: tuple[int, int], batch_size: int,
               workers: int, epochs: int = 2, timeout: float = 1800.0) -> Epochs:
    """``READERS[peer]`` in a fresh interpreter (``python -m runner.bench.peers``), as a
    user's training script runs it: not in the bench's process, whose runner rows have
    started obstore's runtime (a process-wide tokio, not fork-safe). LitData's forked
    workers then fetch with an obstore that never answers (its own guard,
    ``obstore_usable()``, tracks only the obstore it started itself): every chunk waits
    until ``ChunkWaitTimeoutError``. The child inherits the environment (the keys) and the
    client's cores; its output is shown only when it fails."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="runner-peer-") as tmp:
        out = Path(tmp) / "epochs.json"
        ask = {"endpoint": endpoint, "cache": str(cache), "size": list(size),
               "batch_size": batch_size, "workers": workers, "epochs": epochs}
        proc = subprocess.run([sys.executable, "-m", "runner.bench.peers", peer,
                               json.dumps(ask), str(out)], capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0 or not out.exists():
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            raise RuntimeError(lines[-1] if lines else f"exit status {proc.returncode}")
        got = json.loads(out.read_text())
    return Epochs(rates=got["rates"], first_batch_s=got["first_batch_s"],
                  labels=got["labels"], shapes={tuple(s) for s in got["shapes"]})


def main(argv: list[str]) -> int:
    """The child of ``read_apart``: ``PEER ASK_JSON OUT_JSON``."""
    peer, ask, out = argv[0], json.loads(argv[1]), Path(argv[2])
    got = READERS[peer](ask["endpoint"], Path(ask["cache"]), tuple(ask["size"]),
                        ask["batch_size"], ask["workers"], ask["epochs"])
    out.write_text(json.dumps({"rates": got.rates, "first_batch_s": got.first_batch_s,
                               "labels": got.labels, "shapes": sorted(got.shapes)}))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
