"""A TCP proxy that injects object-storage faults between an S3 client and a real S3 server.

It speaks just enough HTTP/1.1 to cut a response where it hurts: it knows
where a request starts (the first bytes a client sends after the previous
response began, as `bench/latency_proxy.py` counts them), its method, and
where a response's head ends. Faults switch at runtime (`proxy.set(...)`),
apply to the next `times` requests of the chosen methods (None: every one)
after the first `skip` of them pass untouched,
and take effect at the next request on connections already open:

* `Fault.LATENCY`: the request waits `delay` seconds before it is forwarded;
* `Fault.RESET`: the response head and `after` bytes of its body are
  forwarded (nothing when `after` < 0), then the connection is reset (TCP RST);
* `Fault.TRUNCATE`: the same, then the connection is closed cleanly (FIN)
  while the Content-Length promised more;
* `Fault.STATUS`: the proxy answers itself with `status` (503 SlowDown by
  default) and closes the connection; the server never sees the request;
* `Fault.STALL`: the head and `after` bytes of body are forwarded, then
  nothing more until the client gives up (its read timeout);
* `Fault.DOWN`: the proxy stops listening and resets every open connection,
  so connects are refused until the fault is switched off.

Run in a thread of the test (`FaultProxy(upstream).start()`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import sys
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from latency_proxy import reset as _reset
from latency_proxy import stop_loop

__all__ = ["Fault", "FaultProxy"]

_BUFFER = 256 << 10
_HEAD_END = b"\r\n\r\n"
# The interim answer to "Expect: 100-continue" (botocore's PUTs): the request's body follows, not a new request.
_CONTINUE = b"HTTP/1.1 100 "
_REASONS = {500: "Internal Server Error", 502: "Bad Gateway", 503: "Slow Down", 504: "Gateway Timeout"}


class Fault(enum.StrEnum):
    NONE = "none"
    LATENCY = "latency"
    RESET = "reset"
    TRUNCATE = "truncate"
    STATUS = "status"
    STALL = "stall"
    DOWN = "down"


@dataclass(frozen=True, slots=True)
class _Plan:
    fault: Fault
    methods: frozenset[str] | None
    times: int | None
    skip: int
    delay: float
    after: int
    status: int


class FaultProxy:
    """Listens on 127.0.0.1 (a free port, kept across `Fault.DOWN`) and forwards to `upstream` ("host:port").

    `requests` counts requests by method; `injected` counts the faults
    applied, by kind.
    """

    def __init__(self, upstream: str, host: str = "127.0.0.1") -> None:
        upstream_host, _, upstream_port = upstream.removeprefix("http://").rpartition(":")
        self.upstream = (upstream_host, int(upstream_port))
        self.host = host
        self.port = 0
        self.requests: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()
        self._plan = _Plan(Fault.NONE, None, None, 0, 0.0, 0, 503)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[asyncio.StreamWriter] = set()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- switching faults (any thread) ------------------------------------

    def set(
        self,
        fault: Fault,
        *,
        methods: tuple[str, ...] | None = None,
        times: int | None = None,
        skip: int = 0,
        delay: float = 0.0,
        after: int = 0,
        status: int = 503,
    ) -> None:
        """Injects `fault` into the next `times` requests whose method is in `methods` (None: all), after `skip`."""
        with self._lock:
            self._plan = _Plan(fault, frozenset(methods) if methods else None, times, skip, delay, after, status)
        listening = fault is not Fault.DOWN
        self._call(self._listen() if listening else self._refuse())

    def clear(self) -> None:
        """Switches every fault off: requests flow as they are."""
        self.set(Fault.NONE)

    def _take(self, method: str) -> _Plan | None:
        """The fault to inject into a request with `method`, counting it; None: forward it as it is."""
        with self._lock:
            self.requests[method] += 1
            plan = self._plan
            if plan.fault in (Fault.NONE, Fault.DOWN) or plan.times == 0:
                return None
            if plan.methods is not None and method not in plan.methods:
                return None
            if plan.skip > 0:
                self._plan = dataclasses.replace(plan, skip=plan.skip - 1)
                return None
            if plan.times is not None:
                self._plan = dataclasses.replace(plan, times=plan.times - 1)
            self.injected[plan.fault.value] += 1
            return plan

    # -- the proxy (its event loop) ---------------------------------------

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self._connections.add(client_writer)
        upstream_writer: asyncio.StreamWriter | None = None
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
            self._connections.add(upstream_writer)
            # What the response pump does to the response that starts next.
            pending: asyncio.Queue[_Plan | None] = asyncio.Queue()
            answered = asyncio.Event()
            answered.set()
            pumps = [
                asyncio.ensure_future(
                    self._pump_requests(client_reader, client_writer, upstream_writer, answered, pending)
                ),
                asyncio.ensure_future(self._pump_responses(upstream_reader, client_writer, answered, pending)),
            ]
            try:
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pump in pumps:
                    pump.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        except (OSError, asyncio.CancelledError):
            pass  # a refused upstream, or the proxy stopping: the connection ends either way
        finally:
            for writer in (client_writer, upstream_writer):
                if writer is not None:
                    self._connections.discard(writer)
                    with contextlib.suppress(Exception):
                        writer.close()

    async def _pump_requests(
        self,
        reader: asyncio.StreamReader,
        client: asyncio.StreamWriter,
        upstream: asyncio.StreamWriter,
        answered: asyncio.Event,
        pending: asyncio.Queue[_Plan | None],
    ) -> None:
        while data := await reader.read(_BUFFER):
            if answered.is_set():
                answered.clear()
                method = data.split(b" ", 1)[0].decode("ascii", "replace")
                plan = self._take(method)
                if plan is not None and plan.fault is Fault.STATUS:
                    client.write(_error_response(plan.status))
                    await client.drain()
                    return  # closes both connections: the request never reaches the server
                if plan is not None and plan.fault is Fault.LATENCY:
                    await asyncio.sleep(plan.delay)
                    plan = None
                pending.put_nowait(plan)
            upstream.write(data)
            await upstream.drain()

    async def _pump_responses(
        self,
        reader: asyncio.StreamReader,
        client: asyncio.StreamWriter,
        answered: asyncio.Event,
        pending: asyncio.Queue[_Plan | None],
    ) -> None:
        while data := await reader.read(_BUFFER):
            if not answered.is_set() and not data.startswith(_CONTINUE):
                answered.set()
                plan = pending.get_nowait() if not pending.empty() else None
                if plan is not None:
                    await self._cut(plan, data, reader, client)
                    return
            client.write(data)
            await client.drain()

    async def _cut(self, plan: _Plan, data: bytes, reader: asyncio.StreamReader, client: asyncio.StreamWriter) -> None:
        """Forwards the head of a response and `plan.after` bytes of its body, then injects the fault.

        `after < 0`: nothing of the response is forwarded (a PUT's answer has no body to cut).
        """
        while _HEAD_END not in data:
            more = await reader.read(_BUFFER)
            if not more:
                break
            data += more
        head_end = data.find(_HEAD_END)
        head_end = len(data) if head_end < 0 else head_end + len(_HEAD_END)
        body = data[head_end:]
        while len(body) < plan.after:
            more = await reader.read(_BUFFER)
            if not more:
                break
            body += more
        if plan.after >= 0:
            client.write(data[:head_end] + body[: plan.after])
            await client.drain()
        if plan.fault is Fault.STALL:
            await asyncio.Event().wait()  # until the client closes, or the proxy stops
        elif plan.fault is Fault.RESET:
            _reset(client)
        # Fault.TRUNCATE: returning closes the connection cleanly.

    async def _listen(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=_BUFFER)
            self.port = self._server.sockets[0].getsockname()[1]

    async def _refuse(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._connections):
            _reset(writer)

    def _call(self, coroutine: object) -> None:
        loop = self._loop
        assert loop is not None, "start() the proxy first"
        asyncio.run_coroutine_threadsafe(coroutine, loop).result(10.0)  # type: ignore[arg-type]

    def start(self) -> FaultProxy:
        """Runs the proxy in a daemon thread; returns once it listens."""
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="fault-proxy", daemon=True)
        self._thread.start()
        ready.wait(10.0)
        self._call(self._listen())
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return
        stop_loop(loop, self._thread, self._refuse)
        self._loop = None

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _error_response(status: int) -> bytes:
    """An S3 error answer, as S3 throttling (503 SlowDown) or a failing gateway sends it."""
    code = "SlowDown" if status == 503 else "InternalError"
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        f"<Message>injected by the fault proxy</Message></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    return head + body
