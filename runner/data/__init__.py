"""The data path, storage to device: ``build_data_path(config, device, ...) -> DataPath``.

The folders follow a batch, in the order it is made:

1. ``sources/``: where the bytes come from: the images a dataset holds and their labels
   (listing.py, remote_listing.py for a bucket) and what reads them, decided once (files.py:
   local files, a far disk's, a store's objects), the default dataset (synthetic.py), object
   stores and URLs (url.py, objectstore.py), the read engine for far links (readengine.py,
   fardisk.py), remote shards read ahead into the node-local shard cache (shardstream.py,
   shardcache.py), and a cold page cache (pagecache.py);
2. ``decode/``: bytes to pixels: the CPU decoders (decoders.py, the region decoder's
   jpegregion.c), the crop geometry every decoder and the device share (crops.py), the bytes
   kept for the GPU decoder (encoded.py), a copy at a lower quality (reencode.py);
3. ``storage/``: the ``loader=`` storages, one module each with its registry record, and
   what the converted ones share (convert.py, decoded.py, tarformat.py, shardwrite.py);
4. ``loading/``: a storage in a DataLoader and the stream of batches the loop reads
   (loader.py), gathered into reusable buffers (buffers.py);
5. ``device/``: batches staged ahead (prefetch.py), decoded on the GPU (nvjpeg.py),
   normalized where ``loader.host_dtype`` says (normalize.py), augmented (augment.py).

What every stage agrees on sits beside them: the storage protocol (protocol.py), the batch
order and its padding (order.py), cores and threads (threads.py), worker processes for
one-off preparation (pool.py); path.py assembles the stages. A stage imports only those
before it (tests/test_layout.py); nothing here imports the loop, the task or the run.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runner.data.path import DataPath, build_data_path

__all__ = ["DataPath", "build_data_path"]


def __getattr__(name: str):
    """``from runner.data import build_data_path``: path.py (and torch) on first use, so that
    a stage that needs no torch (sources/url.py, listing.py) is imported without it: the
    command line's cheap checks (runner/job/precheck.py) answer before torch is loaded."""
    if name in __all__:
        from runner.data import path

        return getattr(path, name)
    raise AttributeError(f"module 'runner.data' has no attribute {name!r}")
