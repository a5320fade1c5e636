"""Size limits both ends of the cache protocol enforce or plan around.

A client splits its batches and streams by these numbers and the server
refuses what goes past them, so they are defined here once.
"""

from __future__ import annotations

__all__ = [
    "CHUNK_BYTES",
    "GET_MANY_READ_BYTES",
    "INLINE_BYTES",
    "MAX_BATCH_KEYS",
    "MAX_KEY_BYTES",
    "MAX_MESSAGE_BYTES",
    "MAX_PLAN_KEYS",
    "MAX_PLAN_MESSAGE_KEYS",
    "META_MAX_MESSAGE_BYTES",
    "PUT_MANY_BYTES",
    "RESPONSE_BUDGET",
]

MAX_KEY_BYTES = 1024
"""Longest key, in bytes (keys are 1..MAX_KEY_BYTES bytes)."""

INLINE_BYTES = 3 << 20
"""Values up to this size travel inside one message; larger ones are streamed in chunks."""

CHUNK_BYTES = 1 << 20
"""Stream chunk size (1 MiB streams about 2.5x faster than 1 MiB unary calls here)."""

RESPONSE_BUDGET = 3 << 20
"""Bytes of values one GetMany response carries before the server defers the rest."""

MAX_MESSAGE_BYTES = INLINE_BYTES + (1 << 20)
"""gRPC message limit of the cache service: an inline value plus room for keys and headers."""

META_MAX_MESSAGE_BYTES = 256 << 20
"""gRPC message limit of the metadata service: a manifest, a node list or a Raft snapshot travels in one message."""

MAX_PLAN_KEYS = 1 << 21
"""Most keys one prefetch plan holds (the server keeps about 110 bytes per planned key besides the key)."""

MAX_PLAN_MESSAGE_KEYS = 1 << 14
"""Most keys one message of a prefetch plan carries; the client sends a longer plan in several."""

MAX_BATCH_KEYS = 4096
"""Most keys one GetMany, GetManyStream, ContainsMany or PutMany carries; the client splits larger batches."""

PUT_MANY_BYTES = INLINE_BYTES
"""Most bytes of values one PutMany carries; the client splits larger batches and streams larger values."""

GET_MANY_READ_BYTES = 64 << 20
"""Bytes of values one GetMany reads (about: the last read may pass it) before it answers the rest deferred, unread."""
