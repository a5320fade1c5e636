"""What a restart costs before a node serves from its L2 again: the time and S3 requests to vouch for N keys.

A node restarted on its L2 does not serve a copy it cannot vouch for (issue
22): each L2 copy is checked against its S3 object (one HEAD) at its first
read. This measures, for `--keys` cached values (default 10,000 of 4 KiB,
written through to SeaweedFS behind a request-counting proxy):

* reopen: the engine opening its L2 (LMDB scan, versions restored);
* first read: every key read once (get_many in batches of 256), each one
  HEAD then served from L2; the S3 requests counted;
* second read: the same keys again, vouched: no S3 request;
* cold read: the same keys from an empty cache (one GET each), for scale.

    .venv/bin/python bench/restart_vouch.py [--keys 10000] [--size 4096]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client"))

from latency_proxy import LatencyProxy

from cachesvc.devcluster.seaweed import S3_ACCESS_KEY, S3_SECRET_KEY, SeaweedFS
from cachesvc.engine import Engine
from cachesvc.policy import LRUPolicy
from cachesvc.tiers import LMDBTier, MemoryTier, S3Tier

BUCKET = "restart-vouch"


def engine(endpoint: str, prefix: str, l2: Path | None) -> Engine:
    return Engine(
        l1=MemoryTier(256 << 20),
        l2=LMDBTier(l2, 1 << 30) if l2 is not None else None,
        l3=S3Tier(endpoint=endpoint, bucket=BUCKET, prefix=prefix, access_key=S3_ACCESS_KEY, secret_key=S3_SECRET_KEY),
        policy_factory=lambda _: LRUPolicy(),
    )


def read_all(e: Engine, keys: list[bytes]) -> tuple[float, dict[str, int]]:
    began = time.perf_counter()
    tiers: dict[str, int] = {}
    for i in range(0, len(keys), 256):
        for hit in e.get_many(keys[i : i + 256]):
            assert hit is not None
            tiers[hit.tier] = tiers.get(hit.tier, 0) + 1
    return time.perf_counter() - began, tiers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--size", type=int, default=4096)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="restart-vouch-")))
        weed = SeaweedFS.on_free_ports(work / "seaweed")
        stack.callback(weed.stop, 5.0)
        weed.create_bucket(BUCKET)
        host, _, port = weed.endpoint.removeprefix("http://").partition(":")
        proxy = LatencyProxy(f"{host}:{port}").start()
        stack.callback(proxy.stop)
        endpoint = f"http://127.0.0.1:{proxy.port}"
        prefix = f"bench/{uuid.uuid4().hex[:8]}/"
        keys = [f"restart/{i:06d}".encode() for i in range(args.keys)]
        first = engine(endpoint, prefix, work / "l2")
        for key in keys:
            first.put(key, os.urandom(args.size))  # write-through: S3 and the cache
        # Out of L1 into L2: the restart finds every value on disk.
        first.close()

        began = time.perf_counter()
        restarted = engine(endpoint, prefix, work / "l2")
        reopen = time.perf_counter() - began
        requests = proxy.requests
        first_read, tiers = read_all(restarted, keys)
        first_requests = proxy.requests - requests
        requests = proxy.requests
        second_read, _ = read_all(restarted, keys)
        second_requests = proxy.requests - requests
        counters = restarted.stats()["counters"]
        restarted.close()

        cold = engine(endpoint, prefix, None)
        requests = proxy.requests
        cold_read, _ = read_all(cold, keys)
        cold_requests = proxy.requests - requests
        cold.close()

    n = len(keys)
    print(f"{n} keys of {args.size} B, L2 (LMDB) + SeaweedFS on this machine")
    print(f"reopen (L2 scan, versions restored):    {reopen:.2f} s")
    print(
        f"first read after restart (vouch):       {first_read:.2f} s, {first_requests} S3 requests "
        f"({first_requests / n:.2f} per key), served from {tiers}; vouch_checks={counters.get('vouch_checks', 0)}"
    )
    print(f"second read (vouched):                  {second_read:.2f} s, {second_requests} S3 requests")
    print(f"cold read, empty cache (GET each):      {cold_read:.2f} s, {cold_requests} S3 requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
