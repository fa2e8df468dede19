"""Where an image folder's bytes come from, decided once: ``open_files(dataset, path) -> Files``.

A listing (listing.py; remote_listing.py for a store) says which images a dataset holds and
their labels; a ``Files`` holds that listing and reads each image's bytes, the one thing that
differs between the places a folder can be:

- **this machine's files** (``Files``): each read whole by one blocking read, in the decode
  thread that wants it;
- **a far disk** (``FarFiles``; fardisk.py tells one, or ``dataset.far_disk``): the same
  files, fetched by the read engine (readengine.py) over obstore's ``LocalStore``;
- **a store** (``StoreFiles``; ``dataset.path=s3://...``, url.py): one object per image,
  fetched by the read engine of the store (objectstore.py).

``will_need`` (the loader calls it for each batch it queues, a few ahead of the one it
decodes) starts an engine's fetches of the batch at once, all of them concurrently on the
engine's I/O thread; ``read`` then waits only for an image not fetched yet. A fetch that
still fails after the engine's retries reads as an unreadable file, an OSError naming its
path or URL: skipped, or with ``dataset.on_corrupt=fail`` an error. ``files`` are the local
files a cold page cache evicts (none in a store), ``name_of`` an image's name relative to
the root, ``figures`` the engine's requests, bytes, retries, window and round trip, and
``close`` stops the engine.

``loader=folder`` (runner/data/storage/folder.py) decodes what a Files reads; the stores
built from a folder (packed, memmap, ...) read its files themselves, once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from runner.config.schema import DatasetConfig
from runner.data.order import split_padding
from runner.data.sources.fardisk import is_far
from runner.data.sources.listing import Listing, list_images
from runner.data.sources.url import is_url

log = logging.getLogger(__name__)

FETCH_HINT = 256 << 10  # bytes the read engine's window reserves per image until it has it


def read_file(path: str) -> bytearray:
    """The whole file in a writable buffer (torch.frombuffer needs one; no extra copy)."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    return buf if got == size else buf[:got]


class Files:
    """A listing's images as files of this machine, each read whole when wanted.

    Args:
        listing: the images (paths or URLs), their labels, classes and root.
    """

    local = True  # the images are files of this machine (a cold page cache evicts them)

    def __init__(self, listing: Listing):
        self.listing = listing

    @property
    def root(self) -> Path | str:
        return self.listing.root

    @property
    def samples(self) -> list[tuple[str, int]]:
        """(path, label) per image, in storage order (the listing's own list)."""
        return self.listing.samples

    @property
    def files(self) -> list[str]:
        """The local files an epoch reads."""
        return [path for path, _ in self.samples]

    def name_of(self, index: int) -> str:
        """Image ``index``'s path relative to the root."""
        return os.path.relpath(self.samples[index][0], self.root)

    def will_need(self, index: torch.Tensor) -> None:
        """Nothing for local files: opening each to say so would cost a read's worth."""

    def read(self, index: int) -> bytearray:
        """Image ``index``'s bytes: its file, read whole."""
        return read_file(self.samples[index][0])

    def figures(self) -> dict:
        return {}

    def close(self) -> None:
        """Nothing to stop: files are opened and closed per read."""

    def kept(self, keep: list[int]) -> Files:
        """The images ``keep`` of this listing, as local files read whole: what a store
        built from a folder serves (it reads its own copy; the folder's files are read
        again, if at all, for an example or a probe), never through an engine."""
        listing = self.listing
        return Files(Listing(listing.root, listing.classes, [self.samples[i] for i in keep],
                             listing.how))


class FarFiles(Files):
    """A local folder on a far disk (a network mount): each file fetched by the read engine
    over obstore's LocalStore (``far_engine``), a coming batch's all in flight at once
    (runner/data/sources/fardisk.py).

    Args:
        listing: as Files.
        engine: the read engine that fetches the images.
    """

    def __init__(self, listing: Listing, engine):
        from runner.data.sources.readengine import Ahead

        super().__init__(listing)
        self.engine = engine
        self.keys = self.keys_of(self.samples)
        self.ahead = Ahead()

    def keys_of(self, samples: list[tuple[str, int]]) -> list[str]:
        """Each image's key in the engine's store (an absolute path without its first /)."""
        return [os.path.abspath(path).lstrip("/") for path, _ in samples]

    def will_need(self, index: torch.Tensor) -> None:
        """Start fetching a coming batch's images now, concurrently."""
        self.ahead.start(split_padding(index)[0].tolist(), lambda todo: self.engine.get_many(
            [self.keys[i] for i in todo], FETCH_HINT))

    def read(self, index: int) -> bytearray:
        """Image ``index``'s bytes, fetched by the engine (started by ``will_need``)."""
        future = self.ahead.take(index, lambda i: self.engine.get(self.keys[i], FETCH_HINT))
        try:
            return bytearray(future.result())
        except Exception as e:  # the engine gave up: unreadable, named by its path or URL
            raise OSError(f"{self.samples[index][0]}: {type(e).__name__} after "
                          f"{self.engine.attempts} tries") from e

    def figures(self) -> dict:
        """The read engine's requests, bytes, retries, window and round trip."""
        return self.engine.stats.figures()

    def close(self) -> None:
        self.engine.close()


class StoreFiles(FarFiles):
    """An image folder (or manifest) in a store, one object per image: fetched as a far
    disk's files are, each by its key in the store; no local files."""

    local = False

    def keys_of(self, samples: list[tuple[str, int]]) -> list[str]:
        """Each image's key in the engine's store (its URL without the store's)."""
        prefix = len(self.engine.store.url.store_url) + 1
        return [url[prefix:] for url, _ in samples]

    @property
    def files(self) -> list[str]:
        """No local files: a cold page cache does not apply."""
        return []

    def name_of(self, index: int) -> str:
        return self.samples[index][0][len(str(self.root)) + 1:]


def far_engine():
    """The read engine over this machine's own files."""
    from runner.data.sources.objectstore import LOCAL_SCHEME, ObjectStore
    from runner.data.sources.readengine import ReadEngine
    from runner.data.sources.url import RemoteURL

    return ReadEngine(ObjectStore(RemoteURL(LOCAL_SCHEME, "", "")))


def open_files(dataset: DatasetConfig, path: str | Path,
               list_labelled: Callable[[DatasetConfig, str | Path], Listing] | None = None
               ) -> Files:
    """The images ``dataset.*`` lists at ``path`` (a folder or a manifest; a URL checked
    readable already), with the side that reads them: a store's objects, a far disk's files
    or this machine's.

    Args:
        list_labelled: the listing of ``dataset.targets``' kind, whose labels name the
            images and carry their targets (its record's, runner/data/targets/: boxes'
            ``list_detection``, masks' ``list_masks``); None: a class per image (class
            folders or a manifest), read from where the images are.
    """
    if is_url(path):  # one object per image, in a store
        from runner.data.sources.objectstore import ObjectStore
        from runner.data.sources.readengine import ReadEngine
        from runner.data.sources.remote_listing import list_remote
        from runner.data.sources.url import RemoteURL

        store = ObjectStore(RemoteURL.parse(path), dataset.endpoint_url)
        return StoreFiles(list_remote(dataset, path, store), ReadEngine(store))
    if list_labelled is not None:  # the images the kind's labels name, with their targets
        return Files(list_labelled(dataset, path))
    listing = list_images(dataset, path)
    far, why = is_far([p for p, _ in listing.samples], dataset.far_disk)
    if far:
        log.info("%s: %s, read through the read engine, many files in flight", path, why)
        return FarFiles(listing, far_engine())
    return Files(listing)
