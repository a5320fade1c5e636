"""What cachesvc costs while nothing happens (issues 15, 25): CPU of idle servers, clients, KV index and shard.

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
* then the three-node metadata shard `cachesvc up` starts (the shard phases,
  `--shard-only` runs just these):
  * alone: before issue 25 its leader heartbeated the two followers every
    30 ms; now it quiesces once everything is replicated and heartbeats
    every 500 ms (answered every other time);
  * with two cache servers registered (heartbeat 2 s, the default), whose
    lease renewals the leader replicates;
  * failover of the idle shard: `--kills` times, the leader is SIGKILLed at
    a random point between two heartbeats, and the time from the kill until
    a write (a manifest put by a client of all three nodes) commits on the
    new leader is taken; the node is restarted and the shard left idle
    before the next kill.

Reported as CPU milliseconds per second of wall time (1000 is one core).

Old vs new (`--compare OLD_TREE`): the shard phases run alternately against
an unpacked older commit (`git archive 1d11c3d | tar -x -C /tmp/idle_old`)
and this tree, `--repeats` times each (for the old tree this script runs
with IDLE_BENCH_TREE and PYTHONPATH naming it, so it and every process it
starts run the old code), and the medians are reported:
bench/results/idle_shard.json and .md.

Usage:
    python bench/idle.py                 # about 5 minutes
    python bench/idle.py --seconds 10    # a smoke run
    git archive 1d11c3d | (mkdir -p /tmp/idle_old && tar -x -C /tmp/idle_old)
    python bench/idle.py --compare /tmp/idle_old --repeats 3 --seconds 20 --kills 5   # about 12 minutes

Writes bench/results/idle.json (or idle_shard.json/.md) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The tree under test: this one, or (IDLE_BENCH_TREE, set by --compare, with PYTHONPATH) an older checkout.
sys.path.insert(0, os.environ.get("IDLE_BENCH_TREE") or str(Path(__file__).resolve().parent.parent))

import _machine
from cluster import Cluster, cpu_seconds

from cacheclient.errors import CacheClientError
from cacheclient.kv import KVCache, KVLayout
from cacheclient.meta import MetaClient
from cachesvc.devcluster.shard import LocalShard

BENCH_DIR = Path(__file__).resolve().parent
TREE = Path(sys.path[0])
SHARD_ALONE = "a three-node metadata shard alone"
SHARD_SERVERS = "a three-node metadata shard, two cache servers"


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


def _shard_names(shard: LocalShard, leader: int) -> dict[str, int]:
    """{"leader": pid, "follower 1": pid, "follower 2": pid} (followers in id order)."""
    followers = [i for i in sorted(shard.pids()) if i != leader]
    return {"leader": shard.pids()[leader], **{f"follower {k}": shard.pids()[i] for k, i in enumerate(followers, 1)}}


def _commit_probe(client: MetaClient, deadline: float) -> float | None:
    """Put a manifest until one commits (each try 0.25 s at most); when it did (monotonic), None if never."""
    while time.monotonic() < deadline:
        try:
            client.put_manifest("idle-bench-failover-probe", timeout=0.25)
            return time.monotonic()
        except CacheClientError:
            time.sleep(0.01)
    return None


def failover_trials(shard: LocalShard, kills: int, rng: random.Random) -> list[float]:
    """Seconds from SIGKILL of the idle shard's leader until a write commits, `kills` times."""
    out: list[float] = []
    with shard.client() as client:
        for k in range(kills):
            _commit_probe(client, time.monotonic() + 30.0)
            shard.wait_agreement(timeout=30.0)
            time.sleep(2.0 + rng.uniform(0.0, 0.3))  # idle (quiesced), then a random point between two heartbeats
            leader, term = shard.leader(timeout=10.0)
            shard.kill(leader)
            killed = time.monotonic()
            done = _commit_probe(client, killed + 20.0)
            took = (done - killed) if done is not None else float("inf")
            out.append(round(took, 3))
            print(f"  kill {k + 1}: leader {leader} (term {term}) killed; a write committed {took:.3f} s later")
            shard.restart(leader)
    return out


def shard_phases(work: Path, seconds: float, kills: int, seed: int = 25) -> dict[str, Any]:
    """The three-node shard idle (alone, then with two cache servers) and its failover times."""
    phases: dict[str, dict[str, float]] = {}
    shard = LocalShard(3, work / "shard3")
    try:
        shard.start()
        leader, _ = shard.leader(timeout=30.0)
        time.sleep(3.0)
        print(f"{SHARD_ALONE}, {seconds:g} s")
        phases[SHARD_ALONE] = sample(_shard_names(shard, leader), seconds, own=False)
        print(f"failover of the idle shard, {kills} kills of its leader")
        failover = failover_trials(shard, kills, random.Random(seed))
    finally:
        shard.stop()
    # The same shard with two cache servers registered (their default 2 s heartbeat, the default 10 s lease).
    cluster = Cluster(work / "servers", {"CACHESVC_META_HEARTBEAT_SECONDS": "2"})
    cluster.shard = LocalShard(3, work / "servers" / "meta3")
    cluster.meta.close()
    cluster.meta = MetaClient(cluster.shard.addresses, timeout=5.0)
    try:
        cluster.start()
        servers = [cluster.add_server() for _ in range(2)]
        cluster.wait_nodes([s.address for s in servers])
        leader, _ = cluster.shard.leader(timeout=30.0)
        time.sleep(3.0)
        pids = {**_shard_names(cluster.shard, leader), **{f"cache server {k}": s.pid for k, s in enumerate(servers, 1)}}
        print(f"{SHARD_SERVERS}, {seconds:g} s")
        phases[SHARD_SERVERS] = sample(pids, seconds, own=False)
    finally:
        cluster.stop()
    return {"phases": phases, "failover_s": failover}


def _median_rows(runs: list[dict[str, Any]]) -> dict[str, Any]:
    phases: dict[str, dict[str, float]] = {}
    for phase in runs[0]["phases"]:
        names = runs[0]["phases"][phase]
        phases[phase] = {n: round(statistics.median(r["phases"][phase][n] for r in runs), 2) for n in names}
    failover = sorted(t for r in runs for t in r["failover_s"])
    return {
        "phases": phases,
        "failover_s": {
            "trials": len(failover),
            "median": round(statistics.median(failover), 3),
            "max": max(failover),
            "min": min(failover),
            "all": failover,
        },
    }


def compare(old_tree: Path, old_commit: str, repeats: int, seconds: float, kills: int, out: Path) -> int:
    """Run the shard phases alternately on `old_tree` and this tree; write medians."""
    new_tree = Path(__file__).resolve().parent.parent
    trees = {"old": old_tree.resolve(), "new": new_tree}
    runs: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
    info = _machine.machine_info()
    head = subprocess.run(["git", "-C", str(new_tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    commits = {"old": old_commit, "new": head.stdout.strip()}
    with tempfile.TemporaryDirectory(prefix="idle-compare-") as tmp:
        for r in range(repeats):
            for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
                tree = trees[name]
                part = Path(tmp) / f"{name}-{r}.json"
                print(f"== repeat {r + 1}/{repeats}: {name} ({tree})", flush=True)
                # Every process the run starts (`python -m cachesvc ...`, in `tree`) runs the tree's code.
                env = {**os.environ, "PYTHONPATH": f"{tree}:{tree / 'client'}", "IDLE_BENCH_TREE": str(tree)}
                argv = [sys.executable, __file__, "--shard-only", "--seconds", f"{seconds:g}"]
                argv += ["--kills", str(kills), "--seed", str(25 + r), "--out", str(part)]
                subprocess.run(argv, cwd=tree, env=env, check=True)
                runs[name].append(json.loads(part.read_text()))
    medians = {name: _median_rows(rs) for name, rs in runs.items()}
    alone, fail = medians["new"]["phases"][SHARD_ALONE], medians["new"]["failover_s"]
    targets = {
        "idle shard CPU per node, ms/s (issue 25: under 1% of a core)": {
            "value": max(alone.values()),
            "target": "< 10",
            "met": max(alone.values()) < 10,
        },
        "failover of the idle shard, max s (docs: within 2 s)": {
            "value": fail["max"],
            "target": "< 2",
            "met": fail["max"] < 2.0,
        },
    }
    result: dict[str, Any] = {
        "benchmark": "idle",
        "command": f"python bench/idle.py --compare OLD_TREE --repeats {repeats} --seconds {seconds:g} --kills {kills}",
        "machine": info,
        "unit": "CPU milliseconds per wall second (1000 = one core busy); failover in seconds",
        "trees": {name: {"path": str(t), "commit": commits[name]} for name, t in trees.items()},
        "repeats": repeats,
        "seconds_per_phase": seconds,
        "targets": targets,
        "median": medians,
        "runs": runs,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# The idle three-node metadata shard, old vs new (issue 25)",
        "",
        f"`{result['command']}` (OLD_TREE: commit {commits['old']} unpacked; new: {commits['new']} + working tree),"
        f" on a shared {info.get('cpu_count')}-core machine; medians of {repeats} alternated runs,"
        f" {seconds:g} s per phase. CPU milliseconds per wall second of each process (10 = 1% of a core).",
        "",
        "| phase | process | old | new |",
        "|---|---|---:|---:|",
    ]
    for phase, row in medians["new"]["phases"].items():
        for n, v in row.items():
            lines.append(f"| {phase} | {n} | {medians['old']['phases'][phase].get(n, float('nan')):.2f} | {v:.2f} |")
    lines += [
        "",
        "Failover of the idle shard: SIGKILL of the leader until a write commits on its successor (seconds).",
        "",
        "| | trials | min | median | max |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in ("old", "new"):
        f = medians[name]["failover_s"]
        lines.append(f"| {name} | {f['trials']} | {f['min']:.2f} | {f['median']:.2f} | {f['max']:.2f} |")
    md = out.with_suffix(".md")
    md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out} and {md}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="wall seconds per phase (default 30)")
    parser.add_argument("--kills", type=int, default=5, help="failover trials of the shard phases (default 5)")
    parser.add_argument("--shard-only", action="store_true", help="only the three-node shard phases")
    parser.add_argument("--compare", metavar="OLD_TREE", help="the shard phases, old tree vs this one, alternated")
    parser.add_argument("--old-commit", default="1d11c3d", help="with --compare: the commit OLD_TREE holds")
    parser.add_argument("--repeats", type=int, default=3, help="with --compare: runs of each tree (default 3)")
    parser.add_argument("--seed", type=int, default=25, help="seed of the kill times")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.compare:
        out = Path(args.out or BENCH_DIR / "results" / "idle_shard.json")
        return compare(Path(args.compare), args.old_commit, args.repeats, args.seconds, args.kills, out)
    info = _machine.machine_info()
    if args.shard_only:
        with tempfile.TemporaryDirectory(prefix="idle-bench-") as tmp:
            result = {
                "tree": str(TREE),
                "machine": info,
                **shard_phases(Path(tmp), args.seconds, args.kills, args.seed),
            }
        out = Path(args.out or BENCH_DIR / "results" / "idle_shard_run.json")
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result["phases"], indent=2), "\nfailover s:", result["failover_s"])
        return 0
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
        shard = shard_phases(Path(tmp), args.seconds, args.kills, args.seed)
        phases.update(shard["phases"])
    out = Path(args.out or BENCH_DIR / "results" / "idle.json")
    previous = json.loads(out.read_text()) if out.exists() else {}
    result: dict[str, Any] = {
        "command": "python bench/idle.py" + (f" --seconds {args.seconds:g}" if args.seconds != 30.0 else ""),
        "machine": info,
        "unit": "CPU milliseconds per wall second (1000 = one core busy)",
        "heartbeat_seconds": 2.0,
        "phases": phases,
        "failover_s": shard["failover_s"],
        # The figures this run replaces, to read beside the new ones.
        "previous": {
            "commit": previous.get("machine", {}).get("commit"),
            "phases": previous.get("phases", {}),
        },
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    names = sorted({n for p in phases.values() for n in p}, key=lambda n: (n == "this client process", n))
    print(f"\n{'phase':<48}" + "".join(f"{n:>16}" for n in names))
    for phase, row in phases.items():
        print(f"{phase:<48}" + "".join(f"{row.get(n, float('nan')):>16.2f}" for n in names))
    print(f"failover (s): {shard['failover_s']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("CACHECLIENT_TUNE_MALLOC", "1")
    sys.exit(main())
