"""Where a co-located checkpoint save's time goes on the cache server (issue 23): a py-spy profile of each save.

Starts SeaweedFS and the co-located server `bench/checkpoint.py` measures
(L1 a 64 MiB shared arena, L2 on disk, "ckpt/" write-back), saves the same
state (`--state-mib`, default 256 MiB) with `dcp.save` and a
`CacheStorageWriter` once to warm up, then `--saves` times, each under
`py-spy record --threads` of the server's process (250 samples/s, idle
threads left out), waiting for every chunk's upload between saves, as the
benchmark does. With `--dirty-mib`, that many MiB of files are written just
before each save and left for the kernel to write back (what the contenders
before it leave in `bench/checkpoint.py` without `os.sync`).

Each thread's samples are summarised by its innermost frame (staging
sessions, the write-back flusher, ...), with the server's CPU seconds
(utime + stime) and the save's wall time per save.

Usage:
    python bench/pyspy_checkpoint.py                  # about a minute
    python bench/pyspy_checkpoint.py --dirty-mib 2048
Writes bench/results/pyspy_checkpoint.json and the raw collapsed stacks beside it
(pyspy_checkpoint-N.txt).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch.distributed.checkpoint as dcp
from checkpoint import BUCKET, CacheServer, change, state_bytes, state_dict, training_state, wait_uploaded
from tiers import machine_info

from cacheclient.checkpoint import CacheStorageWriter
from cachesvc.devcluster.seaweed import SeaweedFS, SeaweedPorts

BENCH_DIR = Path(__file__).resolve().parent


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid`."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def by_thread(raw: Path, top: int = 12) -> dict[str, Any]:
    """Samples per thread name (numbers dropped), and each thread's innermost frames with the most samples."""
    threads: Counter[str] = Counter()
    leaves: dict[str, Counter[str]] = {}
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        frames = stack.split(";")
        name = re.sub(r"_\d+$", "", re.sub(r"\(\d+\)", "", frames[0]).split(": ", 1)[-1].strip())
        threads[name] += int(count_text)
        leaves.setdefault(name, Counter())[frames[-1]] += int(count_text)
    total = sum(threads.values())
    return {
        "samples": total,
        "threads": {
            name: {
                "share": round(count / total, 3),
                "top_frames": [
                    {"frame": frame, "share_of_thread": round(n / count, 3)}
                    for frame, n in leaves[name].most_common(top)
                ],
            }
            for name, count in threads.most_common()
        },
    }


def dirty(work: Path, mib: int) -> None:
    """Writes `mib` MiB of files under `work` and leaves them for the kernel to write back."""
    block = os.urandom(1 << 20)
    for i in range(0, mib, 256):
        with open(work / f"dirty-{i}", "wb") as f:
            for _ in range(min(256, mib - i)):
                f.write(block)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-mib", type=int, default=256)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--dirty-mib", type=int, default=0, help="MiB of files written just before each save")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "pyspy_checkpoint.json")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        print("py-spy is not installed: pip install py-spy", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="pyspy-checkpoint-"))
    weed = SeaweedFS(work / "s3", SeaweedPorts.free())
    weed.start()
    saves = []
    try:
        weed.create_bucket(BUCKET)
        model, optimizer = training_state(args.state_mib)
        total = state_bytes(state_dict(model, optimizer))
        server = CacheServer(work, weed.endpoint, work / "l2", 6 * total + (1 << 30), 64 << 20, shared=True)
        pid = server.process.proc.pid
        try:

            def save(step: int) -> None:
                writer = CacheStorageWriter(server.client, keep_last=2)
                dcp.save(state_dict(model, optimizer), storage_writer=writer, checkpoint_id=f"profiled/step-{step}")

            change(model, optimizer)
            save(0)
            wait_uploaded(server.client, "profiled/step-0")
            for step in range(1, args.saves + 1):
                change(model, optimizer)
                if args.dirty_mib:
                    dirty(work, args.dirty_mib)
                raw = args.out.with_name(f"pyspy_checkpoint-{step}.txt")
                spy = subprocess.Popen(
                    [py_spy, "record", "--format", "raw", "--rate", "250", "--threads", "--nonblocking",
                     "--pid", str(pid), "--output", str(raw)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
                time.sleep(1.0)  # py-spy attached
                cpu, began = cpu_seconds(pid), time.perf_counter()
                save(step)
                wall, cpu = time.perf_counter() - began, cpu_seconds(pid) - cpu
                spy.send_signal(signal.SIGINT)
                spy.wait(30)
                saves.append({"wall_s": round(wall, 3), "server_cpu_s": round(cpu, 2), **by_thread(raw)})
                print(f"save {step}: {wall:.3f} s, server CPU {cpu:.2f} s", flush=True)
                wait_uploaded(server.client, f"profiled/step-{step}")
        finally:
            server.stop()
    finally:
        weed.stop(grace=10.0)
        shutil.rmtree(work, ignore_errors=True)
    for name, thread in saves[-1]["threads"].items():
        print(f"\n{name}: {thread['share']:.1%} of the last save's samples")
        for row in thread["top_frames"][:6]:
            print(f"  {row['share_of_thread']:6.1%}  {row['frame']}")
    result = {
        "benchmark": "pyspy_checkpoint",
        "command": "python " + " ".join([str(Path(sys.argv[0])), *sys.argv[1:]]),
        "config": {"state_mib": args.state_mib, "saves": args.saves, "dirty_mib": args.dirty_mib},
        "machine": machine_info(),
        "median_wall_s": statistics.median(s["wall_s"] for s in saves),
        "median_server_cpu_s": statistics.median(s["server_cpu_s"] for s in saves),
        "saves": saves,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
