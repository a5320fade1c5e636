"""cacheclient: the Python client of cachesvc.

`CacheClient(address)` talks to one cache server, `CacheClient(meta=...)` to
a cluster; `connect` gives the client for an address or passes a client
through; `NodeClient` is the bare client of one server. The PyTorch datasets
live in `cacheclient.torch`; this package never imports `cachesvc`.
"""

from cacheclient._malloc import tune_malloc
from cacheclient.client import CacheClient, connect
from cacheclient.errors import (
    AuthError,
    CacheClientError,
    CorruptValueError,
    DeadlineError,
    InvalidRequestError,
    LimitExceededError,
    NotOwnerError,
    ReplicasFailedError,
    UnavailableError,
)
from cacheclient.node import NodeClient

__all__ = [
    "AuthError",
    "CacheClient",
    "CacheClientError",
    "CorruptValueError",
    "DeadlineError",
    "InvalidRequestError",
    "LimitExceededError",
    "NodeClient",
    "NotOwnerError",
    "ReplicasFailedError",
    "UnavailableError",
    "connect",
    "tune_malloc",
]
