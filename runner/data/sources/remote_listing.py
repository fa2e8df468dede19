"""An image folder or manifest that lives in a store, listed as runner/data/sources/listing.py
lists a local one: the same classes, labels and order, so a bucket holding a copy of a folder
gives the same samples, batches and crops as the folder.

- **class folders**: the first path component under the prefix of every object is a class
  (sorted, as ImageFolder sorts them); each class's images in the order a sorted walk finds
  them (by folder, then by name);
- **unlabelled** (``dataset.labels=none``, or images right under the prefix with
  ``dataset.labels=auto``): every image, sorted by its path's components;
- **a manifest** (a URL ending in .csv, .jsonl or .json): read by the local manifest reader,
  its relative paths resolved against the manifest's own folder in the store.

Images are picked by extension, as locally; other objects are counted and said.
``dataset.val_fraction`` splits the listing as it splits a local one.
"""

from __future__ import annotations

import logging
import posixpath
import tempfile
from pathlib import Path

from runner.config.schema import DatasetConfig, Labels, Split
from runner.data.sources.listing import (
    EXTENSIONS,
    UNLABELLED,
    DatasetError,
    Listing,
    is_image_name,
    read_manifest,
    split_listing,
)
from runner.data.sources.objectstore import ObjectStore
from runner.data.sources.url import RemoteURL

log = logging.getLogger(__name__)

MANIFEST_SUFFIXES = (".csv", ".jsonl", ".json")


def is_manifest(url: RemoteURL) -> bool:
    return url.prefix.lower().endswith(MANIFEST_SUFFIXES)


def list_remote(dataset: DatasetConfig, text: str, store: ObjectStore) -> Listing:
    """What ``dataset.*`` lists at the URL ``text`` (a folder prefix or a manifest)."""
    url = RemoteURL.parse(text)
    listing = _manifest(url, store, dataset.labels) if is_manifest(url) else \
        _folder(url, store, dataset.labels, text)
    if dataset.val_fraction > 0:
        listing = split_listing(listing, dataset.val_fraction, dataset.split_seed,
                                dataset.split is Split.val)
    return listing


def _manifest(url: RemoteURL, store: ObjectStore, labels: Labels) -> Listing:
    data = store.get(url.prefix)
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / posixpath.basename(url.prefix)
        local.write_bytes(data)
        listing = read_manifest(local, labels)
    base = RemoteURL(url.scheme, url.bucket, posixpath.dirname(url.prefix))
    samples = [(str(base.child(Path(p).relative_to(tmp).as_posix())), label)
               for p, label in listing.samples]
    return Listing(str(base), listing.classes, samples, "manifest")


def _folder(url: RemoteURL, store: ObjectStore, labels: Labels, text: str) -> Listing:
    prefix = url.prefix + "/" if url.prefix else ""
    names = [o.key[len(prefix):] for o in store.list(url.prefix)]
    images = [n for n in names if is_image_name(posixpath.basename(n))]
    other = [n for n in names if n not in set(images)
             and not posixpath.basename(n).startswith(".")]
    if other:
        log.warning("%d objects under %s are not images by their names and were left out, "
                    "e.g. %s; images are %s", len(other), text, other[0], " ".join(EXTENSIONS))
    top = [n for n in images if "/" not in n]
    classes = [] if labels is Labels.none else sorted({n.split("/", 1)[0] for n in names
                                                        if "/" in n})
    root = str(url)
    if labels is Labels.none or (labels is Labels.auto and (top or not classes)):
        if not images:
            raise DatasetError(f"dataset.path={text} holds no images ({' '.join(EXTENSIONS)})")
        ordered = sorted(images, key=lambda n: n.split("/"))
        return Listing(root, [], [(url.url_of(url.key(n)), UNLABELLED) for n in ordered],
                       "unlabelled")
    position = {c: k for k, c in enumerate(classes)}
    # a sorted walk per class: by folder, then by file name (listing.py's scan_images)
    ordered = sorted((n for n in images if "/" in n),
                     key=lambda n: (position[n.split("/", 1)[0]], posixpath.dirname(n),
                                    posixpath.basename(n)))
    if not ordered:
        raise DatasetError(f"dataset.path={text} has no images in its class folders "
                           f"({' '.join(EXTENSIONS)})")
    samples = [(url.url_of(url.key(n)), position[n.split("/", 1)[0]]) for n in ordered]
    return Listing(root, classes, samples, "class folders")
