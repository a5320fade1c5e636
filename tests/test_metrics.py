"""Prometheus metrics as an operator scrapes them from a real cache server and metadata node, after traffic."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cachesvc.devcluster.procs import free_port, wait_for_port
from cachesvc.devcluster.shard import LocalShard

from conftest import s3_args, wait_until

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(address: str, token: str = "") -> Samples:
    """Every sample at http://ADDRESS/metrics, by name and labels (presenting `token` as a bearer, if given)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"http://{address}/metrics", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def dashboard_metrics() -> set[str]:
    """Every metric a panel (or variable) of deploy/grafana/cachesvc.json queries."""
    dashboard = json.loads((Path(__file__).resolve().parent.parent / "deploy/grafana/cachesvc.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
    names = {name for expr in exprs for name in re.findall(r"\b((?:cachesvc|process)_[a-z0-9_]+)", expr)}
    assert len(names) > 20, names
    return names


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def rpc(samples: Samples, method: str, code: str = "OK", service: str = "cachesvc.v1.CacheService") -> float:
    return value(samples, "cachesvc_rpc_requests_total", service=service, method=method, code=code)


def test_cache_server_metrics_move_with_traffic(cache_server: Any, s3: Any, s3_prefix: str, tmp_path: Path) -> None:
    metrics = f"127.0.0.1:{free_port()}"
    server = cache_server(
        "--metrics-listen", metrics, "--l1-bytes", "16MiB", "--l2-path", str(tmp_path / "l2"), "--l2-bytes", "8MiB",
        *s3_args(s3, s3_prefix),
    )  # fmt: skip
    before = scrape(metrics)
    # Named metrics are there from the start, at zero; the budgets are the configured ones.
    assert value(before, "cachesvc_s3_errors_total") == 0 and value(before, "cachesvc_writeback_queue_keys") == 0
    assert value(before, "cachesvc_tier_capacity_bytes", tier="l1") == 16 << 20
    assert value(before, "cachesvc_tier_capacity_bytes", tier="l2") > 0

    client = server.client()
    client.put_many({f"k{i}": bytes(1000) for i in range(10)})
    for i in range(10):
        assert client.get(f"k{i}") == bytes(1000)
    assert client.get("absent") is None
    assert client.evict("k0")  # object storage keeps it: the next read is a fill
    assert client.get("k0") == bytes(1000)
    with pytest.raises(Exception, match="1..1024 bytes"):
        client.get("x" * 2000)
    with client.prefetch(["k1", "k2"], window_bytes=1 << 20) as plan:
        plan.wait(10.0)

    # The server ends a plan once it sees the caller's side close.
    wait_until(lambda: value(scrape(metrics), "cachesvc_prefetch_plans_open") == 0, 10, "the plan to end")
    after = scrape(metrics)
    assert rpc(after, "PutMany") - rpc(before, "PutMany") == 1
    assert rpc(after, "Get") - rpc(before, "Get") == 12
    assert rpc(after, "Get", "INVALID_ARGUMENT") == 1
    hist = "cachesvc_rpc_duration_seconds_count"
    labels = {"service": "cachesvc.v1.CacheService", "method": "Get", "code": "OK"}
    assert value(after, hist, **labels) == rpc(after, "Get")
    assert value(after, "cachesvc_rpc_duration_seconds_sum", **labels) > 0
    assert value(after, "cachesvc_tier_hits_total", tier="l1") >= 9
    assert value(after, "cachesvc_tier_hit_bytes_total", tier="l1") >= 9000
    assert value(after, "cachesvc_tier_hits_total", tier="l3") == 1  # k0, filled back
    assert value(after, "cachesvc_s3_fills_total") == 1 and value(after, "cachesvc_s3_fill_bytes_total") == 1000
    assert value(after, "cachesvc_s3_fetch_seconds_count") >= 2  # k0's fill, and "absent" asked of S3
    assert value(after, "cachesvc_s3_fetch_seconds_sum") > 0
    assert value(after, "cachesvc_misses_total") == 1  # "absent"
    assert value(after, "cachesvc_tier_misses_total", tier="l3") == 1
    assert value(after, "cachesvc_tier_misses_total", tier="l1") >= 2
    assert value(after, "cachesvc_tier_used_bytes", tier="l1") >= 10_000
    assert value(after, "cachesvc_tier_entries", tier="l1") == 10
    assert value(after, "cachesvc_puts_total") == 10
    assert value(after, "cachesvc_prefetch_plans_total") == 1
    assert value(after, "process_resident_memory_bytes") > 0
    # Every metric the Grafana dashboard's cache panels query is one this server exports.
    exported = {name for name, _ in after}
    assert {m for m in dashboard_metrics() if not m.startswith("cachesvc_meta_")} <= exported
    # The Stats RPC carries the same RPC totals, for `cachectl top`.
    counters = client.stats()["counters"]
    assert counters["rpc_calls"] >= 14 and counters["rpc_errors"] >= 1 and counters["rpc_micros"] > 0


def test_metadata_node_metrics_move_with_writes(tmp_path: Path) -> None:
    metrics_port = free_port()
    with LocalShard(1, tmp_path / "meta", metrics_ports=[metrics_port]) as shard:
        shard.start()
        metrics = shard.metrics_address[1]
        wait_until(lambda: value(scrape(metrics), "cachesvc_meta_is_leader") == 1, 20, "the one node to lead")
        before = scrape(metrics)
        assert value(before, "cachesvc_meta_term") >= 1 and value(before, "cachesvc_meta_leader_id") == 1
        client = shard.client(timeout=10.0)
        try:
            for i in range(5):
                client.register_node(f"127.0.0.1:{20000 + i}", 1 << 30)
            client.set_node_state("127.0.0.1:20000", "draining")
        finally:
            client.close()
        after = scrape(metrics)
    assert value(after, "cachesvc_meta_commit_index") >= value(before, "cachesvc_meta_commit_index") + 1
    assert value(after, "cachesvc_meta_applied_index") == value(after, "cachesvc_meta_commit_index")
    proposals = "cachesvc_meta_proposal_seconds_count"
    assert value(after, proposals) - value(before, proposals) == 6
    assert value(after, "cachesvc_meta_proposal_seconds_sum") > 0
    assert rpc(after, "Propose", service="cachesvc.v1.MetaService") >= 6
    assert value(after, "cachesvc_meta_cache_nodes", state="joining") == 4
    assert value(after, "cachesvc_meta_cache_nodes", state="draining") == 1
    assert value(after, "cachesvc_meta_persists_total") > value(before, "cachesvc_meta_persists_total")
    assert ("cachesvc_meta_snapshots_total", frozenset()) in after
    # And every metric the dashboard's shard panels query is one a metadata node exports.
    exported = {name for name, _ in after}
    assert {m for m in dashboard_metrics() if m.startswith(("cachesvc_meta_", "process_"))} <= exported


def test_metrics_listen_is_checked_and_a_busy_port_is_named(cache_server: Any, tmp_path: Path) -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "cachesvc", "serve", "--metrics-listen", "9100", "--l1-bytes", "1MiB"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "metrics_listen: expected HOST:PORT, got '9100'" in bad.stderr
    first = cache_server("--l1-bytes", "1MiB")
    argv = [
        sys.executable, "-m", "cachesvc", "serve", "--listen", f"127.0.0.1:{free_port()}",
        "--metrics-listen", first.address, "--l1-bytes", "1MiB",
    ]  # fmt: skip
    busy = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert busy.returncode == 1 and f"cannot serve metrics on {first.address}" in busy.stderr
    wait_for_port(first.port, timeout=5)  # the first server is untouched


def refused(address: str, token: str = "") -> int:
    """The HTTP status a scrape of http://ADDRESS/metrics gets when it is refused (fails if it is served)."""
    wait_for_port(int(address.rpartition(":")[2]), timeout=10)  # it opens just after the gRPC port
    with pytest.raises(urllib.error.HTTPError) as refusal:
        scrape(address, token)
    return refusal.value.code


def test_with_a_token_metrics_need_the_admin_token_unless_opened_on_purpose(cache_server: Any, tmp_path: Path) -> None:
    metrics = f"127.0.0.1:{free_port()}"
    tokens = ("--token", "data-secret", "--admin-token", "admin-secret")
    server = cache_server("--metrics-listen", metrics, "--l1-bytes", "1MiB", *tokens)
    assert refused(metrics) == 401
    assert refused(metrics, "data-secret") == 401  # the data scope does not see the admin scope's numbers
    assert refused(metrics, "wrong") == 401
    assert value(scrape(metrics, "admin-secret"), "cachesvc_tier_capacity_bytes", tier="l1") == 1 << 20
    server.stop()
    # Without an admin token the data token is the admin scope's, and guards the metrics.
    other = f"127.0.0.1:{free_port()}"
    cache_server("--metrics-listen", other, "--l1-bytes", "1MiB", "--token", "data-secret")
    assert refused(other) == 401
    assert scrape(other, "data-secret")
    # Exposure without a token is a choice the config states (metrics_open).
    opened = f"127.0.0.1:{free_port()}"
    cache_server("--metrics-listen", opened, "--l1-bytes", "1MiB", *tokens, env={"CACHESVC_METRICS_OPEN": "true"})
    wait_for_port(int(opened.rpartition(":")[2]), timeout=10)
    assert value(scrape(opened), "cachesvc_tier_capacity_bytes", tier="l1") == 1 << 20


def test_a_metadata_node_with_a_token_serves_metrics_to_the_admin_token_only(tmp_path: Path) -> None:
    metrics_port = free_port()
    with LocalShard(
        1, tmp_path / "meta", metrics_ports=[metrics_port], token="data", admin_token="admin", peer_token="peer"
    ) as shard:
        shard.start()
        metrics = shard.metrics_address[1]
        wait_until(lambda: value(scrape(metrics, "admin"), "cachesvc_meta_is_leader") == 1, 20, "the node to lead")
        assert refused(metrics) == 401
        assert refused(metrics, "data") == 401 and refused(metrics, "peer") == 401
