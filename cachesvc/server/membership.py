"""A cache server's membership in the metadata shard: register once, then heartbeat.

Runs beside the gRPC server in one thread. Registration retries with a
bounded backoff until the shard answers; heartbeats go every `interval`
seconds with the server's used bytes, each with a deadline. Failures are
logged and retried: a shard outage never stops the cache from serving.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from cacheclient.errors import CacheClientError
from cacheclient.meta import MetaClient

__all__ = ["Membership"]

log = logging.getLogger(__name__)


class Membership:
    """Keeps `address` registered and alive in the shard at `meta_addresses`."""

    def __init__(
        self,
        meta_addresses: list[str],
        address: str,
        capacity_bytes: int,
        used_bytes: Callable[[], int],
        interval: float = 2.0,
    ) -> None:
        self._client = MetaClient(meta_addresses, timeout=5.0)
        self._address = address
        self._capacity = capacity_bytes
        self._used = used_bytes
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="membership", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        backoff = 0.2
        while not self._stop.is_set():
            try:
                self._client.register_node(self._address, self._capacity)
                log.info("registered %s with the metadata shard", self._address)
                break
            except CacheClientError as exc:
                log.warning("metadata shard not reachable yet: %s", exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
        while not self._stop.wait(self._interval):
            try:
                self._client.heartbeat(self._address, self._used())
            except CacheClientError as exc:
                log.warning("heartbeat to the metadata shard failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)
        self._client.close()
