"""The KV path in a cluster: blocks go to their owners; a decode worker whose blocks' owner was SIGKILLed
loads the prefix up to the first lost block, recomputes the rest, and generates what one process generates."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_kv import EXAMPLE, KV_NAMESPACE, NEW_TOKENS, _example_model

from cacheclient import CacheClient
from cacheclient.hf import kv_cache_for

from conftest import S3Server, running_cluster

pytestmark = pytest.mark.timeout(300)


def _worker(script: str, meta: str, prompts: Path, *extra: str) -> dict[str, dict[str, Any]]:
    argv = [sys.executable, str(EXAMPLE / script), "--meta", meta, "--prompts", str(prompts), *extra]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, f"{script} failed:\n{done.stderr[-4000:]}"
    return {r["id"]: r for r in (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))}


def test_a_decode_worker_whose_kv_owner_died_recomputes_and_generates_the_same_tokens(
    s3: S3Server, tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    example = _example_model()
    prompts = {"p1300": example.random_prompt(1300, seed=21), "p2100": example.random_prompt(2100, seed=22)}
    prompt_file = tmp_path / "prompts.json"
    prompt_file.write_text(json.dumps([{"id": k, "tokens": v} for k, v in prompts.items()]))
    sizes = [("64MiB", "0"), ("64MiB", "0"), ("64MiB", "0")]
    with running_cluster(s3, tmp_path, KV_NAMESPACE, sizes, meta_nodes=1) as cluster:
        meta = ",".join(cluster.shard.addresses)
        prefill = _worker("prefill.py", meta, prompt_file, "--lease", "120")
        model = example.build_model(threads=1)
        placement = cluster.placement()
        with CacheClient(meta=meta) as client:
            kv = kv_cache_for(model, client, example.FINGERPRINT, example.BLOCK_TOKENS)
            owners = {name: [placement.locate(k) for k in kv.block_keys(ids)] for name, ids in prompts.items()}
            # Every block is in the cluster, each on its owner.
            for name, ids in prompts.items():
                assert prefill[name]["stored_tokens"] == len(ids) // 256 * 256
                assert client.contains_many(kv.block_keys(ids)) == [True] * len(owners[name])
        # The owner of p2100's second block dies (SIGKILL): its blocks are gone, the rest are not.
        victim = owners["p2100"][1]
        cluster.server(victim).kill()
        decode = _worker("decode.py", meta, prompt_file, "--new-tokens", str(NEW_TOKENS))
    with torch.no_grad():
        for name, ids in prompts.items():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
            assert decode[name]["tokens"] == out[0, len(ids) :].tolist(), name
            # Loaded up to the first block that lived on the dead node, then recomputed.
            blocks = owners[name]
            first_lost = blocks.index(victim) if victim in blocks else len(blocks)
            assert decode[name]["loaded_tokens"] == min(first_lost * 256, len(ids) - 1), (name, blocks, victim)
    assert decode["p2100"]["loaded_tokens"] <= 256
