"""Beyond one machine: equal batch counts on every rank (training drops the remainder,
validation pads and masks), elastic resume on another world size, and nodes reading their
share of a bucket (two torchrun 'nodes' on loopback)."""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import SMALL_DATASET

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
        from runner.compose import compose
        from runner.config import AmpConfig, AmpName
        from runner.data import build_data_path
        from runner.distributed import Ranks
        from runner.model import build_model
        from runner.tasks.validation import Validation

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


def test_every_rank_gets_the_same_whole_batches_and_validation_counts_each_image_once(
        tmp_path: Path, private_cache: Path):
    from runner.compose import compose
    from runner.data.storage import resolve_dataset

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
