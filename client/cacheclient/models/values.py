"""A saved model's values as tensors: packing a module's tensors, reading values back, and placing them in a model.

The machinery `save_model`, `load_model`, `register_safetensors` and
`stream_parameters` share: a module's own tensors (`own_tensors`) packed as
a tensor record in parts (`record_values`); values read in one stream and
decoded into aligned host buffers (`fetch_units`, `Held`), the buffers
reused across modules of one size (`BufferPool`); and a manifest matched
against a model (`Bound`), which says where each value's tensors go.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cacheclient.client import CacheClient
from cacheclient.colocated import lent_values
from cacheclient.errors import CorruptValueError
from cacheclient.models.manifest import KIND_OF_NAME, KINDS, RANGES, ModelManifest, ModuleEntry, ParameterValueError
from cacheclient.wire import tensors as records

__all__ = [
    "Bound",
    "BufferPool",
    "Held",
    "dtype_name",
    "fetch_units",
    "module_key",
    "own_tensors",
    "record_values",
    "tensor_slots",
]


def own_tensors(module: nn.Module) -> Iterator[tuple[str, int, torch.Tensor]]:
    """The module's own parameters and buffers (not its children's): (name, tensor record kind, tensor)."""
    for name, p in module._parameters.items():
        if p is not None:
            yield name, records.PARAMETER, p
    for name, b in module._buffers.items():
        if b is not None:
            yield name, records.BUFFER, b


def tensor_slots(module: nn.Module, kind: int) -> dict[str, Any]:
    """The module's parameters or its buffers, by name: where a tensor of that kind is put."""
    slots: dict[str, Any] = module._parameters if kind == records.PARAMETER else module._buffers
    return slots


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype's name as manifests and tensor records hold it ("float32")."""
    return str(dtype).removeprefix("torch.")


def module_key(name: str, path: str) -> str:
    """The key of the value of module `path` of the model saved as `name`."""
    return f"{name}/module/{path or '(root)'}"


def record_values(
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
    base = module_key(name, path)
    keys = tuple(f"{base}#{i}".encode() if parts > 1 else base.encode() for i in range(parts))
    view = memoryview(record)
    for i, key in enumerate(keys):
        out.append((key, bytes(view[i * step : (i + 1) * step])))
    return keys, size


@dataclass
class Held:
    """A module's decoded tensors: views into one host buffer (`buffer`; None once moved to another device)."""

    tensors: dict[str, torch.Tensor]
    buffer: torch.Tensor | None


def _buffer_bytes(entry: ModuleEntry) -> int:
    """Bytes of the host buffer that holds a module's tensors, each 64-byte aligned (as torch allocates)."""
    return sum(-(-t.nbytes // records.ALIGN) * records.ALIGN for t in entry.tensors)


def _new_buffer(nbytes: int) -> torch.Tensor:
    """A fresh host buffer (what `BufferPool.take` hands out when it has none of that size)."""
    return torch.empty(nbytes, dtype=torch.uint8)


def _decode(
    manifest: ModelManifest,
    entry: ModuleEntry,
    parts: Sequence[bytes | memoryview],
    device: torch.device,
    allocate: Callable[[int], torch.Tensor] = _new_buffer,
) -> Held:
    """The tensors of a module's value, copied into an aligned buffer from `allocate`; ParameterValueError if bad."""
    data = parts[0] if len(parts) == 1 else b"".join(parts)
    if entry.layout == RANGES:
        sources = _range_sources(manifest, entry, data)
    else:
        sources = _record_sources(manifest, entry, data)
    # A copy, not a view of the received bytes: those are not aligned as torch aligns its
    # tensors, and BLAS kernels may round differently on differently aligned inputs.
    buffer = allocate(_buffer_bytes(entry))
    out = {}
    offset = 0
    with warnings.catch_warnings():
        # frombuffer warns that bytes are read-only; they are only read.
        warnings.simplefilter("ignore", UserWarning)
        for t, source in zip(entry.tensors, sources, strict=True):
            place = buffer[offset : offset + t.nbytes]
            if t.nbytes:
                place.copy_(torch.frombuffer(source, dtype=torch.uint8))
            out[t.name] = place.view(getattr(torch, t.dtype)).view(t.shape)
            offset += -(-t.nbytes // records.ALIGN) * records.ALIGN
    if device.type != "cpu":
        return Held({name: t.to(device) for name, t in out.items()}, None)
    return Held(out, buffer)


def _record_sources(manifest: ModelManifest, entry: ModuleEntry, record: bytes | memoryview) -> list[memoryview]:
    """The bytes of each tensor of a module's tensor record, in the manifest's order, checked against it."""
    try:
        stored = records.unpack(record, records.owner_digest(manifest.save_id, entry.path))
    except records.TensorRecordError as exc:
        raise ParameterValueError(
            f"{manifest.name}: module {entry.path!r}: value {entry.keys[0].decode()!r} is corrupt: {exc}", entry.path
        ) from None
    expected = [(t.name, KIND_OF_NAME[t.kind], t.dtype, t.shape) for t in entry.tensors]
    if [(e.name, e.kind, e.dtype, e.shape) for e, _ in stored] != expected:
        raise ParameterValueError(
            f"{manifest.name}: module {entry.path!r}: its value holds other tensors than the manifest lists", entry.path
        )
    return [data for _, data in stored]


def _range_sources(manifest: ModelManifest, entry: ModuleEntry, data: bytes | memoryview) -> list[memoryview]:
    """The bytes of each tensor in a module's byte ranges of a safetensors file: each at its offset in them."""
    if len(data) != entry.record_bytes:
        raise ParameterValueError(
            f"{manifest.name}: module {entry.path!r}: its ranges of {manifest.source!r} hold {len(data)} bytes, "
            f"its tensors {entry.record_bytes}",
            entry.path,
        )
    source = memoryview(data)
    return [source[at : at + t.nbytes] for t, at in zip(entry.tensors, entry.offsets, strict=True)]


class BufferPool:
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


def fetch_units(
    cache: CacheClient,
    manifest: ModelManifest,
    units: Sequence[int],
    device: torch.device,
    deliver: Callable[[int, Held | BaseException | None], None],
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
    parts: list[bytes | memoryview] = []
    seen = 0

    def deliver_keyless() -> None:
        # A module whose tensors are all empty has no value to read.
        while pending and not manifest.modules[pending[0]].keys:
            entry = manifest.modules[pending[0]]
            deliver(pending.pop(0), _decode(manifest, entry, [b""], device, allocate))

    try:
        deliver_keyless()
        # Views: a value is copied once, into its module's buffer (`_decode`), not also into bytes first. A
        # tensor record checks every tensor's bytes itself: the stream's checksum of each value would be a
        # second pass over them (byte ranges of a file have no such check, and keep it).
        verify = any(manifest.modules[u].layout == RANGES for u in units)
        stream = lent_values(cache.transport, keys, release=False, verify=verify)
        checks: list[Callable[[], bool]] = []
        for _, value, check in stream:
            entry = manifest.modules[pending[0]]
            seen += 1
            if value is not None:
                parts.append(value)
            if check is not None:
                checks.append(check)
            if seen < len(entry.keys):
                continue
            result: Held | BaseException
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
                if not all(check() for check in checks):
                    # The server reused the arena's bytes while they were checked and copied: read them again.
                    again = cache.get_many(entry.keys)
                    try:
                        if any(value is None for value in again):
                            raise ParameterValueError(
                                f"{manifest.name}: module {entry.path!r}: a value left the cache while it was read",
                                entry.path,
                            )
                        result = _decode(manifest, entry, [v for v in again if v is not None], device, allocate)
                    except ParameterValueError as exc:
                        result = exc
            deliver(pending.pop(0), result)
            parts, seen, checks = [], 0, []
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


class Bound:
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
            for tname, kind, _ in own_tensors(module):
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
            have = {name: (kind, t) for name, kind, t in own_tensors(module) if (id(module), name) not in kept}
            listed = {t.name: (t.kind, t.dtype, t.shape) for t in entry.tensors}
            for tie in entry.ties:
                owner = manifest.modules[index[tie.module]] if tie.module in index else None
                info = next((t for t in owner.tensors if t.name == tie.tensor), None) if owner else None
                if info is None:
                    raise ValueError(f"{manifest.name}: module {entry.path!r}: tie to a tensor the manifest lacks")
                listed[tie.name] = (tie.kind, info.dtype, info.shape)
            actual = {name: (KINDS[kind], dtype_name(t.dtype), tuple(t.shape)) for name, (kind, t) in have.items()}
            if actual != listed:
                raise ValueError(f"{where}: module {entry.path!r} holds {actual}, the manifest lists {listed}")
            self.modules.append(module)
            for t in entry.tensors:
                self.targets[i].append((module, KIND_OF_NAME[t.kind], t.name, t.name))
            needs = [i] if entry.tensors else []
            for tie in entry.ties:
                owner_index = index[tie.module]
                self.targets[owner_index].append((module, KIND_OF_NAME[tie.kind], tie.name, tie.tensor))
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
            tensor_slots(module, kind)[name] = (
                nn.Parameter(tensor, requires_grad=False) if kind == records.PARAMETER else tensor
            )
