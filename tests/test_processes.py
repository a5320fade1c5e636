"""`cachesvc serve --processes N`: N engine processes, each a cluster node with a slice of the budgets."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cacheclient import CacheClient
from cacheclient.meta import MetaClient
from cacheclient.torch import CachedDataset
from cachesvc.devcluster.procs import child_pids, free_port, listen_port, wait_for_port
from cachesvc.devcluster.shard import LocalShard
from cachesvc.tiers import LMDBTier

from conftest import CacheServer, S3Server, router_of, s3_args, wait_until

pytestmark = pytest.mark.timeout(150)


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def test_two_processes_share_the_keys_the_budgets_and_survive_a_crash(s3: S3Server, tmp_path: Path) -> None:
    shard = LocalShard(1, tmp_path / "meta", args=["--lease-seconds", "10"])
    shard.start()
    shard.leader(timeout=20.0)
    prefix = "procs/" + os.urandom(4).hex() + "/"
    args = [
        "--processes", "2",
        "--l1-bytes", "16MiB",
        "--l2-path", str(tmp_path / "l2"),
        "--l2-bytes", "64MiB",
        "--meta", ",".join(shard.addresses),
        *s3_args(s3, prefix),
    ]  # fmt: skip
    server = CacheServer(args, tmp_path / "logs", {"CACHESVC_META_HEARTBEAT_SECONDS": "0.3"}, ports=2)
    addresses = [server.address, f"127.0.0.1:{server.port + 1}"]
    meta = ",".join(shard.addresses)
    shard_client = MetaClient(shard.addresses, timeout=5.0)
    try:
        server.start()
        wait_for_port(server.port + 1, timeout=30.0)
        assert server.process is not None
        supervisor = server.process.pid
        wait_until(
            lambda: sorted(shard_client.placement(refresh=True).nodes) == sorted(addresses),
            30.0,
            "both engine processes in the placement",
            interval=0.1,
        )
        # `cachectl nodes` lists them as nodes of one machine, with about half of the slots each.
        listed = subprocess.run(
            [sys.executable, "-m", "cachesvc.commands.cachectl", "--meta", meta, "nodes", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        nodes = json.loads(listed.stdout)["cache_nodes"]
        assert sorted((n["machine"], n["address"]) for n in nodes) == [("127.0.0.1", a) for a in sorted(addresses)]
        assert all(0.4 < n["slot_share"] < 0.6 for n in nodes), nodes
        # Each process has half of each budget, and its own L2 directory.
        for i, address in enumerate(addresses):
            with CacheClient(address) as one:
                tiers = {t["name"]: t for t in one.stats()["tiers"]}
            assert tiers["l1"]["capacity_bytes"] == 8 << 20
            probe = LMDBTier(tmp_path / "probe", 32 << 20)
            assert tiers["l2"]["capacity_bytes"] == probe.capacity_bytes
            probe.close()
            assert (tmp_path / "l2" / f"p{i}").is_dir()

        rng = random.Random(5)
        samples = {f"s/{i:04d}": rng.randbytes(rng.randrange(100, 4000)) for i in range(200)}
        s3_client = s3.client()
        for name, body in samples.items():
            s3_client.put_object(Bucket=s3.bucket, Key=prefix + name, Body=body)
        with CacheClient(meta=meta, timeout=20.0) as client:
            assert client.get_many(list(samples)) == list(samples.values())
            placement = shard_client.placement(refresh=True)
            owned = {a: sum(placement.locate(k) == a for k in samples) for a in addresses}
            # Each process filled exactly the keys it owns.
            for address in addresses:
                assert _hits(address)["l3"] == owned[address], (address, owned)
            assert min(owned.values()) > 40, owned

            # A co-located dataset reads every process's L2 file.
            dataset = CachedDataset(list(samples), cache=client, return_key=True, local_reads=True)
            assert dict(dataset[i] for i in range(len(samples))) == samples
            assert dataset.local_reads == len(samples)

            # SIGKILL of one engine process: the supervisor starts it again, and it serves its keys from L2.
            victim = next(p for p in child_pids(supervisor) if listen_port(p) == server.port + 1)
            os.kill(victim, signal.SIGKILL)
            # The supervisor takes it out of the placement at once, well within its 10 s lease ...
            wait_until(
                lambda: addresses[1] not in shard_client.placement(refresh=True).nodes,
                3.0,
                "the killed engine process to leave the placement",
                interval=0.05,
            )
            wait_until(
                lambda: any(p != victim and listen_port(p) == server.port + 1 for p in child_pids(supervisor)),
                20.0,
                "the supervisor to restart the killed engine process",
                interval=0.1,
            )
            wait_for_port(server.port + 1, timeout=30.0)
            # ... and its first heartbeat brings it back.
            wait_until(
                lambda: addresses[1] in shard_client.placement(refresh=True).nodes,
                20.0,
                "the restarted engine process to rejoin",
                interval=0.1,
            )
            assert client.get_many(list(samples)) == list(samples.values())
            assert _hits(addresses[1]) == {"l1": 0, "l2": owned[addresses[1]], "l3": 0}

        children = child_pids(supervisor)
        assert len(children) == 2
        assert server.stop(grace=60.0) == 0
        assert not any(_alive(p) for p in children)
    finally:
        if server.process is not None and server.process.alive():
            server.stop(grace=10.0)
        shard_client.close()
        shard.stop()


def test_each_process_shares_its_own_l1_and_co_located_clients_use_them_all(s3: S3Server, tmp_path: Path) -> None:
    # `--processes 2` with a shared L1 and one socket path configured: each process gets an arena and a
    # socket of its own, and a routing client on this machine writes and reads every key through its
    # owner process's (staging area, arena), none over gRPC.
    shard = LocalShard(1, tmp_path / "meta", args=["--lease-seconds", "10"])
    shard.start()
    shard.leader(timeout=20.0)
    socket_path = tmp_path / "l1.sock"
    args = [
        "--processes", "2", "--l1-bytes", "32MiB", "--meta", ",".join(shard.addresses),
        *s3_args(s3, "procs-shared/" + os.urandom(4).hex() + "/"),
    ]  # fmt: skip
    env = {
        "CACHESVC_META_HEARTBEAT_SECONDS": "0.3",
        "CACHESVC_L1_SHARED": "true",
        "CACHESVC_L1_SOCKET": str(socket_path),
    }
    server = CacheServer(args, tmp_path / "logs", env, ports=2)
    addresses = [server.address, f"127.0.0.1:{server.port + 1}"]
    shard_client = MetaClient(shard.addresses, timeout=5.0)
    try:
        server.start()
        wait_for_port(server.port + 1, timeout=30.0)
        wait_until(
            lambda: sorted(shard_client.placement(refresh=True).nodes) == sorted(addresses),
            30.0,
            "both engine processes in the placement",
            interval=0.1,
        )
        sockets = []
        for address in addresses:
            with CacheClient(address, colocated=False) as one:
                sockets.append(one.info()["arena_socket"])
        assert sorted(sockets) == [f"{socket_path}.p0", f"{socket_path}.p1"]
        values = {f"p/{i:03d}".encode(): os.urandom(500 + i) for i in range(200)}
        with CacheClient(meta=",".join(shard.addresses), timeout=20.0) as client:
            router = router_of(client)

            def a_pass_through_shared_memory() -> bool:  # the arenas are mapped in the background at first use
                staged, arena = router.counters["staged"], router.counters["arena"]
                client.put_many(values)
                got = client.get_many(list(values))
                assert got == list(values.values())
                return (router.counters["staged"] - staged, router.counters["arena"] - arena) == (200, 200)

            wait_until(a_pass_through_shared_memory, 20.0, "every put staged and every get from an arena")
        for address in addresses:
            with CacheClient(address, colocated=False) as one:
                assert one.stats()["counters"].get("staging_puts", 0) > 40, address  # its share of the keys
    finally:
        if server.process is not None and server.process.alive():
            server.stop(grace=10.0)
        shard_client.close()
        shard.stop()


def _hits(address: str) -> dict[str, int]:
    with CacheClient(address) as one:
        return {t["name"]: t["hits"] for t in one.stats()["tiers"]}


def test_many_processes_without_a_shard_is_a_config_error(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "cachesvc", "serve", "--listen", f"127.0.0.1:{port}", "--processes", "2"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "processes: 2 processes need a metadata shard (meta.addresses)" in done.stderr
