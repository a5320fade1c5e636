"""`cachesvc serve --processes N`: one engine process per core, each a cluster node of its own.

A cache server is one Python process, and one process uses about one core
(the GIL). To use a machine's cores, `serve` with `processes = N > 1` starts
N child `cachesvc serve` processes and supervises them; it serves nothing
itself. Child i:

* listens on `listen`'s port + i (port 0: each picks a free one), and
  advertises `meta.advertise`'s port + i when one is set;
* registers in the metadata shard as a node of its own, so the placement
  gives it a share of the keys like any node (`cachectl nodes` lists the N
  of them under the machine's host); routing clients send each key to its
  owner process, co-located readers read every process's L2 file;
* has 1/N of `l1.bytes` and of `l2.bytes`, its L2 under `l2.path`/p<i>,
  its shared L1's socket (`l1.shared`) at `l1.socket`.p<i> when one is
  set (else its own default), and its metrics on `metrics_listen`'s port + i.

Children are started fresh (`python -m cachesvc`, not forked: gRPC and the
S3 client's runtime must not cross a fork) with the command line `serve`
was given plus the per-process flags, so they read the same config file and
environment. They get SIGTERM if the supervisor dies (`PR_SET_PDEATHSIG`).
SIGTERM or SIGINT to the supervisor stops every child gracefully (each
drains its write-back queue), then SIGKILL after `stop_grace` seconds.
A child that exits on its own is marked down in the metadata shard at once
(clients move its keys now, not when its lease runs out; its first heartbeat
after the restart brings it back) and restarted after a backoff (1 s doubling to
30 s, reset once it has run a minute); one that fails `MAX_QUICK_FAILURES`
times in a row within `QUICK_SECONDS` of its start (a port in use, a bad
disk) stops the whole server with its exit code.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from cacheclient.errors import CacheClientError
from cacheclient.meta import MetaClient
from cachesvc.config import ServerConfig

__all__ = ["child_flags", "run_processes"]

log = logging.getLogger(__name__)

QUICK_SECONDS = 10.0
"""A child that exits sooner than this after its start failed to start."""
MAX_QUICK_FAILURES = 3
"""Failed starts in a row of one child after which the server gives up."""
_MAX_BACKOFF = 30.0
_STEADY_SECONDS = 60.0
_PR_SET_PDEATHSIG = 1


def _plus(address: str, i: int) -> str:
    """HOST:PORT + i (port 0 stays 0: each process picks its own)."""
    host, _, port = address.rpartition(":")
    return f"{host}:{int(port) + i if int(port) else 0}"


def child_flags(cfg: ServerConfig, i: int, n: int) -> list[str]:
    """The `serve` flags that make process `i` of `n` out of `cfg`: its port, budget slice and L2 directory."""
    flags = ["--processes", "1", "--listen", _plus(cfg.listen, i), "--l1-bytes", str(cfg.l1.bytes // n)]
    flags += ["--l2-bytes", str(cfg.l2.bytes // n)]
    if cfg.l2.bytes:
        flags += ["--l2-path", str(Path(cfg.l2.path) / f"p{i}")]
    if cfg.l1.socket:  # each process's shared L1 has a socket of its own
        flags += ["--l1-socket", f"{cfg.l1.socket}.p{i}"]
    if cfg.metrics_listen:
        flags += ["--metrics-listen", _plus(cfg.metrics_listen, i)]
    if cfg.meta.advertise:
        flags += ["--advertise", _plus(cfg.meta.advertise, i)]
    return flags


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the supervisor dies, so no process outlives it unsupervised."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


@dataclass
class _Child:
    index: int
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    quick_failures: int = 0
    backoff: float = 1.0
    restart_at: float = 0.0

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        self.started = time.monotonic()
        log.info("engine process %d started (pid %d)", self.index, self.proc.pid)


def run_processes(cfg: ServerConfig, serve_argv: list[str], global_argv: list[str], stop_grace: float = 60.0) -> int:
    """Runs `cfg.process_count()` engine processes until SIGTERM/SIGINT; returns the exit status.

    Args:
        cfg: the loaded config (for the per-process flags).
        serve_argv: the flags `serve` was given (children get them, then their own).
        global_argv: the flags given before `serve` (logging).
        stop_grace: seconds each child gets to stop after SIGTERM before SIGKILL.
    """
    n = cfg.process_count()
    base = [sys.executable, "-m", "cachesvc", *global_argv, "serve", *serve_argv]
    children = [_Child(i, base + child_flags(cfg, i, n)) for i in range(n)]
    stop = threading.Event()
    shard = _shard_of(cfg)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        del frame
        log.info("signal %d: stopping %d engine processes", signum, n)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    status = 0
    try:
        log.info("cachesvc serving with %d engine processes from %s", n, cfg.listen)
        for child in children:
            child.start()
        while not stop.wait(0.2):
            failed = _tend(children, on_exit=None if shard is None else lambda child: _leave(shard, cfg, child))
            if failed is not None:
                status = failed
                break
    finally:
        _stop_all(children, stop_grace)
        for s, handler in previous.items():
            signal.signal(s, handler)
        if shard is not None:
            shard.close()
    return status


def _shard_of(cfg: ServerConfig) -> MetaClient | None:
    """A client of the shard the children register with (with the token they register with), or None."""
    addresses = [a.strip() for a in cfg.meta.addresses.split(",") if a.strip()]
    if not addresses:
        return None
    token = cfg.meta.token or cfg.security.admin_token or cfg.security.token
    return MetaClient(addresses, timeout=2.0, token=token or None, tls_ca=cfg.meta.tls_ca or None)


def _leave(shard: MetaClient, cfg: ServerConfig, child: _Child) -> None:
    """Marks an exited child down in the shard, as its graceful stop would have (unless drained: that stays)."""
    address = _plus(cfg.meta.advertise or cfg.listen, child.index)
    if address.endswith(":0"):
        return  # its port was its own pick: the lease will tell
    try:
        if {n.address: n.state for n in shard.nodes()}.get(address) in ("up", "joining"):
            shard.set_node_state(address, "down")
            log.info("engine process %d (%s) marked down in the metadata shard", child.index, address)
    except CacheClientError as exc:
        log.warning("could not mark engine process %d down (its lease will run out): %s", child.index, exc)


def _tend(children: list[_Child], on_exit: Callable[[_Child], None] | None = None) -> int | None:
    """Restarts exited children (after `on_exit` of each); returns an exit status when one keeps failing to start."""
    now = time.monotonic()
    for child in children:
        proc = child.proc
        if proc is None:
            if now >= child.restart_at:
                child.start()
            continue
        code = proc.poll()
        if code is None:
            if now - child.started > _STEADY_SECONDS:
                child.backoff, child.quick_failures = 1.0, 0
            continue
        ran = now - child.started
        if on_exit is not None:
            on_exit(child)
        child.quick_failures = child.quick_failures + 1 if ran < QUICK_SECONDS else 0
        if child.quick_failures >= MAX_QUICK_FAILURES:
            log.error(
                "engine process %d exited with %d %d times in a row within %.0f s of starting; stopping",
                child.index,
                code,
                child.quick_failures,
                QUICK_SECONDS,
            )
            return code or 1
        log.warning(
            "engine process %d exited with %d after %.1f s; restarting in %.0f s", child.index, code, ran, child.backoff
        )
        child.proc, child.restart_at = None, now + child.backoff
        child.backoff = min(child.backoff * 2, _MAX_BACKOFF)
    return None


def _stop_all(children: list[_Child], grace: float) -> None:
    running = [c.proc for c in children if c.proc is not None and c.proc.poll() is None]
    for proc in running:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in running:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("engine process pid %d did not stop within %.0f s; killing it", proc.pid, grace)
            proc.kill()
            proc.wait()
