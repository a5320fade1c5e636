"""KV-cache benchmark: a decode worker's time to first token, recomputing the prefill or loading the KV.

For prompts of 512, 2,048 and 8,192 tokens on the small model of
`examples/pd_disaggregation/model.py` (4 layers, 2 KV heads of dim 32, fp32:
2 KiB of KV per token; torch on one CPU thread unless said), in one run:

* TTFT, recompute: the decode worker prefills the whole prompt itself
  (`model(ids)`, then the argmax of the last logits), on one thread and on
  all the machine's cores (`torch.set_num_threads(os.cpu_count())`);
* TTFT, L1 / L2: it loads the prompt's KV blocks through
  `cacheclient.kv.KVCache.fetch` (finding and fetching the longest cached
  prefix in one pass, all but the last token), builds a `DynamicCache` and
  runs the model on the last token only. L1: a
  `cachesvc serve` with memory only; L2: one with `--l1-bytes 0` and an LMDB
  tier, so every read comes from LMDB (its file in the page cache, as on a
  machine whose NVMe pages are warm; not a cold disk). Each load's first
  token is checked against the recomputed one.
* co-located: the same as L1 from a `cachesvc serve` whose L1 is shared
  (`l1.shared`), read by a client on its machine straight from the arena
  (`cacheclient.colocated`; issue 23), with no gRPC on the bulk path;
* KV bytes/s: `KVCache.get` of the whole prompt's blocks (fetch, checksums,
  tensors), against the floor of our stack measured in the same run: a bare
  gRPC server-streaming call (its own process, identity serializers, 1 MiB
  messages, the chunk size of cachesvc's streams) returning as many bytes.
  The co-located reads are also held against a plain memcpy of as many
  bytes (from buffers taking turns, 256 MiB in all, so the source is no
  more in the CPU's cache than the arena is, into one buffer already
  touched, as KVCache's reused result buffer is), the floor of any copy.
  The ratios of the previous result file (the run this one replaces) are
  kept beside the new ones, under "previous".

Every path takes turns over several rounds, so a burst of load from
elsewhere on the machine lands on all of them alike; the numbers are medians.

Usage:
    python bench/kvcache.py            # about 2 minutes on 2 cores
    python bench/kvcache.py --quick    # fewer samples

Writes `bench/results/kvcache.json` and prints a table and the targets:
loading a 2,048-token KV from L1 at least 20x faster than recomputing its
prefill (issue 6); KV transfer at least 80% of the bare gRPC streaming
throughput at 2,048 and 8,192 tokens (issue 15; issue 6 asked 70%); a
co-located `KVCache.get` at least 3x the bare stream and at least half a
memcpy at 2,048 and 8,192 tokens (issue 23).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "pd_disaggregation"))

import _machine

from cacheclient import CacheClient
from cacheclient.colocated import Colocated
from cacheclient.wire import CHUNK_BYTES
from cacheclient.wire import MAX_MESSAGE_BYTES as CLIENT_MAX_MESSAGE_BYTES
from cachesvc.devcluster.procs import ManagedProcess, free_port, wait_for_port

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
LENGTHS = (512, 2048, 8192)
CORES = os.cpu_count() or 1
ECHO_SERVICE = "/bench.EchoStream/Stream"
KV_CONFIG = """
[[namespaces]]
prefix = "kv/"
write_mode = "cache-only"
"""


# -- the floor: a bare streaming server ------------------------------------------


def _identity(data: bytes) -> bytes:
    return data


def serve_echo_stream(listen: str) -> None:
    """Streams as many bytes as the request (ASCII) asks for, in CHUNK_BYTES messages, until SIGTERM."""
    chunk = os.urandom(CHUNK_BYTES)

    def stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        full, rest = divmod(int(request), CHUNK_BYTES)
        for _ in range(full):
            yield chunk
        if rest:
            yield chunk[:rest]

    server = grpc.server(
        ThreadPoolExecutor(max_workers=16),
        options=[
            ("grpc.max_receive_message_length", CLIENT_MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", CLIENT_MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )
    handler = grpc.unary_stream_rpc_method_handler(
        stream, request_deserializer=_identity, response_serializer=_identity
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.EchoStream", {"Stream": handler}),))
    if server.add_insecure_port(listen) == 0:
        raise OSError(f"cannot listen on {listen}")
    server.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(1.0).wait()


# -- processes ---------------------------------------------------------------------


class Processes:
    """The cache servers (L1, L2) and the echo server, stopped by pid on exit."""

    def __init__(self, work: Path) -> None:
        self.started: list[ManagedProcess] = []
        self.work = work
        config = work / "kv.toml"
        config.write_text(KV_CONFIG)
        self.l1 = self._cache("l1", ["--l1-bytes", "2GiB", "--config", str(config)])
        l2_args = ["--l1-bytes", "0", "--l2-bytes", "4GiB", "--l2-path", str(work / "lmdb"), "--config", str(config)]
        self.l2 = self._cache("l2", l2_args)
        self.shared = self._cache("shared", ["--l1-bytes", "2GiB", "--config", str(config)], shared=True)
        port = free_port()
        self.echo = f"127.0.0.1:{port}"
        argv = [sys.executable, str(Path(__file__).resolve()), "--echo-stream-server", self.echo]
        proc = ManagedProcess("echo", argv, work / "logs" / "echo.log")
        self.started.append(proc)
        wait_for_port(port, 30.0, proc=proc.proc)

    def _cache(self, name: str, args: list[str], shared: bool = False) -> str:
        address = f"127.0.0.1:{free_port()}"
        argv = [sys.executable, "-m", "cachesvc", "--log-level", "WARNING", "serve", "--listen", address, *args]
        env = {**os.environ, "CACHESVC_L1_SHARED": "true"} if shared else None
        proc = ManagedProcess(f"cache-{name}", argv, self.work / "logs" / f"cache-{name}.log", env=env)
        self.started.append(proc)
        client = CacheClient(address, timeout=5.0, colocated=False)
        try:
            client.wait_ready(timeout=30.0)
        except Exception as exc:
            raise RuntimeError(f"cache server {name} did not start:\n{proc.tail()}") from exc
        finally:
            client.close()
        return address

    def stop(self) -> None:
        for proc in self.started:
            proc.stop(10.0)


# -- measuring ------------------------------------------------------------------------


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def machine_info() -> dict[str, Any]:
    return _machine.machine_info(["transformers", "grpcio", "lmdb"], torch=True)


def bench_length(
    n: int,
    model: Any,
    caches: dict[str, Any],
    echo_stream: Any,
    rounds: int,
    reps: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """One prompt length: TTFT recompute / L1 / L2, KVCache.get and echo-stream throughput."""
    import torch
    from model import random_prompt

    from cacheclient.hf import cache_from_kv, kv_from_cache

    ids = torch.tensor([random_prompt(n, seed=n)])
    with torch.no_grad():
        out = model(ids, use_cache=True, logits_to_keep=1)
    want = int(out.logits[0, -1].argmax())
    pairs = kv_from_cache(out.cache)
    for kv in caches.values():
        kv.put(ids, pairs)
    keys = caches["l1"].block_keys(ids)
    value_bytes = sum(len(v or b"") for v in caches["l1"].client.get_many(keys))
    for tier, kv in caches.items():
        answered = kv.client.get_with_tier(keys[0])
        assert answered is not None and answered[1] == {"colocated": "l1"}.get(tier, tier), (tier, answered)
    local = caches["colocated"].client.transport
    assert isinstance(local, Colocated) and local.shared_l1(wait=True) is not None, "no co-located arena"
    # The memcpy floor copies from buffers taking turns, 256 MiB in all, so its source is not in the CPU's
    # cache any more than the arena's blocks are.
    floors = [memoryview(os.urandom(value_bytes)) for _ in range(max(2, (256 << 20) // value_bytes))]
    turn = iter(range(1 << 40))
    target = memoryview(bytearray(value_bytes))  # into memory already touched, as KVCache's result buffer is

    def recompute() -> int:
        with torch.no_grad():
            return int(model(ids, logits_to_keep=1).logits[0, -1].argmax())

    def recompute_all_cores() -> None:
        torch.set_num_threads(CORES)
        try:
            recompute()
        finally:
            torch.set_num_threads(1)

    parts: dict[str, dict[str, list[float]]] = {tier: {"fetch": [], "compute": []} for tier in caches}

    def load(tier: str) -> int:
        kv = caches[tier]
        t0 = time.perf_counter()
        cached, fetched = kv.fetch(ids, max_tokens=n - 1)
        t1 = time.perf_counter()
        assert cached == n - 1 and fetched is not None, (tier, cached)
        with torch.no_grad():
            logits = model(ids[:, cached:], cache=cache_from_kv(fetched, model.config)).logits
        token = int(logits[0, -1].argmax())
        parts[tier]["fetch"].append(t1 - t0)
        parts[tier]["compute"].append(time.perf_counter() - t1)
        return token

    def stream_floor() -> None:
        received = sum(len(chunk) for chunk in echo_stream(str(value_bytes).encode()))
        assert received == value_bytes

    for tier in caches:
        if load(tier) != want:
            raise AssertionError(f"{tier}: the first token from the loaded KV differs from the recomputed one")
        for p in parts[tier].values():
            p.clear()
    names = (
        "recompute", "recompute_all", "ttft_l1", "ttft_l2", "ttft_colocated", "get_l1", "get_l2", "get_colocated",
        "raw_l1", "lookup_l1", "echo", "memcpy",
    )  # fmt: skip
    asked_before = local.counts["asked"]
    samples: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for _ in range(max(1, reps // 4)):
            samples["recompute"].append(timed(recompute))
            samples["recompute_all"].append(timed(recompute_all_cores))
        for tier, kv in caches.items():
            for _ in range(reps):
                samples[f"ttft_{tier}"].append(timed(functools.partial(load, tier)))
            for _ in range(reps):
                samples[f"get_{tier}"].append(timed(functools.partial(kv.get, ids, n)))
        for _ in range(reps):
            samples["lookup_l1"].append(timed(lambda: caches["l1"].lookup(ids)))
        for _ in range(reps):
            # The same stream as KVCache.get (values checked in transit), without decoding the blocks.
            samples["raw_l1"].append(timed(lambda: list(caches["l1"].client.iter_many_views(keys))))
        for _ in range(reps):
            samples["echo"].append(timed(stream_floor))
        for _ in range(reps):
            samples["memcpy"].append(timed(lambda: target.__setitem__(slice(None), floors[next(turn) % len(floors)])))
        log(f"  {n} tokens: round {r + 1}/{rounds}")
    asked = local.counts["asked"] - asked_before
    assert asked == 0, f"{asked} co-located block reads went to the server: not a co-located measurement"
    med = {k: statistics.median(v) for k, v in samples.items()}
    row: dict[str, Any] = {
        "tokens": n,
        "value_bytes": value_bytes,
        "blocks": len(keys),
        "samples": {k: len(v) for k, v in samples.items()},
        "ttft_recompute_ms": med["recompute"] * 1e3,
        "ttft_recompute_all_cores_ms": med["recompute_all"] * 1e3,
        "ttft_l1_ms": med["ttft_l1"] * 1e3,
        "ttft_l2_ms": med["ttft_l2"] * 1e3,
        "speedup_l1": med["recompute"] / med["ttft_l1"],
        "speedup_l2": med["recompute"] / med["ttft_l2"],
        "speedup_l1_all_cores": med["recompute_all"] / med["ttft_l1"],
        "speedup_l2_all_cores": med["recompute_all"] / med["ttft_l2"],
        "ttft_parts_ms": {tier: {k: statistics.median(v) * 1e3 for k, v in p.items()} for tier, p in parts.items()},
        "lookup_l1_ms": med["lookup_l1"] * 1e3,
        "kv_get_l1_ms": med["get_l1"] * 1e3,
        "kv_get_l2_ms": med["get_l2"] * 1e3,
        "kv_get_l1_MBps": value_bytes / med["get_l1"] / 1e6,
        "kv_get_l2_MBps": value_bytes / med["get_l2"] / 1e6,
        "echo_stream_ms": med["echo"] * 1e3,
        "echo_stream_MBps": value_bytes / med["echo"] / 1e6,
    }
    row["raw_stream_l1_MBps"] = value_bytes / med["raw_l1"] / 1e6
    row["l1_vs_echo"] = row["kv_get_l1_MBps"] / row["echo_stream_MBps"]
    row["raw_stream_l1_vs_echo"] = row["raw_stream_l1_MBps"] / row["echo_stream_MBps"]
    row["l2_vs_echo"] = row["kv_get_l2_MBps"] / row["echo_stream_MBps"]
    row["ttft_colocated_ms"] = med["ttft_colocated"] * 1e3
    row["speedup_colocated"] = med["recompute"] / med["ttft_colocated"]
    row["kv_get_colocated_ms"] = med["get_colocated"] * 1e3
    row["kv_get_colocated_MBps"] = value_bytes / med["get_colocated"] / 1e6
    row["memcpy_MBps"] = value_bytes / med["memcpy"] / 1e6
    row["colocated_vs_echo"] = row["kv_get_colocated_MBps"] / row["echo_stream_MBps"]
    row["colocated_vs_memcpy"] = row["kv_get_colocated_MBps"] / row["memcpy_MBps"]
    log(
        f"  {n} tokens: recompute {row['ttft_recompute_ms']:.1f} ms "
        f"({row['ttft_recompute_all_cores_ms']:.1f} ms on {CORES} cores), L1 {row['ttft_l1_ms']:.1f} ms "
        f"({row['speedup_l1']:.0f}x), L2 {row['ttft_l2_ms']:.1f} ms ({row['speedup_l2']:.0f}x); "
        f"KV {row['kv_get_l1_MBps']:.0f} MB/s vs echo {row['echo_stream_MBps']:.0f} MB/s; co-located "
        f"{row['kv_get_colocated_MBps']:.0f} MB/s ({row['colocated_vs_echo']:.1f}x echo, "
        f"{row['colocated_vs_memcpy']:.2f}x memcpy)"
    )
    return row


def run(rounds: int, reps: dict[int, int], log: Callable[[str], None]) -> dict[str, Any]:
    from model import BLOCK_TOKENS, FINGERPRINT, build_model, config

    from cacheclient.hf import kv_cache_for

    model = build_model(threads=1)
    layout_bytes_per_token = 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvbench-") as tmp:
        procs = Processes(Path(tmp))
        try:
            caches = {
                tier: kv_cache_for(
                    model,
                    CacheClient(address, colocated=tier == "colocated"),
                    FINGERPRINT,
                    BLOCK_TOKENS,
                    release_on_read=False,
                )
                for tier, address in (("l1", procs.l1), ("l2", procs.l2), ("colocated", procs.shared))
            }
            layout = caches["l1"].layout
            assert layout is not None
            layout_bytes_per_token = layout.num_layers * layout.kv_heads * (layout.head_dim + layout.v_dim) * 4
            echo = grpc.insecure_channel(procs.echo, [("grpc.max_receive_message_length", CLIENT_MAX_MESSAGE_BYTES)])
            echo_stream = echo.unary_stream(ECHO_SERVICE, request_serializer=_identity, response_deserializer=_identity)

            for n in LENGTHS:
                row = bench_length(n, model, caches, echo_stream, rounds, reps[n], log)
                row["kv_bytes"] = n * layout_bytes_per_token
                rows.append(row)
            echo.close()
        finally:
            procs.stop()
    cfg = config()
    return {
        "model": {
            "fingerprint": FINGERPRINT,
            "layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size,
            "kv_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "dtype": "float32",
            "kv_bytes_per_token": layout_bytes_per_token,
            "block_tokens": BLOCK_TOKENS,
        },
        "rows": rows,
    }


TRANSFER_TARGET = 0.80
"""Issue 15: KV reads at 2,048 and 8,192 tokens reach this share of the bare stream's throughput."""
PREVIOUS_FIELDS = (
    "l1_vs_echo", "raw_stream_l1_vs_echo", "l2_vs_echo", "speedup_l1", "ttft_l1_ms", "colocated_vs_echo",
    "colocated_vs_memcpy",
)  # fmt: skip
COLOCATED_VS_ECHO = 3.0
COLOCATED_VS_MEMCPY = 0.5
"""Issue 23: a co-located KVCache.get at 2,048 and 8,192 tokens, against the bare stream and a memcpy."""


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_n = {row["tokens"]: row for row in rows}
    speedup = by_n[2048]["speedup_l1"]
    transfer = {n: row["l1_vs_echo"] for n, row in by_n.items()}
    return {
        "l1_2048_speedup": {"target": 20.0, "measured": speedup, "met": speedup >= 20.0},
        "l1_2048_speedup_all_cores": {
            "target": 20.0,
            "measured": by_n[2048]["speedup_l1_all_cores"],
            "met": by_n[2048]["speedup_l1_all_cores"] >= 20.0,
        },
        "kv_transfer_vs_echo_stream": {
            "target": TRANSFER_TARGET,
            "at_tokens": [2048, 8192],
            "measured_by_tokens": transfer,
            "met_by_tokens": {n: ratio >= TRANSFER_TARGET for n, ratio in transfer.items() if n in (2048, 8192)},
        },
        "colocated_vs_echo_stream": {
            "target": COLOCATED_VS_ECHO,
            "measured_by_tokens": {n: row["colocated_vs_echo"] for n, row in by_n.items()},
            "met_by_tokens": {n: by_n[n]["colocated_vs_echo"] >= COLOCATED_VS_ECHO for n in (2048, 8192)},
        },
        "colocated_vs_memcpy": {
            "target": COLOCATED_VS_MEMCPY,
            "measured_by_tokens": {n: row["colocated_vs_memcpy"] for n, row in by_n.items()},
            "met_by_tokens": {n: by_n[n]["colocated_vs_memcpy"] >= COLOCATED_VS_MEMCPY for n in (2048, 8192)},
        },
    }


def previous_ratios(path: Path) -> dict[str, Any] | None:
    """The ratios of the result file this run replaces (its commit, date, and per-length ratios), or None."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return {
        "commit": old.get("machine", {}).get("commit"),
        "date_utc": old.get("machine", {}).get("date_utc"),
        "rows": {str(r["tokens"]): {k: r[k] for k in PREVIOUS_FIELDS if k in r} for r in old.get("rows", [])},
    }


def table(rows: list[dict[str, Any]], previous: dict[str, Any] | None) -> str:
    head = (
        f"{'tokens':>7} {'KV MiB':>7} {'recompute':>10} {'all cores':>10} {'L1 TTFT':>8} {'x':>5} {'x all':>5} "
        f"{'L2 TTFT':>8} {'x':>5} {'L1 MB/s':>8} {'L2 MB/s':>8} {'raw MB/s':>8} {'echo MB/s':>9} "
        f"{'L1/echo':>7} {'was':>5} {'raw/echo':>8} {'was':>5} {'L2/echo':>7} {'was':>5} "
        f"{'co-loc MB/s':>11} {'/echo':>6} {'/memcpy':>7}"
    )
    lines = [head]
    old_rows = previous["rows"] if previous else {}
    for r in rows:
        old = old_rows.get(str(r["tokens"]), {})

        def was(field: str, old: dict[str, Any] = old) -> str:
            return f"{old[field]:>5.2f}" if field in old else f"{'-':>5}"

        lines.append(
            f"{r['tokens']:>7} {r['kv_bytes'] / 2**20:>7.1f} {r['ttft_recompute_ms']:>8.1f}ms "
            f"{r['ttft_recompute_all_cores_ms']:>8.1f}ms "
            f"{r['ttft_l1_ms']:>6.1f}ms {r['speedup_l1']:>5.0f} {r['speedup_l1_all_cores']:>5.0f} "
            f"{r['ttft_l2_ms']:>6.1f}ms {r['speedup_l2']:>5.0f} "
            f"{r['kv_get_l1_MBps']:>8.0f} {r['kv_get_l2_MBps']:>8.0f} {r['raw_stream_l1_MBps']:>8.0f} "
            f"{r['echo_stream_MBps']:>9.0f} "
            f"{r['l1_vs_echo']:>7.2f} {was('l1_vs_echo')} {r['raw_stream_l1_vs_echo']:>8.2f} "
            f"{was('raw_stream_l1_vs_echo')} {r['l2_vs_echo']:>7.2f} {was('l2_vs_echo')} "
            f"{r['kv_get_colocated_MBps']:>11.0f} {r['colocated_vs_echo']:>6.2f} {r['colocated_vs_memcpy']:>7.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "kvcache.json")
    parser.add_argument("--echo-stream-server", metavar="HOST:PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.echo_stream_server:
        serve_echo_stream(args.echo_stream_server)
        return 0

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    rounds = 2 if args.quick else 3
    reps = {512: 8, 2048: 6, 8192: 3} if args.quick else {512: 16, 2048: 12, 8192: 6}
    started = time.perf_counter()
    info = machine_info()
    previous = previous_ratios(args.out)
    result = run(rounds, reps, log)
    result = {
        "benchmark": "kvcache",
        "command": "python bench/kvcache.py" + (" --quick" if args.quick else ""),
        "seconds": round(time.perf_counter() - started, 1),
        "machine": info,
        **result,
        "targets": targets(result["rows"]),
        "previous": previous,
        "notes": [
            "TTFT is the decode worker's: KVCache.fetch of all but the last prompt token + the forward pass of "
            "that token (L1/L2), or the forward pass of the whole prompt (recompute); torch on one CPU thread, "
            f"except ttft_recompute_all_cores_ms (torch.set_num_threads({CORES}), this machine's cores; "
            "speedup_*_all_cores compare the loads, still on one thread, with it).",
            "lookup_l1_ms: KVCache.lookup alone (one ContainsMany call), what a router would call.",
            "L2 reads come from LMDB whose file is in the page cache (warm NVMe), not from a cold disk.",
            "KV MB/s counts the block values' bytes (tensors and headers) over KVCache.get, which includes "
            "checksums and building the tensors; echo is a bare gRPC server stream of the same bytes in 1 MiB "
            "messages, to its own process, with identity serializers.",
            "raw_stream_l1: CacheClient.iter_many_views of the blocks alone, the GetManyStream call of KVCache.get "
            "with its checksum of each value in transit but no block checks and no tensors.",
            "previous: the ratios of the result file this run replaced (its commit and date), for comparison.",
            "Every path takes turns over the rounds; numbers are medians.",
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result["rows"], previous))
    print(json.dumps(result["targets"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
