"""The saved model's manifest: which modules it has, the keys of their values, their tensors.

`save_model` (`cacheclient.models.saving`) and `register_safetensors`
(`cacheclient.models.safetensors`) end by committing a `ModelManifest`, a
JSON value listing every module with tensors: its value's keys (parts, in
order), the tensors' names, kinds, dtypes and shapes, its tied tensors, and
the layout of its value (a tensor record, or byte ranges of a safetensors
file). The commit goes through `cacheclient.manifests`: with a metadata
shard, a value under its checksum and then the shard's record
`NAME/manifest` naming it (one Raft entry: readers see the old model or the
new, whole); else the value under `NAME/manifest`. The record's name starts
with the model's name, as its keys do, so a tenant whose prefix the name is
under may commit it (docs/security.md); a record `models/NAME` of an older
save is still read.

This module needs no torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from cacheclient.client import CacheClient
from cacheclient.errors import AuthError, CacheClientError
from cacheclient.manifests import CacheManifests, Manifests, RecordMismatch, manifests
from cacheclient.wire import ranges
from cacheclient.wire import tensors as records

__all__ = [
    "DEFAULT_PART_BYTES",
    "KINDS",
    "KIND_OF_NAME",
    "MANIFEST_FORMAT",
    "RANGES",
    "RECORD",
    "ModelManifest",
    "ModuleEntry",
    "ParameterValueError",
    "TensorInfo",
    "Tie",
    "commit_manifest",
    "manifest_key",
    "model_record",
    "range_of",
    "read_manifest",
]

MANIFEST_FORMAT = "cachesvc-model/1"
DEFAULT_PART_BYTES = 64 << 20
"""Largest value `save_model` writes; a module's record past it is stored in parts."""
KINDS = {records.PARAMETER: "parameter", records.BUFFER: "buffer"}
"""`TensorInfo.kind` of each tensor record kind."""
KIND_OF_NAME = {name: kind for kind, name in KINDS.items()}
"""The tensor record kind of each `TensorInfo.kind`."""


class ParameterValueError(CacheClientError):
    """A stored parameter value is missing, corrupt, from another save, or does not match the manifest.

    Attributes:
        module: the path of the module whose value it is ("" for the root).
    """

    def __init__(self, message: str, module: str) -> None:
        super().__init__(message)
        self.module = module


@dataclass(frozen=True)
class TensorInfo:
    """One stored tensor of a module."""

    name: str
    kind: str  # "parameter" or "buffer"
    dtype: str  # a torch dtype name, e.g. "float32"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return records.TensorEntry(self.name, self.dtype, self.shape).size


@dataclass(frozen=True)
class Tie:
    """A tensor of a module that is another module's tensor (tied weights): stored once, with its owner."""

    name: str
    kind: str
    module: str
    tensor: str


RECORD = "record"
"""`ModuleEntry.layout` of a module stored by `save_model`: a tensor record, in parts."""
RANGES = "ranges"
"""`ModuleEntry.layout` of a module of a registered safetensors file: byte ranges of the file (range keys)."""


@dataclass(frozen=True)
class ModuleEntry:
    """A module with tensors of its own or tied ones: its value's keys (parts, in order) and what it holds.

    `layout` says what the parts joined are: a tensor record (`RECORD`), or
    the module's bytes in a safetensors file (`RANGES`), range keys of the
    file (`cacheclient.wire.ranges`) with each tensor at `offsets[i]` in them.
    """

    path: str
    keys: tuple[bytes, ...]
    record_bytes: int
    tensors: tuple[TensorInfo, ...]
    ties: tuple[Tie, ...] = ()
    layout: str = RECORD
    offsets: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes of the module's own tensors."""
        return sum(t.nbytes for t in self.tensors)

    def part_sizes(self) -> dict[bytes, int]:
        """Each key's value size."""
        if self.layout == RANGES:
            return {key: range_of(key).length for key in self.keys}
        sizes = {}
        for i, key in enumerate(self.keys):
            start = i * -(-self.record_bytes // len(self.keys))
            sizes[key] = min(self.record_bytes - start, -(-self.record_bytes // len(self.keys)))
        return sizes


@dataclass(frozen=True)
class ModelManifest:
    """A saved model: its name, the id of the save, and its modules in registration order.

    `source` is the key of the safetensors file a registered model reads
    from (`register_safetensors`); "" for a model `save_model` stored.
    """

    name: str
    save_id: str
    modules: tuple[ModuleEntry, ...]
    source: str = ""

    @property
    def nbytes(self) -> int:
        """Bytes of every stored tensor."""
        return sum(entry.nbytes for entry in self.modules)

    def execution_steps(self, order: Sequence[str]) -> tuple[list[list[bytes]], dict[bytes, int]]:
        """The keys each module in `order` reads (its value's and its tied tensors' owners'), a step per
        module, and every key's value size: what `Plan.execution_order` plans.

        Raises:
            ValueError: `order` names a module the manifest does not list.
        """
        by_path = {entry.path: entry for entry in self.modules}
        steps = []
        sizes: dict[bytes, int] = {}
        for path in order:
            if path not in by_path:
                raise ValueError(f"{self.name}: no module {path!r} in the manifest")
            needed = [by_path[path], *(by_path[tie.module] for tie in by_path[path].ties)]
            steps.append([k for entry in dict.fromkeys(needed) for k in entry.keys])
            for entry in needed:
                sizes.update(entry.part_sizes())
        return steps, sizes

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "format": MANIFEST_FORMAT,
                "name": self.name,
                "save_id": self.save_id,
                "source": self.source,
                "modules": [
                    {
                        "path": m.path,
                        "keys": [_key_text(k) for k in m.keys],
                        "record_bytes": m.record_bytes,
                        "tensors": [[t.name, t.kind, t.dtype, list(t.shape)] for t in m.tensors],
                        "ties": [[t.name, t.kind, t.module, t.tensor] for t in m.ties],
                        "layout": m.layout,
                        "offsets": list(m.offsets),
                    }
                    for m in self.modules
                ],
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, data: bytes, name: str) -> ModelManifest:
        """Parses a manifest value; raises ParameterValueError (module "") when it is not one."""
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict):
                raise ValueError(f"a JSON {type(doc).__name__}, not an object")
            if doc.get("format") != MANIFEST_FORMAT or doc.get("name") != name:
                raise ValueError(f"format {doc.get('format')!r}, name {doc.get('name')!r}")
            modules = tuple(
                ModuleEntry(
                    path=str(m["path"]),
                    keys=tuple(_key_bytes(k) for k in m["keys"]),
                    record_bytes=int(m["record_bytes"]),
                    tensors=tuple(
                        TensorInfo(str(n), str(k), str(d), tuple(int(x) for x in s)) for n, k, d, s in m["tensors"]
                    ),
                    ties=tuple(Tie(str(n), str(k), str(mod), str(t)) for n, k, mod, t in m["ties"]),
                    layout=str(m.get("layout", RECORD)),
                    offsets=tuple(int(x) for x in m.get("offsets", ())),
                )
                for m in doc["modules"]
            )
            for m in modules:
                if m.layout not in (RECORD, RANGES) or (m.layout == RANGES and len(m.offsets) != len(m.tensors)):
                    raise ValueError(f"module {m.path!r}: layout {m.layout!r} with {len(m.offsets)} offsets")
                if m.layout == RANGES:
                    for key in m.keys:
                        range_of(key)
            return cls(name=name, save_id=str(doc["save_id"]), modules=modules, source=str(doc.get("source", "")))
        except (ValueError, KeyError, TypeError, RecursionError) as exc:  # RecursionError: JSON nested too deep
            raise ParameterValueError(f"{name}: the manifest is not a {MANIFEST_FORMAT} manifest: {exc}", "") from None


def _key_text(key: bytes) -> str:
    """A key as manifest JSON holds it: its UTF-8 text (JSON escapes the NUL of a range key)."""
    return key.decode("utf-8", "surrogateescape")


def _key_bytes(text: Any) -> bytes:
    return str(text).encode("utf-8", "surrogateescape")


def range_of(key: bytes) -> ranges.ByteRange:
    """The range a range key names; ValueError for any other key."""
    found = ranges.parse_range_key(key)
    if found is None:
        raise ValueError(f"{key[:64]!r} is not a range key")
    return found


def manifest_key(name: str) -> bytes:
    """The key of a saved model's manifest (without a metadata shard)."""
    return f"{name}/manifest".encode()


def model_record(name: str) -> str:
    """The metadata shard's record of the model saved as `name` (when the cache has a shard).

    It lies under the model's name, as the model's keys do: a tenant's
    token commits it when the name is under one of the tenant's prefixes.
    """
    return f"{name}/manifest"


def _older_record(name: str) -> str:
    """The record a save before records lay under the model's name made."""
    return f"models/{name}"


def _value_key(name: str, sum64: int) -> bytes:
    return f"{name}/manifest~{sum64:016x}".encode()


def _manifests(cache: CacheClient, record: Callable[[str], str] = model_record) -> Manifests:
    return manifests(cache, key=manifest_key, record=record, value_key=_value_key)


def _load(store: Manifests, name: str) -> tuple[bytes, bytes] | None:
    try:
        return store.load(name)
    except RecordMismatch as exc:
        key = exc.record.key
        if exc.missing:
            raise ParameterValueError(f"{name}: the shard's record names {key!r}, which the cache lacks", "") from None
        raise ParameterValueError(f"{name}: the manifest {key!r} does not match the shard's record", "") from None


def _load_older(cache: CacheClient, name: str) -> tuple[bytes, bytes] | None:
    """The model as a save before `model_record` lay under its name committed it, or None."""
    try:
        return _load(_manifests(cache, _older_record), name)
    except AuthError as exc:
        if exc.code is grpc.StatusCode.PERMISSION_DENIED:
            return None  # a tenant's token, and `models/` not its prefix: no older record of its own is there
        raise


def read_manifest(cache: CacheClient, name: str) -> ModelManifest:
    """The manifest of the model saved as `name`.

    With a metadata shard (a `CacheClient(meta=...)`), the shard's record
    names the manifest's value, its size and checksum, and the value is
    checked against them; a model saved without the shard's record (by a
    client of one server) is found under `manifest_key` as before.

    Raises:
        ParameterValueError: no such model in the cache, or its manifest is damaged.
    """
    store = _manifests(cache)
    found = _load(store, name)
    if found is None and not isinstance(store, CacheManifests):
        found = _load_older(cache, name)
    if found is None and not isinstance(store, CacheManifests):
        found = CacheManifests(cache, key=manifest_key).load(name)
    if found is None:
        raise ParameterValueError(f"{name}: no saved model (no {manifest_key(name).decode()!r} in the cache)", "")
    return ModelManifest.from_json(found[1], name)


def commit_manifest(cache: CacheClient, manifest: ModelManifest) -> None:
    """Makes `manifest` the model's (`cacheclient.manifests`: with a metadata shard, a value named by its
    checksum and then the shard's record naming it; else the value under `manifest_key`)."""
    _manifests(cache).save(manifest.name, manifest.to_json())
