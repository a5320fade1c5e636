"""Hugging Face `transformers` adapter of `cacheclient.kv`.

Turns a model's cache object into per-layer (K, V) pairs for `KVCache.put`,
and pairs fetched by `KVCache.get` back into a cache object (`DynamicCache`
in transformers 5.x) that `model(...)` and `model.generate(...)` accept as
`cache=`. Decoder-only models whose layers all use full attention.

`generate` grows the cache it is given: build a fresh one per request. And
leave at least one prompt token out of the cache handed to `generate`
(`KVCache.get(ids, len(ids) - 1)` at most), or it feeds the prompt again.

This module needs torch and transformers; `cacheclient` itself imports neither.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from cacheclient.client import CacheClient
from cacheclient.kv import KVCache, KVLayout, KVPairs

__all__ = ["cache_from_kv", "kv_cache_for", "kv_from_cache", "layout_of"]


def layout_of(model: Any, *, dtype: torch.dtype | None = None, tp_rank: int = 0, tp_size: int = 1) -> KVLayout:
    """The KV layout of a transformers model (or its config, with `dtype` given).

    Raises:
        ValueError: the model has layers that are not full attention (sliding
            window, linear attention), whose cache these blocks cannot hold.
    """
    config = model.config if hasattr(model, "config") else model
    config = config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ValueError(f"only full-attention layers are supported, got layer types {sorted(set(layer_types))}")
    if dtype is None:
        if not hasattr(model, "dtype"):
            raise ValueError("pass dtype= with a config")
        dtype = model.dtype
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if kv_heads % tp_size:
        raise ValueError(f"{kv_heads} KV heads do not split over tp_size={tp_size}")
    return KVLayout(
        num_layers=config.num_hidden_layers,
        kv_heads=kv_heads // tp_size,
        head_dim=head_dim,
        dtype=str(dtype).removeprefix("torch."),
        tp_rank=tp_rank,
        tp_size=tp_size,
    )


def kv_cache_for(
    model: Any, cache: CacheClient | str, model_fingerprint: str, block_tokens: int = 256, **kwargs: Any
) -> KVCache:
    """A `KVCache` with the layout of `model`; `kwargs` go to `KVCache`."""
    return KVCache(cache, model_fingerprint, block_tokens, layout=layout_of(model), **kwargs)


def kv_from_cache(cache: Any) -> KVPairs:
    """Per-layer (K, V) of a transformers cache object after prefill (no copy)."""
    if hasattr(cache, "layers"):
        pairs = [(layer.keys, layer.values) for layer in cache.layers]
    else:  # a legacy tuple of (K, V) per layer
        pairs = [(k, v) for k, v, *_ in cache]
    if any(k is None or v is None for k, v in pairs):
        raise ValueError("the cache has layers that were never filled")
    return pairs


def cache_from_kv(kv: KVPairs, config: Any) -> DynamicCache:
    """A fresh `DynamicCache` holding `kv`, for `model(..., cache=)` or `generate(..., cache=)`.

    Read-only views from `KVCache.get` are fine here: the cache concatenates
    new tokens into new tensors and never writes into the ones it was given.
    """
    config = config.config if hasattr(config, "config") else config
    return DynamicCache(list(kv), config=config)
