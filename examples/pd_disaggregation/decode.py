"""The decode worker: loads each prompt's KV cache from cachesvc and generates from it.

The prefill worker put the prompt's full blocks; this worker loads them (and
so releases their lease), prefills only the tokens past the last full block,
and decodes greedily. A prompt whose blocks are gone (evicted after the lease,
expired, or corrupt) is prefilled here in full: slower, never wrong.

    python examples/pd_disaggregation/decode.py --cache 127.0.0.1:7070 --random 300,1000 --new-tokens 16

Prints one JSON line per prompt: its id, the tokens loaded from the cache,
the time to the first token, and the generated token ids.
"""

from __future__ import annotations

import json
import time

import torch
from _common import load_prompts, make_kv_cache, parser
from model import build_model
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

from cacheclient.hf import cache_from_kv


class FirstTokenClock(BaseStreamer):
    """Notes when `generate` emits its first new token (its first `put` is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at = 0.0

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=16)
    args = p.parse_args()
    model = build_model()
    kv = make_kv_cache(model, args, release_on_read=True)
    for prompt in load_prompts(args):
        start = time.perf_counter()
        ids = torch.tensor([prompt["tokens"]])
        # Found and fetched in one pass; `generate` must see at least one
        # prompt token that is not in the cache.
        loaded, pairs = kv.fetch(ids, max_tokens=ids.shape[1] - 1)
        cache = cache_from_kv(pairs, model.config) if pairs is not None else DynamicCache(config=model.config)
        clock = FirstTokenClock()
        with torch.no_grad():
            out = model.generate(ids, cache=cache, max_new_tokens=args.new_tokens, do_sample=False, streamer=clock)
        ttft = clock.first_token_at - start
        record = {
            "id": prompt["id"],
            "prompt_tokens": ids.shape[1],
            "loaded_tokens": loaded,
            "ttft_s": round(ttft, 4),
            "tokens": out[0, ids.shape[1] :].tolist(),
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
