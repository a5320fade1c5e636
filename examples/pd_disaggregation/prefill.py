"""The prefill worker: computes each prompt's KV cache and puts it into cachesvc.

For each prompt it first loads the longest prefix already cached (a shared
system prompt, an earlier turn, another request's document), prefills only the
rest, and puts every full block with a lease, so the blocks stay in the cache
until the decode worker reads them (or the lease ends). It never talks to the
decode worker: the cache is the only channel between them.

    python examples/pd_disaggregation/prefill.py --cache 127.0.0.1:7070 --random 300,1000

Prints one JSON line per prompt: its id, its length, the tokens loaded from
the cache and computed here, and the tokens stored.
"""

from __future__ import annotations

import json
import time

import torch
from _common import load_prompts, make_kv_cache, parser
from model import build_model
from transformers import DynamicCache

from cacheclient.hf import cache_from_kv, kv_from_cache


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--lease", type=float, default=60.0, help="seconds each block stays pinned for the decode worker")
    args = p.parse_args()
    model = build_model()
    # Reading a shared prefix must not unpin it: a decode worker may not have read it yet.
    kv = make_kv_cache(model, args, lease=args.lease, release_on_read=False)
    for prompt in load_prompts(args):
        start = time.perf_counter()
        ids = torch.tensor([prompt["tokens"]])
        n = ids.shape[1]
        # The longest cached prefix, found and fetched in one pass; at least
        # one token is computed here, so the forward pass has an input.
        loaded, pairs = kv.fetch(ids, max_tokens=n - 1)
        cache = cache_from_kv(pairs, model.config) if pairs is not None else DynamicCache(config=model.config)
        with torch.no_grad():
            out = model(ids[:, loaded:], cache=cache, use_cache=True, logits_to_keep=1)
        stored = kv.put(ids, kv_from_cache(out.cache))
        record = {
            "id": prompt["id"],
            "prompt_tokens": n,
            "loaded_tokens": loaded,
            "computed_tokens": n - loaded,
            "stored_tokens": stored,
            "seconds": round(time.perf_counter() - start, 4),
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
