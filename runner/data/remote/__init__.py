"""Data that lives elsewhere: object stores and HTTP servers wherever a dataset path goes.

- url.py: which strings are URLs (``s3://``, ``gs://``, ``http(s)://``, fsspec's spelling)
  and how they split into a store and a key prefix;
- client.py: the one client (obstore), credentials and endpoints the usual way, and the
  one-line errors for bad input (unreachable, denied, missing);
- engine.py: the read engine: fetches in flight off the decode threads, as many as the
  measured rate x round trip needs, bounded in bytes; retries with jittered back-off;
- cache.py: the node-local shard cache with a hard bound in bytes;
- stream.py: remote shards fetched ahead of need into that cache (``loader=shards``);
- listing.py: an image folder (or manifest) that lives in a bucket, listed as a local one is;
- fardisk.py: a local path on a network mount (NFS, SMB, FUSE) told far and read through
  the engine, a folder's files or a packed store's images;
- delayline.py, loopback.py: a far link, S3 and HTTP servers on loopback and rclone's FUSE
  mount of them, for tests and the bench.

A bucket is read in one of two layouts: one object per image (``loader=folder`` over a URL),
a request per image; or shards
(``python -m runner.prepare shards ... out=s3://...``, then ``loader=shards``): WebDataset
tars of packed's JPEGs, 64 MiB each by default (``shard_mb=``), with an index per shard
(runner/data/storage/tarshards.py), fetched whole on the I/O thread into the node-local
cache and then read like local shards (a sample is one ``pread``), so a second epoch runs at
local speed when the shards fit ``dataset.cache_bytes`` (10 GB by default). Both layouts are
measured against local disk, at 0/10/50 ms round trip and with faults, by
``python -m runner.bench remote`` (runner/bench/remote.py); why obstore: client.py.
"""
