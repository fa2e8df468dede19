"""The read engine's batch of whole-object gets (``get_many``: one call on the I/O thread,
each first try driven by callbacks, the window's queue, retries handed to ``_fetch``).
Files of this machine through obstore's LocalStore (a far disk's engine): no server, no
process."""

from __future__ import annotations

import asyncio
import os
import random
import threading

import pytest

pytest.importorskip("obstore", reason="pip install -e '.[dev]'")


@pytest.fixture
def objects(tmp_path) -> dict[str, bytes]:
    """150 files of distinct sizes and contents, by their key in a far disk's engine."""
    rng = random.Random(0)
    found = {}
    for i in range(150):
        path = tmp_path / f"{i:03d}.jpg"
        data = rng.randbytes(1000 + 37 * i)
        path.write_bytes(data)
        found[os.path.abspath(path).lstrip("/")] = data
    return found


@pytest.fixture
def engine():
    from runner.data.sources.files import far_engine

    engine = far_engine()
    yield engine
    engine.close()


def test_a_batch_of_gets_gives_each_future_its_object_in_order_with_no_task_per_object(
        objects, engine, monkeypatch):
    """Each future of ``get_many`` gets its own key's bytes, in the order asked, none left
    pending, through a window that holds a few at a time (its queue admits the rest as
    the first ones finish); no first try goes through ``_fetch`` (a task and coroutines
    per object)."""
    keys = list(objects)
    random.Random(1).shuffle(keys)
    slow = []
    monkeypatch.setattr(engine, "_fetch", lambda *a: slow.append(a))
    engine.max_bytes = 5 * 4096  # 5 in flight at once: the rest wait their turn
    futures = engine.get_many(keys, 4096)
    assert [bytes(f.result(timeout=20)) for f in futures] == [objects[k] for k in keys]
    assert slow == [] and engine.stats.requests == len(keys)
    assert engine.stats.bytes == sum(map(len, objects.values()))
    assert engine.stats.peak_in_flight_bytes <= 5 * 4096
    assert engine._window.count == 0 and not engine._window.waiting


def test_a_missing_object_fails_its_own_future_untried_again(objects, engine):
    keys = list(objects)[:20]
    keys.insert(7, "no/such/file.jpg")
    futures = engine.get_many(keys, 4096)
    with pytest.raises(Exception) as caught:
        futures[7].result(timeout=20)
    from runner.data.sources.objectstore import status_of

    assert status_of(caught.value) == 404
    others = [bytes(f.result(timeout=20)) for i, f in enumerate(futures) if i != 7]
    assert others == [objects[k] for k in keys if k in objects]
    assert engine.stats.retries == 0 and engine.stats.failures == 1


def test_a_first_try_that_fails_transiently_is_retried_and_counted(objects, engine,
                                                                  monkeypatch):
    """A reset on the first try of some objects: each retried (through ``_fetch``, with
    its back-off), counted, and its future gets the object; an error that is not transient
    (the request itself refused) is the future's at once."""
    import obstore

    real = obstore.get_async
    keys = list(objects)[:30]
    flaky, refused, seen = set(keys[::4]), keys[5], set()

    def get_async(store, key, *args, **kwargs):
        if key == refused:
            raise FileNotFoundError(key)  # before any request, and for good
        if key in flaky and key not in seen:
            seen.add(key)
            failed = asyncio.get_running_loop().create_future()
            failed.set_exception(ConnectionResetError("connection reset by peer"))
            return failed
        return real(store, key, *args, **kwargs)

    monkeypatch.setattr(obstore, "get_async", get_async)
    engine.backoff = 0.001
    futures = engine.get_many(keys, 4096)
    for key, future in zip(keys, futures):
        if key == refused:
            with pytest.raises(FileNotFoundError):
                future.result(timeout=20)
        else:
            assert bytes(future.result(timeout=20)) == objects[key]
    assert seen == flaky and engine.stats.retries == len(flaky)
    assert engine.stats.errors == {"ConnectionResetError": len(flaky), "FileNotFoundError": 1}
    assert engine.stats.requests == len(keys) - 1 and engine.stats.failures == 1


def test_a_batch_cancelled_before_it_starts_is_not_fetched(objects, engine):
    keys = list(objects)[:10]
    engine._start()
    started = threading.Event()
    engine._loop.call_soon_threadsafe(lambda: started.wait(5))  # hold the loop a moment
    futures = engine.get_many(keys, 4096)
    assert futures[3].cancel()
    started.set()
    assert [bytes(f.result(timeout=20)) for i, f in enumerate(futures) if i != 3] == \
        [objects[k] for i, k in enumerate(keys) if i != 3]
    assert futures[3].cancelled() and engine.stats.requests == len(keys) - 1


def test_many_keys_refused_before_any_request_fail_each_without_recursion(engine,
                                                                           monkeypatch):
    """Keys obstore refuses at once, queued behind a window of one: each future gets its
    error (the window's release admits the next without nesting one call in another)."""
    import obstore

    def refuse(store, key, *args, **kwargs):
        if key == "k0":  # refused a moment later: the others queue behind it meanwhile
            later = asyncio.get_running_loop().create_future()
            later.get_loop().call_later(0.05, later.set_exception, FileNotFoundError(key))
            return later
        raise FileNotFoundError(key)

    monkeypatch.setattr(obstore, "get_async", refuse)
    engine.max_bytes = 4096  # one at a time: 3000 wait in the window's queue
    futures = engine.get_many([f"k{i}" for i in range(3000)], 4096)
    for i, future in enumerate(futures):
        with pytest.raises(FileNotFoundError, match=f"k{i}$"):
            future.result(timeout=20)
    assert engine.stats.failures == 3000 and engine._window.count == 0
