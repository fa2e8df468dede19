"""runner.pipeline(...) in a user's own loop: its progress bar per epoch."""

from __future__ import annotations

from pathlib import Path

import runner


def test_the_pipeline_shows_a_bar_of_each_epochs_steps_unless_told_not_to(image_tree: Path,
                                                                          capsys):
    options = dict(loader="folder", dataset_path=str(image_tree), dataset_image_size=[16, 16],
                   loader_batch_size=4)
    with runner.pipeline(**options) as pipeline:
        for _ in range(2):
            assert sum(len(b["label"]) for b in pipeline) == 18
    err = capsys.readouterr().err
    assert "epoch 1" in err and "epoch 2" in err  # one bar per pass over the data
    assert "0/5 [" in err  # out of the epoch's 5 steps (18 images, batches of 4)
    with runner.pipeline(**options, run_progress=False) as pipeline:
        assert sum(len(b["label"]) for b in pipeline) == 18
    assert "epoch" not in capsys.readouterr().err
