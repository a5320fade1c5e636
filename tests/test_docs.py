"""The docs run: every ```python and ```sh block of README.md and examples/*.md, as written, against real servers.

A module fixture starts what `cachesvc up` would: a three-node metadata
shard, two cache servers registered with it (L1, L2, the tests' SeaweedFS
behind them under a prefix of their own, metrics on), and sample objects
under the prefixes the README reads. Each block then runs in a process of its own (a
Python block with the venv's interpreter, a shell block under `bash -e -o
pipefail`) from a scratch directory that has the repository's examples/
beside it; the README's default addresses (cache 127.0.0.1:7070 and 7071,
metadata 7080-7082, metrics 7170) and bucket (`s3://cachesvc/`) are
replaced by the ones the fixture picked, and cachectl's defaults point at
them too. A block that cannot run
here says why in a `<!-- not-run: REASON -->` line right before it; `toml`
blocks must load as cache-server config.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cachesvc.config import load_config
from cachesvc.devcluster.procs import free_port
from cachesvc.devcluster.shard import LocalShard

from conftest import CacheServer, s3_args, wait_until

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "examples").glob("**/*.md"))]
_FENCE = re.compile(r"^```(\w*)\s*$")
_NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(.+?)\s*-->\s*$")
MAX_NOT_RUN = 4
"""Blocks that may be illustrative only, across all the docs: keep it rare."""


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    code: str
    not_run: str | None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def code_blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, each with the not-run reason of the line before it (blank lines aside)."""
    blocks: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        start = i
        i += 1
        body: list[str] = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        before = start - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        reason = _NOT_RUN.match(lines[before]) if before >= 0 else None
        blocks.append(Block(path, start + 1, match.group(1), "\n".join(body) + "\n", reason and reason.group(1)))
        i += 1
    return blocks


ALL_BLOCKS = [block for path in DOCS for block in code_blocks(path)]
RUNNABLE = [block for block in ALL_BLOCKS if block.lang in ("python", "sh", "bash") and block.not_run is None]


def test_blocks_that_do_not_run_say_why_and_are_few() -> None:
    assert RUNNABLE, "no runnable block found: the extractor is broken"
    skipped = [block for block in ALL_BLOCKS if block.not_run is not None]
    assert len(skipped) <= MAX_NOT_RUN, [block.name for block in skipped]
    for block in ALL_BLOCKS:
        assert block.lang, f"{block.name}: a fence without a language (python, sh, toml, text)"


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.lang == "toml"], ids=lambda b: b.name)
def test_toml_blocks_are_valid_config(block: Block, tmp_path: Path) -> None:
    config = tmp_path / "block.toml"
    config.write_text(block.code)
    load_config(config, env={}, overrides={"s3.bucket": "b"})  # a namespace may need object storage


@dataclass
class Cluster:
    substitutions: dict[str, str]
    env: dict[str, str]


@pytest.fixture(scope="module")
def docs_cluster(s3: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    base = tmp_path_factory.mktemp("docs")
    prefix = f"docs-{base.name}/"
    objects = s3.client()
    for i in range(64):
        objects.put_object(Bucket=s3.bucket, Key=f"{prefix}imagenet/train/{i:05d}.jpg", Body=bytes([i]) * 3000)
    for i in range(8):
        objects.put_object(Bucket=s3.bucket, Key=f"{prefix}shards/{i:03d}.tar", Body=bytes([i]) * 1000)
    # The namespaces the README and the example set up: checkpoints write back, KV blocks stay in the cache.
    config = base / "cachesvc.toml"
    config.write_text(
        '[[namespaces]]\nprefix = "ckpt/"\nwrite_mode = "write-back"\n\n'
        + (ROOT / "examples/pd_disaggregation/kv.toml").read_text()
    )
    with LocalShard(3, base / "meta") as shard:
        shard.start()
        servers: list[CacheServer] = []
        metrics = f"127.0.0.1:{free_port()}"
        try:
            for i in range(2):
                args = [
                    "--config", str(config), "--l1-bytes", "256MiB", "--l2-path", str(base / f"l2-{i}"),
                    "--l2-bytes", "256MiB", *s3_args(s3, prefix),
                    "--meta", ",".join(shard.addresses), *(["--metrics-listen", metrics] if i == 0 else []),
                ]  # fmt: skip
                servers.append(CacheServer(args, base / "logs").start())
            nodes = shard.client(timeout=5.0)
            wait_until(
                lambda: set(nodes.placement(refresh=True).nodes) == {s.address for s in servers},
                30,
                "both cache servers in the placement",
                interval=0.2,
            )
            nodes.close()
            substitutions = {
                "127.0.0.1:7070": servers[0].address,
                "127.0.0.1:7071": servers[1].address,
                **{f"127.0.0.1:{7080 + i}": address for i, address in enumerate(shard.addresses)},
                "127.0.0.1:7170": metrics,
                "s3://cachesvc/": f"s3://{s3.bucket}/",
            }
            env = {
                "CACHECTL_CACHE": servers[0].address,
                "CACHECTL_META": ",".join(shard.addresses),
                "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                "AWS_ACCESS_KEY_ID": "cachesvc",
                "AWS_SECRET_ACCESS_KEY": "cachesvc-local-secret",
                "OMP_NUM_THREADS": "1",
            }
            yield Cluster(substitutions, env)
        finally:
            for server in servers:
                server.stop(grace=10.0)


def _runnable(block: Block, cluster: Cluster) -> str:
    code = block.code
    for default, actual in cluster.substitutions.items():
        code = code.replace(default, actual)
    return code


@pytest.mark.timeout(240)
@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.name)
def test_doc_block_runs(block: Block, docs_cluster: Cluster, tmp_path: Path) -> None:
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    code = _runnable(block, docs_cluster)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHECTL_")}
    env.update(docs_cluster.env)
    # A block of an example's page imports the example's modules, as its scripts do.
    env["PYTHONPATH"] = str(block.path.parent)
    shell = ["bash", "-e", "-o", "pipefail", "-c", code]
    argv = [sys.executable, "-c", code] if block.lang == "python" else shell
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)
    assert result.returncode == 0, (
        f"{block.name} ({block.lang}) exited {result.returncode}\n--- code ---\n{code}"
        f"--- stdout ---\n{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-5000:]}"
    )
