"""Metadata-shard benchmark: three local `cachesvc meta` nodes, measured from clients.

What it measures, each on a fresh three-node shard on 127.0.0.1 (LMDB log,
fsync whenever entries, a vote or a snapshot are persisted):

* committed writes per second and commit latency (p50/p99) of
  `MetaClient.put_manifest`, one write per call, with 1 client and with 16
  concurrent clients (16 threads over 4 processes, so the clients' own GIL is
  not the bottleneck), on a shard with proposal batching (default) and one
  with `--no-batching` (one log entry and one fsync per request);
* the same 16 clients sending 32 writes per call (`MetaClient.propose`), the
  batch-first form of the API;
* linearizable read latency (`get_manifest`, a ReadIndex round each) and a
  stale read (`stale=True`, no consensus round) for comparison;
* election time after a SIGKILL of the leader: from the kill to a surviving
  node reporting itself leader of a newer term (status polled every 10 ms),
  p50/p95 over `--kills` kills, on a fresh shard without load (the killed
  node is restarted after each kill);
* placement look-ups from the client's cached map (`MetaClient.locate`),
  with 16 cache nodes registered and heartbeating;
* for context, the floor of the stack: unary calls per second that the
  leader's gRPC server answers with 16 clients when a call does no work
  (`Leader`, answered locally); a write of one command per call cannot beat it;
* and the latency of one fsync'd LMDB commit on this disk before and
  after the run (two of them sit on every write's path: leader, then follower).

Usage:
    python bench/meta.py            # full run, about 2 minutes on 2 cores
    python bench/meta.py --quick    # shorter phases, 5 kills

Writes `bench/results/meta.json` and prints a table with the targets of
issue 4: >= 5,000 committed small writes/s with batching, p50 commit latency
< 10 ms with one client, placement look-up < 5 us.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from importlib import metadata
from multiprocessing import get_context
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "client")]

from cacheclient.meta import MetaClient  # noqa: E402
from cacheclient.wire import meta_pb2 as pb  # noqa: E402
from cachesvc.devcluster.shard import LocalShard  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def _load(addresses: list[str], threads: int, duration: float, per_call: int, tag: str) -> list[float]:
    """Run in a worker process: `threads` clients writing back to back; returns per-call latencies (s)."""
    latencies: list[float] = []
    lock = threading.Lock()
    start_at = time.time() + 0.5  # All workers start together.
    stop_at = start_at + duration

    def run(t: int) -> None:
        client = MetaClient(addresses, timeout=10.0)
        mine = []
        n = 0
        while time.time() < start_at:
            time.sleep(0.001)
        while time.time() < stop_at:
            n += 1
            t0 = time.perf_counter()
            if per_call == 1:
                client.put_manifest(f"{tag}-{os.getpid()}-{t}-{n % 64}", s3_prefix=str(n))
            else:
                cmds = [
                    pb.Command(
                        put_manifest=pb.PutManifest(
                            manifest=pb.Manifest(name=f"{tag}-{os.getpid()}-{t}-{i}", s3_prefix=str(n))
                        )
                    )
                    for i in range(per_call)
                ]
                client.propose(cmds)
            mine.append(time.perf_counter() - t0)
        with lock:
            latencies.extend(mine)
        client.close()

    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return latencies


def _trivial_calls(address: str, threads: int, duration: float) -> int:
    """Run in a worker process: `threads` clients calling `Leader` (no Raft, no disk) back to back."""
    import grpc

    from cacheclient.wire import meta_pb2_grpc

    done = [0]
    lock = threading.Lock()
    start_at = time.time() + 0.5
    stop_at = start_at + duration

    def run() -> None:
        channel = grpc.insecure_channel(address)
        stub = meta_pb2_grpc.MetaServiceStub(channel)
        n = 0
        while time.time() < start_at:
            time.sleep(0.001)
        while time.time() < stop_at:
            stub.Leader(pb.LeaderRequest(), timeout=5)
            n += 1
        with lock:
            done[0] += n
        channel.close()

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return done[0]


def rpc_floor_phase(pool: ProcessPoolExecutor, shard: LocalShard, duration: float) -> dict[str, Any]:
    """The most unary calls/s the leader's gRPC server answers here when a call does no work at all."""
    leader, _ = shard.leader()
    futures = [pool.submit(_trivial_calls, shard.address[leader], 4, duration) for _ in range(4)]
    return {"clients": 16, "calls_per_s": round(sum(f.result() for f in futures) / duration)}


def write_phase(
    pool: ProcessPoolExecutor, shard: LocalShard, clients: int, procs: int, duration: float, per_call: int, tag: str
) -> dict[str, Any]:
    leader, _ = shard.leader()
    before = shard.status(leader) or {}
    per_proc = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    futures = [
        pool.submit(_load, shard.addresses, n, duration, per_call, f"{tag}{i}") for i, n in enumerate(per_proc) if n
    ]
    lat = [x for f in futures for x in f.result()]
    after = shard.status(leader) or {}
    entries = after.get("entries_proposed", 0) - before.get("entries_proposed", 0)
    commands = after.get("commands_proposed", 0) - before.get("commands_proposed", 0)
    return {
        "commands_per_log_entry": round(commands / entries, 1) if entries > 0 else None,
        "leader_fsyncs_per_s": round((after.get("persists", 0) - before.get("persists", 0)) / duration),
        "clients": clients,
        "writes_per_call": per_call,
        "calls": len(lat),
        "writes_per_s": round(len(lat) * per_call / duration),
        "p50_ms": round(pct(lat, 0.50) * 1000, 2),
        "p99_ms": round(pct(lat, 0.99) * 1000, 2),
    }


def read_phase(shard: LocalShard, n: int, stale: bool) -> dict[str, Any]:
    client = MetaClient(shard.addresses, timeout=10.0)
    client.put_manifest("read-me", s3_prefix="x")
    for _ in range(50):
        client.get_manifest("read-me", stale=stale)
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        assert client.get_manifest("read-me", stale=stale) is not None
        lat.append(time.perf_counter() - t0)
    client.close()
    return {
        "reads": n,
        "stale": stale,
        "p50_ms": round(pct(lat, 0.5) * 1000, 2),
        "p99_ms": round(pct(lat, 0.99) * 1000, 2),
    }


def election_phase(shard: LocalShard, kills: int) -> dict[str, Any]:
    times = []
    for _ in range(kills):
        leader, term = shard.leader(timeout=15.0)
        shard.kill(leader)
        t0 = time.monotonic()
        shard.leader(timeout=15.0, newer_than=term, poll=0.01)
        times.append(time.monotonic() - t0)
        shard.restart(leader)
        time.sleep(0.5)
    return {
        "kills": kills,
        "p50_s": round(pct(times, 0.5), 3),
        "p95_s": round(pct(times, 0.95), 3),
        "max_s": round(max(times), 3),
        "within_2s": sum(t <= 2.0 for t in times),
        "all_s": [round(t, 3) for t in times],
    }


def placement_phase(shard: LocalShard, n: int) -> dict[str, Any]:
    """16 cache nodes registered and heartbeating; time `locate` on the client's cached map."""
    client = MetaClient(shard.addresses, placement_ttl=3600)
    nodes = [(f"10.0.{i // 256}.{i % 256}:7070", (1 + i % 4) << 40) for i in range(16)]
    for address, capacity in nodes:
        client.register_node(address, capacity)
        client.heartbeat(address)
    deadline = time.monotonic() + 10
    while len(client.placement(refresh=True).nodes) < len(nodes):
        if time.monotonic() > deadline:
            raise RuntimeError("cache nodes did not come up in the placement map")
        time.sleep(0.1)
    keys = [f"dataset/train/shard-{i:07d}.tar".encode() for i in range(4096)]
    for k in keys:
        client.locate(k)
    t0 = time.perf_counter()
    rounds = max(1, n // len(keys))
    for _ in range(rounds):
        for k in keys:
            client.locate(k)
    per = (time.perf_counter() - t0) / (rounds * len(keys))
    client.close()
    return {"nodes": len(nodes), "lookups": rounds * len(keys), "us_per_lookup": round(per * 1e6, 3)}


def fsync_probe(directory: Path, n: int = 300) -> dict[str, float]:
    """Latency of one LMDB commit with fsync on this disk, now: the floor under every persist."""
    import lmdb

    env = lmdb.open(str(directory), sync=True, metasync=True)
    lat = []
    for i in range(n):
        t0 = time.perf_counter()
        with env.begin(write=True) as txn:
            txn.put(b"k%d" % i, b"x" * 128)
        lat.append(time.perf_counter() - t0)
    env.close()
    return {"p50_ms": round(pct(lat, 0.5) * 1000, 2), "p99_ms": round(pct(lat, 0.99) * 1000, 2)}


def machine() -> dict[str, Any]:
    def ver(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "-"

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "grpcio": ver("grpcio"),
        "protobuf": ver("protobuf"),
        "lmdb": ver("lmdb"),
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "loadavg_at_start": list(os.getloadavg()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter phases, 5 kills")
    parser.add_argument("--duration", type=float, default=None, help="seconds per write phase")
    parser.add_argument("--kills", type=int, default=None, help="leader kills for the election figure")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "meta.json")
    args = parser.parse_args(argv)
    duration = args.duration or (3.0 if args.quick else 6.0)
    kills = args.kills or (5 if args.quick else 20)
    info = machine()
    writes: list[dict[str, Any]] = []
    results: dict[str, Any] = {}
    pool = ProcessPoolExecutor(max_workers=4, mp_context=get_context("spawn"))
    list(pool.map(time.sleep, [0.0] * 4))  # Start the workers before anything is timed.
    with tempfile.TemporaryDirectory(prefix="bench-meta-") as tmp:
        results["fsync_before"] = fsync_probe(Path(tmp) / "fsync-before")
        for batching in (True, False):
            shard_args = [] if batching else ["--no-batching"]
            with LocalShard(3, Path(tmp) / ("batched" if batching else "unbatched"), args=shard_args) as shard:
                shard.start()
                shard.leader(timeout=15.0)
                for clients, procs, per_call in ((1, 1, 1), (16, 4, 1), (16, 4, 32)):
                    row = write_phase(pool, shard, clients, procs, duration, per_call, f"b{int(batching)}c{clients}")
                    row["batching"] = batching
                    writes.append(row)
                    print(json.dumps(row), flush=True)
                if batching:
                    results["reads"] = [
                        read_phase(shard, 2000 if not args.quick else 500, stale) for stale in (False, True)
                    ]
                    print(json.dumps(results["reads"]), flush=True)
                    results["rpc_floor"] = rpc_floor_phase(pool, shard, duration)
                    print(json.dumps(results["rpc_floor"]), flush=True)
                    results["placement_lookup"] = placement_phase(shard, 200_000 if args.quick else 1_000_000)
                    shard.wait_agreement()
        # Elections on a fresh shard: a node restarted after a long write phase
        # first replays its log, and that replay is not what this measures.
        with LocalShard(3, Path(tmp) / "elections") as shard:
            shard.start()
            client = MetaClient(shard.addresses)
            for i in range(200):
                client.put_manifest(f"e{i}", s3_prefix=str(i))
            client.close()
            results["election"] = election_phase(shard, kills)
            print(json.dumps({k: v for k, v in results["election"].items() if k != "all_s"}), flush=True)
            shard.wait_agreement()
        results["fsync_after"] = fsync_probe(Path(tmp) / "fsync-after")
    pool.shutdown()
    results["writes"] = writes
    by = {(w["batching"], w["clients"], w["writes_per_call"]): w for w in writes}
    targets = {
        "writes_per_s_batched_16_clients >= 5000": by[(True, 16, 1)]["writes_per_s"],
        "writes_per_s_batched_16_clients_32_per_call >= 5000": by[(True, 16, 32)]["writes_per_s"],
        "p50_commit_ms_1_client < 10": by[(True, 1, 1)]["p50_ms"],
        "placement_lookup_us < 5": results["placement_lookup"]["us_per_lookup"],
    }
    out = {
        "mode": "quick" if args.quick else "full",
        "command": "python bench/meta.py" + (" --quick" if args.quick else ""),
        "machine": info,
        "plan": {
            "nodes": 3,
            "write_phase_s": duration,
            "kills": kills,
            "fsync": (
                "LMDB sync=True whenever entries, a vote or a snapshot are persisted; "
                "a commit-index-only change rides with the next one"
            ),
        },
        "results": results,
        "targets": targets,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print()
    print(
        f"{'batching':<9} {'clients':>7} {'writes/call':>11} {'writes/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'cmds/entry':>10} {'fsyncs/s':>9}"
    )
    for w in writes:
        print(
            f"{'on' if w['batching'] else 'off':<9} {w['clients']:>7} {w['writes_per_call']:>11} "
            f"{w['writes_per_s']:>9} {w['p50_ms']:>8} {w['p99_ms']:>8} {w['commands_per_log_entry']!s:>10} "
            f"{w['leader_fsyncs_per_s']:>9}"
        )
    for r in results["reads"]:
        kind = "stale read" if r["stale"] else "linearizable read"
        print(f"{kind:<18} p50 {r['p50_ms']} ms  p99 {r['p99_ms']} ms")
    e = results["election"]
    print(
        f"election after leader kill: p50 {e['p50_s']} s  p95 {e['p95_s']} s  "
        f"({e['within_2s']}/{e['kills']} within 2 s)"
    )
    print(f"placement look-up: {results['placement_lookup']['us_per_lookup']} us")
    print(f"floor: a unary call that does nothing, 16 clients: {results['rpc_floor']['calls_per_s']} calls/s")
    print(f"LMDB fsync'd commit on this disk: before {results['fsync_before']}, after {results['fsync_after']}")
    print(json.dumps(targets, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
