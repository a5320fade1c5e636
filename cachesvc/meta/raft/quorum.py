"""Majority arithmetic: committed index and vote tallies over a voter set."""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping

__all__ = ["VoteResult", "committed_index", "majority", "vote_result"]


class VoteResult(enum.Enum):
    """Outcome of an election so far."""

    PENDING = "pending"
    WON = "won"
    LOST = "lost"


def majority(voters: Collection[int]) -> int:
    """How many voters make a quorum."""
    return len(voters) // 2 + 1


def committed_index(voters: Collection[int], match: Mapping[int, int]) -> int:
    """The highest index that a quorum of `voters` has (0 if there are no voters).

    Voters absent from `match` count as having nothing.
    """
    if not voters:
        return 0
    acked = sorted((match.get(v, 0) for v in voters), reverse=True)
    return acked[majority(voters) - 1]


def vote_result(voters: Collection[int], votes: Mapping[int, bool]) -> VoteResult:
    """WON once a quorum granted, LOST once a quorum can no longer grant."""
    granted = sum(1 for v in voters if votes.get(v) is True)
    missing = sum(1 for v in voters if v not in votes)
    q = majority(voters)
    if granted >= q:
        return VoteResult.WON
    if granted + missing >= q:
        return VoteResult.PENDING
    return VoteResult.LOST
