"""Hands the shared L1 arena's descriptors to co-located clients that may have them, over a Unix socket.

The arena is a memfd: it has no name any other process could open. A client
on this machine connects to the socket Info names (`arena_socket`) and sends
one line, `ARENA1 <token>\\n` (the token empty when the server has none); the
server answers `OK <arena bytes> <hits bytes> <boot>[ stage=0][ seg=...]...\\n`
with two descriptors (SCM_RIGHTS) per segment: the arena opened read-only and
the hit counters, or `ERR <why>\\n` and closes. A client must run as the
server's user (the socket's peer credentials) and present the data token (or
the admin token) when the server has one, as HDFS short-circuit reads hand
out their descriptors. The socket lives in a directory only this user can
enter.

A cluster node keeps one segment per tenant (`cachesvc.tiers.tenant_arenas`):
a tenant's token is granted its own segment alone, with `stage=0` (its
writes go over gRPC: staging sessions are the data token's); the data and
admin tokens get the main segment first, then one
`seg=<arena bytes>:<hits bytes>:<boot>:<prefix hex>,...` per tenant segment,
its descriptors in that order.

One thread accepts; each exchange has a deadline of `TIMEOUT` seconds and
at most `BACKLOG` connections wait, so a client that connects and says
nothing holds nothing.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from cachesvc.server.staging import StagingSessions
from cachesvc.tiers.arena import ArenaTier, Descriptors
from cachesvc.tiers.tenant_arenas import TenantArenas

__all__ = ["ArenaSocket", "default_socket_path", "remove_stale_sockets"]

log = logging.getLogger(__name__)

TIMEOUT = 2.0
BACKLOG = 64
SWEEP = 0.25
"""Seconds between two sweeps of the hits co-located clients counted (for L1's eviction policy and the
prefetcher's open plans), while the last one found none."""
BUSY_SWEEP = 0.05
"""The same while clients read."""
_MAX_LINE = 4096
_MAX_STALE = 1024
"""Sockets looked at per start by `remove_stale_sockets` (a bound on the work, not on what is removed over time)."""


def default_socket_path(name: str) -> Path:
    """Where a server process puts its socket, `l1-NAME.sock`: in $XDG_RUNTIME_DIR, else in a directory of
    this user's in the temporary directory (created mode 0700; refused when another user owns it or others
    may enter it)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        base = Path(runtime)
    else:
        base = Path(tempfile.gettempdir()) / f"cachesvc-{os.getuid()}"
        base.mkdir(mode=0o700, exist_ok=True)
        status = base.stat()
        if status.st_uid != os.getuid() or status.st_mode & 0o077:
            raise PermissionError(f"{base}: not a private directory of this user (owner {status.st_uid})")
    return base / f"l1-{name}.sock"


def remove_stale_sockets(directory: Path) -> int:
    """Removes the `l1-*.sock` files in `directory` that no process listens on; how many it removed.

    A server killed (SIGKILL, a crash) leaves its socket file behind, and the
    next one, with another pid, makes its own: without this, a machine whose
    servers restart keeps one file per restart. A socket is stale when a
    connect is refused: one that answers, or fails otherwise, is kept.
    """
    removed = 0
    for path in sorted(directory.glob("l1-*.sock"))[:_MAX_STALE]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(TIMEOUT)
            try:
                probe.connect(str(path))
            except ConnectionRefusedError:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed += 1
            except OSError:
                continue
    if removed:
        log.info("removed %d stale arena sockets from %s", removed, directory)
    return removed


class ArenaSocket:
    """The socket and its accepting thread (see the module docstring).

    Args:
        tier: the shared L1 whose descriptors are handed out (in segments on a cluster node: `TenantArenas`).
        path: the socket's path (replaced if a stale one is there).
        tokens: the tokens that grant the arena (the data and admin tokens); empty: none needed.
        sweep: called every `SWEEP` seconds from the thread, every `BUSY_SWEEP` while it finds hits (the
            engine's `note_direct_hits`, which returns how many).
    """

    def __init__(
        self,
        tier: ArenaTier | TenantArenas,
        path: Path,
        tokens: tuple[str, ...] = (),
        sweep: Callable[[], int] | None = None,
    ) -> None:
        self._tier = tier
        self._sweep = sweep
        self.path = path
        self._tokens = tuple(t.encode() for t in tokens if t)
        self._stop = threading.Event()
        # Bound under another name and renamed once it listens: a socket file
        # under its own name always answers (`remove_stale_sockets`, in another
        # server starting beside this one, removes only those that do not).
        fresh = path.with_name(path.name + ".new")
        for stale in (path, fresh):
            if stale.exists() or stale.is_symlink():
                stale.unlink()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self._listener.bind(str(fresh))
        finally:
            os.umask(old)
        self._listener.listen(BACKLOG)
        os.replace(fresh, path)
        self._listener.settimeout(SWEEP)
        self._thread = threading.Thread(target=self._run, name="arena-socket", daemon=True)
        self.handed = 0
        self.refused = 0
        self.staging: StagingSessions | None = None
        """Co-located writes, once the server can take them (`cachesvc.server.server.create_server`)."""

    def start(self) -> ArenaSocket:
        self._thread.start()
        return self

    def _run(self) -> None:
        next_sweep = time.monotonic() + SWEEP
        while not self._stop.is_set():
            if self._sweep is not None and time.monotonic() >= next_sweep:
                try:
                    found = self._sweep()
                except Exception:  # the hits of one sweep are lost; the next one goes on
                    log.exception("the sweep of co-located hits failed")
                    found = 0
                # While clients read, often (open plans follow their reads); idle, seldom.
                next_sweep = time.monotonic() + (BUSY_SWEEP if found else SWEEP)
            self._listener.settimeout(max(0.001, next_sweep - time.monotonic()) if self._sweep else SWEEP)
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                raise
            kept = False
            try:
                kept = self._answer(conn)
            except OSError as exc:
                log.info("a co-located client's arena request failed: %s", exc)
            finally:
                if not kept:
                    conn.close()

    def _answer(self, conn: socket.socket) -> bool:
        """Answers one connection's request; True when it became a staging session (kept open)."""
        conn.settimeout(TIMEOUT)
        pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        line = b""
        fds: list[int] = []
        try:
            while not line.endswith(b"\n") and len(line) < _MAX_LINE:
                chunk, received, _flags, _address = socket.recv_fds(conn, _MAX_LINE - len(line), 1)
                fds += received
                if not chunk:
                    return False
                line += chunk
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        verb, _, token = line.rstrip(b"\n").partition(b" ")
        staging = self.staging if verb == b"STAGE1" and len(fds) == 1 else None
        if staging is None:
            for fd in fds:
                os.close(fd)
        why = ""
        if verb not in (b"ARENA1", b"STAGE1"):
            why = "expected ARENA1 <token> or STAGE1 <token>"
        elif verb == b"STAGE1" and staging is None:
            why = "STAGE1 carries one descriptor, to a server that takes co-located writes"
        elif uid != os.getuid():
            why = f"process {pid} runs as user {uid}, the server as {os.getuid()}"
        own = not self._tokens or any(hmac.compare_digest(token, t) for t in self._tokens)
        granted: list[Descriptors] = []
        if not why and verb == b"ARENA1":
            granted = self._grant(None if own else token.decode(errors="replace"))
        if not why and not (own or granted):
            why = "the token is wrong or missing"
        if why:
            self.refused += 1
            log.warning("refused the shared L1 arena to process %d: %s", pid, why)
            if staging is not None:
                os.close(fds[0])
            conn.sendall(f"ERR {why}\n".encode())
            return False
        if staging is not None:
            why = staging.start(conn, fds[0])
            if why:
                conn.sendall(f"ERR {why}\n".encode())
            return not why
        home, extra = granted[0], granted[1:]
        words = [f"OK {home.arena_bytes} {home.hits_bytes} {home.boot}"]
        if not own:
            words.append("stage=0")
        words += [f"seg={d.arena_bytes}:{d.hits_bytes}:{d.boot}:{','.join(p.hex() for p in d.prefixes)}" for d in extra]
        socket.send_fds(conn, [(" ".join(words) + "\n").encode()], [fd for d in granted for fd in (d.arena, d.hits)])
        self.handed += 1
        return False

    def _grant(self, token: str | None) -> list[Descriptors]:
        """The segments a client may map: every one for None (the server's own tokens), a tenant's own for its
        token, none for any other."""
        if isinstance(self._tier, TenantArenas):
            return self._tier.grant(token)
        return [self._tier.descriptors()] if token is None else []

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        self._thread.join(timeout=5.0)
        if self.staging is not None:
            self.staging.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
