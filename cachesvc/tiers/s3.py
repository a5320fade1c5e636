"""L3: S3-compatible object storage (SeaweedFS here, MinIO or S3 in deployment).

Reads and writes go through obstore (Rust's object_store under a Python
binding): against boto3 it costs about a quarter of the client CPU per object
(`bench/s3_clients.py`), and an L3 fill is mostly client CPU on a cache
server. Listing (`scan`, `list_page`) stays on boto3, and so do two cases
obstore cannot serve, each read and written with one plain boto3 request:

* names object_store's paths cannot hold as they are (beginning or ending
  with "/", or with an empty, "." or ".." segment): it would refuse them or
  rewrite them into another object's name;
* a process forked after its parent started using obstore here: obstore
  runs every request on one tokio runtime per process, which a forked child
  inherits without its threads, so a request there would never return
  (tokio-rs/tokio#4301). Fork before the first request, or start workers
  with spawn or forkserver, to keep obstore in the children.

Objects are stored as the raw value bytes, so a dataset that someone else put
in the bucket reads through the cache unchanged. Object names and checksums
are the wire contract's (`cacheclient.wire.s3`), shared with the clients that
read the bucket directly: our writes add the value's xxh3-64 as object
metadata (`x-amz-meta-xxh3`), verified on read; objects written by others are
verified against their ETag when it is a plain MD5.

Large values: PUTs of `multipart_bytes` or more go up in parts of
`part_bytes`; GETs read the first `part_bytes` with a ranged GET, which also
gives the object's size, and fetch the remaining ranges in parallel, each
pinned to the first response's ETag (If-Match). An object replaced during
the read is read again from the start, up to `max_attempts` times. An object
larger than `max_value_bytes` is refused (`ValueTooLarge`) once the first
response's headers show its size, before its body is read.

Expiry: object storage keeps no expiry; `put` accepts `expires_at` and drops it.

Failures: every request has connect and read timeouts and at most
`max_attempts` attempts (object_store retries connection errors, timeouts
and 5xx answers with backoff; a body cut off or stalled past `read_timeout`
is read again too, so a stalled read fails after about `max_attempts` x
`read_timeout`). After a request fails without an answer from
the server, the tier fails fast (`TierUnavailable`) for `breaker_seconds`
instead of making every miss wait out the timeouts again. A 5xx answer that
outlasts the retries (503 SlowDown from a throttling server, 500 from a
failing one) is `TierUnavailable` too, and opens the breaker likewise, for
that kind of request only (reads, or writes): the server asked to be left
alone, and a bucket that throttles uploads still serves reads. A missing
bucket (NoSuchBucket) and a refused request (403 AccessDenied, which is
what SeaweedFS answers a PUT to a missing bucket) are `NotConfigured`,
naming the bucket: never a miss, which would hand readers None for data
only out of reach. Other errors the server answers propagate as they are.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import boto3
import botocore.exceptions
import obstore
from obstore.exceptions import GenericError, PreconditionError
from obstore.store import S3Store

from cacheclient.process_local import ProcessLocal
from cacheclient.wire.ranges import parse_range_key
from cacheclient.wire.record import checksum as xxh3
from cacheclient.wire.s3 import (
    META_CHECKSUM,
    NOT_FOUND_CODES,
    checksum_metadata,
    error_code,
    foreign_object_name,
    is_hashed_name,
    key_in_metadata,
    key_matches,
    key_of,
    object_matches,
    object_name,
    s3_config,
    version_in_metadata,
)
from cachesvc.errors import CorruptValue, InvalidKey, NotConfigured, TierUnavailable, ValueTooLarge
from cachesvc.tiers.base import Entry, ListedObject, ResidentKey
from cachesvc.tiers.s3_ranges import MISSING, contains_range, get_range

__all__ = ["S3Tier"]

T = TypeVar("T")

log = logging.getLogger(__name__)

# A response body cut off or stalled: botocore does not read it again.
_BOTO3_BODY_ERRORS = (
    botocore.exceptions.ResponseStreamingError,
    botocore.exceptions.IncompleteReadError,
    botocore.exceptions.ReadTimeoutError,
)
_BOTO3_CONNECTION_ERRORS = (
    botocore.exceptions.EndpointConnectionError,
    botocore.exceptions.ConnectTimeoutError,
    botocore.exceptions.ConnectionClosedError,
    *_BOTO3_BODY_ERRORS,
)
# object_store reports only in text whether the server answered: "Server
# returned non-2xx status code: 416 ..." when it did, "HTTP error: ..." when
# the connection failed (refused, timed out, cut off mid-body).
_STATUS = re.compile(r"Server returned non-2xx status code: (\d{3})")
_TRANSPORT_FAILURE = "HTTP error:"
# A ceiling on one whole request; `read_timeout` is what catches a stalled
# one. object_store's default (30 s) would cut off a healthy part on a slow link.
_REQUEST_TIMEOUT = datetime.timedelta(minutes=10)
# The process whose obstore runtime this module started (0: none yet); a forked child inherits the value.
_obstore_pid = 0


@dataclass(frozen=True, slots=True)
class _Obstore:
    """One process's obstore handle: None in a process forked after its parent's first request."""

    store: S3Store | None


_WRITES = frozenset({"PUT", "PutObject", "DELETE", "DeleteObject"})
"""The requests that write (`S3Tier.call`'s op names); the rest read."""


class S3Tier:
    """Values as objects in one bucket under one prefix.

    `bucket` may be reassigned (an operator restoring a bucket); the next
    request goes to the new one.
    """

    capacity_bytes: int | None = None

    def __init__(
        self,
        *,
        endpoint: str | None,
        bucket: str,
        prefix: str = "",
        region: str = "us-east-1",
        access_key: str | None = None,
        secret_key: str | None = None,
        connect_timeout: float = 2.0,
        read_timeout: float = 30.0,
        max_attempts: int = 3,
        part_bytes: int = 8 << 20,
        multipart_bytes: int = 16 << 20,
        max_concurrency: int = 4,
        breaker_seconds: float = 2.0,
        max_value_bytes: int = 256 << 20,
        name: str = "l3",
    ) -> None:
        self.name = name
        self.endpoint = endpoint
        self._bucket = bucket
        self.prefix = prefix
        self._region = region
        self._access_key = access_key
        self._secret_key = secret_key
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self.max_attempts = max_attempts
        self.part_bytes = part_bytes
        self._multipart_bytes = multipart_bytes
        self._max_concurrency = max_concurrency
        self._breaker_seconds = breaker_seconds
        self.max_value_bytes = max_value_bytes
        # The breaker, per kind of request: a 5xx to writes (a throttled bucket) leaves reads alone.
        self._down_until = {"read": 0.0, "write": 0.0}
        self._down_reason = {"read": "", "write": ""}
        # None of these may cross a fork: each process makes its own, lazily.
        self._store = ProcessLocal(self._open_store)
        self._workers = ProcessLocal(self._start_workers, _stop_workers)
        self._boto3 = ProcessLocal(self._open_boto3, _close_boto3)

    @property
    def bucket(self) -> str:
        return self._bucket

    @bucket.setter
    def bucket(self, bucket: str) -> None:
        self._bucket = bucket
        self._store.close()  # an S3Store is bound to its bucket: the next request opens one for this one

    def _open_store(self) -> _Obstore:
        global _obstore_pid
        if _obstore_pid not in (0, os.getpid()):
            log.warning(
                "%s: this process was forked after an obstore request in its parent; obstore cannot run here, "
                "so S3 reads and writes go through boto3 (slower). Start workers with spawn or forkserver.",
                self.name,
            )
            return _Obstore(None)
        _obstore_pid = os.getpid()
        config: dict[str, Any] = {"region": self._region}
        if self.endpoint:
            config["endpoint"] = self.endpoint
        if self._access_key is not None and self._secret_key is not None:
            config.update(access_key_id=self._access_key, secret_access_key=self._secret_key)
        else:
            session = boto3.session.Session()
            if session.get_credentials() is not None:  # boto3's chain: environment, profiles, roles
                from obstore.auth.boto3 import Boto3CredentialProvider

                config["credential_provider"] = Boto3CredentialProvider(session)
        seconds = datetime.timedelta(seconds=1)
        store = S3Store(
            self._bucket,
            # The bucket in the path, not the host name, as for boto3 (`s3_config`).
            virtual_hosted_style_request=False,
            client_options={
                "allow_http": bool(self.endpoint and self.endpoint.startswith("http://")),
                "connect_timeout": self._connect_timeout * seconds,
                "read_timeout": self._read_timeout * seconds,
                "timeout": _REQUEST_TIMEOUT,
            },
            retry_config={
                "max_retries": max(0, self.max_attempts - 1),
                # Room for every attempt to time out: a response stalled once is read again
                # on a new connection (as botocore retries a read timeout), not failed.
                "retry_timeout": self._read_timeout * self.max_attempts * seconds,
                "backoff": {"init_backoff": 0.1 * seconds, "max_backoff": 2 * seconds, "base": 2},
            },
            **config,
        )
        return _Obstore(store)

    def obstore_for(self, name: str) -> S3Store | None:
        """The obstore store to address object `name` through; None: use boto3 (see the module docstring)."""
        return self._store.get().store if _plain_path(name) else None

    def part_workers(self) -> ThreadPoolExecutor:
        """This process's pool for reading an object's parts in parallel."""
        return self._workers.get()

    def boto3_client(self) -> Any:
        """This process's boto3 S3 client."""
        return self._boto3.get()

    def _start_workers(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(self._max_concurrency, thread_name_prefix="s3-range")

    def _open_boto3(self) -> Any:
        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=self._region,
            aws_access_key_id=self._access_key,
            aws_secret_access_key=self._secret_key,
            config=s3_config(self._connect_timeout, self._read_timeout, self.max_attempts),
        )

    def call(self, op: str, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)`, failing fast while the breaker is open; a connection failure or a 5xx opens it."""
        kind = "write" if op in _WRITES else "read"
        if time.monotonic() < self._down_until[kind]:
            raise TierUnavailable(
                f"object storage at {self.endpoint or 'AWS'} {self._down_reason[kind]} "
                f"(not tried again for {self._breaker_seconds:g} s)"
            )
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            refused = _refused(exc)
            if refused is not None:
                bucket, endpoint = repr(self.bucket), self.endpoint or "AWS"
                raise NotConfigured(
                    f"{self.name}: bucket {bucket} does not exist at {endpoint}"
                    if refused == "NoSuchBucket"
                    else f"{self.name}: {op} refused (AccessDenied) in bucket {bucket} at {endpoint}: check that "
                    "the bucket exists and that the credentials may use it"
                ) from None
            status = _server_error(exc)
            if status is not None:
                reason = f"{op} answered {status} after {self.max_attempts} attempts"
                what = "is failing"
            elif _unanswered(exc):
                reason = f"{op} failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                what = "is unreachable"
            else:
                raise
            # Unreachable: every request would wait out its timeouts. A 5xx: the server answered, and
            # asked that this kind of request be left alone (a bucket throttling PUTs still serves GETs).
            for opened in ("read", "write") if status is None else (kind,):
                self._down_until[opened] = time.monotonic() + self._breaker_seconds
                self._down_reason[opened] = f"{what}: {reason}"
            raise TierUnavailable(f"object storage at {self.endpoint or 'AWS'} {what}: {reason}") from exc

    @property
    def used_bytes(self) -> int:
        return 0

    def cost(self, key: bytes, size: int) -> int:
        return size

    def get(self, key: bytes) -> Entry | None:
        """The object's bytes, verified; None on a miss.

        Raises:
            ValueTooLarge: the object is larger than `max_value_bytes` (its body is not read).
            CorruptValue: the bytes fail their checksum or MD5 ETag.
            TierUnavailable: object storage cannot be reached.
            InvalidKey: a range key (`cacheclient.wire.ranges`) whose range ends past its object.
        """
        ranged = parse_range_key(key)
        if ranged is not None:
            return get_range(self, ranged)
        name = object_name(self.prefix, key)
        entry = self._get_named(key, name)
        foreign = foreign_object_name(self.prefix, key) if entry is None else None
        if foreign is not None:
            entry = self._get_whole(key, foreign, foreign=True)
        return entry

    def _get_named(self, key: bytes, name: str) -> Entry | None:
        store = self.obstore_for(name)
        if store is None:
            return self._get_whole(key, name)
        for attempt in range(1, self.max_attempts + 1):
            try:
                return self._get_in_ranges(store, key, name)
            except PreconditionError:  # replaced while its ranges were read: read the new object
                if attempt == self.max_attempts:
                    raise
        raise AssertionError("unreachable")

    def _get_in_ranges(self, store: S3Store, key: bytes, name: str) -> Entry | None:
        try:
            first = self.call("GET", obstore.get, store, name, options={"range": (0, self.part_bytes)})
        except MISSING:
            return None
        except GenericError as exc:
            if _status(exc) != 416:
                raise
            first = self.call("GET", obstore.get, store, name)  # an empty object has no byte range
        meta = first.meta
        total, etag = meta["size"], meta["e_tag"] or ""
        if total > self.max_value_bytes:
            del first  # drops the connection rather than read a body we refuse
            raise ValueTooLarge(
                f"{self.name}: object {name!r} is {total} bytes, over max_value_bytes={self.max_value_bytes}"
            )
        metadata = first.attributes
        head = self.call("GET", first.bytes)
        if total > len(head):
            workers = self._workers.get()
            futures = [
                workers.submit(self.read_part, store, name, etag, start, min(start + self.part_bytes, total))
                for start in range(len(head), total, self.part_bytes)
            ]
            value = b"".join([head, *(f.result() for f in futures)])
        else:
            value = bytes(head)
        return self._verified(key, name, value, total, etag, metadata)

    def read_part(self, store: S3Store, name: str, etag: str, start: int, end: int) -> obstore.Bytes:
        """Bytes `start`..`end` (exclusive) of object `name`, only while its ETag is still `etag` (when given).

        Raises:
            PreconditionError: the object was replaced (its ETag changed).
        """
        options: dict[str, Any] = {"range": (start, end)}
        if etag:
            options["if_match"] = etag
        result = self.call("GET", obstore.get, store, name, options=options)
        return self.call("GET", result.bytes)

    def _get_whole(self, key: bytes, name: str, *, foreign: bool = False) -> Entry | None:
        """`get` with one boto3 GET, where obstore cannot serve; with `foreign`, of a name only other tools
        write (`foreign_object_name`): an object there that carries the cache's checksum is another key's, a miss.

        botocore retries a request until its response headers arrive, not
        the reading of its body: a body cut off (reset, closed short of its
        length) or stalled past `read_timeout` is read again here, up to
        `max_attempts` times in all.
        """
        client = self._boto3.get()
        for attempt in range(1, self.max_attempts + 1):
            try:
                response = self.call("GetObject", client.get_object, Bucket=self.bucket, Key=name)
            except botocore.exceptions.ClientError as exc:
                if error_code(exc) in NOT_FOUND_CODES:
                    return None
                raise
            total = int(response["ContentLength"])
            if total > self.max_value_bytes:
                response["Body"].close()
                raise ValueTooLarge(
                    f"{self.name}: object {name!r} is {total} bytes, over max_value_bytes={self.max_value_bytes}"
                )
            if attempt == self.max_attempts:
                value = self.call("GetObject", response["Body"].read)
            else:
                try:
                    value = response["Body"].read()
                except _BOTO3_BODY_ERRORS as exc:
                    log.debug("%s: GET %r cut off mid-body, reading it again: %s", self.name, name, exc)
                    continue
            metadata = response.get("Metadata", {})
            if foreign and META_CHECKSUM in metadata:
                return None
            return self._verified(key, name, value, total, response.get("ETag", ""), metadata)
        raise AssertionError("unreachable")

    def _verified(
        self, key: bytes, name: str, value: bytes, total: int, etag: str, metadata: Mapping[str, str]
    ) -> Entry | None:
        if len(value) != total:
            raise CorruptValue(self.name, key)
        if is_hashed_name(self.prefix, name) and not key_matches(metadata, key):
            return None  # a digest collision: another key's object
        value_checksum = xxh3(value)
        if not object_matches(value, metadata, etag, value_checksum):
            raise CorruptValue(self.name, key)
        return Entry(value, value_checksum, version=version_in_metadata(metadata))

    def put(
        self,
        key: bytes,
        value: bytes,
        checksum: int,
        *,
        dirty: bool = False,
        expires_at: float = 0.0,
        version: int = 0,
    ) -> None:
        # Object storage is the durable copy (nothing is dirty here) and keeps no expiry; the version goes
        # into the object's metadata (`META_VERSION`), where `head_version` and `get` find it.
        del dirty, expires_at
        name = object_name(self.prefix, key)
        metadata = checksum_metadata(checksum, key if is_hashed_name(self.prefix, name) else None, version)
        store = self.obstore_for(name)
        if store is None:
            client = self._boto3.get()
            self.call("PutObject", client.put_object, Bucket=self.bucket, Key=name, Body=value, Metadata=metadata)
            return
        # A multipart upload that fails is aborted by object_store; the old object stays until one completes.
        self.call(
            "PUT",
            obstore.put,
            store,
            name,
            value,
            attributes=metadata,
            use_multipart=len(value) >= self._multipart_bytes,
            chunk_size=self.part_bytes,
            max_concurrency=self._max_concurrency,
        )

    def delete(self, key: bytes) -> bool:
        existed = self.contains(key)
        name = object_name(self.prefix, key)
        store = self.obstore_for(name)
        if store is not None:
            self.call("DELETE", obstore.delete, store, name)
        else:
            self.call("DeleteObject", self._boto3.get().delete_object, Bucket=self.bucket, Key=name)
        return existed

    def _head_whole(self, name: str) -> dict[str, Any] | None:
        """The HEAD of object `name` as boto3 gives it (`ContentLength`, `ETag`, `Metadata` are what callers read);
        None when it does not exist.

        Through obstore where it serves the name (a GET without its body, with the user metadata among
        the attributes): about an eighth of boto3's CPU per request, which counts where every key is
        checked (a server back from a restart vouches each cached copy before it serves it: 0.24 ms of
        CPU against 1.9 ms a HEAD on this machine).
        """
        store = self.obstore_for(name)
        if store is not None:
            try:
                result = self.call("HEAD", obstore.get, store, name, options={"head": True})
            except MISSING:
                return None
            meta = result.meta
            attributes = {str(k): str(v) for k, v in result.attributes.items()}
            return {"ContentLength": meta["size"], "ETag": meta["e_tag"] or "", "Metadata": attributes}
        try:
            head: dict[str, Any] = self.call("HeadObject", self._boto3.get().head_object, Bucket=self.bucket, Key=name)
        except botocore.exceptions.ClientError as exc:
            if error_code(exc) in NOT_FOUND_CODES:
                return None
            raise
        return head

    def head_version(self, key: bytes) -> int | None:
        """The version in the metadata of the object of `key` (0: none there), from one HEAD; None: no object.

        A range key's object is read-only here: its version is 0 when it exists.

        Raises:
            TierUnavailable: object storage cannot be reached, or answers 5xx.
        """
        ranged = parse_range_key(key)
        if ranged is not None:
            return 0 if contains_range(self, ranged) else None
        name = object_name(self.prefix, key)
        head = self._head_whole(name)
        if head is None:
            return 0 if self.foreign_head(key) is not None else None
        metadata = head.get("Metadata", {})
        if is_hashed_name(self.prefix, name) and not key_matches(metadata, key):
            return None
        return version_in_metadata(metadata)

    def vouch(self, key: bytes, value: bytes, checksum: int) -> int | None:
        """The version of the object of `key` when it holds `value` (see `unchanged`); None otherwise. One HEAD.

        Raises:
            TierUnavailable: object storage cannot be reached, or answers 5xx.
        """
        if parse_range_key(key) is not None:
            return 0
        name = object_name(self.prefix, key)
        head = self._head_whole(name)
        if head is None or int(head["ContentLength"]) != len(value):
            return None
        metadata = head.get("Metadata", {})
        if is_hashed_name(self.prefix, name) and not key_matches(metadata, key):
            return None
        if not object_matches(value, metadata, head.get("ETag", ""), checksum):
            return None
        return version_in_metadata(metadata)

    def contains(self, key: bytes) -> bool:
        ranged = parse_range_key(key)
        if ranged is not None:
            return contains_range(self, ranged)
        if self.object_size(object_name(self.prefix, key)) is not None:
            return True
        return self.foreign_head(key) is not None

    def object_size(self, name: str) -> int | None:
        """The size of object `name` (one HEAD); None when it does not exist."""
        store = self.obstore_for(name)
        if store is None:
            head = self._head_whole(name)
            return None if head is None else int(head.get("ContentLength", 0))
        try:
            return int(self.call("HEAD", obstore.head, store, name)["size"])
        except MISSING:
            return None

    def foreign_head(self, key: bytes) -> dict[str, Any] | None:
        """boto3's HEAD of another tool's object of `key` (`foreign_object_name`); None when there is none."""
        foreign = foreign_object_name(self.prefix, key)
        head = None if foreign is None else self._head_whole(foreign)
        return head if head is not None and META_CHECKSUM not in head.get("Metadata", {}) else None

    def unchanged(self, key: bytes, value: bytes, checksum: int) -> bool:
        """Whether the object of `key` is still the one whose bytes are `value`, from one HEAD.

        Compared by size, then by the xxh3 metadata our writes add, else by
        a plain-MD5 ETag; an object that someone else uploaded in parts has
        neither, and counts as unchanged while its size is. A missing object
        has changed. A range key is not checked (True).

        Raises:
            TierUnavailable: object storage cannot be reached, or answers 5xx.
        """
        if parse_range_key(key) is not None:
            return True
        name = object_name(self.prefix, key)
        head = self._head_whole(name)
        if head is None:
            return False
        metadata = head.get("Metadata", {})
        if int(head["ContentLength"]) != len(value):
            return False
        if is_hashed_name(self.prefix, name) and not key_matches(metadata, key):
            return False
        return object_matches(value, metadata, head.get("ETag", ""), checksum)

    def list_keys(self) -> list[bytes]:
        return [r.key for r in self.scan()]  # a listing of the bucket either way

    def scan(self) -> Iterator[ResidentKey]:
        client = self._boto3.get()
        for name, size in self.list_objects():
            if is_hashed_name(self.prefix, name):
                head = self.call("HeadObject", client.head_object, Bucket=self.bucket, Key=name)
                key = key_in_metadata(head.get("Metadata", {}))
                if key is not None:
                    yield ResidentKey(key, size, False)
                continue
            yield ResidentKey(key_of(self.prefix, name), size, False)

    def list_objects(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """(object name, size) for every object under the tier's prefix + `prefix`."""
        paginator = self._boto3.get().get_paginator("list_objects_v2")
        pages = self.call("ListObjectsV2", paginator.paginate, Bucket=self.bucket, Prefix=self.prefix + prefix)
        for page in pages:
            for item in page.get("Contents", []):
                yield item["Key"], int(item["Size"])

    def list_page(self, prefix: bytes, start_after: bytes, limit: int) -> tuple[list[tuple[bytes, int]], bool]:
        """One page of (key, size) under key prefix `prefix`, after key `start_after`; and whether more follow."""
        try:
            text_prefix = prefix.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidKey(f"list prefix must be UTF-8 text, got {prefix[:64]!r}") from None
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.prefix + text_prefix, "MaxKeys": limit}
        if start_after:
            kwargs["StartAfter"] = object_name(self.prefix, start_after)
        response = self.call("ListObjectsV2", self._boto3.get().list_objects_v2, **kwargs)
        entries = []
        for item in response.get("Contents", []):
            name = item["Key"]
            if is_hashed_name(self.prefix, name):
                continue  # hashed long keys are not listable by prefix
            entries.append((key_of(self.prefix, name), int(item["Size"])))
        return entries, bool(response.get("IsTruncated"))

    def object_name(self, key: bytes) -> str:
        return object_name(self.prefix, key)

    def hashed_name(self, name: str) -> bool:
        return is_hashed_name(self.prefix, name)

    def list_after(self, start_after: str, limit: int) -> tuple[list[ListedObject], bool]:
        """Up to `limit` (at most 1,000) objects under the prefix named after `start_after`, and whether more may
        follow: one ListObjectsV2 (`NamedListingTier`).

        Through obstore where it can address the prefix: boto3 parses a page of 1,000 (each entry's time
        through dateutil) in about ten times the CPU. A page obstore cannot read (a name it cannot hold as
        a path) is listed again through boto3.
        """
        store = self._store.get().store if self.prefix.endswith("/") and _plain_path(self.prefix + "x") else None
        if store is not None:

            def first_page() -> list[Any]:
                for page in obstore.list(store, self.prefix, offset=start_after or None, chunk_size=limit):
                    return list(page)
                return []

            try:
                page = self.call("LIST", first_page)
            except TierUnavailable:
                raise
            except Exception as exc:
                log.debug(
                    "%s: obstore could not list after %r (%s); listing through boto3", self.name, start_after, exc
                )
            else:
                listed = [
                    ListedObject(
                        str(meta["path"]),
                        str(meta.get("e_tag") or "").strip('"'),
                        int(meta["size"]),
                        meta["last_modified"].timestamp(),
                    )
                    for meta in page
                ]
                return listed, len(listed) >= limit
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.prefix, "MaxKeys": limit}
        if start_after:
            kwargs["StartAfter"] = start_after
        response = self.call("ListObjectsV2", self._boto3.get().list_objects_v2, **kwargs)
        listed = [
            ListedObject(
                item["Key"], str(item.get("ETag", "")).strip('"'), int(item["Size"]), item["LastModified"].timestamp()
            )
            for item in response.get("Contents", [])
        ]
        return listed, bool(response.get("IsTruncated"))

    def info(self) -> dict[str, str | int]:
        return {"kind": "s3", "endpoint": self.endpoint or "", "bucket": self.bucket, "prefix": self.prefix}

    def close(self) -> None:
        self._workers.close()
        self._store.close()
        self._boto3.close()


def _plain_path(name: str) -> bool:
    """Whether object_store addresses object `name` as it is (its paths drop or refuse the others)."""
    return bool(name) and all(segment not in ("", ".", "..") for segment in name.split("/")) and name.isprintable()


def _refused(exc: BaseException) -> str | None:
    """ "NoSuchBucket" or "AccessDenied" when `exc` is S3's answer saying so (boto3's error code, or the
    answer's body in obstore's text), else None."""
    if isinstance(exc, botocore.exceptions.ClientError):
        code = error_code(exc)
        return code if code in ("NoSuchBucket", "AccessDenied") else None
    text = str(exc)
    return next((code for code in ("NoSuchBucket", "AccessDenied") if f"<Code>{code}</Code>" in text), None)


def _status(exc: BaseException) -> int | None:
    """The HTTP status the server answered with, from an obstore error; None if it did not answer."""
    found = _STATUS.search(str(exc))
    return int(found.group(1)) if found else None


def _server_error(exc: BaseException) -> int | None:
    """The 5xx status the server answered a request with (after the client's retries); None for any other error."""
    if isinstance(exc, botocore.exceptions.ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    elif isinstance(exc, GenericError):
        status = _status(exc)
    else:
        return None
    return status if isinstance(status, int) and 500 <= status < 600 else None


def _unanswered(exc: BaseException) -> bool:
    """Whether a request failed without an answer from the server: refused, timed out, cut off."""
    if isinstance(exc, _BOTO3_CONNECTION_ERRORS):
        return True
    return type(exc) is GenericError and _status(exc) is None and _TRANSPORT_FAILURE in str(exc)


def _stop_workers(workers: ThreadPoolExecutor) -> None:
    workers.shutdown(wait=True)


def _close_boto3(client: Any) -> None:
    with contextlib.suppress(Exception):
        client.close()
