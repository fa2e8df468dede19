"""Stage 4 of the data path: a storage wrapped in a DataLoader and the stream of batches the
loop reads (loader.py), gathered into reusable buffers (buffers.py)."""
