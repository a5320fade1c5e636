"""What issue 22's guarantees cost on the data path: put and get through a routing client in a cluster, per write mode.

One metadata node, SeaweedFS and one or two `cachesvc serve` processes on
127.0.0.1 (`bench/cluster.py`'s `Cluster`), with a write-through (`wt/`)
and a write-back (`wb/`) namespace. A routing `CacheClient(meta=...)` in
this process, one thread, back to back:

* put p50 and p90, 4 KiB and 1 MiB, write-through and write-back (a fresh
  key each time: every put is the key's first version);
* warm get p50 of the same keys (from L1 of their owner);
* put throughput with 4 threads sharing the client, 4 KiB write-back.

The code under test is whatever `cachesvc` and `cacheclient` import as
(the servers are started with this interpreter and environment), so the
same script measures two commits: run it from each commit's checkout with
`PYTHONPATH=CHECKOUT:CHECKOUT/client` (`python -m cachesvc` starts the
servers from the working directory), in alternation (`--label` names the
run in the JSON):

    for i in 1 2 3; do
      (cd /tmp/old && PYTHONPATH=$PWD:$PWD/client python $NEW/bench/consistency_cost.py --label old \
        --out /tmp/cc-old-$i.json)
      (cd $NEW && PYTHONPATH=$PWD:$PWD/client python bench/consistency_cost.py --label new --out /tmp/cc-new-$i.json)
    done
    python bench/consistency_cost.py --compare /tmp/cc-*.json   # medians, new / old

Nothing here runs a competitor: the figure is our own cost, old against new.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# The code under test is what PYTHONPATH names: imported before bench/cluster.py puts this checkout first.
import cacheclient  # noqa: F401
import cachesvc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import Cluster

CONFIG = """
[[namespaces]]
prefix = "wt/"
write_mode = "write-through"

[[namespaces]]
prefix = "wb/"
write_mode = "write-back"
"""
SIZES = {"4KiB": (4 << 10, 400), "1MiB": (1 << 20, 40)}
"""Label: (value bytes, puts timed)."""
THREADS = 4
THROUGHPUT_SECONDS = 4.0


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed(calls: Sequence[Callable[[], object]]) -> list[float]:
    """Seconds each call took, one after another."""
    took = []
    for call in calls:
        began = time.perf_counter()
        call()
        took.append(time.perf_counter() - began)
    return took


def put_throughput(client: Any, value: bytes, seconds: float) -> float:
    """Write-back puts per second, `THREADS` threads sharing `client`, fresh keys."""
    stop = time.monotonic() + seconds
    counts = [0] * THREADS

    def run(t: int) -> None:
        n = 0
        while time.monotonic() < stop:
            client.put(b"wb/tp/%d/%d" % (t, n), value)
            n += 1
        counts[t] = n

    threads = [threading.Thread(target=run, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / seconds


def measure(nodes: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="cc-bench-") as work:
        cluster = Cluster(Path(work))
        cluster.config.write_text(CONFIG)
        cluster.start()
        try:
            for _ in range(nodes):
                cluster.add_server()
            cluster.wait_nodes([s.address for s in cluster.servers])
            result: dict[str, Any] = {}
            with cluster.client() as client:
                for label, (size, count) in SIZES.items():
                    value = os.urandom(size)
                    for mode in ("wt", "wb"):
                        keys = [f"{mode}/{label}/{i}".encode() for i in range(count)]
                        client.put(f"{mode}/warmup/{label}".encode(), value)
                        puts = timed([lambda k=k, v=value: client.put(k, v) for k in keys])
                        gets = timed([lambda k=k: client.get(k) for k in keys])
                        result[f"put_{mode}_{label}"] = {
                            "p50_us": percentile(puts, 0.5) * 1e6,
                            "p90_us": percentile(puts, 0.9) * 1e6,
                        }
                        result[f"get_{mode}_{label}"] = {"p50_us": percentile(gets, 0.5) * 1e6}
                result["put_wb_4KiB_4_threads_per_s"] = put_throughput(client, os.urandom(4 << 10), THROUGHPUT_SECONDS)
            return result
        finally:
            cluster.stop()


def compare(paths: Sequence[str]) -> None:
    runs: dict[str, list[dict[str, Any]]] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        runs.setdefault(data["label"], []).append(data)
    old, new = runs.get("old", []), runs.get("new", [])
    if not old or not new:
        raise SystemExit("--compare needs runs labelled old and new")
    print(f"{'figure':44} {'old (median, runs)':34} {'new (median, runs)':34} new/old")

    def values(group: list[dict[str, Any]], nodes: str, figure: str, stat: str | None) -> list[float]:
        cells = [g["nodes"][nodes][figure] for g in group]
        return [c[stat] if stat else c for c in cells]

    for nodes in sorted(old[0]["nodes"]):
        for figure, stats in old[0]["nodes"][nodes].items():
            for stat in stats if isinstance(stats, dict) else [None]:
                o, n = values(old, nodes, figure, stat), values(new, nodes, figure, stat)
                name = f"{nodes} node(s) {figure}" + (f" {stat}" if stat else "")
                mo, mn = statistics.median(o), statistics.median(n)
                print(
                    f"{name:44} {mo:10.0f} {[round(v) for v in o]!s:23} {mn:10.0f} {[round(v) for v in n]!s:23} "
                    f"{mn / mo:.2f}"
                )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="new", help="names the run in the JSON (old, new)")
    parser.add_argument("--nodes", default="1,2", help="cluster sizes to measure, comma-separated")
    parser.add_argument("--out", help="write the JSON here")
    parser.add_argument("--compare", nargs="+", metavar="JSON", help="print medians of earlier runs, new / old")
    args = parser.parse_args()
    if args.compare:
        compare(args.compare)
        return 0
    result = {
        "label": args.label,
        "cachesvc": str(Path(cachesvc.__file__).resolve().parent),
        "nodes": {n: measure(int(n)) for n in args.nodes.split(",")},
    }
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
