"""The local KV index (`KVIndex`, `KVCache(local_index=...)`) against real cache servers.

The server follows the keys it holds under its `kv_index_prefixes` and
answers them as digests through `KeyDigest`; the client keeps a set of them
and answers `KVCache.lookup` from it while it is fresh. What a user would
notice: the index claiming a block the server does not hold (a lookup that
promises more than a fetch finds), a wrong tensor after a block vanished
between lookup and fetch, a stale index that is used anyway, and an index
that keeps a restarted server's old keys.
"""

from __future__ import annotations

import gc
import hashlib
import importlib.util
import os
import random
import sys
import time
import traceback
import types
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from cacheclient import CacheClient
from cacheclient.errors import CacheClientError
from cacheclient.kv import KVCache, KVIndex, KVLayout
from cacheclient.wire import KEY_DIGEST_ENTRIES, cache_pb2, cache_pb2_grpc, key_digest
from cachesvc.engine.keyindex import KeyIndex
from cachesvc.server.service import digest_response

from conftest import wait_until

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "pd_disaggregation"

KV_CONFIG = """
kv_index_prefixes = ["kv/"]
kv_index_changes = {changes}

[[namespaces]]
prefix = "kv/"
write_mode = "cache-only"
"""

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=16, dtype="float32")
BLOCK = 64


def _config(tmp_path: Path, changes: int = 65536) -> str:
    path = tmp_path / f"kv-index-{changes}.toml"
    path.write_text(KV_CONFIG.format(changes=changes))
    return str(path)


def _random_kv(n_tokens: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    shape = (1, LAYOUT.kv_heads, n_tokens, LAYOUT.head_dim)
    return [(torch.randn(*shape, generator=generator), torch.randn(*shape, generator=generator)) for _ in range(2)]


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _claimed(index: KVIndex, keys: list[bytes]) -> set[bytes]:
    return {key for key in keys if index.contains(key_digest(key))}


def _held(client: CacheClient, keys: list[bytes]) -> set[bytes]:
    return {key for key, found in zip(keys, client.contains_many(keys, cached_only=True), strict=True) if found}


# -- the memoised chain hashes --------------------------------------------------


def _reference_hashes(cache: KVCache, tokens: list[int]) -> list[bytes]:
    """The chain hashes straight from the definition: blake2b(previous hash + block's int64 bytes)."""
    assert cache._root is not None
    data = array("q", tokens).tobytes()
    step = BLOCK * 8
    hashes, previous = [], cache._root
    for start in range(0, len(data) // step * step, step):
        previous = hashlib.blake2b(previous + data[start : start + step], digest_size=16).digest()
        hashes.append(previous)
    return hashes


def test_memoised_chain_hashes_equal_the_definition() -> None:
    """Prompts sharing prefixes, repeated, as lists and tensors, and a list changed in place: memos never lie."""
    rng = random.Random(8)
    cache = KVCache("127.0.0.1:1", "model-a", BLOCK, layout=LAYOUT)  # no call is made
    base = _tokens(6 * BLOCK, seed=8)
    prompts = [base, base[: 4 * BLOCK] + _tokens(2 * BLOCK + 7, seed=9), base + _tokens(BLOCK, seed=10), base[:100]]
    lists = [list(p) for p in prompts]
    for _ in range(300):
        i = rng.randrange(len(prompts))
        form = rng.choice(
            [
                lists[i],
                list(prompts[i]),
                torch.tensor(prompts[i]),
                torch.tensor([prompts[i]]),
                torch.tensor(prompts[i], dtype=torch.int32),
            ]
        )
        want = _reference_hashes(cache, prompts[i])
        assert cache.block_hashes(form) == want
        assert cache._chain(form).digests == [key_digest(cache._key(h)) for h in want]
        if rng.random() < 0.1:  # the same list object, changed in place
            j = rng.randrange(len(lists[i]))
            lists[i][j] = prompts[i][j] = prompts[i][j] + 1


# -- the sync protocol, in one process -------------------------------------------


class _InProcessServer:
    """KeyDigest answered by a `KeyIndex` in this process, with `between()` run before each answer.

    Changes can then land between the pages of a snapshot and between a
    snapshot and its changes, interleavings a real server gives only by luck.
    """

    address = "in-process"

    def __init__(self, index: KeyIndex, between: Callable[[], None]) -> None:
        self.index = index
        self.between = between
        self.calls = 0

    @property
    def cluster(self) -> Any:
        """A cluster of this one node, as `KVIndex` reads it (`CacheClient.cluster`)."""
        return types.SimpleNamespace(nodes=lambda timeout=None: {self.address: self})

    def rpc(self, method: str, request: Any, timeout: float | None) -> Any:
        assert method == "KeyDigest"
        self.calls += 1
        self.between()
        return digest_response(request, lambda *args: self.index.read(*args)())


def test_sync_protocol_matches_a_set_with_changes_between_pages_overflows_and_restarts() -> None:
    rng = random.Random(11)
    keys = [f"kv/{i}".encode() for i in range(300)]
    truth: set[bytes] = set()
    active = [False]

    def change(ops: int) -> None:
        for _ in range(ops):
            key = rng.choice(keys)
            if rng.random() < 0.55:
                server.index.admitted(key)
                truth.add(key)
            else:
                server.index.removed(key)
                truth.discard(key)

    def between() -> None:
        if active[0] and rng.random() < 0.3:
            change(rng.randint(1, 2))

    server = _InProcessServer(KeyIndex([b"kv/", b"other/"], capacity=64), between)
    index = KVIndex(server, "kv/", interval=3600.0, max_entries=5)  # type: ignore[arg-type]
    wait_until(lambda: index.counters["syncs"] == 1, 10.0, "the first sync")
    restarts = 0
    for step in range(150):
        roll = rng.random()
        if roll < 0.05:  # a restart: a new epoch, the same keys held (L2 kept them)
            restarted = KeyIndex([b"kv/", b"other/"], capacity=64)
            for key in truth:
                restarted.admitted(key)
            server.index = restarted
            restarts += 1
        elif roll < 0.15:  # more changes than the log keeps (it keeps 64 to 127)
            change(400)
        else:
            change(rng.randint(0, 10))
        active[0] = True
        index.sync()  # changes land between its answers
        active[0] = False
        index.sync()  # a quiet round: whatever the last one left must now be exact
        claimed = {key for key in keys if index.contains(key_digest(key))}
        assert claimed == truth, f"step {step}: {len(claimed - truth)} claimed, {len(truth - claimed)} missed"
    assert restarts > 0 and index.counters["snapshots"] > restarts + 1  # overflows took snapshots too
    index.close()


# -- the index follows the server exactly ---------------------------------------


def test_index_never_claims_more_than_the_server_holds(cache_server: Any, tmp_path: Path) -> None:
    """Seeded random puts, replacements, deletes, evictions, TTL expiries and evictions for room, L1 over L2.

    After each sync the index holds exactly what ContainsMany finds: never
    more (the property the fetch path relies on), and no less (it keeps up).
    Keys outside the followed prefix never enter it.
    """
    server = cache_server(
        "--l1-bytes", "1MiB", "--l2-path", str(tmp_path / "l2"), "--l2-bytes", "2MiB",
        "--config", _config(tmp_path),
    )  # fmt: skip
    client = server.client()
    index = KVIndex(client, "kv/", interval=3600.0, max_entries=7)  # small pages: snapshots span several
    rng = random.Random(16)
    keys = [f"kv/model/{i:04d}".encode() for i in range(120)]
    others = [f"other/{i}".encode() for i in range(10)]
    expiring = False
    for step in range(60):
        action = rng.random()
        chosen = rng.sample(keys, rng.randint(1, 12))
        if action < 0.5:  # puts of 16-128 KiB values: the tiers evict for room
            client.put_many([(k, rng.randbytes(rng.randint(16, 128) << 10)) for k in chosen])
        elif action < 0.65:
            for key in chosen:
                client.delete(key)
        elif action < 0.8:
            for key in chosen:
                client.evict(key)
        elif action < 0.9:
            client.put_many([(k, b"short-lived") for k in chosen], ttl=0.05)
            expiring = True
        else:
            client.put_many([(k, b"x") for k in others])
        if step % 3 == 0 or step == 59:
            if expiring:  # let the TTLs pass, so none ends between the sync and ContainsMany
                time.sleep(0.1)
                expiring = False
            index.sync()
            held = _held(client, keys)
            claimed = _claimed(index, keys)
            assert claimed <= held, f"step {step}: claims {len(claimed - held)} keys the server does not hold"
            assert claimed == held, f"step {step}: misses {len(held - claimed)} held keys"
            assert not _claimed(index, others)
            assert index.size == len(held)
    counters = client.stats()["counters"]
    assert counters.get("evictions_l2", 0) > 0, f"the workload never evicted from L2; it tests too little: {counters}"
    assert counters.get("ttl_expired", 0) > 0
    assert index.counters["snapshots"] == 1  # one snapshot at the start, only changes after it
    index.close()


def test_a_client_behind_the_change_log_gets_a_full_snapshot(cache_server: Any, tmp_path: Path) -> None:
    server = cache_server("--l1-bytes", "16MiB", "--config", _config(tmp_path, changes=4))
    client = server.client()
    index = KVIndex(client, "kv/", interval=3600.0, max_entries=3)
    client.put_many([(f"kv/a/{i}".encode(), b"v") for i in range(5)])
    index.sync()
    assert index.counters["snapshots"] == 1
    client.put_many([(f"kv/b/{i}".encode(), b"v") for i in range(3)])  # within the log: changes only
    index.sync()
    assert index.counters["snapshots"] == 1
    for i in range(20):  # more changes than the server remembers
        client.put(f"kv/c/{i}".encode(), b"v")
        client.delete(f"kv/a/{i % 5}".encode())
    index.sync()
    assert index.counters["snapshots"] == 2
    keys = [f"kv/{g}/{i}".encode() for g in "abc" for i in range(20)]
    assert _claimed(index, keys) == _held(client, keys)
    index.close()


def test_key_digest_checks_its_request(cache_server: Any, tmp_path: Path) -> None:
    server = cache_server("--l1-bytes", "16MiB", "--config", _config(tmp_path))
    with grpc.insecure_channel(server.address) as channel:
        stub = cache_pb2_grpc.CacheServiceStub(channel)
        for request, code, field in [
            (cache_pb2.KeyDigestRequest(), grpc.StatusCode.INVALID_ARGUMENT, "prefix"),
            (
                cache_pb2.KeyDigestRequest(prefix=b"kv/", max_entries=KEY_DIGEST_ENTRIES + 1),
                grpc.StatusCode.INVALID_ARGUMENT,
                "max_entries",
            ),
            (cache_pb2.KeyDigestRequest(prefix=b"ckpt/"), grpc.StatusCode.FAILED_PRECONDITION, "kv_index_prefixes"),
        ]:
            with pytest.raises(grpc.RpcError) as caught:
                stub.KeyDigest(request, timeout=10)
            assert caught.value.code() == code
            assert field in (caught.value.details() or "")
        answer = stub.KeyDigest(cache_pb2.KeyDigestRequest(prefix=b"kv/"), timeout=10)
        assert answer.full and answer.reset and answer.epoch != 0 and answer.added == b""


# -- lookups --------------------------------------------------------------------


def test_lookup_answers_from_a_fresh_index_and_round_trips_when_it_is_stale(cache_server: Any, tmp_path: Path) -> None:
    server = cache_server("--l1-bytes", "64MiB", "--config", _config(tmp_path))
    client = server.client()
    index = KVIndex(client, "kv/", interval=3600.0)  # syncs once on its own, then only when told
    kv = KVCache(client, "model-a", BLOCK, layout=LAYOUT, local_index=index, max_staleness=1.0)
    first, second = _tokens(4 * BLOCK + 10, seed=1), _tokens(3 * BLOCK, seed=2)
    kv.put(first, _random_kv(len(first)))
    index.sync()
    for ids in (first, torch.tensor(first), torch.tensor([first])):
        assert kv.lookup(ids) == 4 * BLOCK
    assert kv.lookup(second) == 0
    assert kv.counters == {"lookups_local": 4}

    index.sync()
    kv.put(second, _random_kv(len(second), seed=2))
    # The index has not heard of `second` yet: fresh, it answers from what it has ...
    assert kv.lookup(second) == 0
    assert kv.counters == {"lookups_local": 5}
    # ... and once it is older than max_staleness, lookups make the round trip.
    wait_until(lambda: index.staleness > 1.0, 10.0, "the index to turn stale")
    assert kv.lookup(second) == 3 * BLOCK
    assert kv.counters["lookups_remote"] == 1
    index.sync()
    assert kv.lookup(second) == 3 * BLOCK
    assert kv.counters == {"lookups_local": 6, "lookups_remote": 1}
    index.close()


def test_background_sync_keeps_the_index_fresh_and_a_dead_server_makes_it_stale(
    cache_server: Any, tmp_path: Path
) -> None:
    server = cache_server("--l1-bytes", "64MiB", "--config", _config(tmp_path))
    client = server.client(timeout=5.0)
    kv = KVCache(client, "model-a", BLOCK, layout=LAYOUT, local_index=True, max_staleness=0.5)
    assert kv.index is not None
    ids = _tokens(2 * BLOCK, seed=3)
    kv.put(ids, _random_kv(len(ids)))
    key = kv.block_keys(ids)[1]
    wait_until(lambda: kv.index.contains(key_digest(key)), 10.0, "the background sync to bring the new block")
    assert kv.lookup(ids) == 2 * BLOCK
    syncs = kv.index.counters["syncs"]
    wait_until(lambda: kv.index.counters["syncs"] >= syncs + 3, 10.0, "three more background syncs")
    assert kv.index.staleness < 0.5

    server.kill()
    wait_until(lambda: kv.index.staleness > 0.5, 20.0, "the index to turn stale with its server gone")
    assert kv.index.counters["failures"] > 0
    # (A loaded machine may have let the index turn stale before the kill too: count from here.)
    remote = kv.counters.get("lookups_remote", 0)
    with pytest.raises(CacheClientError):  # stale: the lookup asks the (dead) server instead of answering
        kv.lookup(ids)
    assert kv.counters["lookups_remote"] == remote + 1
    kv.close()


def test_server_restart_is_a_new_epoch_and_a_full_resync(cache_server: Any, tmp_path: Path) -> None:
    """Blocks kept in L2 across a restart are found again; blocks lost with L1 are not claimed."""
    server = cache_server(
        "--l1-bytes", "64MiB", "--l2-path", str(tmp_path / "l2"), "--l2-bytes", "64MiB",
        "--config", _config(tmp_path),
    )  # fmt: skip
    client = server.client(timeout=5.0)
    index = KVIndex(client, "kv/", interval=0.02)
    kv = KVCache(client, "model-a", BLOCK, layout=LAYOUT, local_index=index, max_staleness=1.0)
    ids = _tokens(4 * BLOCK, seed=4)
    kv.put(ids, _random_kv(len(ids)))
    keys = kv.block_keys(ids)
    wait_until(lambda: _claimed(index, keys) == set(keys), 10.0, "the index to hold the four blocks")
    assert index.counters["snapshots"] == 1

    assert server.stop() == 0  # a clean stop keeps L1's blocks in L2
    wait_until(lambda: index.counters["failures"] > 0, 10.0, "a sync to fail while the server is down")
    server.start()
    client.wait_ready(30.0)
    client.delete(keys[3])  # the resync may come before or after this delete
    wait_until(lambda: index.counters["snapshots"] == 2, 20.0, "a full resync after the restart")
    wait_until(lambda: _claimed(index, keys) == set(keys[:3]), 10.0, "the index to drop the deleted block")
    assert _held(client, keys) == set(keys[:3])
    assert index.staleness < 1.0
    assert kv.lookup(ids) == 3 * BLOCK
    index.close()


def test_routing_client_follows_every_node(cache_server: Any, tmp_path: Path) -> None:
    config = _config(tmp_path)
    servers = [cache_server("--l1-bytes", "64MiB", "--config", config) for _ in range(2)]
    client = CacheClient(nodes=[s.address for s in servers], timeout=10.0)
    index = KVIndex(client, "kv/", interval=3600.0)
    kv = KVCache(client, "model-a", BLOCK, layout=LAYOUT, local_index=index, max_staleness=60.0)
    prompts = [_tokens(6 * BLOCK, seed=10 + i) for i in range(4)]
    for i, ids in enumerate(prompts):
        kv.put(ids, _random_kv(len(ids), seed=i))
    index.sync()
    keys = [key for ids in prompts for key in kv.block_keys(ids)]
    on_each = [_held(server.client(), keys) for server in servers]
    assert all(on_each), "every node should hold some of the blocks"
    assert _claimed(index, keys) == set(keys)
    client.evict(keys[2])
    index.sync()
    assert kv.lookup(prompts[0]) == 2 * BLOCK
    assert [kv.lookup(ids) for ids in prompts[1:]] == [6 * BLOCK] * 3
    index.close()


def test_a_forked_child_syncs_its_own_index(cache_server: Any, tmp_path: Path) -> None:
    server = cache_server("--l1-bytes", "64MiB", "--config", _config(tmp_path))
    client = server.client()
    index = KVIndex(client, "kv/", interval=3600.0)
    kv = KVCache(client, "model-a", BLOCK, layout=LAYOUT, local_index=index, max_staleness=30.0)
    ids = _tokens(2 * BLOCK, seed=5)
    kv.put(ids, _random_kv(len(ids)))
    index.sync()
    other = _tokens(3 * BLOCK, seed=7)
    pid = os.fork()
    if pid == 0:  # child: its own channel, thread and sets, from the parent's objects
        code = 1
        try:
            kv.put(other, _random_kv(len(other)))
            index.sync()
            found = (kv.lookup(ids), kv.lookup(other))
            code = 0 if found == (2 * BLOCK, 3 * BLOCK) and kv.counters["lookups_local"] == 2 else 2
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert kv.lookup(ids) == 2 * BLOCK  # the parent's index goes on
    index.close()


def test_an_index_dropped_without_close_stops_its_thread(cache_server: Any, tmp_path: Path) -> None:
    server = cache_server("--l1-bytes", "16MiB", "--config", _config(tmp_path))
    index = KVIndex(server.client(), "kv/", interval=0.01)
    follower = index._local.peek()
    assert follower is not None and follower.thread is not None
    thread, state = follower.thread, follower  # the thread's state holds no reference to the index
    wait_until(lambda: state.syncs >= 2, 10.0, "two background syncs")
    del index, follower
    gc.collect()
    wait_until(lambda: not thread.is_alive(), 10.0, "the sync thread of a dropped index to end")


# -- a block gone between lookup and fetch ---------------------------------------


def _example_model() -> Any:
    sys.path.insert(0, str(EXAMPLE))
    spec = importlib.util.spec_from_file_location("pd_example_model", EXAMPLE / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_block_evicted_between_lookup_and_fetch_is_a_miss_and_decode_matches_one_process(
    cache_server: Any, tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    from transformers import DynamicCache

    from cacheclient.hf import cache_from_kv, kv_cache_for, kv_from_cache

    example = _example_model()
    threads = torch.get_num_threads()
    try:
        model = example.build_model(threads=1)
        server = cache_server("--l1-bytes", "256MiB", "--config", _config(tmp_path))
        client = server.client()
        prompt = example.random_prompt(1000, seed=21)
        ids = torch.tensor([prompt])
        n = ids.shape[1]
        new_tokens = 8
        with torch.no_grad():
            reference = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0, n:].tolist()

            prefill = kv_cache_for(model, client, example.FINGERPRINT, example.BLOCK_TOKENS, release_on_read=False)
            out = model(ids, cache=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
            assert prefill.put(ids, kv_from_cache(out.cache)) == 768

            # Syncs only when told: a background sync between the evict and the lookup below (a loaded
            # machine's) would drop the block from the index, and the lookup would not claim it.
            index = KVIndex(client, "kv/", interval=3600.0)
            decode = kv_cache_for(
                model, client, example.FINGERPRINT, example.BLOCK_TOKENS, local_index=index, max_staleness=60.0
            )
            assert decode.index is not None
            decode.index.sync()
            assert decode.lookup(ids) == 768
            # Evicted after the lookup: the index still claims it (no sync since) ...
            client.evict(decode.block_keys(ids)[1])
            assert decode.lookup(ids) == 768 and decode.counters["lookups_local"] == 2
            # ... the fetch misses there, and the worker computes the rest.
            loaded, pairs = decode.fetch(ids, max_tokens=n - 1)
            assert loaded == 256
            cache = cache_from_kv(pairs, model.config)
            got = model.generate(ids, cache=cache, max_new_tokens=new_tokens, do_sample=False)[0, n:].tolist()
        assert got == reference
        decode.index.sync()
        assert decode.lookup(ids) == 256
        decode.close()
        index.close()
    finally:
        torch.set_num_threads(threads)


def test_unconfigured_prefix_falls_back_to_round_trips(cache_server: Any, tmp_path: Path) -> None:
    path = tmp_path / "none.toml"
    path.write_text('kv_index_prefixes = []\n[[namespaces]]\nprefix = "kv/"\nwrite_mode = "cache-only"\n')
    server = cache_server("--l1-bytes", "64MiB", "--config", str(path))
    client = server.client()
    index = KVIndex(client, "kv/", interval=3600.0)
    kv = KVCache(client, "model-a", BLOCK, layout=LAYOUT, local_index=index)
    ids = _tokens(2 * BLOCK, seed=6)
    kv.put(ids, _random_kv(len(ids)))
    with pytest.raises(CacheClientError, match="kv_index_prefixes"):
        index.sync()
    assert index.staleness == float("inf")
    assert kv.lookup(ids) == 2 * BLOCK
    assert kv.counters == {"lookups_remote": 1}
    index.close()


def test_an_idle_index_backs_off_and_a_change_or_a_lookup_brings_the_pace_back(
    cache_server: Any, tmp_path: Path
) -> None:
    server = cache_server("--l1-bytes", "64MiB", "--config", _config(tmp_path))
    client = server.client(timeout=5.0)
    index = KVIndex(client, "kv/", interval=0.02, idle_interval=0.32)
    kv = KVCache(client, "model-a", BLOCK, layout=LAYOUT, local_index=index, max_staleness=1.0)

    def syncs_in(seconds: float, during: Callable[[], object] = lambda: None) -> int:
        before = index.counters["syncs"]
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            during()
            time.sleep(0.01)
        return index.counters["syncs"] - before

    time.sleep(1.0)  # quiet rounds: 0.02, 0.04, ... up to 0.32 s apart
    quiet = syncs_in(1.6)
    assert quiet <= 8, f"{quiet} syncs in 1.6 s of an idle index (0.32 s apart at most: 5 or 6)"
    # Lookups keep it at `interval`; the index stays fresh enough to answer them.
    ids = _tokens(2 * BLOCK, seed=9)
    reading = syncs_in(1.6, lambda: kv.lookup(ids))
    assert reading >= 25, f"{reading} syncs in 1.6 s while lookups read the index (0.02 s apart: about 60)"
    assert kv.counters["lookups_remote"] == 0
    # Quiet again, then a block written elsewhere is seen within the idle interval, and the pace comes back.
    time.sleep(1.0)
    writer = server.client(timeout=5.0)
    KVCache(writer, "model-a", BLOCK, layout=LAYOUT).put(ids, _random_kv(len(ids)))
    keys = kv.block_keys(ids)
    began = time.monotonic()
    wait_until(lambda: _claimed(index, keys) == set(keys), 2.0, "the idle index to see the new blocks")
    assert time.monotonic() - began < 0.32 + 0.3
    index.close()
    writer.close()
