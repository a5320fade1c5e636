"""Quotas and priorities on a real cache node: the noisy neighbour, with and without tenants, in one run.

One metadata node and one cache server (L1 only, plain LRU, so a scan flushes the cache), SeaweedFS behind
it. Tenant A reads a small working set each round; tenant B scans a dataset ten times the cache, twice,
a cache's worth per round. Without tenants A's hit ratio collapses; with A `high` and B `low` under an L1
quota, A's stays within 5 points of A alone, and B's bytes in L1 never exceed its quota at any sample.

On two nodes of capacities 3 : 1, a tenant's L1 quota is the cluster's: each node holds it to the quota times
its share of the placement's slots, and fills that part.

Then L2 on a node without L1: tenant B, with an L2 quota, writes twice the tier; its L2 bytes stay within
the quota at every sample, and its evictions are its own keys (tenant A's, same priority, all stay).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from cacheclient import CacheClient, NodeClient
from tests.conftest import Cluster, S3Server, running_cluster, wait_until

DATA_TOKEN, ADMIN_TOKEN = "quota-data-token", "quota-admin-token"
VALUE = 8 << 10
L1 = 1 << 20
A_KEYS = [f"a/{i:03d}" for i in range(32)]  # 256 KiB
B_KEYS = [f"b/{i:05d}" for i in range(10 * L1 // VALUE)]  # ten times the cache
PAGE = L1 // VALUE  # B reads a cache's worth per round
ROUNDS = 2 * len(B_KEYS) // PAGE  # two epochs of B
B_QUOTA = 512 << 10


@pytest.fixture(scope="module")
def node(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    base = tmp_path_factory.mktemp("quotas")
    with running_cluster(
        s3, base, 'policy = "lru"\n', [("1MiB", "0")], meta_nodes=1, tokens=(DATA_TOKEN, ADMIN_TOKEN)
    ) as cluster:
        objects = s3.client()
        for key in A_KEYS + B_KEYS:
            objects.put_object(Bucket=s3.bucket, Key=cluster.prefix + key, Body=key.encode().ljust(VALUE, b"."))
        yield cluster


def _client(cluster: Cluster, token: str) -> CacheClient:
    return CacheClient(meta=",".join(cluster.shard.addresses), token=token, timeout=20.0, colocated=False)


def _evict_all(cluster: Cluster) -> None:
    with cluster.client(colocated=False) as admin:
        for key in A_KEYS + B_KEYS:
            admin.evict(key)


def _run(
    cluster: Cluster, a: CacheClient, b: CacheClient | None, *, sample: CacheClient | None = None
) -> tuple[float, list[int]]:
    """A's hit ratio after its first round, and (with an admin client to `sample` by) B's L1 bytes after each
    round."""
    hits = reads = 0
    samples: list[int] = []
    for round_ in range(ROUNDS):
        for key in A_KEYS:
            found = a.get_with_tier(key)
            assert found is not None and found[0].startswith(key.encode())
            if round_:  # the first round fills the cache
                reads += 1
                hits += found[1] in ("l1", "l2")
        if b is not None:
            start = (round_ * PAGE) % len(B_KEYS)
            assert all(v is not None for v in b.get_many(B_KEYS[start : start + PAGE]))
        if sample is not None:
            samples.append(int(sample.stats()["counters"].get("tenant_bytes/l1/team-b", 0)))
    return hits / reads, samples


def _cachectl(cluster: Cluster, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHECTL_")}
    env.update(CACHECTL_META=",".join(cluster.shard.addresses), CACHECTL_ADMIN_TOKEN=ADMIN_TOKEN)
    done = subprocess.run(
        [sys.executable, "-m", "cachesvc.commands.cachectl", *args], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _add_tenant(cluster: Cluster, *args: str) -> str:
    return _cachectl(cluster, "tenant", "add", *args).strip().splitlines()[-1]


def test_a_noisy_neighbour_cannot_push_a_protected_tenant_out_of_l1(node: Cluster) -> None:
    # Without tenants: both read with the data token, and B's scans flush A's keys every round.
    with _client(node, DATA_TOKEN) as a, _client(node, DATA_TOKEN) as b:
        collapsed, _ = _run(node, a, b)
    _evict_all(node)
    a_token = _add_tenant(node, "team-a", "--prefix", "a/", "--priority", "high")
    b_token = _add_tenant(node, "team-b", "--prefix", "b/", "--priority", "low", "--l1", str(B_QUOTA))
    with _client(node, a_token) as a, _client(node, b_token) as b, node.client(colocated=False) as admin:
        wait_until(lambda: _tokens_known(a, b), 5.0, "the node to know both tenants' tokens")
        alone, _ = _run(node, a, None)
        _evict_all(node)
        admin.stats()  # the clients hold the map now: they route by it while the shard is down
        # With the whole shard down: the node keeps the last table it applied, quotas and priorities too.
        node.shard.stop()
        try:
            protected, b_samples = _run(node, a, b, sample=admin)
        finally:
            node.shard.start()
            node.shard.leader(timeout=20.0)
    # The restarted shard knows the node again once it heartbeats: until then a routing client (cachectl's too)
    # finds no node to ask for its figures.
    wait_until(lambda: _placed(node), 30.0, "the node back in the restarted shard's placement")
    print(json.dumps({"alone": alone, "protected": protected, "collapsed": collapsed, "b_l1": b_samples}))
    assert alone > 0.9, alone
    assert protected >= alone - 0.05, (protected, alone)
    assert collapsed < alone - 0.5, (collapsed, alone)  # the same run without tenants: A is pushed out
    assert b_samples and max(b_samples) <= B_QUOTA, b_samples
    assert max(b_samples) > B_QUOTA // 2, "B did fill its share of L1"

    # What an operator sees: usage against quota, and rates by tenant.
    listed = {t["name"]: t for t in json.loads(_cachectl(node, "tenant", "ls", "--json"))["tenants"]}
    assert listed["team-b"]["l1_bytes"] == B_QUOTA
    assert 0 < listed["team-b"]["used"]["l1_bytes"] <= B_QUOTA
    assert listed["team-a"]["used"]["l1_bytes"] == 32 * _cost(node)
    assert listed["team-b"]["used"]["misses"] > 0 and listed["team-a"]["used"]["l1_hits"] > 0
    with _client(node, a_token) as a:
        for key in A_KEYS:
            a.get(key)
        top = json.loads(_cachectl(node, "top", "--by", "tenant", "--once", "--interval", "0.5", "--json"))
    rows = {row["tenant"]: row for row in top["tenants"]}
    assert set(rows) == {"team-a", "team-b"}
    assert rows["team-a"]["l1_bytes"] == listed["team-a"]["used"]["l1_bytes"]


def _cost(cluster: Cluster) -> int:
    """What one of A's values costs in L1 (the tier's own accounting)."""
    with cluster.client(colocated=False) as admin:
        counters = admin.stats()["counters"]
    return int(counters["tenant_bytes/l1/team-a"]) // len(A_KEYS)


def _placed(cluster: Cluster) -> bool:
    with cluster.client(colocated=False) as admin:
        try:
            return bool(admin.cluster.placement(refresh=True).nodes)
        except Exception:
            return False


def _tokens_known(a: CacheClient, b: CacheClient) -> bool:
    try:
        a.get_with_tier(A_KEYS[0])
        b.get_with_tier(B_KEYS[0])
    except Exception:
        return False
    return True


# -- L2: a tenant at its quota evicts its own keys only ------------------------------------------------------------

L2 = 4 << 20
L2_QUOTA = 1 << 20
L2_A = [f"la/{i:03d}" for i in range(64)]  # 512 KiB
L2_B = [f"lb/{i:05d}" for i in range(2 * L2 // VALUE)]  # twice the tier


@pytest.fixture(scope="module")
def l2_node(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One node with no L1: every value lands in L2 (LMDB), plain LRU."""
    base = tmp_path_factory.mktemp("l2-quotas")
    with running_cluster(
        s3, base, 'policy = "lru"\n', [("0", "4MiB")], meta_nodes=1, tokens=(DATA_TOKEN, ADMIN_TOKEN)
    ) as cluster:
        yield cluster


def test_a_tenant_at_its_l2_quota_evicts_its_own_keys_only(l2_node: Cluster) -> None:
    # Both tenants `normal`: only the quota keeps B's writes from pushing A's keys out (plain LRU would).
    a_token = _add_tenant(l2_node, "l2-a", "--prefix", "la/")
    b_token = _add_tenant(l2_node, "l2-b", "--prefix", "lb/", "--l2", str(L2_QUOTA))
    value = b"v" * VALUE
    with _client(l2_node, a_token) as a, _client(l2_node, b_token) as b, l2_node.client(colocated=False) as admin:
        wait_until(lambda: _may_write(a, "la/probe") and _may_write(b, "lb/probe"), 5.0, "the node to know the tokens")
        a.put_many([(key, value) for key in L2_A])
        samples: list[int] = []
        for start in range(0, len(L2_B), 32):
            b.put_many([(key, value) for key in L2_B[start : start + 32]])
            samples.append(int(admin.stats()["counters"].get("tenant_bytes/l2/l2-b", 0)))
        counters = admin.stats()["counters"]
        tiers = [found[1] if (found := a.get_with_tier(key)) is not None else None for key in L2_A]
    print(json.dumps({"b_l2": samples, "a_tiers": sorted(set(map(str, tiers)))}))
    # B wrote twice the tier; at every sample its L2 bytes were within its quota, and it did fill it.
    assert max(samples) <= L2_QUOTA, samples
    assert max(samples) > L2_QUOTA // 2, samples
    assert int(counters.get("tenant_evictions/l2/l2-b", 0)) >= len(L2_B) - L2_QUOTA // VALUE
    # B's evictions were its own keys: every one of A's is still in L2, none evicted.
    assert tiers == ["l2"] * len(L2_A), tiers
    assert int(counters.get("tenant_evictions/l2/l2-a", 0)) == 0
    assert int(counters["tenant_bytes/l2/l2-a"]) >= len(L2_A) * VALUE


def _may_write(client: CacheClient, key: str) -> bool:
    try:
        client.put(key, b"probe")
    except Exception:
        return False
    return True


# -- the cluster's quota, divided by the placement's weights ------------------------------------------------------

SPREAD_QUOTA = 1 << 20
SPREAD_KEYS = [f"s/{i:04d}" for i in range(4 * SPREAD_QUOTA // VALUE)]  # four times the quota


@pytest.fixture(scope="module")
def two_nodes(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Two nodes of capacities 3 : 1 (L1 only), so the placement weighs them 3 : 1."""
    base = tmp_path_factory.mktemp("spread-quotas")
    with running_cluster(
        s3, base, 'policy = "lru"\n', [("3MiB", "0"), ("1MiB", "0")], meta_nodes=1, tokens=(DATA_TOKEN, ADMIN_TOKEN)
    ) as cluster:
        yield cluster


def _node_counters(cluster: Cluster) -> dict[str, dict[str, int]]:
    counters = {}
    for server in cluster.servers:
        with NodeClient(server.address, timeout=10.0, token=ADMIN_TOKEN) as node:
            counters[server.address] = {k: int(v) for k, v in node.stats()["counters"].items()}
    return counters


def test_each_node_holds_a_tenant_to_the_cluster_quota_times_its_placement_share(two_nodes: Cluster) -> None:
    placement = two_nodes.placement()
    share = {node: placement.slots.count(i) / len(placement.slots) for i, node in enumerate(placement.nodes)}
    assert len(share) == 2 and max(share.values()) > 0.6, share  # the 3 MiB node owns most slots
    expected = {node: math.ceil(SPREAD_QUOTA * s) for node, s in share.items()}
    token = _add_tenant(two_nodes, "spread", "--prefix", "s/", "--l1", str(SPREAD_QUOTA))

    def quotas() -> dict[str, int]:
        return {node: c.get("tenant_quota/l1/spread", 0) for node, c in _node_counters(two_nodes).items()}

    wait_until(lambda: quotas() == expected, 10.0, "each node's part of the quota")
    value = b"s" * VALUE
    with _client(two_nodes, token) as tenant:
        for start in range(0, len(SPREAD_KEYS), 32):
            tenant.put_many([(key, value) for key in SPREAD_KEYS[start : start + 32]])
    used = {node: c.get("tenant_bytes/l1/spread", 0) for node, c in _node_counters(two_nodes).items()}
    print(json.dumps({"share": share, "quota": quotas(), "used": used}))
    # Each node held the tenant to its part (not the whole quota, which either node's L1 could have taken), and
    # filled it: the cluster holds the quota's worth.
    for node in share:
        assert used[node] <= expected[node] < SPREAD_QUOTA, (node, used, expected)
        assert used[node] > expected[node] - 2 * VALUE, (node, used, expected)
    assert sum(used.values()) <= SPREAD_QUOTA + 2
    listed = {t["name"]: t for t in json.loads(_cachectl(two_nodes, "tenant", "ls", "--json"))["tenants"]}
    assert listed["spread"]["used"]["l1_bytes"] == sum(used.values())
