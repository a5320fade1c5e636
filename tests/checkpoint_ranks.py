"""One rank of the two-rank DCP test (tests/test_checkpoint.py): save through the cache, load back, compare.

Run as `python tests/checkpoint_ranks.py CACHE_ADDRESS NAME` with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment (gloo). Each rank
saves a replicated model (DCP writes it once) and a tensor of its own, then
loads both into zeroed copies; exits 0 when every tensor came back equal.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from cacheclient import CacheClient
from cacheclient.checkpoint import CacheStorageReader, CacheStorageWriter


def state(rank: int, fill: float | None = None) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    shared = torch.randn(64, 128, generator=generator)
    own = torch.arange(1000, dtype=torch.float64) * (rank + 1)
    sd = {"shared.weight": shared, f"rank{rank}.own": own}
    if fill is not None:
        sd = {k: torch.full_like(v, fill) for k, v in sd.items()}
    return sd


def main() -> int:
    address, name = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cache = CacheClient(address)
    saved = state(rank)
    dcp.save(saved, storage_writer=CacheStorageWriter(cache), checkpoint_id=name)
    loaded = state(rank, fill=0.0)
    dcp.load(loaded, storage_reader=CacheStorageReader(cache), checkpoint_id=name)
    ok = all(torch.equal(saved[k], loaded[k]) for k in saved)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
