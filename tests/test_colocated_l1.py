"""Co-located reads from a server's shared L1 (`l1.shared`, `cacheclient.colocated`): real server processes.

What a user of a client on the server's machine notices: reads answered
from the arena (the client's counts, the server's sweep of their hits), the
same bytes and misses as over gRPC, never a value the server would not serve
(overwritten, deleted, past its TTL, or held by a server that was killed and
restarted), and no arena without the token.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cacheclient import CacheClient, CacheClientError
from cacheclient.colocated import Colocated

from conftest import CacheServer, S3Server, router_of, running_cluster, s3_args, wait_until

pytestmark = pytest.mark.timeout(120)


SHARED = {"CACHESVC_L1_SHARED": "true"}


def mapped(client: CacheClient) -> CacheClient:
    """`client`, its server's arena mapped now (a client maps it in the background at its first read)."""
    transport = client.transport
    assert isinstance(transport, Colocated), transport
    assert transport.shared_l1(wait=True) is not None, "the arena was not mapped"
    return client


def counts(client: CacheClient) -> dict[str, int]:
    transport = client.transport
    assert isinstance(transport, Colocated), transport
    return dict(transport.counts)


def test_reads_come_from_the_arena_and_match_the_grpc_path(cache_server: Any) -> None:
    server: CacheServer = cache_server("--l1-bytes", "32MiB", env=SHARED)
    rng = random.Random(5)
    values = {f"k/{i:04d}".encode(): rng.randbytes(rng.choice([1, 100, 4096, 70_000])) for i in range(300)}
    with server.client(colocated=None) as client, server.client(colocated=False) as remote:
        mapped(client)
        client.put_many(values)
        keys = [*values, b"k/absent", b"k/also-absent"]
        rng.shuffle(keys)
        assert client.get_many(keys) == remote.get_many(keys)
        assert [client.get(k) for k in keys[:50]] == [values.get(k) for k in keys[:50]]
        got = counts(client)
        # Every stored value from the arena; the two misses asked the server.
        assert got["arena"] == 300 + sum(1 for k in keys[:50] if k in values), got
        # The server's policy hears of those reads (its sweep of the arena's hit counters).
        wait_until(lambda: remote.stats()["counters"].get("direct_hit_keys", 0) >= 300, 10.0, "the hits swept")


def test_a_cold_read_too_large_for_an_answer_is_copied_from_the_arena_not_streamed(
    cache_server: Any, s3: S3Server
) -> None:
    # A cold 12 MiB object: the Get fills it from object storage into L1 and answers "streamed"; a co-located
    # client copies it from the arena where the Get published it, instead of a GetStream through two gRPC ends.
    server: CacheServer = cache_server("--l1-bytes", "16MiB", *s3_args(s3, "cold-arena/"), env=SHARED)
    rng = random.Random(9)
    value, larger = rng.randbytes(12 << 20), rng.randbytes(20 << 20)
    s3.client().put_object(Bucket=s3.bucket, Key="cold-arena/big", Body=value)
    s3.client().put_object(Bucket=s3.bucket, Key="cold-arena/larger-than-l1", Body=larger)
    with server.client(colocated=None) as client, server.client(colocated=False) as remote:
        mapped(client)
        before = remote.stats()["counters"]
        assert client.get(b"big") == value
        after = remote.stats()["counters"]
        assert after.get("fills", 0) - before.get("fills", 0) == 1  # it was cold: read through from S3
        assert counts(client)["arena_after_get"] == 1, counts(client)
        assert remote.get(b"big") == value  # the gRPC path: the same bytes
        # A value L1 cannot hold is not in the arena: streamed as before.
        assert client.get(b"larger-than-l1") == larger
        assert counts(client)["arena_after_get"] == 1, counts(client)


def test_a_cold_get_many_copies_its_large_values_from_the_arena_and_streams_the_rest(
    cache_server: Any, s3: S3Server
) -> None:
    # GetMany as Get: cold values too large for the answer are copied from the arena where the read published
    # them; a value L1 cannot hold streams; small ones come in the answer; a missing key is None.
    server: CacheServer = cache_server("--l1-bytes", "32MiB", *s3_args(s3, "cold-many/"), env=SHARED)
    rng = random.Random(10)
    objects = {"a": rng.randbytes(6 << 20), "b": rng.randbytes(5 << 20), "small": rng.randbytes(1000)}
    objects["larger-than-l1"] = rng.randbytes(40 << 20)
    for name, body in objects.items():
        s3.client().put_object(Bucket=s3.bucket, Key="cold-many/" + name, Body=body)
    keys = [b"a", b"small", b"absent", b"larger-than-l1", b"b"]
    want = [objects.get(k.decode()) for k in keys]
    with server.client(colocated=None) as client, server.client(colocated=False) as remote:
        mapped(client)
        before = remote.stats()["counters"]
        assert client.get_many(keys) == want
        after = remote.stats()["counters"]
        assert after.get("fills", 0) - before.get("fills", 0) == 4  # all cold: read through from S3
        assert counts(client)["arena_after_get"] == 2, counts(client)  # a and b; not the one L1 cannot hold
        assert remote.get_many(keys) == want  # the gRPC path: the same bytes


def test_overwrites_deletes_and_ttls_are_seen_at_once(cache_server: Any) -> None:
    server: CacheServer = cache_server("--l1-bytes", "16MiB", env=SHARED)
    with server.client(colocated=None) as client:
        mapped(client)
        client.put(b"a", b"one")
        assert client.get(b"a") == b"one"
        client.put(b"a", b"two")
        assert client.get(b"a") == b"two"
        client.delete(b"a")
        assert client.get(b"a") is None
        client.put(b"t", b"short-lived", ttl=1.0)
        assert client.get(b"t") == b"short-lived"
        arena_before = counts(client)["arena"]
        time.sleep(1.2)
        assert client.get(b"t") is None
        assert counts(client)["arena"] == arena_before  # past its TTL: the server was asked, and said no


def test_a_killed_and_restarted_server_is_not_read_from_its_old_arena(cache_server: Any, tmp_path: Path) -> None:
    server: CacheServer = cache_server(
        "--l1-bytes", "16MiB", "--l2-path", str(tmp_path / "l2"), "--l2-bytes", "64MiB", env=SHARED
    )
    with server.client(colocated=None) as client:
        mapped(client)
        client.put(b"k", b"before the kill")
        assert client.get(b"k") == b"before the kill"
        assert counts(client)["arena"] == 1
        server.kill()
        server.start()  # same port and L2; a new arena
        client.put(b"k", b"after the restart")
        assert client.get(b"k") == b"after the restart"
        wait_until(lambda: client.get(b"k") == b"after the restart" and counts(client)["arena"] >= 2, 10.0,
                   "reads from the new arena")  # fmt: skip


def test_no_arena_without_the_token(cache_server: Any) -> None:
    server: CacheServer = cache_server("--l1-bytes", "16MiB", env={**SHARED, "CACHESVC_SECURITY_TOKEN": "s3cret"})
    with server.client(token="s3cret", colocated=None) as writer:
        mapped(writer)
        writer.put(b"k", b"v")
        assert writer.get(b"k") == b"v"
        assert counts(writer)["arena"] == 1
    socket_path = CacheClient(server.address, token="s3cret").info()["arena_socket"]
    assert socket_path and oct(os.stat(socket_path).st_mode & 0o777) == "0o600"
    from cacheclient.colocated import SharedL1

    with pytest.raises(CacheClientError, match="token"):
        SharedL1(socket_path, "wrong")
    with pytest.raises(CacheClientError, match="token"):
        SharedL1(socket_path, None)


def test_a_server_without_a_shared_l1_is_read_over_grpc(cache_server: Any) -> None:
    server: CacheServer = cache_server("--l1-bytes", "16MiB", env={"CACHESVC_L1_SHARED": "false"})
    with server.client(colocated=None) as client:
        client.put(b"k", b"v")
        assert client.get(b"k") == b"v"
        assert counts(client) == {"asked": 1}
    with server.client(colocated=True) as strict, pytest.raises(CacheClientError, match="l1.shared"):
        strict.get(b"k")


def test_an_arena_due_after_its_client_closed_is_read_over_grpc_not_raised(cache_server: Any) -> None:
    # A client closed while its arena's mapping was under way: the mapping's Info call went on over the
    # closed channel and raised grpc's ValueError in the background thread (a CI run's warning). Now that
    # is a failed mapping like any other: reads go over gRPC (which reconnects).
    from cacheclient.colocated import NodeArena
    from cacheclient.node import NodeClient

    server: CacheServer = cache_server("--l1-bytes", "16MiB", env=SHARED)
    node = NodeClient(server.address, timeout=10.0)
    arena = NodeArena(node)
    stub = node._service()  # what the mapping thread took before the close
    node.close()
    node._service = lambda: stub  # type: ignore[method-assign]  # its call goes on on the closed channel
    assert arena.get(wait=True) is None
    with NodeClient(server.address, timeout=10.0) as open_node:
        mapped_arena = NodeArena(open_node)
        assert mapped_arena.get(wait=True) is not None  # the same server's arena maps while its client is open
        mapped_arena.close()


def test_forked_dataloader_style_children_read_the_arena(cache_server: Any) -> None:
    server: CacheServer = cache_server("--l1-bytes", "16MiB", env=SHARED)
    with server.client(colocated=None) as client:
        mapped(client)
        client.put_many({b"f/%d" % i: b"value %d" % i for i in range(20)})
        assert client.get(b"f/0") == b"value 0"  # maps the arena in the parent
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child reads through the mapping it inherited, never over the parent's channel
            try:
                l1 = client.transport.shared_l1()  # type: ignore[attr-defined]
                ok = l1 is not None and all(l1.get(b"f/%d" % i) == b"value %d" % i for i in range(20))
                os.write(write, b"1" if ok else b"0")
            finally:
                os._exit(0)
        os.close(write)
        assert os.read(read, 1) == b"1"
        os.waitpid(pid, 0)


def test_a_fork_waits_for_the_arena_mapping_under_way(cache_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # A DataLoader forks its workers just after the dataset's first call, which starts the arena's mapping
    # in the background: a child forked while that thread is inside its Info call can hang (a CI run's
    # shard test did). The fork waits for it, and the children get the arena mapped.
    from cacheclient.colocated import NodeArena

    server: CacheServer = cache_server("--l1-bytes", "16MiB", env=SHARED)
    under_way = threading.Event()
    real_map = NodeArena._map

    def slow_map(self: NodeArena) -> Any:
        under_way.set()
        time.sleep(0.5)  # a loaded machine's slow Info call
        return real_map(self)

    monkeypatch.setattr(NodeArena, "_map", slow_map)
    with server.client(colocated=None) as client:
        client.put(b"w/0", b"value 0")
        assert client.get(b"w/0") == b"value 0"  # over gRPC: the mapping has just begun
        assert under_way.wait(10.0)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                l1 = client.transport.shared_l1()  # type: ignore[attr-defined]
                os.write(write, b"1" if l1 is not None and l1.get(b"w/0") == b"value 0" else b"0")
            finally:
                os._exit(0)
        mapping = [t for t in threading.enumerate() if t.name == "cacheclient-arena"]
        os.close(write)
        assert os.read(read, 1) == b"1", "the child did not inherit the mapped arena"
        os.waitpid(pid, 0)
        assert mapping == [], "the fork did not wait for the mapping under way"


def test_an_open_plan_follows_reads_from_the_arena(cache_server: Any) -> None:
    # The prefetcher moves a plan's cursor by the reads it sees; co-located reads never reach the server,
    # so the server's sweep of the arena's hit counters must tell it.
    server: CacheServer = cache_server("--l1-bytes", "16MiB", env=SHARED)
    keys = [b"p/%03d" % i for i in range(50)]
    with server.client(colocated=None) as client:
        mapped(client)
        client.put_many({k: k * 40 for k in keys})
        plan = client.prefetch(keys, window_bytes=1 << 20, sizes=[len(k) * 40 for k in keys])
        try:
            assert client.get_many(keys) == [k * 40 for k in keys]
            assert counts(client)["arena"] == len(keys)
            wait_until(lambda: plan.progress["consumed"] == len(keys), 10.0, "the plan's cursor past every read")
        finally:
            plan.close()


def test_kv_blocks_come_from_the_arena_and_their_leases_end(cache_server: Any, tmp_path: Path) -> None:
    from test_kv import BLOCK, LAYOUT, _kv_config, _random_kv, _same, _tokens

    from cacheclient.kv import KVCache

    server: CacheServer = cache_server("--l1-bytes", "64MiB", "--config", _kv_config(tmp_path), env=SHARED)
    with server.client(colocated=None) as client, server.client() as remote:
        mapped(client)
        kv = KVCache(client, "model-a", BLOCK, layout=LAYOUT, lease=60.0)
        ids, tensors = _tokens(5 * BLOCK), _random_kv(5 * BLOCK)
        assert kv.put(ids, tensors) == 5 * BLOCK
        before = remote.stats()["counters"].get("leases_released", 0)
        n, got = kv.fetch(ids)  # release on read, the default
        assert n == 5 * BLOCK and _same(got, tensors, n)
        assert counts(client)["arena"] == 5
        after = remote.stats()["counters"]["leases_released"]
        assert after - before == 5, "the blocks read from the arena kept their leases"
        # The same bytes as over gRPC, block by block.
        keys = kv.block_keys(ids)
        assert client.get_many(keys) == remote.get_many(keys)


@pytest.mark.parametrize("copy_path", ["memcpy", "torch"])
def test_kv_blocks_whose_arena_check_fails_are_read_again(
    cache_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, copy_path: str
) -> None:
    # A lost race (simulated: every lent view's check after the copy fails) reads the block again, over
    # gRPC, and the read still returns every block, right.
    from test_kv import BLOCK, LAYOUT, _kv_config, _random_kv, _same, _tokens

    import cacheclient.kv as kv_module
    from cacheclient.kv import KVCache
    from cacheclient.wire.arena import ArenaView

    monkeypatch.setattr(kv_module, "_MEMCPY_RUN_BYTES", 0 if copy_path == "memcpy" else 1 << 40)
    server: CacheServer = cache_server("--l1-bytes", "64MiB", "--config", _kv_config(tmp_path), env=SHARED)
    with server.client(colocated=None) as client:
        transport = mapped(client).transport
        assert isinstance(transport, Colocated)
        kv = KVCache(client, "model-a", BLOCK, layout=LAYOUT, release_on_read=False)
        ids, tensors = _tokens(4 * BLOCK), _random_kv(4 * BLOCK)
        assert kv.put(ids, tensors) == 4 * BLOCK
        assert _same(kv.get(ids, 4 * BLOCK - 7), tensors, 4 * BLOCK - 7)
        lend = ArenaView.lend

        def lost(view: ArenaView, key: bytes) -> Any:
            lent = lend(view, key)
            return (lent[0], lambda: False) if isinstance(lent, tuple) else lent

        monkeypatch.setattr(ArenaView, "lend", lost)
        before = dict(transport.counts)
        assert _same(kv.get(ids, 4 * BLOCK - 7), tensors, 4 * BLOCK - 7)
        assert transport.counts["lent_lost"] - before.get("lent_lost", 0) == 4


@pytest.mark.parametrize("copy_path", ["memcpy", "torch"])
def test_kv_blocks_read_from_the_arena_while_they_are_overwritten_are_never_mixed(
    cache_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, copy_path: str
) -> None:
    # KV blocks are copied once, straight out of the arena, and checked after the copy: a block the server
    # rewrote meanwhile (its bytes freed and reused) is read again, never returned half old, half new.
    # A stress test of the whole path; the check itself is held to it in test_arena (a view whose bytes
    # were reused), as the window here is too narrow to be hit on every run.
    import threading

    import torch
    from test_kv import BLOCK, LAYOUT, _kv_config, _random_kv, _tokens

    import cacheclient.kv as kv_module
    from cacheclient.kv import KVCache

    # Both ways a block is copied into the result (see test_kv's copy_path): a memcpy per run, or one torch copy.
    monkeypatch.setattr(kv_module, "_MEMCPY_RUN_BYTES", 0 if copy_path == "memcpy" else 1 << 40)
    server: CacheServer = cache_server("--l1-bytes", "8MiB", "--config", _kv_config(tmp_path), env=SHARED)
    blocks = 6
    ids = _tokens(blocks * BLOCK)
    versions = [_random_kv(blocks * BLOCK, seed=seed) for seed in (1, 2)]
    with server.client(colocated=None) as client, server.client() as remote:
        mapped(client)
        kv = KVCache(client, "model-a", BLOCK, layout=LAYOUT, release_on_read=False)
        keys = kv.block_keys(ids)
        raw = []
        for tensors in versions:  # each version's block values, as the cache stores them
            for key in keys:
                remote.delete(key)
            assert kv.put(ids, tensors) == blocks * BLOCK
            raw.append(remote.get_many(keys))
        stop = threading.Event()

        def rewrite() -> None:
            n = 0
            while not stop.is_set():
                remote.put_many(list(zip(keys, raw[n % 2], strict=True)))
                n += 1

        writer = threading.Thread(target=rewrite)
        writer.start()
        try:
            mixed = reads = 0
            while reads < 300:
                n, got = kv.fetch(ids)
                if n == 0:
                    continue
                reads += 1
                assert got is not None
                for b in range(n // BLOCK):
                    part = slice(b * BLOCK, (b + 1) * BLOCK)
                    if not any(
                        all(
                            torch.equal(k[:, :, part], wk[:, :, part]) and torch.equal(v[:, :, part], wv[:, :, part])
                            for (k, v), (wk, wv) in zip(got, version, strict=True)
                        )
                        for version in versions
                    ):
                        mixed += 1
        finally:
            stop.set()
            writer.join(30)
        assert mixed == 0, f"{mixed} blocks mixed two versions"
        assert counts(client)["arena"] > 0


def test_parameters_stream_from_the_arena_bit_identical_and_a_lost_race_is_read_again(
    cache_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # stream_parameters copies each module's value once, out of the arena into its buffer, and checks the
    # seqlock after the copy. A lost race (simulated: every check fails) reads the module's values again.
    import torch
    from test_prefetch_models import NEW_TOKENS, build_llama

    from cacheclient.prefetch import save_model, stream_parameters
    from cacheclient.wire.arena import ArenaView

    server: CacheServer = cache_server("--l1-bytes", "256MiB", env=SHARED)
    reference = build_llama()
    ids = torch.tensor([random.Random(5).choices(range(3, 512), k=24)])
    with torch.inference_mode():
        want = reference.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    with server.client(colocated=None) as client:
        transport = mapped(client).transport
        assert isinstance(transport, Colocated)
        manifest = save_model(reference, client, "llama")
        lend = ArenaView.lend
        for losing in (False, True):
            if losing:

                def lost(view: ArenaView, key: bytes) -> Any:
                    lent = lend(view, key)
                    return (lent[0], lambda: False) if isinstance(lent, tuple) else lent

                monkeypatch.setattr(ArenaView, "lend", lost)
            before = dict(transport.counts)
            model = build_llama(meta=True)
            with (
                stream_parameters(model, client, "llama", budget_bytes=manifest.nbytes // 4),
                torch.inference_mode(),
            ):
                got = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
            assert torch.equal(got, want), f"streamed output differs (losing races: {losing})"
            arena = transport.counts["arena"] - before.get("arena", 0)
            lost_races = transport.counts["lent_lost"] - before.get("lent_lost", 0)
            assert arena > 0 and transport.counts["asked"] == before.get("asked", 0)
            assert (lost_races > 0) == losing, (losing, lost_races)


def test_a_routing_client_reads_each_owner_s_arena_and_follows_a_drain(s3: S3Server, tmp_path: Path) -> None:
    # Three nodes on this machine: a routing client reads every key from its owner's shared L1. A node is
    # drained and its keys rewritten through their new owners: no read returns a value from before.
    with running_cluster(s3, tmp_path, "", [("16MiB", "32MiB")] * 3, meta_nodes=1) as cluster:
        values = {b"r/%03d" % i: b"v1 %d" % i for i in range(200)}
        with cluster.client() as client:
            client.put_many(values)
            router = router_of(client)

            def a_pass_from_the_arenas() -> bool:  # each node's arena is mapped in the background
                before = router.counters["arena"]
                return client.get_many(list(values)) == list(values.values()) and (
                    router.counters["arena"] - before == len(values)
                )

            wait_until(a_pass_from_the_arenas, 10.0, "every read from its owner's shared L1")
            drained = cluster.servers[0]
            mine = [k for k in values if cluster.placement().locate(k) == drained.address]
            argv = [sys.executable, "-m", "cachesvc.commands.cachectl", "--meta", ",".join(cluster.shard.addresses)]
            done = subprocess.run([*argv, "drain", drained.address], capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            cluster.wait_placement([s.address for s in cluster.servers[1:]], "the drain")
            newer = {k: b"v2 %s" % k for k in mine}
            client.put_many(newer)
            got = client.get_many(list(values))
            assert got == [newer.get(k, v) for k, v in values.items()]


def test_a_killed_servers_socket_is_removed_by_the_next_server(cache_server: Any, tmp_path: Path) -> None:
    """A server SIGKILLed leaves its socket file; the next one to start in the same directory removes it, and
    keeps those a process still listens on (without the sweep, one file per restart piles up)."""
    import socket

    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    env = {**SHARED, "XDG_RUNTIME_DIR": str(run)}
    first: CacheServer = cache_server("--l1-bytes", "16MiB", env=env)
    with first.client() as client:
        killed = Path(client.info()["arena_socket"])
    assert killed.parent == run and killed.exists()
    first.kill()
    assert killed.exists(), "a SIGKILLed server cannot remove its socket"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listening:
        live = run / "l1-listening.sock"
        listening.bind(str(live))
        listening.listen(1)
        second: CacheServer = cache_server("--l1-bytes", "16MiB", env=env)
        with second.client(colocated=None) as client:
            mapped(client)
            client.put(b"k", b"v")
            assert client.get(b"k") == b"v"
            assert counts(client)["arena"] == 1
            kept = Path(client.info()["arena_socket"])
        assert sorted(run.iterdir()) == sorted([kept, live]), "the killed server's socket is still there"
