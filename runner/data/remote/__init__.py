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
- delayline.py, loopback.py: a far link and an S3 server on loopback, for tests and the bench.
"""
