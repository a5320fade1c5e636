"""The one table between kinds of failure and gRPC status codes.

The server's typed errors (`cachesvc.errors`) and the client's typed errors
(`cacheclient.errors`) each name their `ErrorKind`; the server answers a
failure with `status_code(kind)` and the client raises the error of
`kind_of(code)`. Neither side writes a status code of its own.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

import grpc

__all__ = ["STATUS_CODES", "ErrorKind", "kind_of", "status_code"]


class ErrorKind(enum.Enum):
    """What went wrong, in terms a caller handles differently."""

    INVALID_REQUEST = "invalid_request"
    """The request is malformed: a bad key, for example. Retrying it cannot help."""
    LIMIT_EXCEEDED = "limit_exceeded"
    """A size or capacity limit was exceeded, or a bounded queue is full."""
    CORRUPT = "corrupt"
    """Bytes failed their checksum in transit or in storage."""
    UNAVAILABLE = "unavailable"
    """The server, or the object storage behind it, cannot be reached now."""
    DEADLINE = "deadline"
    """The call did not finish within its deadline."""
    FAILED_PRECONDITION = "failed_precondition"
    """The server cannot serve this request in its present state (no object storage configured; not the leader)."""
    NOT_OWNER = "not_owner"
    """The server does not own the key by the placement map; the answer names the owner and the map's version."""
    AUTH = "auth"
    """The server wants a (different) bearer token."""
    INTERNAL = "internal"
    """A bug: anything else."""


STATUS_CODES: Mapping[ErrorKind, tuple[grpc.StatusCode, ...]] = MappingProxyType(
    {
        ErrorKind.INVALID_REQUEST: (grpc.StatusCode.INVALID_ARGUMENT,),
        ErrorKind.LIMIT_EXCEEDED: (grpc.StatusCode.RESOURCE_EXHAUSTED,),
        ErrorKind.CORRUPT: (grpc.StatusCode.DATA_LOSS,),
        ErrorKind.UNAVAILABLE: (grpc.StatusCode.UNAVAILABLE,),
        ErrorKind.DEADLINE: (grpc.StatusCode.DEADLINE_EXCEEDED,),
        ErrorKind.FAILED_PRECONDITION: (grpc.StatusCode.FAILED_PRECONDITION,),
        # gRPC's guide: ABORTED when the client should retry at a higher level
        # (here: route the key again, by a newer map).
        ErrorKind.NOT_OWNER: (grpc.StatusCode.ABORTED,),
        # A proxy in front of the server may answer PERMISSION_DENIED.
        ErrorKind.AUTH: (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED),
        ErrorKind.INTERNAL: (grpc.StatusCode.INTERNAL,),
    }
)
"""Each kind's status codes: the first is the one a server sends, all of them read back as the kind."""

_KIND_OF: dict[grpc.StatusCode, ErrorKind] = {code: kind for kind, codes in STATUS_CODES.items() for code in codes}


def status_code(kind: ErrorKind) -> grpc.StatusCode:
    """The status code a server answers a failure of `kind` with."""
    return STATUS_CODES[kind][0]


def kind_of(code: grpc.StatusCode | None) -> ErrorKind | None:
    """The kind of failure a status code reports; None for a code outside the table (CANCELLED, say)."""
    return _KIND_OF.get(code) if code is not None else None
