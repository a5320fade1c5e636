"""Checkpoints' names, cache keys, manifests and errors: what every part of the catalog agrees on.

A checkpoint is named "RUN/STEP" (for example "llama-7b/step-1000"); RUN may
have several components, STEP is one. Under a key prefix (default "ckpt/",
which the server should map to a write-back namespace):

    ckpt/chunks/RUN/~/DIGEST       a chunk (the 32 hex digits of its xxh3-128)
    ckpt/manifests/RUN/~/STEP      the manifest: JSON naming every chunk
    ckpt/index/RUN/~index          the run's committed checkpoints, oldest first
    ckpt/readers/RUN/~/STEP        a marker a loader leaves (with a TTL)

and, with a metadata shard, `CheckpointKeys.manifest_value`,
`commit_record` and `retired_record` (`cacheclient.checkpoint.catalog`
describes the commit protocol).
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from typing import Any

import xxhash

from cacheclient.client import Location
from cacheclient.errors import CacheClientError

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_PREFIX",
    "MANIFEST_FORMAT",
    "CheckpointCorrupt",
    "CheckpointEntry",
    "CheckpointError",
    "CheckpointKeys",
    "CheckpointNotFound",
    "Durability",
    "RetentionBlocked",
    "chunk_digest",
    "parse_manifest",
    "split_name",
]

DEFAULT_PREFIX = "ckpt/"
DEFAULT_CHUNK_BYTES = 2 << 20
"""Chunk size: one chunk travels in one batched put (under INLINE_BYTES); a partly changed tensor re-sends little."""
MANIFEST_FORMAT = 1
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)+")
_MAX_NAME_BYTES = 400


class CheckpointError(CacheClientError):
    """A checkpoint could not be saved, found or read."""


class CheckpointNotFound(CheckpointError):
    """No committed checkpoint has this name."""


class CheckpointCorrupt(CheckpointError):
    """A chunk of a committed checkpoint is missing or fails its content hash."""


class RetentionBlocked(CheckpointError):
    """Retention deleted nothing: the manifest of a checkpoint it keeps could not be read.

    Retention fails closed: a chunk is deleted only when every manifest that
    could name it was read. A kept manifest that is away for a moment (its
    node restarting, object storage slow) blocks the pass until it reads
    again; one that is lost for good blocks it until that checkpoint is
    deleted (`delete_checkpoint`).
    """


class Durability(enum.StrEnum):
    """Where every chunk must be before a checkpoint is committed."""

    CACHE = "cache"
    """On the cache server's disk (L2), synced there (`fdatasync` of each chunk's file, a synced index commit),
    or in object storage: survives the server being killed and its machine losing power. Chunks are put with
    `durable=True`. Like DCP's `FileSystemWriter(sync_files=True)`, its default."""
    UNSYNCED = "unsynced"
    """On the cache server's disk (L2), written but not synced, or in object storage: survives the server being
    killed, not its machine losing power. Chunks are put with `durable=False` (a chunk the namespace kept in
    memory only is put again with `durable=True`); manifests and the run's index are synced as with CACHE. Like
    DCP's `FileSystemWriter(sync_files=False)`."""
    S3 = "s3"
    """In object storage: survives the loss of the cache server's disk."""

    def holds(self, location: Location | None) -> bool:
        if location is None:
            return False
        return location.uploaded if self is Durability.S3 else location.durable

    @property
    def synced_puts(self) -> bool:
        """Whether values are put with `durable=True` (on disk and synced when the put returns)."""
        return self is Durability.CACHE


def split_name(name: str) -> tuple[str, str]:
    """(run, step) of a checkpoint name "RUN/STEP".

    Raises:
        CheckpointError: not a valid name (components of letters, digits,
            ".", "_" and "-", not starting with "." or "-"; at least two).
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name) or len(name.encode()) > _MAX_NAME_BYTES:
        raise CheckpointError(
            f"checkpoint name {name!r}: expected RUN/STEP, components of letters, digits, '.', '_' and '-' "
            f"(at most {_MAX_NAME_BYTES} bytes), e.g. 'llama-7b/step-1000'"
        )
    run, _, step = name.rpartition("/")
    return run, step


def _check_run(run: str) -> str:
    split_name(run + "/x")
    return run


@dataclass(frozen=True)
class CheckpointKeys:
    """The cache keys of checkpoints under `prefix`."""

    prefix: str = DEFAULT_PREFIX

    def chunk(self, run: str, digest: str) -> bytes:
        return f"{self.prefix}chunks/{run}/~/{digest}".encode()

    def manifest(self, name: str) -> bytes:
        run, step = split_name(name)
        return f"{self.prefix}manifests/{run}/~/{step}".encode()

    def index(self, run: str) -> bytes:
        return f"{self.prefix}index/{_check_run(run)}/~index".encode()

    def reader(self, name: str) -> bytes:
        run, step = split_name(name)
        return f"{self.prefix}readers/{run}/~/{step}".encode()

    def index_root(self) -> bytes:
        return f"{self.prefix}index/".encode()

    def manifest_value(self, name: str, checksum: int) -> bytes:
        """The cache key of a manifest whose commit the metadata shard holds."""
        return self.manifest(name) + f"~{checksum:016x}".encode()

    def commit_record(self, name: str) -> str:
        """The name of checkpoint `name`'s commit record in the metadata shard."""
        return self.manifest(name).decode()

    def retired_record(self, name: str, checksum: int) -> str:
        """The name of the shard record of a retired manifest of checkpoint `name`."""
        run, step = split_name(name)
        return f"{self.prefix}retired/{run}/~/{step}~{checksum:016x}"

    def record_roots(self) -> tuple[str, str]:
        """The name prefixes of (commit records, retired records) in the metadata shard."""
        return f"{self.prefix}manifests/", f"{self.prefix}retired/"


def chunk_digest(data: memoryview | bytes) -> str:
    """A chunk's name: the 32 hex digits of its xxh3-128."""
    return xxhash.xxh3_128_hexdigest(data)


def parse_manifest(name: str, raw: bytes) -> dict[str, Any]:
    """A manifest value as JSON; CheckpointCorrupt when it is not an object, CheckpointError for another format."""
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, or nested too deep
        raise CheckpointCorrupt(f"checkpoint {name!r}: its manifest is not JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise CheckpointCorrupt(f"checkpoint {name!r}: its manifest is a JSON {type(manifest).__name__}, not an object")
    if manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"checkpoint {name!r}: manifest format {manifest.get('format')!r} is not supported")
    return manifest


@dataclass(frozen=True)
class CheckpointEntry:
    """A committed checkpoint as its run's index lists it."""

    name: str
    created: float
    bytes: int
    chunks: int
