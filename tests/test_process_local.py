"""`cacheclient.process_local`: what a forked child (a DataLoader worker) inherits, and what it never finalizes."""

from __future__ import annotations

import gc
import os
import threading

from cacheclient.process_local import ProcessLocal


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
