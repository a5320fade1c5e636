"""Small values in L2: bytes spent per value byte, and get/put rates, before and after packing (issue 16).

Before: every value is one LMDB record (`LMDBTier(..., pack_below=0)`, the
layout cachesvc had until issue 16). After: values under 64 KiB are packed
(the default). Both layouts run in the same process, the same server build
and the same rounds; only `pack_below` differs.

Space, for 1, 4 and 16 KiB values with 16-byte keys (a dataset's sample
keys, b"ds/train/0001234"): an L2 of 64 MiB is filled to one and a half times
its budget in random key order, the oldest value evicted whenever the next
would not fit (what the engine does with an LRU policy). Reported per value
byte held: the bytes L2 charges against its budget (`used_bytes`, the
engine's view) and the bytes of the LMDB file in use (B-tree, overflow and
pack pages: what the disk holds). Keys and headers are overhead. The same
with 48-byte keys (a KV block's key) shows how the figure moves with keys.

Rates, for the same sizes, over 2,000 fresh keys per size and round:
* tier: `LMDBTier.put` / `LMDBTier.get` in this process (what the engine calls);
* server: a `cachesvc serve` process with L2 only (no L1, so every get reads
  LMDB), through `CacheClient`: puts one at a time (`put`), gets one at a
  time (`get`) and in batches of 64 (`get_many`);
* co-located: `L2Reader.get_many` in batches of 64 on the server's LMDB
  directory, as DataLoader workers on the server's machine read it.
Each figure is the best of the rounds (load from elsewhere on the machine,
2 cores shared by several people here, only ever slows a round down); the
layouts take turns within a round, and every sample is in the JSON.

KV lookups (`--kv-lookup`, run on its own): `KVCache.lookup` latency for a
2,048-token prompt (8 blocks of 256 tokens, all cached) against a
`cachesvc serve` process on this machine, answered by the local index
(`local_index=True`, synced every 50 ms in the background while timing) and
by the round trip (`contains_many`), p50/p99 over single calls timed with
perf_counter_ns. The token ids come as a tensor and as a list, each "warm"
(the same prompt looked up before: its chain hashes are memoised; for a
list, the same list object) and "cold" (the memos emptied before each call:
8 blake2b chain hashes and the conversion to bytes are paid), and a tensor
never seen whose first 7 blocks a prompt looked up before had (a
conversation's next turn: one block is hashed). Then the miss
rate a stale index causes: an L1 of 8 MiB (64 blocks, LRU) takes a new 8-block
prompt before each lookup of one of the last 48 prompts (so older blocks are
evicted all the time), and each lookup is followed by the fetch a decode
worker would make; then, paced, an L1 of 64 MiB (512 blocks) takes 25 new
prompts a second with 500 lookups a second of the last 192 in between; a
miss is a lookup that claimed more tokens than the fetch then found ("of claims": among lookups that claimed any block;
"tokens lost": claimed tokens the fetch did not find; "found/lookup": tokens
the fetch brought, what a worker saves; an index that has not heard of new
blocks yet claims too little, which costs recomputation, not a miss). Run for
several sync intervals, and for the round trip; "turnovers/sync": how many
times the blocks put during one sync interval would fill the whole L1, the
churn the index has to keep up with.

Usage:
    python bench/smallvalues.py              # about 4 minutes on 2 cores
    python bench/smallvalues.py --quick      # about a minute
    python bench/smallvalues.py --kv-lookup  # the KV lookup part only, about a minute

Writes bench/results/smallvalues.json (and smallvalues.png when matplotlib is
installed) and prints the tables; `--kv-lookup` merges its part ("kv_lookup")
into the existing JSON and leaves the rest as it was.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _machine

from cacheclient import CacheClient
from cacheclient._lmdb_reader import L2Reader
from cacheclient.wire import checksum
from cachesvc.devcluster.procs import ManagedProcess, free_port
from cachesvc.tiers.lmdb_tier import PACK_BELOW, LMDBTier

BENCH_DIR = Path(__file__).resolve().parent
SIZES = {"1KiB": 1 << 10, "4KiB": 4 << 10, "16KiB": 16 << 10}
LAYOUTS = {"before": 0, "after": PACK_BELOW}  # pack_below
SPACE_MAP = 64 << 20
SERVER_MAP = 512 << 20
BATCH = 64


# -- space --------------------------------------------------------------------------


def fill_to_budget(path: Path, size: int, pack_below: int, key_bytes: int) -> dict[str, float]:
    """Fills an L2 to 1.5x its budget, evicting the oldest; what it charges and holds per value byte."""
    tier = LMDBTier(path, SPACE_MAP, pack_below=pack_below)
    assert tier.capacity_bytes is not None
    rng = random.Random(size)
    order = list(range(int(tier.capacity_bytes / size * 1.5)))
    rng.shuffle(order)
    value = rng.randbytes(size)
    value_checksum = checksum(value)
    resident: OrderedDict[bytes, None] = OrderedDict()
    for n in order:
        key = b"ds/train/%07d" % n
        key = key.rjust(key_bytes, b"k")
        while tier.used_bytes + tier.cost(key, size) > tier.capacity_bytes:
            tier.delete(resident.popitem(last=False)[0])
        tier.put(key, value, value_checksum)
        resident[key] = None
    value_bytes = len(resident) * size
    result = {
        "values": len(resident),
        "charged_per_value_byte": tier.used_bytes / value_bytes,
        "disk_per_value_byte": tier.disk_bytes() / value_bytes,
        "values_share_of_charged": value_bytes / tier.used_bytes,
        "values_share_of_disk": value_bytes / tier.disk_bytes(),
        "file_bytes": (path / "data.mdb").stat().st_size,
    }
    tier.close()
    return result


# -- rates ----------------------------------------------------------------------------


def rate(n: int, run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return n / (time.perf_counter() - start)


def tier_rates(path: Path, size: int, pack_below: int, keys: list[bytes]) -> dict[str, float]:
    tier = LMDBTier(path, SERVER_MAP, pack_below=pack_below)
    value = os.urandom(size)
    value_checksum = checksum(value)

    def put_all() -> None:
        for key in keys:
            tier.put(key, value, value_checksum)

    def get_all() -> None:
        for key in keys:
            entry = tier.get(key)
            assert entry is not None and len(entry.value) == size

    result = {"put": rate(len(keys), put_all), "get": rate(len(keys), get_all)}
    tier.close()
    shutil.rmtree(path)
    return result


class Server:
    """This file run as `serve`: a cache server with L2 only, its LMDB tier built with `pack_below`."""

    def __init__(self, name: str, pack_below: int, work: Path) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        self.l2 = work / f"l2-{name}"
        argv = [sys.executable, __file__, "serve", str(pack_below), self.address, str(self.l2)]
        self.process = ManagedProcess(f"cache-{name}", argv, work / f"cache-{name}.log")
        self.client = CacheClient(self.address, timeout=30.0)
        self.client.wait_ready(timeout=60.0)
        info = self.client.info()
        self.reader = L2Reader(str(info["l2_path"]), int(info["l2_map_size"]))

    def stop(self) -> None:
        self.client.close()
        self.process.stop(10.0)


def server_rates(server: Server, size: int, keys: list[bytes]) -> dict[str, float]:
    value = os.urandom(size)
    client, reader = server.client, server.reader

    def put_all() -> None:
        for key in keys:
            client.put(key, value)

    def get_all() -> None:
        for key in keys:
            assert client.get(key) == value

    def batches(read: Callable[[list[bytes]], list[bytes | None]]) -> Callable[[], None]:
        def run() -> None:
            for i in range(0, len(keys), BATCH):
                got = read(keys[i : i + BATCH])
                assert all(v == value for v in got), "a value did not come back"

        return run

    return {
        "server_put": rate(len(keys), put_all),
        "server_get": rate(len(keys), get_all),
        "server_get_many": rate(len(keys), batches(client.get_many)),
        "colocated_get_many": rate(len(keys), batches(reader.get_many)),
    }


def serve(pack_below: int, address: str, l2_path: str) -> None:
    """The server process: `cachesvc serve` with L2 only, its LMDB tier built with `pack_below`."""
    import cachesvc.server.server as server_module
    from cachesvc.config import load_config

    server_module.LMDBTier = functools.partial(LMDBTier, pack_below=pack_below)  # type: ignore[misc,assignment]
    cfg = load_config(env={}, overrides={"listen": address, "l1.bytes": 0, "l2.path": l2_path, "l2.bytes": SERVER_MAP})
    server_module.serve(cfg)


# -- KV lookups -----------------------------------------------------------------------

KV_BLOCK = 256
KV_PROMPT = 2048
KV_CONFIG = '[[namespaces]]\nprefix = "kv/"\nwrite_mode = "cache-only"\n'


def _kv_server(work: Path, l1: str, policy: str = "lru-k") -> tuple[ManagedProcess, str]:
    config = work / f"kv-{policy}.toml"
    config.write_text(f'policy = "{policy}"\n' + KV_CONFIG)
    address = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "cachesvc", "serve", "--listen", address, "--l1-bytes", l1, "--config", str(config)]
    process = ManagedProcess(f"kv-{l1}", argv, work / f"kv-{l1}.log")
    CacheClient(address, timeout=30.0).wait_ready(timeout=60.0)
    return process, address


def _percentiles(samples_ns: list[int]) -> dict[str, float]:
    ordered = sorted(samples_ns)
    return {
        "p50_us": ordered[len(ordered) // 2] / 1e3,
        "p99_us": ordered[int(len(ordered) * 0.99)] / 1e3,
        "mean_us": sum(ordered) / len(ordered) / 1e3,
        "calls": len(ordered),
    }


def kv_lookup_latency(address: str, calls: int) -> dict[str, Any]:
    """p50/p99 of `KVCache.lookup` for 2,048-token prompts: local index vs round trip, tensor vs list, warm vs cold."""
    import torch

    from cacheclient.kv import KVCache, KVLayout

    layout = KVLayout(num_layers=2, kv_heads=2, head_dim=16)
    client = CacheClient(address, timeout=30.0)
    local = KVCache(client, "bench-model", KV_BLOCK, layout=layout, local_index=True, max_staleness=0.5)
    remote = KVCache(client, "bench-model", KV_BLOCK, layout=layout)
    rng = torch.Generator().manual_seed(16)
    prompts = [torch.randint(0, 50_000, (KV_PROMPT,), generator=rng) for _ in range(16)]
    kv = [(torch.randn(1, 2, KV_PROMPT, 16), torch.randn(1, 2, KV_PROMPT, 16)) for _ in range(2)]
    for ids in prompts:
        local.put(ids, kv)
    assert local.index is not None
    local.index.sync()
    lists = [ids.tolist() for ids in prompts]

    def timed(cache: KVCache, inputs: list[Any], cold: bool, n: int) -> dict[str, float]:
        samples = []
        for i in range(n):
            ids = inputs[i % len(inputs)]
            if cold:  # what a prompt never seen costs: the chain hashes and the conversion to bytes
                cache._memo.clear()
                cache._lists.clear()
                cache._blocks.clear()
            began = time.perf_counter_ns()
            found = cache.lookup(ids)
            samples.append(time.perf_counter_ns() - began)
            assert found == KV_PROMPT, found
        return _percentiles(samples)

    result: dict[str, Any] = {}
    for name, cache in (("local_index", local), ("round_trip", remote)):
        n = calls if cache is local else max(200, calls // 10)
        for kind, inputs in (("tensor", prompts), ("list", lists)):
            for cold in (False, True):
                result[f"{name} {kind} {'cold' if cold else 'warm'}"] = timed(cache, inputs, cold, n)
        # A new list object with the same tokens: the list memo misses, the bytes memo hits.
        copies = [list(ids) for ids in lists for _ in range(n // len(lists) + 1)][:n]
        samples = []
        for fresh in copies:
            began = time.perf_counter_ns()
            cache.lookup(fresh)
            samples.append(time.perf_counter_ns() - began)
        result[f"{name} list new-object"] = _percentiles(samples)
        # A prompt never seen whose first 7 blocks a recent prompt had (a conversation's next turn):
        # only its last block is hashed.
        tail = torch.Generator().manual_seed(99)
        extended = [
            torch.cat(
                [
                    prompts[i % len(prompts)][: KV_PROMPT - KV_BLOCK],
                    torch.randint(0, 50_000, (KV_BLOCK,), generator=tail),
                ]
            )
            for i in range(min(n, 2000))
        ]
        samples = []
        for ids in extended:
            began = time.perf_counter_ns()
            found = cache.lookup(ids)
            samples.append(time.perf_counter_ns() - began)
            assert found == KV_PROMPT - KV_BLOCK, found
        result[f"{name} tensor new, 7/8 blocks seen"] = _percentiles(samples)
    assert local.counters["lookups_remote"] == 0, "the index went stale while timing"
    local.close()
    client.close()
    return result


def kv_stale_misses(
    address: str, seconds: float, interval: float | None, window: int = 48, prompts_per_second: float | None = None
) -> dict[str, Any]:
    """Lookups whose claim the following fetch does not find, while puts evict blocks all the time.

    Args:
        interval: the index's sync interval; None: lookups make the round trip.
        window: lookups pick one of the last `window` prompts put.
        prompts_per_second: new prompts put per second, with 500 lookups a second in
            between; None: one put before each lookup, as fast as they go.
    """
    import torch

    from cacheclient._kvindex import KVIndex
    from cacheclient.kv import KVCache, KVLayout

    layout = KVLayout(num_layers=2, kv_heads=2, head_dim=16)
    client = CacheClient(address, timeout=30.0)
    index = KVIndex(client, "kv/", interval=interval) if interval is not None else None
    cache = KVCache(
        client,
        f"stale-{interval}",
        KV_BLOCK,
        layout=layout,
        local_index=index if index is not None else False,
        max_staleness=3600.0,
    )
    rng = torch.Generator().manual_seed(7)
    kv = [(torch.randn(1, 2, KV_PROMPT, 16), torch.randn(1, 2, KV_PROMPT, 16)) for _ in range(2)]
    recent: list[torch.Tensor] = []
    lookups = misses = claims = claimed_tokens = lost_tokens = found_tokens = puts = 0
    pick = random.Random(3)
    if index is not None:
        index.sync()
    staleness: list[float] = []
    began = time.monotonic()
    deadline = began + seconds
    next_put = began
    while time.monotonic() < deadline:
        if prompts_per_second is not None:
            # A worker's request rate, not a spin: a spinning thread would starve the sync thread of the GIL.
            time.sleep(max(0.0, began + lookups / 500.0 - time.monotonic()))
        if time.monotonic() >= next_put:
            ids = torch.randint(0, 50_000, (KV_PROMPT,), generator=rng)
            cache.put(ids, kv)
            puts += 1
            recent = [*recent[-(window - 1) :], ids]
            if prompts_per_second is not None:
                next_put = began + puts / prompts_per_second
        target = recent[pick.randrange(len(recent))]
        if index is not None:
            staleness.append(index.staleness)
        claimed = cache.lookup(target)
        found, _ = cache.fetch(target, max_tokens=claimed) if claimed else (0, None)
        lookups += 1
        claims += claimed > 0
        claimed_tokens += claimed
        found_tokens += found
        if found < claimed:
            misses += 1
            lost_tokens += claimed - found
    l1 = next(tier for tier in client.stats()["tiers"] if tier["name"] == "l1")
    block_bytes = len(client.get(cache.block_keys(recent[-1])[0]) or b"")
    cache_blocks = l1["capacity_bytes"] // block_bytes if block_bytes else 0
    if index is not None:
        index.close()
    client.close()
    blocks_per_second = puts * KV_PROMPT / KV_BLOCK / seconds
    return {
        "sync_interval_s": interval,
        "lookups": lookups,
        "blocks_put_per_second": round(blocks_per_second, 1),
        "cache_blocks": cache_blocks,
        "staleness_ms_p50": round(sorted(staleness)[len(staleness) // 2] * 1e3, 1) if staleness else None,
        "staleness_ms_max": round(max(staleness) * 1e3, 1) if staleness else None,
        "cache_turnovers_per_sync_interval": (
            round(blocks_per_second * interval / cache_blocks, 2) if interval and cache_blocks else None
        ),
        "miss_rate": misses / lookups if lookups else 0.0,
        "miss_rate_of_claims": misses / claims if claims else 0.0,
        "claimed_tokens_not_found": lost_tokens / claimed_tokens if claimed_tokens else 0.0,
        "mean_claimed_tokens": claimed_tokens / lookups if lookups else 0.0,
        "mean_found_tokens": found_tokens / lookups if lookups else 0.0,
    }


def kv_lookup_main(out: Path, calls: int, seconds: float) -> int:
    """The KV lookup benchmark alone; merges "kv_lookup" into the JSON at `out`."""
    with tempfile.TemporaryDirectory(prefix="kvlookup-") as tmp:
        work = Path(tmp)
        process, address = _kv_server(work, "256MiB")
        try:
            latency = kv_lookup_latency(address, calls)
        finally:
            process.stop(10.0)
        # LRU: under LRU-K the blocks a fetch touched twice stay and only the
        # newest puts churn, so a stale index would hardly ever be wrong.
        process, address = _kv_server(work, "8MiB", policy="lru")
        try:
            stale = [kv_stale_misses(address, seconds, interval) for interval in (None, 0.01, 0.05, 0.2, 1.0)]
        finally:
            process.stop(10.0)
        # Paced: 25 prompts (200 blocks) a second into an L1 of 512 blocks.
        process, address = _kv_server(work, "64MiB", policy="lru")
        try:
            paced = [
                kv_stale_misses(address, seconds, interval, window=192, prompts_per_second=25.0)
                for interval in (None, 0.05, 0.2, 1.0)
            ]
        finally:
            process.stop(10.0)
    result = json.loads(out.read_text()) if out.exists() else {}
    result["kv_lookup"] = {
        "command": f"python bench/smallvalues.py --kv-lookup --kv-calls {calls} --kv-seconds {seconds:g}",
        "machine": machine(),
        "prompt_tokens": KV_PROMPT,
        "block_tokens": KV_BLOCK,
        "latency": latency,
        "stale_index_misses": stale,
        "stale_index_misses_paced": paced,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nKVCache.lookup, {KV_PROMPT}-token prompt, {KV_PROMPT // KV_BLOCK} blocks (microseconds)")
    print(f"{'':<32}{'p50':>10}{'p99':>10}")
    for what, figures in latency.items():
        print(f"{what:<32}{figures['p50_us']:>10.1f}{figures['p99_us']:>10.1f}")
    for title, rows in (("as fast as puts go, L1 of 64 blocks", stale), ("25 prompts/s, L1 of 512 blocks", paced)):
        _print_stale(title, rows)
    print(f"merged into {out}")
    return 0


def _print_stale(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\nstale index under eviction ({title}): lookups whose claim the fetch did not find")
    print(
        f"{'sync interval':<16}{'lookups':>9}{'blocks put/s':>14}{'miss rate':>11}{'of claims':>11}"
        f"{'tokens lost':>13}{'found/lookup':>14}{'turnovers/sync':>16}{'staleness p50/max ms':>22}"
    )
    for row in rows:
        shown = "round trip" if row["sync_interval_s"] is None else f"{row['sync_interval_s'] * 1e3:g} ms"
        print(
            f"{shown:<16}{row['lookups']:>9}{row['blocks_put_per_second']:>14.0f}"
            f"{row['miss_rate']:>11.1%}{row['miss_rate_of_claims']:>11.1%}"
            f"{row['claimed_tokens_not_found']:>13.1%}{row['mean_found_tokens']:>14.0f}"
            f"{row['cache_turnovers_per_sync_interval'] or 0:>16.2f}"
            f"{row['staleness_ms_p50'] or 0:>14.0f}/{row['staleness_ms_max'] or 0:<7.0f}"
        )


def machine() -> dict[str, Any]:
    return _machine.machine_info()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer keys and rounds")
    parser.add_argument("--out", default=str(BENCH_DIR / "results" / "smallvalues.json"))
    parser.add_argument("--kv-lookup", action="store_true", help="only the KV lookup part, merged into --out")
    parser.add_argument("--kv-calls", type=int, default=5000, help="timed lookups per case (local index)")
    parser.add_argument("--kv-seconds", type=float, default=6.0, help="seconds of each stale-index run")
    args = parser.parse_args()
    if args.kv_lookup:
        return kv_lookup_main(Path(args.out), args.kv_calls, args.kv_seconds)
    rounds, n_keys = (1, 1000) if args.quick else (5, 2000)
    info = machine()

    space: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="smallvalues-") as tmp:
        work = Path(tmp)
        for key_bytes in (16, 48):
            for label, size in SIZES.items():
                for layout, pack_below in LAYOUTS.items():
                    path = work / f"space-{key_bytes}-{label}-{layout}"
                    space.setdefault(f"{key_bytes}B keys", {}).setdefault(label, {})[layout] = fill_to_budget(
                        path, size, pack_below, key_bytes
                    )

        samples: dict[str, dict[str, dict[str, list[float]]]] = {}
        servers = {layout: Server(layout, pack_below, work) for layout, pack_below in LAYOUTS.items()}
        try:
            for round_ in range(rounds):
                for label, size in SIZES.items():
                    keys = [b"ds/%s/r%d/%07d" % (label.encode(), round_, i) for i in range(n_keys)]
                    order = list(LAYOUTS) if round_ % 2 == 0 else list(reversed(LAYOUTS))
                    for layout in order:
                        path = work / f"rates-{label}-{layout}-{round_}"
                        found = tier_rates(path, size, LAYOUTS[layout], keys)
                        found |= server_rates(servers[layout], size, keys)
                        for what, value in found.items():
                            samples.setdefault(label, {}).setdefault(layout, {}).setdefault(what, []).append(value)
        finally:
            for server in servers.values():
                server.stop()

    rates = {
        label: {layout: {what: max(v) for what, v in found.items()} for layout, found in by.items()}
        for label, by in samples.items()
    }
    result = {
        "command": "python bench/smallvalues.py" + (" --quick" if args.quick else ""),
        "machine": info,
        "plan": {"rounds": rounds, "keys_per_size": n_keys, "batch": BATCH, "space_map_bytes": SPACE_MAP},
        "layouts": {"before": "pack_below=0: one LMDB record per value", "after": f"pack_below={PACK_BELOW}"},
        "space": space,
        "rates_per_second_best_of_rounds": rates,
        "rate_samples": samples,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_tables(space, rates)
    plot(space, rates, out.with_suffix(".png"))
    print(f"wrote {out}")
    return 0


def print_tables(space: dict[str, Any], rates: dict[str, Any]) -> None:
    print("\nL2 bytes per value byte (charged against the budget / on disk); values' share of the bytes")
    print(f"{'keys':<10}{'size':<7}{'before':>16}{'after':>16}{'share before':>15}{'share after':>14}")
    for keys, by_size in space.items():
        for label, by in by_size.items():
            b, a = by["before"], by["after"]
            print(
                f"{keys:<10}{label:<7}"
                f"{b['charged_per_value_byte']:>8.3f}/{b['disk_per_value_byte']:<7.3f}"
                f"{a['charged_per_value_byte']:>8.3f}/{a['disk_per_value_byte']:<7.3f}"
                f"{b['values_share_of_disk']:>14.1%}{a['values_share_of_disk']:>14.1%}"
            )
    print("\nrates, values per second (best of rounds): before -> after")
    whats = ["put", "get", "server_put", "server_get", "server_get_many", "colocated_get_many"]
    print(f"{'size':<7}" + "".join(f"{w:>26}" for w in whats))
    for label, by in rates.items():
        cells = [f"{by['before'][w]:>11,.0f} -> {by['after'][w]:<10,.0f}" for w in whats]
        print(f"{label:<7}" + "".join(f"{c:>26}" for c in cells))


def plot(space: dict[str, Any], rates: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = list(SIZES)
    width = 0.35
    for i, layout in enumerate(LAYOUTS):
        shares = [space["16B keys"][label][layout]["values_share_of_disk"] * 100 for label in labels]
        left.bar([x + (i - 0.5) * width for x in range(len(labels))], shares, width, label=layout)
    left.axhline(90, color="grey", linestyle="--", linewidth=1)
    left.set_xticks(range(len(labels)), labels)
    left.set_ylabel("% of L2 disk bytes holding values")
    left.set_title("L2 space (16-byte keys)")
    left.legend()
    whats = ["get", "server_get", "server_get_many", "colocated_get_many"]
    for i, layout in enumerate(LAYOUTS):
        for j, what in enumerate(whats):
            values = [rates[label][layout][what] for label in labels]
            right.plot(
                labels, values, marker="o", linestyle="-" if i else "--", color=f"C{j}", label=f"{what} {layout}"
            )
    right.set_yscale("log")
    right.set_ylabel("values per second")
    right.set_title("get rates, before (dashed) and after")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "serve":
        serve(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        sys.exit(main())
