"""`save_model` and `load_model`: a model's parameters and buffers as values in the cache, and back.

`save_model(model, cache, name)` stores each module's own parameters and
buffers as one value (a tensor record, `cacheclient.wire.tensors`: raw bytes
behind a small header, a checksum per tensor, no pickle), split in parts past
`part_bytes`, and then the manifest (`cacheclient.models.manifest`) that
lists the modules, their keys, tensor names, dtypes and shapes. Every value
is bound to its save and module path, so a value from another save or under
another key is refused. `load_model` fills a model built on the `meta`
device from them.
"""

from __future__ import annotations

import uuid
from typing import Any

import torch
from torch import nn

from cacheclient.client import CacheClient
from cacheclient.errors import CorruptValueError
from cacheclient.models.manifest import (
    DEFAULT_PART_BYTES,
    KINDS,
    ModelManifest,
    ModuleEntry,
    TensorInfo,
    Tie,
    commit_manifest,
    read_manifest,
)
from cacheclient.models.values import Bound, Held, dtype_name, fetch_units, own_tensors, record_values, tensor_slots
from cacheclient.wire import tensors as records

__all__ = ["load_model", "save_model"]

_PUT_BATCH_BYTES = 64 << 20
_LOAD_BATCH_BYTES = 256 << 20


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
        for tname, kind, tensor in own_tensors(module):
            if id(tensor) in seen:
                owner, owner_tensor = seen[id(tensor)]
                ties.append(Tie(tname, KINDS[kind], owner, owner_tensor))
                continue
            if tensor.is_meta:
                raise ValueError(f"{name}: module {path!r} tensor {tname!r} is on the meta device; nothing to save")
            seen[id(tensor)] = (path, tname)
            data = tensor.detach().to("cpu").contiguous()
            dtype = dtype_name(data.dtype)
            info = TensorInfo(tname, KINDS[kind], dtype, tuple(data.shape))
            infos.append(info)
            own.append(
                (records.TensorEntry(tname, dtype, info.shape, kind), data.reshape(-1).view(torch.uint8).numpy())
            )
        if not own and not ties:
            continue
        keys: tuple[bytes, ...] = ()
        size = 0
        if own:
            keys, size = record_values(name, save_id, path, own, part_bytes, batch)
            batch_bytes += size
        entries.append(ModuleEntry(path, keys, size, tuple(infos), tuple(ties)))
        if batch_bytes >= _PUT_BATCH_BYTES:
            cache.put_many(batch)
            batch, batch_bytes = [], 0
    if batch:
        cache.put_many(batch)
    manifest = ModelManifest(name, save_id, tuple(entries))
    commit_manifest(cache, manifest)
    return manifest


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
    bound = Bound(model, manifest)
    bound.check_kept()
    device = torch.device(device)
    kept = [(module, tname, module._buffers[tname]) for _, module, tname in bound.kept]
    model.to_empty(device=device)
    for module, tname, tensor in kept:  # to_empty leaves them uninitialized
        module._buffers[tname] = tensor.to(device)  # type: ignore[union-attr]
    units = [i for i, entry in enumerate(manifest.modules) if entry.tensors]
    failures: list[BaseException] = []

    def deliver(unit: int, result: Held | BaseException | None) -> None:
        if isinstance(result, Held):
            with torch.no_grad():
                for module, kind, tname, source in bound.targets[unit]:
                    if module is bound.modules[unit] and tname == source:
                        tensor_slots(module, kind)[tname].copy_(result.tensors[source])
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
        fetch_units(cache, manifest, batch, device, deliver)
        if failures:
            raise failures[0]
    # to_empty gives tied tensors one copy each; tie them again.
    for unit in units:
        for module, kind, tname, source in bound.targets[unit]:
            owner = bound.modules[unit]
            if module is not owner or tname != source:
                tensor_slots(module, kind)[tname] = tensor_slots(owner, kind)[source]
    return model
