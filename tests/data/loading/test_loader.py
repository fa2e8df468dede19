"""runner/data/loading/loader.py: the batches a loader makes (a batch size beyond the dataset's is
a batch of the dataset)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import (
    SMALL_DATASET,
)


@pytest.mark.slow
def test_a_batch_size_larger_than_the_dataset_is_a_batch_of_the_dataset(tmp_path: Path,
                                                                        cache_dir: Path):
    """loader.batch_size=1000000 allocated buffers for a million images (150 GB at 224)."""
    from runner.data import build_data_path
    from runner.job.compose import compose

    config = compose([*SMALL_DATASET, "loader.batch_size=1000000", "model=none"])
    data = build_data_path(config, torch.device("cpu"), epochs=1, progress=False)
    batches = list(data)
    assert [len(b["label"]) for b in batches] == [60]
    assert batches[0]["image"].untyped_storage().nbytes() <= 60 * 3 * 48 * 48
    data.close()
