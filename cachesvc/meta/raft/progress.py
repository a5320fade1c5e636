"""The leader's view of one follower's log: what it has and what to send it next."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Progress", "ProgressState"]


class ProgressState(enum.Enum):
    """How the leader replicates to a follower."""

    PROBE = "probe"
    """Next is a guess: one APPEND at a time until the follower accepts one."""
    REPLICATE = "replicate"
    """Follower is in step: stream entries optimistically."""
    SNAPSHOT = "snapshot"
    """A snapshot is on its way; send nothing else until it lands."""


@dataclass(slots=True)
class Progress:
    """Replication state of one follower.

    Attributes:
        match: Highest index known to be in the follower's log.
        next: Next index to send.
        state: Probe, replicate or snapshot.
        probe_sent: In PROBE, an APPEND is outstanding (paused until a reply or heartbeat).
        pending_snapshot: In SNAPSHOT, the index of the snapshot sent.
        snapshot_heartbeats: Heartbeat replies seen while in SNAPSHOT; after a few the
            snapshot is presumed lost and is sent again.
        recent_active: Heard from since the last check-quorum round.
    """

    match: int = 0
    next: int = 1
    state: ProgressState = ProgressState.PROBE
    probe_sent: bool = False
    pending_snapshot: int = 0
    snapshot_heartbeats: int = 0
    recent_active: bool = False

    # Bound on un-acknowledged entries in flight, so a slow follower is not flooded.
    MAX_INFLIGHT = 512

    def become_probe(self) -> None:
        """Fall back to probing from just after `match` (or after the snapshot sent)."""
        if self.state is ProgressState.SNAPSHOT:
            self.next = max(self.match + 1, self.pending_snapshot + 1)
        else:
            self.next = self.match + 1
        self.state = ProgressState.PROBE
        self.probe_sent = False
        self.pending_snapshot = 0

    def become_replicate(self) -> None:
        """Stream entries from just after `match`."""
        self.state = ProgressState.REPLICATE
        self.next = self.match + 1
        self.probe_sent = False

    def become_snapshot(self, index: int) -> None:
        """A snapshot at `index` was sent."""
        self.state = ProgressState.SNAPSHOT
        self.pending_snapshot = index
        self.snapshot_heartbeats = 0

    def maybe_update(self, index: int) -> bool:
        """The follower has everything up to `index`; False if that is old news."""
        updated = False
        if self.match < index:
            self.match = index
            updated = True
            self.probe_sent = False
        self.next = max(self.next, index + 1)
        return updated

    def maybe_decr_to(self, rejected: int, match_hint: int) -> bool:
        """The follower rejected an APPEND at `rejected`; back `next` off.

        Returns False when the rejection is stale (a reply to an APPEND from
        before a later change of `next`), which must be ignored.
        """
        if self.state is ProgressState.REPLICATE:
            if rejected <= self.match:
                return False
            self.next = self.match + 1
            return True
        if self.next - 1 != rejected:
            return False
        self.next = max(min(rejected, match_hint + 1), self.match + 1, 1)
        self.probe_sent = False
        return True

    def is_paused(self) -> bool:
        """Whether the leader should hold back APPENDs to this follower."""
        if self.state is ProgressState.PROBE:
            return self.probe_sent
        if self.state is ProgressState.SNAPSHOT:
            return True
        return self.next - 1 - self.match >= self.MAX_INFLIGHT
