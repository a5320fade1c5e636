"""Typed exceptions of the cache client, one per kind of failure a caller handles differently."""

from __future__ import annotations

import grpc

__all__ = [
    "AuthError",
    "CacheClientError",
    "CorruptValueError",
    "DeadlineError",
    "InvalidRequestError",
    "LimitExceededError",
    "UnavailableError",
    "from_rpc_error",
]


class CacheClientError(Exception):
    """Base of every error the client raises; `code` is the gRPC status, when there was one."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class InvalidRequestError(CacheClientError):
    """The request is malformed: a bad key, for example (INVALID_ARGUMENT)."""


class LimitExceededError(CacheClientError):
    """A size or capacity limit was exceeded (RESOURCE_EXHAUSTED)."""


class UnavailableError(CacheClientError):
    """The server, or the object storage behind it, cannot be reached (UNAVAILABLE)."""


class DeadlineError(CacheClientError):
    """The call did not finish within its deadline (DEADLINE_EXCEEDED)."""


class CorruptValueError(CacheClientError):
    """Bytes failed their checksum in transit or in storage (DATA_LOSS)."""


class AuthError(CacheClientError):
    """The server wants a (different) token (UNAUTHENTICATED / PERMISSION_DENIED)."""


_BY_CODE: dict[grpc.StatusCode, type[CacheClientError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: LimitExceededError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineError,
    grpc.StatusCode.DATA_LOSS: CorruptValueError,
    grpc.StatusCode.UNAUTHENTICATED: AuthError,
    grpc.StatusCode.PERMISSION_DENIED: AuthError,
}


def from_rpc_error(error: grpc.RpcError, address: str) -> CacheClientError:
    """The typed exception for a failed RPC to `address`."""
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else str(error)
    cls = _BY_CODE.get(code, CacheClientError) if code is not None else CacheClientError
    name = code.name if code is not None else "ERROR"
    return cls(f"{address}: {name}: {details}", code)
