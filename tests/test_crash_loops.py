"""Crash loops: a cache server, then metadata nodes, SIGKILLed every few seconds while clients work.

Cache server: write-through and write-back namespaces, SIGKILLed every 5-15 s
(seeded) and restarted on its L2 while writers put and readers get. Every
restart must open LMDB, every read must return the bytes of a version that
was acknowledged or in flight (values name their key and version,
`versioned.py`), and at the end every acknowledged value must read back:
through the crashed server from L2 or S3, then from S3 alone through a fresh
server with an empty cache.

Metadata shard: a random node (any role) SIGKILLed and restarted every 5-15 s,
and rounds where all three are killed at once, under the linearizability
workload of `test_meta_cluster`; the history must be linearizable and the
replicas' committed logs must agree.

The three-minute versions are `slow`; the default suite runs a short one of each.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from test_meta_cluster import Workload, committed_log
from versioned import LARGE, Versions, check_read, value_of

from cacheclient import CacheClient, CacheClientError
from cachesvc.devcluster.shard import LocalShard

from conftest import CacheServer, S3Server, ThreadedLoad, s3_args, wait_until

NAMESPACES = """
[[namespaces]]
prefix = "wt/"
write_mode = "write-through"

[[namespaces]]
prefix = "wb/"
write_mode = "write-back"
"""


# ---------------------------------------------------------------------- cache server


class ClientLoad(ThreadedLoad):
    """Writer threads (each owning its keys, half write-through, half write-back) and reader threads.

    A write that raised has an unknown outcome: its version counts as sent,
    not acknowledged. A read that raised is retried later; a read that
    returned is checked with `check_read`, and what is wrong is kept in `wrong`.
    """

    join_seconds = 60.0

    def __init__(self, address: str, writers: int, readers: int, keys_per_writer: int, seed: int) -> None:
        self.address = address
        self.versions = Versions()
        self.owned = [
            [
                b"%s%s%d-%03d" % (b"wb/" if k % 2 else b"wt/", LARGE if k % 8 == 0 else b"", w, k)
                for k in range(keys_per_writer)
            ]
            for w in range(writers)
        ]
        self.keys = [k for keys in self.owned for k in keys]
        self.counts: Counter[str] = Counter()
        self.wrong: list[str] = []
        self._lock = threading.Lock()
        super().__init__(
            [(self._write, (keys, random.Random(seed * 100 + w))) for w, keys in enumerate(self.owned)]
            + [(self._read, (random.Random(seed * 100 + 50 + r),)) for r in range(readers)]
        )

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] += n

    def _write(self, keys: list[bytes], rng: random.Random) -> None:
        client = CacheClient(self.address, timeout=10.0)
        while not self._stop.is_set():
            key = rng.choice(keys)
            version = self.versions.next(key)
            try:
                client.put(key, value_of(key, version))
            except CacheClientError:
                self._count("puts_failed")
                time.sleep(0.05)
                continue
            self.versions.ack(key, version)
            self._count("puts_acknowledged")
        client.close()

    def _read(self, rng: random.Random) -> None:
        client = CacheClient(self.address, timeout=10.0)
        while not self._stop.is_set():
            wanted = rng.sample(self.keys, rng.choice((1, 1, 8)))
            low = [self.versions.low(k) for k in wanted]
            try:
                values = client.get_many(wanted) if len(wanted) > 1 else [client.get(wanted[0])]
            except CacheClientError:
                self._count("reads_failed")
                time.sleep(0.05)
                continue
            self.verify(wanted, values, low)
        client.close()

    def verify(self, keys: list[bytes], values: list[bytes | None], low: list[int]) -> None:
        for key, value, lo in zip(keys, values, low, strict=True):
            problem = check_read(key, value, lo, self.versions.high(key))
            self._count("values_verified" if value is not None else "misses")
            if problem:
                with self._lock:
                    self.wrong.append(problem)

    def read_all(self, client: CacheClient, what: str) -> None:
        """Reads every key once (the load stopped), checks each, and counts them under `what`."""
        low = [self.versions.low(k) for k in self.keys]
        values = client.get_many(self.keys)
        self.verify(self.keys, values, low)
        self._count(what, sum(v is not None for v in values))


def _counters(server: CacheServer) -> Counter[str]:
    return Counter(server.client(timeout=10.0).stats()["counters"])


def _l2_entries(server: CacheServer) -> int:
    tiers = {t["name"]: t for t in server.client(timeout=10.0).stats()["tiers"]}
    return int(tiers["l2"]["entries"])


def cache_server_crash_loop(
    s3: S3Server, s3_prefix: str, tmp_path: Path, duration: float, interval: tuple[float, float], seed: int
) -> None:
    config = tmp_path / "cachesvc.toml"
    config.write_text(NAMESPACES)

    def args(l2: str) -> list[str]:
        return [
            "--config", str(config), "--l1-bytes", "1MiB", "--l2-path", str(tmp_path / l2), "--l2-bytes", "64MiB",
            *s3_args(s3, s3_prefix),
        ]  # fmt: skip

    server = CacheServer(args("l2"), tmp_path / "logs").start()
    fresh: CacheServer | None = None
    rng = random.Random(seed)
    kills = 0
    restarts: list[float] = []
    checksum_failures = 0
    try:
        with ClientLoad(server.address, writers=3, readers=2, keys_per_writer=40, seed=seed) as load:
            deadline = time.monotonic() + duration
            while time.monotonic() + interval[0] < deadline:
                time.sleep(min(rng.uniform(*interval), max(0.0, deadline - time.monotonic())))
                checksum_failures += _counters(server)["checksum_failures"]
                server.kill()
                killed_at = time.monotonic()
                server.start()  # raises, with the server's log, if it does not come back
                restarts.append(time.monotonic() - killed_at)
                kills += 1
                assert _l2_entries(server) > 0, "the restarted server's L2 is empty"
        # One more kill with the writers just stopped: the last write-back puts may not be uploaded yet.
        server.kill()
        server.start()
        assert _l2_entries(server) > 0, "the restarted server's L2 is empty"
        with server.client(timeout=30.0) as client:
            load.read_all(client, "read_back_after_the_last_kill")
        wait_until(lambda: _counters(server)["dirty_keys"] == 0, 60.0, "every write-back value uploaded")
        checksum_failures += _counters(server)["checksum_failures"]
        # Everything acknowledged is in S3: a server with an empty cache reads it all from there.
        fresh = CacheServer(args("l2-fresh"), tmp_path / "logs").start()
        with fresh.client(timeout=30.0) as client:
            load.read_all(client, "read_back_from_s3")
    finally:
        server.stop(grace=10.0)
        if fresh is not None:
            fresh.stop(grace=10.0)
    acked = {k: v for k, v in load.versions.acked.items() if v > 0}
    summary = (
        f"{kills} kills, restarts (kill to serving) max {max(restarts, default=0):.2f}s; "
        f"{dict(sorted(load.counts.items()))}; {len(acked)} keys acknowledged "
        f"({sum(k.startswith(b'wb/') for k in acked)} write-back); checksum failures {checksum_failures}; "
        f"{len(load.wrong)} wrong reads"
    )
    print(summary)
    assert not load.wrong, f"{summary}\n" + "\n".join(load.wrong[:20])
    assert kills >= 2, summary
    assert load.counts["puts_acknowledged"] > 20 * kills, summary
    assert sum(k.startswith(b"wb/") for k in acked) > 0, summary
    assert sum(LARGE in k for k in acked) > 0, f"no large value (a file of its own in L2) acknowledged: {summary}"
    assert load.counts["read_back_from_s3"] >= len(acked), summary
    assert checksum_failures == 0, summary


def test_cache_server_sigkilled_in_a_loop_loses_no_acknowledged_value(
    s3: S3Server, s3_prefix: str, tmp_path: Path
) -> None:
    cache_server_crash_loop(s3, s3_prefix, tmp_path, duration=25.0, interval=(5.0, 9.0), seed=1)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cache_server_sigkilled_every_5_to_15_s_for_three_minutes(s3: S3Server, s3_prefix: str, tmp_path: Path) -> None:
    cache_server_crash_loop(s3, s3_prefix, tmp_path, duration=180.0, interval=(5.0, 15.0), seed=2)


# ---------------------------------------------------------------------- metadata shard


def _kill_one(s: LocalShard, rng: random.Random) -> str:
    victim = rng.choice(s.ids)
    role = "leader" if s.leader(timeout=15.0)[0] == victim else "follower"
    s.kill(victim)
    time.sleep(rng.uniform(0.0, 1.0))
    s.restart(victim, wait=False)
    s.wait_serving(victim)
    return role


def _kill_all(s: LocalShard, rng: random.Random) -> str:
    for i in s.ids:
        s.kill(i)
    for i in s.ids:
        time.sleep(rng.uniform(0.0, 0.5))
        s.start(i, wait=False)
    for i in s.ids:
        s.wait_serving(i)
    return "all three"


def meta_crash_loop(
    tmp_path: Path, rounds: list[Callable[[LocalShard, random.Random], str]], interval: tuple[float, float], seed: int
) -> None:
    """Runs `rounds` (each kills and restarts nodes) `interval` seconds apart under the linearizability workload."""
    rng = random.Random(seed)
    s = LocalShard(3, tmp_path / "shard")
    try:
        s.start()
        s.leader(timeout=15.0)
        killed: Counter[str] = Counter()
        recovered: list[float] = []
        with Workload(s, clients=4, keys=24, seed=seed) as work:
            for kill in rounds:
                time.sleep(rng.uniform(*interval))
                killed_at = time.monotonic()
                killed[kill(s, rng)] += 1
                s.leader(timeout=20.0)
                recovered.append(time.monotonic() - killed_at)
        work.final_reads()
        summary = (
            f"kills {dict(killed)}; kill to a leader with every node serving: p50 "
            f"{sorted(recovered)[len(recovered) // 2]:.2f}s max {max(recovered):.2f}s; {len(work.history)} ops, "
            f"{work.acked_writes} acknowledged writes, {work.failed} failed calls"
        )
        print(summary)
        assert work.acked_writes > 20 * len(rounds), summary
        work.check()
        print("history linearizable")
        assert len(s.wait_agreement()) == 3
        committed_log(s)
    finally:
        s.stop()


def test_whole_shard_killed_under_load_stays_linearizable(tmp_path: Path) -> None:
    """Beyond the leader kills of test_meta_cluster: every node at once, and followers, while clients write."""
    meta_crash_loop(tmp_path, [_kill_all, _kill_one, _kill_all], interval=(2.0, 4.0), seed=3)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_meta_nodes_sigkilled_every_5_to_15_s_for_three_minutes(tmp_path: Path) -> None:
    rng = random.Random(4)
    rounds: list[Callable[[LocalShard, random.Random], str]] = []
    planned = 0.0
    while planned < 180.0:  # one round in four kills all three
        rounds.append(_kill_all if rng.random() < 0.25 else _kill_one)
        planned += 10.0 + 1.5
    meta_crash_loop(tmp_path, rounds, interval=(5.0, 15.0), seed=4)
