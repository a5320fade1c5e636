"""L3: S3-compatible object storage through boto3 (SeaweedFS here, MinIO or S3 in deployment).

Objects are stored as the raw value bytes, so a dataset that someone else put
in the bucket reads through the cache unchanged. Our writes add the value's
xxh3-64 checksum as object metadata (`x-amz-meta-xxh3`), verified on read;
objects without it (written by others) are verified against their ETag when
the ETag is a plain MD5 (a single-part upload).

Key mapping: a key that is printable UTF-8 and does not start with "~" is the
object name under the prefix, as is; any other key is stored as
"~b64/" + its URL-safe base64. A name that would pass S3's 1,024-byte limit
becomes "~h/" + the key's xxh3-128 digest, with the key itself in the object's
metadata (`x-amz-meta-key`, base64), checked on read.

Large values: PUTs above `multipart_bytes` go up in parts; GETs read the first
`part_bytes` with a ranged GET, learn the size from Content-Range, and fetch
the remaining ranges in parallel, pinned to the first response's ETag.

Failures: every call has connect and read timeouts and at most
`max_attempts` attempts. After a connection failure the tier fails fast for
`breaker_seconds` instead of making every miss wait out the timeouts again.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3
import botocore.config
import botocore.exceptions
import xxhash

from cachesvc.errors import CorruptValue, InvalidKey, TierUnavailable
from cachesvc.integrity import checksum as xxh3
from cachesvc.tiers.base import Entry, ResidentKey

__all__ = ["S3Tier", "object_name", "s3_config"]

_META = "xxh3"
_META_KEY = "key"
_MAX_NAME = 1024
_CONNECTION_ERRORS = (
    botocore.exceptions.EndpointConnectionError,
    botocore.exceptions.ConnectTimeoutError,
    botocore.exceptions.ReadTimeoutError,
    botocore.exceptions.ConnectionClosedError,
)


def s3_config(
    connect_timeout: float = 2.0, read_timeout: float = 30.0, max_attempts: int = 3, max_pool_connections: int = 32
) -> botocore.config.Config:
    """The botocore settings every S3 client of cachesvc uses: deadlines, bounded retries, path-style URLs."""
    return botocore.config.Config(
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        retries={"max_attempts": max_attempts, "mode": "standard"},
        max_pool_connections=max_pool_connections,
        # S3-compatible servers reject the newer default integrity headers.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"addressing_style": "path"},
    )


def object_name(prefix: str, key: bytes) -> str:
    """The S3 object name that holds `key` under `prefix`."""
    try:
        text = key.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or text.startswith("~") or not text.isprintable():
        text = "~b64/" + base64.urlsafe_b64encode(key).decode("ascii")
    name = prefix + text
    if len(name.encode("utf-8")) > _MAX_NAME:
        name = prefix + "~h/" + xxhash.xxh3_128_hexdigest(key)
    return name


def key_of(prefix: str, name: str) -> bytes:
    """The cache key stored in object `name` (inverse of `object_name`)."""
    text = name[len(prefix) :]
    if text.startswith("~b64/"):
        return base64.urlsafe_b64decode(text[5:])
    return text.encode("utf-8")


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
        self._down_until = 0.0
        self._down_reason = ""
        self._pid = -1
        self._client_obj: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    # A boto3 client must not cross fork; build one per process, lazily.
    def _client(self) -> Any:
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    self._client_obj = boto3.session.Session().client(
                        "s3",
                        endpoint_url=self.endpoint,
                        region_name=self._region,
                        aws_access_key_id=self._access_key,
                        aws_secret_access_key=self._secret_key,
                        config=self._config,
                    )
                    self._pool = ThreadPoolExecutor(self._max_concurrency, thread_name_prefix="s3-range")
                    self._pid = os.getpid()
        return self._client_obj

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
        parts = [first["Body"].read()]
        if total > len(parts[0]):
            assert self._pool is not None
            ranges = [
                (start, min(start + self._part_bytes, total) - 1)
                for start in range(len(parts[0]), total, self._part_bytes)
            ]
            futures = [self._pool.submit(self._get_range, name, etag, lo, hi) for lo, hi in ranges]
            parts.extend(f.result() for f in futures)
        value = b"".join(parts) if len(parts) > 1 else parts[0]
        if len(value) != total:
            raise CorruptValue(self.name, key)
        metadata = first.get("Metadata", {})
        if name.startswith(self.prefix + "~h/") and metadata.get(_META_KEY) != _b64(key):
            return None  # a digest collision: another key's object
        value_checksum = xxh3(value)
        expected = metadata.get(_META)
        if expected is not None:
            if int(expected, 16) != value_checksum:
                raise CorruptValue(self.name, key)
        elif _is_md5_etag(etag) and hashlib.md5(value, usedforsecurity=False).hexdigest() != etag.strip('"'):
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

    def put(self, key: bytes, value: bytes, checksum: int, *, dirty: bool = False) -> None:
        del dirty  # object storage is the durable copy; nothing is dirty here
        client = self._client()
        name = object_name(self.prefix, key)
        metadata = {_META: f"{checksum:016x}"}
        if name.startswith(self.prefix + "~h/"):
            metadata[_META_KEY] = _b64(key)
        if len(value) < self._multipart_bytes:
            self._call("PutObject", client.put_object, Bucket=self.bucket, Key=name, Body=value, Metadata=metadata)
            return
        upload = self._call(
            "CreateMultipartUpload", client.create_multipart_upload, Bucket=self.bucket, Key=name, Metadata=metadata
        )
        upload_id = upload["UploadId"]
        try:
            view = memoryview(value)
            assert self._pool is not None
            futures = [
                self._pool.submit(
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
            if name.startswith(self.prefix + "~h/"):
                head = self._call("HeadObject", self._client().head_object, Bucket=self.bucket, Key=name)
                encoded = head.get("Metadata", {}).get(_META_KEY)
                if encoded is not None:
                    yield ResidentKey(base64.urlsafe_b64decode(encoded), size, False)
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
            if name.startswith(self.prefix + "~h/"):
                continue  # hashed long keys are not listable by prefix
            entries.append((key_of(self.prefix, name), int(item["Size"])))
        return entries, bool(response.get("IsTruncated"))

    def close(self) -> None:
        if self._pool is not None and self._pid == os.getpid():
            self._pool.shutdown(wait=True)
        self._pid = -1


def _b64(key: bytes) -> str:
    return base64.urlsafe_b64encode(key).decode("ascii")


def _total_size(response: dict[str, Any]) -> int:
    content_range = response.get("ContentRange")
    if content_range and "/" in content_range:
        return int(content_range.rsplit("/", 1)[1])
    return int(response["ContentLength"])


def _is_md5_etag(etag: str) -> bool:
    stripped = etag.strip('"')
    return len(stripped) == 32 and "-" not in stripped
