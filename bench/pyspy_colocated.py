"""What is left on the co-located paths (issue 23): a py-spy profile of a client on the server's machine.

Starts one `cachesvc serve` (L1 1 GiB in a shared arena, nothing below) and
fills it, then runs a client process under `py-spy record` (`--rate`
samples/s, native frames off) once per phase, each for `--seconds`:

* `get 4KiB`: `CacheClient.get` of 4 KiB values, back to back (arena reads);
* `get_many 64x4KiB`: `get_many` of 64 such values (a DataLoader batch);
* `get 64MiB`: `get` of one 64 MiB value;
* `put 4KiB`: `put` of 4 KiB values (through the staging area).

Each phase's samples are summarised as `bench/pyspy_profile.py` does (by
where the innermost frame lives, and the 25 innermost functions with the
most samples), with the calls per second the process made under the profiler.

Usage:
    python bench/pyspy_colocated.py            # about a minute
Writes bench/results/pyspy_colocated.json and the raw collapsed stacks beside it
(pyspy_colocated-PHASE.txt).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _machine
from pyspy_profile import summarise

from cacheclient import CacheClient
from cachesvc.devcluster.procs import ManagedProcess, free_port, wait_for_port

BENCH_DIR = Path(__file__).resolve().parent
PHASES = ("get 4KiB", "get_many 64x4KiB", "get 64MiB", "put 4KiB")

_CHILD = """
import os, sys, time
from cacheclient import CacheClient
address, phase, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
client = CacheClient(address, colocated=True)
assert client.transport.shared_l1(wait=True) is not None
keys = [b"s/%04d" % i for i in range(256)]
value = os.urandom(4096)
calls = 0
stop = time.perf_counter() + seconds
while time.perf_counter() < stop:
    if phase == "get 4KiB":
        client.get(keys[calls % 256])
    elif phase == "get_many 64x4KiB":
        client.get_many(keys[(calls % 4) * 64 : (calls % 4) * 64 + 64])
    elif phase == "get 64MiB":
        client.get(b"large")
    else:
        client.put(keys[calls % 256], value)
    calls += 1
counts = dict(client.transport.counts)
assert counts.get("asked", 0) == 0, counts
print("CALLS/S", calls / seconds, flush=True)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rate", type=int, default=250)
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "pyspy_colocated.json")
    args = parser.parse_args()
    py_spy = Path(sys.executable).parent / "py-spy"
    port = free_port()
    address = f"127.0.0.1:{port}"
    phases = {}
    with tempfile.TemporaryDirectory(prefix="pyspy-colocated-") as work:
        server = ManagedProcess(
            "cache",
            [sys.executable, "-m", "cachesvc", "serve", "--listen", address, "--l1-bytes", "1GiB"],
            Path(work) / "cache.log",
            env={**os.environ, "CACHESVC_L1_SHARED": "true"},
        )
        try:
            wait_for_port(port, timeout=30.0, proc=server.proc)
            with CacheClient(address, colocated=False) as client:
                client.put_many({b"s/%04d" % i: os.urandom(4096) for i in range(256)})
                client.put(b"large", os.urandom(64 << 20))
            child = Path(work) / "child.py"
            child.write_text(_CHILD)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            for phase in PHASES:
                raw = args.out.with_name(f"pyspy_colocated-{phase.split()[0]}-{phase.split()[1]}.txt")
                done = subprocess.run(
                    [str(py_spy), "record", "--format", "raw", "--rate", str(args.rate), "--output", str(raw),
                     "--", sys.executable, str(child), address, phase, str(args.seconds)],
                    capture_output=True, text=True, env=env, timeout=args.seconds + 120,
                )  # fmt: skip
                if done.returncode != 0:
                    raise RuntimeError(f"{phase}: {done.stderr[-2000:]}")
                calls = float(next(line for line in done.stdout.splitlines() if line.startswith("CALLS/S")).split()[1])
                phases[phase] = {"calls_per_s_profiled": round(calls, 1), **summarise(raw)}
                print(f"\n{phase}: {calls:,.0f} calls/s under the profiler")
                for row in phases[phase]["top_functions"][:8]:
                    print(f"  {row['share']:6.1%}  {row['frame']}")
        finally:
            server.stop(10.0)
    result = {
        "benchmark": "pyspy_colocated",
        "command": "python bench/pyspy_colocated.py",
        "machine": _machine.machine_info(),
        "phases": phases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
