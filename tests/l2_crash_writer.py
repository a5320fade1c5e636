"""A writer for the L2 crash test (tests/test_l2_pack.py): runs a seeded list of tier operations until killed.

    python tests/l2_crash_writer.py DIR SEED N LOG

Opens `LMDBTier(DIR)`, writes "r" to LOG, then for each operation i writes
"b<i>" before it and "a<i>" once it returned (unbuffered, so a SIGKILL loses
nothing written). The test derives the same operations from `operations()`.
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass

MAP_BYTES = 16 << 20
KEYS = [b"k/%02d" % i for i in range(40)] + [b"L" * 600 + b"/%d" % i for i in range(4)]
# Packed (below 64 KiB) and plain, page-sized and page-crossing.
SIZES = [0, 1, 100, 1000, 1024, 3000, 4058, 4080, 4096, 5000, 16384, 40000, 65535, 65536, 70000]


@dataclass(frozen=True)
class Op:
    kind: str  # "put", "delete" or "compact"
    key: bytes = b""
    value: bytes = b""
    dirty: bool = False
    expires_at: float = 0.0


def operations(seed: int, n: int) -> list[Op]:
    rng = random.Random(seed)
    ops = []
    for _ in range(n):
        roll = rng.random()
        key = rng.choice(KEYS)
        if roll < 0.2:
            ops.append(Op("delete", key))
        elif roll < 0.23:
            ops.append(Op("compact"))
        else:
            value = rng.randbytes(rng.choice(SIZES))
            ops.append(Op("put", key, value, rng.random() < 0.3, rng.choice([0.0, 2_000_000_000.5])))
    return ops


def main() -> None:
    from cacheclient.wire import checksum
    from cachesvc.tiers import LMDBTier

    path, seed, n, log_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    ops = operations(seed, n)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    tier = LMDBTier(path, MAP_BYTES)
    os.write(log, b"r\n")
    for i, op in enumerate(ops):
        os.write(log, b"b%d\n" % i)
        if op.kind == "put":
            tier.put(op.key, op.value, checksum(op.value), dirty=op.dirty, expires_at=op.expires_at)
        elif op.kind == "delete":
            tier.delete(op.key)
        else:
            tier.compact()
        os.write(log, b"a%d\n" % i)
    tier.close()
    os.write(log, b"done\n")


if __name__ == "__main__":
    main()
