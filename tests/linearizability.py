"""Linearizability checking of client histories (Porcupine's algorithm).

A history is a list of completed (or never-answered) operations with call and
return times. `check_operations` decides whether some total order of them,
consistent with real time, is a legal run of a sequential model. It uses the
Wing & Gong depth-first search with Lowe's memoisation of (linearized set, model
state), as Porcupine does, and first splits the history by key so that each key
is searched alone (linearizability is compositional).

An operation whose reply never came (a write that timed out) has return time
`math.inf`: it may take effect at any point after its call, or never observably.
A read that never returned constrains nothing; leave it out of the history.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = [
    "CheckResult",
    "KvInput",
    "Model",
    "Operation",
    "check_operations",
    "kv_model",
]

S = TypeVar("S", bound=Hashable)


@dataclass(frozen=True, slots=True)
class Operation:
    """One client operation as observed from outside.

    Attributes:
        client_id: Which client issued it (for error messages only).
        input: What was asked (model specific; `KvInput` for `kv_model`).
        call: When the request was sent.
        output: What came back (model specific; the value for a KV read).
        return_time: When the reply arrived; `math.inf` if it never did.
    """

    client_id: int
    input: Any
    call: float
    output: Any
    return_time: float


@dataclass(frozen=True, slots=True)
class Model(Generic[S]):
    """A sequential specification.

    Attributes:
        init: The initial state.
        step: ``step(state, input, output) -> (legal, next_state)``.
        partition: Splits a history into independent sub-histories (by key);
            None checks the history as one.
    """

    init: Callable[[], S]
    step: Callable[[S, Any, Any], tuple[bool, S]]
    partition: Callable[[Sequence[Operation]], list[list[Operation]]] | None = None


class CheckResult(enum.Enum):
    """Verdict of a check."""

    OK = "ok"
    ILLEGAL = "illegal"
    UNKNOWN = "unknown"
    """The search hit its step budget before deciding."""


@dataclass(frozen=True, slots=True)
class KvInput:
    """A key-value operation: a read ("get") or a blind write ("put").

    Attributes:
        op: "get" or "put".
        key: The key.
        value: The value written (ignored for "get").
    """

    op: str
    key: str
    value: str | None = None


def _kv_step(state: str | None, inp: KvInput, output: Any) -> tuple[bool, str | None]:
    if inp.op == "put":
        return True, inp.value
    return output == state, state


def _kv_partition(history: Sequence[Operation]) -> list[list[Operation]]:
    seen = {(op.input.key, op.output) for op in history if op.input.op == "get"}
    by_key: dict[str, list[Operation]] = {}
    for op in history:
        if op.input.op == "put" and op.return_time == math.inf and (op.input.key, op.input.value) not in seen:
            # An unanswered write whose value no read returned can always be placed
            # last, after everything else; it constrains nothing. Dropping it keeps
            # the search from trying every subset of such writes on illegal histories.
            continue
        by_key.setdefault(op.input.key, []).append(op)
    return list(by_key.values())


def kv_model() -> Model[Any]:
    """Registers keyed by name, all initially None; reads see the latest write.

    The history is split by key. Unanswered writes whose value no read saw are
    left out of the search (see `_kv_partition`); that never changes the verdict.
    """
    return Model(init=lambda: None, step=_kv_step, partition=_kv_partition)


class _Node:
    """One call or return event in the doubly linked event list."""

    __slots__ = ("id", "is_call", "match", "next", "prev", "value")

    def __init__(self, op_id: int, is_call: bool, value: Any) -> None:
        self.id = op_id
        self.is_call = is_call
        self.value = value
        self.match: _Node | None = None
        self.prev: _Node | None = None
        self.next: _Node | None = None


def _build_list(ops: Sequence[Operation]) -> _Node:
    events: list[tuple[float, int, int, bool]] = []
    for i, op in enumerate(ops):
        # At equal times calls sort before returns: such operations overlap.
        events.append((op.call, 0, i, True))
        events.append((op.return_time, 1, i, False))
    events.sort()
    head = _Node(-1, False, None)
    prev = head
    calls: dict[int, _Node] = {}
    for _, _, i, is_call in events:
        node = _Node(i, is_call, ops[i].input if is_call else ops[i].output)
        if is_call:
            calls[i] = node
        else:
            calls[i].match = node
        prev.next = node
        node.prev = prev
        prev = node
    return head


def _lift(call: _Node) -> None:
    assert call.prev is not None and call.match is not None and call.match.prev is not None
    call.prev.next = call.next
    if call.next is not None:
        call.next.prev = call.prev
    ret = call.match
    ret.prev.next = ret.next  # type: ignore[union-attr]
    if ret.next is not None:
        ret.next.prev = ret.prev


def _unlift(call: _Node) -> None:
    ret = call.match
    assert ret is not None and ret.prev is not None and call.prev is not None
    ret.prev.next = ret
    if ret.next is not None:
        ret.next.prev = ret
    call.prev.next = call
    if call.next is not None:
        call.next.prev = call


def _check_single(model: Model[Any], ops: Sequence[Operation], budget: list[int]) -> CheckResult:
    head = _build_list(ops)
    state = model.init()
    linearized = 0
    cache: set[tuple[int, Any]] = set()
    stack: list[tuple[_Node, Any]] = []
    entry = head.next
    while head.next is not None:
        budget[0] -= 1
        if budget[0] < 0:
            return CheckResult.UNKNOWN
        assert entry is not None
        if entry.is_call:
            assert entry.match is not None
            legal, new_state = model.step(state, entry.value, entry.match.value)
            if legal:
                new_linearized = linearized | (1 << entry.id)
                key = (new_linearized, new_state)
                if key not in cache:
                    cache.add(key)
                    stack.append((entry, state))
                    state = new_state
                    linearized = new_linearized
                    _lift(entry)
                    entry = head.next
                    continue
            entry = entry.next
        else:
            # A return reached before its call was linearized: backtrack.
            if not stack:
                return CheckResult.ILLEGAL
            entry, state = stack.pop()
            linearized &= ~(1 << entry.id)
            _unlift(entry)
            entry = entry.next
    return CheckResult.OK


def check_operations(
    model: Model[Any], history: Sequence[Operation], max_steps: int = 10_000_000
) -> tuple[CheckResult, list[Operation]]:
    """Decide whether `history` is linearizable with respect to `model`.

    Args:
        model: The sequential specification.
        history: Operations; `return_time` may be `math.inf` for unanswered ones.
        max_steps: Search budget over all partitions; past it the result is UNKNOWN.

    Returns:
        The verdict, and for ILLEGAL the operations of the first partition
        (key) found not linearizable, for a failure message.
    """
    for op in history:
        if not op.return_time >= op.call:
            raise ValueError(f"operation returns before its call: {op}")
    parts = model.partition(history) if model.partition else [list(history)]
    budget = [max_steps]
    unknown = False
    for part in parts:
        result = _check_single(model, part, budget)
        if result is CheckResult.ILLEGAL:
            return result, part
        if result is CheckResult.UNKNOWN:
            unknown = True
            break
    return (CheckResult.UNKNOWN if unknown else CheckResult.OK), []
