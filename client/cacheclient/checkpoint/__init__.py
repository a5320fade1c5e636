"""Checkpoints through the cache: PyTorch Distributed Checkpoint (DCP) storage on a cache server.

```python
import torch.distributed.checkpoint as dcp
from cacheclient.checkpoint import CacheStorageReader, CacheStorageWriter

dcp.save(state, storage_writer=CacheStorageWriter(cache), checkpoint_id="run1/step-1000")
dcp.load(state, storage_reader=CacheStorageReader(cache), checkpoint_id="run1/step-1000")
```

A save hands chunks to the cache at local speed; the server's write-back
uploads them to object storage, and `checkpoint_status` tells when that is
done. Chunks are named by content, so unchanged tensors are not sent again;
`keep_last=N` deletes what no kept checkpoint references. See
`cacheclient.checkpoint.catalog` for the layout and the commit protocol.

The DCP classes and `save`/`load` need torch and are imported on first use;
the catalog (status, listing, retention) does not, so admin tools use it
without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cacheclient.checkpoint.catalog import (
    CheckpointCorrupt,
    CheckpointEntry,
    CheckpointError,
    CheckpointNotFound,
    CheckpointStatus,
    Durability,
    RetentionBlocked,
    WriteStats,
    apply_retention,
    checkpoint_status,
    delete_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    list_runs,
)

if TYPE_CHECKING:
    from cacheclient.checkpoint.dcp import CacheStorageReader, CacheStorageWriter, load, save

__all__ = [
    "CacheStorageReader",
    "CacheStorageWriter",
    "CheckpointCorrupt",
    "CheckpointEntry",
    "CheckpointError",
    "CheckpointNotFound",
    "CheckpointStatus",
    "Durability",
    "RetentionBlocked",
    "WriteStats",
    "apply_retention",
    "checkpoint_status",
    "delete_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "list_runs",
    "load",
    "save",
]

_WITH_TORCH = frozenset({"CacheStorageReader", "CacheStorageWriter", "load", "save"})


def __getattr__(name: str) -> Any:
    if name in _WITH_TORCH:
        from cacheclient.checkpoint import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module 'cacheclient.checkpoint' has no attribute {name!r}")
