"""The KV-cache path: `cacheclient.kv.KVCache` against real cache servers, and the PD example as processes.

The prefill/decode tests run `examples/pd_disaggregation/prefill.py` and
`decode.py` as two processes that share nothing but a cache server, and
compare their greedy tokens with generation in one process with no split.
The block tests use small synthetic tensors, so eviction pressure needs only
a few MiB of L1.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from cacheclient import CacheClient, LimitExceededError
from cacheclient.kv import KVCache, KVLayout, salt_segment
from cacheclient.wire import key_digest

from conftest import CacheServer, wait_until

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "pd_disaggregation"
NEW_TOKENS = 12

KV_NAMESPACE = """
[[namespaces]]
prefix = "kv/"
write_mode = "cache-only"
"""


def _example_model() -> Any:
    spec = importlib.util.spec_from_file_location("pd_example_model", EXAMPLE / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kv_config(tmp_path: Path) -> str:
    path = tmp_path / "kv.toml"
    path.write_text(KV_NAMESPACE)
    return str(path)


def _run_worker(script: str, address: str, prompts: Path, *extra: str) -> dict[str, dict[str, Any]]:
    argv = [sys.executable, str(EXAMPLE / script), "--cache", address, "--prompts", str(prompts), *extra]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, f"{script} failed:\n{done.stderr[-4000:]}"
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {r["id"]: r for r in records}


# -- prefill in one process, decode in another ---------------------------------


@pytest.fixture(scope="module")
def pd_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One cache server; prefill.py, then decode.py, over the same prompts; the reference tokens."""
    pytest.importorskip("transformers")
    work = tmp_path_factory.mktemp("pd")
    model_module = _example_model()
    first = model_module.random_prompt(1000, seed=11)
    prompts = {
        "p300": model_module.random_prompt(300, seed=10),
        "p1000": first,
        "p2500": model_module.random_prompt(2500, seed=12),
        # Shares the first 768 tokens (three blocks) of p1000, then goes its own way.
        "reuse": first[:768] + model_module.random_prompt(532, seed=13),
    }
    prompt_file = work / "prompts.json"
    prompt_file.write_text(json.dumps([{"id": k, "tokens": v} for k, v in prompts.items()]))

    server = CacheServer(["--l1-bytes", "256MiB", "--config", _kv_config(work)], work / "logs").start()
    try:
        prefill = _run_worker("prefill.py", server.address, prompt_file, "--lease", "120")
        client = server.client()
        pinned_after_prefill = client.stats()["counters"].get("pinned_keys", 0)
        decode = _run_worker("decode.py", server.address, prompt_file, "--new-tokens", str(NEW_TOKENS))
        stats_after_decode = client.stats()
        client.close()
    finally:
        server.stop(grace=10.0)

    threads = torch.get_num_threads()
    try:
        model = model_module.build_model(threads=1)
        with torch.no_grad():
            reference = {}
            for name, ids in prompts.items():
                out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
                reference[name] = out[0, len(ids) :].tolist()
    finally:
        torch.set_num_threads(threads)
    yield {
        "prompts": prompts,
        "prefill": prefill,
        "decode": decode,
        "reference": reference,
        "pinned_after_prefill": pinned_after_prefill,
        "stats_after_decode": stats_after_decode,
    }


@pytest.mark.parametrize("name", ["p300", "p1000", "p2500"])
def test_prefill_and_decode_processes_generate_the_same_tokens_as_one_process(
    pd_run: dict[str, Any], name: str
) -> None:
    n = len(pd_run["prompts"][name])
    full_blocks = n // 256 * 256
    assert pd_run["prefill"][name]["stored_tokens"] == full_blocks
    decoded = pd_run["decode"][name]
    # The decode worker took every stored block from the cache (all but one
    # token when the prompt ends on a block boundary) ...
    assert decoded["loaded_tokens"] == min(full_blocks, n - 1)
    # ... and generated exactly what one process generates with no split.
    assert decoded["tokens"] == pd_run["reference"][name]


def test_prefix_reuse_loads_shared_blocks_and_prefills_only_the_rest(pd_run: dict[str, Any]) -> None:
    prefill = pd_run["prefill"]["reuse"]
    assert (prefill["loaded_tokens"], prefill["computed_tokens"]) == (768, 1300 - 768)
    assert prefill["stored_tokens"] == 1280
    decoded = pd_run["decode"]["reuse"]
    assert decoded["loaded_tokens"] == 1280
    assert decoded["tokens"] == pd_run["reference"]["reuse"]


def test_decode_reads_release_every_lease(pd_run: dict[str, Any]) -> None:
    # 1 + 3 + 9 + 5 blocks were put with a lease; the three shared blocks twice.
    assert pd_run["pinned_after_prefill"] == 1 + 3 + 9 + 2
    counters = pd_run["stats_after_decode"]["counters"]
    assert counters.get("pinned_keys", 0) == 0
    assert counters.get("leases_released", 0) >= 1 + 3 + 9 + 2


# -- blocks ----------------------------------------------------------------------

LAYOUT = KVLayout(num_layers=3, kv_heads=2, head_dim=16, dtype="float32")
BLOCK = 64
BLOCK_VALUE_BYTES = 128 + 3 * 2 * (2 * BLOCK * 16 * 4)  # the record's header and table, then K and V of each layer


def _random_kv(n_tokens: int, layout: KVLayout = LAYOUT, seed: int = 0) -> list[tuple[Any, Any]]:
    generator = torch.Generator().manual_seed(seed)
    dtype = layout.torch_dtype
    return [
        (
            torch.randn(1, layout.kv_heads, n_tokens, layout.head_dim, generator=generator).to(dtype),
            torch.randn(1, layout.kv_heads, n_tokens, layout.v_dim, generator=generator).to(dtype),
        )
        for _ in range(layout.num_layers)
    ]


def _tokens(n: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (n,), generator=generator).tolist()


def _same(got: list[tuple[Any, Any]] | None, want: list[tuple[Any, Any]], n_tokens: int) -> bool:
    assert got is not None
    return len(got) == len(want) and all(
        torch.equal(k, wk[:, :, :n_tokens]) and torch.equal(v, wv[:, :, :n_tokens])
        for (k, v), (wk, wv) in zip(got, want, strict=True)
    )


@pytest.fixture
def kv_server(cache_server: Any, tmp_path: Path) -> Any:
    return cache_server("--l1-bytes", "64MiB", "--config", _kv_config(tmp_path))


@pytest.fixture(params=["memcpy", "torch"])
def copy_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a read copies a block into its result: a memcpy per run of rows, each checked where it
    landed (runs of at least `_MEMCPY_RUN_BYTES`), or the block checked, then one torch copy (shorter)."""
    import cacheclient.kv as kv_module

    monkeypatch.setattr(kv_module, "_MEMCPY_RUN_BYTES", 0 if request.param == "memcpy" else 1 << 40)
    return str(request.param)


def test_unpack_as_refuses_what_unpack_refuses_and_returns_the_same_bytes() -> None:
    from cacheclient.wire import tensors as records

    owner = records.owner_digest("block", "0")
    entries = [
        records.TensorEntry("k", "float32", (2, 3, 4), records.KV),
        records.TensorEntry("v", "bfloat16", (2, 3, 2), records.KV),
    ]
    value = bytes(records.pack(owner, [(e, os.urandom(e.size)) for e in entries]))
    layout = records.RecordLayout.of(entries)
    assert [bytes(d) for d in records.unpack_as(value, owner, layout)] == [
        bytes(d) for _, d in records.unpack(value, owner)
    ]
    assert [s for _, s in records.unpack_table_as(value, owner, layout)] == [
        e.checksum for e, _ in records.unpack(value, owner)
    ]

    def refused(read: Any, value: bytes) -> bool:
        try:
            read(value)
        except records.TensorRecordError:
            return True
        return False

    padding = set(range(96, 128))  # between the tensors' bytes (64-byte aligned): in no checksum
    for at in range(len(value)):  # every byte flipped: both refuse it, or (padding) both take it
        flipped = bytearray(value)
        flipped[at] ^= 0x01
        start = records.unpack(value, owner)[0][0].offset
        assert refused(lambda v: records.unpack(v, owner), bytes(flipped)) == (at - start not in padding), at
        assert refused(lambda v: records.unpack_as(v, owner, layout), bytes(flipped)) == (at - start not in padding)
    for bad in (value[:-1], value + b"\0", b"", value[:40]):
        with pytest.raises(records.TensorRecordError):
            records.unpack_as(bad, owner, layout)
    with pytest.raises(records.TensorRecordError, match="another owner"):
        records.unpack_as(value, records.owner_digest("block", "1"), layout)
    other = [records.TensorEntry("k", "float32", (2, 4, 3), records.KV), entries[1]]  # as many bytes, other shape
    assert records.RecordLayout.of(other).size == layout.size
    with pytest.raises(records.TensorRecordError, match="other tensors"):
        records.unpack_as(value, owner, records.RecordLayout.of(other))


def test_blocks_round_trip_exactly(kv_server: Any, copy_path: str) -> None:
    client = kv_server.client()
    kv = KVCache(client, "model-a", BLOCK, layout=LAYOUT)
    ids, tensors = _tokens(300), _random_kv(300)
    assert kv.lookup(ids) == 0 and kv.get(ids, 64) is None
    assert kv.put(ids, tensors) == 256  # the 44 tokens past the last full block are not stored
    assert kv.lookup(ids) == 256
    assert kv.lookup(ids[:200]) == 192 and kv.lookup(ids[:63]) == 0
    for n in (1, 64, 100, 256):
        assert _same(kv.get(ids, n, release=False), tensors, n), n
    with pytest.raises(ValueError, match="n_tokens"):
        kv.get(ids, 257)
    # Within one block: views of the fetched bytes, no copy.
    one = kv.get(ids, 64, release=False)
    assert one is not None
    k0, v0 = one[0]
    assert v0.data_ptr() - k0.data_ptr() == k0.nbytes  # side by side, as in the block's bytes
    # Layer by layer.
    streamed = list(kv.stream_layers(ids, 200, release=False))
    assert [layer for layer, _, _ in streamed] == [0, 1, 2]
    assert _same([(k, v) for _, k, v in streamed], tensors, 200)
    # A prompt that diverges inside block 2 shares blocks 0 and 1 only.
    other = ids[:150] + _tokens(150, seed=1)
    assert kv.lookup(other) == 128


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_colocated_blocks_read_into_page_locked_memory_reach_the_gpu_exactly(
    cache_server: Any, tmp_path: Path, copy_path: str
) -> None:
    # The GPU path of issue 23: blocks read from the server's shared arena (no gRPC on the bulk path) into one
    # page-locked buffer, then to the device by DMA (`non_blocking`), bit for bit what was put.
    from cacheclient.colocated import Colocated

    server = cache_server("--l1-bytes", "64MiB", "--config", _kv_config(tmp_path), env={"CACHESVC_L1_SHARED": "true"})
    client = server.client(colocated=True)
    transport = client.transport
    assert isinstance(transport, Colocated) and transport.shared_l1(wait=True) is not None
    kv = KVCache(client, "model-a", BLOCK, layout=LAYOUT, pin_memory=True)
    ids, tensors = _tokens(300), _random_kv(300)
    assert kv.put(ids, tensors) == 256
    before, asked = transport.counts["arena"], transport.counts["asked"]
    for n in (64, 256):
        got = kv.get(ids, n, release=False)
        assert got is not None
        assert all(k.is_pinned() and v.is_pinned() for k, v in got)
        on_device = [(k.to("cuda", non_blocking=True), v.to("cuda", non_blocking=True)) for k, v in got]
        torch.cuda.synchronize()
        assert all(
            torch.equal(k, wk[:, :, :n].cuda()) and torch.equal(v, wv[:, :, :n].cuda())
            for (k, v), (wk, wv) in zip(on_device, tensors, strict=True)
        ), n
    # Every block of both reads (1, then 4) came from the arena; none was asked of the server.
    assert transport.counts["arena"] - before >= 1 + 4 and transport.counts["asked"] == asked


def test_fetch_finds_and_reads_the_longest_cached_prefix(kv_server: Any, copy_path: str) -> None:
    client = kv_server.client()
    kv = KVCache(client, "model-a", BLOCK, layout=LAYOUT, release_on_read=False)
    ids, tensors = _tokens(5 * BLOCK), _random_kv(5 * BLOCK)
    assert kv.fetch(ids) == (0, None)
    kv.put(ids[: 3 * BLOCK], tensors)  # blocks 0-2 only
    n, got = kv.fetch(ids)
    assert n == 3 * BLOCK and _same(got, tensors, n)
    n, got = kv.fetch(ids, max_tokens=100)
    assert n == 100 and _same(got, tensors, 100)
    n, got = kv.fetch(ids[: 3 * BLOCK], max_tokens=3 * BLOCK - 1)  # what a decode worker asks for
    assert n == 3 * BLOCK - 1 and _same(got, tensors, n)
    client.put(kv.block_keys(ids)[1], b"not a block")
    n, got = kv.fetch(ids)  # the prefix ends before the bad block
    assert n == BLOCK and _same(got, tensors, BLOCK)
    client.delete(kv.block_keys(ids)[0])
    assert kv.fetch(ids) == (0, None)


def test_bfloat16_and_distinct_v_head_dim_round_trip(kv_server: Any, copy_path: str) -> None:
    layout = KVLayout(num_layers=2, kv_heads=1, head_dim=24, v_head_dim=8, dtype="bfloat16")
    kv = KVCache(kv_server.client(), "mla-like", BLOCK, layout=layout)
    ids, tensors = _tokens(128), _random_kv(128, layout)
    kv.put(ids, tensors)
    got = kv.get(ids, 128)
    assert got is not None and got[0][0].dtype == torch.bfloat16 and got[0][1].shape == (1, 1, 128, 8)
    assert _same(got, tensors, 128)


def test_a_read_kept_is_never_overwritten_by_the_next(kv_server: Any, copy_path: str) -> None:
    """Reads reuse the memory of an earlier read's K and V only once none of its tensors is alive."""
    kv = KVCache(kv_server.client(), "model-a", BLOCK, layout=LAYOUT, release_on_read=False)
    first, second = _tokens(3 * BLOCK), _tokens(3 * BLOCK, seed=1)
    first_kv, second_kv = _random_kv(3 * BLOCK), _random_kv(3 * BLOCK, seed=1)
    kv.put(first, first_kv)
    kv.put(second, second_kv)
    kept = kv.get(first, 3 * BLOCK)
    assert _same(kept, first_kv, 3 * BLOCK)
    assert _same(kv.get(second, 3 * BLOCK), second_kv, 3 * BLOCK)
    assert _same(kept, first_kv, 3 * BLOCK)
    one_layer = kv.get(first, 2 * BLOCK)
    assert one_layer is not None
    k_last, _ = one_layer[-1]  # a view of one layer holds the whole read's memory
    address = k_last.data_ptr()
    del one_layer
    other = kv.get(second, 2 * BLOCK)
    assert _same(other, second_kv, 2 * BLOCK)
    assert torch.equal(k_last[0], first_kv[-1][0][0, :, : 2 * BLOCK]) and k_last.data_ptr() == address
    assert other is not None
    other_address = other[0][0].data_ptr()
    del k_last, other
    again = kv.get(second, 2 * BLOCK)  # nothing of the last read is alive: its memory is reused
    assert again is not None and again[0][0].data_ptr() == other_address
    assert _same(again, second_kv, 2 * BLOCK)


def test_blocks_over_one_message_are_streamed_and_released(kv_server: Any) -> None:
    layout = KVLayout(num_layers=2, kv_heads=8, head_dim=128, dtype="float32")  # 4 MiB blocks, like real models'
    kv = KVCache(kv_server.client(), "big-model", 256, layout=layout, lease=60.0)
    ids, tensors = _tokens(3 * 256), _random_kv(3 * 256, layout)
    kv.put(ids, tensors)
    assert kv.client.stats()["counters"]["pinned_keys"] == 3
    assert _same(kv.get(ids, 700, release=False), tensors, 700)
    n, got = kv.fetch(ids)  # the decode worker's read releases the leases
    assert n == 768 and _same(got, tensors, 768)
    assert kv.client.stats()["counters"].get("pinned_keys", 0) == 0


def test_other_fingerprint_block_size_or_layout_is_a_miss(kv_server: Any) -> None:
    client = kv_server.client()
    ids, tensors = _tokens(256), _random_kv(256)
    KVCache(client, "model-a", BLOCK, layout=LAYOUT).put(ids, tensors)
    for other in (
        KVCache(client, "model-a@other-weights", BLOCK, layout=LAYOUT),
        KVCache(client, "model-a", 128, layout=LAYOUT),
        KVCache(client, "model-a", BLOCK, layout=KVLayout(3, 2, 16, "bfloat16")),
        KVCache(client, "model-a", BLOCK, layout=KVLayout(3, 2, 16, "float32", tp_rank=1, tp_size=2)),
        KVCache(client, "model-a", BLOCK, layout=LAYOUT, namespace="kv/other/"),
    ):
        assert other.lookup(ids) == 0, other
        assert other.get(ids, 128) is None, other


def test_two_salts_never_share_a_block_of_the_same_prompt(kv_server: Any) -> None:
    client = kv_server.client()
    ids, tensors = _tokens(256), _random_kv(256)
    plain = KVCache(client, "model-a", BLOCK, layout=LAYOUT)
    salt_a, salt_b = plain.with_salt("tenant-a-secret"), plain.with_salt("tenant-b-secret")
    assert plain.with_salt(None) is plain and plain.with_salt("") is plain
    salt_a.put(ids, tensors)
    # The salt is a key segment after the namespace: a digest of it, never the salt itself.
    keys = salt_a.block_keys(ids)
    assert salt_segment("tenant-a-secret").startswith("s-")
    assert all(key.startswith(f"kv/{salt_segment('tenant-a-secret')}".encode()) for key in keys)
    assert all(b"secret" not in key for key in keys) and client.contains_many(keys) == [True] * (256 // BLOCK)
    assert salt_a.lookup(ids) == 256 and _same(salt_a.get(ids, 256, release=False), tensors, 256)
    for other in (salt_b, plain, KVCache(client, "model-a", BLOCK, layout=LAYOUT, salt="tenant-b-secret")):
        assert other.lookup(ids) == 0, other.salt
        assert other.get(ids, 128) is None and other.fetch(ids) == (0, None), other.salt

    # One local index, of the namespace, serves every salt, and tells each salt its own blocks.
    indexed = KVCache(client, "model-a", BLOCK, layout=LAYOUT, local_index=True, max_staleness=60.0)
    try:
        index_a, index_b = indexed.with_salt("tenant-a-secret"), indexed.with_salt("tenant-b-secret")
        assert index_a.index is indexed.index is index_b.index and indexed.index is not None
        index = indexed.index
        wait_until(lambda: index.contains(key_digest(keys[1])), 10.0, "the index to learn the salted blocks")
        assert index_a.lookup(ids) == 256 and index_b.lookup(ids) == 0 and indexed.lookup(ids) == 0
        assert index_a.counters["lookups_local"] == 1 and index_b.counters["lookups_local"] == 1
    finally:
        indexed.close()


def test_a_put_checks_the_kv_against_the_layout(kv_server: Any) -> None:
    kv = KVCache(kv_server.client(), "model-a", BLOCK, layout=LAYOUT)
    with pytest.raises(ValueError, match="layout"):
        kv.put(_tokens(128), _random_kv(128, KVLayout(2, 2, 16)))
    with pytest.raises(ValueError, match="covers 100 tokens"):
        kv.put(_tokens(128), _random_kv(100))


def test_truncated_or_corrupt_block_is_a_miss_never_a_tensor(kv_server: Any, copy_path: str) -> None:
    client = kv_server.client()
    kv = KVCache(client, "model-a", BLOCK, layout=LAYOUT)
    ids, tensors = _tokens(256), _random_kv(256)
    kv.put(ids, tensors)
    keys = kv.block_keys(ids)
    good = client.get(keys[1])
    assert good is not None and len(good) == BLOCK_VALUE_BYTES
    flipped = bytearray(good)
    flipped[-5] ^= 0x10  # a bit of the last layer's V
    header = bytearray(good)
    header[36] = 2  # the tensor's dtype code: float16
    for bad in (  # each stored with a checksum of its own, so the server accepts it
        good[: len(good) // 2],  # truncated
        good[:-4],
        bytes(flipped),  # a flipped bit
        bytes(header),
        client.get(keys[2]),  # a whole, valid block of another position
        b"",
    ):
        client.put(keys[1], bad)
        assert kv.lookup(ids) == 256  # the key is there ...
        assert kv.get(ids, 256, release=False) is None  # ... but the block is a miss
        assert kv.get(ids, 100, release=False) is None
        assert _same(kv.get(ids, 64, release=False), tensors, 64)  # the block before it is still good
    client.put(keys[1], bytes(flipped))
    # Layers 0 and 1 of both blocks are intact, but no layer is handed over
    # before every block has passed its checks.
    assert list(kv.stream_layers(ids, 128, release=False)) == []
    assert len(list(kv.stream_layers(ids, 64, release=False))) == 3
    client.put(keys[0], b"x")
    assert list(kv.stream_layers(ids, 128, release=False)) == []


def test_pinned_blocks_survive_eviction_until_read_unpinned_are_evicted(cache_server: Any, tmp_path: Path) -> None:
    server = cache_server("--l1-bytes", "2MiB", "--config", _kv_config(tmp_path))
    client = server.client()
    pinned = KVCache(client, "model-a", BLOCK, layout=LAYOUT, lease=60.0)
    unpinned = KVCache(client, "model-a", BLOCK, layout=LAYOUT)
    ids_a, kv_a = _tokens(512, seed=1), _random_kv(512, seed=1)
    ids_b, kv_b = _tokens(512, seed=2), _random_kv(512, seed=2)
    pinned.put(ids_a, kv_a)
    unpinned.put(ids_b, kv_b)
    filler = os.urandom(64 << 10)
    for i in range(64):  # 4 MiB through a 2 MiB tier
        client.put(f"fill/{i}", filler)
    stats = client.stats()
    assert stats["tiers"][0]["evictions"] > 0
    assert unpinned.lookup(ids_b) == 0  # the policy took them
    assert pinned.lookup(ids_a) == 512  # it could not take these
    assert _same(pinned.get(ids_a, 512, release=True), kv_a, 512)  # the decode worker's read
    for i in range(64, 128):
        client.put(f"fill/{i}", filler)
    assert pinned.lookup(ids_a) == 0  # read once, evictable like anything else


def test_dead_decode_worker_lease_expires_and_memory_is_reclaimed(cache_server: Any, tmp_path: Path) -> None:
    server = cache_server("--l1-bytes", "1MiB", "--config", _kv_config(tmp_path))
    client = server.client()
    lease = 3.0
    kv = KVCache(client, "model-a", BLOCK, layout=LAYOUT, lease=lease)
    ids_a, kv_a = _tokens(16 * BLOCK, seed=1), _random_kv(16 * BLOCK, seed=1)  # 16 blocks, about 0.8 MiB of the 1 MiB
    worker = subprocess.Popen(
        [sys.executable, "-c", _DOOMED_DECODER, server.address, json.dumps(ids_a)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdin is not None and worker.stdout is not None
        assert worker.stdout.readline().strip() == "ready"
        kv.put(ids_a, kv_a)
        leased_at = time.monotonic()
        # The decode worker finds the blocks, then dies before reading them.
        worker.stdin.write("go\n")
        worker.stdin.flush()
        assert worker.stdout.readline().strip() == str(16 * BLOCK)
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)
    # Everything is pinned: there is no room for another prompt's blocks.
    ids_b, kv_b = _tokens(16 * BLOCK, seed=2), _random_kv(16 * BLOCK, seed=2)
    with pytest.raises(LimitExceededError):
        kv.put(ids_b, kv_b)
    assert time.monotonic() < leased_at + lease, "the machine was too slow to observe the lease"
    assert kv.lookup(ids_a) == 16 * BLOCK
    time.sleep(max(0.0, leased_at + lease + 0.3 - time.monotonic()))
    kv.put(ids_b, kv_b)  # the expired leases freed A's blocks for eviction
    assert kv.lookup(ids_b) == 16 * BLOCK
    assert kv.lookup(ids_a) < 16 * BLOCK
    stats = client.stats()
    assert stats["tiers"][0]["used_bytes"] <= 1 << 20
    assert stats["counters"].get("leases_expired", 0) >= 1


_DOOMED_DECODER = """
import json, sys, time
from cacheclient.kv import KVCache, KVLayout
kv = KVCache(sys.argv[1], "model-a", 64, layout=KVLayout(num_layers=3, kv_heads=2, head_dim=16, dtype="float32"))
kv.client.wait_ready()
print("ready", flush=True)
sys.stdin.readline()
print(kv.lookup(json.loads(sys.argv[2])), flush=True)
time.sleep(120)
"""


def test_ttl_makes_blocks_a_miss(kv_server: Any) -> None:
    ttl = 2.0
    kv = KVCache(kv_server.client(), "model-a", BLOCK, layout=LAYOUT, ttl=ttl)
    ids, tensors = _tokens(128), _random_kv(128)
    kv.put(ids, tensors)
    put_at = time.monotonic()
    assert _same(kv.get(ids, 128, release=False), tensors, 128)
    assert time.monotonic() < put_at + ttl, "the machine was too slow to observe the TTL"
    time.sleep(max(0.0, put_at + ttl + 0.3 - time.monotonic()))
    assert kv.get(ids, 128) is None
    assert kv.fetch(ids) == (0, None)


def test_kv_cache_accepts_an_address_and_tensor_token_ids(kv_server: Any) -> None:
    kv = KVCache(kv_server.address, "model-a", BLOCK, layout=LAYOUT)
    ids, tensors = _tokens(128), _random_kv(128)
    kv.put(torch.tensor([ids]), tensors)
    assert kv.lookup(torch.tensor(ids)) == 128
    assert isinstance(kv.client, CacheClient)


def test_blocks_in_the_paged_layout_read_back_as_put(kv_server: Any, copy_path: str) -> None:
    # The vLLM connector stores blocks as vLLM's CPU pages hold them, "kv_paged" [layers, kv_heads, 2, tokens,
    # head_dim]; `get`, `fetch` and `iter_blocks` read them as blocks `put` stored (here kv_heads is 2: only the
    # table's name tells the two layouts apart).
    from cacheclient.wire import tensors as records

    client = kv_server.client()
    kv = KVCache(client, "model-a", BLOCK, layout=LAYOUT)
    ids, tensors = _tokens(300), _random_kv(300)
    hashes = kv.block_hashes(ids)
    shape = (LAYOUT.num_layers, LAYOUT.kv_heads, 2, BLOCK, LAYOUT.head_dim)
    entry = records.TensorEntry("kv_paged", LAYOUT.dtype, shape, records.KV)

    def paged(i: int) -> bytes:
        rows = slice(i * BLOCK, (i + 1) * BLOCK)
        both = torch.stack([torch.stack([k[0, :, rows], v[0, :, rows]], dim=1) for k, v in tensors])
        return bytes(records.pack(hashes[i], [(entry, both.contiguous().numpy().tobytes())]))

    kv.put_blocks([(h, paged(i)) for i, h in enumerate(hashes)])
    assert len(client.get(kv._key(hashes[0])) or b"") == BLOCK_VALUE_BYTES  # the same size as the fused layout's
    for n in (1, 64, 100, 256):
        assert _same(kv.get(ids, n, release=False), tensors, n), n
    assert kv.fetch(ids, 255, release=False)[0] == 255
    for i, block in enumerate(kv.iter_blocks(hashes, release=False)):
        assert block is not None
        k, v = block
        for layer in range(LAYOUT.num_layers):
            assert torch.equal(k[layer], tensors[layer][0][0, :, i * BLOCK : (i + 1) * BLOCK])
            assert torch.equal(v[layer], tensors[layer][1][0, :, i * BLOCK : (i + 1) * BLOCK])
    # A flipped bit in a paged block's bytes: the prefix ends before it, as for a fused one.
    bad = bytearray(paged(2))
    bad[-5] ^= 0x04
    client.put(kv._key(hashes[2]), bytes(bad))
    assert kv.get(ids, 3 * BLOCK, release=False) is None
    assert kv.fetch(ids, release=False)[0] == 2 * BLOCK


def test_single_blocks_round_trip_and_a_bad_one_ends_the_stream(kv_server: Any) -> None:
    """`encode_block` / `put_blocks` / `iter_blocks`, the calls of engines with a paged KV (cacheclient.vllm)."""
    client = kv_server.client()
    kv = KVCache(client, "model-a", BLOCK, layout=LAYOUT, release_on_read=False)
    ids, tensors = _tokens(3 * BLOCK), _random_kv(3 * BLOCK)
    hashes = kv.block_hashes(ids)

    def fill(i: int) -> Any:
        def write(keys: Any, values: Any) -> None:
            for layer, (k, v) in enumerate(tensors):
                keys[layer].copy_(k[0, :, i * BLOCK : (i + 1) * BLOCK])
                values[layer].copy_(v[0, :, i * BLOCK : (i + 1) * BLOCK])

        return write

    kv.put_blocks([(h, kv.encode_block(h, fill(i))) for i, h in enumerate(hashes)])
    assert _same(kv.get(ids, 3 * BLOCK), tensors, 3 * BLOCK)
    blocks = list(kv.iter_blocks(hashes))
    assert len(blocks) == 3 and all(b is not None for b in blocks)
    for i, block in enumerate(blocks):
        assert block is not None
        k, v = block
        assert all(torch.equal(k[layer], tensors[layer][0][0, :, i * BLOCK : (i + 1) * BLOCK]) for layer in range(3))
        assert all(torch.equal(v[layer], tensors[layer][1][0, :, i * BLOCK : (i + 1) * BLOCK]) for layer in range(3))
    bad = bytearray(client.get(kv.block_keys(ids)[1]) or b"")
    bad[-3] ^= 0x20
    client.put(kv.block_keys(ids)[1], bytes(bad))
    got = list(kv.iter_blocks(hashes))
    assert len(got) == 2 and got[0] is not None and got[1] is None
