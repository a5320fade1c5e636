"""The parsers that read bytes from disk or the wire, as fuzz targets: each may fail only as documented.

Every target takes arbitrary bytes and asserts what its parser promises:

- L2 records (`wire.record`): `unpack_header` and `open_record`, packed or
  not, answer None or a header, never raise; a record packed here and then
  damaged at one byte opens as None or as the very value packed, never as
  other bytes. Locators (`unpack_locator`) and records reached through them
  (`open_stored`, over pack pages made from the input) likewise.
- Stream chunks (`wire.codec`): `parse_chunk` and `stream_value_views`
  raise only `StreamError`; `read_put_stream` only `StreamError` or what
  its key and size checks raise, and what it returns is what was sent.
- Range keys (`wire.ranges`): `parse_range_key` raises only
  `RangeKeyError`, and what it parses `range_key` writes back the same.
- Tensor records, model parameters and KV blocks alike (`wire.tensors`):
  `unpack` raises only `TensorRecordError`; a record packed here and damaged
  at one byte unpacks to the tensors packed or raises.
- Key digests (`wire.digest`): `unpack_digests` raises only ValueError.
- S3 object names (`wire.s3`): a key's object name is a plain path and
  `key_of` gives the key back.
- Manifests: a checkpoint manifest raises only `CheckpointError`; a model
  manifest only `ParameterValueError`.

`fuzz_one(data)` picks a target by the first byte. Run coverage-guided with
atheris (`pip install atheris`; it takes libFuzzer's flags)::

    .venv/bin/python tests/fuzz_parsers.py -runs=200000 -rss_limit_mb=4096

`tests/test_fuzz_parsers.py` runs the same targets under hypothesis in the
default suite, and a bounded atheris run when atheris is installed.
"""

from __future__ import annotations

import contextlib
import inspect
import struct
import sys
from collections.abc import Callable
from typing import Any

from cacheclient.checkpoint.layout import CheckpointError, parse_manifest
from cacheclient.prefetch import ModelManifest, ParameterValueError
from cacheclient.wire import (
    RANGE_MARK,
    RangeKeyError,
    checksum,
    codec,
    key_of,
    object_name,
    open_record,
    pack_record,
    parse_range_key,
    range_key,
    unpack_digests,
    unpack_header,
)
from cacheclient.wire import cache_pb2 as pb
from cacheclient.wire import record as rec
from cacheclient.wire import tensors as tens
from cacheclient.wire.codec import StreamError

__all__ = ["TARGETS", "Target", "fuzz_one", "main"]

Target = Callable[[bytes], None]
"""A fuzz target: arbitrary bytes in; on a defect it raises AssertionError, or an error its parser does not name."""


class Refused(ValueError):
    """What the key and size checks given to `read_put_stream` here raise."""


def _split(data: bytes) -> list[bytes]:
    """Length-prefixed pieces: a byte of length, then that many bytes, until the input runs out."""
    pieces, pos = [], 0
    while pos < len(data):
        n = data[pos]
        pieces.append(data[pos + 1 : pos + 1 + n])
        pos += 1 + n
    return pieces


def _damaged(data: bytes, seed: bytes) -> bytes:
    """`data` with one byte changed, chosen by `seed` (unchanged when `data` is empty)."""
    if not data or len(seed) < 3:
        return data
    at = int.from_bytes(seed[:2], "little") % len(data)
    flip = seed[2] or 1
    return data[:at] + bytes([data[at] ^ flip]) + data[at + 1 :]


# -- L2 records ---------------------------------------------------------------------


def target_record_bytes(data: bytes) -> None:
    key = data[:8] or b"k"
    for packed in (False, True):
        header = unpack_header(data, packed=packed)
        assert header is None or header.value_start <= len(data)
        opened = open_record(key, data, packed=packed)
        if opened is not None:
            assert checksum(opened[1]) == opened[0].checksum


def target_record_damaged(data: bytes) -> None:
    # key length: short (inline) or long (stored in the record)
    key_len = 1 + data[0] % 64 if data else 1
    key, value, seed = data[1 : 1 + key_len] or b"k", data[1 + key_len : -3], data[-3:]
    if len(data) > 1 and data[1] & 1:
        key = key * 40  # past INLINE_KEY_MAX: the key is kept in the record
    for packed in (False, True):
        record = pack_record(key, value, checksum(value), packed=packed, expires_at=1.5)
        opened = open_record(key, _damaged(record, seed), packed=packed)
        assert opened is None or bytes(opened[1]) == value, "a damaged record opened as other bytes"


def target_locator(data: bytes) -> None:
    spans = rec.unpack_locator(data)
    if spans is not None:
        assert all(length > 0 for _, length in spans)
    # What LMDB holds under the key, and the pack pages a locator would point at.
    pieces = _split(data)
    stored = pieces[0] if pieces else b""
    pages = {rec.pack_page_key(i): page for i, page in enumerate(pieces[1:])}
    opened = rec.open_stored(b"key", stored, pages.get)
    if opened is not None:
        assert checksum(opened[1]) == opened[0].checksum


# -- stream chunks ----------------------------------------------------------------


def target_chunk(data: bytes) -> None:
    try:
        head, piece = codec.parse_chunk(data)
    except StreamError:
        return
    assert isinstance(head, pb.Chunk) and len(piece) <= len(data)


def target_stream_views(data: bytes) -> None:
    try:
        for _, pieces in codec.stream_value_views(_split(data)):
            if pieces is not None:
                [len(p) for p in pieces]
    except StreamError:
        pass


def _check_key(key: bytes) -> None:
    if not 1 <= len(key) <= 1024:
        raise Refused(f"key of {len(key)} bytes")


def _check_size(size: int) -> None:
    if size > 1 << 16:
        raise Refused(f"{size} bytes")


def target_put_stream(data: bytes) -> None:
    chunks = []
    for piece in _split(data):
        try:
            chunks.append(pb.Chunk.FromString(piece))
        except Exception:  # bytes that are no Chunk at all: left out of the stream
            continue
    try:
        put = codec.read_put_stream(chunks, check_key=_check_key, check_size=_check_size)
    except (StreamError, Refused):
        return
    assert put.key == chunks[0].key and len(put.value) == chunks[0].size
    assert put.value == b"".join(c.data for c in chunks)


# -- range keys, digests, object names ------------------------------------------------


def target_range_key(data: bytes) -> None:
    for key in (data, data[:4] + RANGE_MARK + data[4:]):
        try:
            ranged = parse_range_key(key)
        except RangeKeyError:
            continue
        if ranged is not None:
            assert 0 <= ranged.start <= ranged.end and ranged.length >= 1
            assert range_key(ranged.key, ranged.start, ranged.end) == key


def target_digests(data: bytes) -> None:
    try:
        digests = unpack_digests(data)
    except ValueError:
        assert len(data) % 8
        return
    assert len(digests) * 8 == len(data)


def target_object_name(data: bytes) -> None:
    if not data:
        return  # not a key (keys are 1..1024 bytes)
    name = object_name("p/", data)
    assert name.startswith("p/") and len(name.encode()) <= 1024
    text = name[2:]
    assert all(s not in ("", ".", "..") for s in text.replace("\\", "/").split("/")), name
    if not text.startswith("~h/"):
        assert key_of("p/", name) == data


# -- tensor records --------------------------------------------------------------------


def target_tensor_bytes(data: bytes) -> None:
    owner = (data[:16] + bytes(16))[:16]
    with contextlib.suppress(tens.TensorRecordError):
        tens.unpack(data[16:], owner)


def target_tensor_damaged(data: bytes) -> None:
    owner = tens.owner_digest("fuzz", "record")
    n = 1 + (data[0] % 16 if data else 0)
    payload = (data[1:] + bytes(4 * n))[: 4 * n]
    entry = tens.TensorEntry("w." + data[:3].hex(), "float32", (n,))
    record = bytes(tens.pack(owner, [(entry, payload)]))
    try:
        unpacked = tens.unpack(_damaged(record, data[-3:]), owner)
    except tens.TensorRecordError:
        return
    assert [bytes(view) for _, view in unpacked] == [payload], "a damaged tensor record unpacked as other bytes"


# -- manifests ------------------------------------------------------------------------


def target_manifests(data: bytes) -> None:
    with contextlib.suppress(CheckpointError):
        parse_manifest("run/1", data)
    with contextlib.suppress(ParameterValueError):
        ModelManifest.from_json(data, "model")


TARGETS: list[Target] = [
    target_record_bytes,
    target_record_damaged,
    target_locator,
    target_chunk,
    target_stream_views,
    target_put_stream,
    target_range_key,
    target_digests,
    target_object_name,
    target_tensor_bytes,
    target_tensor_damaged,
    target_manifests,
]


def fuzz_one(data: bytes) -> None:
    """One input: the first byte picks the target, the rest is its input."""
    if data:
        TARGETS[data[0] % len(TARGETS)](data[1:])


def _seeds() -> list[bytes]:
    """Valid inputs for each target, so coverage starts past the magic numbers."""
    value = b"value bytes"
    owner = tens.owner_digest("fuzz", "record")
    entry = tens.TensorEntry("w", "float32", (2,))
    chunk = codec.value_chunks(pb.Chunk(key=b"k", size=len(value), checksum=checksum(value)), value)
    streamed = b"".join(bytes([len(m)]) + m for m in (c.SerializeToString() for c in chunk))
    return [
        bytes([0]) + pack_record(b"k" * 8, value, checksum(value)),
        bytes([2]) + rec.pack_locator([(0, 20)]),
        bytes([3]) + pb.Chunk(key=b"k", size=3, data=b"abc").SerializeToString(),
        bytes([4]) + streamed,
        bytes([5]) + streamed,
        bytes([6]) + b"key" + RANGE_MARK + b"0-9",
        bytes([9]) + owner + bytes(tens.pack(owner, [(entry, struct.pack("<2f", 1.0, 2.0))])),
        bytes([11]) + b'{"format": "x", "modules": []}',
    ]


def _instrument(atheris: Any) -> None:
    """Coverage for cacheclient's code only (everything loaded, torch included, is 30,000 functions)."""
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "cacheclient" or name.startswith("cacheclient.")):
            continue
        for obj in list(vars(module).values()):
            if getattr(obj, "__module__", None) != name:
                continue
            members = vars(obj).values() if inspect.isclass(obj) else [obj]
            for member in members:
                function = getattr(member, "__func__", member)
                if inspect.isfunction(function):
                    atheris.instrument_func(function)


def main(argv: list[str]) -> None:
    """Runs `fuzz_one` under atheris (libFuzzer flags in `argv`: -runs=N, -max_total_time=S, a corpus dir)."""
    import atheris  # type: ignore[import-not-found]

    _instrument(atheris)
    if not any(not arg.startswith("-") for arg in argv[1:]):
        # No corpus directory given: start from the seeds (libFuzzer reads -seed_inputs files, so write them).
        import tempfile
        from pathlib import Path

        seeds = Path(tempfile.mkdtemp(prefix="fuzz-parsers-seeds-"))
        for i, seed in enumerate(_seeds()):
            (seeds / f"seed{i}").write_bytes(seed)
        argv = [*argv, str(seeds)]
    atheris.Setup(argv, fuzz_one)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
