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


def test_a_bad_label_is_counted_but_never_called_an_undecodable_file(caplog):
    """A label the labels' reader left out (said there, with its count) is in the skipped
    files, not warned of again as an undecodable image; an undecodable image is."""
    import logging

    from runner.data.loading.loader import SkipLog
    from runner.data.protocol import SkippedFile

    skips = SkipLog()
    with caplog.at_level(logging.WARNING):
        skips.add([SkippedFile("ann/instances_val.json", "annotation 4: category_id 5 is not "
                               "among the 3 categories", label=True),
                   SkippedFile("img/a.jpg", "not a JPEG", 3)])
    assert set(skips.files) == {"ann/instances_val.json", "img/a.jpg"}
    assert "undecodable file img/a.jpg" in caplog.text
    assert "instances_val.json" not in caplog.text
