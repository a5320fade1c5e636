"""`cacheclient.vllm.CacheConnector` in real vLLM engines (vLLM's CPU build) against real cache servers.

Each engine is a process of its own, run with the vLLM venv's python
(`.venv-vllm`, which `make test` builds: vLLM pins other transformers and
numpy releases than the test venv): `tests/vllm_engine.py` saves random
Llama models and runs prompts greedily, printing each prompt's tokens and
vLLM's own count of the prompt tokens it computed, found in its prefix cache
or loaded through the connector. Every output is compared with the same
model run without any connector.

Faults are injected between a connector's lookup and its load (the engine
pauses there, `--after-lookup`): a block corrupted, evicted, replaced by
another model's block, its server stopped or a cluster node SIGKILLed. Each
must end in vLLM recomputing what could not be loaded, with the same tokens.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from cacheclient import AuthError, CacheClient, NodeClient
from cacheclient.colocated import Colocated
from cacheclient.kv import KVCache, KVLayout, salt_segment

from conftest import CacheServer, S3Server, running_cluster, wait_until

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "tests" / "vllm_engine.py"
VLLM_PYTHON = Path(os.environ.get("CACHESVC_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
BLOCK = 128
NEW_TOKENS = 8
FINGERPRINT = "tiny-llama-0"
# The models vllm_engine.py saves: 2 layers, hidden 128, 4 heads of dim 32, 2 KV heads, fp32.
LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=32, dtype="float32")
KV_NAMESPACE = '[[namespaces]]\nprefix = "kv/"\nwrite_mode = "cache-only"\n'
SHARED = {"CACHESVC_L1_SHARED": "true"}

pytestmark = pytest.mark.timeout(300)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1024) for _ in range(n)]


_R1 = _tokens(600, 31)
PROMPTS = {
    "p700": _tokens(700, 1),
    "p1000": _tokens(1000, 2),
    **{f"f{i}": _tokens(520, 10 + i) for i in range(1, 5)},
    "r1": _R1,
    "r2": _R1[:384] + _tokens(250, 32),  # shares r1's first three blocks
    "c1": _tokens(900, 41),
}


def _full_blocks(prompt: list[int]) -> int:
    """Tokens the connector may load: full blocks, the last prompt token always computed."""
    return (len(prompt) - 1) // BLOCK * BLOCK


def _connector(role: str, address: str, *, key: str = "cache", **extra: Any) -> str:
    config = {
        "kv_connector": "CacheConnector",
        "kv_connector_module_path": "cacheclient.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {key: address, **extra},
    }
    return json.dumps(config)


def _prompt(name: str) -> dict[str, Any]:
    """A prompt of `PROMPTS` by name; "NAME@SALT" is that prompt with `cache_salt` SALT."""
    base, _, salt = name.partition("@")
    return {"id": name, "tokens": PROMPTS[base], **({"cache_salt": salt} if salt else {})}


def _engine_argv(model: Path, names: list[str], work: Path, *extra: str) -> list[str]:
    prompts = work / f"prompts-{'-'.join(names)}.json"
    prompts.write_text(json.dumps([_prompt(n) for n in names]))
    if not VLLM_PYTHON.exists():
        pytest.fail(f"no vLLM venv at {VLLM_PYTHON}: `make venv-vllm` builds it (`make test` does)", pytrace=False)
    return [
        str(VLLM_PYTHON), str(ENGINE), "run", "--model", str(model), "--prompts", str(prompts),
        "--new-tokens", str(NEW_TOKENS), "--block-size", str(BLOCK), "--reset-prefix-cache", *extra,
    ]  # fmt: skip


def _results(stdout: str) -> dict[str, dict[str, Any]]:
    records = [json.loads(line) for line in stdout.splitlines() if line.startswith('{"id"')]
    return {r["id"]: r for r in records}


def _run_engine(model: Path, names: list[str], work: Path, *extra: str) -> dict[str, dict[str, Any]]:
    done = subprocess.run(
        _engine_argv(model, names, work, *extra), capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, f"engine failed:\n{done.stdout[-2000:]}\n{done.stderr[-6000:]}"
    results = _results(done.stdout)
    assert sorted(results) == sorted(names), done.stdout[-2000:]
    return results


class PausedEngine:
    """An engine that stops after each connector lookup that found blocks until the test says go."""

    def __init__(
        self, model: Path, names: list[str], work: Path, connector: str, pause: str = "--after-lookup"
    ) -> None:
        self.pauses = work / "pauses"
        self.pauses.mkdir()
        argv = _engine_argv(model, names, work, "--connector", connector, pause, str(self.pauses))
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_lookup(self, n: int) -> str:
        """The id of the request whose lookup was the n-th (from 0) to find blocks."""
        looked = self.pauses / f"looked-{n}"
        wait_until(lambda: looked.exists() or self.proc.poll() is not None, 120, f"lookup {n}", interval=0.05)
        assert looked.exists(), f"engine exited before lookup {n}:\n{self.proc.communicate()[1][-6000:]}"
        return looked.read_text()

    def go(self, n: int) -> None:
        (self.pauses / f"go-{n}").touch()

    def wait_placed(self, n: int) -> None:
        """Until the n-th (from 0) load has copied its first block out of the arena, not yet checked it."""
        placed = self.pauses / f"placed-{n}"
        wait_until(lambda: placed.exists() or self.proc.poll() is not None, 120, f"load {n}", interval=0.05)
        assert placed.exists(), f"engine exited before load {n}:\n{self.proc.communicate()[1][-6000:]}"

    def go_placed(self, n: int) -> None:
        (self.pauses / f"go-placed-{n}").touch()

    def results(self) -> dict[str, dict[str, Any]]:
        out, err = self.proc.communicate(timeout=240)
        assert self.proc.returncode == 0, f"engine failed:\n{out[-2000:]}\n{err[-6000:]}"
        return _results(out)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two random models of one architecture (seeds 0 and 1), saved for vLLM."""
    base = tmp_path_factory.mktemp("vllm-models")
    paths = {"m0": base / "m0", "m1": base / "m1"}
    for seed, path in enumerate(paths.values()):
        argv = [str(VLLM_PYTHON), str(ENGINE), "model", str(path), "--seed", str(seed)]
        if not VLLM_PYTHON.exists():
            pytest.fail(f"no vLLM venv at {VLLM_PYTHON}: `make venv-vllm` builds it (`make test` does)", pytrace=False)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr[-4000:]
    return paths


@pytest.fixture(scope="module")
def reference(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """Every prompt's tokens from model m0 in vLLM with no connector and no prefix caching."""
    work = tmp_path_factory.mktemp("vllm-reference")
    results = _run_engine(models["m0"], list(PROMPTS), work, "--no-prefix-caching")
    return {name: r["tokens"] for name, r in results.items()}


@pytest.fixture
def kv_server(cache_server: Any, tmp_path: Path) -> CacheServer:
    config = tmp_path / "kv.toml"
    config.write_text(KV_NAMESPACE)
    server: CacheServer = cache_server("--l1-bytes", "256MiB", "--config", str(config))
    return server


@pytest.fixture
def shared_kv_server(cache_server: Any, tmp_path: Path) -> CacheServer:
    """A server whose L1 is shared memory: an engine on this machine reads blocks straight from its arena."""
    config = tmp_path / "kv.toml"
    config.write_text(KV_NAMESPACE)
    server: CacheServer = cache_server("--l1-bytes", "256MiB", "--config", str(config), env=SHARED)
    return server


def _block_keys(client: CacheClient, prompt: list[int]) -> list[bytes]:
    return KVCache(client, FINGERPRINT, BLOCK, layout=LAYOUT).block_keys(prompt[: _full_blocks(prompt)])


# -- prefill in one process, decode in another ---------------------------------


def test_a_consumer_loads_what_a_producer_stored_and_generates_the_same_tokens(
    models: dict[str, Path], reference: dict[str, list[int]], kv_server: CacheServer, tmp_path: Path
) -> None:
    names = ["p700", "p1000"]
    produced = _run_engine(models["m0"], names, tmp_path, "--connector", _connector("kv_producer", kv_server.address))
    consumed = _run_engine(models["m0"], names, tmp_path, "--connector", _connector("kv_consumer", kv_server.address))
    for name in names:
        prompt, loaded = PROMPTS[name], _full_blocks(PROMPTS[name])
        assert produced[name]["tokens"] == reference[name], name
        assert produced[name]["connector"]["stored_blocks"] == len(prompt) // BLOCK, name
        # The consumer loaded every full block but the one holding the last token, computed only the rest
        # (vLLM's own counters), and generated what vLLM generates without any connector.
        assert consumed[name]["connector"]["loaded_blocks"] == loaded // BLOCK, name
        assert consumed[name]["prompt_tokens"]["external_kv_transfer"] == loaded, name
        assert consumed[name]["prompt_tokens"]["local_compute"] == len(prompt) - loaded, name
        assert consumed[name]["tokens"] == reference[name], name
        assert produced[name]["prompt_tokens"]["local_compute"] == len(prompt), name

    # Another model of the same architecture (its fingerprint derived from its weights) finds none of them.
    other = _run_engine(models["m1"], names, tmp_path, "--connector", _connector("kv_consumer", kv_server.address))
    for name in names:
        assert other[name]["prompt_tokens"]["external_kv_transfer"] == 0, name
        assert other[name]["prompt_tokens"]["local_compute"] == len(PROMPTS[name]), name
        assert other[name]["connector"]["loaded_blocks"] == 0, name


def test_blocks_corrupt_evicted_from_another_model_or_unreachable_are_recomputed(
    models: dict[str, Path], reference: dict[str, list[int]], kv_server: CacheServer, tmp_path: Path
) -> None:
    names = ["f1", "f2", "f3", "f4"]
    extra = {"model_fingerprint": FINGERPRINT}
    _run_engine(models["m0"], names, tmp_path, "--connector", _connector("kv_producer", kv_server.address, **extra))
    client = kv_server.client()
    keys = {name: _block_keys(client, PROMPTS[name]) for name in names}
    assert all(client.contains_many(k) == [True] * 4 for k in keys.values())

    # Another model's block for f2's first block: the same tokens, another fingerprint, put under f2's key.
    other_kv = KVCache(client, "another-model", BLOCK, layout=LAYOUT)
    other_hash = other_kv.block_hashes(PROMPTS["f2"][:BLOCK])[0]
    other_value = other_kv.encode_block(other_hash, lambda k, v: (k.normal_(), v.normal_()))

    def corrupt(key: bytes) -> None:
        value = bytearray(client.get(key) or b"")
        value[len(value) // 2] ^= 0x40
        client.put(key, bytes(value))

    damage = {
        "f1": lambda: corrupt(keys["f1"][1]),  # a flipped bit in block 1
        "f2": lambda: client.put(keys["f2"][0], other_value),  # block 0: another model's
        "f3": lambda: client.delete(keys["f3"][2]),  # block 2: evicted since the lookup
        "f4": lambda: kv_server.stop(grace=5.0),  # the server, gone since the lookup
    }
    first_bad = {"f1": 1, "f2": 0, "f3": 2, "f4": 0}
    engine = PausedEngine(models["m0"], names, tmp_path, _connector("kv_consumer", kv_server.address, **extra))
    try:
        for n, name in enumerate(names):
            engine.wait_lookup(n)
            damage[name]()
            engine.go(n)
        consumed = engine.results()
    finally:
        engine.kill()
    for name in names:
        result, good = consumed[name], first_bad[name]
        assert result["tokens"] == reference[name], name
        assert result["connector"]["matched_tokens"] == 4 * BLOCK, name
        # Loaded up to the bad block; it and the blocks after it were reported to vLLM, which computed them.
        assert result["connector"]["loaded_blocks"] == good, name
        assert result["connector"]["failed_blocks"] == 4 - good, name


def test_one_engine_reuses_a_prefix_from_the_cache(
    models: dict[str, Path], reference: dict[str, list[int]], kv_server: CacheServer, tmp_path: Path
) -> None:
    # kv_both: r1 stores its blocks; r2, which shares r1's first three, loads them (vLLM's own prefix
    # cache is reset after each prompt, so only the connector can supply them).
    results = _run_engine(models["m0"], ["r1", "r2"], tmp_path, "--connector", _connector("kv_both", kv_server.address))
    assert results["r1"]["prompt_tokens"]["external_kv_transfer"] == 0
    assert results["r1"]["connector"]["stored_blocks"] == len(PROMPTS["r1"]) // BLOCK
    assert results["r2"]["prompt_tokens"]["external_kv_transfer"] == 3 * BLOCK
    assert results["r2"]["prompt_tokens"]["local_compute"] == len(PROMPTS["r2"]) - 3 * BLOCK
    assert results["r2"]["connector"]["stored_blocks"] == len(PROMPTS["r2"]) // BLOCK - 3
    for name in ("r1", "r2"):
        assert results[name]["tokens"] == reference[name], name


def test_asynchronous_loads_in_a_batch_with_uncached_requests_give_the_same_tokens(
    models: dict[str, Path], reference: dict[str, list[int]], kv_server: CacheServer, tmp_path: Path
) -> None:
    cached = ["p700", "p1000"]
    _run_engine(models["m0"], cached, tmp_path, "--connector", _connector("kv_producer", kv_server.address))
    # One generate call: two requests wait for their prefixes (load_kv_async) while two others compute theirs.
    names = ["p700", "f1", "p1000", "c1"]
    consumer = _connector("kv_consumer", kv_server.address, load_async=True)
    results = _run_engine(models["m0"], names, tmp_path, "--connector", consumer, "--batch")
    for name in names:
        assert results[name]["tokens"] == reference[name], name
    batch = results["p700"]["batch"]
    loaded = sum(_full_blocks(PROMPTS[name]) for name in cached)
    assert batch["prompt_tokens"]["external_kv_transfer"] == loaded
    assert batch["prompt_tokens"]["local_compute"] == sum(len(PROMPTS[n]) for n in names) - loaded
    assert batch["connector"]["loaded_blocks"] == loaded // BLOCK
    assert batch["connector"]["failed_blocks"] == 0


def test_a_block_the_server_rewrites_during_a_colocated_load_is_read_again(
    models: dict[str, Path], reference: dict[str, list[int]], shared_kv_server: CacheServer, tmp_path: Path
) -> None:
    server, names = shared_kv_server, ["f1", "f2"]
    extra = {"model_fingerprint": FINGERPRINT}
    _run_engine(models["m0"], names, tmp_path, "--connector", _connector("kv_producer", server.address, **extra))
    client = server.client()
    first = {name: _block_keys(client, PROMPTS[name])[0] for name in names}
    own = client.get(first["f2"])
    assert own is not None
    other_kv = KVCache(client, "another-model", BLOCK, layout=LAYOUT)
    other_hash = other_kv.block_hashes(PROMPTS["f1"][:BLOCK])[0]
    other_value = other_kv.encode_block(other_hash, lambda k, v: (k.normal_(), v.normal_()))
    # While each load has copied its first block out of the arena and not yet checked it, the server rewrites
    # that block: f1's with another model's block, f2's with its own bytes again (a new version all the same).
    rewrite = {"f1": lambda: client.put(first["f1"], other_value), "f2": lambda: client.put(first["f2"], own + b"")}
    consumer = _connector("kv_consumer", server.address, colocated=True, **extra)
    engine = PausedEngine(models["m0"], names, tmp_path, consumer, pause="--during-load")
    try:
        for n, name in enumerate(names):
            engine.wait_placed(n)
            rewrite[name]()
            engine.go_placed(n)
        consumed = engine.results()
    finally:
        engine.kill()
    for name in names:
        assert consumed[name]["tokens"] == reference[name], name
        assert consumed[name]["connector"]["reread_blocks"] == 1, name
    # f1's block read again is another model's: it and the blocks after it are recomputed; f2's loads.
    assert consumed["f1"]["connector"]["loaded_blocks"] == 0
    assert consumed["f1"]["connector"]["failed_blocks"] == 4
    assert consumed["f2"]["connector"]["loaded_blocks"] == 4
    assert consumed["f2"]["prompt_tokens"]["external_kv_transfer"] == 4 * BLOCK


def test_chunked_prefill_stores_and_loads_prefixes_longer_than_a_step(
    models: dict[str, Path], reference: dict[str, list[int]], kv_server: CacheServer, tmp_path: Path
) -> None:
    # vLLM's default: chunked prefill, here 256 tokens a step. r1 (600 tokens) is stored over three steps;
    # r2 loads the 384 tokens it shares with r1 (more than a step's budget) and computes its rest in chunks.
    budget = ("--max-num-batched-tokens", "256")
    connector = _connector("kv_both", kv_server.address)
    results = _run_engine(models["m0"], ["r1", "r2"], tmp_path, "--connector", connector, *budget)
    assert results["r1"]["connector"]["stored_blocks"] == len(PROMPTS["r1"]) // BLOCK
    assert results["r2"]["prompt_tokens"]["external_kv_transfer"] == 3 * BLOCK
    assert results["r2"]["prompt_tokens"]["local_compute"] == len(PROMPTS["r2"]) - 3 * BLOCK
    # A consumer loads c1's 768 tokens (three steps' budget) at once and computes the last 132.
    _run_engine(models["m0"], ["c1"], tmp_path, "--connector", _connector("kv_producer", kv_server.address), *budget)
    consumed = _run_engine(
        models["m0"], ["c1"], tmp_path, "--connector", _connector("kv_consumer", kv_server.address), *budget
    )
    assert consumed["c1"]["prompt_tokens"]["external_kv_transfer"] == _full_blocks(PROMPTS["c1"])
    for name, result in (("r1", results["r1"]), ("r2", results["r2"]), ("c1", consumed["c1"])):
        assert result["tokens"] == reference[name], name


def test_a_producer_does_not_send_blocks_the_cache_holds(
    models: dict[str, Path], reference: dict[str, list[int]], kv_server: CacheServer, tmp_path: Path
) -> None:
    names = ["p700", "p1000"]
    blocks = sum(len(PROMPTS[name]) // BLOCK for name in names)
    client = kv_server.client()
    first = _run_engine(models["m0"], names, tmp_path, "--connector", _connector("kv_producer", kv_server.address))
    assert sum(first[name]["connector"]["stored_blocks"] for name in names) == blocks
    puts = client.stats()["counters"]["puts"]
    assert puts >= blocks
    # Another producer of the same prompts: every block is held, none is sent (the server counts no put).
    again = _run_engine(models["m0"], names, tmp_path, "--connector", _connector("kv_producer", kv_server.address))
    for name in names:
        assert again[name]["tokens"] == reference[name], name
        assert again[name]["connector"]["stored_blocks"] == 0, name
        assert again[name]["connector"]["held_blocks"] == len(PROMPTS[name]) // BLOCK, name
    assert client.stats()["counters"]["puts"] == puts


# -- a cluster -------------------------------------------------------------------


def test_a_node_killed_between_prefill_and_decode_costs_a_recompute_not_a_token(
    models: dict[str, Path], reference: dict[str, list[int]], s3: S3Server, tmp_path: Path
) -> None:
    sizes = [("64MiB", "0")] * 3
    with running_cluster(s3, tmp_path, KV_NAMESPACE, sizes, meta_nodes=1) as cluster:
        meta = ",".join(cluster.shard.addresses)
        extra = {"model_fingerprint": FINGERPRINT}
        produced = _run_engine(
            models["m0"], ["c1"], tmp_path, "--connector", _connector("kv_producer", meta, key="meta", **extra)
        )
        assert produced["c1"]["connector"]["stored_blocks"] == len(PROMPTS["c1"]) // BLOCK
        placement = cluster.placement()
        with CacheClient(meta=meta) as client:
            owners = [placement.locate(key) for key in _block_keys(client, PROMPTS["c1"])]
        # The victim owns the first block with another owner than block 0 (or block 0's, if all share one):
        # the blocks before it load, the rest are recomputed.
        first_lost = next((i for i, owner in enumerate(owners) if owner != owners[0]), 0)
        engine = PausedEngine(models["m0"], ["c1"], tmp_path, _connector("kv_consumer", meta, key="meta", **extra))
        try:
            engine.wait_lookup(0)
            victim = cluster.server(owners[first_lost])
            assert victim.process is not None
            os.kill(victim.process.proc.pid, signal.SIGKILL)
            victim.process.proc.wait(timeout=10)
            engine.go(0)
            consumed = engine.results()
        finally:
            engine.kill()
    result = consumed["c1"]
    assert result["tokens"] == reference["c1"]
    assert result["connector"]["matched_tokens"] == _full_blocks(PROMPTS["c1"])
    assert result["connector"]["loaded_blocks"] == first_lost
    assert result["connector"]["failed_blocks"] == _full_blocks(PROMPTS["c1"]) // BLOCK - first_lost


def test_tenants_and_cache_salts_keep_identical_prompts_apart(
    models: dict[str, Path], reference: dict[str, list[int]], s3: S3Server, tmp_path: Path
) -> None:
    data, admin = "data-token-for-tests", "admin-token-for-tests"
    with running_cluster(s3, tmp_path, KV_NAMESPACE, [("64MiB", "0")], meta_nodes=1, tokens=(data, admin)) as cluster:
        meta = ",".join(cluster.shard.addresses)
        tokens = {name: _add_tenant(cluster, admin, name) for name in ("acme", "umbra")}
        wait_until(lambda: _knows(cluster, tokens["umbra"]), 10.0, "the node to know the tenants' tokens")

        # One engine of tenant acme: r2 shares r1's first three blocks, but with another salt it finds none
        # of them; with r1's salt it loads them.
        acme = _connector(
            "kv_both", meta, key="meta", tenant="acme", token=tokens["acme"], model_fingerprint=FINGERPRINT
        )
        results = _run_engine(models["m0"], ["r1@x", "r2@y", "r2@x"], tmp_path, "--connector", acme)
        for name, result in results.items():
            assert result["tokens"] == reference[name.partition("@")[0]], name
        assert results["r1@x"]["connector"]["stored_blocks"] == len(PROMPTS["r1"]) // BLOCK
        assert results["r2@y"]["prompt_tokens"]["external_kv_transfer"] == 0
        assert results["r2@y"]["connector"]["stored_blocks"] == len(PROMPTS["r2"]) // BLOCK
        assert results["r2@x"]["prompt_tokens"]["external_kv_transfer"] == 3 * BLOCK
        # The blocks lie under the tenant's prefix, in the salt's segment (a digest of it).
        with cluster.client(colocated=False) as client:
            salted = KVCache(client, FINGERPRINT, BLOCK, layout=LAYOUT, namespace="acme/kv/", salt="x")
            keys = salted.block_keys(PROMPTS["r1"])
            assert keys[0].startswith(f"acme/kv/{salt_segment('x')}".encode())
            assert client.contains_many(keys) == [True] * len(keys)
            assert list(client.list(b"kv/", cached=True)) == [], "nothing outside the tenant's prefix"

        # Another tenant, the same prompt and salt: nothing found.
        umbra = _connector("kv_consumer", meta, key="meta", tenant="umbra", token=tokens["umbra"])
        other = _run_engine(models["m0"], ["r1@x"], tmp_path, "--connector", umbra)
        assert other["r1@x"]["prompt_tokens"]["external_kv_transfer"] == 0
        assert other["r1@x"]["tokens"] == reference["r1"]

        # umbra's token with acme's namespace: the engine does not start, and says why.
        wrong = _connector("kv_consumer", meta, key="meta", tenant="acme", token=tokens["umbra"])
        argv = _engine_argv(models["m0"], ["r1"], tmp_path, "--connector", wrong)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)
        assert done.returncode != 0
        assert "may not reach the blocks' namespace 'acme/kv/'" in done.stderr, done.stderr[-4000:]
        assert "tenant 'umbra'" in done.stderr


def _add_tenant(cluster: Any, admin: str, name: str) -> str:
    """Adds tenant NAME owning `NAME/` with cachectl; returns its token (the last line of stdout)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHECTL_")}
    env.update(CACHECTL_META=",".join(cluster.shard.addresses), CACHECTL_ADMIN_TOKEN=admin)
    argv = [sys.executable, "-m", "cachesvc.commands.cachectl", "tenant", "add", name, "--prefix", f"{name}/"]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def _knows(cluster: Any, token: str) -> bool:
    """Whether every node knows a tenant's `token` (another's key is then PERMISSION_DENIED, not UNAUTHENTICATED)."""
    for server in cluster.servers:
        with NodeClient(server.address, timeout=5.0, token=token) as node:
            try:
                node.contains(b"nobody/probe")
            except AuthError as exc:
                if exc.code is grpc.StatusCode.UNAUTHENTICATED:
                    return False
    return True


# -- paged blocks, without an engine ---------------------------------------------------


@pytest.mark.parametrize("colocated", [False, True], ids=["grpc", "colocated"])
@pytest.mark.parametrize("backend", ["cpu", "flash_attn"])
def test_paged_blocks_land_whole_and_checked_from_the_stream_and_the_arena(
    cache_server: Any, tmp_path: Path, colocated: bool, backend: str
) -> None:
    import torch

    from cacheclient._paged import PagedBlocks
    from cacheclient.wire import tensors as records

    config = tmp_path / "kv.toml"
    config.write_text(KV_NAMESPACE)
    server: CacheServer = cache_server("--l1-bytes", "256MiB", "--config", str(config), env=SHARED)
    # The benchmark's larger model: 8 layers, 8 KV heads of dim 32, fp32: a 128-token block is 2 MiB, more
    # than one stream message (1 MiB), so over gRPC each block lands from pieces, runs split where they end.
    layout, blocks = KVLayout(num_layers=8, kv_heads=8, head_dim=32), 6
    shape = (blocks + 5, 8, BLOCK, 64) if backend == "cpu" else (2, blocks + 5, BLOCK, 8, 32)
    torch.manual_seed(0)
    source = [torch.randn(shape) for _ in range(8)]
    target = [torch.zeros(shape) for _ in range(8)]
    with server.client(colocated=colocated or False) as client:
        kv = KVCache(client, FINGERPRINT, BLOCK, layout=layout, release_on_read=False)
        pages, landing = PagedBlocks(kv, source, BLOCK), PagedBlocks(kv, target, BLOCK)
        assert pages.one_copy == (backend == "cpu")
        tokens = _tokens(blocks * BLOCK + 1, 5)
        hashes = kv.block_hashes(tokens)
        kv.put_blocks([(h, pages.encode(h, 2 + i)) for i, h in enumerate(hashes)])
        if colocated:  # each block written from the pages into the staging area, not sent over gRPC
            assert isinstance(client.transport, Colocated) and client.transport.counts["staged"] == blocks
        # Stored records are KVCache blocks: KVCache.get (the Hugging Face path) reads them as the pages held them.
        kv_pairs = kv.get(tokens, blocks * BLOCK)
        assert kv_pairs is not None
        if backend == "cpu":  # stored as the CPU pages hold a block: a layer's block is one run of the record
            ((entry, _),) = records.unpack(client.get(kv._key(hashes[0])) or b"", hashes[0])
            assert (entry.name, entry.shape) == ("kv_paged", (8, 8, 2, BLOCK, 32))
        view = pages.view
        for layer, (k, v) in enumerate(kv_pairs):
            for i in range(blocks):
                block = view(source[layer], 2 + i)
                assert torch.equal(k[0, :, i * BLOCK : (i + 1) * BLOCK], block[0])
                assert torch.equal(v[0, :, i * BLOCK : (i + 1) * BLOCK], block[1])
        if colocated:
            assert isinstance(client.transport, Colocated) and client.transport.shared_l1(wait=True) is not None
            client.get(kv._key(hashes[0]))  # the blocks are published in the arena by a read
        assert landing.load(hashes, [5 + i for i in range(blocks)], release=False) == blocks
        assert landing.counters["arena" if colocated else "streamed"] == blocks
        for layer in range(8):
            for i in range(blocks):
                assert torch.equal(view(target[layer], 5 + i), view(source[layer], 2 + i)), (layer, i)
        # A flipped bit in block 3: blocks 0-2 land, block 3 fails its checksum where it landed, and the load stops.
        value = bytearray(client.get(kv._key(hashes[3])) or b"")
        value[len(value) - 1000] ^= 0x10
        client.put(kv._key(hashes[3]), bytes(value))
        if colocated:
            client.get(kv._key(hashes[3]))
        assert landing.load(hashes, [5 + i for i in range(blocks)], release=False) == 3
        assert landing.counters["bad"] == 1
        # Blocks that KVCache.put stored (the fused layout: a Hugging Face producer's) land in the pages too.
        fused_tokens = _tokens(2 * BLOCK + 1, 6)
        fused = [(torch.randn(1, 8, 2 * BLOCK, 32), torch.randn(1, 8, 2 * BLOCK, 32)) for _ in range(8)]
        kv.put(fused_tokens, fused)
        fused_hashes = kv.block_hashes(fused_tokens)
        if colocated:
            client.get_many([kv._key(h) for h in fused_hashes])
        assert landing.load(fused_hashes, [0, 1], release=False) == 2
        for layer, (k, v) in enumerate(fused):
            for i in range(2):
                assert torch.equal(view(target[layer], i)[0], k[0, :, i * BLOCK : (i + 1) * BLOCK]), (layer, i)
                assert torch.equal(view(target[layer], i)[1], v[0, :, i * BLOCK : (i + 1) * BLOCK]), (layer, i)
        # And blocks a CPU engine stored (the paged layout) land in either backend's pages.
        cpu = [torch.randn(2, 8, BLOCK, 64) for _ in range(8)]
        cpu_pages = PagedBlocks(kv, cpu, BLOCK)
        cpu_tokens = _tokens(BLOCK + 1, 7)
        (cpu_hash,) = kv.block_hashes(cpu_tokens)
        kv.put_blocks([(cpu_hash, cpu_pages.encode(cpu_hash, 1))])
        if colocated:
            client.get(kv._key(cpu_hash))
        assert landing.load([cpu_hash], [4], release=False) == 1
        cpu_view = cpu_pages.view
        assert all(torch.equal(view(target[layer], 4), cpu_view(cpu[layer], 1)) for layer in range(8))


# -- load-time checks ----------------------------------------------------------------


def test_load_time_checks_versions_config_fingerprints_and_the_readme_config(models: dict[str, Path]) -> None:
    readme = (ROOT / "README.md").read_text()
    readme_config = re.search(r"```json\n(.*?)```", readme, re.DOTALL).group(1)  # type: ignore[union-attr]
    code = f"""
import json
import re
from cacheclient.vllm import ConnectorConfig, check_vllm_version, default_fingerprint, UnsupportedVLLMError

def raises(kind, pattern, call, *args):
    try:
        call(*args)
    except kind as exc:
        assert re.search(pattern, str(exc)), exc
    else:
        raise AssertionError(f"{{call.__name__}}{{args}} did not raise")

check_vllm_version("0.32.0")
raises(UnsupportedVLLMError, r">=0.32,<0.33.*found 0.33.0", check_vllm_version, "0.33.0")
raises(ValueError, r"unknown kv_connector_extra_config keys.*'cahce'", ConnectorConfig.from_extra, {{"cahce": "x:1"}})
raises(ValueError, r"one of", ConnectorConfig.from_extra, {{}})
raises(ValueError, r"tenant.s name, without", ConnectorConfig.from_extra, {{"cache": "x:1", "tenant": "a/b"}})
assert ConnectorConfig.from_extra({{"cache": "x:1", "tenant": "acme"}}).block_namespace == "acme/kv/"
assert ConnectorConfig.from_extra({{"cache": "x:1", "namespace": "t/kv/"}}).block_namespace == "t/kv/"
m0, m1 = "{models["m0"]}", "{models["m1"]}"
# The README's --kv-transfer-config is one vLLM takes.
from vllm.config import KVTransferConfig
config = KVTransferConfig(**json.loads({readme_config!r}))
assert config.kv_connector == "CacheConnector" and config.kv_load_failure_policy == "recompute"
assert default_fingerprint(m0, None, "float32") == default_fingerprint(m0, None, "float32")
assert default_fingerprint(m0, None, "float32") != default_fingerprint(m1, None, "float32")
"""
    done = subprocess.run([str(VLLM_PYTHON), "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
