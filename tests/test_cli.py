"""The commands as a user types them: `cachectl` against a server, `cachesvc up` end to end."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cacheclient import CacheClient, CacheClientError, InvalidRequestError
from cachesvc.devcluster import seaweed
from cachesvc.devcluster.procs import free_port, free_port_run, port_in_use
from cachesvc.devcluster.seaweed import PortTaken, SeaweedFS, SeaweedPorts

CACHECTL = [sys.executable, "-m", "cachesvc.commands.cachectl"]


def cachectl(server: Any, *args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [*CACHECTL, "--cache", server.address, *args],
        input=stdin,
        capture_output=True,
        timeout=60,
    )


def test_cachectl_put_get_rm_stats(cache_server: Any, tmp_path: Path) -> None:
    server = cache_server("--l1-bytes", "16MiB")
    payload = os.urandom(5000)
    (tmp_path / "in.bin").write_bytes(payload)
    assert cachectl(server, "put", "a/key", str(tmp_path / "in.bin")).returncode == 0
    out = cachectl(server, "get", "a/key")
    assert out.returncode == 0 and out.stdout == payload
    assert cachectl(server, "put", "hex:00ff", "-", stdin=b"from stdin").returncode == 0
    assert cachectl(server, "get", "hex:00ff").stdout == b"from stdin"
    assert server.client().get(b"\x00\xff") == b"from stdin"
    stats = cachectl(server, "stats", "--json")
    assert json.loads(stats.stdout)["counters"]["puts"] == 2
    assert b"l1" in cachectl(server, "stats").stdout
    assert cachectl(server, "rm", "a/key").returncode == 0
    missing = cachectl(server, "get", "a/key")
    assert missing.returncode == 1 and b"not found" in missing.stderr
    assert cachectl(server, "rm", "a/key").returncode == 1


def test_cachectl_errors_have_exit_codes(cache_server: Any) -> None:
    server = cache_server("--l1-bytes", "16MiB")
    bad = cachectl(server, "get", "hex:zz")
    assert bad.returncode == 2 and b"not a hex key" in bad.stderr
    too_long = cachectl(server, "put", "k" * 1025, "--value", "v")
    assert too_long.returncode == 2 and b"1..1024 bytes" in too_long.stderr
    down = subprocess.run(
        [*CACHECTL, "--cache", f"127.0.0.1:{free_port()}", "--timeout", "2", "get", "k"],
        capture_output=True,
        timeout=60,
    )
    assert down.returncode == 3 and b"unavailable" in down.stderr


def test_cachesvc_up_brings_up_a_working_cluster(tmp_path: Path) -> None:
    ports = SeaweedPorts.free()
    cache_port, meta_port, metrics_port = free_port(), free_port_run(3), free_port_run(4)
    args = [
        sys.executable, "-m", "cachesvc", "up", "--check", "--state-dir", str(tmp_path / "state"),
        "--cache-port", str(cache_port), "--s3-port", str(ports.s3), "--master-port", str(ports.master),
        "--volume-port", str(ports.volume), "--filer-port", str(ports.filer), "--meta-port", str(meta_port),
        "--metrics-port", str(metrics_port),
    ]  # fmt: skip
    result = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "round trip through cache and S3 ok" in result.stdout
    assert "cache server registered with the metadata shard" in result.stdout
    info = json.loads((tmp_path / "state" / "cluster.json").read_text())
    assert info["meta"] == [f"127.0.0.1:{meta_port + i}" for i in range(3)]
    assert info["cache"] == [f"127.0.0.1:{cache_port}"]
    assert info["s3_endpoint"] == f"http://127.0.0.1:{ports.s3}" and info["bucket"] == "cachesvc"
    assert info["access_key"] and info["secret_key"]
    # Every process served metrics at the address cluster.json gives (checked in its log: they are gone now).
    assert info["metrics"] == {
        "cache": [f"127.0.0.1:{metrics_port}"],
        "meta": [f"127.0.0.1:{metrics_port + 1 + i}" for i in range(3)],
    }
    assert f"metrics on http://127.0.0.1:{metrics_port}/metrics" in (tmp_path / "state/logs/cache.log").read_text()
    assert sorted(info["pids"]) == ["cache", "meta1", "meta2", "meta3", "s3"]
    assert "stopping 1 cache server (pid" in result.stdout and "stopping SeaweedFS" in result.stdout
    # No SeaweedFS socket is left in /tmp.
    weed_ports = {p for port in ports.all() for p in (port, port + 10000)}
    assert not [p for p in Path("/tmp").glob("seaweedfs-*.sock") if int(p.stem.rpartition("-")[2]) in weed_ports]
    # Everything it started is gone.
    for pid in info["pids"].values():
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_a_port_taken_before_seaweedfs_binds_it_is_found_again(tmp_path: Path, monkeypatch: Any) -> None:
    # Ports found free can be taken before SeaweedFS binds them (by any process's next outgoing
    # connection): it exits, and a fresh-clone CI run lost its S3 server and 164 tests so. The check
    # that runs before the start is skipped here, as the race skips it.
    taken = SeaweedPorts.free()
    monkeypatch.setattr(seaweed, "port_in_use", lambda port, *a, **k: False)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken.filer + 10000))  # the filer's gRPC port
        holder.listen()
        with pytest.raises(PortTaken, match="address already in use"):
            SeaweedFS(tmp_path / "alone", taken).start(timeout=60.0)
        picks = iter([taken])
        real_free = SeaweedPorts.free
        monkeypatch.setattr(SeaweedPorts, "free", classmethod(lambda cls: next(picks, None) or real_free()))
        weed = SeaweedFS.on_free_ports(tmp_path / "again", timeout=60.0)
        try:
            assert weed.ports != taken
            weed.create_bucket("after-a-taken-port")
        finally:
            weed.stop(grace=5.0)


def test_cachesvc_up_names_a_busy_port(tmp_path: Path, cache_server: Any) -> None:
    server = cache_server("--l1-bytes", "16MiB")
    up = [sys.executable, "-m", "cachesvc", "up", "--check", "--state-dir", str(tmp_path), "--meta-nodes", "0"]
    result = subprocess.run(
        [*up, "--cache-port", str(server.port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and f"cache port {server.port} is in use" in result.stderr


def test_cachesvc_meta_reads_its_config_file_and_environment(tmp_path: Path) -> None:
    from cacheclient.meta import MetaClient
    from cachesvc.devcluster.procs import ManagedProcess

    port = free_port()
    config = tmp_path / "meta.toml"
    config.write_text(f'id = 4\npeers = "4=127.0.0.1:{port}"\ntick_ms = 5\n')
    env = dict(os.environ, CACHESVC_META_NODE_DATA_DIR=str(tmp_path / "raft"), CACHESVC_META_NODE_ELECTION_TICKS="10")
    argv = [sys.executable, "-m", "cachesvc", "meta", "--config", str(config), "--lease-seconds", "3"]
    node = ManagedProcess("meta", argv, tmp_path / "meta.log", env=env)
    client = MetaClient(f"127.0.0.1:{port}", timeout=20.0)
    try:
        # A one-node shard elects itself: id and address from the file, data under the variable's directory.
        assert client.leader(timeout=20.0) == (4, f"127.0.0.1:{port}"), node.tail()
        assert any((tmp_path / "raft").iterdir())
        assert "'lease_seconds': 3.0" in node.tail() and "'election_ticks': 10" in node.tail()
    finally:
        client.close()
        assert node.stop(grace=10.0) == 0, node.tail()

    config.write_text(f'id = 4\npeers = "4=127.0.0.1:{port}"\nsnapshot_evry = 5\n')
    bad = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown config key snapshot_evry" in bad.stderr, bad.stderr
    env["CACHESVC_META_NODE_TICKMS"] = "5"
    config.write_text(f'id = 4\npeers = "4=127.0.0.1:{port}"\n')
    bad = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "CACHESVC_META_NODE_TICKMS" in bad.stderr, bad.stderr


def test_cachesvc_meta_refuses_the_cache_servers_token_instead_of_running_open(tmp_path: Path) -> None:
    """A user who read the security page sets CACHESVC_SECURITY_TOKEN for everything: the shard must not run open."""
    from cacheclient.meta import MetaClient
    from cachesvc.devcluster.procs import ManagedProcess

    port = free_port()
    argv = [
        sys.executable, "-m", "cachesvc", "meta", "--id", "1", "--peers", f"1=127.0.0.1:{port}",
        "--data-dir", str(tmp_path / "raft"),
    ]  # fmt: skip
    env = dict(os.environ, CACHESVC_SECURITY_TOKEN="cluster-secret")
    refused = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "CACHESVC_META_NODE_SECURITY_TOKEN" in refused.stderr and "PEER_TOKEN" in refused.stderr, refused.stderr
    assert not port_in_use(port)
    # Given its own token and the peer secret, it starts and requires the token.
    env.update(CACHESVC_META_NODE_SECURITY_TOKEN="cluster-secret", CACHESVC_META_NODE_SECURITY_PEER_TOKEN="peers-only")
    node = ManagedProcess("meta", argv, tmp_path / "meta.log", env=env)
    client = MetaClient(f"127.0.0.1:{port}", timeout=20.0, token="cluster-secret")
    anonymous = MetaClient(f"127.0.0.1:{port}", timeout=5.0)
    try:
        assert client.leader(timeout=20.0) == (1, f"127.0.0.1:{port}"), node.tail()
        with pytest.raises(CacheClientError, match="(?i)unauthenticated|token"):
            anonymous.placement(refresh=True)
    finally:
        client.close()
        anonymous.close()
        assert node.stop(grace=10.0) == 0, node.tail()


def test_json_logs_are_one_object_per_line_without_secrets(tmp_path: Path) -> None:
    from cachesvc.devcluster.procs import ManagedProcess, wait_for_port

    port = free_port()
    argv = [sys.executable, "-m", "cachesvc", "--log-format", "json", "serve", "--listen", f"127.0.0.1:{port}"]
    server = ManagedProcess("cache", [*argv, "--l1-bytes", "1MiB", "--token", "sekrit"], tmp_path / "cache.log")
    try:
        wait_for_port(port, timeout=30, proc=server.proc)
        # A failed call's error names its request id, and the server's line about it carries the same id.
        with CacheClient(f"127.0.0.1:{port}", token="sekrit", timeout=10) as client:
            with pytest.raises(InvalidRequestError) as failed:
                client.get("x" * 2000)
            client.put("fine", b"ok")
            with pytest.raises(InvalidRequestError) as failed_stream:
                client.put("y" * 2000, bytes(8 << 20))  # large: goes as a stream
    finally:
        assert server.stop(grace=10.0) == 0
    records = [json.loads(line) for line in (tmp_path / "cache.log").read_text().splitlines()]
    assert {"time", "level", "logger", "message"} <= set(records[0])
    messages = [r["message"] for r in records]
    assert any(f"serving on 127.0.0.1:{port}" in m for m in messages) and "stopped" in messages
    assert "sekrit" not in json.dumps(records) and "'token': '***'" in messages[0]
    for error, method in ((failed.value, "Get"), (failed_stream.value, "PutStream")):
        rid = error.request_id
        assert len(rid) == 16 and f"(request {rid})" in str(error)
        (line,) = [r for r in records if r.get("request_id") == rid]
        assert line["message"].startswith(f"{method} INVALID_ARGUMENT in ") and "1..1024 bytes" in line["message"]
    # Calls that succeed log nothing; lines outside a call carry no id.
    assert sum("request_id" in r for r in records) == 2
