"""Range keys in the S3 tier: the bytes of one range of an object, read with ranged GETs.

A range key (`cacheclient.wire.ranges`) names bytes START..END of the object
cached as its object key. `S3Tier.get` hands such keys here: the range is
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

from typing import TYPE_CHECKING

import botocore.exceptions
import obstore
from obstore.exceptions import GenericError, PreconditionError

from cacheclient.wire.ranges import ByteRange
from cacheclient.wire.record import checksum as xxh3
from cacheclient.wire.s3 import META_CHECKSUM, foreign_object_name, object_name
from cachesvc.errors import InvalidKey, ValueTooLarge
from cachesvc.tiers.base import Entry

if TYPE_CHECKING:
    from obstore.store import S3Store

    from cachesvc.tiers.s3 import S3Tier

__all__ = ["contains_range", "get_range"]

_NOT_FOUND_CODES = ("NoSuchKey", "404", "NotFound")
_MISSING = (FileNotFoundError, obstore.exceptions.NotFoundError)


def _past_end(tier: S3Tier, name: str, r: ByteRange, size: int | None) -> InvalidKey:
    where = f"object {name!r}" + (f" ({size} bytes)" if size is not None else "")
    return InvalidKey(f"{tier.name}: range {r.header()} ends past the end of {where}")


def _check_length(tier: S3Tier, r: ByteRange) -> None:
    if r.length > tier.max_value_bytes:
        raise ValueTooLarge(
            f"{tier.name}: range {r.header()} is {r.length} bytes, over max_value_bytes={tier.max_value_bytes}"
        )


def get_range(tier: S3Tier, r: ByteRange) -> Entry | None:
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


def _get_named(tier: S3Tier, name: str, r: ByteRange) -> Entry | None:
    store = tier._obstore_for(name)
    if store is None:
        return _get_boto3(tier, name, r)
    for attempt in range(1, tier._max_attempts + 1):
        try:
            return _get_obstore(tier, store, name, r)
        except PreconditionError:  # replaced between parts: read the new object's range
            if attempt == tier._max_attempts:
                raise
    raise AssertionError("unreachable")


def _get_obstore(tier: S3Tier, store: S3Store, name: str, r: ByteRange) -> Entry | None:
    stop = r.end + 1
    first_stop = min(stop, r.start + tier._part_bytes)
    try:
        first = tier._call("GET", obstore.get, store, name, options={"range": (r.start, first_stop)})
    except _MISSING as exc:
        if "<Code>NoSuchBucket</Code>" in str(exc):
            raise
        return None
    except GenericError as exc:
        if "status code: 416" in str(exc):
            raise _past_end(tier, name, r, None) from None
        raise
    size, etag = first.meta["size"], first.meta["e_tag"] or ""
    if stop > size:
        del first  # drops the connection rather than read a body we refuse
        raise _past_end(tier, name, r, size)
    head = tier._call("GET", first.bytes)
    if first_stop < stop:
        workers = tier._workers.get()
        futures = [
            workers.submit(tier._get_range, store, name, etag, start, min(start + tier._part_bytes, stop))
            for start in range(first_stop, stop, tier._part_bytes)
        ]
        value = b"".join([head, *(f.result() for f in futures)])
    else:
        value = bytes(head)
    if len(value) != r.length:
        raise InvalidKey(f"{tier.name}: range {r.header()} of object {name!r} read {len(value)} bytes")
    return Entry(value, xxh3(value))


def _get_boto3(tier: S3Tier, name: str, r: ByteRange, *, foreign: bool = False) -> Entry | None:
    """Range `r` of object `name` through boto3; with `foreign`, of a name only other tools write
    (`foreign_object_name`): an object there that carries the cache's checksum is another key's, a miss."""
    client = tier._boto3.get()
    try:
        response = tier._call("GetObject", client.get_object, Bucket=tier.bucket, Key=name, Range=r.header())
    except botocore.exceptions.ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in _NOT_FOUND_CODES:
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
    value = tier._call("GetObject", response["Body"].read)
    if len(value) != r.length:
        raise InvalidKey(f"{tier.name}: range {r.header()} of object {name!r} read {len(value)} bytes")
    return Entry(value, xxh3(value))


def _size_of_content_range(header: str) -> int | None:
    """The object's size from a Content-Range header ("bytes 0-9/100"); None when not given."""
    _, _, total = header.rpartition("/")
    return int(total) if total.isdigit() else None


def contains_range(tier: S3Tier, r: ByteRange) -> bool:
    """Whether the object exists and holds every byte of range `r` (one HEAD; two for another tool's "a//b")."""
    size = tier._object_size(object_name(tier.prefix, r.key))
    if size is None:
        head = tier._foreign_head(r.key)
        size = None if head is None else int(head.get("ContentLength", 0))
    return size is not None and r.end < size
