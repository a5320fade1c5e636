"""A metadata shard of `cachesvc meta` processes on this machine.

`LocalShard` starts N nodes on 127.0.0.1 ports picked here, each in its own
session with its own data directory, and stops, kills or restarts any of
them by pid. `cachesvc up`, the tests and the benchmarks use it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cacheclient.errors import CacheClientError
from cacheclient.meta import MetaClient
from cachesvc.devcluster.procs import ManagedProcess, free_port

__all__ = ["LocalShard"]


class LocalShard:
    """N metadata nodes as local processes (ids 1..N)."""

    def __init__(
        self,
        n: int,
        base_dir: Path,
        *,
        args: Sequence[str] = (),
        env: Mapping[int, Mapping[str, str]] | None = None,
        ports: Sequence[int] | None = None,
        routes: Mapping[int, Mapping[int, str]] | None = None,
        metrics_ports: Sequence[int] | None = None,
        token: str = "",
        peer_token: str = "",
        admin_token: str = "",
        tls_cert: str = "",
        tls_key: str = "",
        tls_ca: str = "",
    ) -> None:
        """Pick ports; start nothing yet.

        Args:
            n: Number of nodes.
            base_dir: Data directories and logs go under it.
            args: Extra `cachesvc meta` flags for every node.
            env: Extra environment per node id (a failpoint, say).
            ports: The nodes' ports, in id order; default: free ones.
            routes: Where node i reaches node j (`routes[i][j]`, HOST:PORT)
                when not at j's address: a proxy between the two, so a test
                can cut any link in either direction. Default: addresses.
            metrics_ports: Where each node serves Prometheus metrics, in id
                order; default: none.
            token: Bearer token every node requires of clients ("": none);
                `client()` and the shard's own checks present it.
            peer_token: The secret the nodes present to each other; required with `token`.
            admin_token: The admin scope's token ("": `token` grants it);
                `client()` and the shard's own checks present it when set.
            tls_cert, tls_key: PEM files: every node serves TLS with them
                (one certificate for all, valid for 127.0.0.1).
            tls_ca: The CA (PEM file) that signed it: the nodes verify their
                peers with it, and `client()` and the shard's checks trust it.
        """
        self.base_dir = Path(base_dir)
        self.ids = list(range(1, n + 1))
        if ports is not None and len(ports) != n:
            raise ValueError(f"{len(ports)} ports for {n} nodes")
        self.address = {i: f"127.0.0.1:{ports[i - 1] if ports else free_port()}" for i in self.ids}
        if metrics_ports is not None and len(metrics_ports) != n:
            raise ValueError(f"{len(metrics_ports)} metrics ports for {n} nodes")
        self.routes = {i: {**self.address, **(routes or {}).get(i, {}), i: self.address[i]} for i in self.ids}
        """Where each node reaches each member (itself at its own address)."""
        self.metrics_address = {i: f"127.0.0.1:{metrics_ports[i - 1]}" for i in self.ids} if metrics_ports else {}
        """Each node's /metrics address (HOST:PORT), when it serves metrics."""
        self.args = list(args)
        self.env: dict[int, dict[str, str]] = {i: dict((env or {}).get(i, {})) for i in self.ids}
        self.token = admin_token or token
        """The token `client()` presents: the admin one when there is one."""
        self.tls_ca = tls_ca or None
        self._security_env = {
            name: value
            for name, value in (
                ("CACHESVC_META_NODE_SECURITY_TOKEN", token),
                ("CACHESVC_META_NODE_SECURITY_PEER_TOKEN", peer_token),
                ("CACHESVC_META_NODE_SECURITY_ADMIN_TOKEN", admin_token),
                ("CACHESVC_META_NODE_SECURITY_TLS_CERT", tls_cert),
                ("CACHESVC_META_NODE_SECURITY_TLS_KEY", tls_key),
                ("CACHESVC_META_NODE_SECURITY_TLS_CA", tls_ca),
            )
            if value
        }
        self.procs: dict[int, ManagedProcess] = {}
        self._client = MetaClient(
            list(self.address.values()), timeout=5.0, attempt_timeout=0.5, token=self.token, tls_ca=self.tls_ca
        )

    def peers_arg(self, node_id: int) -> str:
        """Node `node_id`'s --peers: every member as it reaches them."""
        return ",".join(f"{i}={a}" for i, a in self.routes[node_id].items())

    @property
    def addresses(self) -> list[str]:
        return list(self.address.values())

    def client(self, **kwargs: Any) -> MetaClient:
        """A new client of every node (presenting the shard's token, and trusting its CA, unless told otherwise)."""
        kwargs.setdefault("token", self.token)
        kwargs.setdefault("tls_ca", self.tls_ca)
        return MetaClient(self.addresses, **kwargs)

    # -- processes ----------------------------------------------------------

    def start(self, node_id: int | None = None, *, wait: bool = True) -> None:
        """Start one node (or all); with `wait`, until each answers."""
        ids = self.ids if node_id is None else [node_id]
        for i in ids:
            argv = [
                sys.executable,
                "-m",
                "cachesvc",
                "meta",
                "--id",
                str(i),
                "--listen",
                self.address[i],
                "--peers",
                self.peers_arg(i),
                "--data-dir",
                str(self.base_dir / f"node{i}"),
                *(["--metrics-listen", self.metrics_address[i]] if i in self.metrics_address else []),
                *self.args,
            ]
            env = dict(os.environ)
            env.pop("CACHESVC_FAILPOINT", None)
            env.update(self._security_env)
            env.update(self.env[i])
            self.procs[i] = ManagedProcess(f"meta{i}", argv, self.base_dir / "logs" / f"meta{i}.log", env=env)
        if wait:
            for i in ids:
                self.wait_serving(i)

    def wait_serving(self, node_id: int, timeout: float = 30.0) -> None:
        """Until node `node_id` answers a status call.

        Raises:
            RuntimeError: it exited or did not answer in time.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self.procs[node_id]
            if not proc.alive():
                raise RuntimeError(f"meta node {node_id} exited ({proc.proc.returncode}):\n{proc.tail()}")
            try:
                self._client.status(self.address[node_id], timeout=0.5)
                return
            except CacheClientError:
                time.sleep(0.05)
        raise RuntimeError(f"meta node {node_id} did not answer in {timeout:.0f}s:\n{self.procs[node_id].tail()}")

    def alive(self, node_id: int) -> bool:
        proc = self.procs.get(node_id)
        return proc is not None and proc.alive()

    def kill(self, node_id: int) -> None:
        """SIGKILL one node (a crash)."""
        self.procs[node_id].kill()

    def restart(self, node_id: int, *, env: Mapping[str, str] | None = None, wait: bool = True) -> None:
        """Kill a node if it runs, then start it again on its data directory."""
        if self.alive(node_id):
            self.kill(node_id)
        if env is not None:
            self.env[node_id] = dict(env)
        self.start(node_id, wait=wait)

    def pids(self) -> dict[int, int]:
        """The pid of each node started."""
        return {i: proc.pid for i, proc in self.procs.items()}

    def stop(self) -> None:
        """SIGTERM every node, SIGKILL after a grace period."""
        for proc in self.procs.values():
            if proc.alive():
                proc.stop(grace=10.0)
        self._client.close()

    def __enter__(self) -> LocalShard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- observing ------------------------------------------------------------

    def status(self, node_id: int, timeout: float = 1.0, state_digest: bool = False) -> dict[str, Any] | None:
        """One node's status, or None if it does not answer."""
        if not self.alive(node_id):
            return None
        try:
            return self._client.status(self.address[node_id], state_digest=state_digest, timeout=timeout)
        except CacheClientError:
            return None

    def leader(self, *, timeout: float = 10.0, newer_than: int = 0, poll: float = 0.02) -> tuple[int, int]:
        """(id, term) of a node that says it leads, in a term above `newer_than`.

        Raises:
            TimeoutError: none within `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            best: tuple[int, int] | None = None
            for i in self.ids:
                s = self.status(i, timeout=0.3)
                if s and s["role"] == "leader" and s["term"] > newer_than and (best is None or s["term"] > best[1]):
                    best = (i, s["term"])
            if best is not None:
                return best
            if time.monotonic() > deadline:
                raise TimeoutError(f"no leader above term {newer_than} within {timeout}s")
            time.sleep(poll)

    def wait_agreement(self, timeout: float = 20.0) -> dict[int, dict[str, Any]]:
        """Until every running node has applied the same index with the same state digest.

        Returns:
            Each running node's status at that point.

        Raises:
            TimeoutError: they did not agree in time (the last statuses are in the message).
        """
        deadline = time.monotonic() + timeout
        statuses: dict[int, dict[str, Any] | None] = {}
        while time.monotonic() < deadline:
            statuses = {i: self.status(i, state_digest=True) for i in self.ids if self.alive(i)}
            values = list(statuses.values())
            if (
                values
                and all(s is not None for s in values)
                and len({(s["applied"], s["state_digest"]) for s in values if s}) == 1
                and all(s["commit"] == s["applied"] for s in values if s)
            ):
                return {i: s for i, s in statuses.items() if s is not None}
            time.sleep(0.1)
        raise TimeoutError(f"nodes did not agree within {timeout}s: {statuses}")
