"""L1 in GPU memory: the memory tier's contract with values held as CUDA tensors.

For hosts with a GPU, where host memory is scarce or the consumer of the
bytes is on the GPU anyway. Budget accounting is the memory tier's
(key + value + ENTRY_OVERHEAD per entry; the device bytes are the value
bytes, rounded up by the CUDA caching allocator, which the overhead covers
for small values). `get` copies the value back to host bytes; `get_tensor`
hands out the device tensor without a copy, for in-process GPU consumers.

Expiry: `expires_at` is kept with each value and reported by `scan`, as in
the memory tier; nothing here enforces it.

Needs torch with CUDA; `CudaMemoryTier` raises at construction otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from cacheclient.wire.record import checksum as xxh3
from cachesvc.errors import TierFull
from cachesvc.tiers.base import Entry, ResidentKey
from cachesvc.tiers.memory import ENTRY_OVERHEAD

__all__ = ["CudaMemoryTier"]


class CudaMemoryTier:
    """Values as uint8 tensors on one CUDA device, within `capacity_bytes`."""

    def __init__(self, capacity_bytes: int, device: str = "cuda", name: str = "l1") -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(f"{name}: l1.device={device!r} but torch.cuda.is_available() is False")
        if capacity_bytes <= 0:
            raise ValueError(f"{name}: capacity_bytes must be positive, got {capacity_bytes}")
        self._torch = torch
        self.device = torch.device(device)
        self.name = name
        self.capacity_bytes: int | None = capacity_bytes
        # key -> (device tensor, checksum, dirty, expires_at)
        self._entries: dict[bytes, tuple[Any, int, bool, float]] = {}
        self._used = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    def cost(self, key: bytes, size: int) -> int:
        return len(key) + size + ENTRY_OVERHEAD

    def get(self, key: bytes) -> Entry | None:
        found = self._entries.get(key)
        if found is None:
            return None
        tensor, value_checksum, dirty, _ = found
        return Entry(tensor.cpu().numpy().tobytes(), value_checksum, dirty)

    def get_tensor(self, key: bytes) -> Any | None:
        """The device tensor holding the value (uint8, 1-D), without copying; None on a miss."""
        found = self._entries.get(key)
        return None if found is None else found[0]

    def put(
        self,
        key: bytes,
        value: bytes,
        checksum: int,
        *,
        dirty: bool = False,
        expires_at: float = 0.0,
        version: int = 0,
    ) -> None:
        del version  # not kept: device memory does not outlive the process, and the engine's key state has it
        old = self._entries.get(key)
        freed = self.cost(key, int(old[0].numel())) if old is not None else 0
        needed = self.cost(key, len(value))
        assert self.capacity_bytes is not None
        if self._used - freed + needed > self.capacity_bytes:
            raise TierFull(f"{self.name}: {needed} bytes do not fit ({self._used}/{self.capacity_bytes} used)")
        torch = self._torch
        host = torch.frombuffer(bytearray(value), dtype=torch.uint8) if value else torch.empty(0, dtype=torch.uint8)
        tensor = host.to(self.device, non_blocking=False)
        self._entries[key] = (tensor, checksum, dirty, expires_at)
        self._used += needed - freed

    def verify(self, key: bytes) -> bool:
        """Re-hashes the device copy: whether it still matches its checksum."""
        entry = self.get(key)
        return entry is not None and xxh3(entry.value) == entry.checksum

    def delete(self, key: bytes) -> bool:
        old = self._entries.pop(key, None)
        if old is None:
            return False
        self._used -= self.cost(key, int(old[0].numel()))
        return True

    def contains(self, key: bytes) -> bool:
        return key in self._entries

    def list_keys(self) -> list[bytes]:
        return list(self._entries)

    def scan(self) -> Iterator[ResidentKey]:
        for key, (tensor, _, dirty, expires_at) in list(self._entries.items()):
            size = int(tensor.numel())
            yield ResidentKey(key, self.cost(key, size), dirty, expires_at, size=size)

    def info(self) -> dict[str, str | int]:
        return {"kind": "cuda", "device": str(self.device), "capacity_bytes": self.capacity_bytes or 0}

    def close(self) -> None:
        self._entries.clear()
        self._used = 0
