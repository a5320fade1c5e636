"""Plans the cache prefetches ahead of, and model parameters that live in the cache and stream in ahead of use.

Plans: a `Plan` is what a job will read, in order: a list of steps, each
naming the keys it needs (a batch of samples, a module's parameters).
`Plan.sampler_order`, `Plan.execution_order` and `Plan(steps)` build one;
`plan.start(cache, window_bytes=...)` hands it to the cache server, which
fetches ahead of the reads it serves (from S3 into its memory) while at most
`window_bytes` are fetched and not yet read. The server learns progress from
those reads; `PlanRun.advance` reports it explicitly.

Parameters: `save_model(model, cache, name)` stores each module's own
parameters and buffers as one value (a tensor record,
`cacheclient.wire.tensors`: raw bytes behind a small header, a checksum per
tensor, no pickle), split in parts past `part_bytes`, and then a manifest
value, `<name>/manifest`, that lists the modules, their keys, tensor names,
dtypes and shapes. Every value is bound to its save and module path, so a
value from another save or under another key is refused. `load_model` fills
a model built on the `meta` device from them.

Streaming: inside `with stream_parameters(model, cache, name,
budget_bytes=...)` the model (or its `generate`) runs as usual while its
parameters live in the cache. Forward pre-hooks record the order in which
modules run; that order, round and round (one forward after another), is
the plan. A fetcher thread reads the next modules' values while the current
module computes, holding at most `budget_bytes` of parameters: when room is
needed it drops what is used again furthest away, and it fetches ahead only
when that drops nothing needed sooner (`cacheclient._residency`). A forward
whose order differs from the plan is still served, each module loading what
it needs, and its order becomes the new plan. Results are bit-identical to
the model with every parameter local. A value that is missing or corrupt
raises `ParameterValueError`, naming the module, when that module runs.

This module needs torch; `cacheclient` itself does not import it.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import itertools
import json
import logging
import struct
import threading
import time
import uuid
import warnings
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from cacheclient.client import CacheClient, PrefetchPlan
from cacheclient.errors import CacheClientError, CorruptValueError
from cacheclient.meta import ManifestItem, MetaClient
from cacheclient.wire import checksum, ranges
from cacheclient.wire import tensors as records

__all__ = [
    "DEFAULT_PART_BYTES",
    "ModelManifest",
    "ModuleEntry",
    "ParameterStream",
    "ParameterValueError",
    "Plan",
    "PlanRun",
    "TensorInfo",
    "Tie",
    "load_model",
    "read_manifest",
    "register_safetensors",
    "save_model",
    "stream_parameters",
]

log = logging.getLogger(__name__)

MANIFEST_FORMAT = "cachesvc-model/1"
DEFAULT_PART_BYTES = 64 << 20
"""Largest value `save_model` writes; a module's record past it is stored in parts."""
_PUT_BATCH_BYTES = 64 << 20
_LOAD_BATCH_BYTES = 256 << 20
_KINDS = {records.PARAMETER: "parameter", records.BUFFER: "buffer"}
_KIND_OF_NAME = {name: kind for kind, name in _KINDS.items()}


class ParameterValueError(CacheClientError):
    """A stored parameter value is missing, corrupt, from another save, or does not match the manifest.

    Attributes:
        module: the path of the module whose value it is ("" for the root).
    """

    def __init__(self, message: str, module: str) -> None:
        super().__init__(message)
        self.module = module


# -- plans ----------------------------------------------------------------------


def _as_key(key: bytes | str) -> bytes:
    return key.encode() if isinstance(key, str) else bytes(key)


class Plan:
    """What a job will read, in order: steps, each naming the keys it needs.

    Stored flat (the keys in order, and where each step starts), so a plan
    of an epoch of millions of samples costs about what its list of keys does.

    Args:
        steps: the keys of each step, in the order the steps run. A key may
            appear in several steps (a loop reads it again).
        sizes: the values' sizes by key, when known; they keep the server's
            window exact.
    """

    def __init__(self, steps: Iterable[Iterable[bytes | str]], *, sizes: Mapping[bytes, int] | None = None) -> None:
        keys: list[bytes] = []
        bounds = array("q", [0])
        for step in steps:
            keys.extend(_as_key(k) for k in step)
            bounds.append(len(keys))
        known = sizes is not None and all(k in sizes for k in keys)
        self._init(keys, bounds, [sizes[k] for k in keys] if sizes is not None and known else None)

    def _init(self, keys: list[bytes], bounds: array[int] | None, sizes: list[int] | None) -> None:
        self._keys = keys
        self._bounds = bounds  # None: one key per step
        self.sizes = sizes
        """Each key's value size, in `keys()` order; None when not all are known."""

    @classmethod
    def _flat(cls, keys: list[bytes], sizes: list[int] | None) -> Plan:
        plan = cls.__new__(cls)
        plan._init(keys, None, sizes)
        return plan

    def __repr__(self) -> str:
        return f"Plan({len(self)} steps, {len(self._keys)} keys)"

    def __len__(self) -> int:
        return len(self._keys) if self._bounds is None else len(self._bounds) - 1

    @property
    def steps(self) -> list[tuple[bytes, ...]]:
        """The keys of each step, in order."""
        if self._bounds is None:
            return [(k,) for k in self._keys]
        b = self._bounds
        return [tuple(self._keys[b[i] : b[i + 1]]) for i in range(len(b) - 1)]

    @classmethod
    def from_dag(
        cls,
        steps: Mapping[str, Iterable[bytes | str]],
        after: Mapping[str, Iterable[str]],
        *,
        sizes: Mapping[bytes, int] | None = None,
    ) -> Plan:
        """A plan of steps that depend on each other: a topological order of the DAG.

        Args:
            steps: each step's keys, by step name, in the order the steps were
                given (that order breaks ties: of the steps whose dependencies
                are done, the one listed first runs first, as a scheduler that
                runs ready work in submission order does).
            after: for a step, the steps it runs after (omitted: none).

        Raises:
            ValueError: `after` names a step `steps` does not, or the steps form a cycle.
        """
        names = list(steps)
        index = {name: i for i, name in enumerate(names)}
        waiting = [0] * len(names)
        unblocks: list[list[int]] = [[] for _ in names]
        for name, deps in after.items():
            if name not in index:
                raise ValueError(f"after names step {name!r}, which is not in steps")
            for dep in set(deps):
                if dep not in index:
                    raise ValueError(f"step {name!r} runs after {dep!r}, which is not in steps")
                waiting[index[name]] += 1
                unblocks[index[dep]].append(index[name])
        ready = [i for i, n in enumerate(waiting) if n == 0]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            i = heapq.heappop(ready)
            order.append(i)
            for j in unblocks[i]:
                waiting[j] -= 1
                if waiting[j] == 0:
                    heapq.heappush(ready, j)
        if len(order) != len(names):
            cycle = sorted(names[i] for i, n in enumerate(waiting) if n > 0)
            raise ValueError(f"the steps form a cycle (among {', '.join(map(repr, cycle[:8]))})")
        return cls((steps[names[i]] for i in order), sizes=sizes)

    @classmethod
    def of_keys(cls, keys: Sequence[bytes | str], sizes: Sequence[int] | None = None) -> Plan:
        """A plan that reads `keys` one per step, in order."""
        if sizes is not None and len(sizes) != len(keys):
            raise ValueError(f"{len(sizes)} sizes for {len(keys)} keys")
        return cls._flat([_as_key(k) for k in keys], None if sizes is None else list(sizes))

    @classmethod
    def sampler_order(
        cls, keys: Sequence[bytes | str], indices: Iterable[int], sizes: Sequence[int] | None = None
    ) -> Plan:
        """The plan of an epoch: `keys[i]` for each sample index `i` in the sampler's order.

        Args:
            keys: every sample's key, by index.
            indices: the order the sampler yields.
            sizes: every sample's size, by index, when known.

        Raises:
            IndexError: an index out of range.
        """
        order = indices if isinstance(indices, Sequence) else list(indices)
        for i in order:
            if not 0 <= i < len(keys):
                raise IndexError(f"sampler index {i} out of range for {len(keys)} samples")
        return cls._flat([_as_key(keys[i]) for i in order], None if sizes is None else [sizes[i] for i in order])

    @classmethod
    def execution_order(cls, manifest: ModelManifest, order: Sequence[str]) -> Plan:
        """The plan of one forward of a saved model: the values of each module in `order`, the order it runs.

        Args:
            manifest: the saved model's manifest (`read_manifest`).
            order: module paths in execution order (`ParameterStream.order`).
        """
        by_path = {entry.path: entry for entry in manifest.modules}
        steps = []
        sizes: dict[bytes, int] = {}
        for path in order:
            if path not in by_path:
                raise ValueError(f"{manifest.name}: no module {path!r} in the manifest")
            needed = [by_path[path], *(by_path[tie.module] for tie in by_path[path].ties)]
            keys = [k for entry in dict.fromkeys(needed) for k in entry.keys]
            steps.append(keys)
            for entry in needed:
                sizes.update(entry.part_sizes())
        return cls(steps, sizes=sizes)

    def keys(self) -> list[bytes]:
        """Every step's keys, in order."""
        return self._keys

    def keys_before(self, step: int) -> int:
        """How many keys the steps before `step` read: the cursor in keys at that step."""
        if self._bounds is None:
            return min(step, len(self._keys))
        return self._bounds[min(step, len(self._bounds) - 1)]

    def start(self, cache: CacheClient, *, window_bytes: int, priority: str = "normal") -> PlanRun:
        """Hands the plan to the cache server; it fetches ahead of the reads until the run is closed.

        Raises:
            InvalidRequestError, LimitExceededError, DeadlineError: as `CacheClient.prefetch`.
        """
        return PlanRun(self, cache.prefetch(self._keys, window_bytes=window_bytes, sizes=self.sizes, priority=priority))


class PlanRun:
    """A `Plan` running on a cache server; a context manager that ends it."""

    def __init__(self, plan: Plan, prefetch: PrefetchPlan) -> None:
        self.plan = plan
        self.prefetch = prefetch
        """The client's handle of the server's plan."""

    @property
    def progress(self) -> dict[str, Any]:
        """The server's last report: keys planned, fetched, consumed, the window in use, failed, done."""
        return self.prefetch.progress

    def advance(self, steps_done: int) -> None:
        """Tells the server the first `steps_done` steps have been read (reads it serves also count)."""
        self.prefetch.consumed(self.plan.keys_before(steps_done))

    def wait(self, timeout: float) -> bool:
        """Waits until the server reports every key fetched (or failed); returns whether it did."""
        return self.prefetch.wait(timeout)

    def close(self) -> None:
        """Ends the plan: the server stops fetching for it."""
        self.prefetch.close()

    def __enter__(self) -> PlanRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the manifest ---------------------------------------------------------------


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
            return {key: _range_of(key).length for key in self.keys}
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
                        _range_of(key)
            return cls(name=name, save_id=str(doc["save_id"]), modules=modules, source=str(doc.get("source", "")))
        except (ValueError, KeyError, TypeError, RecursionError) as exc:  # RecursionError: JSON nested too deep
            raise ParameterValueError(f"{name}: the manifest is not a {MANIFEST_FORMAT} manifest: {exc}", "") from None


def _key_text(key: bytes) -> str:
    """A key as manifest JSON holds it: its UTF-8 text (JSON escapes the NUL of a range key)."""
    return key.decode("utf-8", "surrogateescape")


def _key_bytes(text: Any) -> bytes:
    return str(text).encode("utf-8", "surrogateescape")


def _range_of(key: bytes) -> ranges.ByteRange:
    """The range a range key names; ValueError for any other key."""
    found = ranges.parse_range_key(key)
    if found is None:
        raise ValueError(f"{key[:64]!r} is not a range key")
    return found


def manifest_key(name: str) -> bytes:
    """The key of a saved model's manifest."""
    return f"{name}/manifest".encode()


def model_record(name: str) -> str:
    """The metadata shard's record of the model saved as `name` (when the cache has a shard)."""
    return f"models/{name}"


def read_manifest(cache: CacheClient, name: str) -> ModelManifest:
    """The manifest of the model saved as `name`.

    With a metadata shard (a `CacheClient(meta=...)`), the shard's record
    names the manifest's value, its size and checksum, and the value is
    checked against them; a model saved without the shard's record (by a
    client of one server) is found under `manifest_key` as before.

    Raises:
        ParameterValueError: no such model in the cache, or its manifest is damaged.
    """
    meta = _shard_of(cache)
    record = meta.get_manifest(model_record(name)) if meta is not None else None
    if record is not None and len(record.items) == 1:
        item = record.items[0]
        data = cache.get(item.key)
        if data is None:
            raise ParameterValueError(f"{name}: the shard's record names {item.key!r}, which the cache lacks", "")
        if len(data) != item.size or checksum(data) != item.checksum:
            raise ParameterValueError(f"{name}: the manifest {item.key!r} does not match the shard's record", "")
        return ModelManifest.from_json(data, name)
    data = cache.get(manifest_key(name))
    if data is None:
        raise ParameterValueError(f"{name}: no saved model (no {manifest_key(name).decode()!r} in the cache)", "")
    return ModelManifest.from_json(data, name)


def _shard_of(cache: CacheClient) -> MetaClient | None:
    router = cache.router
    return router.meta if router is not None else None


def _commit_manifest(cache: CacheClient, manifest: ModelManifest) -> None:
    """Makes `manifest` the model's: with a metadata shard, a value named by its checksum and then the
    shard's record naming it (one Raft entry: readers see the old model or the new, whole); else the
    value under `manifest_key`."""
    data = manifest.to_json()
    meta = _shard_of(cache)
    if meta is None:
        cache.put(manifest_key(manifest.name), data)
        return
    sum64 = checksum(data)
    key = f"{manifest.name}/manifest~{sum64:016x}"
    cache.put(key, data)
    meta.put_manifest(model_record(manifest.name), items=[ManifestItem(key=key, size=len(data), checksum=sum64)])


# -- save and load --------------------------------------------------------------


def _own_tensors(module: nn.Module) -> Iterator[tuple[str, int, torch.Tensor]]:
    for name, p in module._parameters.items():
        if p is not None:
            yield name, records.PARAMETER, p
    for name, b in module._buffers.items():
        if b is not None:
            yield name, records.BUFFER, b


def _slots(module: nn.Module, kind: int) -> dict[str, Any]:
    """The module's parameters or its buffers, by name: where a tensor of that kind is put."""
    slots: dict[str, Any] = module._parameters if kind == records.PARAMETER else module._buffers
    return slots


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _module_key(name: str, path: str) -> str:
    return f"{name}/module/{path or '(root)'}"


def save_model(
    model: nn.Module, cache: CacheClient, name: str, *, part_bytes: int = DEFAULT_PART_BYTES
) -> ModelManifest:
    """Stores every parameter and buffer of `model`: one value per module, then the manifest.

    The manifest is written last, so a reader never finds a manifest whose
    values are not all stored. Saving again under `name` replaces the model;
    values of the earlier save no longer match the new manifest.

    Args:
        model: any module; tensors on any device (they are copied to the host).
        cache: the cache to store in.
        name: the model's name: its keys start with `name/`.
        part_bytes: largest value written; a module's record past it is split.

    Returns:
        The manifest written.

    Raises:
        ValueError: a tensor is on the meta device, or its dtype cannot be stored.
    """
    if not name:
        raise ValueError("a saved model needs a name")
    save_id = uuid.uuid4().hex
    seen: dict[int, tuple[str, str]] = {}
    entries: list[ModuleEntry] = []
    batch: list[tuple[bytes, bytes]] = []
    batch_bytes = 0
    for path, module in model.named_modules():
        own: list[tuple[records.TensorEntry, Any]] = []
        infos: list[TensorInfo] = []
        ties: list[Tie] = []
        for tname, kind, tensor in _own_tensors(module):
            if id(tensor) in seen:
                owner, owner_tensor = seen[id(tensor)]
                ties.append(Tie(tname, _KINDS[kind], owner, owner_tensor))
                continue
            if tensor.is_meta:
                raise ValueError(f"{name}: module {path!r} tensor {tname!r} is on the meta device; nothing to save")
            seen[id(tensor)] = (path, tname)
            data = tensor.detach().to("cpu").contiguous()
            dtype = _dtype_name(data.dtype)
            info = TensorInfo(tname, _KINDS[kind], dtype, tuple(data.shape))
            infos.append(info)
            own.append(
                (records.TensorEntry(tname, dtype, info.shape, kind), data.reshape(-1).view(torch.uint8).numpy())
            )
        if not own and not ties:
            continue
        keys: tuple[bytes, ...] = ()
        size = 0
        if own:
            keys, size = _record_values(name, save_id, path, own, part_bytes, batch)
            batch_bytes += size
        entries.append(ModuleEntry(path, keys, size, tuple(infos), tuple(ties)))
        if batch_bytes >= _PUT_BATCH_BYTES:
            cache.put_many(batch)
            batch, batch_bytes = [], 0
    if batch:
        cache.put_many(batch)
    manifest = ModelManifest(name, save_id, tuple(entries))
    _commit_manifest(cache, manifest)
    return manifest


def _record_values(
    name: str,
    save_id: str,
    path: str,
    own: Sequence[tuple[records.TensorEntry, Any]],
    part_bytes: int,
    out: list[tuple[bytes, bytes]],
) -> tuple[tuple[bytes, ...], int]:
    """Packs a module's tensors as one record, split in parts past `part_bytes`, appended to `out` as
    (key, value); returns the keys and the record's size."""
    record = records.pack(records.owner_digest(save_id, path), own)
    size = len(record)
    parts = max(1, -(-size // part_bytes))
    step = -(-size // parts)
    base = _module_key(name, path)
    keys = tuple(f"{base}#{i}".encode() if parts > 1 else base.encode() for i in range(parts))
    view = memoryview(record)
    for i, key in enumerate(keys):
        out.append((key, bytes(view[i * step : (i + 1) * step])))
    return keys, size


# -- safetensors files in object storage ----------------------------------------

SAFETENSORS_DTYPES: Mapping[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "C64": "complex64",
}
"""The torch dtype name of each safetensors dtype `register_safetensors` reads."""
_MAX_SAFETENSORS_HEADER = 100_000_000  # the format's own limit


@dataclass(frozen=True)
class _FileTensor:
    """A tensor of a safetensors file: its dtype (torch's name), shape, and bytes [begin, end) in the file."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _read_range(cache: CacheClient, name: str, key: bytes, start: int, end: int, what: str) -> bytes:
    """Bytes `start`..`end` (inclusive) of object `key`, through the cache; ParameterValueError naming `what`."""
    try:
        value = cache.get(ranges.range_key(key, start, end))
    except CacheClientError as exc:
        raise ParameterValueError(f"{name}: {key.decode(errors='replace')!r}: cannot read {what}: {exc}", "") from None
    if value is None:
        raise ParameterValueError(f"{name}: no object {key.decode(errors='replace')!r} in object storage", "")
    if len(value) != end - start + 1:
        raise ParameterValueError(f"{name}: {what} read {len(value)} bytes, want {end - start + 1}", "")
    return value


def _read_safetensors_header(cache: CacheClient, name: str, key: bytes) -> dict[str, _FileTensor]:
    """The tensors a safetensors file's header lists, checked: dtypes known, sizes that match shapes, no
    overlaps, every byte inside the file. ParameterValueError (module "") naming the problem otherwise."""
    where = f"{name}: {key.decode(errors='replace')!r} is not a valid safetensors file"
    size = struct.unpack("<Q", _read_range(cache, name, key, 0, 7, "the safetensors header length"))[0]
    if not 2 <= size <= _MAX_SAFETENSORS_HEADER:
        raise ParameterValueError(f"{where}: its header length is {size} bytes", "")
    raw = _read_range(cache, name, key, 8, 8 + size - 1, f"the {size}-byte safetensors header")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ParameterValueError(f"{where}: its header is not JSON: {exc}", "") from None
    if not isinstance(header, dict):
        raise ParameterValueError(f"{where}: its header is not a JSON object", "")
    data_start = 8 + size
    tensors: dict[str, _FileTensor] = {}
    for tname, spec in header.items():
        if tname == "__metadata__":
            continue
        try:
            dtype_code, shape, (begin, end) = spec["dtype"], tuple(spec["shape"]), spec["data_offsets"]
            if not all(isinstance(x, int) and x >= 0 for x in (*shape, begin, end)):
                raise TypeError("shape and offsets must be whole numbers")
        except (KeyError, TypeError, ValueError) as exc:
            raise ParameterValueError(f"{where}: tensor {tname!r}: malformed entry {spec!r}: {exc}", "") from None
        dtype = SAFETENSORS_DTYPES.get(dtype_code) if isinstance(dtype_code, str) else None
        if dtype is None:
            known = ", ".join(SAFETENSORS_DTYPES)
            raise ParameterValueError(f"{name}: tensor {tname!r}: dtype {dtype_code!r} is not supported ({known})", "")
        nbytes = records.TensorEntry(tname, dtype, shape).size
        if end - begin != nbytes:
            raise ParameterValueError(
                f"{where}: tensor {tname!r}: data_offsets [{begin}, {end}] hold {end - begin} bytes, "
                f"its {dtype_code} shape {list(shape)} needs {nbytes}",
                "",
            )
        tensors[tname] = _FileTensor(dtype, shape, data_start + begin, data_start + end)
    spans = sorted((t.begin, t.end, n) for n, t in tensors.items() if t.end > t.begin)
    for (_, end_a, a), (begin_b, _, b) in itertools.pairwise(spans):
        if begin_b < end_a:
            raise ParameterValueError(f"{where}: tensors {a!r} and {b!r} overlap", "")
    if spans:
        last = spans[-1][1] - 1
        _read_range(cache, name, key, last, last, f"the last byte of tensor {spans[-1][2]!r} (byte {last})")
    return tensors


def _module_ranges(
    key: bytes, tensors: Sequence[tuple[str, _FileTensor]], part_bytes: int
) -> tuple[tuple[bytes, ...], int, tuple[int, ...]]:
    """A module's tensors as range keys: one per run of tensors contiguous in the file (split past
    `part_bytes`); also the bytes of all ranges and each tensor's offset in them (in `tensors`' order)."""
    order = sorted(range(len(tensors)), key=lambda i: tensors[i][1].begin)
    runs: list[list[int]] = []  # [begin, end) in the file
    offsets = [0] * len(tensors)
    total = 0
    for i in order:
        t = tensors[i][1]
        if t.end == t.begin:
            offsets[i] = total
            continue
        if runs and runs[-1][1] == t.begin:
            runs[-1][1] = t.end
        else:
            runs.append([t.begin, t.end])
        offsets[i] = total
        total += t.end - t.begin
    keys = []
    for begin, end in runs:
        for start in range(begin, end, part_bytes):
            keys.append(ranges.range_key(key, start, min(start + part_bytes, end) - 1))
    return tuple(keys), total, tuple(offsets)


def register_safetensors(
    cache: CacheClient,
    name: str,
    key: bytes | str,
    *,
    model: nn.Module | None = None,
    part_bytes: int = DEFAULT_PART_BYTES,
) -> ModelManifest:
    """Registers a safetensors file in object storage as the model `name`, without rewriting it.

    Reads only the file's header (two small ranges through the cache, and
    the last data byte, to learn the file is whole) and writes a manifest
    under `name` whose modules' values are byte ranges of the file (range
    keys, `cacheclient.wire.ranges`): `load_model` and `stream_parameters`
    then read it as they read a saved model, and the cache server reads each
    range from object storage on a miss (a ranged GET), caches it and
    prefetches it like any value. One range per run of a module's tensors
    that lie together in the file (all of a module's tensors, as a file
    written from a state dict has them), split past `part_bytes`.

    The cache reads the file as it is at each miss: replacing the object
    under a registered model is not noticed by values already cached;
    register again under a new name after replacing it.

    Args:
        cache: the cache whose server's object storage holds the file.
        name: the model's name (its manifest is `<name>/manifest`).
        key: the file's cache key: its object name under the server's S3 prefix.
        model: the model the file is for (on `meta` or not). Given, each
            tensor takes its kind (parameter or buffer) from it, tied
            tensors are tied (a file holds one of them), the file must hold
            every persistent tensor of the model with its dtype and shape,
            and non-persistent buffers the model holds off `meta` (rotary
            tables) are stored in the cache as tensor records, so a model
            built on `meta` gets them. Without it, every tensor of the file
            is a parameter of the module its name's prefix names.
        part_bytes: largest range one value reads.

    Returns:
        The manifest written.

    Raises:
        ParameterValueError: no such object, or not a valid safetensors
            file (header malformed, a tensor past the end of the file, an
            unknown dtype): the message names the problem and the tensor.
        ValueError: the file does not match `model` (naming the tensor).
    """
    if not name:
        raise ValueError("a registered model needs a name")
    key = _as_key(key)
    source = key.decode(errors="replace")
    file = _read_safetensors_header(cache, name, key)
    save_id = uuid.uuid4().hex
    # Per module path, in order: its own tensors (name, kind, file tensor), its ties, its stored buffers.
    modules: dict[str, tuple[list[tuple[str, str, _FileTensor]], list[Tie], list[tuple[records.TensorEntry, Any]]]]
    modules = {}
    if model is None:
        for full in sorted(file, key=lambda n: file[n].begin):
            path, _, tname = full.rpartition(".")
            modules.setdefault(path, ([], [], []))[0].append((tname, "parameter", file[full]))
    else:
        modules = _match_model(model, file, name)
    entries: list[ModuleEntry] = []
    batch: list[tuple[bytes, bytes]] = []
    for path, (own, ties, stored) in modules.items():
        if not own and not ties and not stored:
            continue
        if stored and not own:  # non-persistent buffers only (a module with file tensors keeps its own)
            keys, size = _record_values(name, save_id, path, stored, part_bytes, batch)
            infos = tuple(TensorInfo(e.name, _KINDS[e.kind], e.dtype, e.shape) for e, _ in stored)
            entries.append(ModuleEntry(path, keys, size, infos, tuple(ties)))
            continue
        keys, size, offsets = _module_ranges(key, [(tname, t) for tname, _, t in own], part_bytes)
        infos = tuple(TensorInfo(tname, kind, t.dtype, t.shape) for tname, kind, t in own)
        entries.append(ModuleEntry(path, keys, size, infos, tuple(ties), RANGES, offsets))
    if batch:
        cache.put_many(batch)
    manifest = ModelManifest(name, save_id, tuple(entries), source)
    _commit_manifest(cache, manifest)
    return manifest


def _match_model(
    model: nn.Module, file: Mapping[str, _FileTensor], name: str
) -> dict[str, tuple[list[tuple[str, str, _FileTensor]], list[Tie], list[tuple[records.TensorEntry, Any]]]]:
    """`register_safetensors`'s modules, matched against `model`: the file's tensors by the model's names."""
    where = f"{name}: the safetensors file does not match the model"
    places: dict[int, list[tuple[str, str, int, str]]] = {}  # id(tensor) -> its (full name, path, kind, name)
    for path, module in model.named_modules():
        for tname, kind, tensor in _own_tensors(module):
            full = f"{path}.{tname}" if path else tname
            places.setdefault(id(tensor), []).append((full, path, kind, tname))
    out: dict[str, tuple[list[tuple[str, str, _FileTensor]], list[Tie], list[tuple[records.TensorEntry, Any]]]] = {}
    used: set[str] = set()
    tensors = {id(t): t for _, m in model.named_modules() for _, _, t in _own_tensors(m)}
    for tensor_id, names in places.items():
        tensor = tensors[tensor_id]
        found = next((n for n in names if n[0] in file), None)
        if found is None:
            full, path, kind, tname = names[0]
            module = model.get_submodule(path)
            if kind == records.BUFFER and tname in module._non_persistent_buffers_set:
                if not tensor.is_meta and all(n[1] == path for n in names):
                    data = tensor.detach().to("cpu").contiguous()
                    entry = records.TensorEntry(tname, _dtype_name(data.dtype), tuple(data.shape), kind)
                    out.setdefault(path, ([], [], []))[2].append((entry, data.reshape(-1).view(torch.uint8).numpy()))
                continue
            raise ValueError(f"{where}: the model's tensor {full!r} is not in the file")
        full, path, kind, tname = found
        t = file[full]
        used.add(full)
        if t.dtype != _dtype_name(tensor.dtype) or t.shape != tuple(tensor.shape):
            raise ValueError(
                f"{where}: tensor {full!r} is {t.dtype} {list(t.shape)} in the file, "
                f"{_dtype_name(tensor.dtype)} {list(tensor.shape)} in the model"
            )
        out.setdefault(path, ([], [], []))[0].append((tname, _KINDS[kind], t))
        for other_full, other_path, other_kind, other_name in names:
            if other_full != full:
                used.add(other_full)
                out.setdefault(other_path, ([], [], []))[1].append(Tie(other_name, _KINDS[other_kind], path, tname))
    unused = sorted(set(file) - used)
    if unused:
        raise ValueError(f"{where}: the file's tensor {unused[0]!r} is not the model's ({len(unused)} such)")
    order = [path for path, _ in model.named_modules()]
    return {path: out[path] for path in order if path in out}


@dataclass
class _Held:
    """A module's decoded tensors: views into one host buffer (`buffer`; None once moved to another device)."""

    tensors: dict[str, torch.Tensor]
    buffer: torch.Tensor | None


def _buffer_bytes(entry: ModuleEntry) -> int:
    """Bytes of the host buffer that holds a module's tensors, each 64-byte aligned (as torch allocates)."""
    return sum(-(-t.nbytes // records.ALIGN) * records.ALIGN for t in entry.tensors)


def _new_buffer(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def _decode(
    manifest: ModelManifest,
    entry: ModuleEntry,
    parts: list[bytes],
    device: torch.device,
    allocate: Callable[[int], torch.Tensor] = _new_buffer,
) -> _Held:
    """The tensors of a module's value, copied into an aligned buffer from `allocate`; ParameterValueError if bad."""
    record = parts[0] if len(parts) == 1 else b"".join(parts)
    if entry.layout == RANGES:
        return _decode_ranges(manifest, entry, record, device, allocate)
    try:
        stored = records.unpack(record, records.owner_digest(manifest.save_id, entry.path))
    except records.TensorRecordError as exc:
        raise ParameterValueError(
            f"{manifest.name}: module {entry.path!r}: value {entry.keys[0].decode()!r} is corrupt: {exc}", entry.path
        ) from None
    expected = [(t.name, _KIND_OF_NAME[t.kind], t.dtype, t.shape) for t in entry.tensors]
    if [(e.name, e.kind, e.dtype, e.shape) for e, _ in stored] != expected:
        raise ParameterValueError(
            f"{manifest.name}: module {entry.path!r}: its value holds other tensors than the manifest lists", entry.path
        )
    # A copy, not a view of the received bytes: those are not aligned as torch aligns its
    # tensors, and BLAS kernels may round differently on differently aligned inputs.
    buffer = allocate(_buffer_bytes(entry))
    out = {}
    offset = 0
    with warnings.catch_warnings():
        # frombuffer warns that bytes are read-only; they are only read.
        warnings.simplefilter("ignore", UserWarning)
        for e, data in stored:
            place = buffer[offset : offset + e.nbytes]
            if e.nbytes:
                place.copy_(torch.frombuffer(data, dtype=torch.uint8))
            out[e.name] = place.view(getattr(torch, e.dtype)).view(e.shape)
            offset += -(-e.nbytes // records.ALIGN) * records.ALIGN
    if device.type != "cpu":
        return _Held({name: t.to(device) for name, t in out.items()}, None)
    return _Held(out, buffer)


def _decode_ranges(
    manifest: ModelManifest,
    entry: ModuleEntry,
    data: bytes,
    device: torch.device,
    allocate: Callable[[int], torch.Tensor],
) -> _Held:
    """`_decode` of a module's byte ranges of a safetensors file: each tensor at its offset in them."""
    if len(data) != entry.record_bytes:
        raise ParameterValueError(
            f"{manifest.name}: module {entry.path!r}: its ranges of {manifest.source!r} hold {len(data)} bytes, "
            f"its tensors {entry.record_bytes}",
            entry.path,
        )
    buffer = allocate(_buffer_bytes(entry))
    out = {}
    offset = 0
    source = memoryview(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # frombuffer: the bytes are read-only; they are only read
        for t, at in zip(entry.tensors, entry.offsets, strict=True):
            place = buffer[offset : offset + t.nbytes]
            if t.nbytes:
                place.copy_(torch.frombuffer(source[at : at + t.nbytes], dtype=torch.uint8))
            out[t.name] = place.view(getattr(torch, t.dtype)).view(t.shape)
            offset += -(-t.nbytes // records.ALIGN) * records.ALIGN
    if device.type != "cpu":
        return _Held({name: t.to(device) for name, t in out.items()}, None)
    return _Held(out, buffer)


class _BufferPool:
    """Host buffers of dropped modules, kept for the next module of the same size.

    A fresh buffer costs a page fault per page on first touch (a copy into
    one ran at 2-3 GB/s here, into a reused one at 14 GB/s), and on a loop
    every layer's modules have the sizes of the layer before. A buffer is
    reused only when nothing else holds a view of it. Buffers handed out and
    buffers kept together stay within `limit` bytes (the budget): a module
    dropped to make room hands its buffer to the one fetched in its place.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free: list[torch.Tensor] = []  # oldest first
        self._lock = threading.Lock()
        self.bytes = 0
        self.reused = 0
        self._in_use = 0
        # What a buffer nothing else holds counts; None where torch does not tell (then nothing is reused).
        self._alone = _use_count(torch.empty(1, dtype=torch.uint8))

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            self._in_use += nbytes
            for i in range(len(self._free) - 1, -1, -1):
                if self._free[i].numel() == nbytes:
                    self.bytes -= nbytes
                    self.reused += 1
                    return self._free.pop(i)
        return _new_buffer(nbytes)

    def give(self, buffer: torch.Tensor) -> None:
        """Takes a buffer back; keeps it for reuse, before older ones, if nothing else holds it."""
        nbytes = buffer.numel()
        alone = self._alone is not None and _use_count(buffer) == self._alone
        with self._lock:
            self._in_use -= nbytes
            if not alone or self._in_use + nbytes > self.limit:
                return
            while self._free and self.bytes + self._in_use + nbytes > self.limit:
                self.bytes -= self._free.pop(0).numel()
            self._free.append(buffer)
            self.bytes += nbytes

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self.bytes = 0


def _use_count(tensor: torch.Tensor) -> int | None:
    """References to the tensor's storage (tensors and views sharing it, plus this call's own); None if unknown."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else int(count(tensor.untyped_storage()._cdata))


def _fetch(
    cache: CacheClient,
    manifest: ModelManifest,
    units: Sequence[int],
    device: torch.device,
    deliver: Callable[[int, _Held | BaseException | None], None],
    allocate: Callable[[int], torch.Tensor] = _new_buffer,
) -> None:
    """Reads the values of `units` (module indexes) in one stream, handing each over as it completes.

    `deliver(unit, tensors)` for a good value; `deliver(unit, error)` for a
    missing or bad one, or for every unit left when the stream fails;
    `deliver(unit, None)` for those left after a value corrupt in transit
    (worth reading again).
    """
    keys = [k for u in units for k in manifest.modules[u].keys]
    pending = list(units)
    parts: list[bytes] = []
    seen = 0

    def deliver_keyless() -> None:
        # A module whose tensors are all empty has no value to read.
        while pending and not manifest.modules[pending[0]].keys:
            entry = manifest.modules[pending[0]]
            deliver(pending.pop(0), _decode(manifest, entry, [b""], device, allocate))

    try:
        deliver_keyless()
        for _, value in cache.iter_many(keys):
            entry = manifest.modules[pending[0]]
            seen += 1
            if value is not None:
                parts.append(value)
            if seen < len(entry.keys):
                continue
            result: _Held | BaseException
            if len(parts) < len(entry.keys):
                key = entry.keys[0].decode(errors="replace")
                where = f" (its object {manifest.source!r} is gone)" if entry.layout == RANGES else ""
                result = ParameterValueError(
                    f"{manifest.name}: module {entry.path!r}: value {key!r} is missing from the cache{where}",
                    entry.path,
                )
            else:
                try:
                    result = _decode(manifest, entry, parts, device, allocate)
                except ParameterValueError as exc:
                    result = exc
            deliver(pending.pop(0), result)
            parts, seen = [], 0
            deliver_keyless()
    except CorruptValueError as exc:
        if pending:
            entry = manifest.modules[pending[0]]
            deliver(pending.pop(0), ParameterValueError(f"{manifest.name}: module {entry.path!r}: {exc}", entry.path))
        for unit in pending:
            deliver(unit, None)
    except BaseException as exc:
        for unit in pending:
            deliver(unit, exc)
        raise


class _Bound:
    """A manifest matched against a model: each stored module's module object, and where its tensors go.

    Raises ValueError, naming the module, when the model's modules or tensors
    differ from the manifest's.
    """

    def __init__(self, model: nn.Module, manifest: ModelManifest) -> None:
        self.manifest = manifest
        modules = dict(model.named_modules())
        index = {entry.path: i for i, entry in enumerate(manifest.modules)}
        where = f"{manifest.name}: the model does not match the saved one"
        # Non-persistent buffers (rotary tables, masks) that the manifest does not list stay as the model has them:
        # a safetensors file never holds them.
        self.kept: list[tuple[str, nn.Module, str]] = []
        for path, module in modules.items():
            entry = manifest.modules[index[path]] if path in index else None
            listed_names = {t.name for t in entry.tensors} | {t.name for t in entry.ties} if entry else set()
            for tname, kind, _ in _own_tensors(module):
                if tname in listed_names:
                    continue
                if kind == records.BUFFER and tname in module._non_persistent_buffers_set:
                    self.kept.append((path, module, tname))
                elif entry is None:
                    raise ValueError(f"{where}: module {path!r} has tensors the manifest does not list")
        kept = {(id(module), tname) for _, module, tname in self.kept}
        self.modules: list[nn.Module] = []
        # Per stored module: (module, kind, tensor name, name in the owner's value) of every place its tensors go.
        self.targets: list[list[tuple[nn.Module, int, str, str]]] = [[] for _ in manifest.modules]
        # Per stored module: the values its forward needs (its own, and its tied tensors' owners').
        self.needs: list[tuple[int, ...]] = []
        for i, entry in enumerate(manifest.modules):
            module = modules.get(entry.path)
            if module is None:
                raise ValueError(f"{where}: it has no module {entry.path!r}")
            have = {name: (kind, t) for name, kind, t in _own_tensors(module) if (id(module), name) not in kept}
            listed = {t.name: (t.kind, t.dtype, t.shape) for t in entry.tensors}
            for tie in entry.ties:
                owner = manifest.modules[index[tie.module]] if tie.module in index else None
                info = next((t for t in owner.tensors if t.name == tie.tensor), None) if owner else None
                if info is None:
                    raise ValueError(f"{manifest.name}: module {entry.path!r}: tie to a tensor the manifest lacks")
                listed[tie.name] = (tie.kind, info.dtype, info.shape)
            actual = {name: (_KINDS[kind], _dtype_name(t.dtype), tuple(t.shape)) for name, (kind, t) in have.items()}
            if actual != listed:
                raise ValueError(f"{where}: module {entry.path!r} holds {actual}, the manifest lists {listed}")
            self.modules.append(module)
            for t in entry.tensors:
                self.targets[i].append((module, _KIND_OF_NAME[t.kind], t.name, t.name))
            needs = [i] if entry.tensors else []
            for tie in entry.ties:
                owner_index = index[tie.module]
                self.targets[owner_index].append((module, _KIND_OF_NAME[tie.kind], tie.name, tie.tensor))
                needs.append(owner_index)
            self.needs.append(tuple(sorted(set(needs))))

    def check_kept(self) -> None:
        """Raises ValueError, naming it, when an unlisted non-persistent buffer the model must keep is on `meta`."""
        for path, module, tname in self.kept:
            if module._buffers[tname].is_meta:  # type: ignore[union-attr]
                raise ValueError(
                    f"{self.manifest.name}: module {path!r} buffer {tname!r} is not stored (a non-persistent buffer) "
                    "and the model holds it on the meta device; build the model with its buffers on a device, or "
                    "register the file with a model that holds it (register_safetensors(..., model=...))"
                )

    def install(self, unit: int, tensors: Mapping[str, torch.Tensor]) -> None:
        for module, kind, name, source in self.targets[unit]:
            tensor = tensors[source]
            _slots(module, kind)[name] = (
                nn.Parameter(tensor, requires_grad=False) if kind == records.PARAMETER else tensor
            )


def _build(model_or_config: Any) -> nn.Module:
    if isinstance(model_or_config, nn.Module):
        return model_or_config
    from transformers import AutoModelForCausalLM, PretrainedConfig

    if not isinstance(model_or_config, PretrainedConfig):
        raise TypeError(f"load_model takes a torch.nn.Module or a transformers config, got {type(model_or_config)}")
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_or_config)  # type: ignore[no-any-return]


def load_model(model_or_config: Any, cache: CacheClient, name: str, *, device: str | torch.device = "cpu") -> nn.Module:
    """Fills a model with the parameters and buffers saved as `name`, and returns it.

    Args:
        model_or_config: a module of the saved structure, best built on the
            `meta` device (`with torch.device("meta"): ...`), or a
            transformers config, which is built so
            (`AutoModelForCausalLM.from_config`).
        cache: the cache the model was saved in.
        name: the name it was saved under.
        device: where the tensors go.

    Raises:
        ParameterValueError: a value is missing or corrupt (naming its module),
            or there is no model `name`.
        ValueError: the model's modules or tensors differ from the saved ones.
    """
    manifest = read_manifest(cache, name)
    model = _build(model_or_config)
    bound = _Bound(model, manifest)
    bound.check_kept()
    device = torch.device(device)
    kept = [(module, tname, module._buffers[tname]) for _, module, tname in bound.kept]
    model.to_empty(device=device)
    for module, tname, tensor in kept:  # to_empty leaves them uninitialized
        module._buffers[tname] = tensor.to(device)  # type: ignore[union-attr]
    units = [i for i, entry in enumerate(manifest.modules) if entry.tensors]
    failures: list[BaseException] = []

    def deliver(unit: int, result: _Held | BaseException | None) -> None:
        if isinstance(result, _Held):
            with torch.no_grad():
                for module, kind, tname, source in bound.targets[unit]:
                    if module is bound.modules[unit] and tname == source:
                        _slots(module, kind)[tname].copy_(result.tensors[source])
        elif not failures:
            failures.append(result or CorruptValueError(f"{name}: a value failed its checksum in transit"))

    start = 0
    while start < len(units):
        batch: list[int] = []
        size = 0
        while start < len(units) and (not batch or size < _LOAD_BATCH_BYTES):
            batch.append(units[start])
            size += manifest.modules[units[start]].record_bytes
            start += 1
        _fetch(cache, manifest, batch, device, deliver)
        if failures:
            raise failures[0]
    # to_empty gives tied tensors one copy each; tie them again.
    for unit in units:
        for module, kind, tname, source in bound.targets[unit]:
            owner = bound.modules[unit]
            if module is not owner or tname != source:
                _slots(module, kind)[tname] = _slots(owner, kind)[source]
    return model


# -- streaming ------------------------------------------------------------------


@dataclass
class _Counters:
    forwards: int = 0
    recordings: int = 0
    diverged: int = 0
    hits: int = 0
    late: int = 0
    loaded_on_demand: int = 0
    fetched_ahead: int = 0
    fetched_bytes: int = 0
    dropped: int = 0
    stall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


FOLLOW_MAX_KEYS = 1 << 16
"""Keys a `ParameterStream`'s server plan grows to before it is replaced by a new one (from the forward
starting then): it gains a pass every forward, and each planned key costs the server about 110 bytes."""


class _FollowedPlan:
    """The server's prefetch plan of a `ParameterStream`, kept one forward ahead of the model.

    The plan is passes of the execution order, one after another, and
    holds the forward running and the next one: plan-aware eviction on the
    server then knows every key's next use across forwards (a key just read
    is next read a whole pass away), not only within one forward, after
    which the keys would fall back to LRU-K. Each forward appends a pass.
    The first pass of a plan reads every module; later passes only the
    modules the client streams (its kept set stays resident, so the server
    neither prefetches nor keeps those). The cursor is reported at every
    module, so modules the client does not read do not hold it back. A new
    order, a plan grown past `FOLLOW_MAX_KEYS`, or a plan the server ended
    starts a new plan. Used only from the model's thread (the hooks): no lock.
    """

    def __init__(self, cache: CacheClient, name: str, window_bytes: int) -> None:
        self._cache = cache
        self._name = name
        self._window_bytes = window_bytes
        self._run: PrefetchPlan | None = None
        self._first: Plan | None = None  # a pass of every module: what a plan starts with
        self._loop: Plan | None = None  # a pass of the streamed modules: what each forward appends
        self._running: Plan | None = None  # the pass of the forward running
        self._base = 0  # where the running forward's pass starts in the plan
        self._next = 0  # where the next forward's pass starts
        self._sent = 0  # the cursor last reported
        self.started = 0
        """Plans started (the first, and one per new order or replacement)."""
        self.extended = 0
        """Passes appended to running plans."""

    def restart(self, first: Plan, loop: Plan) -> None:
        """Replaces the plan with `first` (for the next forward), then `loop`."""
        self.close()
        self._first, self._loop, self._running = first, loop, None
        self._next = self._sent = 0
        keys = first.keys() + loop.keys()
        sizes = first.sizes + loop.sizes if first.sizes is not None and loop.sizes is not None else None
        try:
            self._run = self._cache.prefetch(keys, window_bytes=self._window_bytes, sizes=sizes)
        except CacheClientError as exc:
            log.warning("%s: no server prefetch plan: %s", self._name, exc)
            return
        self.started += 1

    def follow(self, first: Plan, loop: Plan) -> None:
        """An order was recorded: a new plan unless it reads the keys already planned."""
        if (
            self._first is None
            or self._loop is None
            or (first.keys(), loop.keys())
            != (
                self._first.keys(),
                self._loop.keys(),
            )
        ):
            self.restart(first, loop)

    def forward_starts(self) -> None:
        """A forward begins: its pass is the plan's next; the plan gains the pass after it."""
        if self._first is None or self._loop is None or self._run is None:
            return
        first, loop = self._first, self._loop
        if self._run.error is not None or self._next + 2 * len(loop.keys()) > max(
            FOLLOW_MAX_KEYS, len(first.keys()) + len(loop.keys())
        ):
            if self._run.error is not None:
                log.warning("%s: the server ended its plan (%s); starting another", self._name, self._run.error)
            self.restart(first, loop)
            if self._run is None:
                return
        self._running = first if self._next == 0 else loop
        self._base = self._next
        self._next = self._base + len(self._running.keys())
        if self._run.planned < self._next + len(loop.keys()):
            self._run.extend(loop.keys(), loop.sizes)
            self.extended += 1
        self._report(self._base)

    def reached(self, step: int) -> None:
        """The forward reached `step` of its pass: every step before it is read (or held by the client)."""
        if self._running is not None:
            self._report(self._base + self._running.keys_before(step))

    def _report(self, cursor: int) -> None:
        if self._run is not None and cursor > self._sent:
            self._run.consumed(cursor)
            self._sent = cursor

    def close(self) -> None:
        if self._run is not None:
            self._run.close()
            self._run = None


class ParameterStream:
    """A model running while its parameters stream from the cache; made by `stream_parameters`.

    Attributes read while it runs: `stats` (counters), `order` (the module
    paths of the recorded execution order), `plan` (that order as a `Plan`).
    """

    def __init__(
        self,
        model: nn.Module,
        cache: CacheClient,
        manifest: ModelManifest,
        *,
        budget_bytes: int | None,
        lookahead: int | None,
        window_bytes: int | None,
        fetch_bytes: int,
        device: torch.device,
        server_window_bytes: int,
    ) -> None:
        from cacheclient._residency import ABSENT, FETCHING, READY, Residency

        self._ABSENT, self._FETCHING, self._READY = ABSENT, FETCHING, READY
        self.model = model
        self.cache = cache
        self.manifest = manifest
        self.device = device
        self._bound = _Bound(model, manifest)
        self._bound.check_kept()
        sizes = [entry.nbytes for entry in manifest.modules]
        largest = max((sum(sizes[u] for u in needs) for needs in self._bound.needs), default=0)
        self.budget_bytes = budget_bytes if budget_bytes is not None else max(sum(sizes), 1)
        if self.budget_bytes < largest:
            raise ValueError(
                f"budget_bytes={self.budget_bytes} is less than the largest module's parameters ({largest} bytes)"
            )
        self._core = Residency(sizes, self.budget_bytes, window_bytes)
        self._lookahead = lookahead
        self._fetch_bytes = fetch_bytes
        self._cond = threading.Condition()
        self._held: dict[int, _Held] = {}
        self._pool = _BufferPool(self.budget_bytes)
        self._errors: dict[int, BaseException] = {}
        self._counters = _Counters()
        hooked = [i for i, needs in enumerate(self._bound.needs) if needs]
        # The first forward runs in registration order, the best guess before one is recorded.
        self._order: list[int] = hooked
        self._core.set_steps([self._bound.needs[i] for i in self._order])
        self._recorded: list[int] = []
        self._expect = 0
        self._depth = 0
        self._closed = False
        self._placeholders = self._offload()
        self._handles: list[Any] = []
        self._handles.append(model.register_forward_pre_hook(self._forward_starts))
        for i in hooked:
            module = self._bound.modules[i]
            self._handles.append(module.register_forward_pre_hook(functools.partial(self._module_starts, i)))
            self._handles.append(
                module.register_forward_hook(functools.partial(self._module_ends, i), always_call=True)
            )
        self._handles.append(model.register_forward_hook(self._forward_ends, always_call=True))
        self._server: _FollowedPlan | None = None
        if server_window_bytes > 0:
            self._server = _FollowedPlan(cache, manifest.name, server_window_bytes)
            self._server.restart(*self._passes())
        self._fetcher: threading.Thread | None = None
        if lookahead is None or lookahead > 0:
            self._fetcher = threading.Thread(target=self._fetch_ahead, name="parameter-prefetch", daemon=True)
            self._fetcher.start()

    def _passes(self) -> tuple[Plan, Plan]:
        """The planned order as two `Plan`s of keys, a step per module: every module's keys, and the
        streamed modules' (the kept ones are read once, then stay with the client)."""
        with self._cond:
            steps = list(self._core.steps)
            kept = self._core.kept
        sizes: dict[bytes, int] = {}
        every: list[list[bytes]] = []
        streamed: list[list[bytes]] = []
        for needs in steps:
            every.append([])
            streamed.append([])
            for unit in needs:
                entry = self.manifest.modules[unit]
                sizes.update(entry.part_sizes())
                every[-1].extend(entry.keys)
                if unit not in kept:
                    streamed[-1].extend(entry.keys)
        return Plan(every, sizes=sizes), Plan(streamed, sizes=sizes)

    # -- the model's tensors --

    def _offload(self) -> list[dict[tuple[int, str], torch.Tensor]]:
        """Puts a meta tensor in place of every stored tensor (freeing the model's own); those placeholders."""
        placeholders: list[dict[tuple[int, str], torch.Tensor]] = []
        for targets in self._bound.targets:
            held: dict[tuple[int, str], torch.Tensor] = {}
            for module, kind, name, _ in targets:
                tensors = _slots(module, kind)
                current = tensors[name]
                empty = torch.empty(current.shape, dtype=current.dtype, device="meta")
                meta = nn.Parameter(empty, requires_grad=False) if kind == records.PARAMETER else empty
                held[(id(module), name)] = meta
                tensors[name] = meta
            placeholders.append(held)
        return placeholders

    def _drop(self, units: Iterable[int], *, evicted: bool = True) -> None:
        """Lets go of units' tensors: their places get the meta placeholders back, their buffers go to the pool."""
        for unit in units:
            for module, kind, name, _ in self._bound.targets[unit]:
                _slots(module, kind)[name] = self._placeholders[unit][(id(module), name)]
            held = self._held.pop(unit, None)
            if held is not None and held.buffer is not None:
                buffer = held.buffer
                del held  # the views go first, so the pool can tell whether anything else holds the buffer
                self._pool.give(buffer)
            self._counters.dropped += evicted

    # -- hooks (the model's thread) --

    def _forward_starts(self, module: nn.Module, args: Any) -> None:
        with self._cond:
            first = self._depth == 0
            if first:
                self._recorded = []
                self._expect = 0
                self._counters.forwards += 1
            self._depth += 1
        if first and self._server is not None:
            self._server.forward_starts()  # outside the lock: it may start a plan (a round trip)

    def _forward_ends(self, module: nn.Module, args: Any, output: Any) -> None:
        recorded = False
        with self._cond:
            self._depth -= 1
            if self._depth or output is None or not self._recorded:
                return
            if self._recorded != self._order or self._counters.recordings == 0:
                self._order = self._recorded
                self._core.set_steps([self._bound.needs[i] for i in self._order])
                self._counters.recordings += 1
                recorded = True
            else:
                self._core.advance(0)
            self._expect = 0
            self._cond.notify_all()
        if recorded and self._server is not None:
            self._server.follow(*self._passes())

    def _module_starts(self, index: int, module: nn.Module, args: Any) -> None:
        needs = self._bound.needs[index]
        with self._cond:
            if self._depth:
                self._recorded.append(index)
            order = self._order
            if self._expect < len(order) and order[self._expect] == index:
                step: int | None = self._expect
            else:
                step = self._core.find(needs, self._expect % max(len(order), 1)) if order else None
                self._counters.diverged += 1
            if step is not None:
                self._core.advance(step)
                self._expect = step + 1
                if self._server is not None:
                    self._server.reached(step)
            self._cond.notify_all()
            self._acquire(needs)

    def _module_ends(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        with self._cond:
            self._core.unpin(self._bound.needs[index])
            self._cond.notify_all()

    def _acquire(self, needs: tuple[int, ...]) -> None:
        """Holds `needs` for the running module: waits for those on the way, loads those absent. Under the lock."""
        core = self._core
        counted = False
        while True:
            for unit in needs:
                error = self._errors.pop(unit, None)
                if error is not None:
                    raise error
            absent = [u for u in needs if core.state[u] == self._ABSENT]
            waiting = [u for u in needs if core.state[u] == self._FETCHING]
            if not counted:
                self._counters.hits += len(needs) - len(absent) - len(waiting)
                self._counters.late += len(waiting) + (len(absent) if self._fetcher is not None else 0)
                counted = True
            if not absent and not waiting:
                break
            began = time.perf_counter()
            if absent and self._fetcher is None:
                self._drop(core.reserve_now(absent))
                self._counters.loaded_on_demand += len(absent)
                self._cond.release()
                try:
                    _fetch(self.cache, self.manifest, absent, self.device, self._deliver_unlocked, self._pool.take)
                except Exception:
                    pass  # delivered to the units as errors: raised at the top of the loop
                finally:
                    self._cond.acquire()
            else:
                # The fetcher takes the running step's units first, whatever it is doing next.
                self._cond.wait()
            self._counters.stall_s += time.perf_counter() - began
        core.pin(needs)
        for unit in needs:
            self._bound.install(unit, self._held[unit].tensors)

    # -- fetching --

    def _deliver_unlocked(self, unit: int, result: _Held | BaseException | None) -> None:
        with self._cond:
            self._deliver(unit, result)

    def _deliver(self, unit: int, result: _Held | BaseException | None) -> None:
        if isinstance(result, _Held):
            self._held[unit] = result
            self._core.fetched(unit)
            self._counters.fetched_bytes += self.manifest.modules[unit].nbytes
        else:
            self._core.dropped(unit)
            if result is not None:
                self._errors[unit] = result
        self._cond.notify_all()

    def _fetch_ahead(self) -> None:
        """The fetcher thread: reads what the plan needs next, as the budget allows, until closed."""
        lookahead = self._lookahead if self._lookahead is not None else 1 << 30
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    units, victims = self._core.next_fetch(lookahead, self._fetch_bytes, skip=self._errors)
                    if units:
                        break
                    self._cond.wait()
                self._drop(victims)
                self._counters.fetched_ahead += len(units)
            try:
                _fetch(self.cache, self.manifest, units, self.device, self._deliver_unlocked, self._pool.take)
            except Exception as exc:
                # Delivered to the units as errors, which the fetcher passes over:
                # the model raises when it needs one of them.
                log.debug("parameter prefetch failed: %s", exc)

    # -- what the caller sees --

    @property
    def order(self) -> list[str]:
        """Module paths in the execution order now planned (registration order before the first forward)."""
        with self._cond:
            return [self.manifest.modules[i].path for i in self._order]

    @property
    def plan(self) -> Plan:
        """The planned execution order as a `Plan` of keys."""
        return Plan.execution_order(self.manifest, self.order)

    @property
    def stats(self) -> dict[str, Any]:
        """Counters: forwards, recordings (orders recorded), diverged (calls off the plan), hits (values
        held when their module ran), late (on the way), loaded_on_demand, fetched_ahead, fetched_bytes,
        dropped, buffers_reused, stall_s (the model's time waiting for values), resident_bytes, peak_resident_bytes,
        budget_bytes, server_plans_started and server_passes_appended (the server plan that follows the forwards)."""
        with self._cond:
            c = self._counters
            return {
                "forwards": c.forwards,
                "recordings": c.recordings,
                "diverged": c.diverged,
                "hits": c.hits,
                "late": c.late,
                "loaded_on_demand": c.loaded_on_demand,
                "fetched_ahead": c.fetched_ahead,
                "fetched_bytes": c.fetched_bytes,
                "dropped": c.dropped,
                "buffers_reused": self._pool.reused,
                "stall_s": round(c.stall_s, 6),
                "resident_bytes": self._core.used,
                "peak_resident_bytes": self._core.peak,
                "budget_bytes": self.budget_bytes,
                "server_plans_started": self._server.started if self._server is not None else 0,
                "server_passes_appended": self._server.extended if self._server is not None else 0,
            }

    def close(self) -> None:
        """Stops fetching, removes the hooks and lets go of every held value (the model is left on `meta`)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self._fetcher is not None:
            self._fetcher.join(60.0)
        for handle in self._handles:
            handle.remove()
        if self._server is not None:
            self._server.close()
        with self._cond:
            held = list(self._held)
            for unit in held:
                self._core.dropped(unit)
            self._drop(held, evicted=False)
            self._pool.clear()


@contextlib.contextmanager
def stream_parameters(
    model: nn.Module,
    cache: CacheClient,
    name: str,
    *,
    budget_bytes: int | None = None,
    lookahead: int | None = None,
    window_bytes: int | None = None,
    fetch_bytes: int = 8 << 20,
    device: str | torch.device = "cpu",
    server_window_bytes: int = 256 << 20,
) -> Iterator[ParameterStream]:
    """Runs `model` inside the block with its parameters streamed from the model saved as `name`.

    On entry every stored tensor of `model` is replaced by a `meta`
    placeholder (build the model on `meta`: nothing is allocated). Calls to
    the model, or its `generate`, then fetch each module's parameters before
    it runs, ahead of time once the order is recorded, while holding at most
    `budget_bytes`. On exit the tensors are `meta` placeholders again.

    Meant for inference (`torch.inference_mode()`): parameters come back with
    `requires_grad=False`, and buffers a forward changes are not written back.
    Tensors read outside their module's forward (`model.lm_head.weight`
    read by another module) are `meta` there.

    Args:
        model: the module saved as `name`, or one of the same structure.
        cache: the cache holding it.
        name: the saved model's name.
        budget_bytes: most bytes of parameters held at once; None: all of them.
            At least the largest module's. A module that runs inside another
            holds both, and the budget gives way rather than fail.
        lookahead: how many modules past the running one to fetch ahead;
            None: as far as the window allows; 0: none, each module fetched
            when it runs (as offload hooks without prefetch do).
        window_bytes: bytes of the budget for modules streamed through it;
            the rest holds a fixed set of modules across forwards (on a loop,
            every byte held is a byte not fetched again). None: the
            largest two consecutive streamed modules' parameters, the least
            that lets one module arrive while the one before it runs.
        fetch_bytes: bytes one fetch of ahead modules reads at most.
        device: where the parameters go.
        server_window_bytes: window of a plan handed to the server, so it reads
            the values from object storage ahead of the client; 0: none. The
            plan follows the forwards (the running one and the next, a pass
            appended at each), so the server's plan-aware eviction keeps a
            stable subset of a model larger than its memory.

    Raises:
        ParameterValueError: no model `name` in the cache; inside the block,
            when a module runs whose value is missing or corrupt.
        ValueError: the model does not match the saved one, or the budget is too small.
    """
    manifest = read_manifest(cache, name)
    stream = ParameterStream(
        model,
        cache,
        manifest,
        budget_bytes=budget_bytes,
        lookahead=lookahead,
        window_bytes=window_bytes,
        fetch_bytes=fetch_bytes,
        device=torch.device(device),
        server_window_bytes=server_window_bytes,
    )
    try:
        yield stream
    finally:
        stream.close()
