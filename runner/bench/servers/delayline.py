"""A delay line for object-store tests and ``python -m runner.bench remote``: a loopback TCP
proxy that adds a fixed round trip, caps the bandwidth and injects faults.

This kernel has no netem, so the link is made in user space. ``DelayLine(upstream_port)``
listens on ``127.0.0.1:<port>`` and forwards every connection to ``127.0.0.1:<upstream>``
(an S3-compatible server): each chunk read in either direction is handed on ``rtt / 2``
after it arrived (so a request and its answer cost one ``rtt`` more), and the bytes towards
the client leave no faster than ``bandwidth`` bytes/s over all connections together (one
shared link). Faults, per HTTP request (a chunk from the client that starts a request line):

- ``reset_rate``: the connection is reset (``SO_LINGER 0``: an RST) after half the first
  chunk of its answer, so the client sees an answer cut short;
- ``burst_rate``: a burst of ``burst_len`` requests, this one and those after it, answered
  ``503 SlowDown`` by the proxy itself (an S3 error body), without reaching the server;
- ``fail_next(n)``: the next ``n`` requests answered 503 (a test's deterministic burst);
- ``deny``: every request answered ``403 AccessDenied`` (a server refusing the credentials).

One asyncio loop in one daemon thread runs it; ``bytes_down`` counts what reached the
clients (the bytes an epoch fetched), ``requests``, ``resets`` and ``errors_503`` what it
did. Nothing here is specific to S3 except the 503 body.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass

METHODS = (b"GET ", b"HEAD ", b"PUT ", b"POST ", b"DELETE ")
SLOWDOWN = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>"
            b"<Message>Please reduce your request rate.</Message></Error>")
DENIED = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>AccessDenied</Code>"
          b"<Message>Access Denied</Message></Error>")


@dataclass
class LinkStats:
    """What the delay line saw since it started (or since ``reset_stats``)."""

    bytes_down: int = 0
    requests: int = 0
    resets: int = 0
    errors_503: int = 0
    connections: int = 0


class DelayLine:
    """A loopback proxy with an added round trip, a bandwidth cap and injected faults.

    Args:
        upstream_port: the server's port on 127.0.0.1.
        rtt: added round-trip time, seconds (half each way).
        bandwidth: bytes/s towards the clients, all connections together (None: no cap).
        reset_rate: share of requests whose connection is reset mid-answer.
        burst_rate: share of requests that start a burst of 503s.
        burst_len: requests per 503 burst.
        seed: seeds the fault draws (a test's faults are the same every run).
    """

    def __init__(self, upstream_port: int, rtt: float = 0.0, bandwidth: float | None = None,
                 reset_rate: float = 0.0, burst_rate: float = 0.0, burst_len: int = 5,
                 seed: int = 0):
        self.upstream_port = upstream_port
        self.rtt, self.bandwidth = rtt, bandwidth
        self.reset_rate, self.burst_rate, self.burst_len = reset_rate, burst_rate, burst_len
        self.deny = False
        self.stats = LinkStats()
        self._rng = random.Random(seed)
        self._forced = 0  # 503s still owed (a burst, or fail_next)
        self._link_free = 0.0  # when the shared downlink is next free (bandwidth cap)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: asyncio.base_events.Server | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._run, name="delay-line", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if not self.port:
            raise RuntimeError("the delay line did not start")

    # --- control ---------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set(self, **settings) -> None:
        """Change ``rtt``, ``bandwidth``, ``reset_rate``, ``burst_rate``, ``burst_len`` or
        ``deny`` now."""
        for key, value in settings.items():
            if key not in ("rtt", "bandwidth", "reset_rate", "burst_rate", "burst_len", "deny"):
                raise TypeError(f"DelayLine has no setting {key!r}")
            setattr(self, key, value)

    def fail_next(self, n: int) -> None:
        """Answer the next ``n`` requests 503 SlowDown."""
        self._forced += n

    def reset_stats(self) -> None:
        self.stats = LinkStats()

    def close(self) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._loop.stop()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(stop(), self._loop)
            self._thread.join(5)

    def __enter__(self) -> DelayLine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the proxy -------------------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]

        self._loop.run_until_complete(start())
        self._ready.set()
        self._loop.run_forever()

    def _fault(self) -> str | None:
        """What to do to the request just seen: None, "503" or "reset"."""
        self.stats.requests += 1
        if self.deny:
            return "403"
        if self._forced > 0:
            self._forced -= 1
            return "503"
        if self.burst_rate and self._rng.random() < self.burst_rate:
            self._forced = max(self.burst_len - 1, 0)
            return "503"
        if self.reset_rate and self._rng.random() < self.reset_rate:
            return "reset"
        return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._proxy(reader, writer)
        except asyncio.CancelledError:  # the line is closing
            pass

    async def _proxy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        state = {"doomed": False, "closed": False}
        down: asyncio.Queue = asyncio.Queue()
        up: asyncio.Queue = asyncio.Queue()
        readers = [asyncio.ensure_future(self._read_client(reader, up, down, state)),
                   asyncio.ensure_future(self._read_server(up_reader, down))]
        deliveries = [asyncio.ensure_future(self._deliver(up, up_writer, state, shaped=False)),
                      asyncio.ensure_future(self._deliver(down, writer, state, shaped=True))]
        # a side is done when all it was sent has been delivered (an end read, a reset, a
        # 503 answered): then the connection is torn down, both ways
        await asyncio.wait(deliveries, return_when=asyncio.FIRST_COMPLETED)
        for t in readers + deliveries:
            t.cancel()
        for w in (writer, up_writer):
            try:
                w.close()
            except Exception:  # already torn down
                pass

    async def _read_client(self, reader, up: asyncio.Queue, down: asyncio.Queue, state) -> None:
        while True:
            data = await _read(reader)
            due = time.monotonic() + self.rtt / 2
            if not data:
                await up.put((due, None))
                return
            if data.startswith(METHODS):
                fault = self._fault()
                if fault in ("503", "403"):
                    if fault == "503":
                        self.stats.errors_503 += 1
                    body = SLOWDOWN if fault == "503" else DENIED
                    status = b"503 Slow Down" if fault == "503" else b"403 Forbidden"
                    head = (b"HTTP/1.1 %s\r\nContent-Type: application/xml\r\n"
                            b"Content-Length: %d\r\nConnection: close\r\n\r\n"
                            % (status, len(body)))
                    # the answer comes back after a full round trip, as the server's would
                    await down.put((due + self.rtt / 2, head + body))
                    await down.put((due + self.rtt / 2, None))
                    return
                if fault == "reset":
                    state["doomed"] = True
            await up.put((due, data))

    async def _read_server(self, reader, down: asyncio.Queue) -> None:
        while True:
            data = await _read(reader)
            await down.put((time.monotonic() + self.rtt / 2, data or None))
            if not data:
                return

    async def _deliver(self, queue: asyncio.Queue, writer: asyncio.StreamWriter, state,
                       shaped: bool) -> None:
        while True:
            due, data = await queue.get()
            now = time.monotonic()
            if shaped and data and self.bandwidth:
                start = max(due, self._link_free)
                self._link_free = start + len(data) / self.bandwidth
                due = self._link_free
            if due > now:
                await asyncio.sleep(due - now)
            if data is None:
                return
            if shaped and state["doomed"]:  # half of this chunk, then an RST
                writer.write(data[: len(data) // 2])
                self.stats.bytes_down += len(data) // 2
                self.stats.resets += 1
                _abort(writer)
                return
            writer.write(data)
            if shaped:
                self.stats.bytes_down += len(data)
            try:
                await writer.drain()
            except ConnectionError:  # the other side hung up (a FUSE mount's seek does)
                return


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with an RST (the peer reads "connection reset"), not a clean FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


async def _read(reader: asyncio.StreamReader) -> bytes:
    """The next chunk from ``reader``; b"" (its end) when the peer reset the connection: a
    client that hangs up mid-answer (rclone's mount does on every seek) ends it, quietly."""
    try:
        return await reader.read(65536)
    except ConnectionError:
        return b""


class DelayLineProcess:
    """A ``DelayLine`` in a child process of its own, with the same controls: its Python
    proxying then takes no time from the GIL of the process it delays (a real link runs in
    no client's interpreter). The bench uses it; tests use ``DelayLine`` directly.

    Args:
        upstream_port: the server's port on 127.0.0.1.
        **settings: ``DelayLine``'s settings (rtt, bandwidth, reset_rate, ...).
    """

    def __init__(self, upstream_port: int, **settings):
        import multiprocessing

        ctx = multiprocessing.get_context("fork")  # before any client thread starts
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_line, args=(upstream_port, settings, child),
                                 daemon=True)
        self._proc.start()
        self.port = self._conn.recv()

    @property
    def pid(self) -> int:
        """The child process that proxies."""
        return self._proc.pid

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _ask(self, *command):
        self._conn.send(command)
        return self._conn.recv()

    def set(self, **settings) -> None:
        self._ask("set", settings)

    def fail_next(self, n: int) -> None:
        self._ask("fail_next", n)

    def reset_stats(self) -> None:
        self._ask("reset_stats")

    @property
    def stats(self) -> LinkStats:
        return self._ask("stats")

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._ask("close")
            except (EOFError, OSError):
                pass
            self._proc.join(5)
            if self._proc.is_alive():
                self._proc.terminate()

    def __enter__(self) -> DelayLineProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _serve_line(upstream_port: int, settings: dict, conn) -> None:
    """The child: a DelayLine, and its controls over ``conn`` until told to close."""
    line = DelayLine(upstream_port, **settings)
    conn.send(line.port)
    while True:
        try:
            command, *args = conn.recv()
        except EOFError:  # the parent is gone
            break
        if command == "close":
            conn.send(None)
            break
        if command == "stats":
            conn.send(line.stats)
            continue
        getattr(line, command)(*(args[0:1] if command == "fail_next" else ()),
                               **(args[0] if command == "set" else {}))
        conn.send(None)
    line.close()
