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

Usage:
    python bench/smallvalues.py            # about 4 minutes on 2 cores
    python bench/smallvalues.py --quick    # about a minute

Writes bench/results/smallvalues.json (and smallvalues.png when matplotlib is
installed) and prints the tables.
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


# -- the run ----------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    return _machine.machine_info()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer keys and rounds")
    parser.add_argument("--out", default=str(BENCH_DIR / "results" / "smallvalues.json"))
    args = parser.parse_args()
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
