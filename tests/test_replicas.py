"""Replicated namespaces as real processes: a write reaches every replica the placement names, or fails naming
the ones it missed; deletes reach every replica; a read with release=True ends the lease on every replica.

Three cache servers (each with an L2, so a SIGKILLed one comes back with what it held), one metadata node
whose lease on a cache node is long (60 s): a killed node stays in the placement for the whole test, so the
routing client meets it as a replica that does not answer, not as a node the shard has moved keys off.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from cacheclient import CacheClient, CacheClientError, ReplicasFailedError
from cacheclient.meta import PlacementMap

from conftest import CacheServer, Cluster, S3Server, hang, router_of, running_cluster

pytestmark = pytest.mark.timeout(180)

CONFIG = """
[[namespaces]]
prefix = "wb/"
write_mode = "write-back"
replicas = 2

[[namespaces]]
prefix = "co/"
write_mode = "cache-only"
replicas = 2

[[namespaces]]
prefix = "wt/"
replicas = 2
"""
REPLICAS = {"wb/": 2, "co/": 2, "wt/": 2}
SIZES = [("8MiB", "16MiB")] * 3


@pytest.fixture(scope="module")
def cluster(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    base = tmp_path_factory.mktemp("replicas")
    with running_cluster(s3, base, CONFIG, SIZES, meta_nodes=1, lease_seconds=60.0, replicas=REPLICAS) as c:
        yield c


@pytest.fixture
def victim(cluster: Cluster) -> Iterator[CacheServer]:
    """The second cache server, started again (with its L2) after the test if the test killed it."""
    server = cluster.servers[1]
    try:
        yield server
    finally:
        if server.process is None or not server.process.alive():
            server.start()
        cluster.wait_placement([s.address for s in cluster.servers], "every server back in the placement")
        with server.client() as direct:
            direct.wait_ready(20.0)


def _replicas(cluster: Cluster, key: bytes, placement: PlacementMap | None = None) -> list[str]:
    return list((placement or cluster.placement()).candidates(key)[:2])


def _keys_on(cluster: Cluster, prefix: str, address: str, n: int) -> list[bytes]:
    """`n` keys under `prefix` that have `address` among their two replicas."""
    keys = (f"{prefix}{i:05d}".encode() for i in range(10_000))
    return [k for k in keys if address in _replicas(cluster, k)][:n]


def _cached_on(cluster: Cluster, key: bytes) -> set[str]:
    """The servers whose cache tiers hold `key`, each asked directly (no routing)."""
    held = set()
    for server in cluster.servers:
        if server.process is not None and server.process.alive():
            with server.client() as direct:
                if direct.contains(key, cached_only=True):
                    held.add(server.address)
    return held


def _assert_on_their_replicas(cluster: Cluster, keys: list[bytes]) -> None:
    """Every key is cached on exactly the replicas the shard's map names (the message says where each is not)."""
    placement = cluster.placement()
    misplaced = {k: (sorted(_cached_on(cluster, k)), sorted(_replicas(cluster, k, placement))) for k in keys}
    misplaced = {k: where for k, where in misplaced.items() if where[0] != where[1]}
    assert not misplaced, f"keys cached (left) not where their replicas are (right): {misplaced}"


def test_a_write_with_a_replica_down_fails_naming_it_and_returns_once_retried(
    cluster: Cluster, victim: CacheServer
) -> None:
    # Puts in a write-back and a cache-only namespace (two keys each, one batch), deletes in a
    # write-through and a cache-only one: every key has the victim among its two replicas.
    puts = {ns: _keys_on(cluster, f"{ns}down/", victim.address, 2) for ns in ("wb/", "co/")}
    deletes = {ns: _keys_on(cluster, f"{ns}gone/", victim.address, 1)[0] for ns in ("wt/", "co/")}
    every = [*puts["wb/"], *puts["co/"], *deletes.values()]
    # A write waits for a replica that does not answer until its deadline: `hurried` has a short one.
    with cluster.client(timeout=10.0) as client, cluster.client(timeout=1.5) as hurried:
        client.put_many({k: b"v1" for k in every})
        _assert_on_their_replicas(cluster, every)
        victim.kill()  # SIGKILL by pid; the shard keeps it in the placement (60 s lease)
        for keys in puts.values():
            with pytest.raises(ReplicasFailedError) as failed:
                hurried.put_many({k: b"v2" for k in keys})
            # It names the replica that failed and the keys the write did not finish.
            assert set(failed.value.failed) == {victim.address}
            assert victim.address in str(failed.value)
            assert sorted(failed.value.keys) == sorted(keys)
            # The replica that answered took it; no third node stood in for the lost one.
            for key in keys:
                [survivor] = [a for a in _replicas(cluster, key) if a != victim.address]
                assert _cached_on(cluster, key) == {survivor}
                with cluster.server(survivor).client() as direct:
                    assert direct.get(key) == b"v2"
        for key in deletes.values():
            with pytest.raises(ReplicasFailedError) as failed:
                hurried.delete(key)
            assert set(failed.value.failed) == {victim.address}
            assert _cached_on(cluster, key) == set()  # the live replica dropped it
        victim.start()
        cluster.wait_placement([s.address for s in cluster.servers], "the killed server back in the placement")
        with victim.client() as direct:
            direct.wait_ready(20.0)
            # Back with its L2. The failed put is undecided there (the old value, or the new one once
            # checked against S3) and the failed delete's copy may be back, until each is retried.
            for keys in puts.values():
                assert all(direct.get(k) in (b"v1", b"v2", None) for k in keys)
        assert all(_cached_on(cluster, k) <= {victim.address} for k in deletes.values())
        # Retried once it is back, each write returns (it waits for the client to reconnect, at most 2 s),
        # and then every replica holds what it wrote.
        for key in [*puts["wb/"], *puts["co/"]]:
            client.put(key, b"v3")
            for address in _replicas(cluster, key):
                with cluster.server(address).client() as direct:
                    assert direct.get(key) == b"v3", address
        for key in deletes.values():
            client.delete(key)
            assert _cached_on(cluster, key) == set()
            assert client.get(key) is None


def test_a_write_waits_for_the_shard_to_drop_a_replica_that_is_down_and_returns_on_the_next(
    cluster: Cluster, victim: CacheServer
) -> None:
    [key] = _keys_on(cluster, "co/wait/", victim.address, 1)
    with cluster.client(timeout=20.0) as client:
        client.put(key, b"v1")
        victim.kill()
        with ThreadPoolExecutor(1) as pool:
            put = pool.submit(client.put, key, b"v2")
            time.sleep(1.0)
            assert not put.done()  # waiting: its replica does not answer and is still named
            # What the shard does when the node's lease runs out (60 s here).
            cluster.meta.set_node_state(victim.address, "down")
            put.result(timeout=15.0)
        after = cluster.placement()
        replicas = set(after.candidates(key)[:2])
        assert victim.address not in replicas
        assert _cached_on(cluster, key) == replicas
        assert client.get(key) == b"v2"


def _peer_drop_errors(cluster: Cluster) -> int:
    """Drops of deleted keys that servers asked of a peer and did not get, summed over the cluster."""
    total = 0
    for server in cluster.servers:
        with server.client() as direct:
            total += int(direct.stats()["counters"].get("peer_drop_errors", 0))
    return total


@pytest.mark.parametrize("namespace", ["wt/", "co/"])
def test_a_delete_leaves_no_copy_on_any_replica(cluster: Cluster, namespace: str) -> None:
    keys = [f"{namespace}delete/{i}".encode() for i in range(20)]
    routed, at_once = keys[:10], keys[10:]
    with cluster.client(timeout=10.0) as client:
        client.put_many({k: b"x" for k in keys})
        _assert_on_their_replicas(cluster, keys)
        failed_drops = _peer_drop_errors(cluster)
        assert all(client.delete(k) for k in routed)  # the routing client asks the replicas in turn
        # Others may ask both at once (two clients, each of one node).
        with ThreadPoolExecutor(2) as pool:
            for key in at_once:
                directs = [cluster.server(a).client(timeout=10.0) for a in _replicas(cluster, key)]
                try:
                    assert any(list(pool.map(lambda direct, k=key: direct.delete(k), directs)))
                finally:
                    for direct in directs:
                        direct.close()
        assert all(_cached_on(cluster, k) == set() for k in keys)
        assert client.get_many(keys) == [None] * len(keys)
        # Neither replica waits for the other: a server that told its co-replica (an owner by an earlier map
        # too) to drop the key would wait, holding the key, for a drop that waits for the key, until the peer
        # deadline, and count the drop as failed.
        assert _peer_drop_errors(cluster) == failed_drops


def test_a_delete_with_hung_replicas_fails_by_its_deadline_and_a_healthy_one_still_deletes(
    cluster: Cluster,
) -> None:
    # The routing client asks a key's replicas one after another (two DELETEs of one object at once make
    # SeaweedFS wait a second). A replica's wait for the one before counts against the call's deadline:
    # with both hung, a delete took twice its deadline. And the wait is short enough that a healthy replica
    # asked after a hung one still deletes, and is not blamed.
    deadline = 2.0
    for key, hung in ((b"co/hung/0", 1), (b"co/hung/1", 2)):
        replicas = _replicas(cluster, key)
        with cluster.client(timeout=10.0) as client:
            client.put(key, b"v")
        with cluster.client(timeout=deadline) as hurried:
            router_of(hurried).placement_ttl = 3600.0  # routes by the map it has now, the hung servers in it
            router_of(hurried).placement(refresh=True)
            pids = [cluster.server(address).process.pid for address in replicas[:hung]]  # type: ignore[union-attr]
            try:
                for pid in pids:
                    hang(pid)
                began = time.monotonic()
                with pytest.raises(CacheClientError) as failed:
                    hurried.delete(key)
                took = time.monotonic() - began
                if hung == 1:
                    assert isinstance(failed.value, ReplicasFailedError), failed.value
                    assert set(failed.value.failed) == {replicas[0]}
                    with cluster.server(replicas[1]).client() as direct:
                        assert not direct.contains(key, cached_only=True), "the healthy replica kept the key"
            finally:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
        assert took < deadline + 1.0, f"a delete with a {deadline} s deadline took {took:.2f} s ({hung} hung)"
        for address in replicas:
            with cluster.server(address).client() as direct:
                direct.wait_ready(20.0)


def _pinned(cluster: Cluster) -> dict[str, int]:
    pinned = {}
    for server in cluster.servers:
        with server.client() as direct:
            pinned[server.address] = int(direct.stats()["counters"].get("pinned_keys", 0))
    return pinned


def test_a_read_with_release_ends_the_lease_on_every_replica(cluster: Cluster) -> None:
    keys = [f"co/lease/{i:04d}".encode() for i in range(40)]
    before = _pinned(cluster)
    with cluster.client(timeout=10.0) as client:
        client.put_many({k: b"block " + k for k in keys}, lease=120.0)
        expected = {s.address: before[s.address] for s in cluster.servers}
        for key in keys:
            for address in _replicas(cluster, key):
                expected[address] += 1
        assert _pinned(cluster) == expected  # each key pinned on both of its replicas
        assert client.get_many(keys[:30], release=True) == [b"block " + k for k in keys[:30]]
        assert client.get(keys[30], release=True) == b"block " + keys[30]
        # Each read ended the lease on the replica it read and on the other one.
        for key in keys[:31]:
            for address in _replicas(cluster, key):
                expected[address] -= 1
        assert _pinned(cluster) == expected
        assert client.get_many(keys[31:], release=True) == [b"block " + k for k in keys[31:]]
    assert _pinned(cluster) == before


def test_a_client_of_one_replica_still_reads_and_releases_alone(cluster: Cluster) -> None:
    """A plain client of one node (no routing) ends only that node's lease, as before."""
    key = b"co/lease/plain"
    with cluster.client(timeout=10.0) as routed:
        routed.put(key, b"x", lease=120.0)
    first, second = _replicas(cluster, key)
    before = _pinned(cluster)
    with CacheClient(first) as plain:
        assert plain.get(key, release=True) == b"x"
    after = _pinned(cluster)
    assert (after[first], after[second]) == (before[first] - 1, before[second])
    with CacheClient(second) as plain:
        assert plain.get(key, release=True) == b"x"


def test_a_write_that_runs_out_of_time_names_what_its_replica_answered_before() -> None:
    """A write waits out refusals (a server behind the map that cannot reach the shard) until its deadline; when
    the last try is the one that times out, the error still says why the node refused (the put-back [down] test
    in test_membership_consistency saw only "Deadline Exceeded" on a loaded machine)."""
    from cacheclient.routing import _Key, _replicas_failed

    def message(item: _Key) -> str:
        """The error of a write whose one replica (127.0.0.1:1) failed `item`."""
        return str(_replicas_failed([item], None, lambda item, placement: ["127.0.0.1:1"]))  # type: ignore[arg-type]

    refused = "UnavailableError: the client routed this write by placement version 4, and this server holds 3"
    timed_out = "DeadlineError: 127.0.0.1:1: DEADLINE_EXCEEDED: Deadline Exceeded"
    waited = _Key(0, b"k/0", failed={"127.0.0.1:1": timed_out}, earlier={"127.0.0.1:1": refused})
    assert "Deadline Exceeded (before that: UnavailableError: the client routed this write" in message(waited)
    # A refusal on the last try is the reason as it stands; so is a deadline with nothing else before it.
    last_refused = _Key(1, b"k/1", failed={"127.0.0.1:1": refused}, earlier={"127.0.0.1:1": timed_out})
    assert "before that" not in message(last_refused)
    assert "before that" not in message(_Key(2, b"k/2", failed={"127.0.0.1:1": timed_out}))
