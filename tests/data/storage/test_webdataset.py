"""loader=webdataset: the webdataset library's own pipeline on loader=shards' shards, a rival
in the runner's loop (local shards and a bucket through the delay line)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.data.storage.test_shards import batches, prepare_shards


def by_index(got: list) -> dict[int, tuple[int, torch.Tensor]]:
    return {int(i): (int(label), image) for index, labels, images in got
            for i, label, image in zip(index, labels, images)}


@pytest.mark.server
@pytest.mark.parametrize("where", ["local", "bucket"])
def test_webdatasets_pipeline_reads_every_image_once_with_the_same_crop(
        where, tmp_path, cache_dir, request):
    pytest.importorskip("webdataset")
    out = tmp_path / "shards"
    prepare_shards(str(out))
    path = str(out)
    if where == "bucket":
        s3_server = request.getfixturevalue("s3_server")
        request.getfixturevalue("s3_env")
        request.getfixturevalue("delay_line").set(rtt=0.005)
        bucket = f"wds-{os.getpid()}"
        s3_server.make_bucket(bucket)
        s3_server.upload(out, bucket, "shards")
        path = f"s3://{bucket}/shards"
    ours = by_index(batches(f"dataset.path={out}"))
    theirs = by_index(batches(f"dataset.path={path}", "loader.num_workers=2",
                              "loader.shuffle=true", loader="webdataset"))
    assert sorted(theirs) == sorted(ours) == list(range(60))  # every image once
    for i, (label, image) in theirs.items():  # the same label and centre crop per image
        assert label == ours[i][0] and torch.equal(image, ours[i][1])
