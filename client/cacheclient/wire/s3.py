"""How cache keys live in S3-compatible object storage, and how their bytes are checked.

The server's L3 tier writes and reads objects with these names; a client
reads the same objects directly while the cache server is down (the
DataLoader's S3 fallback), and the benchmarks seed buckets with them.

Object naming: a key that is printable UTF-8, does not start with "~" and
reads as a plain relative path (no empty, "." or ".." segment between "/"
or "\\" separators: S3 servers that keep objects as files refuse such names
or fold them into others, SeaweedFS and MinIO among them) is the object name
under the prefix, as is; any other key is "~b64/" + its URL-safe base64. A
key whose only departure is an empty segment inside ("a//b") is also read,
on a miss, under its name as is (`foreign_object_name`): datasets written
by other tools to AWS S3 have such names. A
name that would pass S3's 1,024-byte limit becomes "~h/" + the key's
xxh3-128 digest, with the key itself in the object's metadata
(`x-amz-meta-key`, base64), checked on read.

Checksums: objects the cache writes carry the value's xxh3-64 as metadata
(`x-amz-meta-xxh3`, 16 hex digits). Objects written by others are checked
against their ETag when it is a plain MD5 (a single-part upload); any other
ETag cannot be checked.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import xxhash

from cacheclient.wire.record import checksum

if TYPE_CHECKING:
    import botocore.config

__all__ = [
    "MAX_OBJECT_NAME_BYTES",
    "META_CHECKSUM",
    "META_KEY",
    "META_VERSION",
    "NOT_FOUND_CODES",
    "checksum_metadata",
    "error_code",
    "foreign_object_name",
    "is_hashed_name",
    "key_in_metadata",
    "key_matches",
    "key_of",
    "object_matches",
    "object_name",
    "parse_s3_uri",
    "s3_config",
    "version_in_metadata",
]

MAX_OBJECT_NAME_BYTES = 1024
"""S3's limit on an object name, in UTF-8 bytes."""
META_CHECKSUM = "xxh3"
"""Object metadata (`x-amz-meta-xxh3`) holding the value's xxh3-64 as 16 hex digits."""
META_KEY = "key"
"""Object metadata (`x-amz-meta-key`) holding the base64 key of an object named by digest."""
META_VERSION = "cache-version"
"""Object metadata (`x-amz-meta-cache-version`) holding the value's version (the hybrid-logical-clock stamp
the cache node that accepted the write gave it) as decimal digits; absent on objects written by others."""
NOT_FOUND_CODES = ("NoSuchKey", "404", "NotFound")
"""boto3's error codes of a missing object (`error_code`)."""
_B64 = "~b64/"
_HASHED = "~h/"
_PATH_FOLDED = frozenset({".", ".."})
"""Path segments S3 servers that keep objects as files refuse or resolve; an empty segment is folded too."""


def object_name(prefix: str, key: bytes) -> str:
    """The S3 object name that holds `key` under `prefix`."""
    try:
        text: str | None = key.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or text.startswith("~") or not text.isprintable() or not _plain_path(text):
        text = _B64 + base64.urlsafe_b64encode(key).decode("ascii")
    name = prefix + text
    if len(name.encode("utf-8")) > MAX_OBJECT_NAME_BYTES:
        name = prefix + _HASHED + xxhash.xxh3_128_hexdigest(key)
    return name


def foreign_object_name(prefix: str, key: bytes) -> str | None:
    """Where a dataset written by another tool may hold `key` when `object_name` names it otherwise; else None.

    Only for a printable UTF-8 key whose one departure from a plain path is
    an empty segment inside ("a//b", "/x"): AWS S3 keeps such a name apart
    from "a/b", and datasets have them. The cache never writes under this
    name (S3 servers that keep objects as files fold it into "a/b"), so an
    object found there that carries the cache's checksum is another key's.
    """
    try:
        text = key.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if text.startswith("~") or not text.isprintable() or _plain_path(text):
        return None
    segments = text.replace("\\", "/").split("/")
    if segments[-1] == "" or any(segment in _PATH_FOLDED for segment in segments):
        return None
    name = prefix + text
    return name if len(name.encode("utf-8")) <= MAX_OBJECT_NAME_BYTES else None


def _plain_path(text: str) -> bool:
    """Whether `text` names a file as is: no empty, "." or ".." segment (so no leading, trailing or double "/").

    A backslash separates segments too: some S3 servers read it as "/".
    """
    return all(segment and segment not in _PATH_FOLDED for segment in text.replace("\\", "/").split("/"))


def is_hashed_name(prefix: str, name: str) -> bool:
    """Whether object `name` is named by its key's digest (its key is in `META_KEY`, not in the name)."""
    return name.startswith(prefix + _HASHED)


def key_of(prefix: str, name: str) -> bytes:
    """The cache key stored in object `name` (inverse of `object_name`, except for hashed names)."""
    text = name[len(prefix) :]
    if text.startswith(_B64):
        return base64.urlsafe_b64decode(text[len(_B64) :])
    return text.encode("utf-8")


def checksum_metadata(value_checksum: int, key: bytes | None = None, version: int = 0) -> dict[str, str]:
    """The object metadata the cache writes with a value: its checksum, `key` when given (hashed names), and
    its version when known (`META_VERSION`)."""
    metadata = {META_CHECKSUM: f"{value_checksum:016x}"}
    if key is not None:
        metadata[META_KEY] = base64.urlsafe_b64encode(key).decode("ascii")
    if version:
        metadata[META_VERSION] = str(version)
    return metadata


def version_in_metadata(metadata: Mapping[str, str]) -> int:
    """The version an object's metadata holds (`META_VERSION`); 0 when it holds none or a malformed one."""
    stored = metadata.get(META_VERSION, "")
    return int(stored) if stored.isdigit() and len(stored) <= 20 else 0


def object_matches(value: bytes, metadata: Mapping[str, str], etag: str, value_checksum: int | None = None) -> bool:
    """Whether an object's bytes pass the checks its metadata and ETag allow.

    Args:
        value: the object's bytes.
        metadata: its user metadata (boto3's `Metadata`).
        etag: its ETag, quoted or not.
        value_checksum: `checksum(value)` when the caller has it already.

    Returns:
        False when the stored xxh3-64 or a plain-MD5 ETag disagrees with the
        bytes; True otherwise (also when nothing can be checked).
    """
    stored = metadata.get(META_CHECKSUM)
    if stored is not None:
        try:
            expected = int(stored, 16)
        except ValueError:
            return False
        return (checksum(value) if value_checksum is None else value_checksum) == expected
    md5 = etag.strip('"').lower()
    if len(md5) != 32 or any(c not in "0123456789abcdef" for c in md5):
        return True  # a multipart ETag (or none): nothing to check against
    return hashlib.md5(value, usedforsecurity=False).hexdigest() == md5


def key_matches(metadata: Mapping[str, str], key: bytes) -> bool:
    """Whether an object named by digest holds `key` (False: another key with the same digest)."""
    return metadata.get(META_KEY) == base64.urlsafe_b64encode(key).decode("ascii")


def key_in_metadata(metadata: Mapping[str, str]) -> bytes | None:
    """The key an object named by digest holds, from its metadata; None if it has none."""
    encoded = metadata.get(META_KEY)
    return None if encoded is None else base64.urlsafe_b64decode(encoded)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """("bucket", "key/prefix") of "s3://bucket/key/prefix".

    Raises:
        ValueError: not an s3:// URI with a bucket.
    """
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    if not uri.startswith("s3://") or not bucket:
        raise ValueError(f"not an S3 URI with a bucket (want s3://bucket/prefix): {uri!r}")
    return bucket, prefix


def s3_config(
    connect_timeout: float = 2.0,
    read_timeout: float = 30.0,
    max_attempts: int = 3,
    max_pool_connections: int = 32,
    *,
    path_style: bool = True,
) -> botocore.config.Config:
    """The botocore settings of every S3 client in cachesvc and cacheclient.

    Args:
        connect_timeout: seconds to wait for a connection.
        read_timeout: seconds to wait for bytes on an open connection.
        max_attempts: attempts per call, first one included (standard retry mode).
        max_pool_connections: connections kept per client.
        path_style: bucket in the path, not the host name (what S3-compatible
            servers on an IP address need); False lets botocore choose (AWS).
    """
    import botocore.config  # here, so that importing the wire contract does not import botocore

    return botocore.config.Config(
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        retries={"max_attempts": max_attempts, "mode": "standard"},
        max_pool_connections=max_pool_connections,
        # S3-compatible servers reject the newer default integrity headers.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"addressing_style": "path"} if path_style else {},
    )


def error_code(exc: Any) -> str:
    """The S3 error code of a boto3 `ClientError` ("NoSuchKey", "AccessDenied", ...); "" if it carries none."""
    return str(exc.response.get("Error", {}).get("Code", ""))
