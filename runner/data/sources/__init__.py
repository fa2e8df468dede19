"""Stage 1 of the data path: where the bytes come from.

- listing.py: which images a dataset holds and their labels (class folders, a flat folder, a
  manifest); remote_listing.py: the same for a folder or manifest in a bucket, so a bucket
  holding a copy of a folder gives the same samples, batches and crops;
- synthetic.py: the default dataset, generated once and cached;
- url.py: which strings are URLs (``s3://``, ``gs://``, ``http(s)://``, fsspec's spelling)
  and how they split into a store and a key prefix;
- objectstore.py: the one client (obstore), credentials and endpoints the usual way, and the
  one-line errors for bad input (unreachable, denied, missing);
- readengine.py: fetches in flight off the decode threads, as many as the measured rate x
  round trip needs, bounded in bytes; retries with jittered back-off;
- fardisk.py: a local path on a network mount (NFS, SMB, FUSE) told far and read through
  the engine;
- files.py: an image folder's listing and what reads its bytes, decided once
  (``open_files``): this machine's files, a far disk's through the engine, or a store's
  objects; ``loader=folder`` only decodes what it reads;
- shardcache.py, shardstream.py: remote shards fetched ahead of need into the node-local
  shard cache, bounded in bytes (``loader=shards``);
- pagecache.py: ``dataset.page_cache=cold``, the dataset read from the device, not from RAM.

A bucket is read in one of two layouts: one object per image (``loader=folder`` over a URL),
a request per image; or shards
(``python -m runner.prepare shards ... out=s3://...``, then ``loader=shards``): WebDataset
tars of packed's JPEGs, 64 MiB each by default (``shard_mb=``), with an index per shard
(runner/data/storage/tarformat.py), fetched whole on the I/O thread into the node-local
cache and then read like local shards (a sample is one ``pread``), so a second epoch runs at
local speed when the shards fit ``dataset.cache_bytes`` (10 GB by default). Both layouts are measured against
local disk, at 0/10/50 ms round trip and with faults, by ``python -m runner.bench remote``
(runner/bench/remote.py, through the loopback servers and delay line of
runner/bench/servers/); why obstore: objectstore.py.
"""
