"""runner/data/sources/blockreads.py: a far file's blocks, each read whole once and cut
into its items; a batch spread over many blocks left to the caller."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from runner.data.sources.blockreads import BlockReads, block_bounds
from runner.data.sources.files import far_engine


def test_blocks_are_runs_of_items_spanning_at_most_the_block_bytes():
    sizes = [30, 30, 30, 100, 10, 10, 10, 10]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    bounds = block_bounds(offsets, sizes, 64)
    assert bounds == [0, 2, 3, 4, 8]  # 30+30 | 30 | 100 (alone, too big) | 4 x 10
    for a, b in zip(bounds[:-1], bounds[1:]):
        assert b - a == 1 or offsets[b - 1] + sizes[b - 1] - offsets[a] <= 64
    assert block_bounds([], [], 64) == [0]


@pytest.fixture
def far_file(tmp_path: Path):
    data = os.urandom(64 * 1000)
    path = tmp_path / "images.bin"
    path.write_bytes(data)
    sizes = [1000] * 64
    offsets = [1000 * k for k in range(64)]
    engine = far_engine()
    yield data, engine, os.path.abspath(path).lstrip("/"), offsets, sizes
    engine.close()


def test_a_batch_in_a_few_blocks_reads_each_block_once_whole(far_file):
    data, engine, key, offsets, sizes = far_file
    reads = BlockReads(engine, key, offsets, sizes, block_bounds(offsets, sizes, 8000), cached=4)
    assert len(reads.spans) == 8
    batch = [3, 12, 5, 14, 1]  # blocks 0 and 1
    assert reads.will_need(batch) and reads.will_need([2, 9])  # the same blocks: no read
    for i in batch + [2, 9]:
        assert reads.read(i) == data[1000 * i : 1000 * (i + 1)]
    assert reads.fetched == 2 and engine.stats.requests == 2
    assert engine.stats.bytes == 2 * 8000
    assert reads.read(40) is None  # its block is not being read: the caller's range


def test_a_spread_batch_is_left_to_the_caller_and_old_blocks_make_room(far_file):
    data, engine, key, offsets, sizes = far_file
    reads = BlockReads(engine, key, offsets, sizes, block_bounds(offsets, sizes, 8000), cached=3)
    assert not reads.will_need([0, 9, 17, 25])  # four blocks: more than two thirds of 3
    assert reads.fetched == 0 and engine.stats.requests == 0
    for stretch in ([0, 9], [17, 25], [33, 41]):  # blocks 0 1, then 2 3 (0 out), 4 5
        assert reads.will_need(stretch)
    assert list(reads.blocks) == [3, 4, 5] and reads.read(0) is None
    assert reads.read(41) == data[41000:42000]
