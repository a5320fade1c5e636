"""A vLLM engine in a process of its own, for tests/test_vllm.py and bench/vllm_kv.py.

Runs with the vLLM venv's python (`.venv-vllm`, see the Makefile), never
the test runner's: vLLM pins other transformers and numpy releases.

    python tests/vllm_engine.py model DIR [--layers N --hidden N --seed N]
        saves a random Llama (fixed seed, fp32) that vLLM loads
    python tests/vllm_engine.py run --model DIR --prompts FILE [--connector JSON] [--new-tokens N]
        runs each prompt of FILE (`[{"id": ..., "tokens": [...], "cache_salt": ...}, ...]`;
        the salt optional) in turn,
        greedy, and prints a JSON line per prompt: its tokens and how vLLM
        counted its prompt tokens (computed here, found in vLLM's own prefix
        cache, loaded through the connector)

`--connector` is a KVTransferConfig as JSON (what `vllm serve
--kv-transfer-config` takes); each prompt's line then also has the
`CacheConnector` counters it moved (summed over the scheduler's and the
worker's connector). `--after-lookup DIR` is the tests' fault injection: after
each connector lookup that found blocks, the engine writes DIR/looked-N and
waits for DIR/go-N, so a test can evict, corrupt or kill between the lookup
and the load. `--during-load DIR` pauses a load after its first block is
copied out of a co-located server's arena and before the arena's check
(DIR/placed-N, DIR/go-placed-N), so a test can rewrite the block meanwhile.
`--batch` runs every prompt in one `generate` call (one batch; each line then
has the batch's counters), `--max-num-batched-tokens` sets vLLM's per-step
token budget (chunked prefill when a prompt is longer).
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


def _track_connectors() -> list[Any]:
    """Every CacheConnector the engine makes, as it makes them (vLLM builds them from the class in the module)."""
    import cacheclient.vllm as connector_module

    made: list[Any] = []
    init = connector_module.CacheConnector.__init__

    def tracked(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    connector_module.CacheConnector.__init__ = tracked  # type: ignore[method-assign]
    return made


def _pause_after_lookups(directory: Path) -> None:
    import cacheclient.vllm as connector_module

    lookup = connector_module.CacheConnector.get_num_new_matched_tokens
    done = [0]

    def paused(self: Any, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        found = lookup(self, request, num_computed_tokens)
        if found[0]:
            n = done[0]
            done[0] += 1
            (directory / f"looked-{n}").write_text(request.request_id)
            deadline = time.monotonic() + 120
            while not (directory / f"go-{n}").exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nobody wrote {directory}/go-{n}")
                time.sleep(0.01)
        return found

    connector_module.CacheConnector.get_num_new_matched_tokens = paused  # type: ignore[method-assign]


def _pause_during_loads(directory: Path) -> None:
    from cacheclient._paged import PagedBlocks

    load, place = PagedBlocks.load, PagedBlocks._place
    done = [0]
    first = [False]

    def loading(self: Any, *args: Any, **kwargs: Any) -> int:
        first[0] = True
        return load(self, *args, **kwargs)

    def placing(self: Any, *args: Any) -> bool:
        placed = place(self, *args)
        if first[0]:
            first[0] = False
            n = done[0]
            done[0] += 1
            (directory / f"placed-{n}").write_text("")
            deadline = time.monotonic() + 120
            while not (directory / f"go-placed-{n}").exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nobody wrote {directory}/go-placed-{n}")
                time.sleep(0.01)
        return placed

    PagedBlocks.load = loading  # type: ignore[method-assign]
    PagedBlocks._place = placing  # type: ignore[method-assign]


def _connector_counters(connectors: list[Any]) -> dict[str, float]:
    total: dict[str, float] = {}
    for connector in connectors:
        for name, value in connector.counters.items():
            total[name] = total.get(name, 0) + value
    return total


def run(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {}
    connectors: list[Any] = []
    if args.connector:
        kwargs["kv_transfer_config"] = KVTransferConfig(**json.loads(args.connector))
        connectors = _track_connectors()
        if args.after_lookup:
            _pause_after_lookups(Path(args.after_lookup))
        if args.during_load:
            _pause_during_loads(Path(args.during_load))
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
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
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
    prompts = json.loads(Path(args.prompts).read_text())
    if args.batch:
        before = _counters(llm)
        outs = llm.generate([{"prompt_token_ids": p["tokens"]} for p in prompts], params, use_tqdm=False)
        after = _counters(llm)
        batch: dict[str, Any] = {"prompt_tokens": {k: after.get(k, 0) - before.get(k, 0) for k in after}}
        if connectors:
            batch["connector"] = _connector_counters(connectors)
        for prompt, out in zip(prompts, outs, strict=True):
            record = {"id": prompt["id"], "tokens": list(out.outputs[0].token_ids), "batch": batch}
            print(json.dumps(record), flush=True)
        return
    for prompt in prompts:
        connector_before = _connector_counters(connectors)
        before = _counters(llm)
        inputs: dict[str, Any] = {"prompt_token_ids": prompt["tokens"]}
        if prompt.get("cache_salt"):
            inputs["cache_salt"] = prompt["cache_salt"]
        out = llm.generate([inputs], params, use_tqdm=False)[0]
        after = _counters(llm)
        record = {
            "id": prompt["id"],
            "tokens": list(out.outputs[0].token_ids),
            "prompt_tokens": {k: after.get(k, 0) - before.get(k, 0) for k in after},
            "num_cached_tokens": out.num_cached_tokens,
        }
        if connectors:
            counters = _connector_counters(connectors)
            record["connector"] = {k: v - connector_before.get(k, 0) for k, v in counters.items()}
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
    go.add_argument("--after-lookup", default="")
    go.add_argument("--during-load", default="")
    go.add_argument("--batch", action="store_true", help="every prompt in one generate call")
    go.add_argument("--max-num-batched-tokens", type=int, default=0, help="0: vLLM's default")
    args = parser.parse_args()
    if args.command == "model":
        make_model(args.directory, args.layers, args.hidden, args.seed, args.vocab)
    else:
        run(args)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
