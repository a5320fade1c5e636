"""The small decoder-only model that both workers of the example build.

A Llama-architecture model from a `transformers` config with random weights
from a fixed seed: every process that calls `build_model()` holds the same
weights, so its KV tensors are real and interchangeable, and nothing is
downloaded. `FINGERPRINT` names config and seed; a real deployment would name
the checkpoint (e.g. its hub revision or a hash of its weights).
"""

from __future__ import annotations

import hashlib
import json
import random

import torch
from transformers import LlamaConfig, LlamaForCausalLM

__all__ = ["BLOCK_TOKENS", "FINGERPRINT", "SEED", "build_model", "config", "random_prompt"]

SEED = 0
BLOCK_TOKENS = 256


def config() -> LlamaConfig:
    """4 layers, hidden 256, 8 query heads sharing 2 KV heads of dim 32: 2 KiB of fp32 KV per token."""
    return LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=16384,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        # Wider than the default 0.02, which leaves attention nearly uniform:
        # then the next token hardly depends on the context, and a wrong KV
        # would go unnoticed. At 0.1 one changed prompt token changes the output.
        initializer_range=0.1,
    )


def _fingerprint() -> str:
    described = json.dumps(config().to_dict(), sort_keys=True, default=str)
    return f"pd-example-llama/{hashlib.sha256(described.encode()).hexdigest()[:16]}/seed={SEED}"


FINGERPRINT = _fingerprint()


def build_model(threads: int | None = 1) -> LlamaForCausalLM:
    """The model in eval mode, weights from `SEED`.

    Args:
        threads: torch CPU threads; 1 keeps float results identical across
            processes (reductions split over threads add in another order).
    """
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config()).eval()
    # No EOS stop, so every run generates exactly the tokens asked for.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def random_prompt(n_tokens: int, seed: int) -> list[int]:
    """A prompt of `n_tokens` token ids drawn from `seed` (ids 3 and up: no BOS/EOS/pad)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 4096) for _ in range(n_tokens)]
