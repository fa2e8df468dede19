"""Batch order: which images each step of each epoch reads, and the padding rule.

Every loading path (per item, batched, in process, with workers) draws its batches from one
``BatchOrder``, so the same seed gives the same batches on every path. An epoch's order is a
function of (seed, epoch) alone, never of the epochs drawn before it: a run resumed at
epoch ``e`` reads exactly what an uninterrupted run reads there.

Ranks (torch.distributed): every rank draws the same permutation and takes every
``world``-th index from ``rank`` on, so global step ``s`` reads positions ``s*G .. (s+1)*G``
of the permutation (``G`` = batch x world) whatever the world size: a run resumed on another
number of ranks with the same global batch reads the same images at each step. Every rank
runs the same number of steps: ``drop_last`` (training under several ranks) drops the
permutation's remainder after the last whole global batch, so no rank holds a short or
padded batch; otherwise (validation, inference) the permutation is padded to a multiple of
the world size with repeats. A repeat of image ``i`` is written ``-1 - i``
(``pad``); storages turn it into a row with ``valid=False`` (``unpad``, ``split_padding``),
which counts in no figure, loss or prediction (``count_images``). This file is the one
place that rule is written.

Aspect-ratio groups (``loader.group_aspect``, torchvision's detection references'
``GroupedBatchSampler``, ultralytics' ``rect``): each item has a bin of its source image's
aspect ratio (``aspect_bins``: torchvision's ``create_aspect_ratio_groups`` quantization,
``2 ** linspace(-1, 1, 2k + 1)``); the epoch's permutation is split by bin, keeping its
order, and cut into global batches of one bin; those are read in a seeded order, then
(unless ``drop_last``) each bin's rest as a short global batch of its own, padded to the
world size with its own images marked as padding. Every batch holds one bin, every image
is read once per epoch, the order is a function of (seed, epoch) and the steps per epoch
of the bins' counts alone; a rank takes every ``world``-th image of each global batch.
Since a batch never mixes bins, each bin has one batch shape (``bin_shapes``: ultralytics'
rect shape, long side the output's, the other the bin's squarest image's rounded up to a
multiple of 32), which the storage decodes its images at (``set_item_shapes``).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from tensordict import TensorDict

from runner.data.threads import torch_threads


def pad(index: int | torch.Tensor) -> int | torch.Tensor:
    """Indices (an int or a tensor) as padding: the same images, marked not to count;
    applied to padding, the indices to read."""
    return -1 - index


def unpad(index: int) -> tuple[int, bool]:
    """(the index to read, whether it counts) for one index of a batch (``pad`` is its own
    inverse)."""
    return (index, True) if index >= 0 else (pad(index), False)


def split_padding(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the indices to read, the valid mask, or None when no row is padding)."""
    if len(index) == 0 or index.numpy().min() >= 0:  # one numpy call: this runs per batch
        return index, None
    valid = index >= 0
    return torch.where(valid, index, pad(index)), valid


def count_images(batch: TensorDict) -> int:
    """Images in a batch that count: padding rows (torch.distributed) do not."""
    if "valid" in batch.keys():
        return int(batch["valid"].sum())  # only a last batch of an epoch has padding
    return batch.batch_size[0]


def sorted_rows(rows: torch.Tensor) -> torch.Tensor:
    """Each row in file order; padding sorts as the index it repeats. Sorted by numpy, in
    int32 where the indices fit: a (1000, 300) epoch took 24 ms in torch's sort (its
    threads on a busy machine), 0.5 ms here."""
    array = rows.numpy()
    padded = array.size and array.min() < 0
    real = np.where(array >= 0, array, pad(array)) if padded else array
    narrow = real.astype(np.int32) if real.size and real.max() < 2**31 else real
    if not padded:
        return torch.from_numpy(np.sort(narrow, axis=1).astype(np.int64, copy=False))
    return torch.from_numpy(np.take_along_axis(array, narrow.argsort(axis=1, kind="stable"),
                                               axis=1))


ASPECT_GROUPS = 3  # torchvision's references' --aspect-ratio-group-factor default


def aspect_bins(sizes: list[tuple[int, int]], k: int = ASPECT_GROUPS) -> torch.Tensor:
    """Each (height, width)'s aspect-ratio bin (int64): ``w / h`` placed among the edges
    ``2 ** linspace(-1, 1, 2k + 1)`` (torchvision's references' ``_quantize``: bin 0 below
    1:2, ``2k + 1`` at 2:1 and wider); an unknown size (0) goes to the square's bin."""
    edges = np.sort(2 ** np.linspace(-1, 1, 2 * k + 1))
    hw = np.asarray(sizes, dtype=np.float64).reshape(-1, 2)
    ratio = np.where((hw[:, 0] > 0) & (hw[:, 1] > 0), hw[:, 1] / np.maximum(hw[:, 0], 1), 1.0)
    return torch.from_numpy(np.searchsorted(edges, ratio, side="right").astype(np.int64))


# Each side of a bin's batch shape is a multiple of this: ultralytics' rect batches (its
# ``batch_shapes``) round up to the model's largest stride, 32 for its YOLOs; torchvision's
# detectors pad their batches to multiples of 32 too (``GeneralizedRCNNTransform``).
RECT_STRIDE = 32


def bin_shapes(sizes: list[tuple[int, int]], bins: torch.Tensor, size: tuple[int, int],
               stride: int = RECT_STRIDE) -> torch.Tensor:
    """Each item's output (height, width), int64 [N, 2], under ``loader.group_aspect``: its
    bin's shape, the same for every item of a bin (a handful of shapes per run).

    ultralytics' rect batch shape (``set_rectangle``: the batch's squarest image sets it),
    taken over the bin's images of the whole set instead of one batch's, so it is a
    function of the bin alone: the squarest image of the bin (an unknown size, 0, counts
    as square) letterboxed into ``size`` fills one side of it; the other side is its
    picture's, rounded up to a multiple of ``stride`` (at most ``size``'s). Every other
    image of the bin is as wide (or as tall) or more, so it fills the same long side and
    fits."""
    hw = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
    known = (hw[:, 0] > 0) & (hw[:, 1] > 0)
    hw = np.where(known[:, None], hw, 1)  # unknown: square
    out_h, out_w = (int(v) for v in size)
    shapes = np.empty((len(hw), 2), dtype=np.int64)
    binned = bins.numpy()
    for b in np.unique(binned):
        members = np.flatnonzero(binned == b)
        h, w = (int(v) for v in hw[members[np.argmin(np.abs(np.log(
            hw[members, 0] / hw[members, 1])))]])
        if h * out_w <= w * out_h:  # as wide as the output or wider: fills its width
            shape = (min(out_h, -(-h * out_w // (w * stride)) * stride), out_w)
        else:  # taller: fills its height
            shape = (out_h, min(out_w, -(-w * out_h // (h * stride)) * stride))
        shapes[members] = shape
    return torch.from_numpy(shapes)


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of one epoch's permutation (and crops): distinct per (seed, epoch)."""
    return (seed * 1_000_003 + epoch) * 10_000_019 % (2**62)


class BatchOrder:
    """The index sets of each epoch's batches: a seeded permutation per epoch.

    Indices within a batch are sorted: the batch is the same set of images, read in file
    order. ``set_epoch`` picks the epoch the next iteration hands out (as
    ``DistributedSampler.set_epoch`` does); iterating without it moves to the next epoch.

    Args:
        size: number of items.
        batch_size: items per batch.
        shuffle: permute each epoch (else file order).
        drop_last: drop a last, short batch.
        seed: seeds the permutations.
        block: shuffle runs of this many consecutive items instead of single items (1: a
            full permutation); larger blocks read a memmap in longer contiguous runs.
        rank: this process's rank (torch.distributed).
        world: the number of ranks.
        crop_seeds: hand out ``(index, crop seed)`` items (storages that crop at random
            while decoding).
        groups: the start of each group of consecutive items and, last, ``size`` (a
            sharded storage's shards, ``loader=shards``): groups are shuffled in blocks of
            ``group_block`` and the items of each block among themselves, so an epoch reads
            a few shards at a time, in an order known in advance (``group_blocks``).
        group_block: groups per block.
        members: with ``groups``, the item at each place of the groups (a sharded storage
            that numbers its items otherwise than its shards hold them); None: item ``p``.
        lanes: with ``groups``, deal each epoch's groups to this many lanes (``lanes``: one
            per node of a multi-node run, ``loader.lanes``).
        bins: each item's aspect-ratio bin (``aspect_bins``): batches of one bin
            (``loader.group_aspect``; see the module's docstring); None: any mix.

    Lanes (``loader=shards`` on several nodes): each epoch's permutation of groups is cut
    into ``lanes`` runs of whole groups, each read in blocks as above; global step ``s``
    takes ``G / lanes`` samples from each lane, side by side, and rank slot ``r`` takes
    positions ``r*batch .. (r+1)*batch`` of it, so the ranks of one node (consecutive
    slots) read their node's lanes alone and the node fetches about ``1/nodes`` of the
    shards. The order depends on (seed, epoch, groups, lanes), never on the world size.
    Lanes hold different numbers of samples: the epoch's steps are fixed from the groups'
    sizes (the smallest a lane can hold with ``drop_last``, else the largest, short lanes
    padded), so every rank and every epoch has the same count.
    """

    def __init__(self, size: int, batch_size: int, *, shuffle: bool, drop_last: bool,
                 seed: int, block: int = 1, rank: int = 0, world: int = 1,
                 crop_seeds: bool = False, groups: list[int] | None = None,
                 group_block: int = 1, lanes: int = 1, members: torch.Tensor | None = None,
                 bins: torch.Tensor | None = None):
        self.size, self.batch_size = size, batch_size
        self.shuffle, self.drop_last, self.block = shuffle, drop_last, block
        self.rank, self.world = rank, world
        self.per_rank = -(-size // world)  # padded to the same length on every rank
        self.seed = seed
        self.crop_seeds = crop_seeds
        self.groups, self.group_block = groups, max(1, group_block)
        self.members = members
        self.lanes = max(1, lanes) if groups is not None else 1
        if self.lanes > 1 and (batch_size * world) % self.lanes:
            raise ValueError(f"a global batch of {batch_size * world} cannot be shared by "
                             f"{self.lanes} lanes")
        if bins is not None and (groups is not None or len(bins) != size):
            raise ValueError("aspect-ratio bins need one bin per item and no groups")
        self.bins = bins
        self.epoch = -1  # the epoch whose batches are being handed out
        self.last_epoch: int | None = None  # the run's last (None: not known), to fetch ahead
        self._next: int | None = None  # set_epoch's choice for the next iteration
        self._skip = 0  # batches of the next iteration's epoch already done (a resume)

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """The next iteration hands out epoch ``epoch``, from its batch ``skip`` on (a run
        resumed mid-epoch continues with the next batch of the same permutation)."""
        self._next, self._skip = epoch, skip

    @property
    def coming_epoch(self) -> int:
        """The epoch the next iteration reads (``set_epoch``'s, else the one after)."""
        return self._next if self._next is not None else self.epoch + 1

    def seeds_for(self, index: torch.Tensor, epoch: int | None = None) -> list[int]:
        """One random-crop seed per image of ``epoch`` (unset: the epoch being read): a
        function of (seed, epoch, image), so a path that decodes in threads, in workers or
        per item crops each image alike."""
        real, _ = split_padding(index)
        epoch = self.epoch if epoch is None else epoch
        return ((real + epoch_seed(self.seed, epoch)) % (2**62)).tolist()

    @property
    def largest_batch(self) -> int:
        """The most images one batch holds: the batch size, or a rank's whole shard when
        that is smaller (what batch buffers are sized by)."""
        return min(self.batch_size, self.per_rank)

    def __len__(self) -> int:
        if self.lanes > 1:
            return self._lane_steps()
        if self.bins is not None:  # whole global batches of each bin, then each bin's rest
            counts = torch.bincount(self.bins).tolist()
            whole = self.batch_size * self.world
            return sum(n // whole + (0 if self.drop_last or n % whole == 0 else 1)
                       for n in counts)
        if self.drop_last:  # whole global batches: the same count on every rank
            return self.size // (self.batch_size * self.world)
        return -(-self.per_rank // self.batch_size)

    def _lane_groups(self, epoch: int) -> list[list[int]]:
        """Each lane's groups, in reading order: the epoch's permutation of groups (their
        order when not shuffled) cut into ``lanes`` runs."""
        n = len(self.groups) - 1
        if self.shuffle:
            generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            perm = torch.randperm(n, generator=generator).tolist()
        else:
            perm = list(range(n))
        cuts = [n * k // self.lanes for k in range(self.lanes + 1)]
        return [perm[cuts[k] : cuts[k + 1]] for k in range(self.lanes)]

    def _blocks_of(self, lane: list[int]) -> list[list[int]]:
        return [lane[a : a + self.group_block] for a in range(0, len(lane), self.group_block)]

    def _my_lanes(self) -> range:
        """The lanes this rank's slice of a global batch falls in."""
        share = self.batch_size * self.world // self.lanes
        first = self.rank * self.batch_size
        return range(first // share, (first + self.batch_size - 1) // share + 1)

    def _lane_steps(self) -> int:
        """Global steps per epoch with lanes: whatever the permutation, every lane holds at
        least the ``n // lanes`` smallest groups and at most the ``ceil(n / lanes)``
        largest (exactly known when not shuffled)."""
        share = self.batch_size * self.world // self.lanes
        sizes = [self.groups[g + 1] - self.groups[g] for g in range(len(self.groups) - 1)]
        if self.shuffle:
            ascending, n = sorted(sizes), len(sizes)
            least = sum(ascending[: n // self.lanes])
            most = sum(ascending[::-1][: -(-n // self.lanes)])
        else:
            held = [sum(sizes[g] for g in lane) for lane in self._lane_groups(0)]
            least, most = min(held), max(held)
        return least // share if self.drop_last else -(-most // share)

    def group_blocks(self, epoch: int) -> list[list[int]]:
        """The blocks of groups this rank reads in epoch ``epoch``, in reading order (its
        lanes' k-th blocks together; groups in their order when not shuffled)."""
        lanes = self._lane_groups(epoch)
        mine = [self._blocks_of(lanes[k]) for k in self._my_lanes()]
        depth = max((len(b) for b in mine), default=0)
        return [[g for b in mine if k < len(b) for g in b[k]] for k in range(depth)]

    def _lane_streams(self, epoch: int) -> list[torch.Tensor]:
        """Each lane's items: its blocks of groups in order, each block's items shuffled
        among themselves (one generator per epoch: a function of (seed, epoch) alone)."""
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch) ^ 0x5EED)
        streams = []
        for lane in self._lane_groups(epoch):
            parts = []
            for block in self._blocks_of(lane):
                items = torch.cat([torch.arange(self.groups[g], self.groups[g + 1])
                                   for g in block])
                if self.members is not None:
                    items = self.members[items]
                parts.append(items[torch.randperm(len(items), generator=generator)]
                             if self.shuffle else items)
            streams.append(torch.cat(parts) if parts else torch.arange(0))
        return streams

    def _lane_rows(self, epoch: int) -> torch.Tensor:
        """This rank's batches of ``epoch`` with lanes, (steps, batch_size): its slice of
        each global step; a lane shorter than the steps is padded with its own items (the
        first lane's where it has none)."""
        steps, share = len(self), self.batch_size * self.world // self.lanes
        streams = self._lane_streams(epoch)
        lanes = self._my_lanes()
        columns = []
        for k in lanes:
            stream, need = streams[k][: steps * share], steps * share
            if len(stream) < need:
                source = stream if len(stream) else next(s for s in streams if len(s))
                fill = source[torch.arange(need - len(stream)) % len(source)]
                stream = torch.cat([stream, pad(fill)])
            columns.append(stream.view(steps, share))
        rows = torch.cat(columns, dim=1)
        start = self.rank * self.batch_size - lanes.start * share
        return rows[:, start : start + self.batch_size]

    def epoch_order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.size)
        if self.groups is not None:
            return torch.cat(self._lane_streams(epoch))
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        # one thread: the same permutation (a serial draw), 1.4 ms for 300,000 items where
        # torch's threads took 5.7 on a busy 2-core machine
        with torch_threads(1):
            if self.block <= 1:
                return torch.randperm(self.size, generator=generator)
            starts = torch.randperm(-(-self.size // self.block), generator=generator)
        order = (starts[:, None] * self.block + torch.arange(self.block)).flatten()
        return order[order < self.size]

    def _grouped_rows(self, epoch: int) -> list[torch.Tensor]:
        """This rank's batches of ``epoch`` with aspect-ratio bins: the epoch's
        permutation split by bin (its order kept), cut into global batches of one bin read
        in a seeded order, then each bin's rest (unless ``drop_last``), padded to a
        multiple of the world size with its own images as padding; a rank's batch is
        every ``world``-th image of its global batch from ``rank`` on."""
        order = self.epoch_order(epoch)
        whole = self.batch_size * self.world
        binned = self.bins[order]
        chunks, rests = [], []
        for b in torch.unique(binned).tolist():
            items = order[binned == b]  # in the permutation's order
            full = len(items) // whole * whole
            chunks += list(items[:full].view(-1, whole))
            if full < len(items) and not self.drop_last:
                rest = items[full:]
                fill = (-len(rest)) % self.world
                rests.append(torch.cat([rest, pad(rest[torch.arange(fill) % len(rest)])]))
        if self.shuffle and chunks:
            generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch) ^ 0xA5EC)
            chunks = [chunks[i] for i in torch.randperm(len(chunks), generator=generator)]
        rows = [chunk[self.rank :: self.world] for chunk in chunks + rests]
        return [sorted_rows(r[None])[0] for r in rows] if self.shuffle else rows

    def begin_epoch(self) -> int:
        """Move to the next epoch (``set_epoch``'s, else the one after the last); returns
        how many of its batches were already done (a resume)."""
        self.epoch = self._next if self._next is not None else self.epoch + 1
        skip, self._next, self._skip = self._skip, None, 0
        return skip

    def batches(self) -> Iterator[torch.Tensor]:
        """The next epoch's batches (``set_epoch``'s epoch, else the one after the last)."""
        skip = self.begin_epoch()
        if self.lanes > 1:
            rows = self._lane_rows(self.epoch)
            yield from (sorted_rows(rows) if self.shuffle else rows)[skip:]
            return
        if self.bins is not None:
            yield from self._grouped_rows(self.epoch)[skip:]
            return
        order = self.epoch_order(self.epoch)
        if self.world > 1:
            pads = self.per_rank * self.world - self.size
            order = torch.cat([order, pad(order[:pads])])[self.rank :: self.world]
        full = (len(self) if self.drop_last else len(order) // self.batch_size) \
            * self.batch_size
        rows = order[:full].view(-1, self.batch_size)
        if self.shuffle:  # one sort for the whole epoch, not one call per batch
            rows = sorted_rows(rows)
        yield from rows[skip:]
        if not self.drop_last and full < len(order) and skip <= len(rows):
            rest = order[full:]
            yield sorted_rows(rest[None])[0] if self.shuffle else rest

    def __iter__(self) -> Iterator[list]:  # as a DataLoader batch_sampler
        for index in self.batches():
            if self.crop_seeds:  # (index, crop seed) items: runner/data/storage/folder.py
                yield list(zip(index.tolist(), self.seeds_for(index)))
            else:
                yield index.tolist()
