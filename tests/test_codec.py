"""The wire codec (hand encoding, chunking, stream assembly) and the server's hand-off table, in process."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from cacheclient.wire import cache_pb2 as pb
from cacheclient.wire import codec
from cacheclient.wire.limits import CHUNK_BYTES
from cachesvc.server.handoff import Handoffs


@pytest.mark.parametrize("size", [0, 1, 4096, 3 << 20])
def test_hand_encoded_get_response_is_the_protobuf_message(size: int) -> None:
    value = os.urandom(size)
    header = pb.GetResponse(found=True, size=size, checksum=12345, tier=pb.TIER_L2)
    expected = pb.GetResponse(found=True, size=size, checksum=12345, tier=pb.TIER_L2, value=value)
    assert pb.GetResponse.FromString(codec.get_response_bytes(header, value)) == expected


@pytest.mark.parametrize("sizes", [[0], [5], [3, 0, 70_000, 1], [1 << 20, 1 << 20]])
def test_hand_encoded_puts_are_the_protobuf_messages(sizes: list[int]) -> None:
    pieces = [os.urandom(n) for n in sizes]
    value = b"".join(pieces)
    fields = {"key": b"k/1", "checksum": 99, "lease_seconds": 2.5, "ttl_seconds": 0.0, "durable": True}
    views = [memoryview(p) for p in pieces]
    assert pb.PutRequest.FromString(codec.put_request_bytes(pb.PutRequest(**fields), views)) == pb.PutRequest(
        value=value, **fields
    )
    other = pb.PutRequest(key=b"k/2", checksum=0)
    request = codec.put_many_request_bytes([(pb.PutRequest(**fields), views), (other, [b"v", b""])])
    expected = pb.PutManyRequest(
        items=[pb.PutRequest(value=value, **fields), pb.PutRequest(key=b"k/2", value=b"v", checksum=0)]
    )
    assert pb.PutManyRequest.FromString(request) == expected


def _stream_of(values: list[bytes | None]) -> list[pb.Chunk]:
    chunks: list[pb.Chunk] = []
    for i, value in enumerate(values):
        key = b"k%d" % i
        if value is None:
            chunks.append(pb.Chunk(key=key, found=False))
        else:
            chunks.extend(codec.value_chunks(pb.Chunk(key=key, found=True, size=len(value), checksum=i), value))
    return chunks


def test_values_survive_chunking_and_assembly() -> None:
    values = [os.urandom(n) for n in (0, 1, CHUNK_BYTES, CHUNK_BYTES + 1, 3 * CHUNK_BYTES)]
    sent: list[bytes | None] = [values[0], None, values[1], values[2], None, values[3], values[4]]
    chunks = _stream_of(sent)
    assert all(len(c.data) <= CHUNK_BYTES for c in chunks)
    got = list(codec.stream_values(chunks))
    assert [head.key for head, _ in got] == [b"k%d" % i for i in range(len(sent))]
    assert [value for _, value in got] == sent


def test_a_stream_that_does_not_add_up_is_refused() -> None:
    value = os.urandom(2 * CHUNK_BYTES + 10)
    chunks = _stream_of([value])
    with pytest.raises(codec.StreamError, match="ended after"):
        list(codec.stream_values(chunks[:-1]))
    chunks[-1] = pb.Chunk(data=chunks[-1].data + b"x")
    with pytest.raises(codec.StreamError, match="more than the announced"):
        list(codec.stream_values(chunks))


class _Refused(Exception):
    pass


def _check_key(key: bytes) -> None:
    if not key:
        raise _Refused("empty key")


def _check_size(limit: int) -> Callable[[int], None]:
    def check(size: int) -> None:
        if size > limit:
            raise _Refused(f"{size} over {limit}")

    return check


def test_put_stream_assembly_checks_before_it_buffers() -> None:
    value = os.urandom(CHUNK_BYTES * 2 + 5)
    head = pb.Chunk(key=b"k", size=len(value), checksum=7, lease_seconds=30.0)
    put = codec.read_put_stream(codec.value_chunks(head, value), check_key=_check_key, check_size=_check_size(1 << 30))
    assert (put.key, put.value, put.checksum, put.lease, put.ttl) == (b"k", value, 7, 30.0, None)
    with pytest.raises(_Refused, match="empty key"):
        codec.read_put_stream(iter([]), check_key=_check_key, check_size=_check_size(1 << 30))
    with pytest.raises(_Refused, match="over 100"):  # the announced size
        codec.read_put_stream(iter([pb.Chunk(key=b"k", size=101)]), check_key=_check_key, check_size=_check_size(100))

    def liar() -> Iterator[pb.Chunk]:
        # Announces 10 bytes, then sends without end: refused at the first byte past the limit.
        yield pb.Chunk(key=b"k", size=10, data=b"0123456789")
        while True:
            yield pb.Chunk(data=b"x" * 64)

    with pytest.raises(_Refused, match="74 over 50"):
        codec.read_put_stream(liar(), check_key=_check_key, check_size=_check_size(50))
    with pytest.raises(codec.StreamError, match="more than the announced"):
        codec.read_put_stream(liar(), check_key=_check_key, check_size=_check_size(1 << 30))
    with pytest.raises(codec.StreamError, match="ended after 3 of the announced 10"):
        codec.read_put_stream(
            iter([pb.Chunk(key=b"k", size=10, data=b"abc")]), check_key=_check_key, check_size=_check_size(100)
        )


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_handoff_serves_each_held_value_once_until_it_expires() -> None:
    clock = _Clock()
    handoffs: Handoffs[str] = Handoffs(max_bytes=100, seconds=5.0, clock=clock)
    token = handoffs.hold([(b"a", "a1", 10), (b"b", "b", 10), (b"a", "a2", 10)])  # a key read twice holds two
    assert handoffs.take(token, [b"b", b"c"]) == ["b", None]  # c was never held: read it
    assert handoffs.take(token, [b"a", b"b", b"a"]) == ["a1", None, "a2"]  # each value once
    assert len(handoffs) == 0 and handoffs.held_bytes == 0  # all taken: the hand-off is gone
    late = handoffs.hold([(b"c", "c", 10)])
    clock.now = 5.0
    assert handoffs.take(late, [b"c"]) == [None]
    assert handoffs.take(b"never-issued", [b"c"]) == [None]
    assert handoffs.counters == {"handoffs": 2, "handoff_misses": 4, "handoffs_dropped": 0}
    assert len(handoffs) == 0 and handoffs.held_bytes == 0


def test_handoffs_stay_within_their_bytes_and_entries() -> None:
    handoffs: Handoffs[int] = Handoffs(max_bytes=100, seconds=60.0, max_entries=3, clock=_Clock())
    tokens = [handoffs.hold([(b"%d" % i, i, 40)]) for i in range(3)]  # the third drops the first
    assert handoffs.held_bytes == 80 and handoffs.take(tokens[0], [b"0"]) == [None]
    more = [handoffs.hold([(b"%d" % i, i, 1)]) for i in range(3, 5)]  # a fourth hand-off: the oldest goes
    assert len(handoffs) == 3 and handoffs.take(tokens[1], [b"1"]) == [None]
    assert handoffs.take(more[1], [b"4"]) == [4]
    huge = handoffs.hold([(b"huge", 99, 1000)])  # larger than the budget: held alone
    assert len(handoffs) == 1 and handoffs.take(huge, [b"huge"]) == [99]
    assert handoffs.counters["handoffs_dropped"] == 4


def _encoded_stream_of(values: list[bytes | None]) -> list[bytes]:
    messages: list[bytes] = []
    for i, value in enumerate(values):
        key = b"k%d" % i
        if value is None:
            messages.append(pb.Chunk(key=key, found=False).SerializeToString())
        else:
            head = pb.Chunk(key=key, found=True, size=len(value), checksum=i, tier=pb.TIER_L2)
            messages.extend(codec.encoded_value_chunks(head, value))
    return messages


def test_hand_encoded_chunks_are_the_protobuf_chunks() -> None:
    value = os.urandom(2 * CHUNK_BYTES + 7)
    for empty_or_not in (b"", value):
        head = pb.Chunk(key=b"k", found=True, size=len(empty_or_not), checksum=9, tier=pb.TIER_L1)
        encoded = [pb.Chunk.FromString(m) for m in codec.encoded_value_chunks(head, empty_or_not)]
        head = pb.Chunk(key=b"k", found=True, size=len(empty_or_not), checksum=9, tier=pb.TIER_L1)
        assert encoded == list(codec.value_chunks(head, empty_or_not))


def test_value_views_are_the_values_left_in_their_messages() -> None:
    values = [os.urandom(n) for n in (0, 1, CHUNK_BYTES, CHUNK_BYTES + 1, 3 * CHUNK_BYTES)]
    sent: list[bytes | None] = [values[0], None, values[1], values[2], None, values[3], values[4]]
    messages = _encoded_stream_of(sent)
    got = list(codec.stream_value_views(messages))
    assert [head.key for head, _ in got] == [b"k%d" % i for i in range(len(sent))]
    assert [None if pieces is None else b"".join(pieces) for _, pieces in got] == sent
    assert [head.tier for head, _ in got if head.found] == [pb.TIER_L2] * 5
    _, one = got[2]  # a value of one chunk: a view of the message it came in, not a copy
    assert one is not None and len(one) == 1 and one[0].obj is messages[2]
    with pytest.raises(codec.StreamError, match="ended after"):
        list(codec.stream_value_views(messages[:-1]))


def test_a_chunk_is_parsed_whatever_its_field_order() -> None:
    # protobuf writes fields by number: data (5) comes before tier (6) and the lease (7)
    chunk = pb.Chunk(key=b"k", size=3, checksum=1, found=True, data=b"abc", tier=pb.TIER_L3, lease_seconds=1.5)
    head, data = codec.parse_chunk(chunk.SerializeToString())
    assert bytes(data) == b"abc"
    assert head == pb.Chunk(key=b"k", size=3, checksum=1, found=True, tier=pb.TIER_L3, lease_seconds=1.5)
    message = chunk.SerializeToString()
    for bad in (message[:-1], message[: message.index(b"abc") + 1], b"\x80", b"\x0b"):  # cut short; a group
        with pytest.raises(codec.StreamError):
            codec.parse_chunk(bad)


def test_checksum_of_pieces_is_the_checksum_of_their_concatenation() -> None:
    from cacheclient.wire.record import checksum, checksum_of_pieces

    data = os.urandom(100_000)
    view = memoryview(data)
    assert checksum_of_pieces([view[:1], view[1:60_000], view[60_000:]]) == checksum(data)
    assert checksum_of_pieces([data]) == checksum(data)
