"""runner/data/sources/files.py: a folder's bytes decided once in sources/ (``open_files``:
local, far disk or store), and only decoded by storage/."""

from __future__ import annotations

from tests.conftest import REPO

RUNNER = REPO / "runner"


# --- a folder's bytes come from sources/, decided once ---------------------------------------

def folder_of(source, on_corrupt=None):
    from runner.config.schema import Decoder, OnCorrupt
    from runner.data.decode.decoders import ImageDecoder
    from runner.data.storage.folder import FolderStorage

    return FolderStorage(source, ImageDecoder(Decoder.simplejpeg, (16, 16)),
                         on_corrupt or OnCorrupt.skip)


def test_open_files_decides_local_or_far_once_and_the_folder_decodes_either_alike(image_tree):
    import torch

    from runner.config.schema import DatasetConfig
    from runner.data.sources.files import FarFiles, Files, open_files

    local = open_files(DatasetConfig(far_disk=False), image_tree)
    far = open_files(DatasetConfig(far_disk=True), image_tree)
    assert type(local) is Files and local.local and local.figures() == {}
    assert type(far) is FarFiles and far.local and far.files == local.files
    try:
        a, b = folder_of(local), folder_of(far)
        assert b.source is far and a.samples == b.samples and a.names() == b.names()
        b.will_need(torch.arange(len(b)))  # the whole folder started, all in flight
        for i in range(len(a)):
            assert torch.equal(a[i].image, b[i].image)
        assert b.figures()["remote_requests"] == len(b) and a.figures() == {}
        assert all(bytes(a.read(i)) == bytes(b.read(i)) for i in range(len(a)))
        assert folder_of(image_tree).samples == a.samples  # a path: listed, read locally
    finally:
        far.close()


def test_a_store_built_from_a_far_folder_reads_its_files_locally_with_no_engine(image_tree):
    from runner.config.schema import DatasetConfig
    from runner.data.sources.files import Files, open_files

    far = open_files(DatasetConfig(far_disk=True), image_tree)
    try:
        folder = folder_of(far)
        served = folder_of(image_tree)
        served._serve(folder, [3, 1], [])
        assert type(served.source) is Files and served.samples == [folder.samples[3],
                                                                   folder.samples[1]]
        assert served.names() == [folder.name_of(3), folder.name_of(1)]
        assert bytes(served.read(0)) == bytes(folder.read(3)) and served.figures() == {}
    finally:
        far.close()


class FakeEngine:
    """A read engine over a dict of objects (key -> bytes): fetches answered at once."""

    attempts = 3

    def __init__(self, store_url: str, objects: dict[str, bytes]):
        import types

        self.store = types.SimpleNamespace(url=types.SimpleNamespace(store_url=store_url))
        self.objects, self.asked, self.closed = objects, [], False

    def get(self, key: str, size_hint: int):
        import concurrent.futures

        self.asked.append(key)
        future = concurrent.futures.Future()
        if key in self.objects:
            future.set_result(self.objects[key])
        else:
            future.set_exception(FileNotFoundError(key))
        return future

    def get_many(self, keys: list[str], size_hint: int):
        return [self.get(k, size_hint) for k in keys]

    def close(self) -> None:
        self.closed = True


def test_a_stores_objects_are_fetched_by_key_named_by_url_and_unreadable_when_lost():
    import torch

    from runner.config.schema import OnCorrupt
    from runner.data.decode.decoders import CorruptFileStop
    from runner.data.protocol import Sample, SkippedFile
    from runner.data.sources.files import StoreFiles
    from runner.data.sources.listing import Listing
    from runner.data.storage.folder import source_footprint
    from tests.conftest import encode, photo

    root = "s3://bucket/data/train"
    urls = [f"{root}/cat/a.jpg", f"{root}/dog/b.jpg", f"{root}/dog/gone.jpg"]
    engine = FakeEngine("s3://bucket", {"data/train/cat/a.jpg": encode(photo(index=1)),
                                        "data/train/dog/b.jpg": encode(photo(index=2))})
    files = StoreFiles(Listing(root, ["cat", "dog"], list(zip(urls, [0, 1, 1])),
                               "class folders"), engine)
    assert files.keys == ["data/train/cat/a.jpg", "data/train/dog/b.jpg",
                          "data/train/dog/gone.jpg"]
    assert not files.local and files.files == []
    folder = folder_of(files)
    assert folder.names() == ["cat/a.jpg", "dog/b.jpg", "dog/gone.jpg"] and folder.files == []
    assert source_footprint(None, folder).nbytes == 0
    folder.will_need(torch.tensor([0, 1]))
    assert engine.asked == files.keys[:2]
    assert isinstance(folder[0], Sample) and isinstance(folder[1], Sample)
    assert engine.asked == files.keys[:2]  # taken from the fetches started ahead
    skipped = folder[2]
    assert isinstance(skipped, SkippedFile) and skipped.path == urls[2]
    assert skipped.error == f"unreadable: {urls[2]}: FileNotFoundError after 3 tries"
    strict = folder_of(files, OnCorrupt.fail)
    try:
        strict[2]
    except CorruptFileStop as e:
        assert urls[2] in str(e)
    else:
        raise AssertionError("on_corrupt=fail let an unreadable object through")
    folder.close()
    assert engine.closed


def test_the_folder_storage_decides_no_source_and_has_one_class():
    """storage/folder.py decodes; where the bytes come from is sources/files.py's alone."""
    from tests.test_layout import imported_modules

    imported = imported_modules(RUNNER / "data" / "storage" / "folder.py")
    deciding = {"runner.data.sources.url", "runner.data.sources.fardisk",
                "runner.data.sources.remote_listing", "runner.data.sources.objectstore",
                "runner.data.sources.readengine"}
    assert not imported & deciding, imported & deciding
    import runner.data.storage.folder as folder

    storages = [n for n, v in vars(folder).items()
                if isinstance(v, type) and v.__module__ == folder.__name__]
    assert storages == ["FolderStorage"]


def test_a_bucket_staged_to_pack_keeps_its_listings_names_labels_and_bytes(s3_server, s3_env,
                                                                          cache_dir):
    """``prepare packed|shards dataset.path=s3://...`` stages the objects through the store's
    Files (stage_remote): each image under its name in the listing, with its class."""
    import csv
    import os
    from pathlib import Path

    from runner.data.sources.files import StoreFiles, open_files
    from runner.data.storage.shardwrite import stage_remote
    from runner.job.compose import compose
    from tests.data.sources.test_objectstore import SMALL, local_dataset

    root = local_dataset(cache_dir)
    name = f"flow-staging-{os.getpid()}"
    s3_server.make_bucket(name)
    s3_server.upload(root, name, "train")
    dataset = compose(SMALL).dataset
    local, remote = open_files(dataset, root), open_files(dataset, f"s3://{name}/train")
    try:
        assert isinstance(remote, StoreFiles)
        names = [local.name_of(i) for i in range(len(local.samples))]
        assert [remote.name_of(i) for i in range(len(remote.samples))] == names
    finally:
        remote.close()
    manifest = stage_remote(dataset, f"s3://{name}/train")
    with open(manifest, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["path", "label"]
    assert rows[1:] == [[f"files/{n}", local.listing.classes[label]]
                        for n, (_, label) in zip(names, local.samples)]
    assert all((manifest.parent / row[0]).read_bytes() == Path(path).read_bytes()
               for row, (path, _) in zip(rows[1:], local.samples))


def test_a_stores_messages_name_its_server_with_no_password_even_one_holding_a_slash():
    """objectstore.py masks userinfo with the refusal's pattern (credentials.redacted), not
    a second, weaker one of its own (which left a password holding '/' in the message)."""
    from runner.data.sources.objectstore import ObjectStore
    from runner.data.sources.url import RemoteURL

    store = ObjectStore(RemoteURL.parse("s3://bucket/x"), "http://AKIA:se/cr+et@host:9000")
    assert store.where() == "the server at http://host:9000"
    plain = ObjectStore(RemoteURL.parse("s3://bucket/x"), "http://127.0.0.1:9")
    assert plain.where() == "the server at http://127.0.0.1:9"
