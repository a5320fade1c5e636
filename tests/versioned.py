"""Values that name their key and version, and the record of what a writer sent and had acknowledged.

The crash loops and the soak run write `value_of(key, version)`: its first
bytes say which key and which version it is, the rest follow from them, so
any value read back can be checked byte for byte against the write it came
from. `Versions` holds, per key, the newest version acknowledged and the
newest one sent (a put that failed may or may not have taken effect); a read
must return a version between what was acknowledged when it was sent and
what had been sent when it returned.
"""

from __future__ import annotations

import random
import threading

import xxhash

__all__ = ["LARGE", "Versions", "check_read", "value_of"]


LARGE = b"large-"
"""A key that holds this takes large values: 1 MiB to 1.25 MiB, files of their own in L2 (`l2.file_from`)."""


def value_of(key: bytes, version: int, max_bytes: int = 40_000) -> bytes:
    """The value written as `version` of `key`: a header naming both, then bytes derived from them (64 to
    `max_bytes` + 64 of them, or 1 MiB to 1.25 MiB for a key that holds `LARGE`)."""
    head = b"%s|%d|" % (key, version)
    least, spread = ((1 << 20), 256 << 10) if LARGE in key else (64, max_bytes)
    size = least + xxhash.xxh3_64_intdigest(head) % spread
    return head + random.Random(head).randbytes(size)


def _version_in(key: bytes, value: bytes) -> int | None:
    prefix = key + b"|"
    if not value.startswith(prefix):
        return None
    end = value.find(b"|", len(prefix))
    try:
        return int(value[len(prefix) : end]) if end > 0 else None
    except ValueError:
        return None


class Versions:
    """Per key: the newest version acknowledged and the newest sent. Thread-safe; one writer per key."""

    def __init__(self) -> None:
        self.acked: dict[bytes, int] = {}
        self.sent: dict[bytes, int] = {}
        self._lock = threading.Lock()

    def next(self, key: bytes) -> int:
        with self._lock:
            version = self.sent[key] = self.sent.get(key, 0) + 1
            return version

    def ack(self, key: bytes, version: int) -> None:
        with self._lock:
            self.acked[key] = max(self.acked.get(key, 0), version)

    def deleted(self, key: bytes, version: int) -> None:
        """An acknowledged delete, numbered `version`: reads from now on miss, or return a later put."""
        with self._lock:
            self.acked[key] = -version

    def unknown(self, key: bytes) -> None:
        """A delete that failed: it may have taken effect, so a miss or any version sent is right."""
        with self._lock:
            self.acked[key] = 0

    def low(self, key: bytes) -> int:
        with self._lock:
            return self.acked.get(key, 0)

    def high(self, key: bytes) -> int:
        with self._lock:
            return self.sent.get(key, 0)


def check_read(key: bytes, value: bytes | None, low: int, high: int, max_bytes: int = 40_000) -> str | None:
    """What is wrong with a read of `key`, or None when it is right.

    Args:
        value: what the read returned.
        low: `Versions.low` before the read was sent: the newest acknowledged
            version (0: none yet; negative: deleted at that version).
        high: `Versions.high` once it returned: the newest version sent.
    """
    if value is None:
        return None if low <= 0 else f"{key!r}: a miss, but version {low} was acknowledged"
    version = _version_in(key, value)
    if version is None:
        return f"{key!r}: {len(value)} bytes that are no version of this key: {bytes(value[:40])!r}"
    if value != value_of(key, version, max_bytes):
        return f"{key!r}: version {version} with wrong bytes ({len(value)} bytes)"
    floor = -low + 1 if low < 0 else low
    if not floor <= version <= high:
        return f"{key!r}: version {version}, but {low} was acknowledged and {high} the newest sent"
    return None
