"""Prometheus metrics of a metadata node: its Raft state, its counters, its cache nodes by state.

`MetaNodeCollector` reads the node when Prometheus scrapes; `proposal_histogram`
times each client write from its arrival to its commit and apply. The RPC
metrics, the registry and the /metrics endpoint are `cachesvc.metrics`, shared
with the cache server.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cacheclient.wire import NODE_STATE_NAMES, node_state_name
from cachesvc.meta.node import MetaNode
from cachesvc.metrics import LATENCY_BUCKETS

__all__ = ["MetaNodeCollector", "proposal_histogram"]


class MetaNodeCollector(Collector):
    """A metadata node's Raft state and counters, and its view of the cache nodes, at scrape time."""

    def __init__(self, node: MetaNode) -> None:
        self._node = node

    def collect(self) -> Iterator[Metric]:
        node = self._node
        info = node.info  # published whole by the Raft thread: one consistent view
        gauges = {
            "term": ("The Raft term this node is in", info.term),
            "leader_id": ("The id of the node this one follows or is (0: none known)", info.leader or 0),
            "is_leader": ("1 when this node leads the shard", int(info.role.value == "leader")),
            "commit_index": ("Highest log index known committed", info.commit),
            "applied_index": ("Highest log index applied to the state machine", info.applied),
            "last_index": ("Highest log index this node holds", info.last_index),
            "snapshot_index": ("Log index the latest snapshot covers", info.snapshot_index),
            "quiesced": ("1 when the shard is quiet: its leader heartbeats at the slow, idle rate", int(info.quiesced)),
        }
        for name, (help_text, value) in gauges.items():
            yield GaugeMetricFamily(f"cachesvc_meta_{name}", help_text, value=value)
        counters = {
            "entries_proposed": "Log entries this node proposed as leader",
            "commands_proposed": "Client commands this node proposed (many per entry)",
            "persists": "Durable writes (fsyncs) of the Raft log and state",
            "elections_won": "Elections this node won",
            "snapshots": "Snapshots this node took (log compactions)",
            "snapshots_installed": "Snapshots this node installed from its leader",
            "raft_messages_sent": "Raft messages this node sent to its peers",
            "heartbeats_sent": "Raft heartbeats this node sent as leader (few while the shard is quiesced)",
        }
        stats = dict(node.stats)
        for name, help_text in counters.items():
            yield CounterMetricFamily(f"cachesvc_meta_{name}", help_text, value=stats.get(name, 0))
        nodes = GaugeMetricFamily(
            "cachesvc_meta_cache_nodes", "Cache nodes registered, by state (this node's applied view)", labels=["state"]
        )
        try:
            by_state = node.inspect(_cache_nodes_by_state).result(timeout=1.0)
        except Exception:
            by_state = {}
        for state in NODE_STATE_NAMES.values():
            nodes.add_metric([state], by_state.get(state, 0))
        yield nodes

    def describe(self) -> Iterator[Metric]:
        return iter(())


def _cache_nodes_by_state(node: MetaNode) -> dict[str, int]:
    counts: dict[str, int] = {}
    for cache_node in node.state.nodes.values():
        name = node_state_name(cache_node.state)
        counts[name] = counts.get(name, 0) + 1
    return counts


def proposal_histogram(registry: CollectorRegistry) -> Histogram:
    """`cachesvc_meta_proposal_seconds`: from a write's arrival at the leader to its commit and apply."""
    return Histogram(
        "cachesvc_meta_proposal_seconds",
        "Time from a client write's arrival at the leader until it is committed and applied",
        buckets=LATENCY_BUCKETS,
        registry=registry,
    )
