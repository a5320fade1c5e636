"""What keeps `cachesvc up`'s cluster running: restarts with a backoff, and requests from another shell.

`Supervisor` watches the processes `cachesvc up` started (cache servers,
metadata nodes): one that exits is reported on the console, with the end of
its log, and started again on its own state (its L2, its Raft directory)
after a backoff, 3 s doubling to 60 s and back to 3 s once it has run a
minute. A callback runs at once on each exit (`up` marks a cache server down
in the shard, so clients move its keys now instead of after its lease).

`request` and `Requests` carry a command from another shell to the running
`up` through files in its state directory (`STATE_DIR/requests/`): the
caller writes `ID.json`, the running `up` answers in `ID.reply.json`. A file
needs no port, and only the user who owns the state directory can write it.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["FIRST_BACKOFF", "Requests", "Supervisor", "request"]

FIRST_BACKOFF = 3.0
"""Seconds before the first restart: long enough to watch the cluster without the process."""
_MAX_BACKOFF = 60.0
_STEADY_SECONDS = 60.0


@dataclass
class _Watched:
    name: str
    what: str
    start: Callable[[], int]
    alive: Callable[[], bool]
    reap: Callable[[], int | None]
    tail: Callable[[], str]
    on_exit: Callable[[], object] | None
    started: float
    backoff: float = FIRST_BACKOFF
    restart_at: float | None = None


class Supervisor:
    """Restarts the watched processes that exit (see the module docstring); call `tend()` now and then.

    Args:
        say: prints one line for the user (the console).
    """

    def __init__(self, say: Callable[[str], None]) -> None:
        self._say = say
        self._watched: dict[str, _Watched] = {}

    def watch(
        self,
        name: str,
        what: str,
        *,
        start: Callable[[], int],
        alive: Callable[[], bool],
        reap: Callable[[], int | None],
        tail: Callable[[], str],
        on_exit: Callable[[], object] | None = None,
    ) -> None:
        """Watch a running process.

        Args:
            name: its name in cluster.json ("cache-1", "meta2").
            what: how the console names it ("cache server 127.0.0.1:7071").
            start: starts it again; returns the new pid.
            alive: whether it runs.
            reap: collects an exited process; returns its exit status.
            tail: the end of its log.
            on_exit: runs once when it has exited, before the backoff.
        """
        self._watched[name] = _Watched(name, what, start, alive, reap, tail, on_exit, time.monotonic())

    def forget(self, name: str) -> None:
        """Stop watching (it is being stopped on purpose)."""
        self._watched.pop(name, None)

    def tend(self) -> list[tuple[str, int]]:
        """Reports exits and restarts what is due; returns the (name, pid) of each process restarted."""
        restarted: list[tuple[str, int]] = []
        now = time.monotonic()
        for w in list(self._watched.values()):
            if w.restart_at is None:
                if w.alive():
                    if now - w.started > _STEADY_SECONDS:
                        w.backoff = FIRST_BACKOFF
                    continue
                code = w.reap()
                how = f"signal {-code}" if code is not None and code < 0 else f"status {code}"
                self._say(f"{w.what} ({w.name}) exited ({how}); restarting it in {w.backoff:.0f} s")
                tail = w.tail().strip()
                if tail:
                    self._say("  last log lines:\n" + "\n".join("    " + line for line in tail.splitlines()[-5:]))
                if w.on_exit is not None:
                    try:
                        w.on_exit()
                    except Exception as exc:  # a shard that is down too: the lease does the same, later
                        self._say(f"{w.what}: {exc}")
                w.restart_at = now + w.backoff
                w.backoff = min(w.backoff * 2, _MAX_BACKOFF)
            elif now >= w.restart_at:
                try:
                    pid = w.start()
                except (OSError, RuntimeError) as exc:
                    self._say(f"{w.what} ({w.name}) did not start again: {exc}; next try in {w.backoff:.0f} s")
                    w.restart_at = now + w.backoff
                    w.backoff = min(w.backoff * 2, _MAX_BACKOFF)
                    continue
                w.restart_at, w.started = None, now
                self._say(f"{w.what} ({w.name}) restarted (pid {pid})")
                restarted.append((w.name, pid))
        return restarted


def request(state_dir: Path, op: str, timeout: float, **arguments: Any) -> dict[str, Any]:
    """Asks the `cachesvc up` running on `state_dir` to do `op`; returns its reply.

    Raises:
        RuntimeError: no `cachesvc up` runs there, or it did not answer within `timeout`.
    """
    directory = state_dir / "requests"
    if not (state_dir / "cluster.json").exists() or not directory.is_dir():
        raise RuntimeError(f"no `cachesvc up` is running with --state-dir {state_dir}")
    ident = secrets.token_hex(8)
    ask, answer = directory / f"{ident}.json", directory / f"{ident}.reply.json"
    partial = directory / f".{ident}.tmp"
    partial.write_text(json.dumps({"op": op, **arguments}))
    partial.rename(ask)  # whole or not at all: the running `up` never reads half a request
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if answer.exists():
            reply: dict[str, Any] = json.loads(answer.read_text())
            answer.unlink()
            return reply
        time.sleep(0.2)
    ask.unlink(missing_ok=True)
    raise RuntimeError(f"the `cachesvc up` running with --state-dir {state_dir} did not answer in {timeout:.0f} s")


class Requests:
    """The running `up`'s side of `request`: the requests waiting in `STATE_DIR/requests/`."""

    def __init__(self, state_dir: Path) -> None:
        self.directory = state_dir / "requests"
        self.directory.mkdir(mode=0o700, exist_ok=True)
        for stale in self.directory.iterdir():  # from an `up` that ended before it answered
            stale.unlink()

    def pending(self) -> list[tuple[str, dict[str, Any]]]:
        """Each waiting request's id and body, oldest first."""
        found = []
        for path in sorted(self.directory.glob("*.json"), key=lambda p: p.stat().st_mtime):
            if path.name.endswith(".reply.json"):
                continue
            try:
                body = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            path.unlink()
            found.append((path.stem, body))
        return found

    def answer(self, ident: str, reply: dict[str, Any]) -> None:
        partial = self.directory / f".{ident}.reply.tmp"
        partial.write_text(json.dumps(reply))
        os.replace(partial, self.directory / f"{ident}.reply.json")
