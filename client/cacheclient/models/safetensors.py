"""`register_safetensors`: a safetensors file in object storage as a saved model, without rewriting it.

The file's header is read through the cache (two small ranges, and the last
data byte to learn the file is whole); the manifest it commits names each
module's tensors as byte ranges of the file (range keys,
`cacheclient.wire.ranges`), so `load_model` and `stream_parameters` read a
registered model as they read a saved one.
"""

from __future__ import annotations

import itertools
import json
import struct
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cacheclient.client import CacheClient
from cacheclient.errors import CacheClientError
from cacheclient.models.manifest import (
    DEFAULT_PART_BYTES,
    KINDS,
    RANGES,
    ModelManifest,
    ModuleEntry,
    ParameterValueError,
    TensorInfo,
    Tie,
    commit_manifest,
)
from cacheclient.models.values import dtype_name, own_tensors, record_values
from cacheclient.plans import as_key
from cacheclient.wire import ranges
from cacheclient.wire import tensors as records

__all__ = ["SAFETENSORS_DTYPES", "register_safetensors"]

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
    key = as_key(key)
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
            keys, size = record_values(name, save_id, path, stored, part_bytes, batch)
            infos = tuple(TensorInfo(e.name, KINDS[e.kind], e.dtype, e.shape) for e, _ in stored)
            entries.append(ModuleEntry(path, keys, size, infos, tuple(ties)))
            continue
        keys, size, offsets = _module_ranges(key, [(tname, t) for tname, _, t in own], part_bytes)
        infos = tuple(TensorInfo(tname, kind, t.dtype, t.shape) for tname, kind, t in own)
        entries.append(ModuleEntry(path, keys, size, infos, tuple(ties), RANGES, offsets))
    if batch:
        cache.put_many(batch)
    manifest = ModelManifest(name, save_id, tuple(entries), source)
    commit_manifest(cache, manifest)
    return manifest


def _match_model(
    model: nn.Module, file: Mapping[str, _FileTensor], name: str
) -> dict[str, tuple[list[tuple[str, str, _FileTensor]], list[Tie], list[tuple[records.TensorEntry, Any]]]]:
    """`register_safetensors`'s modules, matched against `model`: the file's tensors by the model's names."""
    where = f"{name}: the safetensors file does not match the model"
    places: dict[int, list[tuple[str, str, int, str]]] = {}  # id(tensor) -> its (full name, path, kind, name)
    for path, module in model.named_modules():
        for tname, kind, tensor in own_tensors(module):
            full = f"{path}.{tname}" if path else tname
            places.setdefault(id(tensor), []).append((full, path, kind, tname))
    out: dict[str, tuple[list[tuple[str, str, _FileTensor]], list[Tie], list[tuple[records.TensorEntry, Any]]]] = {}
    used: set[str] = set()
    tensors = {id(t): t for _, m in model.named_modules() for _, _, t in own_tensors(m)}
    for tensor_id, names in places.items():
        tensor = tensors[tensor_id]
        found = next((n for n in names if n[0] in file), None)
        if found is None:
            full, path, kind, tname = names[0]
            module = model.get_submodule(path)
            if kind == records.BUFFER and tname in module._non_persistent_buffers_set:
                if not tensor.is_meta and all(n[1] == path for n in names):
                    data = tensor.detach().to("cpu").contiguous()
                    entry = records.TensorEntry(tname, dtype_name(data.dtype), tuple(data.shape), kind)
                    out.setdefault(path, ([], [], []))[2].append((entry, data.reshape(-1).view(torch.uint8).numpy()))
                continue
            raise ValueError(f"{where}: the model's tensor {full!r} is not in the file")
        full, path, kind, tname = found
        t = file[full]
        used.add(full)
        if t.dtype != dtype_name(tensor.dtype) or t.shape != tuple(tensor.shape):
            raise ValueError(
                f"{where}: tensor {full!r} is {t.dtype} {list(t.shape)} in the file, "
                f"{dtype_name(tensor.dtype)} {list(tensor.shape)} in the model"
            )
        out.setdefault(path, ([], [], []))[0].append((tname, KINDS[kind], t))
        for other_full, other_path, other_kind, other_name in names:
            if other_full != full:
                used.add(other_full)
                out.setdefault(other_path, ([], [], []))[1].append(Tie(other_name, KINDS[other_kind], path, tname))
    unused = sorted(set(file) - used)
    if unused:
        raise ValueError(f"{where}: the file's tensor {unused[0]!r} is not the model's ({len(unused)} such)")
    order = [path for path, _ in model.named_modules()]
    return {path: out[path] for path in order if path in out}
