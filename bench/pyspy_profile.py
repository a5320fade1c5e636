"""Where a cache server's time goes on a cold epoch and on a warm one: a py-spy profile, summarised (issue 15).

Starts SeaweedFS and one `cachesvc serve` (L1 1 GiB, L3 SeaweedFS), profiled
by `py-spy record` (100 samples/s of every thread py-spy takes for active;
it takes threads blocked in C calls, such as a pool thread waiting for work
or a fill waiting on the S3 client, for active too, so the samples say where
threads spend wall time, and the process's CPU time says what it costs), puts
`--objects` objects of `--object-bytes` in S3 directly, then `--clients`
client processes read disjoint slices once (cold: every read an L3 fill),
then the same keys again (warm: L1 hits), 16 keys per `get_many`, each
phase profiled on its own.

The summary groups samples by where their innermost frame lives: waiting on
S3 (the S3 tier's call into the S3 client), `obstore` (the S3 client), `grpc` (the gRPC runtime's Python side),
`protobuf`, `lmdb`, `xxhash`, `cachesvc.engine`, `cachesvc.server`,
`cachesvc.tiers`, `cacheclient.wire`, pool threads idle and other waits
(`threading`, `queue`, `concurrent.futures`) and `other`; and lists the 25 innermost functions with the most
samples. The server's CPU per object (utime + stime over the phase) is in
the JSON too.

Usage:
    python bench/pyspy_profile.py                     # about a minute
    python bench/pyspy_profile.py --object-bytes 1048576 --objects 600

Writes bench/results/pyspy_profile.json (the summary) and pyspy_profile-cold.txt,
pyspy_profile-warm.txt (py-spy's raw collapsed stacks, for flamegraph.pl or
speedscope). py-spy attaches to the running server (`--pid`) for each phase.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _machine
from cluster import client_reports, cpu_seconds, spawn_clients

from cacheclient import CacheClient
from cachesvc.devcluster.procs import ManagedProcess, free_port, wait_for_port
from cachesvc.devcluster.seaweed import S3_ACCESS_KEY, S3_SECRET_KEY, SeaweedFS, s3_client

BENCH_DIR = Path(__file__).resolve().parent
BUCKET = "cachesvc-bench"
BATCH = 16
GROUPS = [
    ("waiting on S3 (S3Tier.call)", ("S3Tier.call",)),
    ("obstore", ("obstore",)),
    ("grpc", ("grpc/", "grpc\\", "_channel.py", "_server.py", "_common.py", "_interceptor.py")),
    ("protobuf", ("google/protobuf",)),
    ("lmdb", ("lmdb",)),
    ("xxhash", ("xxhash",)),
    ("cachesvc.engine", ("cachesvc/engine",)),
    ("cachesvc.server", ("cachesvc/server",)),
    ("cachesvc.tiers", ("cachesvc/tiers",)),
    ("cachesvc.prefetch/policy", ("cachesvc/prefetch", "cachesvc/policy")),
    ("cacheclient.wire", ("cacheclient/wire",)),
    ("pool threads idle, waits", ("threading.py", "queue.py", "concurrent/futures")),
]


def read_worker(address: str, keys: list[str], size: int, start_at: float, out: Any) -> None:
    try:
        with CacheClient(address, timeout=60.0) as client:
            client.contains("warmup")
            while time.time() < start_at:
                time.sleep(0.005)
            began = time.monotonic()
            wrong = 0
            for i in range(0, len(keys), BATCH):
                for value in client.get_many(keys[i : i + BATCH]):
                    wrong += value is None or len(value) != size
            out.put({"elapsed": time.monotonic() - began, "wrong": wrong})
    except BaseException as exc:
        out.put({"error": repr(exc)})


def read_all(address: str, keys: list[str], size: int, clients: int, pid: int) -> tuple[float, float]:
    """`clients` processes read `keys` once between them through `address`: (their time, the server's CPU s)."""
    start_at = time.time() + 5.0
    jobs = [(address, keys[i::clients], size, start_at) for i in range(clients)]
    procs, out = spawn_clients(read_worker, jobs, start_at)
    cpu0 = cpu_seconds(pid)
    reports = client_reports(procs, out, timeout=600.0)
    cpu = cpu_seconds(pid) - cpu0
    if any(r["wrong"] for r in reports):
        raise RuntimeError(f"client processes read wrong values: {reports}")
    return max(r["elapsed"] for r in reports), cpu


def group_of(frame: str) -> str:
    for name, marks in GROUPS:
        if any(mark in frame for mark in marks):
            return name
    return "other"


def summarise(raw: Path) -> dict[str, Any]:
    """Samples by group of the innermost frame, and the innermost functions with the most samples."""
    groups: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        # The thread's frame comes first in py-spy's raw output; the innermost is last.
        leaf = frames[-1]
        total += count
        groups[group_of(leaf)] += count
        leaves[leaf] += count
    return {
        "samples": total,
        "by_group": {k: round(v / total, 3) for k, v in groups.most_common()} if total else {},
        "top_functions": [{"frame": k, "share": round(v / total, 3)} for k, v in leaves.most_common(25)],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=2000)
    parser.add_argument("--object-bytes", type=int, default=100 << 10)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--out", default=str(BENCH_DIR / "results" / "pyspy_profile.json"))
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        print("py-spy is not installed: pip install py-spy", file=sys.stderr)
        return 2
    out = Path(args.out)
    phases: dict[str, Any] = {}
    info = _machine.machine_info()
    with tempfile.TemporaryDirectory(prefix="profile-bench-") as tmp:
        work = Path(tmp)
        weed = SeaweedFS.on_free_ports(work / "seaweed")
        server: ManagedProcess | None = None
        try:
            weed.create_bucket(BUCKET)
            s3: Any = s3_client(weed.endpoint)
            body = os.urandom(args.object_bytes)
            keys = [f"p/{i:06d}" for i in range(args.objects)]
            for key in keys:
                s3.put_object(Bucket=BUCKET, Key="bench/" + key, Body=body)
            port = free_port()
            argv = [
                sys.executable, "-m", "cachesvc", "serve", "--listen", f"127.0.0.1:{port}", "--l1-bytes", "1GiB",
                "--s3-endpoint", weed.endpoint, "--s3-bucket", BUCKET, "--s3-prefix", "bench/",
            ]  # fmt: skip
            env = {**os.environ, "CACHESVC_S3_ACCESS_KEY": S3_ACCESS_KEY, "CACHESVC_S3_SECRET_KEY": S3_SECRET_KEY}
            server = ManagedProcess("cache", argv, work / "server.log", env)
            wait_for_port(port, timeout=60.0, proc=server.proc)
            address = f"127.0.0.1:{port}"
            pid = server.pid
            for phase in ("cold", "warm"):
                path = out.with_name(f"{out.stem}-{phase}.txt")
                spy = subprocess.Popen(
                    [py_spy, "record", "--rate", "100", "--format", "raw", "--output", str(path), "--pid", str(pid)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                time.sleep(1.0)  # py-spy attaches
                elapsed, cpu = read_all(address, keys, args.object_bytes, args.clients, pid)
                spy.send_signal(signal.SIGINT)
                spy.wait(60.0)
                summary = summarise(path)
                phases[phase] = {
                    "objects_per_s": round(args.objects / elapsed),
                    "server_cpu_ms_per_object": round(cpu / args.objects * 1e3, 3),
                    "server_thread_ms_per_object": round(summary["samples"] * 10 / args.objects, 3),
                    "profile": summary,
                }
        finally:
            if server is not None:
                server.stop(grace=10.0)
            weed.stop(grace=5.0)
    result = {
        "command": "python bench/pyspy_profile.py"
        + (f" --object-bytes {args.object_bytes} --objects {args.objects}" if args.object_bytes != 100 << 10 else ""),
        "machine": info,
        "plan": {"objects": args.objects, "object_bytes": args.object_bytes, "clients": args.clients, "batch": BATCH},
        "phases": phases,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for phase, r in phases.items():
        summary = r["profile"]
        print(
            f"\n{phase}: {r['objects_per_s']:,} objects/s; server CPU {r['server_cpu_ms_per_object']:.2f} ms per "
            f"object; thread time sampled {r['server_thread_ms_per_object']:.2f} ms per object, by where the "
            "innermost frame is:"
        )
        for name, share in summary["by_group"].items():
            print(f"  {name:<26}{share * 100:6.1f}%")
        print("innermost functions:")
        for row in summary["top_functions"][:12]:
            print(f"  {row['share'] * 100:5.1f}%  {row['frame']}")
    print(f"\nwrote {out} and the raw stacks beside it ({out.stem}-cold.txt, {out.stem}-warm.txt)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
