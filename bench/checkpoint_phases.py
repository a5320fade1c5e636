"""Where a co-located blocking checkpoint save's stall goes (issue 47), phase by phase, in turn with DCP.

Starts SeaweedFS and the co-located server `bench/checkpoint.py` measures
(a shared L1, L2 on disk, "ckpt/" write-back), and saves the same state
(`--state-mib`, default 256 MiB) with `dcp.save` and a `CacheStorageWriter`
(`keep_last=2`), one in turn with DCP's `FileSystemWriter` to local disk
(`thread_count` as the cache writer's `threads`, the oldest checkpoint
deleted before each save, outside the timer), `os.sync()` before each save.
The cache's saves are `durability="unsynced"` against DCP's
`sync_files=False`; `--durable`: `durability="cache"` (synced) against
`sync_files=True`.

Each phase of the cache's save is timed in the saving process by wrapping
the function that does it:

* plan: DCP's planning, the wait for the run's retention pass and the
  look-up of the latest checkpoint's chunks (wall);
* chunk hashes: the content hashes of the chunks, in the caller's thread (wall);
* locate: the dedup check of each batch (thread-seconds, summed over the writer's threads);
* place: asking for places (thread-seconds; the round trip, without the writes);
* pwrite, write hash: the client writing each value into its place and
  hashing it as it goes (thread-seconds);
* commit: the round trip of each commit: the server's lease check, its
  checksum pass from the page cache, the index records (and, durable, the syncs) (thread-seconds);
* puts left: from the last chunk handed to the writer's threads until the last put was answered (wall);
* durable check: `wait_durable` after the puts (wall);
* manifest commit: storing the manifest and the run's index (wall);
* uploads under it: write-back uploads the server finished while the save ran;
* CPU seconds per save: of the saving process and of the cache server, while the save ran.

Usage:
    python bench/checkpoint_phases.py                  # about a minute
    python bench/checkpoint_phases.py --durable
Writes bench/results/checkpoint_phases.json (checkpoint_phases-durable.json with --durable).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch.distributed.checkpoint as dcp
import xxhash
from checkpoint import BUCKET, CacheServer, change, state_bytes, state_dict, training_state, wait_uploaded
from tiers import machine_info

import cacheclient.staged as staged
from cacheclient._batches import Gathered
from cacheclient.checkpoint import CacheStorageWriter, Durability, catalog, chunks
from cacheclient.checkpoint import dcp as cache_dcp
from cacheclient.client import CacheClient
from cachesvc.devcluster.seaweed import SeaweedFS

BENCH_DIR = Path(__file__).resolve().parent
THREADS = 4
"""Threads of both writers (the cache writer's default `threads`; DCP's `thread_count` set to it)."""


class Phases:
    """Seconds per phase of the save under way (summed over threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seconds: dict[str, float] = defaultdict(float)

    def add(self, phase: str, seconds: float) -> None:
        with self.lock:
            self.seconds[phase] += seconds

    @contextlib.contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - began)

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.timing(phase):
                return original(*args, **kwargs)

        setattr(owner, name, timed)


PHASES = Phases()


def instrument() -> None:
    """Wraps the functions each phase runs in (see the module docstring)."""
    PHASES.wrap(cache_dcp.CacheStorageWriter, "prepare_global_plan", "plan: retention wait")
    PHASES.wrap(cache_dcp, "_latest_chunks", "plan: latest chunks")
    PHASES.wrap(chunks, "chunk_digest", "chunk hashes")
    PHASES.wrap(CacheClient, "locate_many", "locate (thread-s)")
    PHASES.wrap(staged._Session, "commit", "commit (thread-s)")
    PHASES.wrap(cache_dcp, "commit_checkpoint", "manifest commit")  # the name `finish` calls
    original_finish = chunks.ChunkWriter.finish

    def finish(self: chunks.ChunkWriter) -> chunks.WriteStats:
        with PHASES.timing("puts left + durable check"):
            stats = original_finish(self)
        PHASES.add("durable check", stats.seconds_durable)
        return stats

    chunks.ChunkWriter.finish = finish  # type: ignore[method-assign]
    original_place = staged._Session.place

    def place(self: staged._Session, *args: Any, **kwargs: Any) -> Any:
        with PHASES.timing("place incl. writes (thread-s)"):
            return original_place(self, *args, **kwargs)

    staged._Session.place = place  # type: ignore[method-assign]

    def timed_write_place(fd: int, value: Any) -> int:
        """`staged._write_place`, its pwrite and its hashing timed apart."""
        hashed = xxhash.xxh3_64()
        done = 0
        pwrite_s = hash_s = 0.0
        for whole in value.pieces if isinstance(value, Gathered) else (value,):
            at = 0
            while at < len(whole):
                piece = whole[at : at + staged._PIECE]
                began = time.perf_counter()
                written = 0
                while written < len(piece):
                    written += os.pwrite(fd, piece[written:], done + written)
                wrote = time.perf_counter()
                hashed.update(piece)
                pwrite_s += wrote - began
                hash_s += time.perf_counter() - wrote
                done += len(piece)
                at += len(piece)
        PHASES.add("pwrite (thread-s)", pwrite_s)
        PHASES.add("write hash (thread-s)", hash_s)
        return hashed.intdigest()

    staged._write_place = timed_write_place


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` (every thread)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def report(seconds: dict[str, float]) -> dict[str, float]:
    out = dict(seconds)
    if "place incl. writes (thread-s)" in out:
        out["place round trip (thread-s)"] = (
            out.pop("place incl. writes (thread-s)")
            - out.get("pwrite (thread-s)", 0.0)
            - out.get("write hash (thread-s)", 0.0)
        )
    if "puts left + durable check" in out:
        out["puts left"] = out.pop("puts left + durable check") - out.get("durable check", 0.0)
    return {k: round(v, 4) for k, v in sorted(out.items())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-mib", type=int, default=256)
    parser.add_argument("--saves", type=int, default=4, help="timed saves each (after 3 warm-up saves)")
    parser.add_argument("--chunk-mib", type=int, default=2, help="the cache writer's chunk_bytes, in MiB")
    parser.add_argument("--durable", action="store_true", help="durable=True against DCP sync_files=True")
    parser.add_argument(
        "--no-upload", action="store_true", help='"ckpt/" cache-only: no write-back upload behind the saves'
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out_path = args.out or BENCH_DIR / "results" / (
        "checkpoint_phases-durable.json" if args.durable else "checkpoint_phases.json"
    )
    instrument()
    work = Path(tempfile.mkdtemp(prefix="checkpoint-phases-"))
    weed = SeaweedFS.on_free_ports(work / "s3")
    cache_stalls: list[float] = []
    dcp_stalls: list[float] = []
    per_save: list[dict[str, float]] = []
    try:
        weed.create_bucket(BUCKET)
        model, optimizer = training_state(args.state_mib)
        total = state_bytes(state_dict(model, optimizer))
        server = CacheServer(
            work,
            weed.endpoint,
            work / "l2",
            6 * total + (1 << 30),
            64 << 20,
            shared=True,
            write_mode="cache-only" if args.no_upload else "write-back",
        )
        disk = work / "disk"
        disk.mkdir()
        server_pid = server.process.proc.pid
        cpus: dict[str, list[float]] = {"cachesvc": [], "cachesvc server": [], "DCP": [], "DCP server": []}
        try:
            cache = server.client

            # Before issue 47's second part, "cache" was the unsynced save (no "unsynced" then).
            durability = "cache" if args.durable or not hasattr(Durability, "UNSYNCED") else "unsynced"

            def cache_save(step: int) -> None:
                writer = CacheStorageWriter(
                    cache, keep_last=2, threads=THREADS, durability=durability, chunk_bytes=args.chunk_mib << 20
                )
                dcp.save(state_dict(model, optimizer), storage_writer=writer, checkpoint_id=f"phases/step-{step}")

            def dcp_save(step: int) -> None:
                if step >= 2:
                    shutil.rmtree(disk / f"fs-{step - 2}", ignore_errors=True)
                writer = dcp.FileSystemWriter(str(disk), thread_count=THREADS, sync_files=args.durable)
                dcp.save(state_dict(model, optimizer), storage_writer=writer, checkpoint_id=str(disk / f"fs-{step}"))

            saves: list[tuple[str, Callable[[int], None], list[float]]] = [
                ("cachesvc", cache_save, cache_stalls),
                ("DCP", dcp_save, dcp_stalls),
            ]
            for step in range(3 + args.saves):
                for name, save, stalls in saves:
                    change(model, optimizer)
                    os.sync()
                    PHASES.seconds.clear()
                    uploads = cache.stats()["counters"].get("writebacks", 0)
                    client_cpu, server_cpu = cpu_seconds(os.getpid()), cpu_seconds(server_pid)
                    began = time.perf_counter()
                    save(step)
                    stall = time.perf_counter() - began
                    client_cpu = cpu_seconds(os.getpid()) - client_cpu
                    server_cpu = cpu_seconds(server_pid) - server_cpu
                    cpu = client_cpu + server_cpu
                    uploads = cache.stats()["counters"].get("writebacks", 0) - uploads
                    if step >= 3:
                        cpus[name].append(cpu)
                        cpus[f"{name} server"].append(server_cpu)
                    if name == "cachesvc":
                        catalog.wait_for_retention("phases")
                        if not args.no_upload:
                            wait_uploaded(cache, f"phases/step-{step}")
                        if step >= 3:
                            per_save.append(
                                {"stall": round(stall, 4), "uploads under it": uploads, **report(PHASES.seconds)}
                            )
                    if step >= 3:
                        stalls.append(stall)
                    print(
                        f"{name:<9} step {step}: {stall:.3f} s, CPU {cpu:.2f} s, {uploads} uploads under it",
                        file=sys.stderr,
                        flush=True,
                    )
            counters = cache.stats()["counters"]
        finally:
            server.stop()
    finally:
        weed.stop(grace=10.0)
        shutil.rmtree(work, ignore_errors=True)
    phases = {
        phase: round(statistics.median(s.get(phase, 0.0) for s in per_save), 4)
        for phase in sorted({p for s in per_save for p in s})
    }
    ratio = statistics.median(cache_stalls) / statistics.median(dcp_stalls)
    print(f"\n{'phase (median of the timed saves)':<40} {'seconds':>8}")
    for phase, seconds in phases.items():
        print(f"{phase:<40} {seconds:>8.3f}")
    print(
        f"\ncachesvc {statistics.median(cache_stalls):.3f} s, DCP (sync_files={args.durable}) "
        f"{statistics.median(dcp_stalls):.3f} s: {ratio:.2f}x"
    )
    cpu_median = {name: round(statistics.median(values), 3) for name, values in cpus.items()}
    print(
        f"CPU seconds per save (this process and the cache server, while the save ran): cachesvc "
        f"{cpu_median['cachesvc']:.2f} (server {cpu_median['cachesvc server']:.2f}), DCP {cpu_median['DCP']:.2f}"
    )
    result = {
        "benchmark": "checkpoint_phases",
        "command": "python " + " ".join([str(Path(sys.argv[0])), *sys.argv[1:]]),
        "config": {
            "chunk_mib": args.chunk_mib,
            "state_mib": args.state_mib,
            "saves": args.saves,
            "durable": args.durable,
            "threads": THREADS,
        },
        "machine": machine_info(),
        "loadavg_at_end": list(os.getloadavg()),
        "cachesvc_stalls_s": [round(s, 3) for s in cache_stalls],
        "dcp_stalls_s": [round(s, 3) for s in dcp_stalls],
        "ratio": round(ratio, 3),
        "cpu_s_per_save_median": cpu_median,
        "cpu_s_per_save": {name: [round(c, 2) for c in values] for name, values in cpus.items()},
        "phases_median_s": phases,
        "per_save": per_save,
        "server_counters": {k: v for k, v in counters.items() if "staging" in k or "sync" in k or "durable" in k},
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
