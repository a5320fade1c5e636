"""Cluster mode as real processes: a three-node metadata shard, three cache servers, SeaweedFS.

Routing clients (`CacheClient(meta=...)`) send each key to its owner by the
shard's placement map; servers refuse keys they do not own with the owner's
address; a SIGKILLed server's keys are read from the next candidate (or
from S3) with the right bytes, and the shard moves its slots.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from cacheclient import CacheClient
from cacheclient.torch import CachedDataset, CachedIterableDataset

from conftest import Cluster, S3Server, hang, router_of, running_cluster, wait_until

pytestmark = pytest.mark.timeout(180)

CONFIG = """
[[namespaces]]
prefix = "co/"
write_mode = "cache-only"

[[namespaces]]
prefix = "rep/"
replicas = 2
"""
# Sizes 1:1:2 (L1 + L2 of each server; an L2 registers somewhat less than its
# map size). The second keeps everything in L2, so what it held survives its SIGKILL.
SIZES = [("8MiB", "8MiB"), ("0", "16MiB"), ("16MiB", "16MiB")]


@pytest.fixture(scope="module")
def cluster(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(s3, tmp_path_factory.mktemp("cluster"), CONFIG, SIZES, replicas={"rep/": 2}) as c:
        yield c


def _values(n: int, seed: int, prefix: str = "k/") -> dict[bytes, bytes]:
    rng = random.Random(seed)
    return {f"{prefix}{seed}/{i:05d}".encode(): rng.randbytes(rng.randrange(10, 3000)) for i in range(n)}


def _holders(cluster: Cluster, keys: list[bytes]) -> dict[bytes, set[str]]:
    """Which servers' cache tiers hold each key, asked with plain clients (no routing)."""
    held: dict[bytes, set[str]] = {k: set() for k in keys}
    for server in cluster.servers:
        with server.client() as plain:
            for key, found in zip(keys, plain.contains_many(keys, cached_only=True), strict=True):
                if found:
                    held[key].add(server.address)
    return held


def test_a_put_through_one_client_is_read_through_another_that_knows_only_the_shard(cluster: Cluster) -> None:
    values = _values(300, seed=1)
    writer, reader = cluster.client(), cluster.client()
    try:
        writer.put_many(values)
        assert reader.get_many(list(values)) == list(values.values())
        assert reader.get(next(iter(values))) == next(iter(values.values()))
        assert reader.contains_many(list(values)) == [True] * len(values)
        # Each key lives on its owner alone, and the batch went to every node.
        placement = cluster.placement()
        held = _holders(cluster, list(values))
        assert all(held[k] == {placement.locate(k)} for k in values)
        assert {placement.locate(k) for k in values} == set(placement.nodes)
        assert router_of(writer).counters["not_owner"] == 0
        key = next(iter(values))
        assert reader.delete(key) and reader.get(key) is None
    finally:
        writer.close()
        reader.close()


def test_keys_spread_across_nodes_in_proportion_to_capacity(cluster: Cluster) -> None:
    placement = cluster.wait_placement([s.address for s in cluster.servers], "every server in the placement")
    # What each server registered: its L1 plus what its L2 may hold (less
    # than the L2 map size), so about 1.1 : 1 : 2.2 here, not the 1:1:2 of
    # the flags; the third must weigh about twice the others.
    capacity = dict(zip(placement.nodes, placement.capacities, strict=True))
    first, second, third = (capacity[s.address] for s in cluster.servers)
    assert third > 1.8 * max(first, second)
    keys = [f"co/spread/{i}".encode() for i in range(10_000)]
    client = cluster.client()
    try:
        client.put_many({k: b"v" for k in keys})
    finally:
        client.close()
    held = _holders(cluster, keys)
    assert all(len(nodes) == 1 for nodes in held.values())
    counts = Counter(next(iter(nodes)) for nodes in held.values())
    for address, weight in capacity.items():
        expected = len(keys) * weight / sum(capacity.values())
        assert abs(counts[address] - expected) <= 0.1 * expected, (address, counts, expected)


def test_a_client_with_a_stale_map_reaches_the_owner_in_one_extra_round_trip(cluster: Cluster) -> None:
    stale = cluster.client()
    try:
        router = router_of(stale)
        before = router.placement(refresh=True)
        router.placement_ttl = 3600.0  # it learns of the change only from a server
        router._map_expiry = float("inf")
        drained = cluster.servers[0].address
        # Keys the drained node owned, never written: no node holds their bytes.
        moved = [k for k in (f"stale/{uuid.uuid4().hex}".encode() for _ in range(400)) if before.locate(k) == drained]
        cluster.meta.set_node_state(drained, "draining")
        try:
            after = cluster.wait_placement([s.address for s in cluster.servers[1:]], "the drained node to leave")
            assert router.placement().version == before.version
            calls = router.counters["calls"]
            stale.put(moved[0], b"written by a stale client")
            assert router.counters["calls"] - calls == 2  # the old owner's refusal, then the new owner
            assert router.counters["not_owner"] == 1
            assert _holders(cluster, [moved[0]])[moved[0]] == {after.locate(moved[0])}
            assert stale.get(moved[1]) is None  # a miss, answered by its new owner
            # A batch from a stale map again (keys with different new owners): the
            # node refuses it whole, naming one owner; the client fetches the newer
            # map and re-splits, instead of bouncing every key between the owners.
            router._map = before
            router._refresh_in_background = lambda: None  # type: ignore[method-assign]  # no lucky refresh
            refusals = router.counters["not_owner"]
            for _ in range(5):
                assert stale.get_many(moved[:8]) == [b"written by a stale client"] + [None] * 7
            assert router.counters["not_owner"] - refusals == 1
        finally:
            cluster.meta.set_node_state(drained, "up")
            cluster.wait_placement([s.address for s in cluster.servers], "the drained node to come back")
    finally:
        stale.close()


def test_a_sigkilled_server_does_not_stop_reads_and_its_slots_move(cluster: Cluster) -> None:
    values = _values(240, seed=2)
    replicated = _values(120, seed=2, prefix="rep/")
    client = cluster.client()
    try:
        client.put_many({**values, **replicated})
        victim = cluster.servers[1]
        placement = client.cluster.placement()
        on_victim = [k for k in values if placement.locate(k) == victim.address]
        replicated_on_victim = [k for k in replicated if victim.address in placement.candidates(k)[:2]]
        assert on_victim and replicated_on_victim
        victim.kill()
        # At once, before the shard notices: the next candidate serves. With
        # R=1 it had no copy and read the key from S3; with R=2 the other
        # replica has it cached.
        assert [client.get_with_tier(k) for k in on_victim[:5]] == [(values[k], "l3") for k in on_victim[:5]]
        assert router_of(client).counters["failovers"] >= 1
        assert client.get_many(list(values)) == list(values.values())
        for key in replicated_on_victim:
            got = client.get_with_tier(key)
            assert got is not None and got[0] == replicated[key] and got[1] in ("l1", "l2"), got
        # The shard marks it down after its lease; the placement moves its slots.
        survivors = [s.address for s in cluster.servers if s is not victim]
        after = cluster.wait_placement(survivors, "the killed server to leave the placement")
        assert all(after.locate(k) in survivors for k in on_victim)
        fresh = cluster.client()
        try:
            assert fresh.get_many(list(values)) == list(values.values())
            assert router_of(fresh).counters["failovers"] == 0
        finally:
            fresh.close()
        # It comes back with its L2 and serves its keys again.
        victim.start()
        cluster.wait_placement([s.address for s in cluster.servers], "the restarted server to rejoin")
        back = cluster.client()
        try:
            got = back.get_with_tier(on_victim[0])
            assert got is not None and got[0] == values[on_victim[0]]
            assert got[1] in ("l1", "l2")
        finally:
            back.close()
    finally:
        client.close()


def test_a_hung_server_costs_a_read_half_its_deadline_not_all_of_it(cluster: Cluster) -> None:
    victim = cluster.servers[0]
    assert victim.process is not None and victim.process.alive()
    cluster.wait_placement([s.address for s in cluster.servers], "every server in the placement")
    values = _values(60, seed=6)
    with cluster.client() as writer:
        writer.put_many(values)
    deadline = 6.0
    reader = cluster.client(timeout=deadline)
    try:
        # The reader routes by this one map until the read is done (no refresh
        # in the background): the key is the victim's in the map its read uses.
        router_of(reader).placement_ttl = 3600.0
        placement = router_of(reader).placement(refresh=True)
        key = next(k for k in values if placement.locate(k) == victim.address)
        hang(victim.process.pid)
        try:
            began = time.monotonic()
            assert reader.get(key) == values[key]
            elapsed = time.monotonic() - began
        finally:
            os.kill(victim.process.pid, signal.SIGCONT)
        assert router_of(reader).placement().version == placement.version
        # The owner was asked and never answered; the next candidate served the read.
        counters = router_of(reader).counters
        assert (counters["calls"], counters["failovers"], counters["not_owner"]) == (2, 1, 0), counters
        # The owner had half the deadline (a gRPC deadline never fires early),
        # and the read still ended inside it: the hung owner did not take it all.
        assert 0.45 * deadline < elapsed < deadline
    finally:
        reader.close()
    cluster.wait_placement([s.address for s in cluster.servers], "the resumed server to be in the placement")


def test_reads_go_on_while_the_metadata_leader_is_sigkilled(cluster: Cluster) -> None:
    values = _values(100, seed=7)
    client = cluster.client()
    try:
        client.put_many(values)
        router_of(client).placement_ttl = 0.05  # refresh all the time, so the outage is met
        leader, _ = cluster.shard.leader(timeout=10.0)
        cluster.shard.kill(leader)
        try:
            # For 3 s (the election is in there), and 3 reads at least however slow the machine.
            deadline = time.monotonic() + 3.0
            reads = 0
            while reads < 3 or time.monotonic() < deadline:
                assert client.get_many(list(values)) == list(values.values())
                reads += 1
        finally:
            cluster.shard.restart(leader)
        cluster.shard.leader(timeout=20.0)
    finally:
        client.close()
    # Heartbeats missed during the election may have cost a server its lease for a moment.
    cluster.wait_placement([s.address for s in cluster.servers], "every server in the placement again")


def test_a_put_that_returned_is_read_from_either_replica(cluster: Cluster) -> None:
    values = _values(120, seed=3, prefix="rep/")
    client = cluster.client()
    try:
        client.put_many(values)
        placement = client.cluster.placement()
        held = _holders(cluster, list(values))
        assert all(held[k] == set(placement.candidates(k)[:2]) for k in values)
        # Overwrite: once put_many returns, each replica answers the new bytes,
        # so a reader that starts after it reads them whichever replica it asks.
        newer = {k: v + b"/2" for k, v in values.items()}
        client.put_many(newer)
        for server in cluster.servers:
            mine = [k for k in values if server.address in placement.candidates(k)[:2]]
            with server.client() as plain:
                assert plain.get_many(mine) == [newer[k] for k in mine]
        for _ in range(3):
            reader = cluster.client()
            try:
                assert reader.get_many(list(values)) == list(newer.values())
            finally:
                reader.close()
    finally:
        client.close()


def test_a_client_not_told_the_replicas_learns_them_and_reads_from_every_replica(cluster: Cluster) -> None:
    values = _values(200, seed=9, prefix="rep/")
    # No replicas=: the client asks a node for its [[namespaces]] (rep/ has 2). Over gRPC: the servers count
    # the reads they serve (a client on their machine would read their shared L1 instead, uncounted).
    client = CacheClient(meta=",".join(cluster.shard.addresses), timeout=20.0, colocated=False)
    try:
        assert router_of(client).replicas_of(b"rep/x") == 2
        assert router_of(client).replicas_of(b"k/x") == 1
        client.put_many(values)
        placement = router_of(client).placement()
        held = _holders(cluster, list(values))
        assert all(held[k] == set(placement.candidates(k)[:2]) for k in values)
        # Reads spread over both replicas of each key, not only its owner.
        before = {s.address: s.client().stats()["counters"].get("gets", 0) for s in cluster.servers}
        for _ in range(5):
            assert client.get_many(list(values)) == list(values.values())
        after = {s.address: s.client().stats()["counters"].get("gets", 0) for s in cluster.servers}
        served = {a: after[a] - before[a] for a in after}
        second = Counter(placement.candidates(k)[1] for k in values)
        owners = Counter(placement.locate(k) for k in values)
        for address in served:
            # Each node serves about half the reads of the keys it owns and of those it is second for.
            expected = 5 * (owners[address] + second[address]) / 2
            assert 0.6 * expected <= served[address] <= 1.4 * expected, (address, served, expected)
    finally:
        client.close()


def test_the_cluster_client_pickles(cluster: Cluster) -> None:
    client = cluster.client()
    try:
        client.put(b"k/pickle", b"bytes")
        again = pickle.loads(pickle.dumps(client))
        try:
            assert again.get(b"k/pickle") == b"bytes"
        finally:
            again.close()
    finally:
        client.close()


def as_list(batch: list[Any]) -> list[Any]:
    return batch


@pytest.mark.parametrize("style", ["map", "iterable"])
def test_a_dataloader_epoch_with_a_node_killed_midway_delivers_every_sample_once(cluster: Cluster, style: str) -> None:
    rng = random.Random(4)
    samples = {f"dl-{style}/{i:04d}.bin": rng.randbytes(rng.randrange(100, 4000)) for i in range(240)}
    s3 = cluster.s3.client()
    for name, body in samples.items():
        s3.put_object(Bucket=cluster.s3.bucket, Key=cluster.prefix + name, Body=body)
    where = {
        "cache": cluster.client(),
        "return_key": True,
        "local_reads": False,
        "s3_bucket": cluster.s3.bucket,
        "s3_key_prefix": cluster.prefix,
        "s3_endpoint": cluster.s3.endpoint,
    }
    if style == "map":
        dataset: Any = CachedDataset(list(samples), **where)
        loader = DataLoader(dataset, batch_size=8, num_workers=2, shuffle=True, collate_fn=as_list, timeout=60)
    else:
        # Each worker reads its shard of the (shuffled) keys, fetch_size at a time, with a plan ahead.
        dataset = CachedIterableDataset(list(samples), fetch_size=8, **where)
        loader = DataLoader(dataset, batch_size=8, num_workers=2, collate_fn=as_list, timeout=60)
    victim = cluster.servers[2]
    seen: list[tuple[str, bytes]] = []
    for n, batch in enumerate(loader):
        if n == 6:
            victim.kill()
        seen.extend(batch)
    assert not victim.process or not victim.process.alive()
    assert Counter(key for key, _ in seen) == Counter(list(samples))
    assert all(value == samples[key] for key, value in seen)
    victim.start()
    cluster.wait_placement([s.address for s in cluster.servers], "the killed server to rejoin")


def cachectl(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "cachesvc.commands.cachectl", "--meta", ",".join(cluster.shard.addresses), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_cachectl_routes_by_the_shard_and_drains_a_node_under_a_running_reader(cluster: Cluster) -> None:
    assert cachectl(cluster, "put", "k/ctl", "--value", "routed").returncode == 0
    got = cachectl(cluster, "get", "k/ctl")
    assert got.returncode == 0 and got.stdout == "routed"
    listed = cachectl(cluster, "nodes", "--json")
    shares = {n["address"]: n["slot_share"] for n in json.loads(listed.stdout)["cache_nodes"]}
    assert sum(shares.values()) == pytest.approx(1.0) and all(shares[s.address] > 0 for s in cluster.servers)

    values = _values(200, seed=5)
    client = cluster.client()
    client.put_many(values)
    errors: list[BaseException] = []
    reads = [0]
    stop = threading.Event()

    def reader() -> None:
        with cluster.client() as mine:
            while not stop.is_set():
                try:
                    assert mine.get_many(list(values)) == list(values.values())
                    reads[0] += 1
                except BaseException as exc:  # every failure is the finding
                    errors.append(exc)
                    return

    thread = threading.Thread(target=reader)
    thread.start()
    drained = cluster.servers[0].address
    try:
        wait_until(lambda: reads[0] >= 2 or errors, 20.0, "the reader to read")
        result = cachectl(cluster, "drain", drained)
        assert result.returncode == 0, result.stderr
        assert drained not in cluster.placement().nodes
        before = reads[0]
        wait_until(lambda: reads[0] >= before + 3 or errors, 20.0, "the reader to read on after the drain")
    finally:
        stop.set()
        thread.join(30.0)
        client.close()
        assert cachectl(cluster, "drain", drained, "--cancel").returncode == 0
        cluster.wait_placement([s.address for s in cluster.servers], "the drained node to take placements again")
    assert errors == []


@pytest.mark.slow
def test_cachesvc_up_starts_n_cache_servers_in_one_placement(tmp_path: Path) -> None:
    from cachesvc.devcluster.procs import free_port, port_in_use
    from cachesvc.devcluster.seaweed import SeaweedPorts

    def free_run(n: int) -> int:
        while True:
            first = free_port()
            if first + n < 65536 and not any(port_in_use(first + i) for i in range(1, n)):
                return first

    ports = SeaweedPorts.free()
    cache_port, meta_port = free_run(3), free_run(3)
    args = [
        sys.executable, "-m", "cachesvc", "up", "--check", "--nodes", "3", "--state-dir", str(tmp_path / "state"),
        "--cache-port", str(cache_port), "--meta-port", str(meta_port), "--s3-port", str(ports.s3),
        "--master-port", str(ports.master), "--volume-port", str(ports.volume), "--filer-port", str(ports.filer),
    ]  # fmt: skip
    result = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 cache servers registered with the metadata shard" in result.stdout
    assert "round trip through cache and S3 ok" in result.stdout
    info = json.loads((tmp_path / "state" / "cluster.json").read_text())
    assert info["cache"] == [f"127.0.0.1:{cache_port + i}" for i in range(3)]
    assert {"cache", "cache-1", "cache-2", "s3"} <= set(info["pids"])
    assert all((tmp_path / "state" / name).is_dir() for name in ("l2", "l2-1", "l2-2"))


def test_a_server_stopped_gracefully_leaves_the_placement_at_once_and_reads_move_without_failover(
    s3: S3Server, tmp_path: Path
) -> None:
    # The default 10 s lease: a node that only stopped heartbeating would be routed to for that long.
    with running_cluster(s3, tmp_path, "", [("16MiB", "0"), ("16MiB", "0")], lease_seconds=10.0) as cluster:
        values = _values(200, seed=9)
        client = cluster.client()
        try:
            client.put_many(values)
            victim = cluster.servers[1]
            assert victim.process is not None
            on_victim = [k for k in values if client.cluster.placement().locate(k) == victim.address]
            assert on_victim
            began = time.monotonic()
            os.kill(victim.process.pid, signal.SIGTERM)
            left_after = None
            slowest = 0.0
            while time.monotonic() - began < 8.0 and (left_after is None or victim.process.alive()):
                read_began = time.monotonic()
                assert client.get_many(on_victim) == [values[k] for k in on_victim]
                slowest = max(slowest, time.monotonic() - read_began)
                if left_after is None and victim.address not in cluster.placement().nodes:
                    left_after = time.monotonic() - began
            assert left_after is not None and left_after < 3.0, left_after
            assert not victim.process.alive() and victim.stop() == 0, victim.log()
            # No read waited for a dead node: the server redirected them while it still answered.
            assert router_of(client).counters["failovers"] == 0 and slowest < 2.0, slowest
            assert client.get_many(list(values)) == list(values.values())
        finally:
            client.close()
