"""The shared-memory L1 arena (`cachesvc.tiers.arena`) and its lock-free reader (`cacheclient.wire.arena`).

The tier's contract is in `tests/test_tier_contract.py`; here: what a reader
in another process may take, and that it never takes torn or stale bytes
while the one writer overwrites, deletes and shifts the same keys.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import random
import time
from multiprocessing.synchronize import Event

import numpy as np
import pytest
import xxhash

from cacheclient.wire.arena import ASK, ArenaView
from cachesvc.engine import Engine
from cachesvc.errors import TierFull
from cachesvc.policy import LRUPolicy
from cachesvc.tiers.arena import ArenaTier


def _view(tier: ArenaTier, clock: object = time.time) -> ArenaView:
    """A reader's view as a client maps it: the read-only descriptor, the writable hit counters."""
    fds = tier.descriptors()
    arena = mmap.mmap(fds.arena, fds.arena_bytes, prot=mmap.PROT_READ)
    hits = mmap.mmap(fds.hits, fds.hits_bytes)
    return ArenaView(memoryview(arena), memoryview(hits), clock=clock)  # type: ignore[arg-type]


def _put(tier: ArenaTier, key: bytes, value: bytes, **kwargs: object) -> None:
    tier.put(key, value, xxhash.xxh3_64_intdigest(value), **kwargs)  # type: ignore[arg-type]


def test_a_reader_gets_published_values_and_asks_for_the_rest() -> None:
    tier = ArenaTier(1 << 20)
    view = _view(tier)
    _put(tier, b"a", b"alpha" * 100)
    _put(tier, b"b", b"beta")
    assert view.get(b"a") == b"alpha" * 100
    assert view.get(b"b") == b"beta"
    assert view.get(b"c") is ASK
    _put(tier, b"a", b"newer")
    assert view.get(b"a") == b"newer"
    tier.delete(b"a")
    assert view.get(b"a") is ASK
    # The engine decides what is published: nothing it would not serve as it is.
    tier.publisher = lambda key: None if key == b"held-back" else 0.0
    _put(tier, b"held-back", b"x")
    assert view.get(b"held-back") is ASK
    assert tier.get(b"held-back") is not None  # the server still reads it (through its engine's checks)
    tier.conceal([b"b"])
    assert view.get(b"b") is ASK
    tier.reveal(b"b")
    assert view.get(b"b") == b"beta"
    tier.conceal_all()
    assert view.get(b"b") is ASK
    tier.reveal(b"b")
    assert view.get(b"b") == b"beta"
    tier.close()
    assert view.get(b"b") is ASK and not view.open


def test_a_lent_view_s_check_fails_once_its_bytes_may_have_been_reused() -> None:
    tier = ArenaTier(1 << 20)
    view = _view(tier)
    _put(tier, b"a", b"A" * 5000)
    lent = view.lend(b"a")
    assert isinstance(lent, tuple)
    data, check = lent
    assert bytes(data) == b"A" * 5000 and check()  # nothing changed: what was copied is the value
    # The value is overwritten and another takes the bytes it had: the view now shows those.
    _put(tier, b"a", b"newer")
    _put(tier, b"b", b"B" * 5000)
    assert bytes(data) != b"A" * 5000
    assert not check()
    # A deleted value's check fails as well, and an unpublished key is not lent.
    lent = view.lend(b"b")
    assert isinstance(lent, tuple)
    tier.delete(b"b")
    assert not lent[1]()
    assert view.lend(b"b") is ASK
    tier.close()


def test_a_value_past_its_serve_until_time_is_asked_for() -> None:
    now = [1000.0]
    tier = ArenaTier(1 << 20)
    tier.publisher = lambda key: 1010.0
    view = _view(tier, clock=lambda: now[0])
    _put(tier, b"ttl", b"v")
    assert view.get(b"ttl") == b"v"
    now[0] = 1010.0
    assert view.get(b"ttl") is ASK
    tier.close()


def test_the_read_only_descriptor_cannot_write_the_arena() -> None:
    tier = ArenaTier(1 << 20)
    fds = tier.descriptors()
    with pytest.raises(PermissionError):
        mmap.mmap(fds.arena, fds.arena_bytes)  # a writable mapping of it
    tier.close()


def test_a_value_a_get_answered_is_taken_only_as_answered_and_not_counted_again() -> None:
    # A co-located Get of a value too large for its answer takes it from the arena by the answer's checksum.
    tier = ArenaTier(1 << 20)
    view = _view(tier)
    old, new = b"o" * 5000, b"n" * 5000
    _put(tier, b"k", old)
    assert view.get_answered(b"k", xxhash.xxh3_64_intdigest(old)) == old
    _put(tier, b"k", new)  # overwritten after the Get answered: not the value it answered
    assert view.get_answered(b"k", xxhash.xxh3_64_intdigest(old)) is ASK
    assert view.get_answered(b"absent", 0) is ASK
    assert tier.take_hits() == []  # the server counted the Get already
    tier.close()


def test_hits_of_readers_reach_the_server() -> None:
    tier = ArenaTier(1 << 20)
    view = _view(tier)
    for key in (b"x", b"y", b"z"):
        _put(tier, key, key * 10)
    assert tier.take_hits() == []
    view.get(b"x")
    view.get(b"z")
    view.get(b"z")
    assert sorted(tier.take_hits()) == [b"x", b"z"]
    assert tier.take_hits() == []
    tier.close()


def _bump_hits(fd: int, size: int, stop: Event) -> None:
    """A reader process's share of the counters: bumps every one, over and over, until `stop` is set."""
    hits = np.frombuffer(mmap.mmap(fd, size), dtype=np.uint32)
    while not stop.is_set():
        hits[::2] += 1
        hits[1::2] += 1


def test_the_hit_sweep_holds_while_readers_bump_the_counters() -> None:
    # Readers count hits in shared memory while the server sweeps them: the sweep must see one snapshot
    # (a count of the nonzero counters taken twice disagreed, and the sweep raised).
    tier = ArenaTier(64 << 20)
    for key in (b"x", b"y", b"z"):
        _put(tier, key, key * 10)
    fds = tier.descriptors()
    context = multiprocessing.get_context("fork")
    stop = context.Event()
    reader = context.Process(target=_bump_hits, args=(fds.hits, fds.hits_bytes, stop), daemon=True)
    reader.start()
    try:
        seen: set[bytes] = set()
        sweeps = 0
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            seen.update(tier.take_hits())
            sweeps += 1
        assert seen == {b"x", b"y", b"z"}, f"after {sweeps} sweeps"
    finally:
        stop.set()
        reader.join(10.0)
        tier.close()


def test_random_puts_and_deletes_keep_every_key_readable_and_the_space_whole() -> None:
    # Deletions shift later entries of a probe back; a model dict says what must be there.
    rng = random.Random(7)
    tier = ArenaTier(1 << 20)
    view = _view(tier)
    model: dict[bytes, bytes] = {}
    for step in range(6000):
        key = b"k%d" % rng.randrange(400)
        if rng.random() < 0.35:
            assert tier.delete(key) == (key in model)
            model.pop(key, None)
        else:
            value = rng.randbytes(rng.choice([1, 60, 700, 3000]))
            try:
                _put(tier, key, value)
            except TierFull:
                continue
            model[key] = value
        if step % 500 == 0:
            for k, v in model.items():
                assert view.get(k) == v
    for k, v in model.items():
        assert view.get(k) == v and tier.get(k).value == v  # type: ignore[union-attr]
    for k in list(model):
        tier.delete(k)
    assert tier.used_bytes == 0
    # Every record's bytes came back, merged into the one extent the data region started as.
    assert tier._space.free_bytes == view.header.data_bytes and len(tier._space._by_start) == 1
    tier.close()


def test_the_budget_and_the_index_bound_what_fits() -> None:
    tier = ArenaTier(64 << 10)
    assert tier.cost(b"k", 1) >= 64  # at least the arena over its usable slots
    put = 0
    with pytest.raises(TierFull):
        for i in range(100_000):
            _put(tier, b"%d" % i, b"v")
            put += 1
    assert put * tier.cost(b"0", 1) <= 64 << 10
    tier.close()


def _reader(
    fd_path: str, hits_path: str, arena_bytes: int, hits_bytes: int, keys: int, seconds: float, out: object
) -> None:
    arena_fd = os.open(fd_path, os.O_RDONLY)
    hits_fd = os.open(hits_path, os.O_RDWR)
    arena = mmap.mmap(arena_fd, arena_bytes, prot=mmap.PROT_READ)
    hits = mmap.mmap(hits_fd, hits_bytes)
    view = ArenaView(memoryview(arena), memoryview(hits))
    got = asked = wrong = 0
    stop = time.monotonic() + seconds
    rng = random.Random(os.getpid())
    while time.monotonic() < stop:
        key = b"race/%d" % rng.randrange(keys)
        value = view.get(key)
        if value is ASK:
            asked += 1
            continue
        assert isinstance(value, bytes)
        # Every value the writer ever put for a key is the key's name, a generation, and filler derived from both.
        name, _, rest = value.partition(b"|")
        generation, _, filler = rest.partition(b"|")
        if name != key or filler != _filler(key, int(generation)):
            wrong += 1
        got += 1
    out.put((got, asked, wrong))  # type: ignore[attr-defined]


def _filler(key: bytes, generation: int) -> bytes:
    size = 64 + (generation * 977) % 6000
    return (key + b"#%d#" % generation) * (size // (len(key) + 8) + 1)


def test_readers_in_other_processes_never_take_torn_or_reused_bytes() -> None:
    # The writer rewrites, deletes and re-puts a few hundred keys as fast as it can, in a small arena that
    # keeps reusing freed space; two reader processes read the same keys through their own mappings.
    tier = ArenaTier(1 << 20)
    fds = tier.descriptors()
    keys = 200
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    readers = [
        ctx.Process(
            target=_reader,
            args=(
                f"/proc/{os.getpid()}/fd/{fds.arena}",
                f"/proc/{os.getpid()}/fd/{fds.hits}",
                fds.arena_bytes,
                fds.hits_bytes,
                keys,
                6.0,
                out,
            ),
        )
        for _ in range(2)
    ]
    for reader in readers:
        reader.start()
    rng = random.Random(3)
    generation = 0
    writes = 0
    stop = time.monotonic() + 7.0
    while time.monotonic() < stop:
        key = b"race/%d" % rng.randrange(keys)
        if rng.random() < 0.2:
            tier.delete(key)
            continue
        generation += 1
        value = key + b"|%d|" % generation + _filler(key, generation)
        try:
            _put(tier, key, value)
        except TierFull:
            for victim in list(tier._entries)[:20]:
                tier.delete(victim)
        writes += 1
    results = [out.get(timeout=30) for _ in readers]
    for reader in readers:
        reader.join(10)
    tier.close()
    got = sum(r[0] for r in results)
    wrong = sum(r[2] for r in results)
    assert wrong == 0, f"{wrong} of {got} reads returned bytes of another value"
    assert got > 1000 and writes > 1000, (got, writes, results)


def test_a_fence_hold_keeps_every_key_of_the_arena_from_readers_until_it_ends() -> None:
    # A node a peer fenced with a map it has not followed (`Engine.hold_direct_reads`): what it published is
    # concealed, and a read it serves meanwhile does not publish the key again until the hold ends.
    tier = ArenaTier(1 << 20)
    engine = Engine(l1=tier, l2=None, l3=None, policy_factory=lambda _: LRUPolicy())
    view = _view(tier)
    engine.put(b"k", b"value" * 10)
    assert engine.get(b"k") is not None
    assert view.get(b"k") == b"value" * 10
    engine.hold_direct_reads(True)
    assert view.get(b"k") is ASK
    assert engine.get(b"k") is not None  # served through the engine, not published
    assert view.get(b"k") is ASK
    engine.hold_direct_reads(False)
    assert engine.get(b"k") is not None  # served again: published again
    assert view.get(b"k") == b"value" * 10
    engine.close()
