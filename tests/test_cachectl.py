"""`cachectl` as an operator types it: status, ls, evict, top, and what each failure looks like.

Every command runs as a process against real servers (and SeaweedFS); the
exit status is part of what is checked, and a failure must be one line on
stderr, never a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from cachesvc.commands.common import DEFAULT_CACHE, EXIT_CODES
from cachesvc.devcluster.procs import free_port
from cachesvc.devcluster.shard import LocalShard

from conftest import s3_args, self_signed_cert, wait_until

CACHECTL = [sys.executable, "-m", "cachesvc.commands.cachectl"]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("CACHECTL_")}
    environment.update(env or {})
    return subprocess.run([*CACHECTL, *args], capture_output=True, text=True, timeout=60, env=environment)


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def test_status_ls_evict_and_top_on_one_server(cache_server: Any, s3: Any, s3_prefix: str, tmp_path: Path) -> None:
    server = cache_server(
        "--l1-bytes", "16MiB", "--l2-path", str(tmp_path / "l2"), "--l2-bytes", "8MiB", *s3_args(s3, s3_prefix)
    )  # fmt: skip
    client = server.client()
    client.put_many({f"data/k{i}": bytes(100 * (i + 1)) for i in range(5)} | {"other/x": b"x"})
    cache = ("--cache", server.address)

    status = run(*cache, "status", "--json")
    assert status.returncode == 0, status.stderr
    doc = json.loads(status.stdout)
    (node,) = doc["nodes"]
    assert node["reachable"] and node["object_storage"]["status"] == "ok" and doc["problems"] == []
    assert node["tiers"]["l1"]["used_bytes"] > 1500 and node["tiers"]["l1"]["capacity_bytes"] == 16 << 20
    assert node["writeback"] == {"queued": 0, "dirty_keys": 0}
    text = run(*cache, "status")
    assert text.returncode == 0 and "reachable from 1 of 1 nodes" in text.stdout and server.address in text.stdout

    # ls pages through object storage's keys, showing the tier that holds each.
    first = run(*cache, "ls", "data/", "--limit", "3")
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert [line.split()[-1] for line in lines] == ["data/k0", "data/k1", "data/k2"]
    assert all(" l1 " in line for line in lines) and "100 B" in lines[0]
    assert "--start-after data/k2" in first.stderr
    rest = json.loads(run(*cache, "ls", "data/", "--start-after", "data/k2", "--json").stdout)
    assert [e["key"] for e in rest["entries"]] == ["data/k3", "data/k4"] and rest["next_start_after"] is None

    # evict: the key leaves the cache, object storage keeps it; a second evict finds nothing.
    assert run(*cache, "evict", "data/k0").returncode == 0
    again = run(*cache, "evict", "data/k0")
    assert again.returncode == 1 and "not cached" in one_line_error(again)
    assert json.loads(run(*cache, "ls", "data/k0", "--json").stdout)["entries"][0]["tier"] is None
    by_prefix = json.loads(run(*cache, "evict", "--prefix", "data/", "--json").stdout)
    assert sorted(by_prefix["evicted"]) == ["data/k1", "data/k2", "data/k3", "data/k4"]
    assert by_prefix["scanned"] == 5 and client.contains("other/x", cached_only=True)
    assert client.get("data/k3") == bytes(400)  # filled back from object storage
    # ls --cached: what the cache tiers hold, not object storage.
    cached = json.loads(run(*cache, "ls", "--cached", "--json").stdout)["entries"]
    assert [(e["key"], e["size"], e["tier"]) for e in cached] == [("data/k3", 400, "l1"), ("other/x", 1, "l1")]
    usage = run(*cache, "evict")
    assert usage.returncode == 2 and "KEY or --prefix" in one_line_error(usage)
    # warm names a bucket the server does not cache instead of warming its own.
    other = run(*cache, "warm", "s3://otherbucket/data/", "--no-progress")
    assert other.returncode == 2 and "bucket 'otherbucket' is not the one" in one_line_error(other)

    # top: rates over one interval while a reader runs.
    stop = threading.Event()

    def reader() -> None:
        reading = server.client()
        while not stop.is_set():
            reading.get_many(["data/k3", "other/x"])

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        top = run(*cache, "top", "--once", "--interval", "1", "--json")
        text_top = run(*cache, "top", "--iterations", "2", "--interval", "0.3")
    finally:
        stop.set()
        thread.join()
    assert top.returncode == 0, top.stderr
    (row,) = json.loads(top.stdout)["nodes"]
    assert row["requests_per_second"] > 5 and row["gets_per_second"] > 10 and row["hit_ratio"] > 0.9
    assert row["mean_latency_ms"] > 0 and row["bytes_out_per_second"] > 0
    assert text_top.returncode == 0 and text_top.stdout.count("req/s") == 2 and server.address in text_top.stdout


def test_ls_lists_the_keys_of_a_server_without_object_storage(cache_server: Any, tmp_path: Path) -> None:
    # KV blocks and the like in L1 and L2, no S3: ls lists what the server holds, each key once.
    server = cache_server("--l1-bytes", "128KiB", "--l2-path", str(tmp_path / "l2"), "--l2-bytes", "16MiB")
    cache = ("--cache", server.address)
    server.client().put_many({f"kv/block-{i:02d}": bytes(5000 + i) for i in range(1, 40)})
    put = subprocess.run([*CACHECTL, *cache, "put", "kv/block-00"], input=bytes(5000), capture_output=True, timeout=60)
    assert put.returncode == 0, put.stderr
    listed = run(*cache, "ls", "kv/", "--limit", "30", "--json")
    assert listed.returncode == 0, listed.stderr
    page = json.loads(listed.stdout)
    assert [(e["key"], e["size"]) for e in page["entries"]] == [(f"kv/block-{i:02d}", 5000 + i) for i in range(30)]
    assert {e["tier"] for e in page["entries"]} == {"l1", "l2"}  # some were demoted to L2
    assert page["next_start_after"] == "kv/block-29"
    rest = run(*cache, "ls", "kv/", "--start-after", "kv/block-29")
    assert rest.returncode == 0 and [line.split()[-1] for line in rest.stdout.splitlines()] == [
        f"kv/block-{i}" for i in range(30, 40)
    ]


def test_failures_are_one_line_with_their_exit_code(cache_server: Any) -> None:
    bad = run("--cache", "notanaddress", "get", "k")
    assert bad.returncode == 2 and "expected HOST:PORT" in one_line_error(bad)
    nowhere = f"127.0.0.1:{free_port()}"
    down = run("--cache", nowhere, "--timeout", "2", "stats")
    assert down.returncode == 3 and "unavailable" in one_line_error(down)
    no_shard = run("--meta", nowhere, "leader", "--wait", "1")
    assert no_shard.returncode == 3 and f"no metadata node answered at {nowhere}" in one_line_error(no_shard)
    status_down = run("--cache", nowhere, "--timeout", "2", "status")
    assert status_down.returncode == 3 and "Traceback" not in status_down.stderr
    assert f"cache node {nowhere} does not answer" in status_down.stderr

    server = cache_server("--l1-bytes", "16MiB", env={"CACHESVC_SECURITY_TOKEN": "s3cret"})
    refused = run("--cache", server.address, "get", "k")
    assert refused.returncode == 5 and "CACHECTL_TOKEN" in one_line_error(refused)
    allowed = run("--cache", server.address, "get", "k", env={"CACHECTL_TOKEN": "s3cret"})
    assert allowed.returncode == 1 and "not found" in one_line_error(allowed)
    no_prefix = run("--cache", server.address, "ls", "x/", env={"CACHECTL_TOKEN": "s3cret"})
    assert no_prefix.returncode == 0 and no_prefix.stdout == "", no_prefix.stderr

    help_text = run("--help").stdout
    assert DEFAULT_CACHE in help_text and "exit status:" in help_text
    for code, meaning in EXIT_CODES.items():
        assert f"  {code}  {meaning}" in help_text


def test_status_and_nodes_see_the_whole_shard_from_one_address(cache_server: Any, tmp_path: Path) -> None:
    with LocalShard(3, tmp_path / "meta") as shard:
        shard.start()
        meta = ",".join(shard.addresses)
        server = cache_server("--l1-bytes", "16MiB", "--meta", meta)
        one = shard.addresses[0]
        wait_until(
            lambda: (
                run("--meta", one, "nodes", "--json").returncode == 0
                and [n["state"] for n in json.loads(run("--meta", one, "nodes", "--json").stdout)["cache_nodes"]]
                == ["up"]
            ),
            30,
            "the cache server to be up in the shard",
        )
        nodes = json.loads(run("--meta", one, "nodes", "--shard", "--json").stdout)
        assert sorted(m["address"] for m in nodes["meta_nodes"]) == sorted(shard.addresses)
        assert sum(m["role"] == "leader" for m in nodes["meta_nodes"]) == 1

        status = run("--meta", one, "status", "--json")
        assert status.returncode == 0, status.stderr
        doc = json.loads(status.stdout)
        assert doc["leader"]["address"] in shard.addresses and len(doc["meta_nodes"]) == 3
        assert [(n["address"], n["state"], n["slot_share"]) for n in doc["nodes"]] == [(server.address, "up", 1.0)]
        text = run("--meta", one, "status").stdout
        assert "leader" in text and "3 of 3 metadata nodes answer" in text and "1 up" in text

        unknown = run("--meta", one, "drain", "127.0.0.1:1")
        assert unknown.returncode == 1 and "unknown node" in one_line_error(unknown)
        server.stop()
    gone = run("--meta", meta, "status")
    assert gone.returncode == 3 and f"no metadata node answered at {meta}" in gone.stderr


def test_tls_ca_reaches_a_tls_server_and_its_absence_is_one_line(cache_server: Any, tmp_path: Path) -> None:
    key, cert = self_signed_cert(tmp_path)
    server = cache_server("--l1-bytes", "16MiB", "--tls-cert", str(cert), "--tls-key", str(key))
    cache = ("--cache", server.address, "--timeout", "5")

    assert run(*cache, "--tls-ca", str(cert), "put", "secure", "--value", "over TLS").returncode == 0
    stats = run(*cache, "--tls-ca", str(cert), "stats", "--json")
    assert stats.returncode == 0, stats.stderr
    (l1,) = [t for t in json.loads(stats.stdout)["tiers"] if t["name"] == "l1"]
    assert l1["entries"] == 1 and l1["used_bytes"] >= len("over TLS")
    by_env = run(*cache, "get", "secure", env={"CACHECTL_TLS_CA": str(cert)})
    assert by_env.returncode == 0 and by_env.stdout == "over TLS"
    status = run(*cache, "status", "--json", env={"CACHECTL_TLS_CA": str(cert)})
    assert status.returncode == 0 and json.loads(status.stdout)["nodes"][0]["reachable"], status.stderr

    plaintext = run(*cache, "stats")
    assert plaintext.returncode == 3 and "pass --tls-ca" in one_line_error(plaintext)
    _, other = self_signed_cert(tmp_path, "other", common_name="other")
    wrong = run(*cache, "--tls-ca", str(other), "stats")
    assert wrong.returncode == 3 and "did this CA sign its certificate?" in one_line_error(wrong)
    missing = run(*cache, "--tls-ca", str(tmp_path / "nope.pem"), "stats")
    assert missing.returncode == 2 and "--tls-ca" in one_line_error(missing)
