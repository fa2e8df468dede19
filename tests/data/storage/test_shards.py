"""loader=shards and python -m runner.prepare shards: WebDataset's layout, read by webdataset
unchanged; a tar set someone else wrote, indexed on first use; shards in a bucket read
through the node-local cache with a hard bound; CRC checks; the order in blocks of shards."""

from __future__ import annotations

import csv
import io
import json
import logging
import multiprocessing
import os
import shutil
import tarfile
import time
import zlib
from pathlib import Path

import pytest
import torch

from runner.common.errors import ConfigError
from tests.conftest import SMALL_DATASET, assert_same, encode, make_tree, photo, run_in_process

SMALL = [o for o in SMALL_DATASET if not o.startswith("loader.num_workers")]


def prepare_shards(out: str, *more: str) -> None:
    from runner.prepare import main

    assert main(["shards", *SMALL, f"out={out}", "shard_mb=0.05", *more]) == 0


def batches(*overrides: str, loader: str = "shards", epochs: int = 1, figures: dict | None = None
            ) -> list[tuple[torch.Tensor, ...]]:
    import runner

    pipe = runner.pipeline(*SMALL, *overrides, loader=loader)
    try:  # one epoch per iteration
        out = [(b["index"].clone(), b["label"].clone(), b["image"].clone())
               for _ in range(epochs) for b in pipe]
        if figures is not None:
            figures.update(pipe.storage.figures())
        return out
    finally:
        pipe.close()


@pytest.mark.slow
def test_prepared_shards_are_webdataset_shards_with_an_index(tmp_path, cache_dir):
    wds = pytest.importorskip("webdataset")
    out = tmp_path / "shards"
    prepare_shards(str(out))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["count"] == 60 and len(manifest["shards"]) >= 3
    indexed = {}
    for shard in manifest["shards"]:
        assert shard["bytes"] <= 0.05 * (1 << 20) + 16 * 1024  # about shard_mb each
        index = json.loads((out / shard["index"]).read_text())
        raw = (out / shard["name"]).read_bytes()
        for key, off, size, label, crc in zip(index["keys"], index["offsets"],
                                              index["sizes"], index["labels"], index["crcs"]):
            assert zlib.crc32(raw[off:off + size]) == crc
            indexed[key] = (raw[off:off + size], label)
    urls = [str(out / s["name"]) for s in manifest["shards"]]
    seen = {s["__key__"]: (s["jpg"], int(s["cls"])) for s in
            wds.WebDataset(urls, shardshuffle=False)}
    assert seen == indexed and len(seen) == 60


@pytest.mark.slow
def test_shards_written_from_a_far_packed_store_are_the_local_ones(tmp_path, cache_dir):
    # dataset.far_disk=true: the packed store's images read through the read engine, asked
    # for ahead in runs (one range each), to the same bytes as plain preads
    prepare_shards(str(tmp_path / "local"), "dataset.far_disk=false")
    prepare_shards(str(tmp_path / "far"), "dataset.far_disk=true")
    names = sorted(p.name for p in (tmp_path / "local").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "far").iterdir()) and names
    for name in names:
        assert (tmp_path / "local" / name).read_bytes() == (tmp_path / "far" / name).read_bytes()


@pytest.mark.slow
def test_shards_decode_as_the_packed_store_does(tmp_path, cache_dir):
    out = tmp_path / "shards"
    prepare_shards(str(out))
    packed = batches("loader.shuffle=false", loader="packed")
    shards = batches(f"dataset.path={out}", "loader.shuffle=false")
    assert_same(packed, shards)


@pytest.mark.slow
def test_a_tar_set_someone_else_wrote_is_indexed_once_and_read(tmp_path, cache_dir):
    wds = pytest.importorskip("webdataset")
    folder, tars = tmp_path / "folder", tmp_path / "tars"
    tars.mkdir()
    samples = [(f"c{k % 2}", f"img{k:03d}", encode(photo(64, 80, k))) for k in range(24)]
    for c, name, data in samples:
        (folder / c).mkdir(parents=True, exist_ok=True)
        (folder / c / f"{name}.jpg").write_bytes(data)
    ordered = sorted(samples)
    for part in range(2):
        with wds.TarWriter(str(tars / f"part-{part}.tar")) as sink:
            for c, name, data in ordered[part * 12:(part + 1) * 12]:
                sink.write({"__key__": f"{c}/{name}", "jpg": data, "cls": int(c[1])})
    shards = batches(f"dataset.path={tars}", "loader.shuffle=false")
    folder_batches = batches(f"dataset.path={folder}", "loader.shuffle=false",
                             "loader.decoder=region", loader="folder")
    assert_same(folder_batches, shards)
    saved = sorted((cache_dir / "shards" / "index").rglob("*.idx.json*"))
    assert len(saved) == 2
    stamp = [p.stat().st_mtime_ns for p in saved]
    batches(f"dataset.path={tars}", "loader.shuffle=false")
    assert [p.stat().st_mtime_ns for p in saved] == stamp  # reused, not indexed again


@pytest.mark.slow
def test_a_sample_that_fails_its_crc_is_named_and_on_corrupt_decides(tmp_path, cache_dir):
    from runner.data.decode.decoders import CorruptFileStop

    out = tmp_path / "shards"
    prepare_shards(str(out))
    manifest = json.loads((out / "manifest.json").read_text())
    first = manifest["shards"][0]
    index = json.loads((out / first["index"]).read_text())
    with open(out / first["name"], "r+b") as f:  # one byte of sample 2's JPEG changed
        f.seek(index["offsets"][2] + index["sizes"][2] // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    import runner

    pipe = runner.pipeline(*SMALL, f"dataset.path={out}", loader="shards")
    assert sum(len(b["label"]) for b in pipe) == 59
    assert any(index["keys"][2] in s for s in pipe.data.skipped)
    pipe.close()
    with pytest.raises(CorruptFileStop, match=f"{first['name']}/{index['keys'][2]}"):
        batches(f"dataset.path={out}", "dataset.on_corrupt=fail")


def written_labels(out: Path) -> list[list[int]]:
    """Each shard's labels, in the order its tar holds them."""
    manifest = json.loads((out / "manifest.json").read_text())
    return [json.loads((out / s["index"]).read_text())["labels"] for s in manifest["shards"]]


@pytest.mark.slow
def test_shards_are_written_with_the_classes_mixed_in_an_order_the_seed_fixes(tmp_path,
                                                                              cache_dir):
    """Written in dataset order, the first shards held one class each (60 images of 3
    classes: 20 of class 0 first), so webdataset's shard shuffle gave one-class batches. A
    shuffled order, its seed in the manifest; the same seed writes the same bytes."""
    prepare_shards(str(tmp_path / "a"))
    prepare_shards(str(tmp_path / "b"), "shuffle_seed=0")
    prepare_shards(str(tmp_path / "c"), "shuffle_seed=7")
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["shuffle"] == {"seed": 0}
    assert json.loads((tmp_path / "c" / "manifest.json").read_text())["shuffle"] == {"seed": 7}
    labels = written_labels(tmp_path / "a")
    in_order = [label for shard in labels for label in shard]
    assert sorted(in_order) == [0] * 20 + [1] * 20 + [2] * 20
    assert len(set(in_order[:20])) == 3  # the first 20 written: every class
    assert all(len(set(shard)) > 1 for shard in labels if len(shard) >= 6), labels
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    for name in names:  # the same seed: the same files, byte for byte
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert written_labels(tmp_path / "c") != labels  # another seed: another order
    assert main_error(["shards", *SMALL, f"out={tmp_path / 'd'}", "shuffle_seed=x"]) \
        == "error: shuffle_seed=x is invalid: give a whole number 0 or more (the seed of the " \
        "order the shards are written in)"


def main_error(argv: list[str]) -> str:
    import contextlib
    import io

    from runner.prepare import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(argv) == 2
    return err.getvalue().strip()


@pytest.mark.slow
def test_the_runner_numbers_shuffled_shards_by_their_place_in_the_dataset(tmp_path,
                                                                         cache_dir):
    """Sample i of loader=shards is the dataset's image i, whatever shard holds it: its
    labels in dataset order (as packed's), and a shuffled epoch reads each image once."""
    out = tmp_path / "shards"
    prepare_shards(str(out))
    import runner

    pipe = runner.pipeline(*SMALL, f"dataset.path={out}", loader="shards")
    try:
        storage = pipe.storage
        assert [label for _, label in storage.samples] == [0] * 20 + [1] * 20 + [2] * 20
        assert storage.order_members is not None
        assert sorted(storage.order_members.tolist()) == list(range(60))
        assert storage.order_members.tolist()[:20] != list(range(20))  # shuffled on disk
    finally:
        pipe.close()
    got = batches(f"dataset.path={out}", "loader.shuffle=true")
    assert sorted(torch.cat([b[0] for b in got]).tolist()) == list(range(60))


def test_a_block_of_shards_reads_the_members_of_its_shards():
    """BatchOrder with ``members``: a shuffled epoch reads the items the shards of a block
    hold (their members), block after block; unshuffled, the items' own order."""
    from runner.data.order import BatchOrder

    groups, members = [0, 3, 6, 10], torch.tensor([5, 0, 9, 2, 7, 4, 1, 8, 3, 6])
    held = {g: set(members[groups[g]:groups[g + 1]].tolist()) for g in range(3)}
    order = BatchOrder(10, 2, shuffle=True, drop_last=False, seed=1, groups=groups,
                       group_block=1, members=members)
    items = order.epoch_order(0).tolist()
    read, start = [], 0
    for (g,) in order.group_blocks(0):
        read.append(set(items[start:start + len(held[g])]) == held[g])
        start += len(held[g])
    assert read == [True] * 3 and start == 10
    plain = BatchOrder(10, 2, shuffle=False, drop_last=False, seed=1, groups=groups,
                       members=members)
    assert torch.cat(list(plain.batches())).tolist() == list(range(10))


# --- the order ----------------------------------------------------------------------------

def test_shards_are_read_a_block_at_a_time_in_an_order_fixed_by_seed_and_epoch():
    from runner.data.order import BatchOrder

    groups = [0, 7, 15, 20, 31, 40, 44, 50]
    order = BatchOrder(50, 6, shuffle=True, drop_last=False, seed=3, groups=groups,
                       group_block=2)
    shard_of = {i: g for g in range(7) for i in range(groups[g], groups[g + 1])}
    first = torch.cat(list(order.batches()))
    assert sorted(first.tolist()) == list(range(50))
    blocks = order.group_blocks(0)
    position = {g: k for k, b in enumerate(blocks) for g in b}
    # samples come block after block: a block's samples before the next block's
    seen = [position[shard_of[i]] for i in order.epoch_order(0).tolist()]
    assert seen == sorted(seen)
    again = BatchOrder(50, 6, shuffle=True, drop_last=False, seed=3, groups=groups,
                       group_block=2)
    assert torch.equal(torch.cat(list(again.batches())), first)
    second = torch.cat(list(order.batches()))
    assert not torch.equal(second, first)
    resumed = BatchOrder(50, 6, shuffle=True, drop_last=False, seed=3, groups=groups,
                         group_block=2)
    resumed.set_epoch(1, skip=4)
    assert torch.equal(torch.cat(list(resumed.batches())), second[24:])


# --- remote shards and the node-local cache ------------------------------------------------

@pytest.fixture
def shard_bucket(s3_server, s3_env, cache_dir, tmp_path, request) -> tuple[str, Path]:
    """The small dataset's shards, in a bucket and in a local folder."""
    name = f"sh-{request.node.name.lower().replace('_', '-')[:36]}-{os.getpid()}"
    s3_server.make_bucket(name)
    out = tmp_path / "local-shards"
    prepare_shards(str(out))
    s3_server.upload(out, name, "shards")
    return f"s3://{name}/shards", out


def test_remote_shards_give_the_local_batches_and_epoch_2_reads_the_cache(
        shard_bucket, delay_line):
    url, local = shard_bucket
    delay_line.set(rtt=0.01)
    figures: dict = {}
    remote = batches(f"dataset.path={url}", "loader.shuffle=true", epochs=2, figures=figures)
    assert_same(batches(f"dataset.path={local}", "loader.shuffle=true", epochs=2), remote)
    total = sum(f.stat().st_size for f in local.glob("*.tar"))
    # every shard fetched once, epoch 2 from the cache; the cold first block's samples
    # also read by range requests while its shards arrive (here the whole set is one block)
    assert total <= figures["remote_bytes"] <= 2 * total + 16 * 1024
    assert figures["cache_peak_bytes"] <= figures["cache_bound_bytes"]


def test_the_cache_never_passes_its_bound_and_loses_no_sample(shard_bucket, delay_line,
                                                              cache_dir):
    url, local = shard_bucket
    sizes = sorted(f.stat().st_size for f in local.glob("*.tar"))
    bound = sizes[-1] * 2 + 1000  # two shards: less than a block
    figures: dict = {}
    got = batches(f"dataset.path={url}", f"dataset.cache_bytes={bound}", "loader.shuffle=true",
                  epochs=2, figures=figures)
    assert sorted(torch.cat([b[0] for b in got]).tolist()) == sorted(list(range(60)) * 2)
    assert figures["cache_peak_bytes"] <= bound
    cached = [p for p in (cache_dir / "shards" / "remote").rglob("*.tar")]
    assert sum(p.stat().st_size for p in cached) <= bound
    assert not list((cache_dir / "shards" / "remote").rglob("*.partial.*"))


def test_eviction_drops_the_shard_needed_furthest_ahead(tmp_path):
    from runner.data.sources.shardcache import ShardCache

    cache = ShardCache(tmp_path / "c", bound=3000)
    for name in ("a.tar", "b.tar", "c.tar"):
        assert cache.fetch(name, 1000, lambda p: p.write_bytes(b"x" * 1000),
                           lambda f: 0, set()) is not None
    next_use = {"a.tar": 5, "b.tar": 1, "c.tar": 9, "d.tar": 0}
    cache.fetch("d.tar", 1000, lambda p: p.write_bytes(b"x" * 1000), next_use.get, set())
    assert sorted(p.name for p in (tmp_path / "c").glob("*.tar")) == \
        ["a.tar", "b.tar", "d.tar"]
    # nothing may go (all busy): no fetch, the caller reads around the cache
    assert cache.fetch("e.tar", 1000, lambda p: p.write_bytes(b"x" * 1000), next_use.get,
                       {"a.tar", "b.tar", "d.tar"}) is None


def _fetch_once(folder: str, counter: str) -> None:
    from runner.data.sources.shardcache import ShardCache

    def write(partial: Path) -> None:
        with open(counter, "a") as f:
            f.write("fetch\n")
        time.sleep(0.5)
        partial.write_bytes(b"y" * 5000)

    path = ShardCache(Path(folder), 10**6).fetch("s.tar", 5000, write, lambda f: 0, set())
    assert path is not None and path.read_bytes() == b"y" * 5000


def test_processes_on_one_node_share_one_copy(tmp_path):
    ctx = multiprocessing.get_context("fork")
    counter = tmp_path / "count"
    procs = [ctx.Process(target=_fetch_once, args=(str(tmp_path / "c"), str(counter)))
             for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert counter.read_text().count("fetch") == 1


def test_prepare_writes_shards_to_a_bucket_that_loader_shards_reads(s3_server, s3_env,
                                                                    cache_dir, delay_line):
    s3_server.make_bucket("written-shards")
    prepare_shards("s3://written-shards/set")
    client = s3_server.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="written-shards")["Contents"]]
    assert "set/manifest.json" in keys and any(k.endswith(".tar") for k in keys)
    body = client.get_object(Bucket="written-shards", Key=[k for k in keys
                                                           if k.endswith(".tar")][0])["Body"]
    with tarfile.open(fileobj=body, mode="r|") as tar:
        names = [m.name for m in tar]
    assert names[0].endswith(".jpg") and names[1].endswith(".cls")
    got = batches("dataset.path=s3://written-shards/set")
    assert sum(len(b[0]) for b in got) == 60


RUN = ["logger=none", "diagnose=false", "run.timeline=false", "run.progress=false",
       "run.warmup_steps=0", "loader=shards"]

def foreign_tars(folder: Path, parts: int = 2, per: int = 12, labelled=(True, True),
                 restart: bool = False) -> Path:
    """WebDataset tars written as another tool would: ``<key>.jpg`` and (when labelled)
    ``<key>.cls`` per sample, no manifest."""
    folder.mkdir(parents=True, exist_ok=True)
    for part in range(parts):
        with tarfile.open(folder / f"part-{part}.tar", "w") as tar:
            for k in range(per):
                key = f"s{k if restart else part * per + k:04d}"
                members = {f"{key}.jpg": encode(photo(48, 64, part * per + k))}
                if labelled[part]:
                    members[f"{key}.cls"] = str(k % 2).encode()
                for name, data in members.items():
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return folder

@pytest.mark.slow
def test_a_missing_index_is_made_again_from_its_tar(tmp_path, cache_dir, caplog):
    out = tmp_path / "shards"
    prepare_shards(str(out))
    manifest = json.loads((out / "manifest.json").read_text())
    (out / manifest["shards"][1]["index"]).unlink()
    with caplog.at_level(logging.WARNING):
        got = batches(f"dataset.path={out}", "loader.shuffle=false")
    assert sum(len(b[0]) for b in got) == 60
    said = [r.getMessage() for r in caplog.records if "indexed again" in r.getMessage()]
    assert len(said) == 1 and manifest["shards"][1]["index"] in said[0]

@pytest.mark.slow
def test_an_index_cut_short_is_made_again_from_its_tar(tmp_path, cache_dir, caplog):
    out = tmp_path / "shards"
    prepare_shards(str(out))
    manifest = json.loads((out / "manifest.json").read_text())
    index = out / manifest["shards"][0]["index"]
    index.write_text(index.read_text()[:100])
    with caplog.at_level(logging.WARNING):
        got = batches(f"dataset.path={out}", "loader.shuffle=false")
    assert sum(len(b[0]) for b in got) == 60
    assert any("cannot be read" in r.getMessage() for r in caplog.records)

@pytest.mark.slow
def test_a_missing_shard_is_one_line(tmp_path, cache_dir):
    from runner.data.sources.listing import DatasetError

    out = tmp_path / "shards"
    prepare_shards(str(out))
    manifest = json.loads((out / "manifest.json").read_text())
    (out / manifest["shards"][0]["index"]).unlink()
    (out / manifest["shards"][0]["name"]).unlink()
    with pytest.raises(DatasetError, match=manifest["shards"][0]["name"]) as refused:
        batches(f"dataset.path={out}")
    assert "\n" not in str(refused.value)

def test_training_on_shards_with_unlabelled_samples_is_refused_in_one_line(tmp_path,
                                                                            cache_dir):
    tars = foreign_tars(tmp_path / "tars", labelled=(True, False))
    with pytest.raises(ConfigError) as refused:
        run_in_process("task=train", *RUN, f"dataset.path={tars}", "loader.batch_size=8",
                       "dataset.image_size=[32,32]", "run.steps=3", run_dir=tmp_path / "run")
    message = str(refused.value)
    assert "\n" not in message and "12 of 24" in message and "task=infer" in message, message

def test_a_shard_copied_beside_itself_is_read_once_and_said(tmp_path, cache_dir, caplog):
    tars = foreign_tars(tmp_path / "tars")
    shutil.copy(tars / "part-0.tar", tars / "part-0-copy.tar")
    figures: dict = {}
    with caplog.at_level(logging.WARNING):
        got = batches(f"dataset.path={tars}", "loader.shuffle=false", figures=figures)
    indices = [i for b in got for i in b[0].tolist()]
    assert len(indices) == 24 == len(set(indices))
    said = [r.getMessage() for r in caplog.records if "repeat a key" in r.getMessage()]
    assert len(said) == 1 and "12 sample(s)" in said[0] and "part-0.tar" in said[0], said
    assert figures["shard_duplicates_skipped"] == 12
    from runner.measure.metrics import problems

    assert problems({"shard_duplicates_skipped": 12}) == []  # a metrics.json key declared

def test_tars_whose_keys_restart_in_each_are_not_copies(tmp_path, cache_dir, caplog):
    """cat.tar and dog.tar may both hold 0001.jpg: other bytes, so every sample is read."""
    tars = foreign_tars(tmp_path / "tars", restart=True)
    figures: dict = {}
    with caplog.at_level(logging.WARNING):
        got = batches(f"dataset.path={tars}", "loader.shuffle=false", figures=figures)
    assert sum(len(b[0]) for b in got) == 24
    assert not any("repeat a key" in r.getMessage() for r in caplog.records)
    assert figures.get("shard_duplicates_skipped", 0) == 0

@pytest.mark.slow
def test_a_tar_beside_a_manifest_that_does_not_list_it_is_named(tmp_path, cache_dir, caplog):
    out = tmp_path / "shards"
    prepare_shards(str(out))
    foreign_tars(tmp_path / "other", parts=1)
    shutil.copy(tmp_path / "other" / "part-0.tar", out / "extra.tar")
    with caplog.at_level(logging.WARNING):
        got = batches(f"dataset.path={out}", "loader.shuffle=false")
    assert sum(len(b[0]) for b in got) == 60
    said = [r.getMessage() for r in caplog.records if "extra.tar" in r.getMessage()]
    assert len(said) == 1 and "not read" in said[0], said

@pytest.mark.slow
def test_inference_rows_of_shards_made_of_a_folder_keep_the_source_names(tmp_path, cache_dir):
    import runner

    m = run_in_process("task=infer", *RUN, *SMALL, "run.epochs=1", run_dir=tmp_path / "run")
    assert m["status"] == "ok"
    with open(tmp_path / "run" / "predictions.csv", newline="", encoding="utf-8") as f:
        files = [row["file"] for row in csv.DictReader(f)]
    folder = runner.pipeline(*SMALL, loader="folder")
    try:
        names = {folder.storage.name_of(i) for i in range(len(folder.storage))}
    finally:
        folder.close()
    assert len(files) == 60 and set(files) == names, files[:3]
    shards = runner.pipeline(*SMALL, loader="shards")
    try:
        assert set(shards.storage.names()) == names  # FolderStorage.names() still answers
    finally:
        shards.close()

def test_files_a_conversion_to_shards_skipped_are_in_skipped_files(tmp_path, cache_dir,
                                                                    caplog):
    files = {f"{'ab'[k % 2]}/{k:02d}.jpg": encode(photo(40, 52, k)) for k in range(12)}
    files["a/04.jpg"] = b"\xff\xd8\xff not really a JPEG"
    data = make_tree(tmp_path / "data", files)
    with caplog.at_level(logging.WARNING):
        m = run_in_process("task=infer", *RUN, f"dataset.path={data}", "run.epochs=1",
                           "dataset.image_size=[32,32]", "loader.batch_size=4",
                           run_dir=tmp_path / "run")
    assert m["status"] == "ok" and m["predictions"] == 11
    assert [Path(p).name for p in m["skipped_files"]] == ["04.jpg"], m["skipped_files"]
    said = [r.getMessage() for r in caplog.records if "not in the shards" in r.getMessage()]
    assert len(said) == 1 and "04.jpg" in said[0] and "manifest.json" in said[0], said

def test_a_tar_cut_short_is_read_as_far_as_it_goes(tmp_path, cache_dir, caplog):
    tars = foreign_tars(tmp_path / "tars")
    raw = (tars / "part-1.tar").read_bytes()
    (tars / "part-1.tar").write_bytes(raw[: len(raw) // 2])  # mid-member
    import runner

    with caplog.at_level(logging.WARNING):
        pipe = runner.pipeline(*SMALL, f"dataset.path={tars}", loader="shards")
        try:
            read = sum(len(b["label"]) for b in pipe)
            skipped = pipe.data.skipped
        finally:
            pipe.close()
    assert 12 <= read < 24 and len(skipped) <= 1
    assert any("cut short" in r.getMessage() for r in caplog.records)

def test_a_shard_set_in_a_bucket_with_an_index_missing_is_read(s3_server, s3_env, cache_dir,
                                                               tmp_path, caplog):
    out = tmp_path / "shards"
    prepare_shards(str(out))
    manifest = json.loads((out / "manifest.json").read_text())
    (out / manifest["shards"][1]["index"]).unlink()
    s3_server.make_bucket("lost-index")
    s3_server.upload(out, "lost-index", "shards")
    with caplog.at_level(logging.WARNING):
        got = batches("dataset.path=s3://lost-index/shards", "loader.shuffle=false")
    assert sum(len(b[0]) for b in got) == 60
    said = [r.getMessage() for r in caplog.records if "indexed again" in r.getMessage()]
    assert len(said) == 1 and manifest["shards"][1]["index"] in said[0], said


# --- detection: each sample's boxes beside its image --------------------------------------

def detection_set(tmp_path: Path) -> tuple[Path, list[str]]:
    """A small shapes set (YOLO labels) and the overrides that read it with its boxes."""
    from runner.data.sources.shapes import ShapesSpec, ensure_shapes

    shapes = ensure_shapes(ShapesSpec(num_images=24, seed=5), tmp_path / "shapes", progress=False)
    return shapes, ["dataset.targets=yolo", f"dataset.path={shapes}", "model=none",
                    "logger=none", "dataset.image_size=[96,96]", "loader.batch_size=6",
                    "loader.num_workers=0", "loader.shuffle=false", "run.progress=false"]


def box_batches(overrides: list[str], loader: str) -> dict[int, tuple[torch.Tensor, ...]]:
    """Every image's (pixels, boxes, labels) as the pipeline delivers them, by index."""
    import runner

    pipe = runner.pipeline(*overrides, loader=loader)
    try:
        return {int(i): (b["image"][r].clone(), b["boxes"][r, :n].clone(),
                         b["box_labels"][r, :n].clone())
                for b in pipe
                for r, (i, n) in enumerate(zip(b["index"], b["box_count"].tolist()))}
    finally:
        pipe.close()


@pytest.mark.parametrize("crop", ["center", "random"])
def test_detection_shards_carry_the_packed_boxes_through_the_same_crops(tmp_path, cache_dir,
                                                                        crop):
    """prepare shards of a detection set writes each sample's boxes as <key>.json right after
    its JPEG; loader=shards reads them with it and crops them as packed does (the same
    batches, pixels and boxes), and each sample's boxes equal torchvision v2's on the
    window its stored JPEG was cut from (centre and random crops, flips among them)."""
    from runner.data.decode.boxgeometry import Window
    from runner.data.sources.labels import ImageTargets
    from runner.data.storage.packed import open_packed
    from runner.data.storage.shards import open_shards
    from runner.job.compose import compose
    from runner.prepare import main
    from tests.data.decode.test_boxgeometry import assert_same as same_boxes
    from tests.data.decode.test_boxgeometry import torchvision_boxes

    shapes, base = detection_set(tmp_path)
    base = [*base, f"dataset.crop={crop}", "loader.drop_last=false"]  # every image
    out = tmp_path / "written"
    assert main(["shards", *base, f"out={out}", "shard_mb=0.05"]) == 0
    with tarfile.open(sorted(out.glob("*.tar"))[0]) as tar:
        names = tar.getnames()
        entry = json.loads(tar.extractfile(names[1]).read())
    key = names[0].removesuffix(".jpg")
    assert names[:3] == [f"{key}.jpg", f"{key}.json", f"{key}.cls"]
    config = compose(base)
    packed = open_packed(config.loader, config.dataset, shapes, progress=False)
    shards = open_shards(config.loader, config.dataset, out, progress=False)
    try:
        stored = packed.targets[int(key)]
        assert torch.equal(torch.tensor(entry["boxes"]), stored.boxes)
        assert entry["labels"] == stored.labels.tolist()
        flips = 0
        for index in range(len(packed)):
            seed = 77 + index
            got = {name: store[(index, seed)] for name, store in (("packed", packed),
                                                                    ("shards", shards))}
            assert torch.equal(got["packed"].image, got["shards"].image)
            assert torch.equal(got["packed"].boxes, got["shards"].boxes)
            assert torch.equal(got["packed"].box_labels, got["shards"].box_labels)
            _, window, flip, _ = shards.decode.image_decoder.decode_window(
                bytearray(shards.read(index)), seed)
            target: ImageTargets = shards.targets[index]
            hw = (shards.heights[index], shards.widths[index])
            assert (target.height, target.width) == hw
            same_boxes((got["shards"].boxes, got["shards"].box_labels),
                       torchvision_boxes(target.boxes, target.labels, hw, Window(*window),
                                         (96, 96), flip))
            flips += flip
        assert crop == "center" or 0 < flips < len(packed)
    finally:
        packed.close()
        shards.close()
    # the pipeline's batches (the decode threads' batch path): shards give packed's
    from_packed = box_batches(base, "packed")
    from_shards = box_batches([*base, f"dataset.path={out}"], "shards")
    assert from_packed.keys() == from_shards.keys() and len(from_packed) == 19
    assert sum(len(v[2]) for v in from_shards.values()) > 10
    for index, (image, boxes, labels) in from_packed.items():
        assert torch.equal(image, from_shards[index][0])
        assert torch.equal(boxes, from_shards[index][1])
        assert torch.equal(labels, from_shards[index][2])


def test_detection_shards_read_a_samples_image_and_boxes_in_one_pread(tmp_path, cache_dir,
                                                                      monkeypatch):
    from runner.data.storage import shards as module
    from runner.data.storage.shards import open_shards
    from runner.job.compose import compose

    _, base = detection_set(tmp_path)
    config = compose(base)
    storage = open_shards(config.loader, config.dataset, config.dataset.path, progress=False)
    reads = []
    real = module.LocalShards.read

    def counted(self, shard, offset, size, index):
        reads.append((offset, size, index))
        return real(self, shard, offset, size, index)

    monkeypatch.setattr(module.LocalShards, "read", counted)
    try:
        out = torch.empty((len(storage), 3, 96, 96), dtype=torch.uint8)
        items = storage.decode_slice(out, range(len(storage)), list(range(len(storage))))
    finally:
        storage.close()
    assert len(items) == len(reads) == 19 and all(i.boxes is not None for i in items)
    for offset, size, index in reads:  # the JPEG and its boxes member, in one read
        assert offset == storage.offsets[index]
        assert offset + size == storage.box_offsets[index] + storage.box_sizes[index]


def test_a_shard_set_without_boxes_under_dataset_targets_is_one_clear_error(tmp_path,
                                                                            cache_dir):
    from runner.data.sources.listing import DatasetError
    from runner.data.storage.shards import open_shards
    from runner.job.compose import compose

    out = tmp_path / "shards"
    prepare_shards(str(out))  # a classification set: no boxes
    config = compose([*SMALL, "dataset.targets=yolo", f"dataset.path={out}", "loader=shards"])
    with pytest.raises(DatasetError, match=r"hold no boxes \(no <key>\.json member.*"
                                           r"prepare shards dataset\.targets=yolo"):
        open_shards(config.loader, config.dataset, out, progress=False)
    tars = foreign_tars(tmp_path / "tars")  # nor does a tar set someone else wrote
    with pytest.raises(DatasetError, match="hold no boxes"):
        open_shards(config.loader, config.dataset, tars, progress=False)


def test_a_detection_samples_missing_or_broken_boxes_member_is_a_counted_skip(tmp_path,
                                                                             cache_dir, caplog):
    """A tar someone else wrote, with <key>.json boxes: read; a sample whose member is not
    boxes, or missing, is skipped and counted with its name, never a crash."""
    import runner

    folder = tmp_path / "tars"
    folder.mkdir()
    with tarfile.open(folder / "part-0.tar", "w") as tar:
        for k in range(8):
            members = {f"s{k:04d}.jpg": encode(photo(48, 64, k))}
            if k == 3:
                members[f"s{k:04d}.json"] = b'{"captions": "a cat"}'
            elif k != 5:
                members[f"s{k:04d}.json"] = json.dumps(
                    {"boxes": [[4.0, 6.0, 30.0, 40.0]], "labels": [k % 2]}).encode()
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    pipe = runner.pipeline(*SMALL, f"dataset.path={folder}", "dataset.targets=yolo",
                           "model=none", "dataset.crop_fraction=1.0", loader="shards")
    try:
        with caplog.at_level(logging.WARNING):
            got = [(b["index"].tolist(), b["box_count"].tolist()) for b in pipe]
        skipped = pipe.data.skipped
    finally:
        pipe.close()
    indexes = [i for b in got for i in b[0]]
    assert sorted(indexes) == [0, 1, 2, 4, 6, 7]
    assert all(n == 1 for b in got for n in b[1])
    assert sorted(s.rsplit("/", 1)[-1] for s in skipped) == ["s0003", "s0005"]
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "s0003.json is not boxes" in said and "s0005.json is missing" in said


def test_detection_shards_in_a_bucket_give_the_local_boxes(s3_server, s3_env, cache_dir,
                                                           delay_line, tmp_path):
    """prepare shards of a detection set to a bucket; loader=shards over the URL reads each
    sample's boxes with its JPEG (the same ranges), as the local shards give them."""
    from runner.prepare import main

    _, base = detection_set(tmp_path)
    s3_server.make_bucket("boxes")
    assert main(["shards", *base, "out=s3://boxes/set", "shard_mb=0.05"]) == 0
    local = box_batches(base, "shards")
    remote = box_batches([*base, "dataset.path=s3://boxes/set"], "shards")
    assert local.keys() == remote.keys() and len(local) == 19
    for index, (image, boxes, labels) in local.items():
        assert torch.equal(image, remote[index][0])
        assert torch.equal(boxes, remote[index][1])
        assert torch.equal(labels, remote[index][2])
