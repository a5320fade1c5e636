"""Checkpoints through a cluster: a three-node metadata shard, three cache servers, SeaweedFS, real DCP.

A routing client (`CacheClient(meta=...)`) spreads a checkpoint's chunks
over the nodes and commits it as a record in the metadata shard; the tests
check what a training job would notice: after a node holding chunks is
SIGKILLed, a fresh model restores the last checkpoint with equal tensors;
`cachectl --meta ... checkpoints` lists and shows it; the commit is a shard
record any client sees, which retention and `rm` delete; and a job killed
at its commit point leaves no checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402
from test_checkpoint import (  # noqa: E402
    S3WriteGate,
    _assert_equal,
    _run,
    _state_dict,
    _training_state,
    retention_with_the_newest_manifest_away,
)
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner  # noqa: E402

from cacheclient.checkpoint import (  # noqa: E402
    CacheStorageReader,
    CacheStorageWriter,
    CheckpointNotFound,
    apply_retention,
    checkpoint_status,
    delete_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load,
    save,
)
from cacheclient.checkpoint.catalog import CheckpointKeys, read_manifest  # noqa: E402
from cachesvc.commands.cachectl import main as cachectl_main  # noqa: E402

from conftest import CacheServer, Cluster, S3Server, running_cluster, wait_until  # noqa: E402

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

KEYS = CheckpointKeys()
REPLICATED = "rckpt/"
CONFIG = f"""
[[namespaces]]
prefix = "ckpt/"
write_mode = "write-back"

[[namespaces]]
prefix = "{REPLICATED}"
write_mode = "write-back"
replicas = 2
"""
SIZES = [("32MiB", "64MiB")] * 3


@pytest.fixture(scope="module")
def gate(s3: S3Server) -> Iterator[S3WriteGate]:
    """The servers' way to S3: open, unless a test holds uploads back."""
    gate = S3WriteGate(s3.endpoint).start()
    gate.closed = False
    yield gate
    gate.stop()


@pytest.fixture(scope="module")
def cluster(s3: S3Server, gate: S3WriteGate, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    base = tmp_path_factory.mktemp("ckpt-cluster")
    with running_cluster(s3, base, CONFIG, SIZES, replicas={REPLICATED: 2}, s3_endpoint=gate.endpoint) as c:
        yield c


def _holders(cluster: Cluster, keys: list[bytes]) -> Counter[str]:
    """How many of `keys` each running server's cache tiers hold, asked with plain clients (no routing)."""
    held: Counter[str] = Counter()
    for server in cluster.servers:
        if server.process is None or not server.process.alive():
            continue
        with server.client() as plain:
            held[server.address] += sum(plain.contains_many(keys, cached_only=True))
    return held


def _held_by(server: CacheServer, keys: list[bytes]) -> list[bytes]:
    """The keys of `keys` that `server`'s cache tiers hold."""
    with server.client() as plain:
        return [k for k, found in zip(keys, plain.contains_many(keys, cached_only=True), strict=True) if found]


def test_a_checkpoint_across_nodes_restores_into_a_fresh_model_after_a_node_is_sigkilled(cluster: Cluster) -> None:
    model, optimizer = _training_state(seed=11, layers=8)
    state = _state_dict(model, optimizer)
    name = f"{_run()}/step-100"
    run = name.split("/")[0]
    with cluster.client() as cache:
        dcp.save(state, storage_writer=CacheStorageWriter(cache), checkpoint_id=name)
        wait_until(lambda: checkpoint_status(cache, name).state == "uploaded", 60, "the checkpoint uploaded to S3")
        chunk_keys = [KEYS.chunk(run, d) for d in read_manifest(cache, name)["chunks"]]
    held = _holders(cluster, chunk_keys)
    assert all(held[s.address] for s in cluster.servers), held  # the checkpoint spans the nodes
    assert sum(held.values()) == len(chunk_keys), held  # each chunk on its owner alone
    victim = cluster.server(held.most_common(1)[0][0])
    victims_chunks = _held_by(victim, chunk_keys)
    victim.kill()  # SIGKILL by pid
    try:
        fresh_model, fresh_optimizer = _training_state(seed=12, layers=8)
        target = _state_dict(fresh_model, fresh_optimizer)
        with cluster.client() as cache:
            dcp.load(target, storage_reader=CacheStorageReader(cache), checkpoint_id=name)
            assert checkpoint_status(cache, name).state == "uploaded"
        fresh_model.load_state_dict(target["model"])
        fresh_optimizer.load_state_dict(target["optim"])
        _assert_equal(model.state_dict(), fresh_model.state_dict())
        _assert_equal(optimizer.state_dict(), fresh_optimizer.state_dict())
        _assert_equal(state["extra"], target["extra"])
        # What only the killed node held came from S3 through the survivors.
        assert sum(_holders(cluster, victims_chunks).values()) >= len(victims_chunks)
    finally:
        victim.start()
        cluster.wait_placement([s.address for s in cluster.servers], "the killed server to rejoin")


def test_cachectl_checkpoints_ls_and_show_through_the_shard(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run()
    torch.manual_seed(13)
    states = {step: {"w": torch.randn(600, 600), "b": torch.full((10,), float(step))} for step in (1, 2)}
    with cluster.client() as cache:
        for step, sd in states.items():
            save(sd, cache, f"{run}/step-{step}")
        wait_until(lambda: checkpoint_status(cache, f"{run}/step-2").state == "uploaded", 60, "step-2 uploaded")
        assert [e.name for e in list_checkpoints(cache, run)] == [f"{run}/step-1", f"{run}/step-2"]

    def cachectl(*args: str) -> tuple[int, str]:
        capsys.readouterr()
        code = cachectl_main(["--meta", ",".join(cluster.shard.addresses), "checkpoints", *args])
        return code, capsys.readouterr().out

    code, out = cachectl("ls", "--json")
    rows = {row["name"]: row for row in json.loads(out)}
    assert code == 0 and {f"{run}/step-1", f"{run}/step-2"} <= set(rows), out
    assert rows[f"{run}/step-2"]["state"] == "uploaded"
    assert rows[f"{run}/step-2"]["bytes"] == 600 * 600 * 4 + 40
    code, out = cachectl("ls", run)
    assert code == 0 and f"{run}/step-1" in out and "uploaded" in out
    code, out = cachectl("show", f"{run}/step-1", "--json")
    shown = json.loads(out)
    assert code == 0 and shown["chunks_missing"] == 0 and shown["chunks"] == shown["chunks_uploaded"] >= 1
    code, out = cachectl("rm", f"{run}/step-1", "--json")
    assert code == 0 and json.loads(out) == {"deleted": [f"{run}/step-1"]}
    assert cachectl("show", f"{run}/step-1")[0] == 1
    with cluster.client() as cache:
        assert [e.name for e in list_checkpoints(cache, run)] == [f"{run}/step-2"]
        _assert_equal(states[2], load(cache, f"{run}/step-2"))


def test_the_commit_is_a_record_in_the_metadata_shard_and_retention_deletes_it(cluster: Cluster) -> None:
    run = _run()
    names = [f"{run}/step-{step}" for step in (1, 2, 3)]
    torch.manual_seed(14)
    weights = {f"layer{i}": torch.randn(256, 256) for i in range(3)}
    saved = {}
    with cluster.client() as cache:
        for step, name in enumerate(names):
            weights[f"layer{step}"] = torch.randn(256, 256)  # one tensor of three changes each step
            saved[name] = {k: v.clone() for k, v in weights.items()}
            save(saved[name], cache, name)
        # Another client of the shard (not the saver's) sees each commit: a record
        # naming the manifest, its size and checksum. No run index is written.
        records = {name: cluster.meta.get_manifest(KEYS.commit_record(name)) for name in names}
        for name, record in records.items():
            assert record is not None and len(record.items) == 1, name
            item = record.items[0]
            assert item.key.encode().startswith(KEYS.manifest(name) + b"~")
            value = cache.get(item.key)
            assert value is not None and (item.size, item.checksum) == (len(value), xxhash.xxh3_64_intdigest(value))
        revisions = [records[name].revision for name in names]  # type: ignore[union-attr]
        assert revisions == sorted(revisions) and len(set(revisions)) == 3
        assert {KEYS.commit_record(n) for n in names} <= set(cluster.meta.list_manifests())
        assert cache.get(KEYS.index(run)) is None
        assert [e.name for e in list_checkpoints(cache, run)] == names
        assert latest_checkpoint(cache, run) == names[-1]

        step1 = read_manifest(cache, names[0])
        later = set().union(*(read_manifest(cache, n)["chunks"] for n in names[1:]))
        only_step1 = [KEYS.chunk(run, d) for d in set(step1["chunks"]) - later]
        assert only_step1
        assert apply_retention(cache, run, keep_last=2) == [names[0]]
        assert cluster.meta.get_manifest(KEYS.commit_record(names[0])) is None
        assert cache.get(records[names[0]].items[0].key) is None  # type: ignore[union-attr]
        assert cache.locate_many(only_step1) == [None] * len(only_step1)
        assert not [r for r in cluster.meta.list_manifests() if r.startswith(f"{KEYS.prefix}retired/{run}/")]

        # A load under way (its manifest read) when retention retires its
        # checkpoint: retired in the shard at once, deleted after the load's lease.
        reader = CacheStorageReader(cache, lease=5.0)  # ample on a loaded machine: retention runs next
        reader.reset(names[1])
        metadata = reader.read_metadata()
        assert apply_retention(cache, run, keep_last=1) == []
        assert [e.name for e in list_checkpoints(cache, run)] == [names[2]]
        assert checkpoint_status(cache, names[1]).state == "missing"
        target = {k: torch.zeros(256, 256) for k in weights}
        planner = DefaultLoadPlanner()
        reader.set_up_storage_reader(metadata, True)
        planner.set_up_planner(target, metadata, True)
        reader.read_data(reader.prepare_local_plan(planner.create_local_plan()), planner).wait()
        _assert_equal(saved[names[1]], target)
        wait_until(lambda: apply_retention(cache, run, keep_last=1) == [names[1]], 20, "step-2 freed after the lease")
        assert not [r for r in cluster.meta.list_manifests() if r.startswith(f"{KEYS.prefix}retired/{run}/")]

        # A checkpoint saved again under its name: the shard's record moves to the new manifest.
        weights["layer0"] = torch.randn(256, 256)
        save(weights, cache, names[2])
        record = cluster.meta.get_manifest(KEYS.commit_record(names[2]))
        assert record is not None and record.items[0].key != records[names[2]].items[0].key  # type: ignore[union-attr]
        _assert_equal(weights, load(cache, names[2], lease=2.0))
        assert delete_checkpoint(cache, names[2])
        assert cluster.meta.get_manifest(KEYS.commit_record(names[2])) is None
        assert list_checkpoints(cache, run) == [] and latest_checkpoint(cache, run) is None
        # The load above left its mark for its lease: the manifests go after it.
        wait_until(lambda: apply_retention(cache, run, keep_last=1) == [names[2]], 10, "step-3 freed after the lease")
        assert not [r for r in cluster.meta.list_manifests() if f"/{run}/~/" in r]
        assert cache.get(record.items[0].key) is None


def test_retention_through_the_shard_deletes_nothing_while_a_kept_manifest_cannot_be_read(cluster: Cluster) -> None:
    with cluster.client() as cache:
        retention_with_the_newest_manifest_away(cache)


def test_a_save_killed_before_its_commit_leaves_no_record_in_the_shard(cluster: Cluster) -> None:
    name = f"{_run()}/step-9"
    run = name.split("/")[0]
    script = str(Path(__file__).with_name("checkpoint_commit_pause.py"))
    job = subprocess.Popen(
        [sys.executable, script, ",".join(cluster.shard.addresses), name], stdout=subprocess.PIPE, text=True
    )
    try:
        assert job.stdout is not None
        manifest_key = job.stdout.readline().strip()  # the job is at its commit point
        assert manifest_key, f"the job exited ({job.wait(30)}) before its commit point"
    finally:
        job.kill()  # SIGKILL by pid
        job.wait(30)
    with cluster.client() as cache:
        assert cache.get(manifest_key) is not None, "the manifest and its chunks were stored"
        assert cluster.meta.get_manifest(KEYS.commit_record(name)) is None
        assert KEYS.commit_record(name) not in cluster.meta.list_manifests()
        assert checkpoint_status(cache, name).state == "missing"
        assert list_checkpoints(cache, run) == [] and latest_checkpoint(cache, run) is None
        with pytest.raises(CheckpointNotFound):
            load(cache, name)


def test_with_two_replicas_a_checkpoint_not_yet_uploaded_survives_a_node_sigkill(
    cluster: Cluster, gate: S3WriteGate
) -> None:
    model, optimizer = _training_state(seed=15, layers=6)
    state = _state_dict(model, optimizer)
    name = f"{_run()}/step-200"
    run = name.split("/")[0]
    keys = CheckpointKeys(REPLICATED)
    gate.closed = True  # S3 refuses every upload: the checkpoint lives in the cache alone
    refused = gate.refused
    victim: CacheServer | None = None
    try:
        with cluster.client() as cache:
            dcp.save(state, storage_writer=CacheStorageWriter(cache, prefix=REPLICATED), checkpoint_id=name)
            status = checkpoint_status(cache, name, keys=keys)
            assert status.state == "in cache" and status.chunks_uploaded == 0, status
            wait_until(lambda: gate.refused > refused, 30, "the servers trying to upload")
            chunk_keys = [keys.chunk(run, d) for d in read_manifest(cache, name, keys)["chunks"]]
        held = _holders(cluster, chunk_keys)
        assert sum(held.values()) == 2 * len(chunk_keys), held  # each chunk on two nodes
        victim = cluster.server(held.most_common(1)[0][0])
        victim.kill()  # SIGKILL by pid, before any upload
        fresh_model, fresh_optimizer = _training_state(seed=16, layers=6)
        target = _state_dict(fresh_model, fresh_optimizer)
        with cluster.client() as cache:
            dcp.load(target, storage_reader=CacheStorageReader(cache, prefix=REPLICATED), checkpoint_id=name)
        fresh_model.load_state_dict(target["model"])
        fresh_optimizer.load_state_dict(target["optim"])
        _assert_equal(model.state_dict(), fresh_model.state_dict())
        _assert_equal(optimizer.state_dict(), fresh_optimizer.state_dict())
    finally:
        gate.closed = False
        if victim is not None and victim.process is not None and not victim.process.alive():
            victim.start()
            cluster.wait_placement([s.address for s in cluster.servers], "the killed server to rejoin")
    with cluster.client() as cache:
        wait_until(
            lambda: checkpoint_status(cache, name, keys=keys).state == "uploaded", 60, "the upload after S3 came back"
        )
