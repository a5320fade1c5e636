"""`cachesvc serve --processes N` on this machine (issue 15): 1 against 2 engine processes, and the cost per core.

One metadata node, one SeaweedFS, and one `cachesvc serve --processes P`
(P = 1, then 2) with the same machine budget (L1 512 MiB, L2 1 GiB, split
evenly between the processes). For each P:

* warm gets: `--clients` client processes (spawned, each with a routing
  `CacheClient(meta=...)`) read random batches of a warm set for
  `--seconds` seconds (4 KiB values in batches of 64, 1 MiB values in
  batches of 4), as `bench/cluster.py` measures them; CPU per GiB served is
  each engine process's utime + stime over the timed window;
* cold fills: `--cold-objects` objects of 100 KiB are put in S3 directly,
  then the client processes read disjoint slices of them once through the
  cache, 16 keys per `get_many` (every read an L3 fill). Reported: objects
  per second and the engine processes' CPU per object filled.

On 2 cores the clients, SeaweedFS and the engine processes share the cores,
so 2 processes cannot double the rate here; what projects is the CPU per GiB
and per fill of one process: a machine with C cores and C engine processes
serves about C / (CPU s per GiB) GiB/s while clients and the network keep up
(each process owns its keys; processes share nothing on the read path). See
"projection" in the JSON.

Usage:
    python bench/processes.py          # about 3 minutes on 2 cores

Writes bench/results/processes.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _machine
from cluster import Cluster, client_reports, cpu_seconds, spawn_clients, throughput

from cacheclient import CacheClient
from cachesvc.devcluster.procs import ManagedProcess, child_pids, free_port, listen_port, port_in_use, wait_for_port
from cachesvc.devcluster.seaweed import S3_ACCESS_KEY, S3_SECRET_KEY, s3_client

BENCH_DIR = Path(__file__).resolve().parent
L1_BYTES = "512MiB"
L2_BYTES = "1GiB"
COLD_BYTES = 100 << 10
COLD_BATCH = 16


@dataclass
class Engine:
    """One engine process of the supervised server, as `cluster.throughput` sees a node."""

    address: str
    pid: int

    def stop(self) -> None:
        """The supervisor stops its engine processes."""


def start_server(cluster: Cluster, processes: int) -> tuple[ManagedProcess, list[Engine]]:
    """`cachesvc serve --processes N` in the cluster; the supervisor and its engine processes once all are placed."""
    port = free_port()
    while any(port_in_use(port + i) for i in range(1, processes)):  # the processes listen on port + i
        port = free_port()
    argv = [
        sys.executable, "-m", "cachesvc", "serve", "--listen", f"127.0.0.1:{port}", "--config", str(cluster.config),
        "--processes", str(processes), "--l1-bytes", L1_BYTES, "--l2-bytes", L2_BYTES,
        "--l2-path", str(cluster.work / f"l2-p{processes}"), "--meta", cluster.meta_arg,
        "--s3-endpoint", cluster.weed.endpoint, "--s3-bucket", "cachesvc-bench", "--s3-prefix", "bench/",
    ]  # fmt: skip
    env = {
        **os.environ,
        "CACHESVC_S3_ACCESS_KEY": S3_ACCESS_KEY,
        "CACHESVC_S3_SECRET_KEY": S3_SECRET_KEY,
        "CACHESVC_META_HEARTBEAT_SECONDS": "0.3",
    }
    server = ManagedProcess(f"serve-p{processes}", argv, cluster.work / "logs" / f"serve-p{processes}.log", env)
    addresses = [f"127.0.0.1:{port + i}" for i in range(processes)]
    for i in range(processes):
        wait_for_port(port + i, timeout=60.0, proc=server.proc)
    cluster.wait_nodes(addresses)
    # One process serves itself; N > 1 are the supervisor's children.
    pids = child_pids(server.pid) if processes > 1 else [server.pid]
    by_port = {listen_port(p): p for p in pids}
    return server, [Engine(a, by_port[port + i]) for i, a in enumerate(addresses)]


def cold_worker(meta: str, keys: list[str], start_at: float, out: Any) -> None:
    """A client process: reads `keys` once through the cache, `COLD_BATCH` at a time, from `start_at`."""
    try:
        with CacheClient(meta=meta, timeout=60.0) as client:
            client.get_many(["warmup/none"])  # connects before the clock
            while time.time() < start_at:
                time.sleep(0.005)
            began = time.monotonic()
            wrong = 0
            for i in range(0, len(keys), COLD_BATCH):
                chunk = keys[i : i + COLD_BATCH]
                for value in client.get_many(chunk):
                    wrong += value is None or len(value) != COLD_BYTES
            out.put({"elapsed": time.monotonic() - began, "objects": len(keys), "wrong": wrong})
    except BaseException as exc:
        out.put({"error": repr(exc)})


def cold_fills(cluster: Cluster, engines: list[Engine], label: str, objects: int, clients: int) -> dict[str, Any]:
    s3: Any = s3_client(cluster.weed.endpoint)
    body = os.urandom(COLD_BYTES)
    keys = [f"cold/{label}/{i:06d}" for i in range(objects)]
    for key in keys:
        s3.put_object(Bucket="cachesvc-bench", Key="bench/" + key, Body=body)
    start_at = time.time() + 6.0
    procs, out = spawn_clients(
        cold_worker, [(cluster.meta_arg, keys[i::clients], start_at) for i in range(clients)], start_at
    )
    cpu0 = sum(cpu_seconds(e.pid) for e in engines)
    reports = client_reports(procs, out, timeout=600.0)
    cpu = sum(cpu_seconds(e.pid) for e in engines) - cpu0
    elapsed = max(r["elapsed"] for r in reports)
    return {
        "objects": objects,
        "object_bytes": COLD_BYTES,
        "objects_per_s": round(objects / elapsed),
        "engine_cpu_ms_per_object": round(cpu / objects * 1e3, 3),
        "wrong": sum(r["wrong"] for r in reports),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4, help="client processes (default 4)")
    parser.add_argument("--seconds", type=float, default=6.0, help="timed window per warm figure (default 6)")
    parser.add_argument("--cold-objects", type=int, default=2000, help="100 KiB objects per cold read (default 2000)")
    parser.add_argument("--out", default=str(BENCH_DIR / "results" / "processes.json"))
    args = parser.parse_args()
    info = _machine.machine_info()
    began = time.monotonic()
    by_processes: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="processes-bench-") as tmp:
        for processes in (1, 2):
            cluster = Cluster(Path(tmp) / f"p{processes}")
            server: ManagedProcess | None = None
            try:
                cluster.start()
                server, engines = start_server(cluster, processes)
                cluster.servers = engines  # type: ignore[assignment]
                print(f"--processes {processes}: warm gets for {args.seconds:g} s per size, then cold fills")
                warm = throughput(cluster, args.clients, args.seconds)
                cold = cold_fills(cluster, engines, f"p{processes}", args.cold_objects, args.clients)
                by_processes[str(processes)] = {"warm": warm, "cold_100KiB": cold}
            finally:
                if server is not None:
                    server.stop(grace=60.0)
                cluster.servers = []
                cluster.stop()
    one, two = by_processes["1"], by_processes["2"]
    ratios = {
        f"warm_{label}": round(two["warm"][label]["values_per_s"] / one["warm"][label]["values_per_s"], 2)
        for label in one["warm"]
    }
    ratios["cold_100KiB"] = round(two["cold_100KiB"]["objects_per_s"] / one["cold_100KiB"]["objects_per_s"], 2)
    projection = {}
    for label, r in two["warm"].items():
        per_gib = r["node_cpu_seconds_per_gib_mean"]
        projection[f"warm_{label}_gib_per_s_per_core"] = round(1 / per_gib, 3) if per_gib else None
        projection[f"warm_{label}_32_cores_gib_per_s"] = round(32 / per_gib, 1) if per_gib else None
    fill_ms = two["cold_100KiB"]["engine_cpu_ms_per_object"]
    projection["cold_100KiB_fills_per_s_per_core"] = round(1e3 / fill_ms) if fill_ms else None
    projection["cold_100KiB_32_cores_fills_per_s"] = round(32e3 / fill_ms) if fill_ms else None
    result = {
        "command": "python bench/processes.py",
        "machine": info,
        "wall_seconds": round(time.monotonic() - began, 1),
        "plan": {"clients": args.clients, "seconds": args.seconds, "l1": L1_BYTES, "l2": L2_BYTES},
        "by_processes": by_processes,
        "two_over_one": ratios,
        "projection": projection,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"\n{'processes':<11}{'4KiB values/s':>15}{'s/GiB':>8}{'1MiB MiB/s':>12}{'s/GiB':>8}"
        f"{'cold obj/s':>12}{'ms/fill':>9}"
    )
    for p, r in by_processes.items():
        w4, w1, c = r["warm"]["4KiB"], r["warm"]["1MiB"], r["cold_100KiB"]
        print(
            f"{p:<11}{w4['values_per_s']:>15,}{w4['node_cpu_seconds_per_gib_mean'] or 0:>8.2f}"
            f"{w1['mib_per_s']:>12,.0f}{w1['node_cpu_seconds_per_gib_mean'] or 0:>8.2f}"
            f"{c['objects_per_s']:>12,}{c['engine_cpu_ms_per_object']:>9.2f}"
        )
    print(f"2 over 1: {ratios}")
    print(f"projection: {projection}")
    print(f"wrote {out} in {result['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
