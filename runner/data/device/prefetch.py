"""``prefetch=``: how batches are staged ahead of the step that uses them.

- ``none``: the loop takes each batch when it needs it and copies it on the compute stream.
- ``cpu`` (``CpuPrefetcher``): a daemon thread keeps up to ``depth`` ready batches in a
  bounded queue, so loading overlaps the step; modelled on FFCV's EpochIterator (a thread,
  a bounded queue, a stop event). A producer error is raised in the loop with its own
  traceback; leaving the loop early, or Ctrl-C, stops the thread at once.
- ``gpu`` (``CudaStreamPrefetcher``): a CUDA side stream, created once, copies the next
  ``depth`` batches from pinned memory with ``non_blocking=True`` while the model computes
  on the current one. timm's PrefetchLoader made a new stream per epoch and never made the
  copy stream wait for the compute stream, and its reserved memory grew every epoch (timm
  issue #2781); here the stream lives as long as the prefetcher, the compute stream waits
  for each batch's copy event, and tensors that cross streams are ``record_stream``-ed, so
  the allocator never reuses a block the compute stream still reads (the copy itself does
  not wait for earlier steps: it overlaps them, even at depth 1).
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from tensordict import TensorDict

from runner.common.errors import Unavailable
from runner.common.registry import Registry
from runner.config.schema import PrefetchConfig, PrefetchName
from runner.data.order import count_images
from runner.data.threads import (
    bind_cuda,
    cuda_index,
    main_thread_count,
    one_core_for_this_thread,
    restore_thread_count,
)
from runner.measure import timeline

_END = object()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


def _close(iterator) -> None:
    close = getattr(iterator, "close", None)
    if close is not None:
        close()  # a generator's finally runs: loader workers shut down


class Unprefetched:
    """``prefetch=none``: the source's batches, taken when the loop asks for them.

    Args:
        source: an iterable of batches.
        device: unused (every prefetcher is built with the same arguments).
        depth: unused.
    """

    name = PrefetchName.none

    def __init__(self, source: Iterable, device: torch.device | None = None, depth: int = 0):
        self.source = source

    def __iter__(self) -> Iterator:
        return iter(self.source)

    def figures(self, steps: int) -> dict[str, float]:
        return {}


class CpuPrefetcher:
    """Batches from ``source``, loaded ``depth`` ahead by a background thread.

    Args:
        source: an iterable of batches (it is iterated, and closed, by the thread).
        device: unused (every prefetcher is built with the same arguments).
        depth: the most batches kept ready.
    """

    name = PrefetchName.cpu

    def __init__(self, source: Iterable, device: torch.device | None = None, depth: int = 2):
        self.source = source
        self.depth = depth

    def figures(self, steps: int) -> dict[str, float]:
        return {}

    def __iter__(self) -> Iterator:
        ready: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        main_threads = main_thread_count()
        thread = threading.Thread(target=self._produce, args=(ready, stop, main_threads),
                                  daemon=True, name="runner-prefetch")
        thread.start()
        try:
            while True:
                item = self._next(ready, thread)
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.error  # the producer's exception, with its traceback
                yield item
        finally:
            stop.set()
            while True:  # unblock a producer waiting for room in the queue
                try:
                    ready.get_nowait()
                except queue.Empty:
                    break
            thread.join(timeout=5.0)

    @staticmethod
    def _next(ready: queue.Queue, thread: threading.Thread):
        while True:
            try:
                return ready.get(timeout=0.1)  # a timeout keeps Ctrl-C responsive
            except queue.Empty:
                if not thread.is_alive() and ready.empty():
                    raise RuntimeError("the prefetch thread stopped without a result") from None

    def _produce(self, ready: queue.Queue, stop: threading.Event, main_threads: int) -> None:
        one_core_for_this_thread()
        iterator = iter(self.source)
        try:
            for batch in iterator:
                if not self._put(ready, stop, batch):
                    return
            self._put(ready, stop, _END)
        except BaseException as e:  # handed to the loop, raised there
            self._put(ready, stop, _Failure(e))
        finally:
            _close(iterator)
            restore_thread_count(main_threads)

    @staticmethod
    def _put(ready: queue.Queue, stop: threading.Event, item) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False


class CudaStreamPrefetcher:
    """Device-resident batches: a background thread takes each batch from the source (the
    memmap/ram gather, or the loader's next batch) and launches its copy on a side stream,
    ``depth`` batches ahead, so host work and copies both overlap the model's step (as
    FFCV's epoch iterator does).

    The compute stream waits for each batch's copy event (on the device, not the host),
    and every tensor made on the side stream is ``record_stream``-ed on the compute stream
    so the allocator does not reuse it early. Copy times are kept as event pairs, folded
    into a total as they complete (no sync, a bounded list).

    Args:
        source: batches in pinned host memory (pinned is what makes the copy asynchronous).
        device: the CUDA device.
        depth: batches gathered and copied ahead of the one in use.
    """

    name = PrefetchName.gpu

    def __init__(self, source: Iterable[TensorDict], device: torch.device, depth: int = 2):
        if device.type != "cuda":
            raise Unavailable(
                "prefetch=gpu copies batches on a CUDA side stream and needs a CUDA device; "
                f"this run's device is {device.type}. Use prefetch=cpu or prefetch=none")
        self.source = source
        self.device = device
        self.depth = depth
        self.stream = torch.cuda.Stream(device=device)  # once per prefetcher, not per epoch
        self.index = cuda_index(device)  # the prefetch thread binds to it
        self._copy_events: collections.deque = collections.deque()
        self._copy_seconds = 0.0
        self._images = 0

    def _copies(self, compute: torch.cuda.Stream) -> Iterator[tuple[TensorDict, Any, int]]:
        """Runs on the prefetch thread: each batch gathered, then copied on the side stream."""
        bind_cuda(self.index)
        batches = iter(self.source)
        while True:
            start = torch.cuda.Event(enable_timing=True)
            done = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.stream):
                # The source is advanced on the side stream too: its own GPU work (nvjpeg's
                # decode and crops, DALI's copy into torch tensors, made on the current
                # stream) then overlaps the step instead of queueing on the compute stream.
                # No wait for the compute stream here: that would queue each copy behind
                # the step before it (no overlap at depth 1). Memory is safe without it:
                # every tensor that crosses to the compute stream is record_stream-ed there
                # (``__iter__``), so the allocator does not hand its block to a later copy
                # until the compute work that reads it ends.
                batch = next(batches, None)
                if batch is None:
                    return
                images = count_images(batch)  # on the host (nvjpeg keeps "valid" there)
                # recorded after the host's gather: an event recorded on an idle stream
                # completes at once, so one recorded before ``next`` would time the gather
                # on the host as if it were the copy
                start.record(self.stream)
                moved = batch.to(self.device, non_blocking=True)
                done.record(self.stream)
            timeline.record_device(timeline.COPY_STREAM, "copy", start, done)  # no sync
            yield moved, (start, done), images

    def _fold_completed(self) -> None:
        while self._copy_events and self._copy_events[0][1].query():
            start, done = self._copy_events.popleft()
            self._copy_seconds += start.elapsed_time(done) / 1000.0

    def __iter__(self) -> Iterator[TensorDict]:
        compute = torch.cuda.current_stream(self.device)
        for moved, (start, done), images in CpuPrefetcher(self._copies(compute),
                                                           depth=self.depth):
            compute.wait_event(done)  # this batch's copy, not the later ones
            for tensor in moved.values(include_nested=True, leaves_only=True):
                # made on the side stream, used on the compute stream: the allocator
                # must not reuse it until the compute stream is done with it
                tensor.record_stream(compute)
            self._copy_events.append((start, done))
            if len(self._copy_events) > 64:
                self._fold_completed()
            self._images = images
            yield moved

    def count(self, batch: TensorDict) -> int:
        """Images that count in the batch just handed out, counted on the host."""
        return self._images

    def copy_seconds(self) -> float:
        """Total side-stream copy time so far (synchronizes; call after the timed loop)."""
        torch.cuda.synchronize(self.device)
        self._fold_completed()
        total, self._copy_seconds = self._copy_seconds, 0.0
        return total

    def figures(self, steps: int) -> dict[str, float]:
        """The side-stream copy time per step, overlapped with compute (so not in copy_ms)."""
        return {"prefetch_copy_ms": 1000 * self.copy_seconds() / max(steps, 1)}


PREFETCHERS: Registry[type] = Registry(PrefetchName, "prefetch={}",
                                       (Unprefetched, CpuPrefetcher, CudaStreamPrefetcher))


def build_prefetcher(cfg: PrefetchConfig, source: Iterable, device: torch.device):
    """The prefetcher ``prefetch.name`` asks for, over ``source``."""
    return PREFETCHERS[cfg.name](source, device, cfg.depth)
