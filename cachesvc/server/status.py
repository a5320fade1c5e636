"""The status code the server answers an error with, from the wire contract's one table.

Every `cachesvc.errors.CacheError` names its kind of failure; the kind's code
comes from `cacheclient.wire.status.STATUS_CODES`, the table the client reads
back into its own typed errors.
"""

from __future__ import annotations

import grpc

from cacheclient.wire.status import ErrorKind, status_code
from cachesvc.errors import CacheError

__all__ = ["status_of"]


def status_of(error: BaseException) -> grpc.StatusCode:
    """The status code for an error: its kind's for a `CacheError`, DEADLINE_EXCEEDED for a timeout, else INTERNAL."""
    if isinstance(error, CacheError):
        return status_code(error.kind)
    if isinstance(error, TimeoutError):
        return status_code(ErrorKind.DEADLINE)
    return status_code(ErrorKind.INTERNAL)
