"""What a join and a drain cost a warm cluster: the first epoch after the placement changes against the warm one before.

A metadata shard (one node) and three `cachesvc serve` processes (L1 and L2,
the L1 shared with clients on this machine, as `cachesvc up` starts them; the
cluster of bench/cluster.py), S3 (SeaweedFS) `--delay-ms` away behind
`bench/latency_proxy.py`, which counts the requests it forwards. `--keys`
objects of `--size` bytes are in S3 before the servers start; one epoch
through a routing client (`CacheClient(meta=...)`) caches each on its owner.
Epochs of `get_many` in batches of 64, in one shuffled order (a sampler's),
each through a new routing client (a new job: its connections and map
fetch are part of every epoch, warm ones included):

* warm: the median of `--repeat` epochs;
* a join (`cachesvc up --add-node`): a fourth server registers with the
  shard; once the shard's map holds it (and the servers had a heartbeat to
  fetch that map), the first epoch and the second;
* then a drain of one of the first three servers (`cachectl drain`: its
  state set to draining): the warm epochs of the four-node cluster before
  it, then once the map no longer holds it, the first epoch and the second.

For each move: the first epoch over the warm one before it, and the S3
requests per moved key (the keys whose owner differs between the shard's
maps before and after), counted from the change until the first epoch ends,
so that requests made in the background after the flip count too. Prints
the ratios against the targets of issue 49, writes bench/results/moves.json
(runs of other sizes are kept).

    .venv/bin/python bench/moves.py [--keys 3000] [--size 65536] [--delay-ms 20] [--repeat 5]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _machine
from cluster import BUCKET, HEARTBEAT_SECONDS, Cluster, node_counters
from latency_proxy import LatencyProxy
from restart import BATCH, epoch, populate

from cacheclient.meta import PlacementMap

RESULTS = Path(__file__).resolve().parent / "results" / "moves.json"
PREFIX = "bench/"
"""The S3 prefix of bench/cluster.py's servers."""
TARGETS = {"first_over_warm": 1.5, "s3_requests_per_moved_key": 0.01}
COUNTERS = (
    "peer_fills",
    "peer_fill_bytes",
    "peer_fills_checked",
    "peer_fills_listed",
    "peer_fill_listings",
    "vouch_listings",
    "peer_errors",
    "l3_fetches",
    "vouch_checks",
    "handover_keys",
    "handover_bytes",
    "fills",
    "gets",
    "direct_hit_keys",
)
"""Server counters whose change over a move is reported (summed over the nodes)."""


def fresh_epoch(cluster: Cluster, order: list[bytes], proxy: LatencyProxy) -> tuple[float, int]:
    """One epoch through a new routing client, as a new job reads (its connections are made in the epoch)."""
    with cluster.client(timeout=120.0) as client:
        return epoch(client, order, proxy)


def warm(cluster: Cluster, order: list[bytes], proxy: LatencyProxy, repeat: int) -> dict[str, Any]:
    """The median of `repeat` epochs, and the S3 requests they made."""
    runs = [fresh_epoch(cluster, order, proxy) for _ in range(repeat)]
    return {
        "warm_s": statistics.median(seconds for seconds, _ in runs),
        "warm_runs_s": [seconds for seconds, _ in runs],
        "warm_requests": sum(requests for _, requests in runs),
    }


def move(
    cluster: Cluster, order: list[bytes], proxy: LatencyProxy, repeat: int, change: Callable[[], PlacementMap]
) -> dict[str, Any]:
    """Warm epochs, then `change()` (which returns the shard's map once it holds the change), then two epochs."""
    row = warm(cluster, order, proxy, repeat)
    before = cluster.placement()
    counters = node_counters(cluster)
    requests = proxy.requests
    began = time.perf_counter()
    after = change()
    row["placement_changed_s"] = time.perf_counter() - began
    moved = sum(before.locate(k) != after.locate(k) for k in order)
    moved_in: list[float] = []

    def watch() -> None:
        # When the new owners hold every moved key (peer fills: the handover's, or the first epoch's reads).
        while time.perf_counter() - began < 60:
            now = node_counters(cluster)
            fills = sum(c.get("fills", 0) - counters.get(a, {}).get("fills", 0) for a, c in now.items())
            if fills >= moved:
                moved_in.append(time.perf_counter() - began)
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    time.sleep(3 * HEARTBEAT_SECONDS)  # every server fetches the new map after its next heartbeat
    row["requests_before_first"] = proxy.requests - requests
    row["first_s"], row["first_requests"] = fresh_epoch(cluster, order, proxy)
    watcher.join(60)
    row["moved_in_s"] = moved_in[0] if moved_in else None
    row["first_began_s"] = row["placement_changed_s"] + 3 * HEARTBEAT_SECONDS
    row["second_s"], row["second_requests"] = fresh_epoch(cluster, order, proxy)
    counted = node_counters(cluster)
    row["counters"] = {
        name: sum(c.get(name, 0) - counters.get(address, {}).get(name, 0) for address, c in counted.items())
        for name in COUNTERS
    }
    row["moved_keys"] = moved
    row["first_over_warm"] = round(row["first_s"] / row["warm_s"], 2)
    row["second_over_warm"] = round(row["second_s"] / row["warm_s"], 2)
    # From the change until the first epoch ended: background work after the flip counts.
    requests_for_move = row["requests_before_first"] + row["first_requests"]
    row["s3_requests_per_moved_key"] = round(requests_for_move / moved, 4) if moved else None
    return row


def run(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    keys = [f"ds/{i:08d}".encode() for i in range(args.keys)]
    order = keys[:]
    random.Random(49).shuffle(order)
    # As `cachesvc up` runs its servers (the handover on, as by default: `meta.handover_bytes` 256 MiB).
    cluster = Cluster(tmp / "cluster", {"CACHESVC_L1_SHARED": "true", "CACHESVC_META_HANDOVER_BYTES": "256MiB"})
    with contextlib.ExitStack() as stack:
        stack.callback(cluster.stop)
        cluster.start()
        proxy = LatencyProxy(cluster.weed.endpoint.removeprefix("http://"), delay=args.delay_ms / 1000).start()
        stack.callback(proxy.stop)
        cluster.s3_endpoint = proxy.endpoint
        populate(cluster.weed.endpoint, PREFIX, keys, args.size, bucket=BUCKET)
        for _ in range(3):
            cluster.add_server()
        cluster.wait_nodes([s.address for s in cluster.servers])
        time.sleep(3 * HEARTBEAT_SECONDS)
        cold_s, cold_requests = fresh_epoch(cluster, order, proxy)
        common = {"keys": args.keys, "size": args.size, "repeat": args.repeat, "cold_s": cold_s}
        common["cold_requests"] = cold_requests

        def join() -> PlacementMap:
            cluster.add_server()
            return cluster.wait_nodes([s.address for s in cluster.servers])[0]

        drained = cluster.servers[0].address

        def drain() -> PlacementMap:
            cluster.meta.set_node_state(drained, "draining")
            return cluster.wait_nodes([s.address for s in cluster.servers if s.address != drained])[0]

        rows = []
        for name, change in (("join", join), ("drain", drain)):
            row = {"move": name, **common, **move(cluster, order, proxy, args.repeat, change)}
            for field, value in list(row.items()):
                if isinstance(value, float):
                    row[field] = round(value, 3)
                elif isinstance(value, list):
                    row[field] = [round(v, 3) for v in value]
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=3000)
    parser.add_argument("--size", type=int, default=64 << 10)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--repeat", type=int, default=5, help="warm epochs before each move (median)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results file (runs of other sizes are kept)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="moves-bench-") as tmp:
        rows = run(args, Path(tmp))
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    kept = [r for r in previous.get("runs", []) if (r["keys"], r["size"]) != (args.keys, args.size)]
    runs = kept + rows
    targets = []
    for r in runs:
        case = f"{r['keys']} x {r['size'] // 1024} KiB, {r['move']}"
        limit = TARGETS["first_over_warm"]
        targets.append({"target": f"{case}: first epoch after / warm before", "value": r["first_over_warm"],
                        "limit": limit, "met": r["first_over_warm"] <= limit})  # fmt: skip
        per_key, limit = r["s3_requests_per_moved_key"], TARGETS["s3_requests_per_moved_key"]
        targets.append({"target": f"{case}: S3 requests per moved key", "value": per_key, "limit": limit,
                        "met": per_key is not None and per_key <= limit})  # fmt: skip
    result = {
        "benchmark": "moves",
        "command": "bench/moves.py " + " ".join(sys.argv[1:]),
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
            f"{r['keys']} x {r['size']} B, {r['move']}: warm {r['warm_s']:.3f} s; first after {r['first_s']:.3f} s "
            f"({r['first_over_warm']}x warm, target <= {TARGETS['first_over_warm']}), second {r['second_s']:.3f} s "
            f"({r['second_over_warm']}x); {r['moved_keys']} keys moved, "
            f"{r['requests_before_first'] + r['first_requests']} S3 requests: {r['s3_requests_per_moved_key']} "
            f"per moved key (target <= {TARGETS['s3_requests_per_moved_key']}); "
            f"peer fills {r['counters']['peer_fills']}"
            f"; every moved key on its new owner {r['moved_in_s']} s after the change (first epoch from "
            f"{r['first_began_s']:.2f} s)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
