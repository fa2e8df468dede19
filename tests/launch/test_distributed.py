"""torchrun / DDP on CPU (gloo, 2 processes), and the SLURM launcher preset."""

from __future__ import annotations

import csv
import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runner.config.schema import Decoder, LoaderConfig, OnCorrupt, StorageName
from runner.data.decode.decoders import ImageDecoder
from runner.data.loading.loader import BatchStream
from runner.data.order import BatchOrder
from runner.data.storage.decoded import DecodedStorage
from runner.data.storage.folder import FolderStorage
from tests.conftest import REPO, SMALL_DATASET, encode, make_loader, make_tree, photo, read_metrics


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
