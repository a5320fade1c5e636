"""The wire contract (`cacheclient.wire`): defined once, read the same on both ends."""

from __future__ import annotations

import re
import time
from pathlib import Path

import grpc
import pytest

import cacheclient.wire as wire
from cacheclient import errors as client_errors
from cacheclient._lmdb_reader import L2Reader
from cachesvc import errors as server_errors
from cachesvc.server.status import status_of
from cachesvc.tiers.lmdb_tier import LMDBTier

from conftest import serving_l2

ROOT = Path(__file__).resolve().parent.parent
WIRE = ROOT / "client" / "cacheclient" / "wire"


def test_colocated_reader_treats_an_expired_record_as_a_miss(tmp_path: Path) -> None:
    tier = LMDBTier(tmp_path / "l2", 8 << 20)
    now = time.time()
    for key, expires_at in [(b"expired", now - 1.0), (b"fresh", now + 3600.0), (b"forever", 0.0)]:
        tier.put(key, b"value of " + key, wire.checksum(b"value of " + key), expires_at=expires_at)
    tier.put(b"L" * 600 + b"expired", b"long", wire.checksum(b"long"), expires_at=now - 1.0)
    tier.close()  # one process opens an environment once
    reader = L2Reader(str(tmp_path / "l2"))
    with serving_l2(tmp_path / "l2"):
        got = reader.get_many([b"expired", b"fresh", b"forever", b"L" * 600 + b"expired"])
    assert got == [None, b"value of fresh", b"value of forever", None]
    assert (reader.expired, reader.corrupt) == (2, 0)  # misses, not corruption


def test_every_error_kind_reads_back_as_the_same_kind_on_the_client() -> None:
    server_classes = [getattr(server_errors, name) for name in server_errors.__all__]
    assert {cls.kind for cls in server_classes} >= set(wire.ErrorKind) - {wire.ErrorKind.DEADLINE, wire.ErrorKind.AUTH}
    for cls in server_classes:
        code = status_of(cls.__new__(cls))
        raised = client_errors.from_rpc_error(_RpcError(code), "host:1")
        expected = cls.kind if cls.kind not in (wire.ErrorKind.FAILED_PRECONDITION, wire.ErrorKind.INTERNAL) else None
        assert raised.kind is expected and raised.code is code, cls
    assert status_of(TimeoutError()) is grpc.StatusCode.DEADLINE_EXCEEDED
    assert status_of(KeyError("a bug")) is grpc.StatusCode.INTERNAL
    for kind, codes in wire.STATUS_CODES.items():
        assert all(wire.kind_of(code) is kind for code in codes)


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "details"


# -- one definition of each ---------------------------------------------------------

# Definitions still written outside the wire package, by files whose owners
# are moving them; remove an entry when its copy is gone (the test says so).
PENDING: set[tuple[str, str]] = set()


def _sources(root: Path) -> list[Path]:
    trees = [root / "cachesvc", root / "client" / "cacheclient", root / "bench", root / "tests"]
    return [
        path
        for tree in trees
        for path in tree.rglob("*.py")
        if WIRE not in path.parents and "_proto" not in path.parts and path != Path(__file__).resolve()
    ]


def _copies(root: Path = ROOT) -> set[tuple[str, str]]:
    """(file, name) for each module-level definition of a wire name, or literal of a wire format, outside the wire."""
    names = [name for name in wire.__all__ if not name.endswith(("_pb2", "_pb2_grpc"))]
    definition = re.compile(
        rf"^(?:def\s+(?P<fn>{'|'.join(names)})\s*\(|(?P<const>{'|'.join(names)})\s*(?::[^=\n]+)?=[^=])", re.M
    )
    literals = {
        "MAX_KEY_BYTES": re.compile(r"len\([^)]*\)\s*<=\s*1024\b|1\.\.1024"),
        "HEADER": re.compile(r"struct\.Struct\(\s*['\"]<2sBB"),
        "boot_id": re.compile(r"/proc/sys/kernel/random/boot_id"),
        "object_name": re.compile(r"['\"]~(?:b64|h)/['\"]"),
        "META_CHECKSUM": re.compile(r"['\"]xxh3['\"]\s*[:\]]"),
        "NODE_STATE_NAMES": re.compile(r"NODE_STATE_\w+\s*:\s*['\"]"),
        "TIER_NAMES": re.compile(r"TIER_L1\s*:\s*['\"]|['\"]l1['\"]\s*:\s*\w+\.TIER_L1"),
        "STATUS_CODES": re.compile(r"grpc\.StatusCode\.\w+\s*:\s*\w*Error\b"),
        "AUTH_METADATA": re.compile(r"f['\"]Bearer \{"),
        "MAX_MESSAGE_BYTES": re.compile(r"INLINE_BYTES\s*\+"),
    }
    found = set()
    for path in _sources(root):
        text = path.read_text()
        rel = str(path.relative_to(root))
        for m in definition.finditer(text):
            found.add((rel, m.group("fn") or m.group("const")))
        if not rel.startswith("tests/"):  # tests may state what users see ("1..1024 bytes") on their own
            found.update((rel, name) for name, pattern in literals.items() if pattern.search(text))
    return found


def test_each_wire_constant_and_format_is_defined_once() -> None:
    copies = _copies()
    assert copies - PENDING == set(), "written again outside cacheclient.wire; import it from there"
    assert PENDING - copies == set(), "gone now: remove it from PENDING"


def test_stubs_are_imported_through_the_wire() -> None:
    importers = [
        str(path.relative_to(ROOT))
        for path in _sources(ROOT)
        if re.search(r"from cacheclient\._proto import|import cacheclient\._proto", path.read_text())
    ]
    assert importers == [], "import the generated stubs from cacheclient.wire"


def test_the_scan_would_see_a_copy(tmp_path: Path) -> None:
    # The scan above must not pass because it looks at nothing.
    (tmp_path / "cachesvc").mkdir()
    (tmp_path / "cachesvc" / "copy.py").write_text(
        "INLINE_BYTES = 3 << 20\n"
        "def parse_s3_uri(uri):\n    pass\n"
        'def _boot() -> str:\n    return open("/proc/sys/kernel/random/boot_id").read()\n'
        "if not 1 <= len(key) <= 1024:\n    raise ValueError\n"
    )
    found = _copies(tmp_path)
    assert found == {("cachesvc/copy.py", n) for n in ("INLINE_BYTES", "parse_s3_uri", "boot_id", "MAX_KEY_BYTES")}
    assert _copies(ROOT) >= PENDING


def test_range_keys_round_trip_and_refuse_what_is_not_a_range() -> None:
    for key, start, end in [(b"a", 0, 0), (b"models/x.safetensors", 8, 1031), ("é/\x00odd".encode(), 5, 10**18)]:
        ranged = wire.parse_range_key(wire.range_key(key, start, end))
        assert ranged == wire.ByteRange(key, start, end) and ranged.length == end - start + 1
        assert ranged.header() == f"bytes={start}-{end}"
    assert wire.parse_range_key(b"plain/key") is None and not wire.is_range_key(b"plain/key")
    for bad, problem in [
        (b"k\x00bytes=9-3", "ends before it starts"),
        (b"k\x00bytes=-3", "not START-END"),
        (b"k\x00bytes=1-", "not START-END"),
        (b"k\x00bytes=01-3", "not START-END"),
        (b"k\x00bytes=1-3 ", "not START-END"),
        (b"k\x00bytes=1-99999999999999999999", "not START-END"),
        (b"\x00bytes=1-3", "want one object key"),
        (b"k\x00bytes=1-2\x00bytes=3-4", "want one object key"),
    ]:
        assert wire.is_range_key(bad)
        with pytest.raises(wire.RangeKeyError, match=problem):
            wire.parse_range_key(bad)
    for key, start, end in [(b"", 0, 1), (b"k\x00bytes=1-2", 0, 1), (b"k", 5, 4), (b"k", -1, 4)]:
        with pytest.raises(wire.RangeKeyError):
            wire.range_key(key, start, end)
