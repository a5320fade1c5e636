"""Typed exceptions of the cache client, one per kind of failure a caller handles differently.

Each names its `ErrorKind`; a failed RPC raises the error of the kind its
status code reports in the wire contract's one table
(`cacheclient.wire.status`), the table the server answers with.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import grpc

from cacheclient.wire.names import OWNER_METADATA, PLACEMENT_VERSION_METADATA
from cacheclient.wire.status import ErrorKind, kind_of

__all__ = [
    "AuthError",
    "CacheClientError",
    "CorruptValueError",
    "DeadlineError",
    "InvalidRequestError",
    "LimitExceededError",
    "NotOwnerError",
    "ReplicasFailedError",
    "UnavailableError",
    "from_rpc_error",
    "from_status",
]


class CacheClientError(Exception):
    """Base of every error the client raises; `code` is the gRPC status, when there was one."""

    kind: ClassVar[ErrorKind | None] = None

    def __init__(self, message: str, code: grpc.StatusCode | None = None, request_id: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.request_id = request_id
        """The failed call's request id ("" if none): the server's log lines about the call carry it."""


class InvalidRequestError(CacheClientError):
    """The request is malformed: a bad key, for example (INVALID_ARGUMENT)."""

    kind = ErrorKind.INVALID_REQUEST


class LimitExceededError(CacheClientError):
    """A size or capacity limit was exceeded (RESOURCE_EXHAUSTED)."""

    kind = ErrorKind.LIMIT_EXCEEDED


class UnavailableError(CacheClientError):
    """The server, or the object storage behind it, cannot be reached (UNAVAILABLE)."""

    kind = ErrorKind.UNAVAILABLE


class ReplicasFailedError(UnavailableError):
    """A routed write (put, delete, evict) did not reach every replica the placement names for its keys.

    No node stood in for the replicas that failed. The replicas that answered
    did the write; the others hold what they held before, so a reader may get
    either until the write is retried and returns (see docs/cluster.md, "What
    a reader gets").

    Attributes:
        failed: Each replica that did not take the write -> why.
        keys: The keys the write did not reach on every replica of.
    """

    def __init__(self, message: str, failed: dict[str, str], keys: list[bytes]) -> None:
        super().__init__(message)
        self.failed = failed
        self.keys = keys


class DeadlineError(CacheClientError):
    """The call did not finish within its deadline (DEADLINE_EXCEEDED)."""

    kind = ErrorKind.DEADLINE


class CorruptValueError(CacheClientError):
    """Bytes failed their checksum in transit or in storage (DATA_LOSS)."""

    kind = ErrorKind.CORRUPT


class AuthError(CacheClientError):
    """The server wants a (different) token (UNAUTHENTICATED / PERMISSION_DENIED)."""

    kind = ErrorKind.AUTH


class NotOwnerError(CacheClientError):
    """A cache node does not own the key a routing client sent it (ABORTED).

    A routing client handles it by routing again; it reaches a caller only
    when that keeps failing.

    Attributes:
        owner: The owner by the node's map ("" if it named none).
        version: The node's placement version (0 if it named none).
    """

    kind = ErrorKind.NOT_OWNER

    def __init__(
        self, message: str, code: grpc.StatusCode | None = None, owner: str = "", version: int = 0, request_id: str = ""
    ) -> None:
        super().__init__(message, code, request_id)
        self.owner = owner
        self.version = version


_BY_KIND: dict[ErrorKind | None, type[CacheClientError]] = {
    cls.kind: cls
    for cls in (
        InvalidRequestError,
        LimitExceededError,
        UnavailableError,
        DeadlineError,
        CorruptValueError,
        AuthError,
        NotOwnerError,
    )
}


def from_rpc_error(error: grpc.RpcError, address: str, request_id: str = "") -> CacheClientError:
    """The typed exception for a failed RPC to `address`; its message ends with `request_id`, when given."""
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else str(error)
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    return from_status(code, details, trailing or (), address, request_id)


def from_status(
    code: grpc.StatusCode | None,
    details: str,
    trailing: Iterable[tuple[str, Any]],
    address: str,
    request_id: str = "",
) -> CacheClientError:
    """The typed exception for a call to `address` answered with `code`, `details` and `trailing` metadata
    (over gRPC, or by a co-located server's staging session)."""
    cls = _BY_KIND.get(kind_of(code), CacheClientError)
    name = code.name if code is not None else "ERROR"
    message = f"{address}: {name}: {details}" + (f" (request {request_id})" if request_id else "")
    if cls is NotOwnerError:
        metadata = dict(trailing)
        version = str(metadata.get(PLACEMENT_VERSION_METADATA, "0"))
        return NotOwnerError(
            message, code, str(metadata.get(OWNER_METADATA, "")), int(version) if version.isdigit() else 0, request_id
        )
    return cls(message, code, request_id)
