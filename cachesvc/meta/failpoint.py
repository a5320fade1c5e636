"""Crash points for tests: exit the process abruptly at a named point.

`CACHESVC_FAILPOINT` names the point, optionally with the hit that fires it
(``after-append:3`` exits on the third time the node gets there; the default
is the first). The node process then calls `os._exit` with `FAILPOINT_EXIT`:
no cleanup, no flush, as close to a power cut as a process can get without
losing what the kernel already holds.

Points (in `cachesvc.meta.node`): ``before-append`` / ``after-append`` around
persisting log entries, ``before-vote`` / ``after-vote`` around persisting a
vote, ``before-snapshot`` / ``after-snapshot`` around persisting a snapshot
(taken locally or received from the leader).
"""

from __future__ import annotations

import os
import sys

__all__ = ["FAILPOINT_ENV", "FAILPOINT_EXIT", "POINTS", "failpoint"]

FAILPOINT_ENV = "CACHESVC_FAILPOINT"
FAILPOINT_EXIT = 86
POINTS = frozenset({"before-append", "after-append", "before-vote", "after-vote", "before-snapshot", "after-snapshot"})


def _parse(spec: str) -> tuple[str, int] | None:
    if not spec:
        return None
    name, _, count = spec.partition(":")
    if name not in POINTS:
        raise ValueError(f"{FAILPOINT_ENV}={spec!r}: unknown point; one of {', '.join(sorted(POINTS))}")
    return name, int(count) if count else 1


_armed = _parse(os.environ.get(FAILPOINT_ENV, ""))
_hits = 0


def failpoint(name: str) -> None:
    """Exit the process now if `name` is the armed point and this is the chosen hit."""
    global _hits
    if _armed is None or _armed[0] != name:
        return
    _hits += 1
    if _hits >= _armed[1]:
        sys.stderr.write(f"failpoint {name} hit {_hits}: exiting\n")
        sys.stderr.flush()
        os._exit(FAILPOINT_EXIT)
