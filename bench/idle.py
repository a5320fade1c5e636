"""What cachesvc costs while nothing happens (issue 15): CPU of idle servers, idle clients, and an idle KV index.

A cache that sits on every training and inference machine is idle most of
the time between epochs and requests; what it burns then is paid on every
machine all day. Everything runs on 127.0.0.1: one metadata node, SeaweedFS
(reported too, as the reference of a server that idles), and one cache
server registered with the shard (heartbeat 2 s, the default). For each
phase, `--seconds` seconds of wall time, the CPU seconds (utime + stime,
every thread) of each process over it:

* servers alone: the cache server and the metadata node with no client;
* a routing client connected (`CacheClient(meta=...)`, its placement map
  refreshed in the background) doing nothing;
* a `KVCache` with its local index (`local_index=True`: a `KeyDigest` sync
  every 50 ms while read, backing off to 0.4 s when nobody reads it and
  nothing changes) doing nothing, which also shows what the server pays;
* then a three-node metadata shard on its own (the one `cachesvc up`
  starts): its leader heartbeats the two followers every 30 ms.

Reported as CPU milliseconds per second of wall time (1000 is one core).

Usage:
    python bench/idle.py                 # about 2 minutes
    python bench/idle.py --seconds 10    # a smoke run

Writes bench/results/idle.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _machine
from cluster import Cluster, cpu_seconds

from cacheclient.kv import KVCache, KVLayout
from cachesvc.devcluster.shard import LocalShard

BENCH_DIR = Path(__file__).resolve().parent


def sample(pids: dict[str, int], seconds: float, own: bool) -> dict[str, float]:
    """CPU milliseconds per wall second of each process in `pids` (and of this one, with `own`) over `seconds`."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    mine = time.process_time()
    began = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - began
    out = {name: round((cpu_seconds(pid) - before[name]) / elapsed * 1e3, 2) for name, pid in pids.items()}
    if own:
        out["this client process"] = round((time.process_time() - mine) / elapsed * 1e3, 2)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="wall seconds per phase (default 30)")
    parser.add_argument("--out", default=str(BENCH_DIR / "results" / "idle.json"))
    args = parser.parse_args()
    info = _machine.machine_info()
    with tempfile.TemporaryDirectory(prefix="idle-bench-") as tmp:
        cluster = Cluster(Path(tmp), {"CACHESVC_META_HEARTBEAT_SECONDS": "2"})
        try:
            cluster.start()
            server = cluster.add_server()
            cluster.wait_nodes([server.address])
            assert cluster.weed.process is not None
            pids = {
                "cache server": server.pid,
                "metadata node": next(iter(cluster.shard.pids().values())),
                "SeaweedFS": cluster.weed.process.pid,
            }
            time.sleep(3.0)  # start-up work done
            phases: dict[str, dict[str, float]] = {}
            print(f"servers alone, {args.seconds:g} s")
            phases["servers alone"] = sample(pids, args.seconds, own=False)
            with cluster.client() as client:
                client.put("idle/warm", b"x")  # connected: its channels, placement refreshes
                print(f"a routing client connected, idle, {args.seconds:g} s")
                phases["a routing client connected, idle"] = sample(pids, args.seconds, own=True)
                layout = KVLayout(num_layers=2, kv_heads=2, head_dim=8, dtype="float32")
                kv = KVCache(client, "idle-model", 16, layout=layout, local_index=True)
                kv.lookup(list(range(64)))  # the index is syncing from here on
                try:
                    print(f"a KVCache with its local index, idle, {args.seconds:g} s")
                    phases["a KVCache local index syncing, idle"] = sample(pids, args.seconds, own=True)
                finally:
                    kv.close()
        finally:
            cluster.stop()
        # The three-node shard `cachesvc up` starts: the leader heartbeats its two followers.
        shard = LocalShard(3, Path(tmp) / "shard3")
        try:
            shard.start()
            leader, _ = shard.leader(timeout=30.0)
            time.sleep(3.0)
            names = {i: "leader" if i == leader else f"follower {i}" for i in shard.pids()}
            print(f"a three-node metadata shard alone, {args.seconds:g} s")
            phases["a three-node metadata shard alone"] = sample(
                {names[i]: pid for i, pid in shard.pids().items()}, args.seconds, own=False
            )
        finally:
            shard.stop()
    out = Path(args.out)
    previous = json.loads(out.read_text()) if out.exists() else {}
    result: dict[str, Any] = {
        "command": "python bench/idle.py" + (f" --seconds {args.seconds:g}" if args.seconds != 30.0 else ""),
        "machine": info,
        "unit": "CPU milliseconds per wall second (1000 = one core busy)",
        "heartbeat_seconds": 2.0,
        "phases": phases,
        # The figures this run replaces, to read beside the new ones.
        "previous": {
            "commit": previous.get("machine", {}).get("commit"),
            "phases": previous.get("phases", {}),
        },
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    names = sorted({n for p in phases.values() for n in p}, key=lambda n: (n == "this client process", n))
    print(f"\n{'phase':<40}" + "".join(f"{n:>22}" for n in names))
    for phase, row in phases.items():
        print(f"{phase:<40}" + "".join(f"{row.get(n, float('nan')):>22.2f}" for n in names))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("CACHECLIENT_TUNE_MALLOC", "1")
    sys.exit(main())
