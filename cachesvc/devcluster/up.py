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

from cacheclient import CacheClient, CacheClientError
from cacheclient.meta import MetaClient
from cachesvc.devcluster.procs import ManagedProcess, port_in_use
from cachesvc.devcluster.seaweed import S3_ACCESS_KEY, S3_SECRET_KEY, SeaweedFS, SeaweedPorts
from cachesvc.devcluster.shard import LocalShard

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
    state.mkdir(parents=True, exist_ok=True)
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
        stage = _Stage("the metadata shard", [shard.stop])
        started.append(stage)
        shard.start()
        stage.pids = list(shard.pids().values())
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
    cache_addresses = [f"127.0.0.1:{port}" for port in cache_ports]
    env = dict(os.environ, CACHESVC_S3_ACCESS_KEY=access_key, CACHESVC_S3_SECRET_KEY=secret_key)
    servers: list[ManagedProcess] = []
    cache_stage = _Stage(f"{len(cache_addresses)} cache server{'s' if len(cache_addresses) > 1 else ''}")
    started.append(cache_stage)
    for i, address in enumerate(cache_addresses):
        # Node 0 keeps the names a one-node cluster always had.
        suffix = "" if i == 0 else f"-{i}"
        argv = [
            sys.executable, "-m", "cachesvc", "serve",
            "--listen", address,
            "--l1-bytes", str(args.l1_bytes),
            "--l2-path", str(state / f"l2{suffix}"),
            "--l2-bytes", str(args.l2_bytes),
            "--s3-endpoint", endpoint,
            "--s3-bucket", args.bucket,
            "--metrics-listen", cache_metrics[i],
            *(["--meta", ",".join(meta_addresses)] if meta_addresses else []),
        ]  # fmt: skip
        print(f"cachesvc up: starting cache server on {address}", flush=True)
        server = ManagedProcess(f"cache{suffix}", argv, state / "logs" / f"cache{suffix}.log", env=env)
        cache_stage.stops.append(functools.partial(server.stop, grace=20.0))
        cache_stage.pids.append(server.pid)
        servers.append(server)
    for address, server in zip(cache_addresses, servers, strict=True):
        plain = CacheClient(address, timeout=10.0)
        try:
            plain.wait_ready(timeout=30.0)
        except Exception as exc:
            raise RuntimeError(
                f"cache server did not start: {exc}\n--- {server.log_path.name} ---\n{server.tail()}"
            ) from exc
        finally:
            plain.close()
    if meta_addresses:
        _wait_registered(meta_addresses, cache_addresses)
        print(
            f"cachesvc up: {len(cache_addresses)} cache server{'s' if len(servers) > 1 else ''} registered with "
            f"the metadata shard ({','.join(meta_addresses)})"
        )
    # The start-up round trip: through the cache to S3 and back, routed by the
    # shard's placement (or a static one without a shard) when there are several nodes.
    if meta_addresses:
        client = CacheClient(meta=meta_addresses, timeout=10.0)
    elif len(cache_addresses) > 1:
        client = CacheClient(nodes=cache_addresses, timeout=10.0)
    else:
        client = CacheClient(cache_addresses[0], timeout=10.0)
    probes = {f"cachesvc-up/probe-{i}": os.urandom(64 << 10) for i in range(4 * len(cache_addresses))}
    began = time.perf_counter()
    client.put_many(probes)
    assert client.get_many(list(probes)) == list(probes.values())
    for key in probes:
        client.delete(key)
    print(f"cachesvc up: round trip through cache and S3 ok ({(time.perf_counter() - began) * 1e3:.1f} ms)")
    client.close()

    info = {
        "cache": cache_addresses,
        "meta": meta_addresses,
        "s3_endpoint": endpoint,
        "bucket": args.bucket,
        "access_key": access_key,
        "secret_key": secret_key,
        "region": "us-east-1",
        "metrics": {"cache": cache_metrics, "meta": meta_metrics},
        "pids": {
            **{server.name: server.pid for server in servers},
            **meta_pids,
            **({"s3": weed_pid} if weed_pid else {}),
        },
    }
    cluster_file = state / "cluster.json"
    cluster_file.write_text(json.dumps(info, indent=2) + "\n")
    cluster_file.chmod(0o600)
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
    print("cachesvc up: running; Ctrl-C stops everything", flush=True)
    while not stop.is_set():
        for server in servers:
            if not server.alive():
                print(f"cachesvc up: cache server {server.name} exited\n{server.tail()}", file=sys.stderr)
                return 1
        stop.wait(1.0)
    return 0


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
