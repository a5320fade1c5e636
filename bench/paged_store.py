"""Storing KV blocks out of vLLM's CPU pages (issue 46): the block's record handed on as pieces of the pages, against
the record built first, then put.

One `cachesvc serve` (L1 shared memory, no L2) on 127.0.0.1; in this
process, the paged KV memory of the benchmark's larger model as vLLM's CPU
backend holds it (8 layers of `[blocks, 8 heads, 128 tokens, 2 x 32]` fp32:
a 128-token block is 2 MiB) and a 2,048-token prefix's 16 blocks (32 MiB)
stored with `KVCache.put_blocks`, each way in turn for `--rounds` rounds
(fresh keys each time; medians):

* pieces: `PagedBlocks.encode` (the record's header, then each run of the
  pages as a view; `cacheclient._batches.Gathered`). Co-located, each piece
  is copied once into the staging area and hashed there; over gRPC, joined
  once into bytes;
* record: the record built in a new buffer, run by run out of the pages,
  sealed, then put (what `encode` did before: the put copies it again, into
  bytes and then into the staging area or the message);
* memcpy: one thread copying as many bytes between two bytearrays, the floor.

Then each prefix is loaded back into other pages (`PagedBlocks.load`):
pieces stored the paged layout (a layer's block is one run of the record
and of the pages: 8 copies a block), record the fused one
(`[layers, 2, kv_heads, tokens, head_dim]`, as `KVCache.put` stores: 128
copies a block). Co-located loads are timed the second time (the first
publishes the blocks in the arena).

Both co-located (`CacheClient(address)`, through the staging area) and over
gRPC (`colocated=False`). Prints the store and load times of each and the
ratio pieces / record (below 1: faster), and writes
bench/results/paged_store.json.

Usage:
    python bench/paged_store.py              # about 20 s on 2 cores
    python bench/paged_store.py --rounds 9
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _machine

from cacheclient import CacheClient
from cacheclient._paged import PagedBlocks
from cacheclient.colocated import Colocated
from cacheclient.kv import KVCache, KVLayout
from cacheclient.wire import tensors as records
from cachesvc.devcluster.procs import ManagedProcess, free_port, wait_for_port

BENCH_DIR = Path(__file__).resolve().parent
BLOCK = 128
LAYOUT = KVLayout(num_layers=8, kv_heads=8, head_dim=32)
BLOCKS = 16


def record_first(paged: PagedBlocks, block_hash: bytes, block_id: int) -> bytearray:
    """The block's record as `encode` built it before: copied run by run into a new buffer, then sealed."""
    buf, offsets = records.new_record(paged.entries)
    run, base, at = paged.run, block_id * paged._block_bytes, offsets[0]
    out = memoryview(buf)
    for pages in paged._pages:
        for place in paged._offsets:
            to = base + place
            out[at : at + run] = pages[to : to + run]
            at += run
    return records.seal(buf, block_hash, paged.entries)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "paged_store.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    layers = [torch.randn(BLOCKS, LAYOUT.kv_heads, BLOCK, 2 * LAYOUT.head_dim) for _ in range(LAYOUT.num_layers)]
    landed = [torch.zeros_like(layer) for layer in layers]
    port = free_port()
    address = f"127.0.0.1:{port}"
    seconds: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="paged-store-bench-") as work:
        config = Path(work) / "kv.toml"
        config.write_text('[[namespaces]]\nprefix = "kv/"\nwrite_mode = "cache-only"\n')
        server = ManagedProcess(
            "cache",
            [sys.executable, "-m", "cachesvc", "serve", "--listen", address, "--l1-bytes", "2GiB", "--config",
             str(config)],
            Path(work) / "cache.log",
            env={**os.environ, "CACHESVC_L1_SHARED": "true"},
        )  # fmt: skip
        try:
            wait_for_port(port, timeout=30.0, proc=server.proc)
            local = CacheClient(address, colocated=True)
            remote = CacheClient(address, colocated=False)
            assert isinstance(local.transport, Colocated) and local.transport.shared_l1(wait=True) is not None
            caches = {
                "colocated": KVCache(local, "bench", BLOCK, layout=LAYOUT),
                "grpc": KVCache(remote, "bench", BLOCK, layout=LAYOUT),
            }
            paged = PagedBlocks(caches["colocated"], layers, BLOCK)
            assert paged.one_copy
            landing = {name: PagedBlocks(kv, landed, BLOCK) for name, kv in caches.items()}
            nbytes = BLOCKS * paged.record.size
            src, dst = bytearray(os.urandom(nbytes)), bytearray(nbytes)
            prompt = 0
            for _ in range(args.rounds + 1):  # the first round warms up (sessions, pages), not counted
                for transport, kv in caches.items():
                    for way, encode in (("pieces", paged.encode), ("record", lambda h, b: record_first(paged, h, b))):
                        prompt += 1
                        hashes = kv.block_hashes([prompt] * (BLOCKS * BLOCK))
                        began = time.perf_counter()
                        kv.put_blocks([(h, encode(h, i)) for i, h in enumerate(hashes)])
                        seconds.setdefault(f"{transport}_{way}", []).append(time.perf_counter() - began)
                        for _ in range(2 if transport == "colocated" else 1):
                            began = time.perf_counter()
                            assert landing[transport].load(hashes, list(range(BLOCKS)), release=False) == BLOCKS
                            took = time.perf_counter() - began
                        seconds.setdefault(f"{transport}_{way}_load", []).append(took)
                        assert all(torch.equal(a, b) for a, b in zip(landed, layers, strict=True))
                        for layer in landed:
                            layer.zero_()
                began = time.perf_counter()
                dst[:] = src
                seconds.setdefault("memcpy", []).append(time.perf_counter() - began)
            staged = local.transport.counts["staged"]
            assert staged == 2 * BLOCKS * (args.rounds + 1), f"co-located stores went over gRPC: {staged} staged"
            # What was stored reads back as the pages held it (the last prompt's, stored as a built record).
            got = caches["grpc"].get([prompt] * (BLOCKS * BLOCK), BLOCKS * BLOCK)
            assert got is not None
            assert torch.equal(got[3][0][0, :, BLOCK : 2 * BLOCK], paged.view(layers[3], 1)[0])
            pieces = caches["colocated"].get([prompt - 3] * (BLOCKS * BLOCK), BLOCKS * BLOCK)  # colocated, pieces
            assert pieces is not None
            assert torch.equal(pieces[5][1][0, :, 0:BLOCK], paged.view(layers[5], 0)[1])
            local.close()
            remote.close()
        finally:
            server.stop()
    ms = {name: round(statistics.median(values) * 1e3, 2) for name, values in seconds.items()}
    result: dict[str, Any] = {
        "machine": _machine.machine_info(torch=True),
        "blocks": BLOCKS,
        "block_bytes": nbytes // BLOCKS,
        "bytes": nbytes,
        "rounds": args.rounds,
        "median_ms": ms,
        "colocated_pieces_vs_record": round(ms["colocated_pieces"] / ms["colocated_record"], 2),
        "grpc_pieces_vs_record": round(ms["grpc_pieces"] / ms["grpc_record"], 2),
        "colocated_pieces_vs_memcpy": round(ms["colocated_pieces"] / ms["memcpy"], 2),
        "colocated_load_paged_vs_fused": round(ms["colocated_pieces_load"] / ms["colocated_record_load"], 2),
        "grpc_load_paged_vs_fused": round(ms["grpc_pieces_load"] / ms["grpc_record_load"], 2),
        "colocated_load_paged_vs_memcpy": round(ms["colocated_pieces_load"] / ms["memcpy"], 2),
        "arena_loads": landing["colocated"].counters["arena"],
    }
    print(f"{BLOCKS} blocks of {nbytes // BLOCKS >> 10} KiB ({nbytes >> 20} MiB), median of {args.rounds} rounds:")
    print("| path | pieces (one copy) | record first | ratio |")
    print("|---|---:|---:|---:|")
    for transport in ("colocated", "grpc"):
        print(f"| {transport} | {ms[f'{transport}_pieces']} ms | {ms[f'{transport}_record']} ms "
              f"| {result[f'{transport}_pieces_vs_record']}x |")  # fmt: skip
    print(f"memcpy of as many bytes: {ms['memcpy']} ms (co-located pieces {result['colocated_pieces_vs_memcpy']}x)")
    print("| load | paged layout (stored as pieces) | fused layout (stored as a record) | ratio |")
    print("|---|---:|---:|---:|")
    for transport in ("colocated", "grpc"):
        print(f"| {transport} | {ms[f'{transport}_pieces_load']} ms | {ms[f'{transport}_record_load']} ms "
              f"| {result[f'{transport}_load_paged_vs_fused']}x |")  # fmt: skip
    print(f"co-located paged load: {result['colocated_load_paged_vs_memcpy']}x a memcpy's time")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
