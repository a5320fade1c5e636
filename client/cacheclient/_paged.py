"""KV blocks moved between the cache and an engine's paged KV memory in one copy: `PagedBlocks`.

A stored block (`cacheclient.kv`) is a tensor record holding one tensor,
in one of two layouts. An engine with a paged KV cache (vLLM, through
`cacheclient.vllm`) keeps each layer as one tensor of blocks; vLLM's CPU
backend holds a block of a layer as `[kv_heads, 2 x block_size, head_dim]`
(per head, K rows then V rows). The paged layout, "kv_paged" `[layers,
kv_heads, 2, tokens, head_dim]`, is the same bytes in the same order: a
layer's block is one run of the record and of the pages, and a record is
`layers` memcpys from where it rests into the pages; it is what this module
stores. The fused layout, "kv" `[layers, 2, kv_heads, tokens, head_dim]`
(what `KVCache.put` stores), loads as `2 x layers x kv_heads` runs of
`block_size x head_dim` values.

Load: each run is copied straight from the record's bytes (the view of a
co-located server's arena, or the gRPC messages the block arrived in, a run
split where a message ends) into its place in the pages, and hashed there
while it is still in the CPU's nearest cache: the record's checksum covers
the bytes as they landed, and no byte is read twice from memory. The
record's size, header, chain hash and table are checked first. A block read
from the arena is then checked against the arena's seqlock (`check`): when
the server changed it meanwhile, it is read again over gRPC and placed
again; a block that fails any check is not placed (its pages hold no
meaningful bytes, and the caller reports it for recompute).

Store: a block's record is handed to the put as pieces, never built here
(`cacheclient._batches.Gathered`): its header (with the checksum of its
runs, hashed where they lie in the pages) and then each run, a view of the
pages. A co-located put copies each piece once, straight into the server's
staging area, and hashes it there for the value's checksum
(`cacheclient.staged`); over gRPC each piece is copied once, into the
serialized request (`cacheclient.wire.codec.put_request_bytes`).

GPU backends (`[2, blocks, block_size, heads, dim]`, FlashAttention;
`[blocks, 2, block_size, heads, dim]`, FlashInfer) hold a block's K of a
head as strided rows: there a record is checked where it rests, then
copied with one torch copy per layer (to the device), and the arena's
seqlock is checked after. Written, not tested here (no GPU in CI).
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import torch

from cacheclient._batches import Gathered
from cacheclient.colocated import Colocated
from cacheclient.errors import CorruptValueError
from cacheclient.kv import KVCache, KVLayout
from cacheclient.wire import checksum
from cacheclient.wire import tensors as records
from cacheclient.wire.record import checksum_state

__all__ = ["PagedBlocks", "block_view"]

BlockView = Callable[[torch.Tensor, int], torch.Tensor]
"""(a layer's paged KV tensor, block id) -> that block as `[2, kv_heads, block_size, head_dim]` (a view)."""


def block_view(kv: torch.Tensor, layout: KVLayout, block_size: int) -> tuple[BlockView, bool]:
    """How one layer's paged tensor holds a block, from its shape, and whether that is the CPU layout (a
    block of a layer is `kv_heads` runs of K rows then V rows); refuses a shape it does not know."""
    heads, dim = layout.kv_heads, layout.head_dim
    shape = tuple(kv.shape)
    if len(shape) == 4 and shape[1:] == (heads, block_size, 2 * dim):
        # CPU: [blocks, heads, block_size, 2 x dim], read by the kernels as [blocks, heads, 2 x block_size, dim].
        return (lambda t, b: t[b].view(heads, 2, block_size, dim).transpose(0, 1)), True
    if len(shape) == 5 and shape[0] == 2 and shape[2:] == (block_size, heads, dim):
        return (lambda t, b: t[:, b].transpose(1, 2)), False  # [2, blocks, block_size, heads, dim] (FlashAttention)
    if len(shape) == 5 and shape[1] == 2 and shape[2:] == (block_size, heads, dim):
        return (lambda t, b: t[b].transpose(1, 2)), False  # [blocks, 2, block_size, heads, dim] (FlashInfer)
    raise ValueError(
        f"CacheConnector: unknown paged KV shape {shape} for {heads} KV heads of dim {dim}, block size {block_size}"
    )


class PagedBlocks:
    """An engine's paged KV memory (one tensor per layer, in layer order) and the blocks of `kv` moved into
    and out of it, one copy each way (see the module docstring).

    Args:
        kv: the `KVCache` whose blocks (keys, format, client) these are; its layout must be set.
        layers: each layer's paged KV tensor.
        block_size: tokens per paged block (the cache's `block_tokens`).
    """

    def __init__(self, kv: KVCache, layers: Sequence[torch.Tensor], block_size: int) -> None:
        layout, fmt = kv.layout, kv._format
        if layout is None or fmt is None:
            raise ValueError("PagedBlocks needs a KVCache with a layout")
        if not fmt.fused:
            raise ValueError("PagedBlocks: K and V of different head dims are not supported")
        if len(layers) != layout.num_layers:
            raise ValueError(f"CacheConnector: {len(layers)} KV cache layers, the model config says {layout}")
        if any(t.dtype != fmt.dtype for t in layers):
            raise ValueError(f"CacheConnector: paged KV dtype {layers[0].dtype}, the layout says {layout.dtype}")
        assert fmt.paged_record is not None
        if fmt.paged_record.size != fmt.record.size or fmt.paged_record.spans != fmt.record.spans:
            raise AssertionError("the paged and fused records of a block differ in size")  # both: one tensor
        self.kv = kv
        self.fmt = fmt
        self.layers = list(layers)
        self.block_size = block_size
        self.record = fmt.record
        self.entries = fmt.entries
        self.view, cpu_layout = block_view(layers[0], layout, block_size)
        itemsize = fmt.dtype.itemsize
        self.run = block_size * layout.head_dim * itemsize
        """Bytes of one (layer, K or V, head) of a block: a contiguous run in a record of the fused layout."""
        self._pages: list[memoryview] = []
        self._block_bytes = 0
        self._offsets: list[int] = []
        """Where each run of a layer's part of a fused-layout record lies in its block, in record order (K or
        V, head)."""
        if cpu_layout and all(t.device.type == "cpu" and t.is_contiguous() for t in layers):
            self._pages = [t.view(torch.uint8).numpy().data.cast("B") for t in layers]
            self._block_bytes = layers[0].stride(0) * itemsize
            self._offsets = [(2 * head + part) * self.run for part in (0, 1) for head in range(layout.kv_heads)]
        self._scratch = bytearray(self.record.size)
        """A record-sized buffer whose head holds a block's header and table when they came split over messages."""
        self.counters: Counter[str] = Counter()
        """"arena" (blocks copied from a co-located server's arena), "streamed" (over gRPC), "reread" (changed
        by the server while copied, read again), "bad" (failed a check), "bytes" (of the blocks placed)."""

    @property
    def one_copy(self) -> bool:
        """Whether blocks move run by run between records and the pages (the CPU layout)."""
        return bool(self._pages)

    # -- load ------------------------------------------------------------------

    def load(
        self, block_hashes: Sequence[bytes], block_ids: Sequence[int], *, release: bool, kv: KVCache | None = None
    ) -> int:
        """Copies the blocks of `block_hashes`, in order, into the paged blocks `block_ids`, each checked
        where it landed; returns how many were placed (up to the first missing or bad one). `kv`: whose keys
        the blocks have (a `KVCache.with_salt` sibling of this one's, same format); None: this one's.

        Raises:
            CacheClientError: the call itself failed (a server down); the blocks before it are placed.
        """
        kv = self.kv if kv is None else kv
        keys = [kv._key(h) for h in block_hashes]
        transport = kv.client.transport
        placed = 0
        if isinstance(transport, Colocated):
            lent = transport.iter_lent(keys, release=release, timeout=None)
            try:
                for i, (key, value, check) in enumerate(lent):
                    ok = value is not None and self._place([value], block_hashes[i], block_ids[i])
                    if ok and check is not None:
                        self.counters["arena"] += 1
                        if not check():  # the server reused the bytes while they were copied: read it again
                            self.counters["reread"] += 1
                            again = kv.client.get(key, release=False)
                            ok = again is not None and self._place([memoryview(again)], block_hashes[i], block_ids[i])
                    if not ok:
                        break
                    placed += 1
            except CorruptValueError:
                pass  # the stream broke off (out of order, cut short): the prefix ends before it
            finally:
                _close(lent)
            return placed
        stream: Iterator[tuple[bytes, list[memoryview] | None]] = transport.iter_pieces(
            keys, release=release, timeout=None, verify=False
        )
        try:
            for i, (_, pieces) in enumerate(stream):
                if pieces is None or not self._place(pieces, block_hashes[i], block_ids[i]):
                    break
                self.counters["streamed"] += 1
                placed += 1
        except CorruptValueError:
            pass
        finally:
            _close(stream)
        return placed

    def _place(self, pieces: list[memoryview], block_hash: bytes, block_id: int) -> bool:
        """Copies one record (the concatenation of `pieces`) into paged block `block_id`; False when it is not
        a record of this block (its size, header, chain hash, table or checksum)."""
        record = self.record  # the paged layout's is the same size, its data at the same place
        first = pieces[0]
        if len(pieces) == 1:
            head: memoryview | bytearray = first
        else:
            if sum(len(p) for p in pieces) != record.size:
                self.counters["bad"] += 1
                return False
            head = self._scratch  # only the header and table are read from it
            at = 0
            for piece in pieces:
                n = min(len(piece), record.start - at)
                head[at : at + n] = piece[:n]
                at += n
                if at == record.start:
                    break
        try:
            table, paged = self.fmt.check(head, block_hash)
        except records.TensorRecordError:
            self.counters["bad"] += 1
            return False
        (_, data_sum), (offset, nbytes) = table[0], record.spans[0]
        if self._pages and paged:  # a layer's block is one run in the record and in the pages
            ok = self._copy_runs(pieces, offset, block_id, self._block_bytes, [0]) == data_sum
        elif self._pages:
            ok = self._copy_runs(pieces, offset, block_id, self.run, self._offsets) == data_sum
        else:
            ok = self._copy_tensors(pieces, offset, nbytes, data_sum, block_id, paged)
        if not ok:
            self.counters["bad"] += 1
            return False
        self.counters["bytes"] += record.size
        return True

    def _copy_runs(self, pieces: list[memoryview], offset: int, block_id: int, run: int, offsets: list[int]) -> int:
        """Copies a record's tensor bytes (from `offset` in the pieces' concatenation) run by run into the
        pages, hashing each run where it landed; returns the checksum of what landed. A layer's part of the
        record is runs of `run` bytes, which go to `offsets` in the layer's block, in order."""
        base = block_id * self._block_bytes
        state = checksum_state()
        if len(pieces) == 1:
            data, at = pieces[0], offset
            for pages in self._pages:
                for place in offsets:
                    to = base + place
                    piece = pages[to : to + run]
                    piece[:] = data[at : at + run]
                    state.update(piece)
                    at += run
            return state.intdigest()
        index, at = 0, offset
        while at >= len(pieces[index]):  # the piece where the tensor's bytes begin
            at -= len(pieces[index])
            index += 1
        for pages in self._pages:
            for place in offsets:
                to = base + place
                piece = pages[to : to + run]
                filled = 0
                while filled < run:  # a run split where a message ends
                    data = pieces[index]
                    n = min(run - filled, len(data) - at)
                    piece[filled : filled + n] = data[at : at + n]
                    filled += n
                    at += n
                    if at == len(data) and index + 1 < len(pieces):
                        index, at = index + 1, 0
                state.update(piece)
        return state.intdigest()

    def _copy_tensors(
        self, pieces: list[memoryview], offset: int, nbytes: int, data_sum: int, block_id: int, paged: bool
    ) -> bool:
        """A record checked where it rests, then copied with one torch copy per layer (GPU layouts)."""
        data = pieces[0] if len(pieces) == 1 else memoryview(b"".join(pieces))
        tensor_bytes = data[offset : offset + nbytes]
        if checksum(tensor_bytes) != data_sum:
            return False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # frombuffer of read-only bytes: only read here
            stored = torch.frombuffer(tensor_bytes, dtype=self.layers[0].dtype)
        if paged:  # [layers, heads, 2, tokens, dim] as [layers, 2, heads, tokens, dim]
            both = stored.view(self.fmt.paged_entries[0].shape).transpose(1, 2)
        else:
            both = stored.view(self.entries[0].shape)
        for layer, tensor in enumerate(self.layers):
            self.view(tensor, block_id).copy_(both[layer], non_blocking=True)
        if self.layers[0].device.type == "cuda":
            torch.cuda.current_stream(self.layers[0].device).synchronize()  # the source may change after the check
        return True

    # -- store -----------------------------------------------------------------

    def encode(self, block_hash: bytes, block_id: int) -> Gathered | bytearray:
        """The record of paged block `block_id` (chain hash `block_hash`), to put.

        CPU layout: the record as pieces, its header and then each run as a view of the pages (`Gathered`),
        nothing copied here: the runs are hashed where they lie for the record's checksum, and the put copies
        them once, into a co-located server's staging area (or into the request's bytes for gRPC). The pages must not
        change until the put returns. Else: the bytes copied once out of the pages into a new record, sealed.
        """
        if self._pages:
            base, end = block_id * self._block_bytes, (block_id + 1) * self._block_bytes
            runs = [pages[base:end] for pages in self._pages]  # a layer's block: one run, in the paged layout
            state = checksum_state()
            for piece in runs:
                state.update(piece)
            record = self.fmt.paged_record
            assert record is not None
            return Gathered([memoryview(record.head(block_hash, [state.intdigest()])), *runs])
        buf, offsets = records.new_record(self.entries)
        fmt = self.entries[0]
        both = torch.frombuffer(buf, dtype=self.layers[0].dtype, count=fmt.size // self.layers[0].dtype.itemsize,
                                offset=offsets[0]).view(fmt.shape)  # fmt: skip
        for layer, paged in enumerate(self.layers):
            both[layer].copy_(self.view(paged, block_id))
        return records.seal(buf, block_hash, self.entries)


def _close(blocks: Iterator[object]) -> None:
    """Ends a read left early: a generator's stream is cancelled now, not when it is collected."""
    close = getattr(blocks, "close", None)
    if close is not None:
        close()
