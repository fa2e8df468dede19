"""Test tooling for the bench and the tests, not the data path: an S3-compatible server and
an HTTP server on loopback (loopback.py) and a delay line in front of them (delayline.py)."""
