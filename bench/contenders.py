"""Checks that every contender the benchmarks compare against imports: `make bench-setup` runs it last.

Each benchmark imports its contenders lazily, inside the function that runs
them, so `bench/X.py --help` works without them and a missing one shows up
only minutes into a run. This imports them all up front and names, for each
missing module, the benchmark that needs it and how it is installed.

Usage:
    python bench/contenders.py        # exit 0: all import; 1: the missing ones are listed
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

__all__ = ["CONTENDERS", "missing"]

NO_DEPS = (
    "pip install --no-deps s3torchconnector==1.5.0 mosaicml-streaming==0.13.0 accelerate==1.15.0 (make bench-setup)"
)
EXTRA = "pip install -e '.[bench]' torch==2.13.0 (make bench-setup)"

CONTENDERS: list[tuple[str, str, str]] = [
    # (module, the benchmarks that import it, how it is installed)
    ("boto3", "dataloader, prefetch, s3_clients", "a cachesvc dependency"),
    ("obstore", "s3_clients", "a cachesvc dependency"),
    ("awscrt.s3", "s3_clients", EXTRA),
    ("s3torchconnector", "dataloader, prefetch, checkpoint", NO_DEPS),
    ("s3torchconnectorclient", "dataloader, prefetch, checkpoint", EXTRA),
    ("s3torchconnector.dcp", "checkpoint", NO_DEPS + " and tenacity: " + EXTRA),
    ("streaming", "dataloader", NO_DEPS + " and its codecs: " + EXTRA),
    ("libcachesim", "eviction", EXTRA),
    ("numpy", "eviction", EXTRA),
    ("matplotlib.pyplot", "dataloader, eviction, prefetch, smallvalues (plots)", EXTRA),
    ("PIL", "matplotlib's PNG output", EXTRA),
    ("safetensors.torch", "prefetch", "the dev extra (transformers)"),
    ("accelerate", "prefetch (the offloaded-inference anchor)", NO_DEPS + " and psutil: " + EXTRA),
    ("transformers", "prefetch, kvcache", "the dev extra"),
    ("torch.distributed.checkpoint", "checkpoint", "torch==2.13.0"),
]


def _import(module: str) -> None:
    if module == "streaming":
        # MosaicML streaming imports torchvision, which has no build for this torch here: the
        # benchmark stands in for it (dataloader.import_streaming), and so does this check.
        from dataloader import import_streaming

        import_streaming()
        return
    if module == "matplotlib.pyplot":
        import matplotlib

        matplotlib.use("Agg")
    importlib.import_module(module)


def missing() -> list[tuple[str, str, str, str]]:
    """(module, benchmarks, how to install, the error) for each contender that does not import."""
    failed = []
    for module, users, install in CONTENDERS:
        try:
            _import(module)
        except Exception as exc:  # an ImportError, or a package broken by a missing dependency of its own
            failed.append((module, users, install, f"{type(exc).__name__}: {exc}"))
    return failed


def main() -> int:
    failed = missing()
    for module, users, install, error in failed:
        print(f"missing {module} (for {users}): {error}\n    install: {install}", file=sys.stderr)
    if not failed:
        print(f"all {len(CONTENDERS)} benchmark contenders import")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
