"""Soak: 16 client processes for 10 minutes against a 3-node cluster, every kind of call, checked byte for byte.

Three metadata nodes, three cache servers and SeaweedFS; each client process
(`soak_worker.py`) mixes get, get_many, put and delete of its own keys (a
write-through and a write-back namespace), prefetch plans over a dataset
written before the clock starts, and KV blocks (a cache-only namespace).
Asserted: no call failed, no read returned a wrong byte, and each server's
heap levels off: it grew less than `SETTLED_GROWTH` over the second half of
the run after the warm-up (a fifth of the run). Not a bound on all growth
from the warm-up: the servers raise glibc's trim threshold to 32 MiB
(`cacheclient.tune_malloc`), so a malloc arena keeps up to that much freed
memory, and a thread's arena that first meets a burst of large buffers
steps up once by 16-20 MB (VmRSS 15-18%) and stays there (three 15- and
30-minute runs: one such step per server, then under 4 MB per half).
p50/p99 latency per kind of call and the RSS figures go to
bench/results/soak.json and are printed.

    CACHESVC_SOAK_SECONDS=60 pytest -m slow tests/test_soak.py -s   # default 600
    CACHESVC_SOAK_SECONDS=1800 CACHESVC_SOAK_OUT=bench/results/soak-30min.json pytest -m slow tests/test_soak.py -s

Each server's memory is sampled from /proc/PID/status: VmRSS split into
RssAnon (the heap: what a leak grows), RssFile (mapped files: the LMDB map,
libraries) and RssShmem (the shared L1 arena, filling as the cache does),
and the heap's growth is reported per quarter of the run after the warm-up,
so growth that levels off shows as quarters that grow less and less.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from soak_worker import dataset_key
from versioned import value_of

from conftest import CacheServer, S3Server, running_cluster

# Taken out of the environment: the servers refuse CACHESVC_ variables that are not config keys.
SECONDS = float(os.environ.pop("CACHESVC_SOAK_SECONDS", "600"))
WORKERS = 16
SETTLED_GROWTH = 8 << 20
"""Bytes a server's heap may grow over the second half of the run after the warm-up (its heap is about 80 MB)."""
# About 50 MB, and the clients' own keys and KV blocks about 25 MB more: the caches (60 MiB) fill and evict
# during the warm-up, so what grows after it is not the cache filling.
DATASET_KEYS = 2500
WARM_UP = 0.2
CONFIG = """
workers = 48

[[namespaces]]
prefix = "ds/"
write_mode = "write-through"

[[namespaces]]
prefix = "wt/"
write_mode = "write-through"

[[namespaces]]
prefix = "wb/"
write_mode = "write-back"

[[namespaces]]
prefix = "kv/"
write_mode = "cache-only"
"""
SIZES = [("4MiB", "16MiB")] * 3
WORKER = Path(__file__).with_name("soak_worker.py")
RESULT = Path(
    os.environ.pop("CACHESVC_SOAK_OUT", "")
    or Path(__file__).resolve().parent.parent / "bench" / "results" / "soak.json"
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(int(2 * SECONDS) + 900)]


MEMORY = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


def rss(server: CacheServer) -> dict[str, int]:
    """VmRSS and its parts (`MEMORY`) of a server process, in bytes."""
    assert server.process is not None
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {name: int(fields[name].split()[0]) * 1024 for name in MEMORY}


def quarters(rss_samples: list[tuple[float, list[dict[str, int]]]], server: int) -> list[int]:
    """RssAnon growth of one server in each quarter of the run after the warm-up, in bytes."""
    after = [(t, sample[server]["RssAnon"]) for t, sample in rss_samples if t >= WARM_UP * SECONDS]
    if len(after) < 5:
        return []
    marks = [after[round(i * (len(after) - 1) / 4)][1] for i in range(5)]
    return [b - a for a, b in itertools.pairwise(marks)]


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def summarize(reports: list[dict[str, Any]], rss_samples: list[tuple[float, list[dict[str, int]]]]) -> dict[str, Any]:
    kinds = sorted({k for r in reports for k in r["latency_ms"]})
    latency = {}
    for kind in kinds:
        values = sorted(v for r in reports for v in r["latency_ms"].get(kind, []))
        latency[kind] = {
            "calls": len(values),
            "p50_ms": round(percentile(values, 0.50), 3),
            "p99_ms": round(percentile(values, 0.99), 3),
            "max_ms": round(values[-1], 3),
        }
    warm = next(sample for t, sample in rss_samples if t >= WARM_UP * SECONDS)
    end = rss_samples[-1][1]
    return {
        "benchmark": "soak",
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "seconds": SECONDS,
        "client_processes": len(reports),
        "calls": sum(sum(r["calls"].values()) for r in reports),
        "errors": sum(sum(r["errors"].values()) for r in reports),
        "error_messages": [m for r in reports for m in r["error_messages"]][:10],
        "wrong_reads": sum(r["wrong"] for r in reports),
        "wrong_examples": [m for r in reports for m in r["wrong_examples"]][:10],
        "values_verified": sum(r["values_verified"] for r in reports),
        "kv_misses": sum(r["calls"].get("kv_miss", 0) for r in reports),
        "latency_ms": latency,
        "rss": [
            {
                "warm_vmrss": w["VmRSS"],
                "end_vmrss": e["VmRSS"],
                "vmrss_growth": round(e["VmRSS"] / w["VmRSS"] - 1, 4),
                "warm_rssanon": w["RssAnon"],
                "end_rssanon": e["RssAnon"],
                "rssanon_growth": round(e["RssAnon"] / w["RssAnon"] - 1, 4),
                "rssanon_growth_by_quarter": quarters(rss_samples, i),
                "warm_rssshmem": w["RssShmem"],
                "end_rssshmem": e["RssShmem"],
                "end_rssfile": e["RssFile"],
            }
            for i, (w, e) in enumerate(zip(warm, end, strict=True))
        ],
        "rss_samples": [
            {"t": round(t, 1), **{name.lower(): [s[name] for s in sample] for name in MEMORY}}
            for t, sample in rss_samples
        ],
        "setup": f"3 meta nodes, 3 cache servers (L1, L2 each {SIZES[0]}), SeaweedFS and {WORKERS} client "
        "processes on one 2-core machine shared with other work",
    }


def test_sixteen_clients_against_a_cluster_make_no_error_and_leak_no_memory(s3: S3Server, tmp_path: Path) -> None:
    with running_cluster(s3, tmp_path, CONFIG, SIZES) as cluster:
        with cluster.client() as client:
            keys = [dataset_key(i) for i in range(DATASET_KEYS)]
            for start in range(0, len(keys), 100):
                client.put_many([(k, value_of(k, 1)) for k in keys[start : start + 100]])
        meta = ",".join(cluster.shard.addresses)
        logs = tmp_path / "logs"
        procs = [
            subprocess.Popen(
                [sys.executable, str(WORKER), meta, str(w), str(1000 + w), str(SECONDS), str(DATASET_KEYS)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=(logs / f"worker-{w}.log").open("w"),
                text=True,
                cwd=WORKER.parent,
            )
            for w in range(WORKERS)
        ]
        try:
            for w, p in enumerate(procs):
                assert p.stdout is not None and p.stdout.readline().strip() == "ready", (
                    logs / f"worker-{w}.log"
                ).read_text()[-3000:]
            for p in procs:
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            started = time.monotonic()
            rss_samples: list[tuple[float, list[dict[str, int]]]] = []
            while (elapsed := time.monotonic() - started) < SECONDS - 2:
                rss_samples.append((elapsed, [rss(s) for s in cluster.servers]))
                time.sleep(min(10.0, SECONDS / 50))
            reports = []
            for w, p in enumerate(procs):
                out, _ = p.communicate(timeout=SECONDS + 300)
                assert p.returncode == 0, (logs / f"worker-{w}.log").read_text()[-3000:]
                reports.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    result = summarize(reports, rss_samples)
    RESULT.write_text(json.dumps(result, indent=1) + "\n")
    brief = {k: v for k, v in result.items() if k != "rss_samples"}
    print(json.dumps(brief, indent=1))
    assert result["errors"] == 0, result["error_messages"]
    assert result["wrong_reads"] == 0, result["wrong_examples"]
    assert result["values_verified"] > 0
    for server in result["rss"]:
        settled = sum(server["rssanon_growth_by_quarter"][2:])  # the second half after the warm-up
        assert settled < SETTLED_GROWTH, result["rss"]
