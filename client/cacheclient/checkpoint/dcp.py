"""A `torch.distributed.checkpoint` storage backend on the cache, and plain `save`/`load`.

Each rank's `write_data` splits every tensor's bytes (and each object DCP
serialized) into content-addressed chunks and stores the ones the cache
lacks, then waits until they are durable; the coordinator's `finish` commits
the manifest (`catalog.commit_checkpoint`). Tensors travel as their raw
bytes, never pickled; their dtype and shape are in the manifest's JSON.

DCP's own `Metadata` object (its plan of the state dict: tensor shapes,
chunk layout) is stored pickled, as DCP's `FileSystemWriter` stores it, and
unpickled with an allowlist of DCP's metadata classes and torch's `Size`,
dtypes and layouts, so a manifest cannot run code when loaded.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import pickle
import time
import uuid
import warnings
from collections import defaultdict, deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from cacheclient.checkpoint.catalog import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_PREFIX,
    MANIFEST_FORMAT,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointKeys,
    CheckpointNotFound,
    ChunkReader,
    ChunkWriter,
    Durability,
    WriteStats,
    commit_checkpoint,
    latest_checkpoint,
    local_l2_reader,
    mark_reader,
    read_manifest,
    split_name,
    wait_for_retention,
)
from cacheclient.client import CacheClient

__all__ = ["CacheStorageReader", "CacheStorageWriter", "load", "save"]

_READ_GROUP_BYTES = 64 << 20
"""Chunk bytes one fetch asks for; `threads` fetches are in flight."""


def _client(cache: CacheClient | str) -> CacheClient:
    return CacheClient(cache) if isinstance(cache, str) else cache


class CacheStorageWriter(StorageWriter, BlockingAsyncStager):
    """Saves DCP checkpoints into a cache server.

    `dcp.save(state, storage_writer=CacheStorageWriter(cache), checkpoint_id="run1/step-1000")`
    (or `dcp.async_save`); every rank passes its own writer.

    Args:
        cache: the cache server (a `CacheClient`, or its "host:port").
        prefix: the key prefix of checkpoints; map it to a write-back
            namespace on the server so saves run at local speed.
        chunk_bytes: the size of the content-addressed chunks.
        durability: "cache" (the default: every chunk on the server's disk
            and synced there, or in object storage, before the commit: like
            DCP's `sync_files=True`), "unsynced" (on the server's disk, not
            synced: survives the server being killed, not its machine losing
            power; like DCP's `sync_files=False`) or "s3" (uploaded).
        keep_last: after each commit, keep only the newest `keep_last`
            checkpoints of the run (None: keep all).
        threads: puts in flight per rank.
        durable_timeout: seconds to wait for durability before the save fails.

    `dcp.async_save` stages the state into CPU memory with this writer, as
    it does with DCP's `FileSystemWriter` (`cache_staged_state_dict=True`
    keeps the staging buffers between saves: faster, at the cost of their
    memory). After a save, `last_stats` tells what this rank sent
    (`WriteStats`).
    """

    def __init__(
        self,
        cache: CacheClient | str,
        *,
        prefix: str = DEFAULT_PREFIX,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        durability: Durability | str = Durability.CACHE,
        keep_last: int | None = None,
        threads: int = 4,
        durable_timeout: float = 600.0,
        cache_staged_state_dict: bool = False,
    ) -> None:
        StorageWriter.__init__(self)
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        self.cache = _client(cache)
        self.keys = CheckpointKeys(prefix)
        self.chunk_bytes = chunk_bytes
        self.durability = Durability(durability)
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        self.keep_last = keep_last
        self.threads = threads
        self.durable_timeout = durable_timeout
        self.name: str | None = None
        self.save_id = uuid.uuid4().hex
        self.rank: int | None = None
        self.last_stats: WriteStats | None = None

    @property
    def checkpoint_id(self) -> str | None:
        return self.name

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id:
            split_name(str(checkpoint_id))
            self.name = str(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        try:
            split_name(str(checkpoint_id))
        except CheckpointError:
            return False
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.name is None:
            raise CheckpointError("no checkpoint name: pass checkpoint_id='RUN/STEP' to dcp.save")
        if not kwargs.get("use_collectives", True):
            raise CheckpointError("CacheStorageWriter needs use_collectives=True (one manifest per checkpoint)")
        self.rank = kwargs.get("rank")

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.name, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # The coordinator plans before any rank writes: a retention pass of
        # the run (started by the previous commit here) ends first, so no
        # rank skips a chunk that the pass then deletes.
        assert self.name is not None
        wait_for_retention(split_name(self.name)[0], keys=self.keys)
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assert self.name is not None
        run, _ = split_name(self.name)
        chunks = ChunkWriter(
            self.cache,
            self.keys,
            run,
            chunk_bytes=self.chunk_bytes,
            durability=self.durability,
            threads=self.threads,
            durable_timeout=self.durable_timeout,
            known=_latest_chunks(self.cache, self.keys, run),
        )
        results = []
        sizes: dict[str, int] = {}
        for item in plan.items:
            record, data = _item_bytes(item, planner.resolve_data(item))
            record["chunks"] = chunks.add(data)
            results.append(WriteResult(index=item.index, size_in_bytes=record["nbytes"], storage_data=record))
        self.last_stats = chunks.finish()
        sizes = chunks.digests()
        for result in results:
            result.storage_data["sizes"] = [sizes[d] for d in result.storage_data["chunks"]]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        assert self.name is not None
        items = []
        chunk_sizes: dict[str, int] = {}
        for rank_results in results:
            for result in rank_results:
                record = dict(result.storage_data)
                chunk_sizes.update(zip(record["chunks"], record["sizes"], strict=True))
                index = result.index
                offset = list(index.offset) if index.offset is not None else None
                items.append({"fqn": index.fqn, "offset": offset, "index": index.index, **record})
        dcp_metadata = dataclasses.replace(metadata, storage_data=None, storage_meta=self.storage_meta())
        manifest = {
            "format": MANIFEST_FORMAT,
            "name": self.name,
            "created": time.time(),
            "world_size": len(results),
            "bytes": sum(item["nbytes"] for item in items),
            "chunks": chunk_sizes,
            "items": items,
            "dcp_metadata": base64.b64encode(pickle.dumps(dcp_metadata)).decode("ascii"),
        }
        commit_checkpoint(
            self.cache,
            self.name,
            manifest,
            keys=self.keys,
            durability=self.durability,
            keep_last=self.keep_last,
            durable_timeout=self.durable_timeout,
        )


def _latest_chunks(cache: CacheClient, keys: CheckpointKeys, run: str) -> set[str]:
    """The chunks of the run's latest committed checkpoint (stored, and kept while it is)."""
    latest = latest_checkpoint(cache, run, keys=keys)
    if latest is None:
        return set()
    try:
        return set(read_manifest(cache, latest, keys)["chunks"])
    except CheckpointNotFound:
        return set()


def _item_bytes(item: WriteItem, data: Any) -> tuple[dict[str, Any], memoryview]:
    """The manifest record of a write item and its bytes (a view of the tensor's memory where it can be)."""
    if item.type is WriteItemType.BYTE_IO:
        raw = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(bytes(data))
        return {"kind": "bytes", "nbytes": len(raw)}, memoryview(raw)
    tensor = data.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    tensor = tensor.contiguous()
    record = {
        "kind": "tensor",
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "nbytes": tensor.numel() * tensor.element_size(),
    }
    if record["nbytes"] == 0:
        return record, memoryview(b"")
    return record, memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


class CacheStorageReader(StorageReader):
    """Loads DCP checkpoints from a cache server.

    `dcp.load(state, storage_reader=CacheStorageReader(cache), checkpoint_id="run1/step-1000")`.

    Chunks come from the cache, or through it from object storage when the
    cache no longer holds them; each is verified against its content hash.
    A load marks the checkpoint in use for `lease` seconds, so retention
    does not delete it underneath. On the cache server's machine, chunks in
    its L2 are read straight from its LMDB file (`local_reads`).

    Raises (from `dcp.load`):
        CheckpointNotFound: no committed checkpoint of that name.
        CheckpointCorrupt: a chunk is missing or damaged; the message names
            the tensor.
    """

    def __init__(
        self,
        cache: CacheClient | str,
        *,
        prefix: str = DEFAULT_PREFIX,
        threads: int = 4,
        lease: float = 900.0,
        local_reads: bool = True,
    ) -> None:
        super().__init__()
        self.cache = _client(cache)
        self.keys = CheckpointKeys(prefix)
        self.threads = threads
        self.lease = lease
        self.local_reads = local_reads
        self.name: str | None = None
        self.load_id = uuid.uuid4().hex
        self.storage_data: dict[MetadataIndex, dict[str, Any]] = {}

    @property
    def checkpoint_id(self) -> str | None:
        return self.name

    def reset(self, checkpoint_id: Any = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            split_name(str(checkpoint_id))
            self.name = str(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return CacheStorageWriter.validate_checkpoint_id(checkpoint_id)

    def read_metadata(self, *args: Any) -> Metadata:  # type: ignore[override]
        # No **kwargs: DCP then never asks for per-rank metadata, which a
        # checkpoint here does not have (one manifest per checkpoint).
        if self.name is None:
            raise CheckpointError("no checkpoint name: pass checkpoint_id='RUN/STEP' to dcp.load")
        mark_reader(self.cache, self.name, self.lease, self.keys)  # before the manifest: see catalog.apply_retention
        try:
            manifest = read_manifest(self.cache, self.name, self.keys)
        except CheckpointNotFound:
            self.cache.delete(self.keys.reader(self.name))
            raise
        metadata = _restricted_loads(base64.b64decode(manifest["dcp_metadata"]))
        metadata.storage_data = {
            MetadataIndex(
                item["fqn"], torch.Size(item["offset"]) if item["offset"] is not None else None, item["index"]
            ): item
            for item in manifest["items"]
        }
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise CheckpointError(f"checkpoint {self.name!r}: metadata without storage data")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self.name is not None
        run, _ = split_name(self.name)
        reader = ChunkReader(self.cache, self.keys, run, local_l2_reader(self.cache) if self.local_reads else None)
        wanted: dict[MetadataIndex, list[ReadItem]] = defaultdict(list)
        for request in plan.items:
            wanted[request.storage_index].append(request)
        groups = _groups([(self.storage_data[index], requests) for index, requests in wanted.items()])
        in_flight: deque[tuple[list[tuple[dict[str, Any], list[ReadItem]]], Any]] = deque()
        with ThreadPoolExecutor(max(1, self.threads), thread_name_prefix="ckpt-get") as pool:
            for group in groups:
                if len(in_flight) >= max(1, self.threads):
                    self._apply(*_resolved(in_flight.popleft(), self.name), planner)
                needed = {d: s for item, _ in group for d, s in zip(item["chunks"], item["sizes"], strict=True)}
                places = _places(group, planner) if reader.local else None
                in_flight.append((group, pool.submit(reader.fetch, needed, places)))
            while in_flight:
                self._apply(*_resolved(in_flight.popleft(), self.name), planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _apply(
        self, group: list[tuple[dict[str, Any], list[ReadItem]]], chunks: dict[str, bytes], planner: LoadPlanner
    ) -> None:
        for item, requests in group:
            data: torch.Tensor | None = None
            for request in requests:
                if request.type == LoadItemType.BYTE_IO:
                    data = _join(item, chunks) if data is None else data
                    planner.load_bytes(request, io.BytesIO(data.numpy().tobytes()))
                    continue
                target = planner.resolve_tensor(request).detach()
                if _whole(item, request, target):
                    # The common case (no resharding): chunks straight into the destination.
                    _join(item, chunks, into=target)
                    planner.commit_tensor(request, target)
                    continue
                data = _join(item, chunks) if data is None else data
                tensor = _as_tensor(item, data)
                for dim, (start, length) in enumerate(zip(request.storage_offsets, request.lengths, strict=True)):
                    tensor = tensor.narrow(dim, start, length)
                if target.size() != tensor.size():
                    raise CheckpointError(
                        f"checkpoint {self.name!r}: tensor {item['fqn']!r} has size {tuple(tensor.size())} here, "
                        f"{tuple(target.size())} in the state dict"
                    )
                target.copy_(tensor)
                planner.commit_tensor(request, target)


def _places(group: list[tuple[dict[str, Any], list[ReadItem]]], planner: LoadPlanner) -> dict[str, memoryview]:
    """Where each chunk of the group's whole-tensor items belongs in its destination tensor (the first place
    of a chunk that occurs more than once): a co-located read copies it there, once."""
    places: dict[str, memoryview] = {}
    for item, requests in group:
        if len(requests) != 1 or requests[0].type == LoadItemType.BYTE_IO:
            continue
        target = planner.resolve_tensor(requests[0]).detach()
        if not _whole(item, requests[0], target):
            continue
        view = memoryview(target.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        offset = 0
        for digest, size in zip(item["chunks"], item["sizes"], strict=True):
            places.setdefault(digest, view[offset : offset + size])
            offset += size
    return places


def _whole(item: dict[str, Any], request: ReadItem, target: torch.Tensor) -> bool:
    """Whether `request` reads all of `item` into a contiguous CPU tensor of its dtype and shape."""
    return (
        target.device.type == "cpu"
        and target.is_contiguous()
        and str(target.dtype).removeprefix("torch.") == item["dtype"]
        and list(target.shape) == item["shape"]
        and list(request.lengths) == item["shape"]
        and not any(request.storage_offsets)
        and item["nbytes"] > 0
    )


def _groups(
    items: list[tuple[dict[str, Any], list[ReadItem]]],
) -> Iterator[list[tuple[dict[str, Any], list[ReadItem]]]]:
    """Items packed into groups of about `_READ_GROUP_BYTES` of chunks."""
    group: list[tuple[dict[str, Any], list[ReadItem]]] = []
    size = 0
    for entry in items:
        group.append(entry)
        size += entry[0]["nbytes"]
        if size >= _READ_GROUP_BYTES:
            yield group
            group, size = [], 0
    if group:
        yield group


def _resolved(entry: tuple[Any, Any], name: str) -> tuple[Any, dict[str, bytes]]:
    """(group, its chunks) once fetched; a bad chunk is reported with the tensors it belongs to."""
    group, future = entry
    try:
        return group, future.result()
    except CheckpointCorrupt as exc:
        digest = getattr(exc, "digest", None)
        owners = [item["fqn"] for item, _ in group if digest in item["chunks"]] or [item["fqn"] for item, _ in group]
        raise CheckpointCorrupt(f"checkpoint {name!r}, tensor {', '.join(map(repr, owners))}: {exc}") from exc


def _join(item: dict[str, Any], chunks: dict[str, bytes], into: torch.Tensor | None = None) -> torch.Tensor:
    """The item's bytes as one uint8 tensor (written into `into`'s memory when given)."""
    out = torch.empty(item["nbytes"], dtype=torch.uint8) if into is None else into.view(-1).view(torch.uint8)
    view = out.numpy()
    offset = 0
    for digest in item["chunks"]:
        piece = memoryview(chunks[digest])
        if _address(piece) != view[offset:].ctypes.data:  # else read in place already (`_places`)
            view[offset : offset + len(piece)] = piece
        offset += len(piece)
    if offset != item["nbytes"] or len(view) != offset:
        raise CheckpointCorrupt(
            f"tensor {item['fqn']!r}: chunks hold {offset} bytes, the manifest says {item['nbytes']}"
        )
    return out


def _address(piece: memoryview) -> int:
    """Where a piece's bytes start in memory."""
    return int(np.frombuffer(piece, dtype=np.uint8).ctypes.data) if len(piece) else 0


def _as_tensor(item: dict[str, Any], data: torch.Tensor) -> torch.Tensor:
    dtype = getattr(torch, item["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"tensor {item['fqn']!r}: unknown dtype {item['dtype']!r}")
    if item["nbytes"] == 0:
        return torch.empty(item["shape"], dtype=dtype)
    return data.view(dtype).reshape(item["shape"])


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's Metadata and nothing else: its dataclasses, torch.Size, dtypes and layouts."""

    _MODULES = frozenset({"torch.distributed.checkpoint.metadata"})
    _NAMES = frozenset({("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")})

    def find_class(self, module: str, name: str) -> Any:
        if module in self._MODULES or (module, name) in self._NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.memory_format):
            return getattr(torch, name)
        raise CheckpointError(f"checkpoint metadata refers to {module}.{name}, which a manifest may not contain")


def _restricted_loads(raw: bytes) -> Metadata:
    metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint metadata is a {type(metadata).__name__}, not DCP Metadata")
    return metadata


# -- single-process helpers ----------------------------------------------------------


def save(
    state_dict: dict[str, Any],
    cache: CacheClient | str,
    name: str,
    **writer_options: Any,
) -> WriteStats:
    """Saves `state_dict` as checkpoint `name` ("RUN/STEP") through DCP; returns what was sent.

    In a process group, every rank calls it (as with `dcp.save`). Keyword
    arguments go to `CacheStorageWriter` (`keep_last=`, `durability=`, ...).
    """
    writer = CacheStorageWriter(cache, **writer_options)
    with _quiet_single_process():
        dcp.save(state_dict, checkpoint_id=name, storage_writer=writer, no_dist=not _distributed())
    assert writer.last_stats is not None
    return writer.last_stats


def load(
    cache: CacheClient | str,
    name: str,
    state_dict: dict[str, Any] | None = None,
    **reader_options: Any,
) -> dict[str, Any]:
    """Loads checkpoint `name`: into `state_dict` in place when given (as `dcp.load`), else into a new dict.

    Without a `state_dict`, every tensor is rebuilt on the CPU in the nesting
    it was saved with (single process only; as DCP does, integer dict keys,
    such as an optimizer's state, come back as strings).
    """
    reader = CacheStorageReader(cache, **reader_options)
    read_manifest(reader.cache, name, reader.keys)  # a missing checkpoint raises CheckpointNotFound, not DCP's error
    if state_dict is not None:
        with _quiet_single_process():
            dcp.load(state_dict, checkpoint_id=name, storage_reader=reader, no_dist=not _distributed())
        return state_dict
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    loaded: dict[str, Any] = {}
    reader.reset(name)
    _load_state_dict(loaded, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return loaded


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class _quiet_single_process(warnings.catch_warnings):
    """DCP warns on every single-process save and load that it assumes a single process; so do we, on purpose."""

    def __enter__(self) -> Any:
        result = super().__enter__()
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return result
