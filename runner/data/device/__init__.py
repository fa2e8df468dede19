"""Stage 5 of the data path: what happens on the device. Batches staged ahead (prefetch.py),
decoded on the GPU (nvjpeg.py), normalized where ``loader.host_dtype`` says (normalize.py),
cropped (crops.py) and augmented (augment.py)."""
