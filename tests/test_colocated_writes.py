"""Co-located writes through a server's staging sessions (`cacheclient.staged`, `cachesvc.server.staging`),
and durable puts: real server processes.

What a user of a client on the server's machine notices: puts that never
cross gRPC (the client's counts, the server's counters), the same bytes and
the same errors as the gRPC path, a server that keeps serving whatever a
client hands it, nothing held after a writer is killed, and a durable put
that survives a kill of the server (or is refused at once when nothing on
the server can make it so).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import random
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
import xxhash

from cacheclient import CacheClient, CacheClientError
from cacheclient._batches import Gathered
from cacheclient.colocated import Colocated
from cacheclient.wire.staging import ANSWER, ITEM, MAGIC, REQUEST

from conftest import CacheServer, S3Server, router_of, running_cluster, wait_until

pytestmark = pytest.mark.timeout(120)

SHARED = {"CACHESVC_L1_SHARED": "true"}


def colocated(client: CacheClient) -> Colocated:
    transport = client.transport
    assert isinstance(transport, Colocated), transport
    assert transport.shared_l1(wait=True) is not None, "the arena was not mapped"
    return transport


def counters(client: CacheClient) -> dict[str, int]:
    return dict(client.stats()["counters"])


def test_puts_go_through_the_staging_area_and_read_back_bit_identical(cache_server: Any) -> None:
    server: CacheServer = cache_server("--l1-bytes", "256MiB", env=SHARED)
    rng = random.Random(7)
    values = {f"w/{i:04d}".encode(): rng.randbytes(rng.choice([0, 1, 100, 4096, 70_000])) for i in range(400)}
    values[b"w/big"] = rng.randbytes(40 << 20)  # over the first staging area: a larger session
    with server.client(colocated=None) as client, server.client(colocated=False) as remote:
        transport = colocated(client)
        client.put_many(values)
        written = sum(map(len, values.values())) + 20 * 5000
        for key in list(values)[:20]:
            values[key] = rng.randbytes(5000)
            client.put(key, values[key])  # overwrites, one at a time
        assert transport.counts["staged"] == len(values) + 20
        # Read over gRPC: what the server stored is what the client wrote.
        assert remote.get_many(list(values)) == list(values.values())
        got = counters(remote)
        assert got["staging_puts"] == len(values) + 20
        assert got["staging_put_bytes"] == written
        assert got["staging_sessions"] >= 1


def test_values_given_as_pieces_are_written_piece_by_piece_and_read_back_joined(
    cache_server: Any, tmp_path: Path
) -> None:
    # A KV block straight out of an engine's pages comes as pieces (`Gathered`): a co-located put writes them into
    # the staging area (small values) or into an L2 place (from `file_from`), never joined; gRPC joins them.
    args = ("--l1-bytes", "128MiB", "--l2-path", str(tmp_path / "l2"), "--l2-bytes", "256MiB")
    server: CacheServer = cache_server(*args, env=SHARED)
    rng = random.Random(3)

    class Unjoinable(Gathered):
        __slots__ = ()

        def __bytes__(self) -> bytes:
            raise AssertionError("a co-located put joined a value's pieces")

    def pieces(sizes: list[int], kind: type[Gathered] = Unjoinable) -> tuple[Gathered, bytes]:
        parts = [rng.randbytes(n) for n in sizes]
        return kind([memoryview(p) for p in parts]), b"".join(parts)

    small = {f"g/{i}".encode(): pieces([36 + i, 4096, 0, 16_384 * (i + 1)]) for i in range(6)}
    large = {f"g/large/{i}".encode(): pieces([1000] + [300_000] * 5 + [i + 1]) for i in range(2)}  # over 1 MiB
    with server.client(colocated=None) as client, server.client(colocated=False) as remote:
        transport = colocated(client)
        client.put_many([(key, value) for key, (value, _) in {**small, **large}.items()])
        assert transport.counts["staged"] == len(small) + len(large)
        assert counters(remote)["staging_placed_puts"] == len(large)
        assert remote.get_many(list(small) + list(large)) == [
            joined for _, joined in [*small.values(), *large.values()]
        ]
        over_grpc, joined = pieces([5, 70_000, 3], Gathered)
        remote.put(b"g/grpc", over_grpc)  # type: ignore[arg-type]
        assert client.get(b"g/grpc") == joined


def test_a_staged_put_fails_as_the_grpc_put_does_and_the_session_goes_on(cache_server: Any) -> None:
    server: CacheServer = cache_server("--l1-bytes", "16MiB", "--max-value-bytes", "1MiB", env=SHARED)
    with server.client(colocated=None) as client, server.client(colocated=False) as remote:
        transport = colocated(client)
        for bad_key, value in [(b"k" * 2000, b"v"), (b"ok", b"x" * (2 << 20))]:
            with pytest.raises(CacheClientError) as staged:
                client.put(bad_key, value)
            with pytest.raises(CacheClientError) as grpc_error:
                remote.put(bad_key, value)
            assert type(staged.value) is type(grpc_error.value)
            assert staged.value.code == grpc_error.value.code
        client.put(b"after", b"fine")
        assert remote.get(b"after") == b"fine"
        assert transport.counts["staged"] == 1


def _raw_session(
    path: str, token: str = "", *, sealed: bool = True, size: int = 1 << 20
) -> tuple[socket.socket, mmap.mmap, bytes]:
    """A staging session opened by hand: (socket, area, the server's first answer)."""
    fd = os.memfd_create("test-staging", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    area = mmap.mmap(fd, size)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    socket.send_fds(sock, [f"STAGE1 {token}\n".encode()], [fd])
    os.close(fd)
    return sock, area, sock.recv(4096)


def _request(sock: socket.socket, items: list[tuple[bytes, int, int, int]]) -> tuple[int, bytes]:
    parts = [REQUEST.pack(MAGIC, 0, len(items), 0, 0.0, 0.0)]
    for key, offset, length, checksum in items:
        parts += [ITEM.pack(len(key), offset, length, checksum), key]
    sock.sendall(b"".join(parts))
    status, message_bytes, trailing_bytes = ANSWER.unpack(sock.recv(ANSWER.size, socket.MSG_WAITALL))
    message = sock.recv(message_bytes, socket.MSG_WAITALL) if message_bytes else b""
    if trailing_bytes:
        sock.recv(trailing_bytes, socket.MSG_WAITALL)
    return status, message


def test_the_server_takes_nothing_a_client_may_change_or_lie_about(cache_server: Any) -> None:
    server: CacheServer = cache_server("--l1-bytes", "16MiB", "--token", "sekrit", env=SHARED)
    with server.client(colocated=False, token="sekrit") as remote:
        path = remote.info()["arena_socket"]
        # No token, or an area that could shrink under the server (SIGBUS): refused.
        sock, _, answer = _raw_session(path)
        assert answer.startswith(b"ERR") and b"token" in answer
        sock, _, answer = _raw_session(path, "sekrit", sealed=False)
        assert answer.startswith(b"ERR") and b"sealed" in answer
        sock, area, answer = _raw_session(path, "sekrit")
        assert answer.startswith(b"OK")
        area[0:5] = b"hello"
        # A checksum that does not match what the server copied: refused, nothing stored.
        status, message = _request(sock, [(b"lie", 0, 5, 12345)])
        assert status == 15 and b"checksum" in message  # DATA_LOSS, as a Put with a wrong checksum gets
        # Bytes outside the area: refused, and the session ends.
        status, message = _request(sock, [(b"out", (1 << 20) - 2, 5, xxhash.xxh3_64_intdigest(b"hello"))])
        assert status == 3 and b"outside" in message
        assert sock.recv(1) == b""
        # A correct request on a new session: stored.
        sock, area, answer = _raw_session(path, "sekrit")
        area[100:105] = b"hello"
        assert _request(sock, [(b"good", 100, 5, xxhash.xxh3_64_intdigest(b"hello"))]) == (0, b"")
        assert remote.get(b"good") == b"hello"
        assert remote.get(b"lie") is None and remote.get(b"out") is None
        assert counters(remote)["staging_refused"] == 1


_KILLED_WRITER = """
import os, sys, time
from cacheclient import CacheClient
client = CacheClient(sys.argv[1])
assert client.transport.shared_l1(wait=True) is not None
client.put(b"first", b"x" * 1000)
assert client.transport.counts["staged"] == 1, client.transport.counts
print("ready", flush=True)
while True:
    client.put(b"again", os.urandom(4 << 20))
"""


def test_a_writer_killed_mid_session_holds_nothing_on_the_server(cache_server: Any, tmp_path: Path) -> None:
    server: CacheServer = cache_server("--l1-bytes", "64MiB", env=SHARED)
    script = tmp_path / "writer.py"
    script.write_text(_KILLED_WRITER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    with server.client(colocated=False) as remote:
        for _ in range(3):
            writer = subprocess.Popen(
                [sys.executable, str(script), server.address], stdout=subprocess.PIPE, env=env, text=True
            )
            try:
                assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
                wait_until(lambda: counters(remote).get("staging_puts", 0) >= 3, 20.0, "the writer writing")
            finally:
                writer.send_signal(signal.SIGKILL)
                writer.wait(10)
            wait_until(
                lambda: counters(remote)["staging_sessions_open"] == 0, 10.0, "the killed writer's session closed"
            )
        assert remote.get(b"first") == b"x" * 1000
        assert len(remote.get(b"again") or b"") == 4 << 20  # a whole value, never a torn one


def test_writers_racing_readers_never_show_a_torn_value(cache_server: Any) -> None:
    """Two co-located writers overwrite the same keys with self-describing values while a co-located reader
    reads them from the arena: every value read is one that was written, whole."""
    server: CacheServer = cache_server("--l1-bytes", "8MiB", env=SHARED)
    keys = [f"race/{i}".encode() for i in range(32)]

    def value_of(key: bytes, writer: int, n: int) -> bytes:
        body = random.Random(hash((key, writer, n))).randbytes(random.Random(n).choice([10, 3000, 60_000]))
        head = f"{key.decode()}|{writer}|{n}|".encode()
        return head + body + xxhash.xxh3_64_digest(head + body)

    stop = threading.Event()
    errors: list[str] = []

    def write(writer: int) -> None:
        with server.client(colocated=None) as client:
            n = 0
            while not stop.is_set():
                client.put_many([(key, value_of(key, writer, n)) for key in keys[n % 4 :: 4]])
                n += 1

    with server.client(colocated=None) as reader:
        transport = colocated(reader)
        writers = [threading.Thread(target=write, args=(w,)) for w in (1, 2)]
        for thread in writers:
            thread.start()
        try:
            checked = 0
            while checked < 4000:
                for key, value in zip(keys, reader.get_many(keys), strict=True):
                    if value is None:
                        continue
                    checked += 1
                    if xxhash.xxh3_64_digest(value[:-8]) != value[-8:] or not value.startswith(key + b"|"):
                        errors.append(f"{key!r}: {len(value)} bytes, torn or another key's")
        finally:
            stop.set()
            for thread in writers:
                thread.join(30)
    assert not errors, errors[:5]
    assert transport.counts["arena"] > 0


def test_a_forked_child_writes_through_sessions_of_its_own(cache_server: Any) -> None:
    server: CacheServer = cache_server("--l1-bytes", "16MiB", env=SHARED)
    with server.client(colocated=None) as client, server.client(colocated=False) as remote:
        colocated(client)
        client.put(b"parent", b"p")
        pid = os.fork()
        if pid == 0:  # the child: a DataLoader worker's life
            code = 1
            try:
                client.put_many([(f"child/{i}".encode(), b"c" * i) for i in range(100)])
                code = 0 if client.transport.counts["staged"] == 101 else 2  # type: ignore[attr-defined]
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        client.put(b"parent-again", b"q")  # the parent's session still works
        assert remote.get_many([f"child/{i}".encode() for i in range(100)]) == [b"c" * i for i in range(100)]
        assert remote.get(b"parent-again") == b"q"
        assert counters(remote)["staging_sessions"] >= 2


def test_a_durable_put_survives_a_kill_of_a_server_without_object_storage(cache_server: Any, tmp_path: Path) -> None:
    l2 = tmp_path / "l2"
    args = ("--l1-bytes", "64MiB", "--l2-path", str(l2), "--l2-bytes", "256MiB")
    server: CacheServer = cache_server(*args, env=SHARED)
    with server.client(colocated=None) as client:
        colocated(client)
        client.put(b"kept", b"k" * 10_000, durable=True)
        client.put_many([(f"kept/{i}".encode(), bytes([i]) * 3000) for i in range(50)], durable=True)
        client.put(b"volatile", b"v" * 10_000)  # in memory only (no object storage, room in L1)
        with server.client(colocated=False) as remote:
            remote.put(b"kept-grpc", b"g" * 5_000_000, durable=True)  # and over gRPC (a PutStream)
            stats = remote.stats()
        # The durable values went to disk only (written there before each put returned): memory holds the one
        # volatile value, not a second copy of each durable one (a checkpoint would push the hot values out).
        assert stats["counters"]["durable_puts_to_disk"] == 52
        (l1,) = [t for t in stats["tiers"] if t["name"] == "l1"]
        assert 10_000 <= l1["used_bytes"] < 100_000, l1
    server.kill()
    restarted: CacheServer = cache_server(*args, env=SHARED)
    with restarted.client(colocated=False) as remote:
        assert remote.get(b"kept") == b"k" * 10_000
        assert remote.get_many([f"kept/{i}".encode() for i in range(50)]) == [bytes([i]) * 3000 for i in range(50)]
        assert remote.get(b"kept-grpc") == b"g" * 5_000_000
        assert remote.get(b"volatile") is None


def test_a_durable_put_is_refused_at_once_where_nothing_can_keep_it(cache_server: Any) -> None:
    server: CacheServer = cache_server("--l1-bytes", "16MiB", env=SHARED)
    for colocated_reads in (None, False):
        with server.client(colocated=colocated_reads) as client:
            if colocated_reads is None:
                colocated(client)
            with pytest.raises(CacheClientError) as refused:
                client.put(b"ckpt", b"x" * 100, durable=True)
            assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION and "(l2)" in str(refused.value)
            client.put(b"ckpt", b"x" * 100)  # not durable: taken
            assert client.get(b"ckpt") == b"x" * 100


def test_a_routing_client_writes_through_each_co_located_owner_s_staging_area(s3: S3Server, tmp_path: Path) -> None:
    with running_cluster(s3, tmp_path, "", [("16MiB", "32MiB")] * 2, meta_nodes=1) as cluster:
        values = {f"c/{i:03d}".encode(): os.urandom(2000 + i) for i in range(200)}
        with cluster.client() as client:
            router = router_of(client)

            def a_pass_staged() -> bool:  # each node's arena is mapped in the background at first use
                before = router.counters["staged"]
                client.put_many(values)
                return router.counters["staged"] - before == len(values)

            wait_until(a_pass_staged, 10.0, "every put through its owner's staging area")
            assert client.get_many(list(values)) == list(values.values())
        for node in cluster.servers:
            with node.client(colocated=False) as remote:
                assert counters(remote).get("staging_puts", 0) > 0  # both owners took some


def test_a_node_cut_off_from_the_shard_for_half_its_lease_takes_co_located_calls_over_grpc_only(
    s3: S3Server, tmp_path: Path
) -> None:
    # A partition does not cut the arena or the staging areas (they are local), so a node that may have lost
    # its keys (no heartbeat answered for half its 2 s lease) must stop answering them: its clients go over
    # gRPC, which routing by the shard's map redirects (tests/test_jepsen.py: without this, stale reads after
    # a cut). With the shard merely down, that gRPC is this node, and every call still works.
    with running_cluster(s3, tmp_path, "", [("16MiB", "32MiB")] * 2, meta_nodes=1) as cluster:
        values = {f"d/{i:03d}".encode(): os.urandom(1000 + i) for i in range(50)}
        with cluster.client() as client:
            router = router_of(client)

            def a_pass_staged() -> bool:  # the arena is mapped in the background at first use
                before = router.counters["staged"]
                client.put_many(values)
                return router.counters["staged"] - before == len(values)

            wait_until(a_pass_staged, 10.0, "every put through the staging area")
            before = router.counters["arena"]
            assert client.get_many(list(values)) == list(values.values())
            assert router.counters["arena"] - before == len(values)  # read from the shared L1
            cluster.shard.stop()
            in_doubt = lambda: all("half the lease" in server.log() for server in cluster.servers)  # noqa: E731
            wait_until(in_doubt, 10.0, "both nodes in doubt of their leases")
            staged, arena = router.counters["staged"], router.counters["arena"]
            changed = {key: os.urandom(900) for key in values}
            client.put_many(changed)  # refused by the staging area, written over gRPC
            assert client.get_many(list(changed)) == list(changed.values())
            assert router.counters["staged"] == staged and router.counters["arena"] == arena


def test_closing_a_client_ends_its_write_sessions_and_a_used_client_opens_them_again(cache_server: Any) -> None:
    server: CacheServer = cache_server("--l1-bytes", "16MiB", env=SHARED)
    with server.client(colocated=False) as remote:
        client = server.client(colocated=None)
        colocated(client)
        client.put(b"a", b"1")
        assert counters(remote)["staging_sessions_open"] == 1
        client.close()
        wait_until(lambda: counters(remote)["staging_sessions_open"] == 0, 10.0, "the closed client's session ended")
        colocated(client)  # used again: mapped again
        client.put(b"b", b"2")
        assert remote.get_many([b"a", b"b"]) == [b"1", b"2"]
        assert counters(remote)["staging_puts"] == 2
        client.close()


def test_a_child_forked_while_the_arena_was_being_mapped_maps_it_itself(cache_server: Any) -> None:
    server: CacheServer = cache_server("--l1-bytes", "16MiB", env=SHARED)
    with server.client(colocated=None) as client, server.client(colocated=False) as remote:
        remote.put(b"k", b"v")
        transport = client.transport
        assert isinstance(transport, Colocated)
        transport._arena._mapping = True  # as when a fork lands while the parent's mapping thread runs
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                mapped = transport.shared_l1(wait=True) is not None
                code = 0 if mapped and client.get(b"k") == b"v" and transport.counts["arena"] == 1 else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
