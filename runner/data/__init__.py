"""The data path, storage to device: ``build_data_path(config, device, ...) -> DataPath``.

One package for every stage a batch passes through before the model: storages
(``storage/``), batch order and padding (``order.py``), loaders and the epoch stream
(``loader.py``), GPU decoding (``nvjpeg.py``), batch buffers (``buffers.py``), prefetchers
(``prefetch.py``), device-side crops (``augment.py``), the cold page cache
(``pagecache.py``), cores and threads (``threads.py``), and the one-off preparation of data
(``synthetic.py``, ``reencode.py``, ``pool.py``). It builds on the config and the run's
ranks only: nothing here imports the loop, the task, the run, the results or the verdict.
"""

from runner.data.path import DataPath, build_data_path

__all__ = ["DataPath", "build_data_path"]
