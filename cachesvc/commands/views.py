"""`cachectl status` and `cachectl top`: the cluster at a glance, once or refreshing.

Both read what the servers already report: the metadata shard's leader, its
members and its cache nodes (with their states), and each cache node's Stats
answer (tiers, engine counters, and the RPC totals its interceptor keeps).
`status` also has each node probe its object storage. `top` samples every
node each interval and shows rates over it: requests, mean latency, errors,
reads and the share the cache tiers answered, bytes served, S3 fills.

Without `--meta` or `--cache`, both look for a shard at the default address
and fall back to the default cache server alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from cacheclient import CacheClient, CacheClientError
from cacheclient.meta import MetaClient
from cachesvc.commands.common import (
    DEFAULT_CACHE,
    DEFAULT_META,
    EXIT_UNAVAILABLE,
    addresses,
    one_line,
    shard_members,
    slot_shares,
    tls_ca,
    token,
)
from cachesvc.units import human_bytes

__all__ = ["cmd_status", "cmd_top", "gather", "tenant_figures"]

_CACHE_TIERS = ("l1", "l2")
_PROBE_TIMEOUT = 5.0


@dataclass
class Node:
    """One cache node as `status` and `top` see it."""

    address: str
    state: str = "-"
    """Its state in the shard ("up", "draining", "down", "joining"), "-" without a shard."""
    slot_share: float | None = None
    stats: dict[str, Any] | None = None
    info: dict[str, Any] | None = None
    error: str = ""
    """Why it did not answer ("" when it did)."""
    at: float = 0.0

    @property
    def counters(self) -> dict[str, int]:
        return self.stats["counters"] if self.stats else {}

    def tier(self, name: str) -> dict[str, Any] | None:
        return next((t for t in self.stats["tiers"] if t["name"] == name), None) if self.stats else None


@dataclass
class Cluster:
    """What one look at the cluster found."""

    nodes: list[Node]
    meta: list[str] = field(default_factory=list)
    """The shard's addresses asked ([] without a shard)."""
    leader: dict[str, Any] | None = None
    members: list[dict[str, Any]] = field(default_factory=list)
    meta_error: str = ""


def _shard_addresses(args: argparse.Namespace) -> tuple[list[str], bool]:
    """The shard's addresses, and whether the user named them (else the default, tried quietly).

    `--meta` beats `--cache` here (the shard knows every node), and flags beat variables.
    """
    for meta, cache in ((getattr(args, "meta", None), args.cache), (os.environ.get("CACHECTL_META"), None)):
        if meta:
            return addresses(meta, "--meta"), True
        if cache:
            return [], False
    if os.environ.get("CACHECTL_CACHE"):
        return [], False
    return [DEFAULT_META], False


def gather(args: argparse.Namespace, *, probe: bool) -> Cluster:
    """Looks at the shard (when there is one) and every cache node it knows, or the one cache server."""
    meta, named = _shard_addresses(args)
    cluster = Cluster(nodes=[], meta=meta)
    wait = min(args.timeout, _PROBE_TIMEOUT)
    if meta:
        with MetaClient(
            meta, timeout=wait, attempt_timeout=min(1.0, wait), token=token(args), tls_ca=tls_ca(args)
        ) as client:
            _look_at_shard(client, cluster, wait)
        if cluster.meta_error and not named and not cluster.members:
            cluster.meta = []  # no shard at the default address: one cache server
    if not cluster.meta:
        cache = args.cache or os.environ.get("CACHECTL_CACHE") or DEFAULT_CACHE
        cluster.nodes = [Node(address) for address in addresses(cache, "--cache")]
    with ThreadPoolExecutor(max(1, min(16, len(cluster.nodes)))) as pool:
        list(pool.map(lambda node: _look_at_node(node, args, probe, wait), cluster.nodes))
    return cluster


def _look_at_shard(client: MetaClient, cluster: Cluster, wait: float) -> None:
    members = shard_members(client, min(1.0, wait))
    if all(m["role"] == "unreachable" for m in members):
        cluster.meta_error = f"no metadata node answered at {','.join(client.addresses)}"
        return
    cluster.members = members
    found = client.leader(timeout=wait)
    if found is not None:
        term = max((m.get("term", 0) for m in cluster.members), default=0)
        cluster.leader = {"id": found[0], "address": found[1], "term": term}
    try:
        nodes = client.nodes(stale=found is None, timeout=wait)
        shares = slot_shares(client.placement(refresh=True, timeout=wait)) if found is not None else {}
    except CacheClientError as exc:
        cluster.meta_error = cluster.meta_error or f"the shard did not list its cache nodes: {one_line(exc)}"
        return
    cluster.nodes = [Node(n.address, n.state, shares.get(n.address)) for n in nodes]
    if found is None:
        cluster.meta_error = "the metadata shard has no leader"


def _look_at_node(node: Node, args: argparse.Namespace, probe: bool, wait: float) -> None:
    client = CacheClient(node.address, timeout=wait, token=token(args), tls_ca=tls_ca(args))
    try:
        node.stats = client.stats()
        node.at = time.monotonic()
        if probe:
            node.info = client.info(probe_object_storage=True)
    except CacheClientError as exc:
        node.error = one_line(exc)
    finally:
        client.close()


# -- status ------------------------------------------------------------------------------


def _hit_ratio(counters: dict[str, int]) -> float | None:
    gets = counters.get("gets", 0)
    return sum(counters.get(f"hits_{t}", 0) for t in _CACHE_TIERS) / gets if gets else None


def _node_doc(node: Node) -> dict[str, Any]:
    doc: dict[str, Any] = {"address": node.address, "state": node.state, "reachable": node.stats is not None}
    if node.slot_share is not None:
        doc["slot_share"] = node.slot_share
    if node.error:
        doc["error"] = node.error
    if node.stats is not None:
        c = node.counters
        doc["tiers"] = {
            t["name"]: {"used_bytes": t["used_bytes"], "capacity_bytes": t["capacity_bytes"], "entries": t["entries"]}
            for t in node.stats["tiers"]
        }
        doc["hit_ratio"] = _hit_ratio(c)
        doc["gets"] = c.get("gets", 0)
        doc["writeback"] = {"queued": c.get("writeback_queue", 0), "dirty_keys": c.get("dirty_keys", 0)}
        if c.get("vouch_held"):
            doc["vouching"] = _vouching_doc(c)
    if node.info is not None:
        doc["object_storage"] = {
            "endpoint": node.info["s3_endpoint"],
            "bucket": node.info["s3_bucket"],
            "status": node.info["object_storage"] or "none",
        }
    return doc


def _problems(cluster: Cluster) -> list[str]:
    problems = [cluster.meta_error] if cluster.meta_error else []
    for node in cluster.nodes:
        if node.error:
            problems.append(f"cache node {node.address} does not answer: {node.error}")
        elif node.info is not None and node.info["object_storage"] not in ("ok", ""):
            problems.append(f"cache node {node.address} cannot reach object storage: {node.info['object_storage']}")
        if node.state in ("down", "joining"):
            problems.append(f"cache node {node.address} is {node.state}")
    return problems


def cmd_status(args: argparse.Namespace) -> int:
    """`cachectl status [--json]`: exit 0 when everything answers, 3 when a node, the leader or S3 does not."""
    cluster = gather(args, probe=True)
    problems = _problems(cluster)
    if args.json:
        doc = {
            "leader": cluster.leader,
            "meta_nodes": [{k: v for k, v in m.items() if k != "members"} for m in cluster.members],
            "nodes": [_node_doc(n) for n in cluster.nodes],
            "problems": problems,
        }
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        _print_status(cluster, problems)
    return EXIT_UNAVAILABLE if problems else 0


def _vouching_doc(c: dict[str, int]) -> dict[str, int | bool]:
    """A node's check of the copies it found at start-up (or after a move) against object storage."""
    return {
        "held": c.get("vouch_held", 0),
        "checked": c.get("vouch_checked", 0),
        "keys_per_second": c.get("vouch_rate", 0),
        "left_to_first_read": c.get("vouch_left_to_reads", 0),
        "unvouched": c.get("unvouched_keys", 0),
        "done": bool(c.get("vouch_done", 0)),
    }


def _vouching_line(address: str, c: dict[str, int]) -> str:
    v = _vouching_doc(c)
    state = "done" if v["done"] else "in progress"
    line = f"vouch    {address}: {v['checked']:,} of {v['held']:,} cached copies checked against S3"
    line += f" ({v['keys_per_second']:,}/s, {state})"
    if v["left_to_first_read"]:
        line += f"; {v['left_to_first_read']:,} checked at their first read"
    return line


def _used(tier: dict[str, Any] | None) -> str:
    if tier is None:
        return "-"
    return f"{human_bytes(tier['used_bytes'])} / {human_bytes(tier['capacity_bytes'])}"


def _print_status(cluster: Cluster, problems: list[str]) -> None:
    if cluster.meta:
        answering = sum(m["role"] != "unreachable" for m in cluster.members)
        if cluster.leader is not None:
            lead = cluster.leader
            print(f"shard    leader {lead['id']} at {lead['address']}, term {lead['term']}; ", end="")
        else:
            print("shard    no leader; ", end="")
        print(f"{answering} of {len(cluster.members) or len(cluster.meta)} metadata nodes answer")
    states: dict[str, int] = {}
    for node in cluster.nodes:
        states[node.state] = states.get(node.state, 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(states.items())) if cluster.meta else "no shard (--meta)"
    print(f"nodes    {len(cluster.nodes)} cache node{'s' if len(cluster.nodes) != 1 else ''}: {summary}")
    storage = {(n.info["s3_endpoint"], n.info["s3_bucket"]) for n in cluster.nodes if n.info and n.info["s3_bucket"]}
    reachable = sum(1 for n in cluster.nodes if n.info and n.info["object_storage"] == "ok")
    probed = sum(1 for n in cluster.nodes if n.info and n.info["object_storage"])
    for endpoint, bucket in sorted(storage):
        print(f"s3       {endpoint or 'AWS'} bucket {bucket}: reachable from {reachable} of {probed} nodes")
    if not storage and any(n.info for n in cluster.nodes):
        print("s3       none configured (no L3)")
    print()
    print(
        f"{'node':<22} {'state':<9}  {'l1 used / budget':>22}  {'l2 used / budget':>22}  {'hit ratio':>9}  "
        f"{'write-back':>10}  {'s3':<5}"
    )
    for node in cluster.nodes:
        if node.stats is None:
            print(f"{node.address:<22} {node.state:<9}  does not answer")
            continue
        ratio = _hit_ratio(node.counters)
        backlog = f"{node.counters.get('dirty_keys', 0)} dirty"
        s3 = "-" if node.info is None else {"ok": "ok", "": "none"}.get(node.info["object_storage"], "ERROR")
        print(
            f"{node.address:<22} {node.state:<9}  {_used(node.tier('l1')):>22}  {_used(node.tier('l2')):>22}  "
            f"{'-' if ratio is None else f'{ratio * 100:.1f}%':>9}  {backlog:>10}  {s3:<5}"
        )
    for node in cluster.nodes:
        if node.stats is not None and node.counters.get("vouch_held"):
            print(_vouching_line(node.address, node.counters))
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)


# -- top ---------------------------------------------------------------------------------


def _rates(before: Node | None, now: Node) -> dict[str, Any]:
    """Per-second rates of `now` over the interval since `before` (same node), plus levels."""
    row: dict[str, Any] = {"address": now.address, "state": now.state, "reachable": now.stats is not None}
    if now.stats is None:
        row["error"] = now.error
        return row
    for name in ("l1", "l2"):
        tier = now.tier(name)
        if tier is not None and tier["capacity_bytes"]:
            row[f"{name}_used"] = tier["used_bytes"] / tier["capacity_bytes"]
    row["writeback_dirty_keys"] = now.counters.get("dirty_keys", 0)
    if before is None or before.stats is None or now.at <= before.at:
        return row
    seconds = now.at - before.at
    a, b = before.counters, now.counters

    def delta(name: str) -> int:
        return max(0, b.get(name, 0) - a.get(name, 0))

    calls, gets = delta("rpc_calls"), delta("gets")
    cached = sum(delta(f"hits_{t}") for t in _CACHE_TIERS)
    row.update(
        requests_per_second=calls / seconds,
        mean_latency_ms=delta("rpc_micros") / calls / 1000 if calls else None,
        errors_per_second=delta("rpc_errors") / seconds,
        gets_per_second=gets / seconds,
        puts_per_second=delta("puts") / seconds,
        hit_ratio=cached / gets if gets else None,
        bytes_out_per_second=sum(delta(name) for name in b if name.startswith("hit_bytes_")) / seconds,
        s3_fills_per_second=delta("fills") / seconds,
    )
    return row


def _frames(args: argparse.Namespace) -> Iterator[list[dict[str, Any]]]:
    previous: dict[str, Node] = {}
    first = True
    while True:
        cluster = gather(args, probe=False)
        if first and not any(node.stats for node in cluster.nodes):
            reason = cluster.meta_error or "; ".join(n.error for n in cluster.nodes) or "no cache node"
            raise CacheClientError(f"nothing to watch: {reason}")
        if not first:
            yield [_rates(previous.get(node.address), node) for node in cluster.nodes]
        first = False
        previous = {node.address: node for node in cluster.nodes}
        time.sleep(args.interval)


def tenant_figures(nodes: list[Node]) -> dict[str, dict[str, int]]:
    """Each tenant's figures over `nodes` (from their Stats counters, `cachesvc.policy.tenants`), summed: per tier,
    its bytes ("l1_bytes", against its quota, which is the cluster's), hits, evictions and the nodes' quotas
    ("l1_quota": each node's share of it); "misses"."""
    figures: dict[str, dict[str, int]] = {}
    for node in nodes:
        for name, value in node.counters.items():
            if not name.startswith("tenant_"):
                continue
            what, _, rest = name[len("tenant_") :].partition("/")
            if what == "misses":
                row = figures.setdefault(rest, {})
                row["misses"] = row.get("misses", 0) + value
                continue
            tier, _, tenant = rest.partition("/")
            row = figures.setdefault(tenant, {})
            field = f"{tier}_{what}"
            row[field] = row.get(field, 0) + value
    return figures


def _tenant_frames(args: argparse.Namespace) -> Iterator[list[dict[str, Any]]]:
    previous: dict[str, dict[str, int]] | None = None
    while True:
        cluster = gather(args, probe=False)
        if previous is None and not any(node.stats for node in cluster.nodes):
            reason = cluster.meta_error or "; ".join(n.error for n in cluster.nodes) or "no cache node"
            raise CacheClientError(f"nothing to watch: {reason}")
        now = tenant_figures(cluster.nodes)
        if previous is not None:
            rows = []
            for tenant, row in sorted(now.items()):
                before = previous.get(tenant, {})

                def rate(field: str, row: dict[str, int] = row, before: dict[str, int] = before) -> float:
                    return max(0, row.get(field, 0) - before.get(field, 0)) / args.interval

                hits = rate("l1_hits") + rate("l2_hits")
                misses = rate("misses")
                rows.append(
                    {
                        "tenant": tenant,
                        "hits_per_second": hits,
                        "misses_per_second": misses,
                        "hit_ratio": hits / (hits + misses) if hits + misses else None,
                        "evictions_per_second": rate("l1_evictions") + rate("l2_evictions"),
                        "l1_bytes": row.get("l1_bytes", 0),
                        "l2_bytes": row.get("l2_bytes", 0),
                    }
                )
            yield rows
        previous = now
        time.sleep(args.interval)


def _print_top_by_tenant(rows: list[dict[str, Any]], interval: float) -> None:
    print(f"cachectl top --by tenant: every {interval:g}s, {time.strftime('%H:%M:%S')}")
    print(f"{'tenant':<16} {'hits/s':>8} {'misses/s':>9} {'hit%':>6} {'evict/s':>8} {'l1 (node max)':>14} {'l2':>10}")
    for row in rows:
        print(
            f"{row['tenant']:<16} {row['hits_per_second']:>8.1f} {row['misses_per_second']:>9.1f} "
            f"{_fmt(row['hit_ratio'], '.1f', 100):>6} {row['evictions_per_second']:>8.1f} "
            f"{human_bytes(row['l1_bytes']):>14} {human_bytes(row['l2_bytes']):>10}"
        )
    sys.stdout.flush()


def cmd_top(args: argparse.Namespace) -> int:
    """`cachectl top [--by node|tenant] [--interval S] [--once | --iterations N] [--json]`: rates, refreshed."""
    if args.interval <= 0:
        print("cachectl top: --interval must be positive", file=sys.stderr)
        return 2
    iterations = 1 if args.once else args.iterations
    clear = sys.stdout.isatty() and not args.json and iterations != 1
    by_tenant = getattr(args, "by", "node") == "tenant"
    frames = _tenant_frames(args) if by_tenant else _frames(args)
    try:
        for shown, rows in enumerate(frames, start=1):
            if args.json:
                what = "tenants" if by_tenant else "nodes"
                print(json.dumps({"time": time.time(), "interval": args.interval, what: rows}), flush=True)
            else:
                if clear:
                    print("\x1b[H\x1b[2J", end="")
                (_print_top_by_tenant if by_tenant else _print_top)(rows, args.interval)
            if iterations and shown >= iterations:
                break
    except KeyboardInterrupt:
        return 0
    return 0


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _print_top(rows: list[dict[str, Any]], interval: float) -> None:
    print(f"cachectl top: every {interval:g}s, {time.strftime('%H:%M:%S')}")
    print(
        f"{'node':<22} {'state':<9} {'req/s':>8} {'lat ms':>7} {'err/s':>6} {'gets/s':>8} {'hit%':>6} "
        f"{'out/s':>10} {'fills/s':>8} {'l1%':>5} {'l2%':>5} {'dirty':>6}"
    )
    for row in rows:
        if not row["reachable"]:
            print(f"{row['address']:<22} {row['state']:<9} (does not answer: {row['error']})")
            continue
        out = row.get("bytes_out_per_second")
        print(
            f"{row['address']:<22} {row['state']:<9} {_fmt(row.get('requests_per_second'), '.1f'):>8} "
            f"{_fmt(row.get('mean_latency_ms'), '.2f'):>7} {_fmt(row.get('errors_per_second'), '.1f'):>6} "
            f"{_fmt(row.get('gets_per_second'), '.1f'):>8} {_fmt(row.get('hit_ratio'), '.1f', 100):>6} "
            f"{'-' if out is None else human_bytes(out):>10} {_fmt(row.get('s3_fills_per_second'), '.1f'):>8} "
            f"{_fmt(row.get('l1_used'), '.0f', 100):>5} {_fmt(row.get('l2_used'), '.0f', 100):>5} "
            f"{row['writeback_dirty_keys']:>6}"
        )
    sys.stdout.flush()
