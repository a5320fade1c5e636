"""cacheclient: the Python client of cachesvc.

`CacheClient(address)` talks to one cache server. The PyTorch datasets live
in `cacheclient.torch`; this package never imports `cachesvc`.
"""

from cacheclient._malloc import tune_malloc
from cacheclient.client import CacheClient
from cacheclient.errors import (
    AuthError,
    CacheClientError,
    CorruptValueError,
    DeadlineError,
    InvalidRequestError,
    LimitExceededError,
    NotOwnerError,
    UnavailableError,
)

__all__ = [
    "AuthError",
    "CacheClient",
    "CacheClientError",
    "CorruptValueError",
    "DeadlineError",
    "InvalidRequestError",
    "LimitExceededError",
    "NotOwnerError",
    "UnavailableError",
    "tune_malloc",
]
