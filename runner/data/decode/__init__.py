"""Stage 2 of the data path: bytes to pixels. The CPU decoders of ``loader.decoder``
(decoders.py, the region decoder's C source jpegregion.c), the files' bytes for the GPU
decoder (encoded.py), and a copy of a folder at a lower quality (reencode.py)."""
