"""A TCP proxy that adds a fixed delay to every request, as a remote object store would.

Put it between an S3 client and a local S3 server to see what a job meets on
a real network: every HTTP request (the first bytes a client sends after the
previous response began) waits `delay` seconds before it is forwarded; bodies
and responses then flow at full speed. Connections are kept alive as the
client keeps them.

Run as a process (`python bench/latency_proxy.py --upstream 127.0.0.1:8333
--delay-ms 20 --listen 127.0.0.1:0`, which prints the port it listens on), or
in a thread of the caller (`LatencyProxy(...).start()`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import threading
from collections.abc import Awaitable, Callable

__all__ = ["LatencyProxy", "stop_loop"]

_BUFFER = 256 << 10


class LatencyProxy:
    """Listens on 127.0.0.1:`port` (0: any free one) and forwards to `upstream` ("host:port") after `delay` s."""

    def __init__(self, upstream: str, delay: float, port: int = 0, host: str = "127.0.0.1") -> None:
        upstream_host, _, upstream_port = upstream.rpartition(":")
        self.upstream = (upstream_host, int(upstream_port))
        self.delay = delay
        self.host = host
        self.port = port
        self.requests = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def _pump_requests(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answered: asyncio.Event
    ) -> None:
        while data := await reader.read(_BUFFER):
            if answered.is_set():
                # The first bytes of a new request: the network's round trip.
                answered.clear()
                self.requests += 1
                await asyncio.sleep(self.delay)
            writer.write(data)
            await writer.drain()

    @staticmethod
    async def _pump_responses(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answered: asyncio.Event
    ) -> None:
        while data := await reader.read(_BUFFER):
            answered.set()
            writer.write(data)
            await writer.drain()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_writer.close()
            return
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
