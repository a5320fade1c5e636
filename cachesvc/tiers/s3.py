"""L3: S3-compatible object storage through boto3 (SeaweedFS here, MinIO or S3 in deployment).

Objects are stored as the raw value bytes, so a dataset that someone else put
in the bucket reads through the cache unchanged. Object names and checksums
are the wire contract's (`cacheclient.wire.s3`), shared with the clients that
read the bucket directly: our writes add the value's xxh3-64 as object
metadata, verified on read; objects written by others are verified against
their ETag when it is a plain MD5.

Large values: PUTs above `multipart_bytes` go up in parts; GETs read the first
`part_bytes` with a ranged GET, learn the size from Content-Range, and fetch
the remaining ranges in parallel, pinned to the first response's ETag. An
object larger than `max_value_bytes` is refused (`ValueTooLarge`) once the
first response shows its size, before its body is read.

Expiry: object storage keeps no expiry; `put` accepts `expires_at` and drops it.

Failures: every call has connect and read timeouts and at most
`max_attempts` attempts. After a connection failure the tier fails fast for
`breaker_seconds` instead of making every miss wait out the timeouts again.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import boto3
import botocore.exceptions

from cacheclient.process_local import ProcessLocal
from cacheclient.wire.record import checksum as xxh3
from cacheclient.wire.s3 import (
    checksum_metadata,
    is_hashed_name,
    key_in_metadata,
    key_matches,
    key_of,
    object_matches,
    object_name,
    s3_config,
)
from cachesvc.errors import CorruptValue, InvalidKey, TierUnavailable, ValueTooLarge
from cachesvc.tiers.base import Entry, ResidentKey

__all__ = ["S3Tier"]

_CONNECTION_ERRORS = (
    botocore.exceptions.EndpointConnectionError,
    botocore.exceptions.ConnectTimeoutError,
    botocore.exceptions.ReadTimeoutError,
    botocore.exceptions.ConnectionClosedError,
)


@dataclass(frozen=True, slots=True)
class _Connection:
    """One process's boto3 client and the threads that fetch ranges and upload parts."""

    client: Any
    pool: ThreadPoolExecutor


class S3Tier:
    """Values as objects in one bucket under one prefix."""

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
        self.bucket = bucket
        self.prefix = prefix
        self._region = region
        self._access_key = access_key
        self._secret_key = secret_key
        self._config = s3_config(connect_timeout, read_timeout, max_attempts, max_pool_connections=64)
        self._part_bytes = part_bytes
        self._multipart_bytes = multipart_bytes
        self._max_concurrency = max_concurrency
        self._breaker_seconds = breaker_seconds
        self.max_value_bytes = max_value_bytes
        self._down_until = 0.0
        self._down_reason = ""
        # A boto3 client must not cross fork: one per process, made lazily.
        self._connection = ProcessLocal(self._connect, _disconnect)

    def _connect(self) -> _Connection:
        client = boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=self._region,
            aws_access_key_id=self._access_key,
            aws_secret_access_key=self._secret_key,
            config=self._config,
        )
        return _Connection(client, ThreadPoolExecutor(self._max_concurrency, thread_name_prefix="s3-range"))

    def _client(self) -> Any:
        return self._connection.get().client

    def _pool(self) -> ThreadPoolExecutor:
        return self._connection.get().pool

    def _call(self, op: str, fn: Any, /, **kwargs: Any) -> Any:
        now = time.monotonic()
        if now < self._down_until:
            raise TierUnavailable(f"object storage at {self.endpoint or 'AWS'} is unreachable: {self._down_reason}")
        try:
            return fn(**kwargs)
        except _CONNECTION_ERRORS as exc:
            self._down_until = time.monotonic() + self._breaker_seconds
            self._down_reason = f"{op} failed: {exc}"
            raise TierUnavailable(
                f"object storage at {self.endpoint or 'AWS'} is unreachable: {op} failed: {exc}"
            ) from exc

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
        """
        client = self._client()
        name = object_name(self.prefix, key)
        try:
            first = self._call(
                "GetObject", client.get_object, Bucket=self.bucket, Key=name, Range=f"bytes=0-{self._part_bytes - 1}"
            )
        except botocore.exceptions.ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchKey", "404", "NotFound"):
                return None
            if code == "InvalidRange":  # an empty object
                first = self._call("GetObject", client.get_object, Bucket=self.bucket, Key=name)
            else:
                raise
        etag = first.get("ETag", "")
        total = _total_size(first)
        if total > self.max_value_bytes:
            first["Body"].close()  # drop the connection rather than read a body we refuse
            raise ValueTooLarge(
                f"{self.name}: object {name!r} is {total} bytes, over max_value_bytes={self.max_value_bytes}"
            )
        parts = [first["Body"].read()]
        if total > len(parts[0]):
            pool = self._pool()
            ranges = [
                (start, min(start + self._part_bytes, total) - 1)
                for start in range(len(parts[0]), total, self._part_bytes)
            ]
            futures = [pool.submit(self._get_range, name, etag, lo, hi) for lo, hi in ranges]
            parts.extend(f.result() for f in futures)
        value = b"".join(parts) if len(parts) > 1 else parts[0]
        if len(value) != total:
            raise CorruptValue(self.name, key)
        metadata = first.get("Metadata", {})
        if is_hashed_name(self.prefix, name) and not key_matches(metadata, key):
            return None  # a digest collision: another key's object
        value_checksum = xxh3(value)
        if not object_matches(value, metadata, etag, value_checksum):
            raise CorruptValue(self.name, key)
        return Entry(value, value_checksum)

    def _get_range(self, name: str, etag: str, lo: int, hi: int) -> bytes:
        response = self._call(
            "GetObject",
            self._client().get_object,
            Bucket=self.bucket,
            Key=name,
            Range=f"bytes={lo}-{hi}",
            IfMatch=etag,
        )
        data: bytes = response["Body"].read()
        return data

    def put(self, key: bytes, value: bytes, checksum: int, *, dirty: bool = False, expires_at: float = 0.0) -> None:
        # Object storage is the durable copy (nothing is dirty here) and keeps no expiry.
        del dirty, expires_at
        client = self._client()
        name = object_name(self.prefix, key)
        metadata = checksum_metadata(checksum, key if is_hashed_name(self.prefix, name) else None)
        if len(value) < self._multipart_bytes:
            self._call("PutObject", client.put_object, Bucket=self.bucket, Key=name, Body=value, Metadata=metadata)
            return
        upload = self._call(
            "CreateMultipartUpload", client.create_multipart_upload, Bucket=self.bucket, Key=name, Metadata=metadata
        )
        upload_id = upload["UploadId"]
        try:
            view = memoryview(value)
            pool = self._pool()
            futures = [
                pool.submit(
                    self._call,
                    "UploadPart",
                    client.upload_part,
                    Bucket=self.bucket,
                    Key=name,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=bytes(view[start : start + self._part_bytes]),
                )
                for number, start in enumerate(range(0, len(value), self._part_bytes), start=1)
            ]
            parts = [{"PartNumber": n, "ETag": f.result()["ETag"]} for n, f in enumerate(futures, start=1)]
            self._call(
                "CompleteMultipartUpload",
                client.complete_multipart_upload,
                Bucket=self.bucket,
                Key=name,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )
        except BaseException:
            # The original error is the one to report; a failed abort only leaves parts for S3's lifecycle rules.
            with contextlib.suppress(Exception):
                client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload_id)
            raise

    def delete(self, key: bytes) -> bool:
        existed = self.contains(key)
        self._call("DeleteObject", self._client().delete_object, Bucket=self.bucket, Key=object_name(self.prefix, key))
        return existed

    def contains(self, key: bytes) -> bool:
        try:
            self._call("HeadObject", self._client().head_object, Bucket=self.bucket, Key=object_name(self.prefix, key))
        except botocore.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code", "") in ("NoSuchKey", "404", "NotFound"):
                return False
            raise
        return True

    def scan(self) -> Iterator[ResidentKey]:
        for name, size in self.list_objects():
            if is_hashed_name(self.prefix, name):
                head = self._call("HeadObject", self._client().head_object, Bucket=self.bucket, Key=name)
                key = key_in_metadata(head.get("Metadata", {}))
                if key is not None:
                    yield ResidentKey(key, size, False)
                continue
            yield ResidentKey(key_of(self.prefix, name), size, False)

    def list_objects(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """(object name, size) for every object under the tier's prefix + `prefix`."""
        paginator = self._client().get_paginator("list_objects_v2")
        pages = self._call("ListObjectsV2", paginator.paginate, Bucket=self.bucket, Prefix=self.prefix + prefix)
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
        response = self._call("ListObjectsV2", self._client().list_objects_v2, **kwargs)
        entries = []
        for item in response.get("Contents", []):
            name = item["Key"]
            if is_hashed_name(self.prefix, name):
                continue  # hashed long keys are not listable by prefix
            entries.append((key_of(self.prefix, name), int(item["Size"])))
        return entries, bool(response.get("IsTruncated"))

    def info(self) -> dict[str, str | int]:
        return {"kind": "s3", "endpoint": self.endpoint or "", "bucket": self.bucket, "prefix": self.prefix}

    def close(self) -> None:
        self._connection.close()


def _disconnect(connection: _Connection) -> None:
    connection.pool.shutdown(wait=True)
    connection.client.close()


def _total_size(response: dict[str, Any]) -> int:
    content_range = response.get("ContentRange")
    if content_range and "/" in content_range:
        return int(content_range.rsplit("/", 1)[1])
    return int(response["ContentLength"])

