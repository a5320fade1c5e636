"""Checkpoints through the cache: real DCP, a real cache server process, real SeaweedFS.

The server maps "ckpt/" to a write-back namespace, so saves land in the
cache and are uploaded behind them; the tests check what a training job
would notice: tensors equal after a load, a crash after the commit losing
nothing, a crash before it leaving no checkpoint, unchanged tensors not sent
again, retention freeing space without breaking a running load, and damaged
chunks repaired or reported by tensor name.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import lmdb
import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from cacheclient.checkpoint import (  # noqa: E402
    CacheStorageReader,
    CacheStorageWriter,
    CheckpointNotFound,
    RetentionBlocked,
    apply_retention,
    checkpoint_status,
    delete_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load,
    save,
)
from cacheclient.checkpoint.catalog import CheckpointKeys, read_manifest  # noqa: E402
from cacheclient.checkpoint.commits import commits  # noqa: E402
from cacheclient.wire.record import storage_key  # noqa: E402
from cachesvc.commands.cachectl import main as cachectl_main  # noqa: E402
from cachesvc.devcluster.procs import free_port  # noqa: E402

from conftest import s3_args, wait_until  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

KEYS = CheckpointKeys()


def _config(tmp_path: Path) -> Path:
    config = tmp_path / "ckpt.toml"
    config.write_text('[[namespaces]]\nprefix = "ckpt/"\nwrite_mode = "write-back"\n')
    return config


class S3WriteGate:
    """A proxy in front of S3 that answers uploads (PUT, POST) with 503 while `closed`; reads pass through.

    It stands for object storage that is slow or away: write-back keeps
    retrying, so what the cache holds stays un-uploaded for as long as a
    test needs.
    """

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.removeprefix("http://").rpartition(":")
        self.upstream = (host, int(port))
        self.closed = True
        self.refused = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="s3-write-gate", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> S3WriteGate:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        server.close()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        upstream_r, upstream_w = await asyncio.open_connection(*self.upstream)
        answered = asyncio.Event()
        answered.set()

        async def requests() -> None:
            while data := await client_r.read(1 << 16):
                if answered.is_set():  # the first bytes of a request
                    answered.clear()
                    if self.closed and data.split(b" ", 1)[0] in (b"PUT", b"POST"):
                        self.refused += 1
                        client_w.write(b"HTTP/1.1 503 Slow Down\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                        await client_w.drain()
                        return
                upstream_w.write(data)
                await upstream_w.drain()

        async def responses() -> None:
            while data := await upstream_r.read(1 << 16):
                answered.set()
                client_w.write(data)
                await client_w.drain()

        tasks = [asyncio.ensure_future(requests()), asyncio.ensure_future(responses())]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        for writer in (client_w, upstream_w):
            with contextlib.suppress(Exception):
                writer.close()


@pytest.fixture
def s3_gate(s3: Any) -> Iterator[S3WriteGate]:
    gate = S3WriteGate(s3.endpoint).start()
    yield gate
    gate.stop()


def _server(
    cache_server: Any, s3: Any, s3_prefix: str, tmp_path: Path, *, l1: str = "64MiB", endpoint: str = ""
) -> Any:
    args = s3_args(s3, s3_prefix)
    if endpoint:
        args[args.index("--s3-endpoint") + 1] = endpoint
    return cache_server(
        "--config", str(_config(tmp_path)),
        "--l1-bytes", l1,
        "--l2-path", str(tmp_path / "l2"),
        "--l2-bytes", "512MiB",
        *args,
    )  # fmt: skip


def _training_state(seed: int = 0, layers: int = 4, width: int = 256) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)], torch.nn.LayerNorm(width))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, width)).square().mean().backward()
    optimizer.step()
    return model, optimizer


def _state_dict(model: Any, optimizer: Any) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "extra": {"step": 1000, "bf16": torch.arange(10, dtype=torch.bfloat16), "mask": torch.tensor([True, False])},
    }


def _assert_equal(expected: Any, actual: Any, path: str = "") -> None:
    if isinstance(expected, dict):
        assert set(expected) == set(actual), path
        for key in expected:
            _assert_equal(expected[key], actual[key], f"{path}.{key}")
    elif isinstance(expected, list | tuple):
        assert len(expected) == len(actual), path
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            _assert_equal(e, a, f"{path}[{i}]")
    elif isinstance(expected, torch.Tensor):
        assert expected.dtype == actual.dtype and torch.equal(expected, actual), path
    else:
        assert expected == actual, path


def _zeroed(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: _zeroed(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return state


def _run() -> str:
    return f"run-{uuid.uuid4().hex[:8]}"


def test_dcp_save_and_load_model_and_optimizer(cache_server: Any, s3: Any, s3_prefix: str, tmp_path: Path) -> None:
    cache = _server(cache_server, s3, s3_prefix, tmp_path).client()
    model, optimizer = _training_state()
    state = _state_dict(model, optimizer)
    name = f"{_run()}/step-1000"

    dcp.save(state, storage_writer=CacheStorageWriter(cache), checkpoint_id=name)
    wait_until(lambda: checkpoint_status(cache, name).state == "uploaded", 30, "the checkpoint uploaded to S3")

    restored = _zeroed(state)
    restored["extra"]["step"] = 0
    dcp.load(restored, storage_reader=CacheStorageReader(cache), checkpoint_id=name)
    _assert_equal(state, restored)
    # Without a template the helper rebuilds the dict (DCP turns int keys, as in optimizer state, into str).
    rebuilt = load(cache, name)
    _assert_equal(state["model"], rebuilt["model"])
    _assert_equal(state["extra"], rebuilt["extra"])
    status = checkpoint_status(cache, name)
    assert status.bytes > 4 * 256 * 256 * 4 * 3  # weights and both Adam moments
    assert status.chunks_missing == 0 and status.world_size == 1


def test_async_save_then_load(cache_server: Any, s3: Any, s3_prefix: str, tmp_path: Path) -> None:
    cache = _server(cache_server, s3, s3_prefix, tmp_path).client()
    model, optimizer = _training_state(seed=1)
    state = _state_dict(model, optimizer)
    name = f"{_run()}/step-1"
    future = dcp.async_save(state, storage_writer=CacheStorageWriter(cache), checkpoint_id=name)
    assert isinstance(future, Future)
    future.result(timeout=60)
    assert latest_checkpoint(cache, name.split("/")[0]) == name
    restored = _zeroed(state)
    dcp.load(restored, storage_reader=CacheStorageReader(cache), checkpoint_id=name)
    _assert_equal(state, restored)


@pytest.mark.parametrize("colocated", [None, False], ids=["staged", "grpc"])
def test_a_server_with_a_disk_and_no_object_storage_is_a_local_checkpoint_store(
    cache_server: Any, tmp_path: Path, colocated: bool | None
) -> None:
    # Chunks are put durable: on the server's disk and synced when the put returns, so the commit waits for
    # nothing (it used to wait out its whole durable_timeout for chunks sitting in L1) and survives a kill.
    # durability="unsynced" (DCP's sync_files=False) puts them plain: here, with a cache-only prefix that keeps
    # them in memory, each is put again durable rather than waited for until durable_timeout.
    args = ("--l1-bytes", "64MiB", "--l2-path", str(tmp_path / "l2"), "--l2-bytes", "512MiB")
    env = {"CACHESVC_L1_SHARED": "true"}
    model, optimizer = _training_state(seed=3)
    state = _state_dict(model, optimizer)
    run = _run()
    name, unsynced_name = f"{run}/step-7", f"{run}/step-8"
    server = cache_server(*args, env=env)
    with server.client(colocated=colocated) as cache:
        dcp.save(state, storage_writer=CacheStorageWriter(cache, durable_timeout=30), checkpoint_id=name)
        assert latest_checkpoint(cache, run) == name
        counters = cache.stats()["counters"]
        staged = counters.get("staging_puts", 0)
        assert (staged > 0) == (colocated is None), staged
        chunks = len(read_manifest(cache, name)["chunks"])
        assert counters["l2_synced_keys"] >= chunks + 1, counters  # every chunk and the manifest synced
        state = copy.deepcopy(state)  # what step-7 holds: the parameters change below
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        unsynced_state = _state_dict(model, optimizer)
        began = time.monotonic()
        writer = CacheStorageWriter(cache, durability="unsynced", durable_timeout=30)
        dcp.save(unsynced_state, storage_writer=writer, checkpoint_id=unsynced_name)
        assert time.monotonic() - began < 20  # no chunk waited out its durable_timeout
        assert latest_checkpoint(cache, run) == unsynced_name
    server.kill()
    restarted = cache_server(*args, env=env)
    with restarted.client(colocated=colocated) as cache:
        for saved, saved_name in ((state, name), (unsynced_state, unsynced_name)):
            restored = _zeroed(saved)
            restored["extra"]["step"] = 0
            dcp.load(restored, storage_reader=CacheStorageReader(cache), checkpoint_id=saved_name)
            _assert_equal(saved, restored)


def test_a_checkpoint_a_server_cannot_keep_fails_at_once_naming_why(cache_server: Any) -> None:
    server = cache_server("--l1-bytes", "64MiB")  # no disk, no object storage
    state = _state_dict(*_training_state(seed=4))
    with server.client() as cache:
        began = time.monotonic()
        with pytest.raises(CheckpointException) as failed:
            dcp.save(state, storage_writer=CacheStorageWriter(cache), checkpoint_id=f"{_run()}/step-1")
        assert time.monotonic() - began < 60  # not its durable_timeout of 600 s
        assert "no local disk tier (l2)" in str(failed.value)


def test_two_gloo_ranks_save_and_load(cache_server: Any, s3: Any, s3_prefix: str, tmp_path: Path) -> None:
    server = _server(cache_server, s3, s3_prefix, tmp_path)
    name = f"{_run()}/step-2"
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    script = str(Path(__file__).with_name("checkpoint_ranks.py"))
    ranks = [
        subprocess.Popen([sys.executable, script, server.address, name], env=dict(env, RANK=str(rank)))
        for rank in range(2)
    ]
    try:
        codes = [rank.wait(timeout=120) for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
    assert codes == [0, 0]
    manifest = read_manifest(server.client(), name)
    assert manifest["world_size"] == 2
    # The replicated tensor is written once, each rank's own tensor once.
    assert sorted(item["fqn"] for item in manifest["items"]) == ["rank0.own", "rank1.own", "shared.weight"]


def _s3_chunk_bytes(s3: Any, s3_prefix: str) -> dict[str, int]:
    listing = s3.client().get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix=s3_prefix + "ckpt/chunks/")
    return {obj["Key"]: obj["Size"] for page in listing for obj in page.get("Contents", [])}


def test_incremental_save_sends_and_uploads_only_what_changed(
    cache_server: Any, s3: Any, s3_prefix: str, tmp_path: Path
) -> None:
    cache = _server(cache_server, s3, s3_prefix, tmp_path).client()
    torch.manual_seed(2)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(10)])
    run = _run()
    first = save(model.state_dict(), cache, f"{run}/step-1")
    wait_until(lambda: checkpoint_status(cache, f"{run}/step-1").state == "uploaded", 30, "step-1 uploaded")
    uploaded_before = _s3_chunk_bytes(s3, s3_prefix)

    with torch.no_grad():
        model[3].weight.add_(1.0)  # one tensor of ten: 10% of the parameters
    second = save(model.state_dict(), cache, f"{run}/step-2")
    wait_until(lambda: checkpoint_status(cache, f"{run}/step-2").state == "uploaded", 30, "step-2 uploaded")
    uploaded_after = _s3_chunk_bytes(s3, s3_prefix)

    assert first.bytes_sent == first.bytes == 10 * 512 * 512 * 4
    assert second.bytes_sent == 512 * 512 * 4
    new_in_s3 = sum(size for key, size in uploaded_after.items() if key not in uploaded_before)
    assert new_in_s3 == 512 * 512 * 4, "S3 received only the changed tensor's chunk"
    assert new_in_s3 <= 0.15 * second.bytes
    restored = load(cache, f"{run}/step-2")
    _assert_equal(model.state_dict(), restored)


def test_sigkill_after_commit_before_upload_keeps_the_checkpoint(
    s3_gate: S3WriteGate, cache_server: Any, s3: Any, s3_prefix: str, tmp_path: Path
) -> None:
    server = _server(cache_server, s3, s3_prefix, tmp_path, l1="0", endpoint=s3_gate.endpoint)
    cache = server.client()
    model, optimizer = _training_state(seed=3)
    state = _state_dict(model, optimizer)
    name = f"{_run()}/step-5"
    save(state, cache, name)  # committed from the server's disk: S3 refuses every upload
    wait_until(lambda: s3_gate.refused > 0, 30, "the server trying to upload")  # each upload HEADs first
    status = checkpoint_status(cache, name)
    assert status.state == "in cache" and status.chunks_uploaded == 0
    assert status.chunks_on_disk == status.chunks

    server.kill()
    server.start()
    cache.wait_ready(30)  # the channel backs off while the server is away
    restored = _zeroed(state)
    load(cache, name, restored)  # from L2: S3 has none of it yet
    _assert_equal(state, restored)
    s3_gate.closed = False
    wait_until(lambda: checkpoint_status(cache, name).state == "uploaded", 30, "the upload resumed after restart")


def test_sigkill_before_commit_leaves_no_checkpoint(
    s3_gate: S3WriteGate, cache_server: Any, s3: Any, s3_prefix: str, tmp_path: Path
) -> None:
    server = _server(cache_server, s3, s3_prefix, tmp_path, l1="0", endpoint=s3_gate.endpoint)
    cache = server.client()
    model, optimizer = _training_state(seed=4)
    name = f"{_run()}/step-6"
    run = name.split("/")[0]
    # durability="s3" cannot be met while S3 refuses uploads: the save waits
    # before its commit until the server dies under it.
    future = dcp.async_save(
        _state_dict(model, optimizer),
        storage_writer=CacheStorageWriter(cache, durability="s3", durable_timeout=60),
        checkpoint_id=name,
    )
    assert isinstance(future, Future)
    wait_until(lambda: s3_gate.refused > 0, 30, "chunks handed to the cache and their uploads refused")
    server.kill()
    with pytest.raises(CheckpointException, match="UnavailableError"):
        future.result(timeout=60)
    s3_gate.closed = False
    server.start()
    cache.wait_ready(30)
    assert checkpoint_status(cache, name).state == "missing"
    assert latest_checkpoint(cache, run) is None
    with pytest.raises(CheckpointNotFound):
        load(cache, name)
    assert any(k.startswith(KEYS.chunk(run, "")[:-1]) for k in _l2_keys(tmp_path / "l2")), "chunks were stored"


def _l2_keys(path: Path) -> list[bytes]:
    if not (path / "data.mdb").exists():
        return []
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=0)
    try:
        with env.begin() as txn:
            return [bytes(k[1:]) for k in txn.cursor().iternext(values=False)]
    finally:
        env.close()


def test_retention_keeps_the_last_n_and_spares_a_running_load(
    cache_server: Any, s3: Any, s3_prefix: str, tmp_path: Path
) -> None:
    cache = _server(cache_server, s3, s3_prefix, tmp_path).client()
    run = _run()
    torch.manual_seed(5)
    weights = {f"layer{i}": torch.randn(256, 256) for i in range(4)}
    frozen = torch.randn(256, 256)
    saved = {}
    for step in range(1, 5):
        weights[f"layer{step % 4}"] = torch.randn(256, 256)
        saved[step] = {**{k: v.clone() for k, v in weights.items()}, "frozen": frozen}
        save(saved[step], cache, f"{run}/step-{step}")
    # A load of step-2 is under way (its metadata read) when retention runs.
    reader = CacheStorageReader(cache, lease=2.0)
    reader.reset(f"{run}/step-2")
    reader.read_metadata()
    step1_chunks = set(read_manifest(cache, f"{run}/step-1")["chunks"])

    deleted = apply_retention(cache, run, keep_last=2)
    assert deleted == [f"{run}/step-1"]
    assert [e.name for e in list_checkpoints(cache, run)] == [f"{run}/step-3", f"{run}/step-4"]
    assert checkpoint_status(cache, f"{run}/step-1").state == "missing"
    kept_chunks = set().union(*(read_manifest(cache, f"{run}/step-{s}")["chunks"] for s in (2, 3, 4)))
    only_step1 = step1_chunks - kept_chunks
    assert only_step1, "step-1 had a tensor no later checkpoint shares"
    assert cache.locate_many([KEYS.chunk(run, d) for d in only_step1]) == [None] * len(only_step1)
    _assert_equal(saved[2], load(cache, f"{run}/step-2", lease=2.0))  # the running load still finds every chunk

    wait_until(
        lambda: apply_retention(cache, run, keep_last=2) == [f"{run}/step-2"], 10, "step-2 deleted after the lease"
    )
    _assert_equal(saved[4], load(cache, f"{run}/step-4"))
    assert delete_checkpoint(cache, f"{run}/step-3")
    assert [e.name for e in list_checkpoints(cache, run)] == [f"{run}/step-4"]
    _assert_equal(saved[4], load(cache, f"{run}/step-4"))


def retention_with_the_newest_manifest_away(cache: Any) -> None:
    """Two checkpoints sharing a tensor; the newest one's manifest reads as missing while retention runs
    (as when the node holding it is away for a moment): retention deletes nothing, and once the manifest
    is back the newest checkpoint loads whole; the next pass frees the older one.
    """
    run = _run()
    torch.manual_seed(21)
    frozen = torch.randn(256, 256)
    saved = {step: {"frozen": frozen, "moving": torch.randn(256, 256)} for step in (1, 2)}
    for step, state in saved.items():
        save(state, cache, f"{run}/step-{step}")
    newest = f"{run}/step-2"
    key = commits(cache, KEYS).manifest_at(newest)[1]
    manifest = cache.get(key)
    assert manifest is not None
    chunks = [KEYS.chunk(run, d) for d in read_manifest(cache, f"{run}/step-1")["chunks"]]
    assert cache.delete(key)  # from the cache and object storage: the newest manifest is away
    with pytest.raises(RetentionBlocked, match="step-2"):
        apply_retention(cache, run, keep_last=1)
    assert None not in cache.locate_many(chunks)  # not one chunk deleted, not even the older one's own
    cache.put(key, manifest)  # back
    assert [e.name for e in list_checkpoints(cache, run)] == [f"{run}/step-1", newest]  # nothing retired either
    _assert_equal(saved[2], load(cache, newest, lease=0.5))
    wait_until(lambda: apply_retention(cache, run, keep_last=1) == [f"{run}/step-1"], 10, "step-1 freed")
    _assert_equal(saved[2], load(cache, newest))


def test_retention_deletes_nothing_while_a_kept_manifest_cannot_be_read(
    cache_server: Any, s3: Any, s3_prefix: str, tmp_path: Path
) -> None:
    retention_with_the_newest_manifest_away(_server(cache_server, s3, s3_prefix, tmp_path).client())


def _corrupt_l2_value(path: Path, key: bytes) -> None:
    env = lmdb.open(str(path), map_size=1 << 30, max_dbs=0)
    try:
        with env.begin(write=True) as txn:
            stored = txn.get(storage_key(key))
            assert stored is not None, "the chunk is in L2"
            record = bytearray(stored)
            record[-1] ^= 0xFF
            txn.put(storage_key(key), bytes(record))
    finally:
        env.close()


def test_a_corrupt_chunk_in_l2_is_repaired_from_s3(cache_server: Any, s3: Any, s3_prefix: str, tmp_path: Path) -> None:
    server = _server(cache_server, s3, s3_prefix, tmp_path, l1="0")
    cache = server.client()
    torch.manual_seed(6)
    state = {"encoder.weight": torch.randn(512, 512), "decoder.weight": torch.randn(512, 512)}
    name = f"{_run()}/step-7"
    save(state, cache, name)
    wait_until(lambda: checkpoint_status(cache, name).state == "uploaded", 30, "the checkpoint uploaded")
    digest = next(i for i in read_manifest(cache, name)["items"] if i["fqn"] == "decoder.weight")["chunks"][0]
    assert server.stop() == 0
    _corrupt_l2_value(tmp_path / "l2", KEYS.chunk(name.split("/")[0], digest))
    server.start()
    cache.wait_ready(30)

    _assert_equal(state, load(cache, name))
    assert cache.stats()["counters"].get("checksum_failures", 0) >= 1


def test_a_colocated_restore_after_a_restart_reads_the_chunks_from_the_servers_disk(
    cache_server: Any, s3: Any, s3_prefix: str, tmp_path: Path
) -> None:
    # Back from a restart, the server checks each cached copy against object storage (a HEAD) before it
    # serves it, and co-located readers skip the copies it has not checked: the first restore after a
    # restart went over gRPC, chunk by chunk. A chunk is named by its content hash, which the reader
    # checks, so the file's copy is the chunk whether the server checked it or not.
    server = _server(cache_server, s3, s3_prefix, tmp_path, l1="0")
    cache = server.client()
    state = _state_dict(*_training_state(seed=9))
    name = f"{_run()}/step-3"
    dcp.save(state, storage_writer=CacheStorageWriter(cache), checkpoint_id=name)
    wait_until(lambda: checkpoint_status(cache, name).state == "uploaded", 30, "the checkpoint uploaded")
    chunks = {digest for item in read_manifest(cache, name)["items"] for digest in item["chunks"]}
    assert len(chunks) >= 10
    assert server.stop() == 0
    server.start()
    cache.wait_ready(30)

    restored = _zeroed(state)
    dcp.load(restored, storage_reader=CacheStorageReader(cache), checkpoint_id=name)
    _assert_equal(state, restored)
    counters = cache.stats()["counters"]
    served = counters.get("hits_l2", 0) + counters.get("hits_l3", 0)
    assert served < len(chunks), f"the server served {served} reads of {len(chunks)} chunks: {counters}"
    assert counters.get("vouch_checks", 0) < len(chunks), counters


def test_a_corrupt_chunk_everywhere_fails_the_load_naming_the_tensor(
    cache_server: Any, s3: Any, s3_prefix: str, tmp_path: Path
) -> None:
    cache = _server(cache_server, s3, s3_prefix, tmp_path).client()
    torch.manual_seed(7)
    state = {"encoder.weight": torch.randn(512, 512), "decoder.weight": torch.randn(512, 512)}
    name = f"{_run()}/step-8"
    save(state, cache, name)
    wait_until(lambda: checkpoint_status(cache, name).state == "uploaded", 30, "the checkpoint uploaded")
    digest = next(i for i in read_manifest(cache, name)["items"] if i["fqn"] == "decoder.weight")["chunks"][0]
    key = KEYS.chunk(name.split("/")[0], digest)
    # Damage the only copy left: evict it from the cache, flip a byte in S3.
    assert cache.evict(key)
    raw = s3.client()
    obj = raw.get_object(Bucket=s3.bucket, Key=s3_prefix + key.decode())
    body = bytearray(obj["Body"].read() or b"")
    body[0] ^= 0xFF
    raw.put_object(Bucket=s3.bucket, Key=s3_prefix + key.decode(), Body=bytes(body), Metadata=obj["Metadata"])

    with pytest.raises(CheckpointException, match="CheckpointCorrupt.*tensor 'decoder.weight'") as raised:
        load(cache, name)
    assert "encoder.weight" not in str(raised.value)


def test_names_are_checked_and_a_missing_checkpoint_is_named(
    cache_server: Any, s3: Any, s3_prefix: str, tmp_path: Path
) -> None:
    for bad in ("no-run", "/abs/step", "run//step", "run/../x", "run/step~1", "run/.hidden", ""):
        assert not CacheStorageWriter.validate_checkpoint_id(bad), bad
    assert CacheStorageWriter.validate_checkpoint_id("team/llama-7b/step-1000")
    cache = _server(cache_server, s3, s3_prefix, tmp_path).client()
    with pytest.raises(CheckpointNotFound, match="nothing/here"):
        load(cache, "nothing/here")


def test_cachectl_checkpoints_ls_show_rm(
    cache_server: Any, s3: Any, s3_prefix: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = _server(cache_server, s3, s3_prefix, tmp_path)
    cache = server.client()
    run = _run()
    torch.manual_seed(8)
    for step in (1, 2):
        save({"w": torch.randn(300, 300), "b": torch.full((10,), float(step))}, cache, f"{run}/step-{step}")
    wait_until(lambda: checkpoint_status(cache, f"{run}/step-2").state == "uploaded", 30, "step-2 uploaded")

    def cachectl(*args: str) -> tuple[int, str]:
        capsys.readouterr()
        code = cachectl_main(["--cache", server.address, "checkpoints", *args])
        return code, capsys.readouterr().out

    # Step-2's chunks and manifest are uploaded; its run's index may still be only in the cache (written back):
    # `ls` lists the run all the same (a CI run listed nothing here when runs were found in object storage only).
    code, out = cachectl("ls", "--json")
    rows = {row["name"]: row for row in json.loads(out)}
    assert code == 0 and {f"{run}/step-1", f"{run}/step-2"} <= set(rows)
    assert rows[f"{run}/step-2"]["state"] == "uploaded" and rows[f"{run}/step-2"]["bytes"] == 300 * 300 * 4 + 40
    code, out = cachectl("ls", run)
    assert code == 0 and f"{run}/step-1" in out and "uploaded" in out
    code, out = cachectl("show", f"{run}/step-1", "--json")
    assert code == 0 and json.loads(out)["chunks_missing"] == 0
    code, out = cachectl("rm", f"{run}/step-1", "--json")
    assert code == 0 and json.loads(out) == {"deleted": [f"{run}/step-1"]}
    assert cachectl("show", f"{run}/step-1")[0] == 1
    assert [e.name for e in list_checkpoints(cache, run)] == [f"{run}/step-2"]
    assert torch.equal(load(cache, f"{run}/step-2")["b"], torch.full((10,), 2.0))


def test_cachectl_checkpoints_ls_lists_a_run_nothing_of_which_is_uploaded_yet(
    s3_gate: S3WriteGate,
    cache_server: Any,
    s3: Any,
    s3_prefix: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # S3 refuses every upload, so the run's index (and every chunk) is in the cache only: a run found
    # by listing object storage alone would be missing from `ls` (a fresh-clone CI run saw that).
    server = _server(cache_server, s3, s3_prefix, tmp_path, endpoint=s3_gate.endpoint)
    cache = server.client()
    run = _run()
    save({"w": torch.ones(64, 64)}, cache, f"{run}/step-1")
    wait_until(lambda: s3_gate.refused > 0, 30, "the server trying to upload")
    listing = s3.client().get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix=s3_prefix)
    assert not [obj["Key"] for page in listing for obj in page.get("Contents", [])], "nothing reached S3"
    capsys.readouterr()
    code = cachectl_main(["--cache", server.address, "checkpoints", "ls", "--json"])
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert code == 0 and f"{run}/step-1" in rows, f"ls listed {sorted(rows)}"
    assert rows[f"{run}/step-1"]["state"] == "in cache"
    assert [entry.name for entry in list_checkpoints(cache, run)] == [f"{run}/step-1"]


def test_the_docs_checkpoint_example_runs(cache_server: Any, s3: Any, s3_prefix: str, tmp_path: Path) -> None:
    server = _server(cache_server, s3, s3_prefix, tmp_path, l1="0")
    page = (Path(__file__).parent.parent / "docs" / "training.md").read_text()
    section = page[page.index("## Checkpoints through the cache") :]
    start = section.index("```python\n") + len("```python\n")
    code = section[start : section.index("```\n", start)]
    scope: dict[str, Any] = {}
    exec(compile(code.replace("127.0.0.1:7070", server.address), "docs/training.md", "exec"), scope)
    assert checkpoint_status(scope["cache"], "run1/step-1000").state in ("in cache", "uploaded")
    assert torch.equal(scope["state"]["model"]["weight"], scope["model"].weight)
