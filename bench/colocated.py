"""The co-located data plane (issue 23): reads from a server's shared L1 against the same reads over gRPC.

One `cachesvc serve` process (L1 `--l1-bytes`, shared, no L2, no S3) on
127.0.0.1 and, in this process, on the same data:

* `CacheClient(address)` reading through the shared L1 (`cacheclient.colocated`,
  the default on the server's machine);
* `CacheClient(address, colocated=False)`: the same client over gRPC, as
  before this issue (the "today" of the targets);
* a bare `GetStream` through stubs generated from the .proto (no cacheclient
  code), for the large value;
* `bytes(memoryview)` of the same number of bytes already in this process
  (a plain memcpy), the floor.

Measured, each path in turn for `--rounds` rounds (medians reported):

* a 4 KiB hit, p50 and p99 of one thread back to back, over `KEYS` resident keys;
* `get_many` of 64 x 4 KiB (a DataLoader batch), values/s;
* a warm 64 MiB `get`, GB/s;
* server CPU seconds per GiB the co-located reads took (utime + stime of the
  server process over the co-located phase);
* writes, co-located (through the client's staging area, `cacheclient.staged`)
  and over gRPC: a 4 KiB put's p50, `put_many` of 64 x 4 KiB, a 64 MiB put,
  and the server CPU per GiB a co-located put takes (it copies each value
  out of the staging area and verifies its checksum).

Targets (issue 23): 4 KiB p50 <= 20 us; get_many of 64 x 4 KiB >= 10x gRPC;
64 MiB >= 3x a bare GetStream and >= 0.5x memcpy; server CPU <= 0.05 s/GiB.

Usage:
    python bench/colocated.py            # about a minute on 2 cores
    python bench/colocated.py --quick

Writes bench/results/colocated.json and prints the table and the targets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _machine

from cacheclient import CacheClient
from cacheclient.colocated import Colocated
from cacheclient.wire import MAX_MESSAGE_BYTES, cache_pb2, cache_pb2_grpc
from cachesvc.devcluster.procs import ManagedProcess, free_port, wait_for_port

BENCH_DIR = Path(__file__).resolve().parent
KEYS = 256
BATCH = 64
LARGE = 64 << 20


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def latencies(call: Callable[[], object], n: int) -> list[float]:
    took = []
    for _ in range(n):
        began = time.perf_counter()
        call()
        took.append(time.perf_counter() - began)
    took.sort()
    return took


def rate(call: Callable[[], object], seconds: float) -> float:
    """Calls per second, back to back for `seconds`."""
    n = 0
    stop = time.perf_counter() + seconds
    began = time.perf_counter()
    while time.perf_counter() < stop:
        call()
        n += 1
    return n / (time.perf_counter() - began)


def bare_get_stream(stub: Any, key: bytes) -> bytes:
    parts = [chunk.data for chunk in stub.GetStream(cache_pb2.GetRequest(key=key), timeout=60)]
    return b"".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "colocated.json")
    args = parser.parse_args()
    n_small = 2000 if args.quick else 6000
    seconds = 1.0 if args.quick else 2.5
    n_large = 3 if args.quick else 6
    port = free_port()
    address = f"127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="colocated-bench-") as work:
        server = ManagedProcess(
            "cache",
            [sys.executable, "-m", "cachesvc", "serve", "--listen", address, "--l1-bytes", "1GiB"],
            Path(work) / "cache.log",
            env={**os.environ, "CACHESVC_L1_SHARED": "true"},
        )
        try:
            wait_for_port(port, timeout=30.0, proc=server.proc)
            local = CacheClient(address, colocated=True)
            remote = CacheClient(address, colocated=False)
            channel = grpc.insecure_channel(
                address,
                options=[
                    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ],
            )
            stub = cache_pb2_grpc.CacheServiceStub(channel)
            small = {b"s/%04d" % i: os.urandom(4096) for i in range(KEYS)}
            large = os.urandom(LARGE)
            local.put_many(small)
            local.put(b"large", large)
            keys = list(small)
            batches = [keys[i : i + BATCH] for i in range(0, KEYS, BATCH)]
            assert local.get_many(keys) == remote.get_many(keys) == list(small.values())
            assert local.get(b"large") == large == bare_get_stream(stub, b"large")
            transport = local.transport
            assert isinstance(transport, Colocated)
            before = dict(transport.counts)
            rows: dict[str, list[float]] = {}

            def note(name: str, value: float) -> None:
                rows.setdefault(name, []).append(value)

            view = memoryview(large)
            for _ in range(args.rounds):
                counter = iter(range(1 << 30))
                for name, client in (("colocated", local), ("grpc", remote)):
                    took = latencies(lambda c=client, i=counter: c.get(keys[next(i) % KEYS]), n_small)
                    note(f"4KiB p50 us {name}", took[len(took) // 2] * 1e6)
                    note(f"4KiB p99 us {name}", took[int(len(took) * 0.99)] * 1e6)
                    note(
                        f"get_many 64x4KiB values/s {name}",
                        BATCH * rate(lambda c=client, i=counter: c.get_many(batches[next(i) % len(batches)]), seconds),
                    )
                cpu0 = cpu_seconds(server.proc.pid)
                took = latencies(lambda: local.get(b"large"), n_large)
                note("64MiB GB/s colocated", LARGE / statistics.median(took) / 1e9)
                note(
                    "server CPU s/GiB colocated", (cpu_seconds(server.proc.pid) - cpu0) / (n_large * LARGE / (1 << 30))
                )
                took = latencies(lambda: bare_get_stream(stub, b"large"), n_large)
                note("64MiB GB/s bare GetStream", LARGE / statistics.median(took) / 1e9)
                took = latencies(lambda: remote.get(b"large"), n_large)
                note("64MiB GB/s grpc", LARGE / statistics.median(took) / 1e9)
                took = latencies(lambda: bytes(view), n_large * 3)
                note("64MiB GB/s memcpy", LARGE / statistics.median(took) / 1e9)
                # Writes: the same keys rewritten with the same bytes.
                for name, client in (("colocated", local), ("grpc", remote)):
                    took = latencies(
                        lambda c=client, i=counter: c.put(keys[next(i) % KEYS], small[keys[0]]), n_small // 2
                    )
                    note(f"put 4KiB p50 us {name}", took[len(took) // 2] * 1e6)
                    note(
                        f"put_many 64x4KiB values/s {name}",
                        BATCH
                        * rate(
                            lambda c=client, i=counter: c.put_many(
                                [(k, small[k]) for k in batches[next(i) % len(batches)]]
                            ),
                            seconds,
                        ),
                    )
                    cpu0 = cpu_seconds(server.proc.pid)
                    took = latencies(lambda c=client: c.put(b"large", large), n_large)
                    note(f"put 64MiB GB/s {name}", LARGE / statistics.median(took) / 1e9)
                    note(
                        f"server CPU s/GiB put {name}",
                        (cpu_seconds(server.proc.pid) - cpu0) / (n_large * LARGE / (1 << 30)),
                    )
            after = dict(transport.counts)
            asked = after.get("asked", 0) - before.get("asked", 0)
            assert asked == 0, f"{asked} co-located reads went to the server: not a co-located measurement"
            staged = after.get("staged", 0) - before.get("staged", 0)
            assert staged >= args.rounds * (n_small // 2 + n_large), f"only {staged} co-located puts were staged"
            local.close()
            remote.close()
            channel.close()
        finally:
            server.stop(10.0)
    medians = {name: statistics.median(values) for name, values in rows.items()}
    targets = {
        "4KiB p50 <= 20 us": (medians["4KiB p50 us colocated"], medians["4KiB p50 us colocated"] <= 20),
        "get_many 64x4KiB >= 10x gRPC": (
            r := medians["get_many 64x4KiB values/s colocated"] / medians["get_many 64x4KiB values/s grpc"],
            r >= 10,
        ),
        "64 MiB >= 3x bare GetStream": (
            r2 := medians["64MiB GB/s colocated"] / medians["64MiB GB/s bare GetStream"],
            r2 >= 3,
        ),
        "64 MiB >= 0.5x memcpy": (r3 := medians["64MiB GB/s colocated"] / medians["64MiB GB/s memcpy"], r3 >= 0.5),
        "server CPU <= 0.05 s/GiB": (
            medians["server CPU s/GiB colocated"],
            medians["server CPU s/GiB colocated"] <= 0.05,
        ),
    }
    ratios = {
        "put 4KiB p50, gRPC / co-located": medians["put 4KiB p50 us grpc"] / medians["put 4KiB p50 us colocated"],
        "put_many 64x4KiB, co-located / gRPC": medians["put_many 64x4KiB values/s colocated"]
        / medians["put_many 64x4KiB values/s grpc"],
        "put 64MiB, co-located / gRPC": medians["put 64MiB GB/s colocated"] / medians["put 64MiB GB/s grpc"],
        "put 64MiB, co-located / memcpy": medians["put 64MiB GB/s colocated"] / medians["64MiB GB/s memcpy"],
        "server CPU per GiB put, gRPC / co-located": medians["server CPU s/GiB put grpc"]
        / max(medians["server CPU s/GiB put colocated"], 1e-3),
    }
    print(f"{'figure':40} {'median':>12}  runs")
    for name, values in rows.items():
        print(f"{name:40} {medians[name]:12.2f}  {[round(v, 2) for v in values]}")
    print()
    for name, (value, met) in targets.items():
        print(f"{name:34} {value:10.2f}  {'met' if met else 'MISSED'}")
    print()
    for name, value in ratios.items():
        print(f"{name:42} {value:8.2f}x")
    result = {
        "benchmark": "colocated",
        "command": "python bench/colocated.py" + (" --quick" if args.quick else ""),
        "machine": _machine.machine_info(),
        "rows": rows,
        "medians": medians,
        "targets": {name: {"value": value, "met": met} for name, (value, met) in targets.items()},
        "write_ratios": ratios,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
