"""Range keys in the S3 tier: the bytes of one range of an object, read with ranged GETs.

A range key (`cacheclient.wire.ranges`) names bytes START..END of the object
cached as its object key. `S3Tier.get` hands such keys here, with itself as
the `ObjectStorage` to read through (this module never imports the tier): the range is
read with one ranged GET when it fits in a part (`part_bytes`), otherwise
in parts read in parallel, each pinned to the first response's ETag
(If-Match), so a range never mixes two versions of an object; an object
replaced between parts is read again, up to `max_attempts` times. The value
is checksummed (xxh3-64) as read, as for objects without our metadata: a
range cannot be checked against the object's MD5 ETag or our metadata,
which cover the whole object.

Errors: a range longer than `max_value_bytes` is `ValueTooLarge` before any
request; a range that ends past the object is `InvalidKey`, naming the
object's size; a missing object is a miss (None).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import botocore.exceptions
import obstore
from obstore.exceptions import GenericError, PreconditionError

from cacheclient.wire.ranges import ByteRange
from cacheclient.wire.record import checksum as xxh3
from cacheclient.wire.s3 import META_CHECKSUM, NOT_FOUND_CODES, error_code, foreign_object_name, object_name
from cachesvc.errors import InvalidKey, ValueTooLarge
from cachesvc.tiers.base import Entry

if TYPE_CHECKING:
    from obstore.store import S3Store

__all__ = ["MISSING", "ObjectStorage", "contains_range", "get_range"]

T = TypeVar("T")

MISSING = (FileNotFoundError, obstore.exceptions.NotFoundError)
"""What obstore raises for a 404 (0.12 raises the builtin FileNotFoundError, not the NotFoundError it declares)."""


class ObjectStorage(Protocol):
    """The object requests a range read is made of: `cachesvc.tiers.s3.S3Tier` is one."""

    @property
    def name(self) -> str:
        """The tier's name, in messages."""
        ...

    @property
    def prefix(self) -> str:
        """The prefix of every object name (`cacheclient.wire.s3.object_name`)."""
        ...

    @property
    def bucket(self) -> str: ...

    @property
    def max_value_bytes(self) -> int: ...

    @property
    def max_attempts(self) -> int:
        """Reads of an object replaced while its parts were read, before giving up."""
        ...

    @property
    def part_bytes(self) -> int:
        """The bytes one ranged GET reads."""
        ...

    def obstore_for(self, name: str) -> S3Store | None:
        """The obstore store to read object `name` through; None: read it with boto3."""
        ...

    def call(self, op: str, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` as request `op`, through the tier's breaker."""
        ...

    def read_part(self, store: S3Store, name: str, etag: str, start: int, end: int) -> obstore.Bytes:
        """Bytes `start`..`end` (exclusive) of object `name` while its ETag is `etag`."""
        ...

    def part_workers(self) -> ThreadPoolExecutor:
        """The pool that reads parts in parallel."""
        ...

    def boto3_client(self) -> Any: ...

    def object_size(self, name: str) -> int | None:
        """The size of object `name` (one HEAD); None when it does not exist."""
        ...

    def foreign_head(self, key: bytes) -> dict[str, Any] | None:
        """The HEAD of another tool's object of `key` ("a//b"); None when there is none."""
        ...


def _past_end(tier: ObjectStorage, name: str, r: ByteRange, size: int | None) -> InvalidKey:
    where = f"object {name!r}" + (f" ({size} bytes)" if size is not None else "")
    return InvalidKey(f"{tier.name}: range {r.header()} ends past the end of {where}")


def _check_length(tier: ObjectStorage, r: ByteRange) -> None:
    if r.length > tier.max_value_bytes:
        raise ValueTooLarge(
            f"{tier.name}: range {r.header()} is {r.length} bytes, over max_value_bytes={tier.max_value_bytes}"
        )


def get_range(tier: ObjectStorage, r: ByteRange) -> Entry | None:
    """The bytes of range `r`, checksummed; None when the object is missing.

    Raises:
        ValueTooLarge: the range is longer than `max_value_bytes`.
        InvalidKey: the range ends past the end of the object.
        TierUnavailable: object storage cannot be reached.
    """
    _check_length(tier, r)
    entry = _get_named(tier, object_name(tier.prefix, r.key), r)
    foreign = foreign_object_name(tier.prefix, r.key) if entry is None else None
    # A range of another tool's object (a model file named "a//b").
    return entry if foreign is None else _get_boto3(tier, foreign, r, foreign=True)


def _get_named(tier: ObjectStorage, name: str, r: ByteRange) -> Entry | None:
    store = tier.obstore_for(name)
    if store is None:
        return _get_boto3(tier, name, r)
    for attempt in range(1, tier.max_attempts + 1):
        try:
            return _get_obstore(tier, store, name, r)
        except PreconditionError:  # replaced between parts: read the new object's range
            if attempt == tier.max_attempts:
                raise
    raise AssertionError("unreachable")


def _get_obstore(tier: ObjectStorage, store: S3Store, name: str, r: ByteRange) -> Entry | None:
    stop = r.end + 1
    first_stop = min(stop, r.start + tier.part_bytes)
    try:
        first = tier.call("GET", obstore.get, store, name, options={"range": (r.start, first_stop)})
    except MISSING:  # the object's (a missing bucket is `NotConfigured`, from `call`)
        return None
    except GenericError as exc:
        if "status code: 416" in str(exc):
            raise _past_end(tier, name, r, None) from None
        raise
    size, etag = first.meta["size"], first.meta["e_tag"] or ""
    if stop > size:
        del first  # drops the connection rather than read a body we refuse
        raise _past_end(tier, name, r, size)
    head = tier.call("GET", first.bytes)
    if first_stop < stop:
        workers = tier.part_workers()
        futures = [
            workers.submit(tier.read_part, store, name, etag, start, min(start + tier.part_bytes, stop))
            for start in range(first_stop, stop, tier.part_bytes)
        ]
        value = b"".join([head, *(f.result() for f in futures)])
    else:
        value = bytes(head)
    if len(value) != r.length:
        raise InvalidKey(f"{tier.name}: range {r.header()} of object {name!r} read {len(value)} bytes")
    return Entry(value, xxh3(value))


def _get_boto3(tier: ObjectStorage, name: str, r: ByteRange, *, foreign: bool = False) -> Entry | None:
    """Range `r` of object `name` through boto3; with `foreign`, of a name only other tools write
    (`foreign_object_name`): an object there that carries the cache's checksum is another key's, a miss."""
    client = tier.boto3_client()
    try:
        response = tier.call("GetObject", client.get_object, Bucket=tier.bucket, Key=name, Range=r.header())
    except botocore.exceptions.ClientError as exc:
        code = error_code(exc)
        if code in NOT_FOUND_CODES:
            return None
        if code == "InvalidRange":
            raise _past_end(tier, name, r, None) from None
        raise
    if foreign and META_CHECKSUM in response.get("Metadata", {}):
        response["Body"].close()
        return None
    size = _size_of_content_range(response.get("ContentRange", ""))
    if size is not None and r.end >= size:
        response["Body"].close()
        raise _past_end(tier, name, r, size)
    value = tier.call("GetObject", response["Body"].read)
    if len(value) != r.length:
        raise InvalidKey(f"{tier.name}: range {r.header()} of object {name!r} read {len(value)} bytes")
    return Entry(value, xxh3(value))


def _size_of_content_range(header: str) -> int | None:
    """The object's size from a Content-Range header ("bytes 0-9/100"); None when not given."""
    _, _, total = header.rpartition("/")
    return int(total) if total.isdigit() else None


def contains_range(tier: ObjectStorage, r: ByteRange) -> bool:
    """Whether the object exists and holds every byte of range `r` (one HEAD; two for another tool's "a//b")."""
    size = tier.object_size(object_name(tier.prefix, r.key))
    if size is None:
        head = tier.foreign_head(r.key)
        size = None if head is None else int(head.get("ContentLength", 0))
    return size is not None and r.end < size
