"""A TCP proxy that adds a fixed delay to every request, as a remote object store would, and can cut the link.

Put it between an S3 client and a local S3 server to see what a job meets on
a real network: every HTTP request (the first bytes a client sends after the
previous response began) waits `delay` seconds before it is forwarded; bodies
and responses then flow at full speed. Connections are kept alive as the
client keeps them.

With `delay = 0` it forwards any TCP protocol byte for byte (gRPC over
HTTP/2 too), and `cut()` partitions the link: by default packets are dropped
(nothing is forwarded either way on open connections, new connections are
accepted and never reach the upstream, so calls wait out their deadlines), or
with `refuse=True` every connection is reset and new ones are refused, as a
host that is gone answers. `heal()` resets the connections that lived through
the cut (as TCP gives up on them) and forwards again.

Run as a process (`python bench/latency_proxy.py --upstream 127.0.0.1:8333
--delay-ms 20 --listen 127.0.0.1:0`, which prints the port it listens on), or
in a thread of the caller (`LatencyProxy(...).start()`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import struct
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

__all__ = ["LatencyProxy", "reset", "stop_loop"]

_BUFFER = 256 << 10


class LatencyProxy:
    """Listens on 127.0.0.1:`port` (0: any free one) and forwards to `upstream` ("host:port") after `delay` s."""

    def __init__(self, upstream: str, delay: float = 0.0, port: int = 0, host: str = "127.0.0.1") -> None:
        upstream_host, _, upstream_port = upstream.rpartition(":")
        self.upstream = (upstream_host, int(upstream_port))
        self.delay = delay
        self.host = host
        self.port = port
        self.requests = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def address(self) -> str:
        """HOST:PORT, for gRPC targets."""
        return f"{self.host}:{self.port}"

    def cut(self, *, refuse: bool = False) -> None:
        """Partitions the link (any thread): packets dropped, or with `refuse` connections reset and refused."""
        self._call(self._cut(refuse))

    def heal(self) -> None:
        """Ends a cut (any thread): connections that lived through it are reset, new ones flow."""
        self._call(self._heal())

    async def _cut(self, refuse: bool) -> None:
        if not refuse:
            self._flowing.clear()
            return
        if self._server is not None:
            self._server.close()
            self._server = None
        self._reset_all()

    async def _heal(self) -> None:
        self._reset_all()
        if self._server is None:
            await self._start()
        self._flowing.set()

    def _reset_all(self) -> None:
        for writer in list(self._connections):
            reset(writer)

    def _call(self, coroutine: Coroutine[Any, Any, None]) -> None:
        loop = self._loop
        assert loop is not None, "start() the proxy first"
        asyncio.run_coroutine_threadsafe(coroutine, loop).result(10.0)

    async def _forward(self, writer: asyncio.StreamWriter, data: bytes) -> bool:
        """Writes `data` on, once the link is not cut; False when the connection was reset meanwhile."""
        if not self._flowing.is_set():
            await self._flowing.wait()
            if writer.is_closing():
                return False
        writer.write(data)
        await writer.drain()
        return True

    async def _pump_requests(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answered: asyncio.Event
    ) -> None:
        while data := await reader.read(_BUFFER):
            if answered.is_set():
                # The first bytes of a new request: the network's round trip.
                answered.clear()
                self.requests += 1
                await asyncio.sleep(self.delay)
            if not await self._forward(writer, data):
                return

    async def _pump_responses(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answered: asyncio.Event
    ) -> None:
        while data := await reader.read(_BUFFER):
            answered.set()
            if not await self._forward(writer, data):
                return

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self._connections.add(client_writer)
        try:
            await self._serve_connection(client_reader, client_writer)
        except asyncio.CancelledError:
            pass  # the proxy stopping: the connection ends either way
        finally:
            self._connections.discard(client_writer)

    async def _serve_connection(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        if not self._flowing.is_set():
            # Accepted while cut: the upstream never hears of it; heal() resets it.
            await self._flowing.wait()
            if client_writer.is_closing():
                return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_writer.close()
            return
        self._connections.add(upstream_writer)
        answered = asyncio.Event()
        answered.set()
        pumps = [
            asyncio.ensure_future(self._pump_requests(client_reader, upstream_writer, answered)),
            asyncio.ensure_future(self._pump_responses(upstream_reader, client_writer, answered)),
        ]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            self._connections.discard(upstream_writer)
            for writer in (client_writer, upstream_writer):
                with contextlib.suppress(Exception):
                    writer.close()

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=_BUFFER)
        self.port = self._server.sockets[0].getsockname()[1]

    def start(self) -> LatencyProxy:
        """Runs the proxy in a daemon thread; returns once it listens."""
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._start())
            except BaseException as exc:
                errors.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="latency-proxy", daemon=True)
        self._thread.start()
        ready.wait(10.0)
        if errors:
            raise errors[0]
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return

        async def close() -> None:
            if self._server is not None:
                self._server.close()

        stop_loop(loop, self._thread, close)
        self._loop = None


def reset(writer: asyncio.StreamWriter) -> None:
    """Closes with a TCP RST rather than a FIN (SO_LINGER 0), as a crashed peer or a middlebox does."""
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError):
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def stop_loop(
    loop: asyncio.AbstractEventLoop, thread: threading.Thread | None, close: Callable[[], Awaitable[None]]
) -> None:
    """Stops a proxy's event loop running in `thread`: `close()` (stop listening), then every task cancelled."""

    async def shutdown() -> None:
        await close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        loop.stop()

    asyncio.run_coroutine_threadsafe(shutdown(), loop)
    if thread is not None:
        thread.join(5.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="host:port to forward to")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="delay added to every request (default 20)")
    parser.add_argument("--listen", default="127.0.0.1:0", help="host:port to listen on (port 0: any)")
    args = parser.parse_args()
    host, _, port = args.listen.rpartition(":")
    proxy = LatencyProxy(args.upstream, args.delay_ms / 1000, int(port), host)

    async def run() -> None:
        await proxy._start()
        print(proxy.port, flush=True)
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
