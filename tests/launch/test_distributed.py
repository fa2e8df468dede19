"""torchrun / DDP on CPU (gloo, 2 processes), and the SLURM launcher preset."""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runner.config.schema import Decoder, LoaderConfig, OnCorrupt, StorageName
from runner.data.decode.decoders import ImageDecoder
from runner.data.loading.loader import BatchStream
from runner.data.order import BatchOrder
from runner.data.storage.convert import ensure_cache
from runner.data.storage.decoded import DecodedStorage
from runner.data.storage.folder import FolderStorage
from runner.data.storage.memmap import MemmapSpec
from tests.conftest import (
    REPO,
    SMALL_DATASET,
    encode,
    make_loader,
    make_tree,
    photo,
    read_metrics,
    run_cli,
    sitecustomize,
)


@pytest.mark.parametrize(("size", "world", "batch"), [(10, 2, 4), (9, 2, 4), (61, 2, 8),
                                                      (7, 3, 2), (5, 4, 8), (64, 2, 8)])
def test_shards_cover_each_epoch_once_with_equal_steps(size: int, world: int, batch: int):
    orders = [BatchOrder(size, batch, shuffle=True, drop_last=False, seed=3, rank=r,
                         world=world)
              for r in range(world)]
    assert len({len(o) for o in orders}) == 1  # every rank runs the same number of steps
    for _ in range(3):  # epochs: reshuffled, and still an exact cover each time
        shards = [[b.tolist() for b in o.batches()] for o in orders]
        assert len({len(s) for s in shards}) == 1
        assert all(len(b) > 0 for s in shards for b in s)  # never an empty batch
        valid = [i for s in shards for b in s for i in b if i >= 0]
        assert sorted(valid) == list(range(size))  # each index once, on one rank
        padding = [i for s in shards for b in s for i in b if i < 0]
        assert len(padding) == -(-size // world) * world - size


def test_padding_rows_are_marked_not_counted(tmp_path: Path):
    images = torch.arange(9, dtype=torch.uint8).view(9, 1, 1, 1).expand(9, 3, 2, 2).clone()
    storage = DecodedStorage(images, torch.arange(9), skipped=[], classes=["c"],
                             names=[str(i) for i in range(9)], root=None)
    cfg = LoaderConfig(name=StorageName.memmap, batch_size=4, num_workers=0, batched=True)
    seen = []
    for rank in (0, 1):
        for batch in BatchStream(make_loader(storage, cfg, 0, False, rank, 2), 1):
            valid = batch["valid"] if "valid" in batch.keys() else torch.ones(len(batch), dtype=torch.bool)
            seen += batch["index"][valid].tolist()
            assert torch.equal(batch["image"][:, 0, 0, 0].long(), batch["index"])  # real pixels
    assert sorted(seen) == list(range(9))
    files = {f"c/{k}.jpg": encode(photo(16, 16, index=k)) for k in range(5)}
    folder = FolderStorage(make_tree(tmp_path / "f", files), ImageDecoder(Decoder.pil, (8, 8)),
                           OnCorrupt.skip)
    folder_cfg = LoaderConfig(name=StorageName.folder, batch_size=4, num_workers=0)
    last = list(BatchStream(make_loader(folder, folder_cfg, 0, False, 1, 2), 1))[-1]
    # 5 images, 2 ranks: 3 rows each, and rank 1's third row is a pad
    assert len(last["valid"]) == 3 and int(last["valid"].sum()) == 2


def torchrun(*overrides: str, cwd: Path, nproc: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_SILENT": "true",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
         "--standalone", "-m", "runner", *overrides],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


UNEVEN = [o for o in SMALL_DATASET if not o.startswith("dataset.num_images")]
UNEVEN.append("dataset.num_images=61")  # 61 images, 2 ranks, batch 8: a padded last batch


@pytest.mark.process
@pytest.mark.ranks
@pytest.mark.slow
@pytest.mark.parametrize("loader", ["folder", "packed", "dali"])
def test_two_ranks_infer_every_image_exactly_once(tmp_path: Path, cache_dir: Path, loader: str):
    if loader == "dali":  # DALI's own shards; its fill rows are marked not valid
        pytest.importorskip("nvidia.dali", reason="loader=dali needs: pip install -e '.[dali]'")
    torchrun(*UNEVEN, "task=infer", "logger=none", "diagnose=false", "hydra.run.dir=run",
             f"loader={loader}", cwd=tmp_path)
    m = read_metrics(tmp_path / "run")
    assert m["status"] == "ok" and m["distributed"]["world"] == 2
    assert m["distributed"]["backend"] == "gloo"
    # the runner's shards are 31 and 30 images, DALI's 30 and 31: each image once
    assert sorted(r["images"] for r in m["distributed"]["ranks"]) == [30, 31]
    with open(tmp_path / "run" / "predictions.csv") as f:
        indices = [int(r["index"]) for r in csv.DictReader(f)]
    assert sorted(indices) == list(range(61))  # merged from both ranks, no overlap
    assert not list((tmp_path / "run").glob("*.rank*.csv"))


@pytest.mark.process
@pytest.mark.ranks
@pytest.mark.slow
def test_two_ranks_train_in_sync_and_only_rank_0_writes(tmp_path: Path, cache_dir: Path):
    proc = torchrun(*UNEVEN, "loader=memmap", "run.epochs=2", "diagnose=false",
                    "hydra.run.dir=run", cwd=tmp_path)
    m = read_metrics(tmp_path / "run")
    assert m["status"] == "ok" and m["distributed"]["replicas_in_sync"] is True
    assert m["images"] == 2 * (61 // 16) * 16  # whole global batches of 2 x 8, each once
    assert m["images_per_sec"] > 0 and m["loss_last"] is not None
    written = sorted(p.name for p in tmp_path.iterdir() if p != cache_dir)
    assert written == ["run"]  # nothing from rank 1 here
    assert len(glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*"))) == 1
    output = proc.stdout + proc.stderr
    assert output.count("memmap store ready") == 1  # built once, by the local main rank

    second = torchrun(*UNEVEN, "loader=memmap", "run.steps=2", "logger=none",
                      "diagnose=false", "hydra.run.dir=again", cwd=tmp_path)
    assert "memmap store ready" not in second.stdout + second.stderr  # reused
    assert read_metrics(tmp_path / "again")["status"] == "ok"


@pytest.mark.process
@pytest.mark.ranks
@pytest.mark.slow
def test_a_sweep_under_torchrun_joins_and_leaves_a_group_per_job(tmp_path: Path,
                                                                 cache_dir: Path):
    # consecutive groups on one rendezvous store: each job must not see the last one's keys
    torchrun("-m", *SMALL_DATASET, "model=none", "logger=none", "diagnose=false",
             "run.steps=3", "loader=folder,memmap,ram", "hydra.sweep.dir=sweep", cwd=tmp_path)
    jobs = sorted(glob.glob(str(tmp_path / "sweep" / "*" / "metrics.json")))
    assert len(jobs) == 3
    assert all(read_metrics(Path(j).parent)["status"] == "ok" for j in jobs)


def test_the_slurm_launcher_preset_composes():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra import compose, initialize_config_dir

    from runner.config.schema import config_dir
    from runner.job.commandline import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu",
                                           "hydra.launcher.tasks_per_node=4"],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.partition, launcher.tasks_per_node, launcher.gpus_per_node) == ("gpu", 4, 1)
    assert launcher.submitit_folder.endswith("/.submitit/%j")


# 61 images, 3 classes; a fifth held out for validation (12 images: 2 ranks x batch 8 pad)
EQUAL = [o for o in SMALL_DATASET if not o.startswith("dataset.num_images")] + [
    "dataset.num_images=61", "dataset.val_fraction=0.2", "logger=none"]

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def _equal_counts_rank(rank: int, world: int, port: int, cache: str, out: str) -> None:
    os.environ["RUNNER_CACHE"] = cache
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        from runner.config.schema import AmpConfig, AmpName
        from runner.data import build_data_path
        from runner.job.compose import compose
        from runner.launch.distributed import Ranks
        from runner.model.networks import build_model
        from runner.tasks.train.validation import Validation

        config = compose(EQUAL)
        ranks, cpu = Ranks(rank, world, rank), torch.device("cpu")
        data = build_data_path(config, cpu, ranks, epochs=1, progress=False)
        train = [(b["index"].tolist(), "valid" in b.keys()) for b in data.device_batches()]
        torch.manual_seed(0)  # the same weights on every rank and in the one-process check
        model = build_model(config.model, len(data.classes), cpu, train=False)
        amp = AmpConfig(AmpName.off)
        shared = Validation.for_run(config, model, amp, cpu, data.classes, False, ranks)
        alone = Validation.for_run(config, model, amp, cpu, data.classes, False)
        val_batches = sum(1 for _ in shared.data.device_batches())
        figures, reference = shared(), alone()
        torch.save({"train": train, "len": len(data.stream), "val_batches": val_batches,
                    "val": figures, "reference": reference,
                    "images": len(data.storage), "val_images": len(alone.data.storage)},
                   f"{out}.{rank}")
    finally:
        dist.destroy_process_group()

@pytest.mark.process
@pytest.mark.ranks
def test_every_rank_gets_the_same_whole_batches_and_validation_counts_each_image_once(
        tmp_path: Path, private_cache: Path):
    from runner.data.storage import resolve_dataset
    from runner.job.compose import compose

    resolve_dataset(compose(EQUAL).dataset, progress=False)  # made once, before the ranks
    out = str(tmp_path / "ranks")
    mp.spawn(_equal_counts_rank, args=(2, free_port(), str(private_cache), out), nprocs=2)
    got = [torch.load(f"{out}.{r}", weights_only=False) for r in (0, 1)]
    images, global_batch = got[0]["images"], 2 * 8
    steps = images // global_batch  # training drops what is left after whole global batches
    for g in got:
        assert len(g["train"]) == g["len"] == steps  # the same count on both ranks
        assert all(len(index) == 8 and not padded for index, padded in g["train"])
    seen = [i for g in got for index, _ in g["train"] for i in index]
    assert len(seen) == len(set(seen)) == steps * global_batch  # no image on two ranks
    # validation: each rank reads its half (padded to equal batches), the sums all-reduced
    val_images = got[0]["val_images"]
    per_rank = math.ceil(val_images / 2)
    assert got[0]["val_batches"] == got[1]["val_batches"] == math.ceil(per_rank / 8)
    for g in got:  # each image once: the same figures as one process scoring them all
        assert g["val"] == pytest.approx(g["reference"], abs=1e-9)
    print(f"\n{images} training images, 2 ranks x batch 8: {steps} whole batches per rank; "
          f"{val_images} validation images: {got[0]['val_batches']} batch(es) per rank")

ELASTIC = [o for o in SMALL_DATASET if not o.startswith(("dataset.num_images", "loader.batch"))] \
    + ["dataset.num_images=44", "loader.batch_size=2", "loader=memmap", "dataset.crop=random",
       # no batch norm: its statistics are each rank's own, so its weights would depend on
       # the world size (the module docstring of runner/tasks/checkpoint.py says so)
       "model=custom", "model.target=tests.nets:TwoLayer", "run.epochs=2", "logger=none",
       "diagnose=false", "run.timeline=false"]  # 44 images, global batch 8: 5 steps an epoch

def torchrun_command(nproc: int, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            "--standalone", "-m", "runner", *ELASTIC, *overrides]

def torchrun_ranks(tmp_path: Path, env: dict, nproc: int, *overrides: str) -> str:
    proc = subprocess.run(torchrun_command(nproc, *overrides), cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    return proc.stdout + proc.stderr

def global_steps(tmp_path: Path, record: str, world: int) -> list[tuple[list[int], int]]:
    """Each global step: the images every rank read (sorted) and their pixels' checksum."""

    ranks = [[json.loads(line) for line in (tmp_path / f"{record}.{r}").read_text().splitlines()]
             for r in range(world)]
    assert len({len(r) for r in ranks}) == 1  # every rank ran the same steps
    return [(sorted(i for r in step for i in r[0]), sum(r[1] for r in step))
            for step in zip(*ranks)]

@pytest.mark.process
@pytest.mark.ranks
@pytest.mark.slow
def test_four_ranks_stopped_and_resumed_on_two_read_what_two_ranks_read_straight(
        tmp_path: Path, cache_dir: Path):
    from runner.job.compose import compose
    from runner.tasks.checkpoint import GlobalBatchError, fit_world, load
    from tests.conftest import read_metrics, sitecustomize
    from tests.tasks.test_checkpoint import RECORDING

    env = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1",
           **sitecustomize(tmp_path / "inject", RECORDING)}
    straight = {**env, "RECORD": str(tmp_path / "straight"), "STOP_AT": "-1"}
    torchrun_ranks(tmp_path, straight, 2, "loader.batch_size=4", "hydra.run.dir=straight")
    # 4 ranks, stopped by a real SIGTERM to torchrun (as SLURM's preemption sends it) once
    # rank 0 is into the second epoch; the ranks agree on the step they stop at
    first = {**env, "RECORD": str(tmp_path / "first"), "STOP_AT": "-1", "SLEEP": "0.3"}
    proc = subprocess.Popen(torchrun_command(4, "resume=auto", "hydra.run.dir=run",
                                             "run.log_every=1"),  # ranks agree each step
                            cwd=tmp_path, env=first, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    record = tmp_path / "first.0"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None and (
            not record.exists() or len(record.read_text().splitlines()) < 6):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    assert read_metrics(tmp_path / "run")["status"] == "interrupted"
    stop = len(global_steps(tmp_path, "first", 4))  # every rank stopped at this one step
    assert 5 < stop < 10  # in the second epoch (5 global steps an epoch)
    # the same command on 2 ranks: loader.batch_size=2 is scaled to 4, said in the log
    second = {**env, "RECORD": str(tmp_path / "second"), "STOP_AT": "-1"}
    out = torchrun_ranks(tmp_path, second, 2, "resume=auto", "hydra.run.dir=run")
    assert "loader.batch_size 2 -> 4 per rank keeps the global batch of 8" in out
    m = read_metrics(tmp_path / "run")
    assert m["status"] == "ok" and m["start_step"] == stop, out[-3000:]

    want = global_steps(tmp_path, "straight", 2)
    got = global_steps(tmp_path, "first", 4) + global_steps(tmp_path, "second", 2)
    assert len(want) == len(got) == 10  # 2 epochs of 44 // 8 = 5 global steps
    assert got == want  # the same images (and crops) at every step: none replayed, none skipped
    for epoch in (0, 1):
        seen = [i for index, _ in got[5 * epoch : 5 * epoch + 5] for i in index]
        assert len(seen) == len(set(seen)) == 40  # 40 distinct images, 4 dropped
    resumed = load(tmp_path / "run" / "checkpoint.pt")
    reference = load(tmp_path / "straight" / "checkpoint.pt")
    assert resumed["world"] == 2 and resumed["steps"] == reference["steps"] == 10
    for key, value in reference["model"].items():
        torch.testing.assert_close(resumed["model"][key], value, atol=1e-5, rtol=1e-4)
    print(f"\n4 ranks x 2 stopped by SIGTERM at step {stop}, resumed on 2 ranks x 4: {len(got)} global "
          f"steps, {sum(len(i) for i, _ in got)} samples, identical to 2 ranks straight")

    # 3 ranks cannot share a global batch of 8: refused, naming the sizes that would
    config = compose([*ELASTIC, "resume=auto"])
    with pytest.raises(GlobalBatchError, match=r"run on 1 \(loader.batch_size=8\), 2 \("
                                               r"loader.batch_size=4\), 4 .*, 8 .* rank"):
        fit_world(resumed, config, 3, "run")

GROUPS = [0, 7, 15, 20, 31, 40, 44, 50, 58, 66, 71]  # 10 shards of 4 to 11 samples

def lane_orders(world: int, batch: int, **kw) -> list:
    from runner.data.order import BatchOrder

    return [BatchOrder(71, batch, seed=5, rank=r, world=world, groups=GROUPS, group_block=2,
                       lanes=2, **kw) for r in range(world)]

def test_lanes_give_each_node_its_own_shards_and_every_world_size_the_same_steps():
    from runner.data.order import split_padding

    shard_of = {i: g for g in range(10) for i in range(GROUPS[g], GROUPS[g + 1])}
    four = lane_orders(4, 3, shuffle=True, drop_last=True)  # 2 nodes x 2 ranks, global 12
    two = lane_orders(2, 6, shuffle=True, drop_last=True)  # 2 nodes x 1 rank, global 12
    assert len({len(o) for o in four + two}) == 1 and len(four[0]) > 0
    for epoch in range(3):
        steps = [[b.tolist() for b in o.batches()] for o in four]
        assert len({len(s) for s in steps}) == 1  # the same count on every rank
        by_node = [{shard_of[i] for r in (2 * n, 2 * n + 1) for b in steps[r] for i in b}
                   for n in (0, 1)]
        assert not by_node[0] & by_node[1]  # each shard read by one node alone
        seen = [i for s in steps for b in s for i in b]
        assert len(seen) == len(set(seen)) and min(seen) >= 0  # none twice, no padding
        # the same global batches on 2 ranks of 6 (an elastic resume reads these)
        other = [[b.tolist() for b in o.batches()] for o in two]
        for k in range(len(steps[0])):
            assert sorted(i for s in steps for i in s[k]) == sorted(i for s in other for i in s[k])
        blocks = four[0].group_blocks(epoch)  # what node 0 fetches ahead: its own shards
        assert {g for b in blocks for g in b} >= by_node[0] and not \
            {g for b in blocks for g in b} & by_node[1]
    # inference: every sample exactly once, short lanes padded and masked
    infer = lane_orders(4, 3, shuffle=False, drop_last=False)
    rows = [list(o.batches()) for o in infer]
    assert len({len(r) for r in rows}) == 1
    valid = [i for r in rows for b in r for i in split_padding(b)[0][b >= 0].tolist()]
    assert sorted(valid) == list(range(71))

NODES = ["dataset.image_size=[48,48]", "loader=shards", "loader.num_workers=0",
         "loader.batch_size=2", "run.warmup_steps=1", "run.progress=false", "logger=none",
         "diagnose=false", "run.timeline=false"]

def two_nodes(tmp_path: Path, s3_env: dict, *overrides: str, ranks: int = 2) -> list[str]:
    """One run as two torchrun 'nodes' of ``ranks`` ranks on loopback (a c10d rendezvous),
    each with its own cache folder; their output."""
    import subprocess
    import sys

    from tests.conftest import REPO

    port, procs = free_port(), []
    for node in (0, 1):
        folder = tmp_path / f"node{node}"
        folder.mkdir(exist_ok=True)
        env = {**os.environ, **s3_env, "RUNNER_CACHE": str(folder / "cache"),
               "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "PYTHONPATH": str(REPO)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
             f"--nproc_per_node={ranks}", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
             "--rdzv_id=nodes", "-m", "runner", *NODES, *overrides],
            cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    return outs

@pytest.mark.process
@pytest.mark.ranks
@pytest.mark.slow
def test_two_nodes_each_fetch_their_share_of_a_bucket_and_train_in_step(
        tmp_path: Path, s3_server, s3_env, delay_line, cache_dir: Path):
    import csv

    from runner.data.order import BatchOrder
    from runner.prepare import main
    from tests.conftest import read_metrics

    out = tmp_path / "shards"
    assert main(["shards", "dataset.num_images=64", "dataset.num_classes=4",
                 "dataset.source_size=[96,128]", "dataset.image_size=[48,48]", f"out={out}",
                 "shard_mb=0.03"]) == 0
    bucket = f"nodes-{os.getpid()}"
    s3_server.make_bucket(bucket)
    s3_server.upload(out, bucket, "shards")
    meta = json.loads((out / "manifest.json").read_text())
    sizes = [s["bytes"] for s in meta["shards"]]
    groups = [0]
    for s in meta["shards"]:
        groups.append(groups[-1] + s["count"])
    delay_line.set(rtt=0.005)
    url = f"dataset.path=s3://{bucket}/shards"

    two_nodes(tmp_path, s3_env, url, "run.epochs=1", "task.checkpoint=false",
              f"hydra.run.dir={tmp_path / 'train'}")
    m = read_metrics(tmp_path / "train")
    ranks = m["distributed"]["ranks"]
    assert m["status"] == "ok" and m["distributed"]["world"] == 4
    assert m["distributed"]["replicas_in_sync"] is True  # identical weights on every rank
    # what each node's ranks read in epoch 0: their lanes' shards (slots 2n and 2n + 1)
    orders = [BatchOrder(groups[-1], 2, shuffle=True, drop_last=True, seed=0, rank=slot,
                         world=4, groups=groups, group_block=4, lanes=2) for slot in (0, 2)]
    assert len({r["steps"] for r in ranks}) == 1 and ranks[0]["steps"] == len(orders[0])
    share = [sum(sizes[g] for b in o.group_blocks(0) for g in b) for o in orders]
    fetched = [a - b for a, b in zip(m["distributed"]["remote_bytes_per_node"],
                                     m["distributed"]["remote_index_bytes_per_node"])]
    total = sum(sizes)
    print(f"\nbytes of shards fetched per node: {fetched} (their lanes' shards: {share}; the "
          f"whole set {total}: {[round(f / total, 3) for f in fetched]} of it each; plus "
          f"indexes {m['distributed']['remote_index_bytes_per_node']}); "
          f"{ranks[0]['steps']} steps on every rank")
    for node in (0, 1):  # one fetch per shard (and index) per node, none of the other node's
        assert fetched[node] <= 1.05 * share[node]
        assert share[node] <= 0.6 * total
        index_bytes = m["distributed"]["remote_index_bytes_per_node"][node]
        assert index_bytes <= 1.05 * sum(p.stat().st_size for p in out.glob("*.idx.json"))
        cached = list((tmp_path / f"node{node}" / "cache").rglob("*.tar"))
        assert sum(p.stat().st_size for p in cached) <= 1.05 * share[node]

    two_nodes(tmp_path, s3_env, url, "task=infer", f"hydra.run.dir={tmp_path / 'infer'}",
              ranks=1)  # (one rank a node: each node's lanes, padded and masked)
    with open(tmp_path / "infer" / "predictions.csv") as f:
        indices = [int(r["index"]) for r in csv.DictReader(f)]
    assert sorted(indices) == list(range(groups[-1]))  # every image once, over both nodes

def test_a_resume_keeps_the_lanes_its_order_was_dealt_to(monkeypatch):
    from runner.job.compose import compose
    from runner.tasks.checkpoint import GlobalBatchError, fit_world

    for key in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(key, raising=False)
    # written on 2 nodes x 2 ranks, batch 2: lanes unset, so one per node
    state = {"config": {"loader": {"batch_size": 2, "lanes": None}}, "world": 4, "nodes": 2}
    config = compose(["loader=shards", "loader.batch_size=2"])
    fit_world(state, config, 2, "ckpt")  # resumed on one node of 2 ranks
    assert (config.loader.lanes, config.loader.batch_size) == (2, 4)
    with pytest.raises(GlobalBatchError, match="loader.lanes=4, the checkpoint's order was "
                                               "dealt to 2 lanes"):
        fit_world(state, compose(["loader=shards", "loader.batch_size=2", "loader.lanes=4"]),
                  2, "ckpt")

def test_a_resume_whose_epochs_hold_other_steps_is_refused_naming_drop_last():
    from runner.tasks.checkpoint import GlobalBatchError, check_epoch_length

    check_epoch_length({"steps_per_epoch": 7}, 7, "ckpt")  # the same: goes on
    # one process kept a last short batch (8 steps), two ranks drop it (7)
    with pytest.raises(GlobalBatchError, match="epochs were 8 steps, this run's are 7 .* "
                                               "loader.drop_last=true"):
        check_epoch_length({"steps_per_epoch": 8}, 7, "ckpt")


SIZE = (24, 32)

def folder_of(root: Path, on_corrupt: OnCorrupt = OnCorrupt.skip) -> FolderStorage:
    return FolderStorage(root, ImageDecoder(Decoder.simplejpeg, SIZE), on_corrupt)

def spec_for(root: Path) -> MemmapSpec:
    return MemmapSpec(root.resolve(), SIZE, "simplejpeg", False)

def build(root: Path, cache: Path, on_corrupt: OnCorrupt = OnCorrupt.skip):
    return ensure_cache(folder_of(root, on_corrupt), spec_for(root), cache, progress=False)

@pytest.mark.process
@pytest.mark.ranks
@pytest.mark.slow
def test_under_torchrun_rank_0_reports_the_failing_ranks_error(tmp_path: Path,
                                                              cache_dir: Path):
    run_cli(*SMALL_DATASET, "model=none", "logger=none", "run.steps=1", "hydra.run.dir=warm",
            cwd=tmp_path)
    env = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    env.update(sitecustomize(tmp_path / "inject", """
        import os
        if os.environ.get("RANK") == "1":
            import runner.tasks.train.training
            def broken(self, *args):
                raise ValueError("rank one cannot build its model")
            runner.tasks.train.training.TrainTask.build = broken
    """))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
         "-m", "runner", *SMALL_DATASET, "model=tiny", "logger=none", "diagnose=false",
         "run.steps=3", "hydra.run.dir=run"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    m = read_metrics(tmp_path / "run")
    assert m["status"] == "failed"
    assert "rank 1" in m["reason"] and "rank one cannot build its model" in m["reason"]
