"""A training job that is SIGKILLed at its checkpoint's commit point (tests/test_checkpoint_cluster.py).

Run as `python tests/checkpoint_commit_pause.py META_ADDRESSES NAME`. It
saves a model through a routing client; when the save is about to commit
(every chunk and the manifest stored and durable, the shard's commit record
not yet proposed) it prints the manifest's cache key and stops there, for
the test to kill it. Nothing is faked: the pause only holds the process at
that point, so the kill lands exactly between the manifest and its commit.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from cacheclient import CacheClient
from cacheclient.checkpoint import save
from cacheclient.meta import MetaClient

_propose = MetaClient.propose


def propose_then_pause(self: MetaClient, commands: Any, **kwargs: Any) -> Any:
    for command in commands:
        if command.WhichOneof("op") == "put_manifest" and "/manifests/" in command.put_manifest.manifest.name:
            print(command.put_manifest.manifest.items[0].key, flush=True)
            while True:
                time.sleep(60)
    return _propose(self, commands, **kwargs)


def main() -> int:
    meta, name = sys.argv[1], sys.argv[2]
    MetaClient.propose = propose_then_pause  # type: ignore[method-assign]
    torch.manual_seed(21)
    state = {f"layer{i}.weight": torch.randn(256, 256) for i in range(4)}
    save(state, CacheClient(meta=meta, timeout=20.0), name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
