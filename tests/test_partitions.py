"""Network partitions through proxies: a metadata node and a cache node cut off, then let back.

Every link that a test cuts runs through a `bench/latency_proxy.py` proxy
in this process (no delay: bytes forwarded as they come; `cut()` drops
everything on the link and holds new connections, as a partition that loses
packets does; `heal()` resets what lived through the cut and forwards again).

* The metadata shard: node i reaches node j only through its own proxy
  (i -> j), so cutting a node's links in both directions isolates it the
  way a network fault would, while clients still reach it directly (a
  client on the minority side). The majority elects a leader and commits;
  the cut node commits nothing; once healed it catches up with the committed
  log and does not disturb the leader (PreVote: its term never rose).
* A cache node: clients and the other nodes reach it only through a proxy
  (it registers that address, `--advertise`), and it reaches the shard only
  through a proxy (a one-node shard: a client of a larger one follows leader
  hints, which name the nodes' own addresses, around the proxies). Routing
  clients read around it (replicas or S3) with the right bytes, the shard
  drops it after its lease, and once healed it registers again, gets its
  slots back and serves its keys; a key written while it was away is not
  served old by it once it is back (it checks what it cached against S3
  once, `Engine.suspect_cached`).

`-s` prints what was measured.
"""

from __future__ import annotations

import contextlib
import math
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_meta_cluster import committed_log
from test_s3_faults import Clock, clocked_engine, put_object

from cacheclient.meta import MetaClient, NoLeaderError, PlacementMap
from cacheclient.wire import checksum
from cachesvc.devcluster.procs import free_port
from cachesvc.devcluster.shard import LocalShard
from cachesvc.engine import Hit, Namespace, WriteMode

from conftest import CacheServer, Cluster, S3Server, router_of, s3_args, wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from latency_proxy import LatencyProxy

pytestmark = pytest.mark.timeout(120)


def _proxy(upstream: str) -> LatencyProxy:
    return LatencyProxy(upstream).start()


# ---------------------------------------------------------------------- the metadata shard


@pytest.fixture
def linked_shard(tmp_path: Path) -> Iterator[tuple[LocalShard, dict[tuple[int, int], LatencyProxy]]]:
    """Three metadata nodes, node i reaching node j through proxy (i, j); yields (shard, proxies)."""
    ports = [free_port() for _ in range(3)]
    ids = [1, 2, 3]
    links = {(i, j): _proxy(f"127.0.0.1:{ports[j - 1]}") for i in ids for j in ids if i != j}
    routes = {i: {j: links[i, j].address for j in ids if j != i} for i in ids}
    # Elections after 0.5-1 s of silence (default 0.2-0.4 s): a loaded machine's pauses start none of their own.
    shard = LocalShard(3, tmp_path / "meta", ports=ports, routes=routes, args=["--election-ticks", "50"])
    try:
        shard.start()
        shard.leader(timeout=15.0)
        yield shard, links
    finally:
        shard.stop()
        for proxy in links.values():
            proxy.stop()


def _timed(call: Callable[[], object]) -> tuple[BaseException | None, float]:
    """What `call()` raised (None: nothing), and how long it took."""
    began = time.monotonic()
    try:
        call()
    except BaseException as exc:
        return exc, time.monotonic() - began
    return None, time.monotonic() - began


def _links_of(links: dict[tuple[int, int], LatencyProxy], node: int) -> list[LatencyProxy]:
    """Every link into and out of `node`."""
    return [proxy for (i, j), proxy in links.items() if node in (i, j)]


def test_a_leader_cut_off_both_ways_loses_the_shard_to_the_majority_and_rejoins_without_an_election(
    linked_shard: tuple[LocalShard, dict[tuple[int, int], LatencyProxy]],
) -> None:
    shard, links = linked_shard
    old_leader, old_term = shard.leader(timeout=10.0)
    majority = [i for i in shard.ids if i != old_leader]
    to_majority = MetaClient([shard.address[i] for i in majority], timeout=10.0, attempt_timeout=0.5)
    to_cut = MetaClient([shard.address[old_leader]], timeout=3.0, attempt_timeout=0.5)
    everyone = shard.client(timeout=10.0)
    acked: dict[str, str] = {}
    try:
        for k in range(10):
            to_majority.put_manifest(f"before/{k}", s3_prefix=f"b{k}")
            acked[f"before/{k}"] = f"b{k}"
        # Cut both directions: RequestVotes and appends neither go out nor come in.
        for proxy in _links_of(links, old_leader):
            proxy.cut()
        cut_at = time.monotonic()

        # A client beside the cut node writes at once, while it still leads.
        with ThreadPoolExecutor(1) as pool:
            lost = pool.submit(_timed, lambda: to_cut.put_manifest("lost", s3_prefix="never"))
            # The cut node steps down (CheckQuorum); the majority elects one of its own.
            stepped_down_in = elected_in = math.nan
            while math.isnan(stepped_down_in) or math.isnan(elected_in):
                assert time.monotonic() - cut_at < 10.0, "no step-down or no new leader within 10 s of the cut"
                cut_status = shard.status(old_leader, timeout=0.5)
                if math.isnan(stepped_down_in) and cut_status is not None and cut_status["role"] != "leader":
                    stepped_down_in = time.monotonic() - cut_at
                if math.isnan(elected_in) and any(
                    (s := shard.status(i, timeout=0.5)) and s["role"] == "leader" and s["term"] > old_term
                    for i in majority
                ):
                    elected_in = time.monotonic() - cut_at
                time.sleep(0.01)
            refused, refused_in = lost.result()
        # Not acknowledged, with a clear error.
        assert isinstance(refused, NoLeaderError), refused
        new_leader, new_term = shard.leader(timeout=5.0, newer_than=old_term)
        assert new_leader in majority
        for k in range(20):
            to_majority.put_manifest(f"during/{k}", s3_prefix=f"d{k}")
            acked[f"during/{k}"] = f"d{k}"

        # Cut off for several election timeouts, it never leads and never raises its term (PreVote).
        terms_while_cut = set()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            cut_status = shard.status(old_leader, timeout=0.5)
            assert cut_status is not None and cut_status["role"] != "leader"
            terms_while_cut.add(cut_status["term"])
            time.sleep(0.05)
        assert terms_while_cut == {old_term}, f"the cut node's term moved while it was cut off: {terms_while_cut}"
        with pytest.raises(NoLeaderError):
            to_cut.put_manifest("lost", s3_prefix="never again")

        # Heal: the cut node catches up with the committed log and agrees.
        for proxy in _links_of(links, old_leader):
            proxy.heal()
        healed_at = time.monotonic()
        statuses = shard.wait_agreement(timeout=15.0)
        rejoined_in = time.monotonic() - healed_at
        committed_log(shard)  # every node holds the same committed entries

        # No election on its return: the same leader in the same term, and the
        # returning node follows it in that term.
        assert shard.leader(timeout=5.0) == (new_leader, new_term)
        assert {int(s["term"]) for s in statuses.values()} == {new_term}, statuses
        assert statuses[old_leader]["role"] == "follower"

        # Every acknowledged write is there; the refused one is not.
        for name, prefix in acked.items():
            manifest = everyone.get_manifest(name)
            assert manifest is not None and manifest.s3_prefix == prefix, name
        assert everyone.get_manifest("lost") is None
    finally:
        for client in (to_majority, to_cut, everyone):
            client.close()
    print(
        f"\nmeta partition: leader {old_leader} (term {old_term}) cut off; it stepped down {stepped_down_in:.2f}s "
        f"after the cut; node {new_leader} elected (term {new_term}) {elected_in:.2f}s after the cut; a write sent to "
        f"the cut node at the cut refused after {refused_in:.2f}s ({refused}); term of the cut node unchanged "
        f"while cut; healed: the same committed log on all three {rejoined_in:.2f}s after, no election"
    )


# ---------------------------------------------------------------------- a cache node

CONFIG = """
[[namespaces]]
prefix = "rep/"
replicas = 2
"""
LEASE_SECONDS = 2.0


@dataclass
class CutCluster:
    """A cluster whose node X (`x`) is reached only through `front` and reaches the shard only through `to_meta`."""

    cluster: Cluster
    x: CacheServer
    front: LatencyProxy
    to_meta: list[LatencyProxy]

    @property
    def everyone(self) -> list[str]:
        """The placement's nodes with X in (X by the address it registered, its proxy's)."""
        return sorted([self.front.address, *(s.address for s in self.cluster.servers[1:])])

    def cut(self) -> float:
        """Cuts X off, both ways; returns when (monotonic)."""
        for proxy in (self.front, *self.to_meta):
            proxy.cut()
        return time.monotonic()

    def heal(self) -> float:
        for proxy in (self.front, *self.to_meta):
            proxy.heal()
        return time.monotonic()

    def wait_dropped(self) -> float:
        """Until the shard has dropped X; returns when it saw that (monotonic)."""
        wait_until(lambda: self.front.address not in self.cluster.up(), 15.0, "the shard to drop X", interval=0.02)
        return time.monotonic()

    def wait_back(self) -> None:
        wait_until(lambda: self.cluster.up() == self.everyone, 20.0, "X back in the placement", interval=0.05)
        self.cluster.wait_placement(self.everyone, "every server on the placement with X back")


@pytest.fixture(scope="module")
def cut_cluster_module(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CutCluster]:
    base = tmp_path_factory.mktemp("partition")
    # One metadata node: X's shard client then never follows a leader hint, which
    # names a node's own address and would go around the proxies.
    shard = LocalShard(1, base / "meta", args=["--lease-seconds", str(LEASE_SECONDS)])
    proxies: list[LatencyProxy] = []
    servers: list[CacheServer] = []
    try:
        shard.start()
        shard.leader(timeout=15.0)
        config = base / "cachesvc.toml"
        config.write_text(CONFIG)
        prefix = f"partition/{time.time_ns()}/"
        env = {"CACHESVC_META_HEARTBEAT_SECONDS": "0.3"}

        def server_args(i: int) -> list[str]:
            return [
                "--config", str(config), "--l1-bytes", "8MiB",
                "--l2-path", str(base / f"l2-{i}"), "--l2-bytes", "16MiB", *s3_args(s3, prefix),
            ]  # fmt: skip

        x = CacheServer([], base / "logs", env)
        front = _proxy(x.address)
        to_meta = [_proxy(address) for address in shard.addresses]
        proxies += [front, *to_meta]
        x.args = [
            *server_args(0), "--advertise", front.address, "--meta", ",".join(p.address for p in to_meta),
        ]  # fmt: skip
        servers.append(x.start())
        for i in (1, 2):
            meta = ["--meta", ",".join(shard.addresses)]
            servers.append(CacheServer([*server_args(i), *meta], base / "logs", env).start())
        cut = CutCluster(Cluster(shard, servers, s3, prefix, {"rep/": 2}), x, front, to_meta)
        cut.cluster.wait_placement(cut.everyone, "all three cache servers in the placement")
        yield cut
    finally:
        for server in servers:
            if server.process is not None and server.process.alive():
                server.stop(grace=10.0)
        for proxy in proxies:
            proxy.stop()
        shard.stop()


@pytest.fixture
def cut_cluster(cut_cluster_module: CutCluster) -> Iterator[CutCluster]:
    """The module's cluster with X in; healed after the test, whatever it did."""
    cut_cluster_module.wait_back()
    try:
        yield cut_cluster_module
    finally:
        cut_cluster_module.heal()


def _values(n: int, prefix: str) -> dict[bytes, bytes]:
    return {f"{prefix}{i:04d}".encode(): (f"{prefix}{i}:".encode() * 40)[: 100 + 7 * i] for i in range(n)}


def _owned_by(placement: PlacementMap, keys: list[bytes], node: str) -> list[bytes]:
    return [k for k in keys if node in placement.candidates(k)[: 2 if k.startswith(b"rep/") else 1]]


def test_a_cache_node_cut_off_is_read_around_dropped_and_rejoins_with_its_slots(cut_cluster: CutCluster) -> None:
    cluster, front = cut_cluster.cluster, cut_cluster.front
    values = {**_values(120, "k/"), **_values(60, "rep/")}
    keys = list(values)
    with cluster.client() as writer:
        writer.put_many(values)
    before = cluster.placement()
    on_x = _owned_by(before, keys, front.address)
    assert on_x
    leader = cluster.shard.leader(timeout=5.0)

    # X gets half the deadline, then the next candidate; once the shard has dropped X
    # (2 s), the new owner asks X for a peer fill first (2 s, then not for 10 s).
    reader = cluster.client(timeout=8.0)
    reads: list[tuple[float, float]] = []  # (began, seconds after the cut; how long it took)
    try:
        assert reader.get_many(keys) == list(values.values())
        cut_at = cut_cluster.cut()
        with ThreadPoolExecutor(1) as pool:
            dropped = pool.submit(lambda: cut_cluster.wait_dropped() - cut_at)
            # Reads go on, with the right bytes, until the shard has dropped X and 2 s after (5 reads at least).
            while not dropped.done() or time.monotonic() - cut_at < dropped.result() + 2.0 or len(reads) < 5:
                began = time.monotonic()
                assert reader.get_many(keys) == list(values.values())
                reads.append((began - cut_at, time.monotonic() - began))
            dropped_in = dropped.result()
        assert cluster.shard.leader(timeout=5.0) == leader  # a cache node's cut is no shard event
        after = cluster.placement()
        assert not _owned_by(after, keys, front.address)
        assert router_of(reader).counters["failovers"] >= 1

        # Heal: X beats again, is up, gets its slots back and serves its keys from its cache.
        healed_at = cut_cluster.heal()
        cut_cluster.wait_back()
        rejoined_in = time.monotonic() - healed_at
        back = cluster.placement()
        assert [back.candidates(k)[:2] for k in keys] == [before.candidates(k)[:2] for k in keys]
        with cluster.client() as fresh:
            assert fresh.get_many(keys) == list(values.values())
            for key in on_x[:10]:
                got = fresh.get_with_tier(key)
                assert got is not None and got[0] == values[key]
                assert got[1] in ("l1", "l2"), (key, got)
            assert router_of(fresh).counters["failovers"] == 0
    finally:
        reader.close()
    slow = [f"{took:.2f}s at +{at:.2f}s" for at, took in reads if took > 0.5]
    print(
        f"\ncache node partition: {len(reads)} reads of {len(keys)} keys while cut, every byte right; slow "
        f"(>0.5 s, client deadline 8 s): {', '.join(slow) or 'none'}; median "
        f"{sorted(took for _, took in reads)[len(reads) // 2] * 1000:.0f} ms; dropped by the shard "
        f"{dropped_in:.2f}s after the cut (lease {LEASE_SECONDS:g}s, heartbeat 0.3 s); back in every server's "
        f"placement {rejoined_in:.2f}s after the heal"
    )


def vouch_checks(counters: Mapping[str, int]) -> tuple[int, int]:
    """(copies checked against S3, copies dropped by the check): one HEAD each, or from a listing page."""
    checked = sum(counters.get(name, 0) for name in ("vouch_checks", "vouch_listed", "vouch_list_drops"))
    return checked, counters.get("vouch_drops", 0) + counters.get("vouch_list_drops", 0)


def test_a_key_written_while_its_owner_was_cut_off_is_not_served_old_after_it_rejoins(
    cut_cluster: CutCluster,
) -> None:
    cluster, front = cut_cluster.cluster, cut_cluster.front
    values = _values(60, "k/stale/")
    new = b"written while the owner was cut off"
    with cluster.client() as client:
        client.put_many(values)
        key = _owned_by(cluster.placement(), list(values), front.address)[0]
        assert client.get_with_tier(key) == (values[key], "l1")  # cached on X
        with cut_cluster.x.client() as direct:
            before = direct.stats()["counters"]
        cut_cluster.cut()
        cut_cluster.wait_dropped()
        # Its new owner takes the write, through to S3; X still holds the old bytes. (A write
        # routed by a map that still names X would wait on X for its whole deadline and fail.)
        assert front.address not in router_of(client).placement(refresh=True).nodes
        client.put(key, new)
        assert client.get(key) == new
        cut_cluster.heal()
        cut_cluster.wait_back()
    with cluster.client() as fresh:
        # X checks each value it cached before against S3 once: the changed one is read again (from S3, or
        # from the copy its stand-in handed back when X rejoined, checked against S3 too), the rest kept.
        value, tier = fresh.get_with_tier(key) or (None, None)
        assert value == new
        if tier != "l3":
            with cut_cluster.x.client() as direct:
                assert direct.stats()["counters"].get("handed_over", 0) > before.get("handed_over", 0), tier
        others = [k for k in _owned_by(cluster.placement(), list(values), front.address) if k != key]
        assert others and [fresh.get_with_tier(k) for k in others] == [(values[k], "l1") for k in others]
        assert [fresh.get_with_tier(k) for k in [key, *others]] == [(new, "l1")] + [(values[k], "l1") for k in others]
    with cut_cluster.x.client() as direct:
        after = direct.stats()["counters"]
    # The checks of a copy the node cannot vouch for (issue 22): each checked (from listings, issue 49: every
    # copy X holds, the other tests' keys too, not only those read here), the changed one dropped.
    checked = [a - b for a, b in zip(vouch_checks(after), vouch_checks(before), strict=True)]
    assert checked[0] >= 1 + len(others) and checked[1] == 1


def test_an_engine_told_it_rejoined_checks_each_cached_value_once(s3: S3Server, s3_prefix: str) -> None:
    """`Engine.suspect_cached` (what a server calls on rejoining) with revalidation otherwise off."""
    clock = Clock()
    engine = clocked_engine(s3, s3_prefix, clock, namespaces=[Namespace(b"wb/", WriteMode.WRITE_BACK)])
    try:
        for name in ("a", "b"):
            engine.put(name.encode(), b"old " + name.encode())
        engine.put(b"wb/back", b"written back")
        wait_until(lambda: engine.stats()["counters"]["dirty_keys"] == 0, 30, "the write-back upload")
        put_object(s3, f"{s3_prefix}a", b"new a")  # written elsewhere while this node was away
        assert engine.get(b"a") == Hit(b"old a", checksum(b"old a"), "l1")  # revalidation is off
        clock.now += 1.0
        engine.suspect_cached()
        assert [hit and (hit.value, hit.tier) for hit in engine.get_many([b"a", b"b", b"wb/back"])] == [
            (b"new a", "l3"),
            (b"old b", "l1"),
            (b"written back", "l1"),
        ]
        assert vouch_checks(engine.counters) == (3, 1)  # issue 22's checks (from one listing: issue 49)
        # Once: what was checked, or filled since, is served as before.
        clock.now += 3600.0
        engine.put(b"c", b"put after")
        assert [hit and hit.tier for hit in engine.get_many([b"a", b"b", b"wb/back", b"c"])] == ["l1"] * 4
        assert vouch_checks(engine.counters) == (3, 1) and engine.counters["revalidations"] == 0
    finally:
        engine.close()


def test_the_proxy_drops_or_refuses_while_cut_and_forwards_once_healed() -> None:
    """The cut itself, on a plain TCP echo server: what the tests above rely on."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    stop = threading.Event()

    def echo(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # the proxy resets what lived through a cut
            while data := conn.recv(1024):
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                threading.Thread(target=echo, args=(server.accept()[0],), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    proxy = _proxy(f"127.0.0.1:{server.getsockname()[1]}")
    try:
        host, port = proxy.address.split(":")

        def connect() -> socket.socket:
            return socket.create_connection((host, int(port)), timeout=0.5)

        with connect() as before:
            before.sendall(b"ping")
            assert before.recv(16) == b"ping"
            proxy.cut()  # dropped: nothing comes back, on this connection or a new one
            before.sendall(b"lost")
            with pytest.raises(TimeoutError):
                before.recv(16)
            with connect() as during:
                during.sendall(b"lost too")
                with pytest.raises(TimeoutError):
                    during.recv(16)
                proxy.heal()  # what lived through the cut is reset
                with pytest.raises(ConnectionResetError):
                    during.recv(16)
        with connect() as after:
            after.sendall(b"pong")
            assert after.recv(16) == b"pong"
            proxy.cut(refuse=True)  # reset at once, new connections refused
            with pytest.raises((ConnectionResetError, BrokenPipeError)):
                after.sendall(b"x")
                after.recv(16)
            with pytest.raises(ConnectionRefusedError):
                connect()
        proxy.heal()
        with connect() as again:
            again.sendall(b"back")
            assert again.recv(16) == b"back"
    finally:
        proxy.stop()
        stop.set()
        acceptor.join()
        server.close()
