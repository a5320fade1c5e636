"""Typed errors of the cache engine and tiers.

The gRPC servicer maps each to one status code (see `cachesvc.server.status`);
nothing else in the server decides status codes.
"""

from __future__ import annotations

__all__ = [
    "CacheError",
    "ChecksumMismatch",
    "CorruptValue",
    "InvalidKey",
    "NotConfigured",
    "Overloaded",
    "TierFull",
    "TierUnavailable",
    "ValueTooLarge",
]


class CacheError(Exception):
    """Base of every error the cache raises on purpose."""


class InvalidKey(CacheError):
    """A key is empty or longer than the limit."""


class ValueTooLarge(CacheError):
    """A value is over the configured maximum (`max_value_bytes`)."""


class ChecksumMismatch(CacheError):
    """A value sent by a client does not match the checksum sent with it."""


class CorruptValue(CacheError):
    """Bytes stored in a tier fail their checksum. The engine treats it as a miss."""

    def __init__(self, tier: str, key: bytes) -> None:
        super().__init__(f"{tier}: stored value for key {key[:64]!r} fails its xxh3 checksum")
        self.tier = tier
        self.key = key


class TierFull(CacheError):
    """A tier cannot take a value within its byte budget."""


class TierUnavailable(CacheError):
    """A tier (in practice, object storage) cannot be reached."""


class Overloaded(CacheError):
    """A bounded queue is full and did not drain within the deadline."""


class NotConfigured(CacheError):
    """The request needs a part this server does not have (object storage, say)."""
