"""The one table that maps the cache's typed errors to gRPC status codes."""

from __future__ import annotations

import grpc

from cachesvc import errors

__all__ = ["STATUS_OF", "status_of"]

STATUS_OF: dict[type[errors.CacheError], grpc.StatusCode] = {
    errors.InvalidKey: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ValueTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.ChecksumMismatch: grpc.StatusCode.DATA_LOSS,
    errors.CorruptValue: grpc.StatusCode.DATA_LOSS,
    errors.TierFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.TierUnavailable: grpc.StatusCode.UNAVAILABLE,
    errors.Overloaded: grpc.StatusCode.UNAVAILABLE,
    errors.NotConfigured: grpc.StatusCode.FAILED_PRECONDITION,
}


def status_of(error: BaseException) -> grpc.StatusCode:
    """The status code for an error; INTERNAL for anything not in the table."""
    for cls in type(error).__mro__:
        code = STATUS_OF.get(cls)  # type: ignore[call-overload]
        if code is not None:
            return code
    if isinstance(error, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.INTERNAL
