"""The read engine: fetches in flight for latency, not for cores.

A read from a bucket costs a round trip (5-50 ms), not a disk's 0.1 ms, so what decides
images/s is how many fetches are in flight: rate x round trip (Little's law), whatever the
core count. The engine runs one asyncio loop in one I/O thread (obstore's async API: the
requests run in Rust, off the GIL), so the decode threads, one per core, never wait on the
network except for an image not fetched in time; callers get ``concurrent.futures.Future``s.

**How many in flight.** A ``Window`` admits a fetch while fewer than ``limit`` fetches and
fewer than ``max_bytes`` bytes are in flight. ``limit`` follows the measured link, as TCP
Vegas does: the smallest latency seen is the base round trip; each completed fetch
compares the expected rate (``limit / base``) with the actual one (``limit / latency``), and
their difference times the base (the fetches queued at the server or on the link) moves the
window: while fewer than a quarter of the window is queued it grows by one, when more than
half is it shrinks by one (never below ``MIN_WINDOW``), so the window settles near rate x
round trip, grows when the link is longer and shrinks when the server is saturated, and a
byte bound caps it (``max_bytes``: big ranges hold fewer in flight). The thresholds are
wide because a busy host's own scheduling inflates latencies too (decode threads on every
core): a narrow band would read that as a full link and starve the decoders.

**Retries.** A reset, a timeout, a 5xx (S3's SlowDown is a 503), a 429: retried up to
``attempts`` times with full-jitter exponential back-off (a random wait in
``[0, min(cap, base * 2**n)]``, botocore's "standard" mode with a shorter base), counted in
``stats``. A 404 or 403 is not retried: it is the caller's to name.

**Small objects, few wake-ups.** One object per image costs the client CPU per request,
not bandwidth, so the path of a batch of whole objects (``get_many``) is kept short: the
batch is handed to the I/O thread by one call, each object's first try is two callbacks
(its headers, its body: ``_Get``) with no task or coroutine of its own, its slot in the
window taken and given back by plain calls (``Window.admit``); only a retry (or a single
``get``/``get_range``) runs as a task through ``_fetch``: fewer allocations and wake-ups
of the I/O thread per object than a task each.

**Ranges.** ``get_ranges(key, ranges)`` merges runs of adjacent or nearly adjacent ranges
(gaps under ``merge_gap``, 4 KiB: a tar's member header and a ``.cls`` member lie between
two samples' JPEGs) into one request each and slices the answers, so a run of samples
stored back to back costs one round trip and no byte is read that is not needed.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from runner.data.sources.objectstore import ObjectStore, backoff_seconds, transient

MIN_WINDOW, MAX_WINDOW = 16, 512


@dataclass
class EngineStats:
    """What the engine did: requests, bytes, retries, and the window it settled on."""

    requests: int = 0
    bytes: int = 0
    retries: int = 0
    failures: int = 0
    base_rtt: float = float("inf")
    latency: float = 0.0  # exponentially weighted, seconds
    window: int = MIN_WINDOW
    peak_in_flight_bytes: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def figures(self) -> dict:
        return {"remote_requests": self.requests, "remote_bytes": self.bytes,
                "remote_retries": self.retries, "remote_window": self.window,
                "remote_rtt_ms": round(1000 * self.base_rtt, 2)
                if self.base_rtt != float("inf") else None}


class Window:
    """Admits fetches while fewer than ``limit`` (moved by the measured queueing, see the
    module's docstring) and fewer than ``max_bytes`` bytes are in flight, first come first
    served (a release admits from the head of the queue: no herd of waiters woken to find
    no room)."""

    def __init__(self, stats: EngineStats, max_bytes: int, initial: int = 32):
        self.stats = stats
        self.max_bytes = max_bytes
        self.limit = initial
        self.count = 0
        self.nbytes = 0
        self.waiting: collections.deque = collections.deque()

    def _fits(self, nbytes: int) -> bool:
        # one fetch larger than the byte bound is admitted alone
        return self.count < self.limit and (self.nbytes + nbytes <= self.max_bytes
                                            or self.count == 0)

    def _take(self, nbytes: int) -> None:
        self.count += 1
        self.nbytes += nbytes
        self.stats.peak_in_flight_bytes = max(self.stats.peak_in_flight_bytes, self.nbytes)

    async def acquire(self, nbytes: int) -> None:
        if not self.waiting and self._fits(nbytes):
            self._take(nbytes)
            return
        turn = asyncio.get_running_loop().create_future()
        self.waiting.append((nbytes, turn))
        await turn  # _admit took the slot for it

    def release(self, nbytes: int, latency: float | None) -> None:
        self.count -= 1
        self.nbytes -= nbytes
        if latency is not None:
            self._adapt(latency)
        while self.waiting and self._fits(self.waiting[0][0]):
            size, turn = self.waiting.popleft()
            if callable(turn):  # a callback's turn (``admit``)
                self._take(size)
                turn()
            elif not turn.done():  # not cancelled meanwhile
                self._take(size)
                turn.set_result(None)

    def admit(self, nbytes: int, start: Callable[[], None]) -> None:
        """``start()`` once the window has room for ``nbytes`` (now, if it has), its slot
        taken: ``acquire`` for a callback, with no task or future to wait on."""
        if not self.waiting and self._fits(nbytes):
            self._take(nbytes)
            start()
        else:
            self.waiting.append((nbytes, start))

    def _adapt(self, latency: float) -> None:
        s = self.stats
        s.base_rtt = min(s.base_rtt, latency)
        s.latency = latency if not s.latency else 0.9 * s.latency + 0.1 * latency
        queued = self.limit * (1 - s.base_rtt / max(s.latency, 1e-9))
        if queued < self.limit / 4:
            self.limit = min(self.limit + 1, MAX_WINDOW)
        elif queued > self.limit / 2:
            self.limit = max(self.limit - 1, MIN_WINDOW)
        s.window = self.limit


class ReadEngine:
    """Concurrent fetches from one store, off the caller's threads.

    Args:
        store: the store.
        max_bytes: the most bytes in flight at once.
        attempts: tries per fetch (the first included) before its error is raised.
        backoff: the first retry's longest wait, seconds (doubled per retry, capped at 5 s).
        merge_gap: ranges closer than this many bytes are read as one.
    """

    def __init__(self, store: ObjectStore, max_bytes: int = 256 << 20, attempts: int = 8,
                 backoff: float = 0.05, merge_gap: int = 4 << 10):
        self.store = store
        self.max_bytes, self.attempts, self.backoff = max_bytes, attempts, backoff
        self.merge_gap = merge_gap
        self.stats = EngineStats()
        self._rng = random.Random()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._window: Window | None = None
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def __getstate__(self) -> dict:  # a worker process starts its own loop
        return {k: v for k, v in self.__dict__.items()
                if k in ("store", "max_bytes", "attempts", "backoff", "merge_gap")}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    # --- the loop ------------------------------------------------------------------------

    def _start(self) -> asyncio.AbstractEventLoop:
        if self._pid != os.getpid():  # forked (a loader worker): the I/O thread stayed behind
            self._pid, self._loop, self._thread = os.getpid(), None, None
            self._lock = threading.Lock()
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def run() -> None:
                    asyncio.set_event_loop(loop)
                    self._window = Window(self.stats, self.max_bytes)
                    ready.set()
                    loop.run_forever()

                self._thread = threading.Thread(target=run, name="runner-fetch", daemon=True)
                self._thread.start()
                ready.wait()
                self._loop = loop
        return self._loop

    def submit(self, make: Callable[[], Awaitable], nbytes: int) -> concurrent.futures.Future:
        """Run the fetch ``make()`` (a new awaitable per try) through the window and the
        retries; its result as a Future."""
        return asyncio.run_coroutine_threadsafe(self._fetch(make, nbytes), self._start())

    async def _fetch(self, make: Callable[[], Awaitable], nbytes: int, first: int = 0):
        window = self._window
        if first:  # a fast-path try failed (``_Get``): its back-off first
            await asyncio.sleep(backoff_seconds(first - 1, self.backoff, 5.0, self._rng))
        for attempt in range(first, self.attempts):
            await window.acquire(nbytes)
            t0 = time.perf_counter()
            try:
                data = await make()
            except Exception as e:
                window.release(nbytes, None)
                kind = type(e).__name__
                self.stats.errors[kind] = self.stats.errors.get(kind, 0) + 1
                if not transient(e) or attempt == self.attempts - 1:
                    self.stats.failures += 1
                    raise
                self.stats.retries += 1
                await asyncio.sleep(backoff_seconds(attempt, self.backoff, 5.0, self._rng))
                continue
            window.release(nbytes, time.perf_counter() - t0)
            self.stats.requests += 1
            self.stats.bytes += len(data)
            return data
        raise AssertionError("unreachable")

    # --- what callers ask ----------------------------------------------------------------

    def get(self, key: str, size_hint: int = 1 << 20) -> concurrent.futures.Future:
        """The whole object ``key`` (a Future of a memoryview)."""
        return self.submit(lambda: self.store.get_async(key), size_hint)

    def get_many(self, keys: list[str], size_hint: int = 1 << 20
                 ) -> list[concurrent.futures.Future]:
        """Each whole object of ``keys`` (Futures of memoryviews), started together by one
        call on the I/O thread, each first try driven by callbacks (``_Get``: no task or
        coroutine per object; one the window makes wait queues as a callback); a retry goes
        through ``_fetch`` as ``submit``'s fetches do."""
        futures = [concurrent.futures.Future() for _ in keys]
        loop = self._start()
        loop.call_soon_threadsafe(self._start_gets, keys, futures, size_hint)
        return futures

    def _start_gets(self, keys: list[str], futures: list[concurrent.futures.Future],
                    nbytes: int) -> None:
        window = self._window
        for key, future in zip(keys, futures):
            if future.set_running_or_notify_cancel():  # (not cancelled by its caller)
                window.admit(nbytes, lambda key=key, future=future: _Get(
                    self, key, future, nbytes))

    def _slow(self, key: str, future: concurrent.futures.Future, nbytes: int,
              first: int) -> None:
        """``key``'s fetch from try ``first`` on, through ``_fetch`` (the window's queue,
        the retries' back-off); its outcome to ``future``."""
        task = asyncio.ensure_future(self._fetch(lambda: self.store.get_async(key), nbytes,
                                                 first))
        task.add_done_callback(lambda t: _settle(future, t, running=True))

    def get_range(self, key: str, start: int, end: int) -> concurrent.futures.Future:
        """Bytes ``[start, end)`` of ``key``."""
        return self.submit(lambda: self.store.get_range_async(key, start, end), end - start)

    def get_ranges(self, key: str, ranges: list[tuple[int, int]]
                   ) -> list[concurrent.futures.Future]:
        """Bytes ``[start, end)`` of ``key`` for each range, runs of nearby ranges read as
        one request (``merge_range``)."""
        out: list[concurrent.futures.Future] = [None] * len(ranges)  # type: ignore[list-item]
        for run in merge_ranges(ranges, self.merge_gap):
            lo, hi = ranges[run[0]][0], max(ranges[k][1] for k in run)
            whole = self.get_range(key, lo, hi)
            for k in run:
                out[k] = _slice(whole, ranges[k][0] - lo, ranges[k][1] - lo)
        return out

    def close(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                self._thread.join(5)


class Ahead:
    """Fetches started ahead of need (a coming batch's, from a storage's ``will_need``),
    each taken once by its item's read; an item read before its fetch was started is
    fetched then. Fetches started and never read (an epoch cut short) are dropped, the
    oldest half at a time, past ``16 x`` the largest batch started. A copy in another process (a loader
    worker, pickled or forked) starts with none: the I/O thread behind them stayed behind.
    """

    def __init__(self) -> None:
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.pid = os.getpid()
        self.batch = 1  # the largest batch started: an epoch's short last one drops none

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def _here(self) -> dict[int, concurrent.futures.Future]:
        if self.pid != os.getpid():
            self.__init__()
        return self.pending

    def start(self, items: list[int],
              fetch_many: Callable[[list[int]], list[concurrent.futures.Future]]) -> None:
        """Start fetching ``items`` (not already under way) with ``fetch_many``."""
        pending = self._here()
        todo = [i for i in dict.fromkeys(items) if i not in pending]
        if todo:
            pending.update(zip(todo, fetch_many(todo)))
        self.batch = max(self.batch, len(items))
        if len(pending) > 16 * self.batch:
            for stale in list(pending)[: len(pending) // 2]:
                pending.pop(stale, None)

    def take(self, item: int, fetch: Callable[[int], concurrent.futures.Future]
             ) -> concurrent.futures.Future:
        """``item``'s fetch, started now with ``fetch`` if it was not under way."""
        return self._here().pop(item, None) or fetch(item)


def merge_ranges(ranges: list[tuple[int, int]], gap: int) -> list[list[int]]:
    """Indices of ``ranges`` grouped into runs whose neighbours (by start) are less than
    ``gap`` bytes apart: each run is read as one request."""
    order = sorted(range(len(ranges)), key=lambda k: ranges[k][0])
    runs: list[list[int]] = []
    end = None
    for k in order:
        start, stop = ranges[k]
        if runs and end is not None and start - end < gap:
            runs[-1].append(k)
            end = max(end, stop)
        else:
            runs.append([k])
            end = stop
    return runs


class _Get:
    """One whole object's first try, by callbacks on the I/O thread: the answer's headers
    (``obstore.get_async``), then its body (``bytes_async``), then ``future``'s result. A
    transient error hands the fetch to ``ReadEngine._slow`` for its retries (from the
    second try on), any other error is ``future``'s. The window's slot was taken for it."""

    __slots__ = ("engine", "key", "future", "nbytes", "t0")

    def __init__(self, engine: ReadEngine, key: str, future: concurrent.futures.Future,
                 nbytes: int):
        import obstore

        self.engine, self.key, self.future, self.nbytes = engine, key, future, nbytes
        self.t0 = time.perf_counter()
        try:
            obstore.get_async(engine.store.store, key).add_done_callback(self.headers)
        except Exception as e:  # refused before any request (a bad key): said on the next
            # turn of the loop, not from inside the window's release that admitted it
            asyncio.get_running_loop().call_soon(self.failed, e)

    def headers(self, answer: asyncio.Future) -> None:
        try:
            answer.result().bytes_async().add_done_callback(self.body)
        except (Exception, asyncio.CancelledError) as e:
            self.failed(e)

    def body(self, body: asyncio.Future) -> None:
        try:
            data = memoryview(body.result())
        except (Exception, asyncio.CancelledError) as e:
            self.failed(e)
            return
        engine = self.engine
        engine._window.release(self.nbytes, time.perf_counter() - self.t0)
        engine.stats.requests += 1
        engine.stats.bytes += len(data)
        self.future.set_result(data)

    def failed(self, error: BaseException) -> None:
        engine = self.engine
        engine._window.release(self.nbytes, None)
        kind = type(error).__name__
        engine.stats.errors[kind] = engine.stats.errors.get(kind, 0) + 1
        if not transient(error) or engine.attempts == 1:
            engine.stats.failures += 1
            self.future.set_exception(error)
            return
        engine.stats.retries += 1
        engine._slow(self.key, self.future, self.nbytes, 1)


def _settle(future: concurrent.futures.Future, task: asyncio.Task,
            running: bool = False) -> None:
    """``future`` gets ``task``'s result or error (``running``: it was set running)."""
    if task.cancelled():
        if running:
            future.set_exception(concurrent.futures.CancelledError())
            return
        future.cancel()
    elif task.exception() is not None:
        future.set_exception(task.exception())
    else:
        future.set_result(task.result())


def _slice(whole: concurrent.futures.Future, a: int, b: int) -> concurrent.futures.Future:
    """A Future of bytes ``[a, b)`` of ``whole``'s result."""
    part: concurrent.futures.Future = concurrent.futures.Future()

    def done(f: concurrent.futures.Future) -> None:
        error = f.exception()
        if error is not None:
            part.set_exception(error)
        else:
            part.set_result(f.result()[a:b])

    whole.add_done_callback(done)
    return part
