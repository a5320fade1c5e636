"""`WriteBackHolding`: what the metadata shard is told of the write-back values a node may hold, and when.

The shard is a recorded callable here (the integration is
`test_membership_consistency`'s withheld-keys test, with real processes).
"""

from __future__ import annotations

import threading

from cachesvc.server.holding import WriteBackHolding


class Shard:
    def __init__(self) -> None:
        self.told: list[bool] = []
        self.down = False

    def declare(self, holding: bool) -> None:
        if self.down:
            raise ConnectionError("no leader")
        self.told.append(holding)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_shard_is_told_once_before_the_first_value_and_once_when_all_are_uploaded_and_quiet() -> None:
    shard, clock, dirty = Shard(), Clock(), [0]
    gate = WriteBackHolding(shard.declare, lambda: dirty[0], quiet_seconds=10.0, clock=clock)
    for _ in range(3):
        assert gate.enter()
        dirty[0] += 1
        gate.leave()
    assert shard.told == [True]  # one shard write, not one per put
    gate.check()
    assert shard.told == [True]  # values not uploaded yet
    dirty[0] = 0
    gate.check()
    assert shard.told == [True]  # uploaded, but a put was acknowledged within the quiet time
    clock.now += 11.0
    gate.check()
    assert shard.told == [True, False] and gate.held is False
    assert gate.enter()
    assert shard.told == [True, False, True]
    clock.now += 60.0
    gate.check()
    assert shard.told == [True, False, True]  # a put between enter and leave keeps it held
    gate.leave()
    gate.check()
    assert shard.told == [True, False, True]  # quiet time again from its leave
    clock.now += 11.0
    gate.check()
    assert shard.told == [True, False, True, False]


def test_a_shard_that_cannot_be_told_turns_the_put_into_a_write_through() -> None:
    shard, clock = Shard(), Clock()
    gate = WriteBackHolding(shard.declare, lambda: 0, clock=clock)
    shard.down = True
    assert not gate.enter()
    shard.down = False
    assert gate.enter() and shard.told == [True]
    gate.leave()


def test_dirty_values_it_did_not_let_in_are_declared_and_a_rejoin_declares_again() -> None:
    shard, clock, dirty = Shard(), Clock(), [5]  # read back dirty from L2 after a restart
    gate = WriteBackHolding(shard.declare, lambda: dirty[0], clock=clock)
    gate.check()
    assert shard.told == [True]
    gate.forget()  # the shard was rebuilt from empty: it does not know
    assert gate.enter() and shard.told == [True, True]
    gate.leave()


def test_close_says_it_holds_none_once_everything_is_uploaded_without_waiting_the_quiet_time() -> None:
    shard, clock, dirty = Shard(), Clock(), [0]
    gate = WriteBackHolding(shard.declare, lambda: dirty[0], quiet_seconds=10.0, check_seconds=0.01, clock=clock)
    gate.start()
    assert gate.enter()
    gate.leave()
    gate.close()
    assert shard.told == [True, False]
    assert not any(t.name == "write-back-holding" for t in threading.enumerate())
