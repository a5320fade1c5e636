"""What a restart costs a cache server that keeps its L2: the first epoch after it against the warm one before.

One `cachesvc serve` (16 MiB L1, an L2 that holds every key), S3 (SeaweedFS)
`--delay-ms` away behind `bench/latency_proxy.py`, which counts the requests
it forwards. `--keys` objects of `--size` bytes are in S3 before it starts.
Epochs of `get_many` in batches of 64, in one shuffled order (a sampler's):

* cold: every key filled from S3 (and written to L2);
* warm: from L2 (the L1 holds a fraction); the median of `--repeat`;
* first after a clean restart (SIGTERM), the median of `--repeat` restarts;
* first after SIGKILL, likewise;
* a clean restart left idle: the time from the engine's start until every
  copy is vouched for (as the node reports it, `vouch_millis`), then an
  epoch (what a restart costs with nothing left to check: a new process,
  an empty L1).

Run for both ways a restarted node checks its copies (`s3.vouch_listings`):
`listings` (in bulk, from ListObjectsV2 pages: this issue's path) and
`head-each` (one HEAD per copy at its first read: the path before it, which
`vouch_listings = 0` keeps), in the same run. Prints the ratios, writes
bench/results/restart.json.

    .venv/bin/python bench/restart.py [--keys 2000] [--size 65536] [--modes listings,head-each]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client"))

import _machine
from latency_proxy import LatencyProxy

from cacheclient import CacheClient
from cacheclient.wire.record import checksum
from cachesvc.devcluster.seaweed import S3_ACCESS_KEY, S3_SECRET_KEY, SeaweedFS
from cachesvc.engine.versions import stamp
from cachesvc.tiers import S3Tier

BUCKET = "restart-bench"
BATCH = 64
RESULTS = Path(__file__).resolve().parent / "results" / "restart.json"
TARGETS = {"first_over_warm": 1.2, "s3_requests_per_key": 0.01, "vouched_100k_seconds": 10.0}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """One `cachesvc serve` process on its own L2 directory."""

    def __init__(self, work: Path, endpoint: str, prefix: str, l2_bytes: int, listings: int) -> None:
        self.work, self.endpoint, self.prefix, self.l2_bytes, self.listings = work, endpoint, prefix, l2_bytes, listings
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""

    def start(self) -> float:
        """Starts it; returns the seconds until it answers."""
        port = free_port()
        self.address = f"127.0.0.1:{port}"
        env = dict(os.environ, CACHESVC_S3_ACCESS_KEY=S3_ACCESS_KEY, CACHESVC_S3_SECRET_KEY=S3_SECRET_KEY)
        env["CACHESVC_S3_VOUCH_LISTINGS"] = str(self.listings)
        argv = [
            sys.executable, "-m", "cachesvc", "serve", "--listen", self.address, "--l1-bytes", "16MiB",
            "--l2-path", str(self.work / "l2"), "--l2-bytes", str(self.l2_bytes),
            "--s3-endpoint", self.endpoint, "--s3-bucket", BUCKET, "--s3-prefix", self.prefix,
        ]  # fmt: skip
        began = time.perf_counter()
        log = (self.work / "server.log").open("ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            with CacheClient(self.address, colocated=False) as client:
                client.wait_ready(60.0)
        except Exception:
            sys.stderr.write((self.work / "server.log").read_text()[-4000:])
            raise
        return time.perf_counter() - began

    def stop(self, how: str) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        self.proc.wait(60)

    def client(self) -> CacheClient:
        return CacheClient(self.address, colocated=False, timeout=120.0)


def populate(endpoint: str, prefix: str, keys: list[bytes], size: int, bucket: str = BUCKET) -> None:
    """The objects, as the cache writes them (checksum and version in their metadata), straight to SeaweedFS."""
    tier = S3Tier(endpoint=endpoint, bucket=bucket, prefix=prefix, access_key=S3_ACCESS_KEY, secret_key=S3_SECRET_KEY)
    version = stamp(int(time.time() * 1000))

    def put(key: bytes) -> None:
        value = os.urandom(size)
        tier.put(key, value, checksum(value), version=version)

    with ThreadPoolExecutor(32) as pool:
        list(pool.map(put, keys))
    tier.close()


def epoch(client: CacheClient, order: list[bytes], proxy: LatencyProxy) -> tuple[float, int]:
    """(seconds, S3 requests) to read every key once, in batches of 64."""
    requests = proxy.requests
    began = time.perf_counter()
    for i in range(0, len(order), BATCH):
        batch = order[i : i + BATCH]
        for hit in client.get_many(batch):
            assert hit is not None
    return time.perf_counter() - began, proxy.requests - requests


def until_vouched(client: CacheClient, timeout: float) -> float:
    """Seconds until the node says every copy it found is checked (a wait from the moment it answers)."""
    began = time.perf_counter()
    while time.perf_counter() - began < timeout:
        if client.stats()["counters"].get("vouch_done"):
            return time.perf_counter() - began
        time.sleep(0.05)
    raise TimeoutError(f"not every copy was vouched for in {timeout} s")


def run_mode(args: argparse.Namespace, mode: str, weed: SeaweedFS, proxy: LatencyProxy, tmp: Path) -> dict[str, Any]:
    prefix = f"bench/{uuid.uuid4().hex[:8]}/"
    keys = [f"ds/{i:08d}".encode() for i in range(args.keys)]
    populate(weed.endpoint, prefix, keys, args.size)
    order = keys[:]
    random.Random(49).shuffle(order)
    work = tmp / mode
    work.mkdir()
    l2_bytes = max(256 << 20, args.keys * (args.size + 4096) * 2)
    server = Server(work, proxy.endpoint, prefix, l2_bytes, 4 if mode == "listings" else 0)
    row: dict[str, Any] = {"mode": mode, "keys": args.keys, "size": args.size, "repeat": args.repeat}
    server.start()
    with server.client() as client:
        row["cold_s"], row["cold_requests"] = epoch(client, order, proxy)
        warm = [epoch(client, order, proxy) for _ in range(args.repeat)]
    row["warm_runs_s"] = [seconds for seconds, _ in warm]
    row["warm_s"], row["warm_requests"] = statistics.median(row["warm_runs_s"]), sum(n for _, n in warm)
    for how in ("sigterm", "sigkill"):
        firsts, requests_per_restart = [], []
        for _ in range(args.repeat):
            server.stop(how)
            requests = proxy.requests
            row[f"ready_after_{how}_s"] = server.start()
            with server.client() as client:
                seconds, _ = epoch(client, order, proxy)
                firsts.append(seconds)
                requests_per_restart.append(proxy.requests - requests)  # start-up's own listings included
                if how == "sigterm":
                    row["second_after_sigterm_s"], _ = epoch(client, order, proxy)
        row[f"first_after_{how}_runs_s"] = firsts
        row[f"first_after_{how}_s"] = statistics.median(firsts)
        row[f"first_after_{how}_requests"] = max(requests_per_restart)
    if mode == "listings":
        server.stop("sigterm")
        server.start()
        with server.client() as client:
            until_vouched(client, 600.0)
            # From the engine's start (the L2 reopened) to its last copy checked, as the node measures it.
            row["vouched_all_s"] = client.stats()["counters"]["vouch_millis"] / 1000
            # The restart's cost with every copy vouched for already: a new process, an empty L1.
            row["first_after_idle_restart_s"], _ = epoch(client, order, proxy)
    server.stop("sigterm")
    for how in ("sigterm", "sigkill"):
        row[f"first_over_warm_{how}"] = round(row[f"first_after_{how}_s"] / row["warm_s"], 2)
        row[f"requests_per_key_{how}"] = round(row[f"first_after_{how}_requests"] / args.keys, 4)
    for name, value in list(row.items()):
        if isinstance(value, float):
            row[name] = round(value, 3)
        elif isinstance(value, list):
            row[name] = [round(v, 3) for v in value]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=2000)
    parser.add_argument("--size", type=int, default=64 << 10)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--modes", default="listings,head-each")
    parser.add_argument("--repeat", type=int, default=3, help="warm epochs, and restarts of each kind (medians)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results file (runs of other sizes are kept)")
    args = parser.parse_args()
    rows = []
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="restart-bench-")))
        weed = SeaweedFS.on_free_ports(tmp / "seaweed")
        stack.callback(weed.stop, 5.0)
        weed.create_bucket(BUCKET)
        proxy = LatencyProxy(weed.endpoint.removeprefix("http://"), delay=args.delay_ms / 1000).start()
        stack.callback(proxy.stop)
        for mode in args.modes.split(","):
            row = run_mode(args, mode, weed, proxy, tmp)
            rows.append(row)
            print(json.dumps(row), flush=True)
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    kept = [r for r in previous.get("runs", []) if (r["keys"], r["size"]) != (args.keys, args.size)]
    runs = kept + rows
    targets = []
    for r in runs:
        case = f"{r['keys']} x {r['size'] // 1024} KiB {r['mode']}"
        for how in ("sigterm", "sigkill"):
            ratio, per_key = r[f"first_over_warm_{how}"], r[f"requests_per_key_{how}"]
            limit = TARGETS["first_over_warm"]
            targets.append({"target": f"{case}: first epoch after {how} / warm", "value": ratio, "limit": limit,
                            "met": ratio <= limit})  # fmt: skip
            limit = TARGETS["s3_requests_per_key"]
            targets.append({"target": f"{case}: S3 requests per key after {how}", "value": per_key, "limit": limit,
                            "met": per_key <= limit})  # fmt: skip
        if "vouched_all_s" in r and r["keys"] >= 100_000:
            limit = TARGETS["vouched_100k_seconds"]
            targets.append({"target": f"{case}: seconds until every copy is vouched", "value": r["vouched_all_s"],
                            "limit": limit, "met": r["vouched_all_s"] <= limit})  # fmt: skip
    result = {
        "benchmark": "restart",
        "command": "bench/restart.py " + " ".join(sys.argv[1:]),
        "delay_ms": args.delay_ms,
        "batch": BATCH,
        "runs": runs,
        "targets": targets,
        "machine": _machine.machine_info(["grpcio", "lmdb", "boto3"]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for r in rows:
        print(
            f"{r['keys']} x {r['size']} B, {r['mode']}: warm {r['warm_s']:.2f} s, cold {r['cold_s']:.2f} s; "
            f"first after SIGTERM {r['first_after_sigterm_s']:.2f} s ({r['first_over_warm_sigterm']}x warm, "
            f"{r['requests_per_key_sigterm']} S3 requests/key), after SIGKILL {r['first_after_sigkill_s']:.2f} s "
            f"({r['first_over_warm_sigkill']}x, {r['requests_per_key_sigkill']}/key)"
            + (f"; every copy vouched {r['vouched_all_s']:.2f} s after start" if "vouched_all_s" in r else "")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
