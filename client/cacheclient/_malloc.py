"""Keeping glibc from handing large buffers back to the kernel after every call.

Moving a 1 MiB value through gRPC and protobuf holds two or three 1 MiB
buffers at once. glibc's default malloc returns such memory to the kernel
when it is freed and faults it back in on the next call: about 700 page
faults per 1 MiB get in a fresh process, which made a get 2.5x slower than
a bare gRPC echo (bench/tiers.py). Raising the mmap and trim thresholds
together keeps the memory in the process; setting only one makes it worse.
The cost is up to `trim_bytes` of free memory kept per malloc arena.

The same effect without code: GLIBC_TUNABLES=glibc.malloc.mmap_threshold=4194304:glibc.malloc.trim_threshold=33554432

A cache server raises the mmap threshold to `MAX_MMAP_BYTES` (glibc's
ceiling): its cold reads of shard parts hold buffers of 8 MiB (each S3 part
read) and 16 MiB (the part, its L2 record, LMDB's copy of it), and at 4 MiB
every one was a fresh mapping faulted in page by page (about 3 µs a page on
the 2-core VM the benchmarks run on: 1.3 GB/s), three or four times per byte
filled. Served from the heap they reuse memory already faulted in: a cold
epoch of 7 x 64 MiB tar shards through `CachedShardDataset` took 2.75-2.80 s
against 3.45 s (medians of three, in turn). The trim threshold stays: an
arena keeps no more freed memory than before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["tune_malloc"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MAX_MMAP_BYTES = 32 << 20
"""The highest mmap threshold glibc takes on a 64-bit machine (`DEFAULT_MMAP_THRESHOLD_MAX`)."""
_tuned = (0, 0)
"""The thresholds set so far (0: glibc's own)."""


def tune_malloc(mmap_bytes: int = 4 << 20, trim_bytes: int = 32 << 20) -> bool:
    """Raises glibc's mmap and trim thresholds for this process; returns whether it could.

    Does nothing (and returns False) off glibc. Safe to call more than once:
    a later call only raises them (a client made in a process before its
    server starts does not hold the server at a client's thresholds).
    """
    global _tuned
    mmap_bytes, trim_bytes = max(mmap_bytes, _tuned[0]), max(trim_bytes, _tuned[1])
    if _tuned == (mmap_bytes, trim_bytes):
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if not (mallopt(_M_MMAP_THRESHOLD, mmap_bytes) and mallopt(_M_TRIM_THRESHOLD, trim_bytes)):
        return False
    _tuned = (mmap_bytes, trim_bytes)
    return True
