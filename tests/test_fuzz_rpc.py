"""Property-based fuzzing of every RPC of the cache and metadata services, through real server processes.

Every method of `CacheService`, `MetaService` and `RaftTransport` is read
from the service descriptors and must have a fuzzer here, so a new RPC
without one fails `test_every_rpc_has_a_fuzzer`. Each fuzzer draws
requests from hypothesis strategies over the inputs that break servers:
keys of 0, 1, 1,024 and 1,025 bytes, non-UTF-8, path-like and NUL-bearing
keys, range keys valid and not, empty values, values at and over the
server's `max_value_bytes` and over the gRPC message limit, right and wrong
checksums, streams that carry more or fewer bytes than they announce, NaN
and infinite leases. It works out the status each request must get from
the wire contract (`cacheclient.wire`: key limits, range keys, batch and
size limits, and the kind-to-status table) and asserts exactly that, with
a message that names the problem; valid writes read back byte for byte
(a dict of what was written is the reference). Malformed protobuf bytes
(random, truncated, wrong wire types, invalid UTF-8 in string fields) are
sent raw to every method and answered INVALID_ARGUMENT.

After every example the server process is still alive and its health
check answers SERVING: no input kills it or leaves it unable to serve.

The default run takes a few examples per RPC; `-m slow` runs
`test_*_slow` with many more (`FUZZ_EXAMPLES` overrides both counts), and
`-rP` shows how many examples each RPC got (an RPC with few possible
inputs, Stats, gets fewer)::

    .venv/bin/python -m pytest tests/test_fuzz_rpc.py -m slow -rP
"""

from __future__ import annotations

import os
import random
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.message_factory import GetMessageClass
from grpc import StatusCode as Code
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cacheclient.wire import (
    KEY_DIGEST_ENTRIES,
    MAX_KEY_BYTES,
    MAX_MESSAGE_BYTES,
    RANGE_MARK,
    RangeKeyError,
    cache_pb2,
    cache_pb2_grpc,
    checksum,
    codec,
    meta_pb2,
    meta_pb2_grpc,
    parse_range_key,
)
from cacheclient.wire.limits import MAX_BATCH_KEYS, MAX_PLAN_MESSAGE_KEYS, PUT_MANY_BYTES
from cachesvc.devcluster.shard import LocalShard

from conftest import CacheServer, S3Server, s3_args

pytestmark = pytest.mark.timeout(600)

OK, INVALID, LIMIT, CORRUPT = Code.OK, Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED, Code.DATA_LOSS

CACHE_SERVICE = cache_pb2.DESCRIPTOR.services_by_name["CacheService"]
META_SERVICE = meta_pb2.DESCRIPTOR.services_by_name["MetaService"]
RAFT_SERVICE = meta_pb2.DESCRIPTOR.services_by_name["RaftTransport"]
OPEN_SERVICES = (
    health_pb2.DESCRIPTOR.services_by_name["Health"],
    reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
)
"""Served beside the others on every port, to any caller."""

MAX_VALUE = 1 << 20
"""The server's --max-value-bytes: small enough that a value over it still fits in one message."""
MAX_LEASE = 3600.0
"""The server's max_lease_seconds (the default)."""
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "12"))
SLOW_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "400"))
TIMEOUT = 30.0


# -- strategies -----------------------------------------------------------------

PATH_LIKE = [
    b"../../etc/passwd",
    b"/etc/passwd",
    b"a/../b",
    b"./x",
    b"x/./y",
    b"//double//slash",
    b"..",
    b".",
    b"/",
    b"a\\..\\b",
    b"%2e%2e/%2fescaped",
    b"~",
    b"~b64/AAAA",
    b"~h/00",
    b"key with spaces?&=#",
    "ключ/中文/🔑".encode(),
]
ABSENT = b"fuzz-absent/"
"""Range keys name objects under this prefix, which no example writes: their reads are plain misses."""


def _sized(size: int) -> st.SearchStrategy[bytes]:
    return st.binary(min_size=size, max_size=size)


keys: st.SearchStrategy[bytes] = st.one_of(
    st.just(b""),
    _sized(1),
    _sized(MAX_KEY_BYTES),
    _sized(MAX_KEY_BYTES + 1),
    st.binary(min_size=1, max_size=40),
    st.builds(lambda b: b"\xff\xfe" + b, st.binary(max_size=30)),  # never UTF-8
    st.builds(lambda b: b + b"\x00" + b, st.binary(max_size=10)),  # NUL inside
    st.sampled_from(PATH_LIKE),
    st.builds(  # a well-formed range key (its length may pass max_value_bytes)
        lambda k, s, n: ABSENT + k + RANGE_MARK + f"{s}-{s + n}".encode(),
        st.binary(min_size=1, max_size=8),
        st.integers(0, 1 << 40),
        st.sampled_from([0, 1, MAX_VALUE - 1, MAX_VALUE, 1 << 50]),
    ),
    st.builds(  # a range key that does not parse (or ends before it starts)
        lambda k, t: k + RANGE_MARK + t,
        st.sampled_from([b"", ABSENT + b"k", b"a" + RANGE_MARK + b"0-0"]),
        st.sampled_from([b"", b"5-1", b"-1-3", b"01-2", b"1-", b"x-y", b"1-2-3", b"99999999999999999999-1"]),
    ),
)
key_lists = st.one_of(st.lists(keys, max_size=5), st.just([b"k"] * (MAX_BATCH_KEYS + 1)))
value_sizes = st.sampled_from([0, 0, 1, 7, 100, 4096, MAX_VALUE, MAX_VALUE + 1, MAX_MESSAGE_BYTES + 1])
seconds = st.sampled_from([0.0, 0.0, 0.0, 1.5, MAX_LEASE, MAX_LEASE + 1, -1.0, float("nan"), float("inf"), 1e300])
ttls = st.sampled_from([0.0, 0.0, 3600.0, -1.0, float("nan"), float("inf"), -0.0])
u64 = st.one_of(st.integers(0, 10), st.integers(0, (1 << 64) - 1))
u32 = st.one_of(st.integers(0, 10), st.integers(0, (1 << 32) - 1))


def value_of(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


# -- the reference: what the contract says each input gets ---------------------------


def key_problems(key: bytes, *, write: bool = False) -> set[Code]:
    """The status codes `key` earns on its own: none for a valid key."""
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        return {INVALID}
    try:
        ranged = parse_range_key(key)
    except RangeKeyError:
        return {INVALID}
    if ranged is None:
        return set()
    problems = {INVALID} if write else set()  # range keys are read-only
    return problems | ({LIMIT} if ranged.length > MAX_VALUE else set())


def lease_problems(lease: float, ttl: float) -> set[Code]:
    bad_lease = lease != 0 and not (0 <= lease <= MAX_LEASE)  # NaN fails both comparisons
    bad_ttl = ttl != 0 and not (0 <= ttl < float("inf"))
    return {INVALID} if bad_lease or bad_ttl else set()


def expected(*problems: set[Code]) -> set[Code]:
    """OK when there are no problems; else any of their codes (the server reports the first it checks)."""
    found = set().union(*problems)
    return found or {OK}


class Written:
    """What the fuzzers wrote and did not delete, by key: the reference every read is checked against."""

    def __init__(self) -> None:
        self.values: dict[bytes, bytes] = {}

    def check_hit(self, key: bytes, found: bool, value: bytes | None) -> None:
        if parse_range_key(key) is not None:
            assert not found, f"a range key of an object never written was found: {key!r}"
            return
        assert found == (key in self.values), f"found={found} for {key[:40]!r}"
        if found and value is not None:
            assert value == self.values[key], f"value of {key[:40]!r} differs from the one written"


# -- calling --------------------------------------------------------------------


def call(method: Callable[..., Any], request: Any, *, stream: bool = False) -> tuple[Code, str, Any]:
    """(status, details, answer) of one call; the answer is a list for a streamed response."""
    try:
        answer = method(request, timeout=TIMEOUT)
        if stream:
            answer = list(answer)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", None
    return OK, "", answer


def check_status(got: tuple[Code, str, Any], allowed: set[Code], what: str) -> None:
    code, details, _ = got
    assert code in allowed, f"{what}: got {code.name} ({details!r}), want one of {sorted(c.name for c in allowed)}"
    assert code not in (Code.UNKNOWN, Code.INTERNAL), f"{what}: {code.name}: {details}"
    if code is not OK:
        assert details, f"{what}: {code.name} without a message"


def check_key_message(got: tuple[Code, str, Any], keys_sent: list[bytes], *, checked_first: bool = True) -> None:
    """A refusal for a key of the wrong length names the limits and the length sent.

    The server checks keys in order, so the first key with a problem is the
    one refused; `checked_first` is False when the request has a problem the
    server checks before its keys (a lease, a batch size).
    """
    first = next((k for k in keys_sent if key_problems(k)), None)
    if got[0] is INVALID and checked_first and first is not None and not 1 <= len(first) <= MAX_KEY_BYTES:
        assert f"1..{MAX_KEY_BYTES} bytes, got {len(first)}" in got[1], got[1]


# -- the servers ----------------------------------------------------------------


class Target:
    """A server under test: its channel, and a check that it is alive and answers its health check."""

    def __init__(self, address: str, alive: Callable[[], bool], log: Callable[[], str]) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(
            address,
            options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)],
        )
        self._alive = alive
        self._log = log
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def assert_serving(self) -> None:
        assert self._alive(), f"the server at {self.address} died:\n{self._log()}"
        status = self._health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status
        assert status == health_pb2.HealthCheckResponse.SERVING, status


@pytest.fixture(scope="module")
def cache(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """One cache server: L1 memory, L2 LMDB, L3 the test S3 server (write-through), values up to 1 MiB."""
    base = tmp_path_factory.mktemp("fuzz-cache")
    args = [
        "--l1-bytes", "64MiB",
        "--l2-path", str(base / "l2"),
        "--l2-bytes", "256MiB",
        "--max-value-bytes", str(MAX_VALUE),
        *s3_args(s3, f"fuzz/{uuid.uuid4().hex[:8]}/"),
    ]  # fmt: skip
    server = CacheServer(args, base / "logs").start()
    assert server.process is not None
    target = Target(server.address, server.process.alive, server.log)
    try:
        yield target
    finally:
        target.channel.close()
        server.stop(grace=10.0)


@pytest.fixture(scope="module")
def meta(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """One metadata node, a shard of one (it leads as soon as it starts)."""
    shard = LocalShard(1, tmp_path_factory.mktemp("fuzz-meta"))
    try:
        shard.start()
        shard.leader(timeout=20.0)
        target = Target(shard.addresses[0], lambda: shard.alive(1), lambda: shard.procs[1].tail(200))
        yield target
        target.channel.close()
    finally:
        shard.stop()


@pytest.fixture(scope="module")
def written() -> Written:
    return Written()


# -- cache service fuzzers: each draws one request, calls, checks ------------------

Draw = Callable[..., Any]


def fuzz_get(stub: cache_pb2_grpc.CacheServiceStub, draw: Draw, ref: Written) -> None:
    key = draw(keys)
    handoff = draw(st.sampled_from([b"", b"", os.urandom(8), os.urandom(40)]))
    got = call(stub.Get, cache_pb2.GetRequest(key=key, release=draw(st.booleans()), handoff=handoff))
    check_status(got, expected(key_problems(key)), f"Get {key[:40]!r}")
    check_key_message(got, [key])
    if got[0] is OK:
        ref.check_hit(key, got[2].found, got[2].value)


def fuzz_get_many(stub: cache_pb2_grpc.CacheServiceStub, draw: Draw, ref: Written) -> None:
    batch = draw(key_lists)
    request = cache_pb2.GetManyRequest(keys=batch, release=draw(st.booleans()))
    got = call(stub.GetMany, request)
    over = {LIMIT} if len(batch) > MAX_BATCH_KEYS else set()
    check_status(got, expected(over, *(key_problems(k) for k in batch)), f"GetMany of {len(batch)}")
    check_key_message(got, batch, checked_first=not over)
    if got[0] is OK:
        assert len(got[2].results) == len(batch)
        for key, result in zip(batch, got[2].results, strict=True):
            assert not result.streamed and not result.deferred  # small values, one small batch
            ref.check_hit(key, result.found, result.value)


def _stream_hits(chunks: list[cache_pb2.Chunk]) -> list[tuple[bytes, bool, bytes | None]]:
    return [(head.key, head.found, value) for head, value in codec.stream_values(chunks)]


def fuzz_get_stream(stub: cache_pb2_grpc.CacheServiceStub, draw: Draw, ref: Written) -> None:
    key = draw(keys)
    got = call(stub.GetStream, cache_pb2.GetRequest(key=key), stream=True)
    check_status(got, expected(key_problems(key)), f"GetStream {key[:40]!r}")
    if got[0] is OK:
        [(_, found, value)] = _stream_hits(got[2])
        ref.check_hit(key, found, value)


def fuzz_get_many_stream(stub: cache_pb2_grpc.CacheServiceStub, draw: Draw, ref: Written) -> None:
    batch = draw(key_lists)
    got = call(stub.GetManyStream, cache_pb2.GetManyRequest(keys=batch), stream=True)
    over = {LIMIT} if len(batch) > MAX_BATCH_KEYS else set()
    check_status(got, expected(over, *(key_problems(k) for k in batch)), f"GetManyStream of {len(batch)}")
    if got[0] is OK:
        hits = _stream_hits(got[2])
        assert [k for k, _, _ in hits] == batch
        for key, found, value in hits:
            ref.check_hit(key, found, value)


def _put_item(draw: Draw) -> tuple[cache_pb2.PutRequest, set[Code]]:
    """A PutRequest and the codes its item earns (lease and TTL apart)."""
    key = draw(keys)
    value = value_of(draw(value_sizes), draw(st.integers(0, 1 << 30)))
    how = draw(st.sampled_from(["none", "right", "wrong"]))
    request = cache_pb2.PutRequest(key=key, value=value)
    problems = key_problems(key, write=True)
    if len(value) > MAX_VALUE:
        problems.add(LIMIT)
    if how == "right":
        request.checksum = checksum(value)
    elif how == "wrong":
        request.checksum = checksum(value) ^ (1 << draw(st.integers(0, 63)))
        problems.add(CORRUPT)
    return request, problems


def fuzz_put(stub: cache_pb2_grpc.CacheServiceStub, draw: Draw, ref: Written) -> None:
    request, problems = _put_item(draw)
    request.lease_seconds, request.ttl_seconds = draw(seconds), draw(ttls)
    problems |= lease_problems(request.lease_seconds, request.ttl_seconds)
    if request.ByteSize() > MAX_MESSAGE_BYTES:
        problems.add(LIMIT)  # refused by gRPC before the servicer sees it
    got = call(stub.Put, request)
    check_status(got, expected(problems), f"Put {request.key[:40]!r} of {len(request.value)} bytes")
    check_key_message(got, [request.key], checked_first=not lease_problems(request.lease_seconds, request.ttl_seconds))
    if got[0] is OK:
        ref.values[request.key] = request.value
        answer = call(stub.Get, cache_pb2.GetRequest(key=request.key))
        assert answer[0] is OK and answer[2].found and answer[2].value == request.value
        assert answer[2].checksum == checksum(request.value)


def fuzz_put_many(stub: cache_pb2_grpc.CacheServiceStub, draw: Draw, ref: Written) -> None:
    drawn = draw(st.lists(st.builds(lambda: None), max_size=4))  # how many items
    items = [_put_item(draw) for _ in drawn]
    request = cache_pb2.PutManyRequest(items=[item for item, _ in items])
    problems: set[Code] = set().union(*(p for _, p in items))
    if items:
        first = request.items[0]
        first.lease_seconds, first.ttl_seconds = draw(seconds), draw(ttls)
        problems |= lease_problems(first.lease_seconds, first.ttl_seconds)
    if sum(len(item.value) for item in request.items) > PUT_MANY_BYTES or request.ByteSize() > MAX_MESSAGE_BYTES:
        problems.add(LIMIT)
    got = call(stub.PutMany, request)
    check_status(got, expected(problems), f"PutMany of {len(items)}")
    if got[0] is OK:
        for item in request.items:
            ref.values[item.key] = item.value
        answer = call(stub.GetMany, cache_pb2.GetManyRequest(keys=[item.key for item in request.items]))
        assert answer[0] is OK
        for key, result in zip([item.key for item in request.items], answer[2].results, strict=True):
            ref.check_hit(key, result.found, result.value)
    else:
        # All items are validated before any is written: nothing changed.
        for item in request.items:
            if not key_problems(item.key):
                got_back = call(stub.Get, cache_pb2.GetRequest(key=item.key))
                ref.check_hit(item.key, got_back[2].found, got_back[2].value)


def fuzz_put_stream(stub: cache_pb2_grpc.CacheServiceStub, draw: Draw, ref: Written) -> None:
    key = draw(keys)
    value = value_of(draw(value_sizes), draw(st.integers(0, 1 << 30)))
    announced = draw(st.sampled_from(["exact", "exact", "shorter", "longer", "huge"]))
    size = {"exact": len(value), "shorter": max(0, len(value) - 1), "longer": len(value) + 1, "huge": 1 << 62}[
        announced
    ]
    how = draw(st.sampled_from(["right", "right", "wrong", "absent"]))
    value_sum = checksum(value) if how == "right" else checksum(value) ^ 1 if how == "wrong" else 0
    lease, ttl = draw(seconds), draw(ttls)
    head = cache_pb2.Chunk(key=key, size=size, checksum=value_sum, lease_seconds=lease, ttl_seconds=ttl)
    chunks = list(codec.value_chunks(head, value))
    if not draw(st.integers(0, 9)):
        chunks = []  # an empty stream: no key at all
    problems = key_problems(key, write=True) | lease_problems(lease, ttl)
    if size > MAX_VALUE or len(value) > MAX_VALUE:
        problems.add(LIMIT)
    if size != len(value) or value_sum != checksum(value):
        problems.add(CORRUPT)
    if not chunks:
        problems = {INVALID}
    got = call(stub.PutStream, iter(chunks))
    check_status(got, expected(problems), f"PutStream {key[:40]!r}: {len(value)} bytes, announced {size}, {how}")
    if got[0] is OK:
        ref.values[key] = value
        answer = call(stub.GetStream, cache_pb2.GetRequest(key=key), stream=True)
        assert answer[0] is OK
        assert _stream_hits(answer[2]) == [(key, True, value)]


def fuzz_delete(stub: cache_pb2_grpc.CacheServiceStub, draw: Draw, ref: Written) -> None:
    key = draw(keys)
    got = call(stub.Delete, cache_pb2.DeleteRequest(key=key))
    check_status(got, expected(key_problems(key)), f"Delete {key[:40]!r}")
    check_key_message(got, [key])
    if got[0] is OK and parse_range_key(key) is None:
        assert got[2].existed == (key in ref.values), key[:40]
        ref.values.pop(key, None)
        assert not call(stub.Get, cache_pb2.GetRequest(key=key))[2].found


def fuzz_contains(stub: cache_pb2_grpc.CacheServiceStub, draw: Draw, ref: Written) -> None:
    key = draw(keys)
    got = call(stub.Contains, cache_pb2.ContainsRequest(key=key))
    check_status(got, expected(key_problems(key)), f"Contains {key[:40]!r}")
    if got[0] is OK:
        ref.check_hit(key, got[2].found, None)


def fuzz_contains_many(stub: cache_pb2_grpc.CacheServiceStub, draw: Draw, ref: Written) -> None:
    batch = draw(key_lists)
    got = call(stub.ContainsMany, cache_pb2.ContainsManyRequest(keys=batch, cached_only=draw(st.booleans())))
    over = {LIMIT} if len(batch) > MAX_BATCH_KEYS else set()
    check_status(got, expected(over, *(key_problems(k) for k in batch)), f"ContainsMany of {len(batch)}")
    if got[0] is OK:
        assert len(got[2].results) == len(batch)


def fuzz_stats(stub: cache_pb2_grpc.CacheServiceStub, draw: Draw, ref: Written) -> None:
    got = call(stub.Stats, cache_pb2.StatsRequest())
    check_status(got, {OK}, "Stats")
    assert {t.name for t in got[2].tiers} == {"l1", "l2", "l3"}


def fuzz_evict(stub: cache_pb2_grpc.CacheServiceStub, draw: Draw, ref: Written) -> None:
    key = draw(keys)
    got = call(stub.Evict, cache_pb2.EvictRequest(key=key))
    check_status(got, expected(key_problems(key)), f"Evict {key[:40]!r}")
    if got[0] is OK and key in ref.values:
        # Object storage keeps it: the next read fills from S3, whatever the key's bytes (path-like ones too).
        answer = call(stub.Get, cache_pb2.GetRequest(key=key))
        assert answer[0] is OK, answer[:2]
        ref.check_hit(key, answer[2].found, answer[2].value)


def fuzz_list(stub: cache_pb2_grpc.CacheServiceStub, draw: Draw, ref: Written) -> None:
    prefix = draw(st.one_of(keys, st.just(b"")))
    limit = draw(u32)
    bucket = draw(st.sampled_from(["", "", "another-bucket", "cachesvc-test", "ü/../x"]))
    request = cache_pb2.ListRequest(prefix=prefix, start_after=draw(st.one_of(keys, st.just(b""))), limit=limit)
    request.bucket = bucket
    got = call(stub.List, request)
    problems = {INVALID} if bucket not in ("", "cachesvc-test") else set()
    try:
        prefix.decode("utf-8")
    except UnicodeDecodeError:
        problems.add(INVALID)  # object names are text: a binary prefix matches none (the message says so)
    check_status(got, expected(problems), f"List {prefix[:40]!r} limit {limit} bucket {bucket!r}")
    if got[0] is OK:
        listed = [e.key for e in got[2].entries]
        assert listed == sorted(listed) and all(k.startswith(prefix) for k in listed)
        assert len(listed) <= (limit or 10_000)
        assert all(k > request.start_after for k in listed) or not request.start_after


def fuzz_prefetch(stub: cache_pb2_grpc.CacheServiceStub, draw: Draw, ref: Written) -> None:
    plan = draw(st.one_of(st.lists(keys, max_size=4), st.just([b"p"] * (MAX_PLAN_MESSAGE_KEYS + 1))))
    sizes = draw(st.sampled_from(["none", "right", "wrong", "huge"]))
    first = cache_pb2.PrefetchRequest(
        keys=plan,
        sizes=[] if sizes == "none" else [1 << 63 if sizes == "huge" else 1] * (len(plan) + (sizes == "wrong")),
        window_bytes=draw(st.sampled_from([0, 1, 1 << 20, (1 << 64) - 1])),
        priority=draw(st.sampled_from([0, 1, 2, 3, 77])),  # proto3 enums are open: 77 arrives as 77
        consumed=draw(u64),
    )
    later = draw(st.lists(keys, max_size=3))
    messages = [first, cache_pb2.PrefetchRequest(keys=later, consumed=draw(u64))]
    problems: set[Code] = set() if first.window_bytes else {INVALID}
    if sizes == "huge" and plan:
        problems.add(INVALID)
    for message in messages:
        if len(message.keys) > MAX_PLAN_MESSAGE_KEYS:
            problems.add(LIMIT)
        if message.sizes and len(message.sizes) != len(message.keys):
            problems.add(INVALID)
        if any(not 1 <= len(k) <= MAX_KEY_BYTES for k in message.keys):
            problems.add(INVALID)
    got = call(stub.Prefetch, iter(messages), stream=True)
    check_status(got, expected(problems), f"Prefetch of {len(plan)}+{len(later)} keys")


def fuzz_info(stub: cache_pb2_grpc.CacheServiceStub, draw: Draw, ref: Written) -> None:
    got = call(stub.Info, cache_pb2.InfoRequest(probe_object_storage=draw(st.booleans())))
    check_status(got, {OK}, "Info")
    assert got[2].max_value_bytes == MAX_VALUE and not got[2].object_storage_error


def fuzz_key_digest(stub: cache_pb2_grpc.CacheServiceStub, draw: Draw, ref: Written) -> None:
    prefix = draw(st.sampled_from([b"kv/", b"kv/", b"", b"kv", b"other/", b"\xff"]))
    max_entries = draw(st.sampled_from([0, 1, KEY_DIGEST_ENTRIES, KEY_DIGEST_ENTRIES + 1, (1 << 32) - 1]))
    request = cache_pb2.KeyDigestRequest(
        prefix=prefix,
        epoch=draw(u64),
        since_seq=draw(u64),
        snapshot=draw(st.booleans()),
        snapshot_after=draw(u64),
        max_entries=max_entries,
    )
    got = call(stub.KeyDigest, request)
    problems = set()
    if max_entries > KEY_DIGEST_ENTRIES or not prefix:
        problems.add(INVALID)
    elif prefix != b"kv/":
        problems.add(Code.FAILED_PRECONDITION)  # not a followed prefix: the server is not set up for it
    check_status(got, expected(problems), f"KeyDigest {prefix!r} max_entries {max_entries}")
    if got[0] is OK:
        assert len(got[2].added) % 8 == 0 and len(got[2].removed) % 8 == 0


def fuzz_fence(stub: cache_pb2_grpc.CacheServiceStub, draw: Draw, ref: Written) -> None:
    version = draw(st.one_of(st.just(0), u64))
    got = call(stub.Fence, cache_pb2.FenceRequest(version=version, epoch=draw(u64)))
    # A server outside a cluster has no placement to fence.
    check_status(got, {INVALID} if version == 0 else {Code.FAILED_PRECONDITION}, f"Fence version {version}")


CACHE_FUZZERS: dict[str, Callable[[cache_pb2_grpc.CacheServiceStub, Draw, Written], None]] = {
    "Get": fuzz_get,
    "GetMany": fuzz_get_many,
    "GetStream": fuzz_get_stream,
    "GetManyStream": fuzz_get_many_stream,
    "Put": fuzz_put,
    "PutMany": fuzz_put_many,
    "PutStream": fuzz_put_stream,
    "Delete": fuzz_delete,
    "Contains": fuzz_contains,
    "ContainsMany": fuzz_contains_many,
    "Stats": fuzz_stats,
    "Evict": fuzz_evict,
    "List": fuzz_list,
    "Prefetch": fuzz_prefetch,
    "Info": fuzz_info,
    "KeyDigest": fuzz_key_digest,
    "Fence": fuzz_fence,
}


# -- metadata service fuzzers ------------------------------------------------------

texts = st.one_of(
    st.just(""), st.text(max_size=20), st.sampled_from(["127.0.0.1:1", "../../etc/passwd", "a" * 5000, "\x00"])
)
node_states = st.sampled_from([0, 1, 2, 3, 4, 99])
read_options = st.builds(meta_pb2.ReadOptions, stale=st.booleans())


def _commands(draw: Draw) -> list[meta_pb2.Command]:
    ops = [
        lambda: meta_pb2.Command(register_node=meta_pb2.RegisterNode(address=draw(texts), capacity_bytes=draw(u64))),
        lambda: meta_pb2.Command(set_node_state=meta_pb2.SetNodeState(address=draw(texts), state=draw(node_states))),
        lambda: meta_pb2.Command(remove_node=meta_pb2.RemoveNode(address=draw(texts))),
        lambda: meta_pb2.Command(
            put_manifest=meta_pb2.PutManifest(
                manifest=meta_pb2.Manifest(
                    name=draw(texts),
                    s3_prefix=draw(texts),
                    items=[meta_pb2.ManifestItem(key=draw(texts), size=draw(u64), checksum=draw(u64))],
                    revision=draw(u64),
                )
            )
        ),
        lambda: meta_pb2.Command(delete_manifest=meta_pb2.DeleteManifest(name=draw(texts))),
        lambda: meta_pb2.Command(heartbeats=meta_pb2.Heartbeats(lease_ms=draw(st.integers(-(1 << 63), 1 << 62)))),
        lambda: meta_pb2.Command(),  # no op at all
    ]
    picked = draw(st.lists(st.integers(0, len(ops) - 1), max_size=4))
    commands = [ops[i]() for i in picked]
    for command in commands:
        command.request_id = draw(st.sampled_from([b"", os.urandom(16), b"\xff" * 300]))
    return commands


def fuzz_propose(channel: grpc.Channel, draw: Draw) -> None:
    commands = _commands(draw)
    got = call(meta_pb2_grpc.MetaServiceStub(channel).Propose, meta_pb2.ProposeRequest(commands=commands))
    client_ops = {"register_node", "set_node_state", "remove_node", "put_manifest", "delete_manifest"}
    problems = {INVALID} if any(c.WhichOneof("op") not in client_ops for c in commands) else set()
    check_status(got, expected(problems), f"Propose {[c.WhichOneof('op') for c in commands]}")
    if got[0] is OK:
        # Each command is applied or refused with a reason, never dropped.
        assert len(got[2].results) == len(commands)
        assert all(r.ok or r.error for r in got[2].results)


def fuzz_heartbeat(channel: grpc.Channel, draw: Draw) -> None:
    beats = [meta_pb2.NodeHeartbeat(address=draw(texts), used_bytes=draw(u64)) for _ in range(draw(st.integers(0, 3)))]
    got = call(meta_pb2_grpc.MetaServiceStub(channel).Heartbeat, meta_pb2.HeartbeatRequest(beats=beats))
    check_status(got, {OK, INVALID}, f"Heartbeat of {len(beats)}")


def fuzz_get_manifest(channel: grpc.Channel, draw: Draw) -> None:
    request = meta_pb2.GetManifestRequest(name=draw(texts), options=draw(read_options))
    check_status(call(meta_pb2_grpc.MetaServiceStub(channel).GetManifest, request), {OK}, "GetManifest")


def fuzz_list_manifests(channel: grpc.Channel, draw: Draw) -> None:
    request = meta_pb2.ListManifestsRequest(options=draw(read_options))
    check_status(call(meta_pb2_grpc.MetaServiceStub(channel).ListManifests, request), {OK}, "ListManifests")


def fuzz_list_nodes(channel: grpc.Channel, draw: Draw) -> None:
    request = meta_pb2.ListNodesRequest(options=draw(read_options))
    check_status(call(meta_pb2_grpc.MetaServiceStub(channel).ListNodes, request), {OK}, "ListNodes")


def fuzz_get_placement(channel: grpc.Channel, draw: Draw) -> None:
    request = meta_pb2.GetPlacementRequest(options=draw(read_options), known_version=draw(u64))
    got = call(meta_pb2_grpc.MetaServiceStub(channel).GetPlacement, request)
    check_status(got, {OK}, "GetPlacement")
    assert all(s < len(got[2].nodes) for s in got[2].slots)


def fuzz_get_namespaces(channel: grpc.Channel, draw: Draw) -> None:
    request = meta_pb2.GetNamespacesRequest(options=draw(read_options))
    got = call(meta_pb2_grpc.MetaServiceStub(channel).GetNamespaces, request)
    check_status(got, {OK}, "GetNamespaces")


def fuzz_leader(channel: grpc.Channel, draw: Draw) -> None:
    got = call(meta_pb2_grpc.MetaServiceStub(channel).Leader, meta_pb2.LeaderRequest())
    check_status(got, {OK}, "Leader")
    assert got[2].leader_id == got[2].node_id == 1  # nothing a fuzzer sends unseats the only node


def fuzz_status(channel: grpc.Channel, draw: Draw) -> None:
    request = meta_pb2.StatusRequest(state_digest=draw(st.booleans()))
    check_status(call(meta_pb2_grpc.MetaServiceStub(channel).Status, request), {OK}, "Status")


def fuzz_committed_entries(channel: grpc.Channel, draw: Draw) -> None:
    request = meta_pb2.CommittedEntriesRequest(lo=draw(u64), hi=draw(u64))
    got = call(meta_pb2_grpc.MetaServiceStub(channel).CommittedEntries, request)
    check_status(got, {OK, INVALID}, f"CommittedEntries {request.lo}..{request.hi}")


def fuzz_send(channel: grpc.Channel, draw: Draw) -> None:
    # Peers are trusted (the peer secret guards this service): here only what a
    # node must refuse or ignore whoever sends it, messages of unknown types and
    # messages addressed to a node that is not this one.
    messages = [
        meta_pb2.RaftMessage(
            type=draw(st.sampled_from([99, 1 << 31])),
            src=draw(u64),
            dst=1,
            term=draw(u64),
            entries=[meta_pb2.RaftEntry(term=draw(u64), index=draw(u64), data=os.urandom(8), kind=draw(u32))],
        ),
        meta_pb2.RaftMessage(type=draw(st.integers(0, 12)), src=draw(u64), dst=draw(st.integers(2, 1 << 40))),
    ]
    picked = draw(st.lists(st.sampled_from(messages), min_size=1, max_size=2))
    got = call(meta_pb2_grpc.RaftTransportStub(channel).Send, meta_pb2.RaftBatch(messages=picked))
    check_status(got, {OK, INVALID}, f"Send {[m.type for m in picked]}")


META_FUZZERS: dict[str, Callable[[grpc.Channel, Draw], None]] = {
    "Propose": fuzz_propose,
    "Heartbeat": fuzz_heartbeat,
    "GetManifest": fuzz_get_manifest,
    "ListManifests": fuzz_list_manifests,
    "ListNodes": fuzz_list_nodes,
    "GetPlacement": fuzz_get_placement,
    "GetNamespaces": fuzz_get_namespaces,
    "Leader": fuzz_leader,
    "Status": fuzz_status,
    "CommittedEntries": fuzz_committed_entries,
}
RAFT_FUZZERS: dict[str, Callable[[grpc.Channel, Draw], None]] = {"Send": fuzz_send}


def test_every_rpc_has_a_fuzzer() -> None:
    for service, fuzzers in (
        (CACHE_SERVICE, CACHE_FUZZERS),
        (META_SERVICE, META_FUZZERS),
        (RAFT_SERVICE, RAFT_FUZZERS),
    ):
        assert set(service.methods_by_name) == set(fuzzers), f"{service.full_name}: methods without a fuzzer"


# -- the property tests -------------------------------------------------------------

_SETTINGS = {"deadline": None, "suppress_health_check": list(HealthCheck), "database": None}


def _run_cache(cache: Target, written: Written, method: str, examples: int) -> int:
    """Runs `method`'s fuzzer for up to `examples` examples (fewer when its inputs run out); how many ran."""
    stub = cache_pb2_grpc.CacheServiceStub(cache.channel)
    ran = 0

    @settings(max_examples=examples, **_SETTINGS)  # type: ignore[arg-type]
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        nonlocal ran
        CACHE_FUZZERS[method](stub, data.draw, written)
        cache.assert_serving()
        ran += 1

    run()
    print(f"CacheService.{method}: {ran} examples")
    return ran


def _run_meta(meta: Target, method: str, examples: int) -> int:
    """As `_run_cache`, for a method of the metadata node."""
    fuzzer = {**META_FUZZERS, **RAFT_FUZZERS}[method]
    ran = 0

    @settings(max_examples=examples, **_SETTINGS)  # type: ignore[arg-type]
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        nonlocal ran
        fuzzer(meta.channel, data.draw)
        meta.assert_serving()
        ran += 1

    run()
    print(f"{'RaftTransport' if method in RAFT_FUZZERS else 'MetaService'}.{method}: {ran} examples")
    return ran


@pytest.mark.parametrize("method", sorted(CACHE_SERVICE.methods_by_name))
def test_cache_rpc(cache: Target, written: Written, method: str) -> None:
    _run_cache(cache, written, method, EXAMPLES)


@pytest.mark.parametrize("method", sorted([*META_SERVICE.methods_by_name, *RAFT_SERVICE.methods_by_name]))
def test_meta_rpc(meta: Target, method: str) -> None:
    _run_meta(meta, method, EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(CACHE_SERVICE.methods_by_name))
def test_cache_rpc_slow(cache: Target, written: Written, method: str) -> None:
    _run_cache(cache, written, method, SLOW_EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted([*META_SERVICE.methods_by_name, *RAFT_SERVICE.methods_by_name]))
def test_meta_rpc_slow(meta: Target, method: str) -> None:
    _run_meta(meta, method, SLOW_EXAMPLES)


# -- malformed bytes, sent raw ----------------------------------------------------------


def _raw_requests(request_type: Any) -> st.SearchStrategy[bytes]:
    """Bytes that do not parse as `request_type`: random, truncated, wrong wire types, invalid UTF-8 in a string."""
    field = next(iter(request_type.DESCRIPTOR.fields), None)
    wrong_type = (
        bytes([(field.number << 3) | 2, 5]) + b"abcde"  # length-delimited where a varint belongs, or the reverse
        if field is not None and field.type not in (field.TYPE_BYTES, field.TYPE_STRING, field.TYPE_MESSAGE)
        else bytes([((field.number if field is not None else 1) << 3) | 0]) + b"\x80" * 11  # an endless varint
    )
    strings = [f for f in request_type.DESCRIPTOR.fields if f.type == f.TYPE_STRING]
    bad_utf8 = [bytes([(f.number << 3) | 2, 2]) + b"\xff\xfe" for f in strings]
    return st.one_of(
        st.sampled_from(
            [
                wrong_type,
                b"\x0a\xff\xff\xff\xff\x0f",  # field 1, a length past the end
                b"\x00",  # field number 0
                b"\x0b",  # a start-group tag
                b"\x0f",  # wire type 7
                b"\x0a\x05ab",  # truncated
                *bad_utf8,
            ]
        ),
        st.binary(min_size=1, max_size=64),
    )


def _parses(request_type: Any, raw: bytes) -> bool:
    try:
        request_type.FromString(raw)
    except Exception:
        return False
    return True


def _raw_call(channel: grpc.Channel, path: str, method: Any, raw: bytes) -> tuple[Code, str]:
    """Sends `raw` as the request (the only one of a stream); the status of the call."""
    if method.client_streaming and method.server_streaming:
        fn: Any = channel.stream_stream(path)
    elif method.client_streaming:
        fn = channel.stream_unary(path)
    elif method.server_streaming:
        fn = channel.unary_stream(path)
    else:
        fn = channel.unary_unary(path)
    request = iter([raw]) if method.client_streaming else raw
    try:
        answer = fn(request, timeout=TIMEOUT)
        if method.server_streaming:
            list(answer)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return OK, ""


def _fuzz_raw(target: Target, service: Any, method: Any, examples: int) -> int:
    """Sends `examples` malformed requests to one method; how many did not parse (and were checked)."""
    path = f"/{service.full_name}/{method.name}"
    request_type = GetMessageClass(method.input_type)
    sent = 0

    @settings(max_examples=examples, **_SETTINGS)  # type: ignore[arg-type]
    @given(raw=_raw_requests(request_type))
    def run(raw: bytes) -> None:
        nonlocal sent
        if _parses(request_type, raw):
            return  # random bytes that happen to be a valid request: the typed fuzzers cover those
        code, details = _raw_call(target.channel, path, method, raw)
        assert code is INVALID, f"{path} {raw[:20]!r}: {code.name} {details!r}"
        assert method.input_type.name in details, details
        sent += 1
        target.assert_serving()

    run()
    return sent


def _run_raw(cache: Target, meta: Target, examples: int) -> dict[str, int]:
    """Malformed requests to every method of every service (health and reflection too); how many each got."""
    targets = [(cache, CACHE_SERVICE), (meta, META_SERVICE), (meta, RAFT_SERVICE)]
    targets += [(target, service) for target in (cache, meta) for service in OPEN_SERVICES]
    return {
        f"{target.address}/{service.full_name}/{method.name}": _fuzz_raw(target, service, method, examples)
        for target, service in targets
        for method in service.methods
    }


def test_malformed_bytes_to_every_method(cache: Target, meta: Target) -> None:
    sent = _run_raw(cache, meta, EXAMPLES)
    assert all(sent.values()), sent


@pytest.mark.slow
def test_malformed_bytes_to_every_method_slow(cache: Target, meta: Target) -> None:
    sent = _run_raw(cache, meta, SLOW_EXAMPLES)
    assert all(sent.values()), sent
    for path, count in sent.items():
        print(f"malformed {path}: {count} requests")
    print(f"malformed requests: {sum(sent.values())} to {len(sent)} methods")


# -- targeted properties ---------------------------------------------------------------


def test_range_reads_of_a_written_object(cache: Target, written: Written) -> None:
    """Any range of an object reads back its bytes exactly; a range past its end is INVALID_ARGUMENT, by name."""
    stub = cache_pb2_grpc.CacheServiceStub(cache.channel)
    base = b"fuzz-range/" + uuid.uuid4().hex.encode()
    value = value_of(256, 7)
    assert call(stub.Put, cache_pb2.PutRequest(key=base, value=value))[0] is OK
    written.values[base] = value

    @settings(max_examples=EXAMPLES * 2, **_SETTINGS)  # type: ignore[arg-type]
    @given(start=st.integers(0, 300), length=st.integers(1, 300))
    def run(start: int, length: int) -> None:
        key = base + RANGE_MARK + f"{start}-{start + length - 1}".encode()
        got = call(stub.Get, cache_pb2.GetRequest(key=key))
        if start + length <= len(value):
            assert got[0] is OK and got[2].found and got[2].value == value[start : start + length], got[:2]
        elif start >= len(value):
            check_status(got, {INVALID}, f"range {start}+{length} of {len(value)} bytes")
        else:  # runs past the end: the bytes there are, or a refusal, never other bytes
            check_status(got, {OK, INVALID}, f"range {start}+{length} of {len(value)} bytes")
            if got[0] is OK:
                assert got[2].value == value[start:]
        cache.assert_serving()

    run()


def test_path_like_keys_are_distinct_objects(cache: Target, written: Written, tmp_path: Path) -> None:
    """Keys that a path normalizer would fold together stay apart through object storage."""
    stub = cache_pb2_grpc.CacheServiceStub(cache.channel)
    tag = uuid.uuid4().hex[:8].encode()
    names = [
        b"a/../b",
        b"b",
        b"./b",
        b"a/./b",
        b"a//b",
        b"a/b",
        b"../../etc/passwd",
        b"etc/passwd",
        b"a/b/..",
        b"a",
        b"a/b/c",
    ]
    keys_ = [tag + b"/" + n for n in names] + [n + b"/" + tag for n in names]
    for i, key in enumerate(keys_):
        got = call(stub.Put, cache_pb2.PutRequest(key=key, value=b"%d" % i))
        check_status(got, {OK}, f"Put {key!r}")
        written.values[key] = b"%d" % i
    for i, key in enumerate(keys_):
        check_status(call(stub.Evict, cache_pb2.EvictRequest(key=key)), {OK}, f"Evict {key!r}")
        got = call(stub.Get, cache_pb2.GetRequest(key=key))
        check_status(got, {OK}, f"Get {key!r} from S3")
        assert got[2].found and got[2].value == b"%d" % i, (key, got[2].value)
