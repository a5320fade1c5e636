"""A vLLM engine in a process of its own, for tests/test_vllm.py and bench/vllm_kv.py.

Runs with the vLLM venv's python (`.venv-vllm`, see the Makefile), never
the test runner's: vLLM pins other transformers and numpy releases.

    python tests/vllm_engine.py model DIR [--layers N --hidden N --seed N]
        saves a random Llama (fixed seed, fp32) that vLLM loads
    python tests/vllm_engine.py run --model DIR --prompts FILE [--connector JSON] [--new-tokens N]
        runs each prompt of FILE (`[{"id": ..., "tokens": [...]}, ...]`) in turn,
        greedy, and prints a JSON line per prompt: its tokens, its time to first
        token, and how vLLM counted its prompt tokens (computed here, found in
        vLLM's own prefix cache, loaded through the connector)

`--connector` is a KVTransferConfig as JSON (what `vllm serve
--kv-transfer-config` takes). `--pause FILE` waits, after the engine has
started, until FILE exists (a test does something to the cache meanwhile).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def make_model(directory: Path, layers: int, hidden: int, seed: int, vocab: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    heads = hidden // 32  # head dim 32: one the CPU attention kernels take
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=16384,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(directory)


def _counters(llm: Any) -> dict[str, float]:
    """vLLM's prompt-token counters by source (local_compute, local_cache_hit, external_kv_transfer)."""
    counts: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name == "vllm:prompt_tokens_by_source":
            source = metric.labels.get("source", "")
            counts[source] = counts.get(source, 0) + metric.value
    return counts


def run(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {}
    if args.connector:
        kwargs["kv_transfer_config"] = KVTransferConfig(**json.loads(args.connector))
    llm = LLM(
        model=str(args.model),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
        disable_log_stats=False,
        seed=0,
        **kwargs,
    )
    print(json.dumps({"event": "ready"}), flush=True)
    if args.pause:
        while not Path(args.pause).exists():
            time.sleep(0.05)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True)
    for prompt in json.loads(Path(args.prompts).read_text()):
        before = _counters(llm)
        ttft = None
        if args.ttft:
            began = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt["tokens"]}], first, use_tqdm=False)
            ttft = time.perf_counter() - began
            before = _counters(llm)
        out = llm.generate([{"prompt_token_ids": prompt["tokens"]}], params, use_tqdm=False)[0]
        after = _counters(llm)
        record = {
            "id": prompt["id"],
            "tokens": list(out.outputs[0].token_ids),
            "ttft_s": ttft,
            "prompt_tokens": {k: after.get(k, 0) - before.get(k, 0) for k in after},
        }
        print(json.dumps(record), flush=True)
        if args.reset_prefix_cache:
            llm.reset_prefix_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    model = sub.add_parser("model")
    model.add_argument("directory", type=Path)
    model.add_argument("--layers", type=int, default=2)
    model.add_argument("--hidden", type=int, default=128)
    model.add_argument("--vocab", type=int, default=1024)
    model.add_argument("--seed", type=int, default=0)
    go = sub.add_parser("run")
    go.add_argument("--model", type=Path, required=True)
    go.add_argument("--prompts", type=Path, required=True)
    go.add_argument("--connector", default="")
    go.add_argument("--new-tokens", type=int, default=8)
    go.add_argument("--max-model-len", type=int, default=4096)
    go.add_argument("--block-size", type=int, default=128)
    go.add_argument("--no-prefix-caching", action="store_true")
    go.add_argument("--reset-prefix-cache", action="store_true", help="after each prompt: no local hits across prompts")
    go.add_argument("--ttft", action="store_true", help="time a 1-token generate of each prompt first")
    go.add_argument("--pause", default="")
    args = parser.parse_args()
    if args.command == "model":
        make_model(args.directory, args.layers, args.hidden, args.seed, args.vocab)
    else:
        run(args)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
