"""Typed errors of the cache engine and tiers.

Each names its `kind` of failure; the wire contract's one status table
(`cacheclient.wire.status`) gives the gRPC status code a kind is answered with
(`cachesvc.server.status.status_of`), and the client raises its own error of
the same kind. Nothing else in the server decides status codes.
"""

from __future__ import annotations

from typing import ClassVar

from cacheclient.wire.names import OWNER_METADATA, PLACEMENT_VERSION_METADATA
from cacheclient.wire.status import ErrorKind

__all__ = [
    "Abandoned",
    "BehindPlacement",
    "CacheError",
    "ChecksumMismatch",
    "CorruptValue",
    "HoldersUnknown",
    "InvalidKey",
    "LeaseInDoubt",
    "LimitReached",
    "MalformedRequest",
    "NotConfigured",
    "NotOwner",
    "Overloaded",
    "Overwrite",
    "TierFull",
    "TierUnavailable",
    "ValueTooLarge",
    "WriteBackFull",
]


class CacheError(Exception):
    """Base of every error the cache raises on purpose."""

    kind: ClassVar[ErrorKind] = ErrorKind.INTERNAL


class Abandoned(CacheError):
    """The caller left (its RPC was cancelled, or its deadline passed) before its reads finished."""

    kind: ClassVar[ErrorKind] = ErrorKind.DEADLINE


class InvalidKey(CacheError):
    """A key is empty or longer than the limit."""

    kind: ClassVar[ErrorKind] = ErrorKind.INVALID_REQUEST


class MalformedRequest(CacheError):
    """A request's bytes do not parse as its message type (`cachesvc.rpc.MalformedRequests`)."""

    kind: ClassVar[ErrorKind] = ErrorKind.INVALID_REQUEST


class ValueTooLarge(CacheError):
    """A value is over the configured maximum (`max_value_bytes`)."""

    kind: ClassVar[ErrorKind] = ErrorKind.LIMIT_EXCEEDED


class ChecksumMismatch(CacheError):
    """A value sent by a client does not match the checksum sent with it."""

    kind: ClassVar[ErrorKind] = ErrorKind.CORRUPT


class CorruptValue(CacheError):
    """Bytes stored in a tier fail their checksum. The engine treats it as a miss."""

    kind: ClassVar[ErrorKind] = ErrorKind.CORRUPT

    def __init__(self, tier: str, key: bytes) -> None:
        super().__init__(f"{tier}: stored value for key {key[:64]!r} fails its xxh3 checksum")
        self.tier = tier
        self.key = key


class TierFull(CacheError):
    """A tier cannot take a value within its byte budget."""

    kind: ClassVar[ErrorKind] = ErrorKind.LIMIT_EXCEEDED


class TierUnavailable(CacheError):
    """A tier (in practice, object storage) cannot be reached."""

    kind: ClassVar[ErrorKind] = ErrorKind.UNAVAILABLE


class LimitReached(CacheError):
    """A configured count limit is reached: open prefetch plans, keys in a plan."""

    kind: ClassVar[ErrorKind] = ErrorKind.LIMIT_EXCEEDED


class Overloaded(CacheError):
    """A bounded queue is full and did not drain within the deadline."""

    kind: ClassVar[ErrorKind] = ErrorKind.UNAVAILABLE


class WriteBackFull(Overloaded):
    """The write-back queue stayed full until the put's caller had to be answered (its deadline, or the server's
    `io_timeout`): a limit of the server's (RESOURCE_EXHAUSTED), answered within the call's deadline."""

    kind: ClassVar[ErrorKind] = ErrorKind.LIMIT_EXCEEDED


class LeaseInDoubt(CacheError):
    """A co-located write to a cluster node that has not reached the metadata shard for half its lease: the
    shard may have given its keys to other nodes, so the write goes over gRPC (as a partition cuts it)."""

    kind: ClassVar[ErrorKind] = ErrorKind.UNAVAILABLE


class BehindPlacement(CacheError):
    """A routing client's write names a placement map newer than this server's, and the metadata shard did not
    give this server that map: the write is refused until it can fence the key's earlier owners by it."""

    kind: ClassVar[ErrorKind] = ErrorKind.UNAVAILABLE

    def __init__(self, key: bytes, held: int, routed: int) -> None:
        super().__init__(
            f"key {key[:64]!r}: the client routed this write by placement version {routed}, and this server holds "
            f"version {held} and could not fetch a newer one from the metadata shard; a write is taken only by a "
            "map this server holds, so that it fences the key's earlier owners first (retry once the shard answers)"
        )


class NotConfigured(CacheError):
    """The request needs a part this server does not have (object storage, say)."""

    kind: ClassVar[ErrorKind] = ErrorKind.FAILED_PRECONDITION


class Withheld(CacheError):
    """A write-back key whose newest value may be on a node that is down (`PlacementMap.withheld`): not served
    here until that node is back, or removed from the shard (`cachectl forget`), accepting the loss."""

    kind: ClassVar[ErrorKind] = ErrorKind.FAILED_PRECONDITION

    def __init__(self, key: bytes, holder: str) -> None:
        super().__init__(
            f"key {key[:64]!r} is withheld: {holder}, which may hold a newer write-back value of it that object "
            f"storage lacks, does not answer; it is served again once {holder} is back, or after "
            f"`cachectl forget {holder}` accepts the loss of what only it held"
        )
        self.holder = holder


class HoldersUnknown(CacheError):
    """A read of a write-back key another node owns (a fallback read, its client passed the owner over), and
    the metadata shard did not say whether that node holds a newer value of it than object storage. Refused as
    `Withheld` is (not UNAVAILABLE: this node is up, and a routing client would pass it over)."""

    kind: ClassVar[ErrorKind] = ErrorKind.FAILED_PRECONDITION

    def __init__(self, key: bytes, owner: str) -> None:
        super().__init__(
            f"key {key[:64]!r} is a write-back key of {owner or 'another node'}, which may hold a newer value "
            "than object storage, and the metadata shard did not answer whether it does: not served here "
            "(retry, or read it from its owner)"
        )


class Overwrite(CacheError):
    """A put over a key that exists, in a namespace declared immutable (its values are never rewritten in place)."""

    kind: ClassVar[ErrorKind] = ErrorKind.FAILED_PRECONDITION

    def __init__(self, key: bytes, prefix: bytes) -> None:
        super().__init__(
            f"key {key[:64]!r} exists, and namespace {prefix.decode(errors='replace')!r} is immutable: its values "
            "are never rewritten in place (write it under a new key)"
        )


class NotOwner(CacheError):
    """A routing client sent a key this server does not own (and does not hold, for a read).

    Answered with the owner and the server's map version in the trailing
    metadata, so a client with a stale map goes to the owner next.
    """

    kind: ClassVar[ErrorKind] = ErrorKind.NOT_OWNER

    def __init__(self, key: bytes, owner: str, version: int) -> None:
        super().__init__(f"key {key[:64]!r} belongs to {owner or 'no node'} (placement version {version})")
        self.owner = owner
        self.version = version

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """The owner and the map version, under their wire names."""
        return ((OWNER_METADATA, self.owner), (PLACEMENT_VERSION_METADATA, str(self.version)))
