"""`cachesvc up`: a whole local cluster on this machine.

Starts a metadata shard (three `cachesvc meta` nodes), an S3 server
(SeaweedFS on 127.0.0.1, data under the state directory) unless
`--s3-endpoint` names one, creates the bucket, starts `--nodes` cache servers
(default 1), each with its own L1 and L2, wired to both (they register with
the shard and heartbeat to it), checks a round trip through them (with a
routing client when there is a shard), prints the endpoints and writes them
to `STATE_DIR/cluster.json`; with `--demo` it then runs `cachesvc demo`
against itself. Runs until Ctrl-C or SIGTERM, then stops everything it
started, by pid. `--check` stops right after the round trip.

Meanwhile it supervises what it started (`cachesvc.devcluster.supervise`):
a cache server or metadata node that exits is reported and restarted on its
own state with a backoff (a cache server is marked down in the shard at
once). `cachesvc up --state-dir DIR --add-node` and `--remove-node
HOST:PORT`, from another shell, ask the running `up` to start one more
cache server or to drain, stop and remove one; `cluster.json` follows.

Default ports (all on 127.0.0.1; each can be set): cache 7070 (node i of
`--nodes` on 7070 + i), metadata 7080-7082 (`--meta-port` is the first), S3 8333,
SeaweedFS master 9333, volume 8080, filer 8888 (SeaweedFS also takes each of
its ports + 10000), Prometheus metrics 7170 onward (cache servers first, then
the metadata nodes; `cluster.json` lists them). A port already in use is an
error that names it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cacheclient import CacheClient, CacheClientError
from cacheclient.meta import MetaClient
from cachesvc.devcluster.procs import ManagedProcess, port_in_use
from cachesvc.devcluster.seaweed import S3_ACCESS_KEY, S3_SECRET_KEY, SeaweedFS, SeaweedPorts
from cachesvc.devcluster.shard import LocalShard
from cachesvc.devcluster.supervise import Requests, Supervisor, request

__all__ = ["DEFAULT_PORTS", "run_up"]

DEFAULT_PORTS = {
    "cache": 7070, "meta": 7080, "metrics": 7170, "s3": 8333, "master": 9333, "volume": 8080, "filer": 8888,
}  # fmt: skip


S3_STOP_GRACE = 5.0
"""Seconds SeaweedFS gets to exit on SIGTERM before SIGKILL: it often takes over 20 s, and what it
acknowledged is in its files already (a killed process loses nothing the kernel holds)."""


@dataclass
class _Stage:
    """Processes started together and stopped together (at once), with what to tell the user."""

    what: str
    stops: list[Callable[[], object]] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    note: str = ""

    def stop(self) -> None:
        said = [f"pid {', '.join(map(str, self.pids))}"] if self.pids else []
        said += [self.note] if self.note else []
        detail = f" ({'; '.join(said)})" if said else ""
        print(f"cachesvc up: stopping {self.what}{detail}", flush=True)
        _all_at_once(self.stops)


def _all_at_once(steps: list[Callable[[], object]]) -> None:
    threads = [threading.Thread(target=step, name="stop") for step in steps]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def run_up(args: argparse.Namespace) -> int:
    """Runs `cachesvc up` with the arguments its parser in `cachesvc.commands.cachesvc` gives; returns the status."""
    state = Path(args.state_dir).resolve()
    if args.add_node or args.remove_node:
        return _ask(state, args)
    state.mkdir(parents=True, exist_ok=True)
    if args.tokens:
        # A data and an admin token for the whole cluster (tenants need the admin one), unless given; every
        # part started below reads them from the environment, and cluster.json (mode 0600) keeps them.
        os.environ.setdefault("CACHESVC_SECURITY_TOKEN", secrets.token_urlsafe(32))
        os.environ.setdefault("CACHESVC_SECURITY_ADMIN_TOKEN", secrets.token_urlsafe(32))
    started: list[_Stage] = []
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        return _run(args, state, started, stop)
    except (OSError, RuntimeError, TimeoutError, ValueError) as exc:
        print(f"cachesvc up: {exc}", file=sys.stderr)
        return 1
    finally:
        began = time.monotonic()
        # Cache servers (started last) first: their write-back queues drain to
        # S3 and they leave the shard. Then S3 and the shard together.
        if started:
            started[-1].stop()
            _all_at_once([stage.stop for stage in started[:-1]])
        if started:
            print(f"cachesvc up: stopped ({time.monotonic() - began:.1f} s)", flush=True)


def _ask(state: Path, args: argparse.Namespace) -> int:
    """`--add-node` or `--remove-node`: asks the `cachesvc up` running on `state` and prints what it did."""
    try:
        if args.add_node:
            reply = request(state, "add", timeout=120.0)
        else:
            reply = request(state, "remove", timeout=120.0, address=args.remove_node)
    except (OSError, RuntimeError) as exc:
        print(f"cachesvc up: {exc}", file=sys.stderr)
        return 1
    if not reply.get("ok"):
        print(f"cachesvc up: {reply.get('error')}", file=sys.stderr)
        return 1
    if args.add_node:
        print(f"cachesvc up: added cache server {reply['address']} ({reply['name']}, pid {reply['pid']})")
    else:
        print(f"cachesvc up: drained and removed cache server {reply['address']} ({reply['name']})")
    return 0


def _run(args: argparse.Namespace, state: Path, started: list[_Stage], stop: threading.Event) -> int:
    if args.nodes < 1:
        raise ValueError(f"--nodes must be at least 1, got {args.nodes}")
    cache_ports = [args.cache_port + i for i in range(args.nodes)]
    for port in cache_ports:
        if port_in_use(port):
            raise OSError(f"cache port {port} is in use; pass --cache-port")
    meta_ports = [args.meta_port + i for i in range(args.meta_nodes)]
    for port in meta_ports:
        if port_in_use(port):
            raise OSError(f"metadata port {port} is in use; pass --meta-port")
    # Metrics: cache server i on --metrics-port + i, then the metadata nodes.
    metrics_ports = [args.metrics_port + i for i in range(args.nodes + args.meta_nodes)]
    for port in metrics_ports:
        if port_in_use(port):
            raise OSError(f"metrics port {port} is in use; pass --metrics-port")
    cache_metrics = [f"127.0.0.1:{port}" for port in metrics_ports[: args.nodes]]
    meta_addresses: list[str] = []
    meta_metrics: list[str] = []
    meta_pids: dict[str, int] = {}
    shard: LocalShard | None = None
    shard_stage: _Stage | None = None
    if meta_ports:
        print(f"cachesvc up: starting a {len(meta_ports)}-node metadata shard on ports {meta_ports}", flush=True)
        # One token for every server (CACHESVC_SECURITY_TOKEN); the shard's nodes get a peer secret of their own.
        token = os.environ.get("CACHESVC_SECURITY_TOKEN", "")
        shard = LocalShard(
            len(meta_ports),
            state / "meta",
            ports=meta_ports,
            metrics_ports=metrics_ports[args.nodes :],
            token=token,
            admin_token=os.environ.get("CACHESVC_SECURITY_ADMIN_TOKEN", ""),
            peer_token=secrets.token_urlsafe(32) if token else "",
        )
        shard_stage = _Stage("the metadata shard", [shard.stop])
        started.append(shard_stage)
        shard.start()
        shard_stage.pids = list(shard.pids().values())
        meta_pids = {f"meta{i}": pid for i, pid in shard.pids().items()}
        meta_addresses = shard.addresses
        meta_metrics = list(shard.metrics_address.values())
    access_key = os.environ.get("AWS_ACCESS_KEY_ID", S3_ACCESS_KEY) if args.s3_endpoint else S3_ACCESS_KEY
    secret_key = os.environ.get("AWS_SECRET_ACCESS_KEY", S3_SECRET_KEY) if args.s3_endpoint else S3_SECRET_KEY
    endpoint = args.s3_endpoint
    weed_pid = 0
    if endpoint is None:
        ports = SeaweedPorts(master=args.master_port, volume=args.volume_port, filer=args.filer_port, s3=args.s3_port)
        print(f"cachesvc up: starting SeaweedFS S3 on 127.0.0.1:{ports.s3} (data in {state / 's3'})", flush=True)
        weed = SeaweedFS(state / "s3", ports)
        stop_weed = functools.partial(weed.stop, grace=S3_STOP_GRACE)
        started.append(_Stage("SeaweedFS", [stop_weed], note=f"up to {S3_STOP_GRACE:.0f} s"))
        weed.start()
        assert weed.process is not None
        weed_pid = weed.process.pid
        started[-1].pids = [weed_pid]
        weed.create_bucket(args.bucket)
        endpoint = weed.endpoint
    env = dict(os.environ, CACHESVC_S3_ACCESS_KEY=access_key, CACHESVC_S3_SECRET_KEY=secret_key)
    fleet = _Fleet(args, state, endpoint, meta_addresses, env)
    cache_stage = _Stage(f"{len(cache_ports)} cache server{'s' if len(cache_ports) > 1 else ''}", [fleet.stop])
    started.append(cache_stage)
    for i, port in enumerate(cache_ports):
        print(f"cachesvc up: starting cache server on 127.0.0.1:{port}", flush=True)
        fleet.start(i, f"127.0.0.1:{port}", cache_metrics[i])
        cache_stage.pids = fleet.pids()
    for node in fleet.nodes.values():
        fleet.wait_ready(node)
    cache_addresses = fleet.addresses()
    if meta_addresses:
        _wait_registered(meta_addresses, cache_addresses)
        print(
            f"cachesvc up: {len(cache_addresses)} cache server{'s' if len(cache_addresses) > 1 else ''} registered "
            f"with the metadata shard ({','.join(meta_addresses)})"
        )
    # The start-up round trip: through the cache to S3 and back, routed by the
    # shard's placement (or a static one without a shard) when there are several nodes.
    data_token = os.environ.get("CACHESVC_SECURITY_TOKEN") or None
    if meta_addresses:
        client = CacheClient(meta=meta_addresses, timeout=10.0, token=data_token)
    elif len(cache_addresses) > 1:
        client = CacheClient(nodes=cache_addresses, timeout=10.0, token=data_token)
    else:
        client = CacheClient(cache_addresses[0], timeout=10.0, token=data_token)
    probes = {f"cachesvc-up/probe-{i}": os.urandom(64 << 10) for i in range(4 * len(cache_addresses))}
    began = time.perf_counter()
    client.put_many(probes)
    assert client.get_many(list(probes)) == list(probes.values())
    for key in probes:
        client.delete(key)
    print(f"cachesvc up: round trip through cache and S3 ok ({(time.perf_counter() - began) * 1e3:.1f} ms)")
    client.close()

    info: dict[str, Any] = {
        "cache": cache_addresses,
        "meta": meta_addresses,
        "s3_endpoint": endpoint,
        "bucket": args.bucket,
        "access_key": access_key,
        "secret_key": secret_key,
        "region": "us-east-1",
        "metrics": {"cache": cache_metrics, "meta": meta_metrics},
        "pids": {**fleet.pids_by_name(), **meta_pids, **({"s3": weed_pid} if weed_pid else {})},
    }
    if data_token:  # read by `cachectl --state-dir`
        info["token"] = data_token
        info["admin_token"] = os.environ.get("CACHESVC_SECURITY_ADMIN_TOKEN", "")
    cluster_file = state / "cluster.json"
    _write_info(cluster_file, info)
    print(f"cachesvc up: cache {','.join(cache_addresses)}  s3 {endpoint}  bucket {args.bucket}")
    print(
        f"cachesvc up: Prometheus /metrics on cache {','.join(cache_metrics)}"
        + (f"  meta {','.join(meta_metrics)}" if meta_metrics else "")
    )
    print(f"cachesvc up: endpoints and credentials in {cluster_file}")
    if args.demo:
        # Its own process: the demo forks DataLoader workers, and this one holds gRPC channels.
        demo = subprocess.run(
            [sys.executable, "-m", "cachesvc", "demo", "--state-dir", str(state)], timeout=900, check=False
        )
        if demo.returncode != 0:
            print(f"cachesvc up: the demo failed (exit {demo.returncode}); the cluster keeps running", file=sys.stderr)
    if args.check:
        return 0
    return _keep_running(state, stop, fleet, cache_stage, shard, shard_stage, info)


def _keep_running(
    state: Path,
    stop: threading.Event,
    fleet: _Fleet,
    cache_stage: _Stage,
    shard: LocalShard | None,
    shard_stage: _Stage | None,
    info: dict[str, Any],
) -> int:
    """Until Ctrl-C: restarts what exits (`Supervisor`) and serves `--add-node` and `--remove-node` requests."""
    supervisor = Supervisor(_say)
    for name in fleet.nodes:
        fleet.watch(supervisor, name)
    if shard is not None:
        _watch_shard(supervisor, shard)
    requests = Requests(state)
    print(
        f"cachesvc up: running; a node that exits is restarted. Another shell: `cachesvc up --state-dir {state} "
        "--add-node` adds a cache server, `--remove-node HOST:PORT` drains and removes one. Ctrl-C stops everything",
        flush=True,
    )
    while not stop.is_set():
        changed = supervisor.tend()
        for ident, body in requests.pending():
            requests.answer(ident, _serve_request(body, fleet, supervisor))
            changed.append(("", 0))
        if changed:
            info["cache"] = fleet.addresses()
            info["metrics"]["cache"] = fleet.metrics()
            info["pids"] = {**fleet.pids_by_name(), **{k: v for k, v in info["pids"].items() if k in ("s3",)}}
            if shard is not None and shard_stage is not None:
                info["pids"].update({f"meta{i}": pid for i, pid in shard.pids().items()})
                shard_stage.pids = list(shard.pids().values())
            cache_stage.pids = fleet.pids()
            cache_stage.what = f"{len(fleet.nodes)} cache server{'s' if len(fleet.nodes) > 1 else ''}"
            _write_info(state / "cluster.json", info)
        stop.wait(0.5)
    return 0


def _watch_shard(supervisor: Supervisor, shard: LocalShard) -> None:
    def restart(node_id: int) -> int:
        shard.start(node_id, wait=False)
        return shard.pids()[node_id]

    def reap(node_id: int) -> int | None:
        return shard.procs[node_id].stop(0.0)

    def tail(node_id: int) -> str:
        return shard.procs[node_id].tail(10)

    for i in shard.ids:
        supervisor.watch(
            f"meta{i}",
            f"metadata node {shard.address[i]}",
            start=functools.partial(restart, i),
            alive=functools.partial(shard.alive, i),
            reap=functools.partial(reap, i),
            tail=functools.partial(tail, i),
        )


def _serve_request(body: dict[str, Any], fleet: _Fleet, supervisor: Supervisor) -> dict[str, Any]:
    """Does what another shell asked (`--add-node`, `--remove-node`); the reply says what happened."""
    try:
        if body.get("op") == "add":
            node = fleet.add()
            fleet.watch(supervisor, node.name)
            _say(f"cache server {node.address} ({node.name}) added; it owns a share of the slots now")
            return {"ok": True, "name": node.name, "address": node.address, "pid": node.process.pid}
        if body.get("op") == "remove":
            address = str(body.get("address", ""))
            name = fleet.name_of(address)
            supervisor.forget(name)
            _say(f"draining cache server {address} ({name}): its slots move to the others")
            fleet.remove(name)
            _say(f"cache server {address} ({name}) drained, stopped and removed from the shard")
            return {"ok": True, "name": name, "address": address}
        return {"ok": False, "error": f"unknown request {body.get('op')!r}"}
    except (OSError, RuntimeError, ValueError, CacheClientError) as exc:
        _say(f"request {body.get('op')!r} failed: {exc}")
        return {"ok": False, "error": str(exc)}


def _say(line: str) -> None:
    print(f"cachesvc up: {line}", flush=True)


def _write_info(path: Path, info: dict[str, Any]) -> None:
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(info, indent=2) + "\n")
    partial.chmod(0o600)
    os.replace(partial, path)


@dataclass
class _CacheNode:
    name: str
    index: int
    address: str
    metrics: str
    process: ManagedProcess


class _Fleet:
    """`up`'s cache servers by name ("cache", "cache-1", ...): started, restarted, added, drained and removed.

    Node i keeps its L2 (`STATE_DIR/l2-i`, `l2` for node 0) and its log across
    restarts: a restarted node serves what it held.
    """

    def __init__(
        self, args: argparse.Namespace, state: Path, endpoint: str, meta_addresses: list[str], env: dict[str, str]
    ) -> None:
        self.args = args
        self.state = state
        self.endpoint = endpoint
        self.meta_addresses = meta_addresses
        self.env = env
        self.nodes: dict[str, _CacheNode] = {}
        self._token = os.environ.get("CACHESVC_SECURITY_ADMIN_TOKEN") or os.environ.get("CACHESVC_SECURITY_TOKEN")

    def _process(self, index: int, address: str, metrics: str) -> ManagedProcess:
        # Node 0 keeps the names a one-node cluster always had.
        suffix = "" if index == 0 else f"-{index}"
        argv = [
            sys.executable, "-m", "cachesvc", "serve",
            "--listen", address,
            "--l1-bytes", str(self.args.l1_bytes),
            "--l2-path", str(self.state / f"l2{suffix}"),
            "--l2-bytes", str(self.args.l2_bytes),
            "--s3-endpoint", self.endpoint,
            "--s3-bucket", self.args.bucket,
            "--metrics-listen", metrics,
            *(["--meta", ",".join(self.meta_addresses)] if self.meta_addresses else []),
        ]  # fmt: skip
        name = f"cache{suffix}"
        env = dict(self.env)
        env.setdefault("CACHESVC_L1_SHARED", "true")  # every client of a local cluster is on its machine
        return ManagedProcess(name, argv, self.state / "logs" / f"{name}.log", env=env)

    def start(self, index: int, address: str, metrics: str) -> _CacheNode:
        process = self._process(index, address, metrics)
        node = _CacheNode(process.name, index, address, metrics, process)
        self.nodes[node.name] = node
        return node

    def restart(self, name: str) -> int:
        node = self.nodes[name]
        if port_in_use(int(node.address.rpartition(":")[2])):
            raise RuntimeError(f"port of {node.address} is in use")
        node.process = self._process(node.index, node.address, node.metrics)
        return node.process.pid

    def wait_ready(self, node: _CacheNode) -> None:
        plain = CacheClient(node.address, timeout=10.0)
        try:
            plain.wait_ready(timeout=30.0)
        except Exception as exc:
            raise RuntimeError(
                f"cache server did not start: {exc}\n--- {node.process.log_path.name} ---\n{node.process.tail()}"
            ) from exc
        finally:
            plain.close()

    def watch(self, supervisor: Supervisor, name: str) -> None:
        node = self.nodes[name]
        supervisor.watch(
            name,
            f"cache server {node.address}",
            start=functools.partial(self.restart, name),
            alive=lambda: self.nodes[name].process.alive(),
            reap=lambda: self.nodes[name].process.stop(0.0),
            tail=lambda: self.nodes[name].process.tail(10),
            on_exit=functools.partial(self.mark_down, node.address) if self.meta_addresses else None,
        )

    def _meta(self) -> MetaClient:
        return MetaClient(self.meta_addresses, timeout=5.0, token=self._token or None)

    def mark_down(self, address: str) -> None:
        """Down in the shard at once (unless drained): clients move its keys now, not after its lease."""
        with self._meta() as meta:
            if {n.address: n.state for n in meta.nodes()}.get(address) in ("up", "joining"):
                meta.set_node_state(address, "down")
                _say(f"cache server {address} marked down in the metadata shard; its keys go to the others")

    def add(self) -> _CacheNode:
        """Starts one more cache server on the next free ports; returns once it owns slots."""
        index = max(n.index for n in self.nodes.values()) + 1
        port = _next_free(max(int(n.address.rpartition(":")[2]) for n in self.nodes.values()) + 1)
        metrics = _next_free(max(int(n.metrics.rpartition(":")[2]) for n in self.nodes.values()) + 1)
        node = self.start(index, f"127.0.0.1:{port}", f"127.0.0.1:{metrics}")
        self.wait_ready(node)
        if self.meta_addresses:
            _wait_registered(self.meta_addresses, [node.address])
        return node

    def name_of(self, address: str) -> str:
        for node in self.nodes.values():
            if node.address == address:
                return node.name
        raise ValueError(f"{address} is not one of this cluster's cache servers ({', '.join(self.addresses())})")

    def remove(self, name: str, timeout: float = 60.0) -> None:
        """Drains the node (its slots move), stops it, and forgets it in the shard."""
        if len(self.nodes) < 2:
            raise ValueError("the last cache server cannot be removed")
        node = self.nodes[name]
        if self.meta_addresses:
            with self._meta() as meta:
                meta.set_node_state(node.address, "draining")
                deadline = time.monotonic() + timeout
                while node.address in meta.placement(refresh=True).nodes:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{node.address} still owns slots after {timeout:.0f} s")
                    time.sleep(0.1)
                node.process.stop(grace=20.0)
                meta.remove_node(node.address)
        else:
            node.process.stop(grace=20.0)
        del self.nodes[name]

    def stop(self) -> None:
        _all_at_once([functools.partial(n.process.stop, 20.0) for n in self.nodes.values()])

    def addresses(self) -> list[str]:
        return [n.address for n in self.nodes.values()]

    def metrics(self) -> list[str]:
        return [n.metrics for n in self.nodes.values()]

    def pids(self) -> list[int]:
        return [n.process.pid for n in self.nodes.values()]

    def pids_by_name(self) -> dict[str, int]:
        return {n.name: n.process.pid for n in self.nodes.values()}


def _next_free(port: int) -> int:
    while port_in_use(port):
        port += 1
    return port


def _wait_registered(meta_addresses: list[str], cache_addresses: list[str], timeout: float = 30.0) -> None:
    """Until every cache server is registered, up, and in the placement map."""
    client = MetaClient(meta_addresses, timeout=5.0, token=os.environ.get("CACHESVC_SECURITY_TOKEN") or None)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                if set(client.placement(refresh=True).nodes) >= set(cache_addresses):
                    return
            except CacheClientError:
                pass
            time.sleep(0.2)
        raise RuntimeError(
            f"cache servers {', '.join(cache_addresses)} did not all join the metadata shard's placement "
            f"in {timeout:.0f}s"
        )
    finally:
        client.close()
