"""`cacheclient.process_local`: what a forked child (a DataLoader worker) inherits, and what it never finalizes."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from cacheclient.process_local import FORK_WAIT_SECONDS, ProcessLocal, background_call


class _Cycle:
    """Garbage in a reference cycle whose finalizer writes to `fd` (as a finished gRPC call's takes a lock)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.me = self

    def __del__(self) -> None:
        os.write(self.fd, str(os.getpid()).encode() + b"\n")


def test_a_forked_child_never_finalizes_its_parent_s_garbage_and_makes_its_own_values() -> None:
    read, write = os.pipe()
    local = ProcessLocal(os.getpid)
    assert local.get() == os.getpid()
    enabled = gc.isenabled()
    gc.collect()
    _Cycle(write)  # garbage, not collected yet
    pid = os.fork()
    if pid == 0:  # the child: collects, and must not finalize the parent's cycle; makes its own value
        code = 0
        try:
            gc.collect()
            code = 0 if local.get() == os.getpid() and gc.isenabled() == enabled else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child did not make its own value, or left gc off"
    assert gc.isenabled() == enabled  # the parent's collector is as it was
    gc.collect()  # the parent collects its own garbage
    os.close(write)
    with os.fdopen(read) as finalized:
        pids = [int(line) for line in finalized.read().split()]
    assert pids == [os.getpid()], f"finalized in {pids}, parent {os.getpid()}, child {pid}"


def test_forks_from_several_threads_at_once_leave_the_collector_as_it_was() -> None:
    def fork_some() -> None:
        for _ in range(5):
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)

    assert gc.isenabled()
    threads = [threading.Thread(target=fork_some) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert gc.isenabled(), "overlapping forks left the parent's collector off"


def _fork_and_reap(child: Callable[[], int] = lambda: 0) -> tuple[float, int]:
    """Forks; the child runs `child` and exits with its code. When the fork returned here, and that code."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = child()
        finally:
            os._exit(code)
    forked = time.monotonic()
    _, status = os.waitpid(pid, 0)
    return forked, os.waitstatus_to_exitcode(status)


def test_a_fork_waits_for_a_background_call_under_way_and_the_child_starts_with_none() -> None:
    # A background thread's gRPC call (an arena's mapping, a map refresh, a KV index round) under way at a
    # fork can hang the child: the fork waits for it.
    started, ended = threading.Event(), []

    def call() -> None:
        with background_call():
            started.set()
            time.sleep(0.3)
            ended.append(time.monotonic())

    thread = threading.Thread(target=call)
    thread.start()
    assert started.wait(5.0)

    def child() -> int:
        began = time.monotonic()  # nothing under way here: a fork of the child's does not wait
        with background_call():
            pass
        _fork_and_reap()
        return 0 if time.monotonic() - began < FORK_WAIT_SECONDS else 2

    forked, code = _fork_and_reap(child)
    thread.join()
    assert ended and ended[0] <= forked, "the fork did not wait for the call under way"
    assert code == 0


def test_a_fork_waits_for_a_background_call_no_longer_than_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("cacheclient.process_local.FORK_WAIT_SECONDS", 0.2)
    release = threading.Event()

    def stuck() -> None:
        with background_call():
            release.wait(30.0)

    thread = threading.Thread(target=stuck)
    thread.start()
    try:
        began = time.monotonic()
        forked, code = _fork_and_reap()
        assert code == 0
        assert 0.2 <= forked - began < 10.0, f"the fork waited {forked - began:.2f} s for a call stuck under way"
    finally:
        release.set()
        thread.join()


_CLOSE_THE_LAST_CLIENT = r"""
import gc, sys, time
from cacheclient import CacheClient

with CacheClient(sys.argv[1]) as client:  # this process's only client
    assert client.get(b"k") == b"v"
gc.collect()  # its channel's last references, collected
time.sleep(1.0)  # gRPC's teardown, if it starts, logs within milliseconds
print("closed", flush=True)
"""


def test_closing_a_process_s_last_client_leaves_grpc_initialised(cache_server: Any) -> None:
    # gRPC tears its library down on a thread of its own when a process closes its last channel, holding
    # its init lock meanwhile; a DataLoader worker forked in that window waited on that lock forever
    # making its first channel. Bare channels reproduced it in 7 of 1,800 forks right after a close, with
    # the stack the worker had, frame for frame; with one reference kept, in none of 1,600. Here: the
    # teardown never starts (gRPC's own trace of its API calls says when it does).
    server = cache_server("--l1-bytes", "8MiB")
    with server.client() as client:
        client.put(b"k", b"v")
    env = {**os.environ, "GRPC_TRACE": "api", "GRPC_VERBOSITY": "debug", "GRPC_PYTHON_DISABLE_ABSL_INIT_LOG": "1"}
    run = subprocess.run(
        [sys.executable, "-c", _CLOSE_THE_LAST_CLIENT, server.address],
        capture_output=True, text=True, timeout=120, check=False, env=env,
    )  # fmt: skip
    assert run.returncode == 0 and run.stdout == "closed\n", run.stderr[-2000:]
    api = [line for line in run.stderr.splitlines() if "grpc_init" in line or "grpc_shutdown" in line]
    assert any("grpc_init(void)" in line for line in api), "gRPC's trace is not on: nothing is checked"
    assert not [line for line in api if "clean-up" in line or "cleanup" in line], api
