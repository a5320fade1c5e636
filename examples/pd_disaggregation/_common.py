"""What both workers share: the command line, prompt files and the KVCache of the model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from model import BLOCK_TOKENS, FINGERPRINT, random_prompt

from cacheclient import CacheClient
from cacheclient.hf import kv_cache_for
from cacheclient.kv import KVCache

__all__ = ["load_prompts", "make_kv_cache", "parser"]


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--cache", help="cache server HOST:PORT")
    where.add_argument("--meta", help="a cluster's metadata shard HOST:PORT,... (blocks go to their owners)")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompts", type=Path, help='JSON file: [{"id": ..., "tokens": [...]}, ...]')
    group.add_argument("--random", help="comma-separated prompt lengths of random prompts, e.g. 300,1000")
    p.add_argument("--seed", type=int, default=1, help="seed of the first --random prompt (the next get seed+1, ...)")
    p.add_argument("--block-tokens", type=int, default=BLOCK_TOKENS)
    return p


def load_prompts(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The prompts to serve, as dicts with "id" and "tokens"."""
    if args.prompts is not None:
        prompts: list[dict[str, Any]] = json.loads(args.prompts.read_text())
        return prompts
    lengths = [int(n) for n in args.random.split(",")]
    return [{"id": f"p{i}", "tokens": random_prompt(n, args.seed + i)} for i, n in enumerate(lengths)]


def make_kv_cache(model: Any, args: argparse.Namespace, **kwargs: Any) -> KVCache:
    client = CacheClient(args.cache) if args.cache else CacheClient(meta=args.meta)
    client.wait_ready(timeout=30.0)
    return kv_cache_for(model, client, FINGERPRINT, args.block_tokens, **kwargs)
