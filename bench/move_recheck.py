"""What a placement move costs a node before its co-located clients read directly again: listing its L2's keys.

When the placement moves keys to or from a node (a join, a drain, a node
put back), the node rechecks what it caches of the keys that moved
(`Engine.unvouch_cached`), and a node a peer fenced serves no direct reads
until that is done (docs/cluster.md). Listing L2's keys used to read every
record's header from the LMDB file (`LMDBTier.scan`); it now reads the
tier's own index (`LMDBTier.list_keys`). This measures both on the same file, in
one run, for `--keys` values of `--size` bytes, and the whole recheck (none
moved; a quarter moved, which also writes their markers in the file).

    .venv/bin/python bench/move_recheck.py [--keys 100000] [--size 2048] [--repeat 5]

Writes bench/results/move_recheck.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _machine
from colocated import latencies

from cachesvc.engine import Engine
from cachesvc.policy import LRUPolicy
from cachesvc.tiers import LMDBTier

RESULTS = Path(__file__).resolve().parent / "results" / "move_recheck.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="move-recheck-") as tmp:
        l2 = LMDBTier(Path(tmp) / "l2", max(1 << 30, args.keys * (args.size + 512) * 2))
        engine = Engine(l1=None, l2=l2, l3=None, policy_factory=lambda _: LRUPolicy())
        value = b"x" * args.size
        for i in range(args.keys):
            engine.put(b"ds/%09d" % i, value)
        scan = latencies(lambda: [r.key for r in l2.scan()], args.repeat)
        index = latencies(l2.list_keys, args.repeat)
        none_moved = latencies(lambda: engine.unvouch_cached(lambda key: False), args.repeat)
        quarter = latencies(lambda: engine.unvouch_cached(lambda key: key[-1] % 4 == 0), 1)
        engine.close()
    measured = {"file_scan": scan, "index": index, "recheck_none_moved": none_moved, "recheck_quarter_moved": quarter}
    ms = {name: round(statistics.median(times) * 1e3, 1) for name, times in measured.items()}
    result = {
        "keys": args.keys,
        "size": args.size,
        "repeat": args.repeat,
        "median_ms": ms,
        "runs_ms": {"file_scan": [round(t * 1e3, 1) for t in scan], "index": [round(t * 1e3, 1) for t in index]},
        "file_scan_over_index": round(ms["file_scan"] / max(ms["index"], 0.1), 1),
        "machine": _machine.machine_info(),
    }
    print(
        f"{args.keys} keys of {args.size} B: listing them by a file scan {ms['file_scan']} ms, from the index "
        f"{ms['index']} ms ({result['file_scan_over_index']}x); the recheck with none moved "
        f"{ms['recheck_none_moved']} ms, a quarter moved {ms['recheck_quarter_moved']} ms"
    )
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
