"""Large values in L2: files of their own beside LMDB, written once in place by a co-located client
(`cachesvc.tiers.lmdb_tier`, `cachesvc.server.staging`, `cacheclient.staged`): real server processes.

What a user notices: a large put from the server's machine that the server
never copies (written in place, counted), the same bytes back over gRPC, from
the co-located L2 reader and after a kill of the server; a writer that keeps
its descriptor or is killed mid-write never gets anyone wrong bytes and leaves
nothing behind; the byte budget holds with files counted.
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
from pathlib import Path
from typing import Any

import pytest
import xxhash

from cacheclient import CacheClient, InvalidRequestError
from cacheclient.colocated import Colocated
from cacheclient.wire.record import FILE_VALUES_DIR
from cacheclient.wire.staging import ANSWER, FLAG_PLACED, ITEM, MAGIC, PLACE, PLACE_MAGIC, PLACE_SIZE, REQUEST

from conftest import CacheServer, s3_args, wait_until

pytestmark = pytest.mark.timeout(120)

SHARED = {"CACHESVC_L1_SHARED": "true"}
MiB = 1 << 20


def _l2_args(l2: Path, size: str = "256MiB") -> tuple[str, ...]:
    return ("--l1-bytes", "64MiB", "--l2-path", str(l2), "--l2-bytes", size)


def _colocated(client: CacheClient) -> Colocated:
    transport = client.transport
    assert isinstance(transport, Colocated), transport
    assert transport.shared_l1(wait=True) is not None, "the arena was not mapped"
    return transport


def _files(l2: Path) -> list[Path]:
    return sorted((l2 / FILE_VALUES_DIR).iterdir())


def _counters(client: CacheClient) -> dict[str, int]:
    return dict(client.stats()["counters"])


def test_a_large_co_located_put_is_written_once_in_place_and_survives_a_kill(cache_server: Any, tmp_path: Path) -> None:
    l2 = tmp_path / "l2"
    server: CacheServer = cache_server(*_l2_args(l2), env=SHARED)
    rng = random.Random(3)
    big = {f"ckpt/{i}".encode(): rng.randbytes(rng.choice([1 * MiB, 3 * MiB + 17, 8 * MiB])) for i in range(6)}
    small = {f"small/{i}".encode(): rng.randbytes(4000) for i in range(20)}
    with server.client(colocated=None) as client, server.client(colocated=False) as remote:
        _colocated(client)
        client.put_many({**big, **small}, durable=True)
        counters = _counters(remote)
        # Every large value went into a file the client wrote; the small ones through the staging area.
        assert counters["staging_placed_puts"] == len(big), counters
        assert counters["staging_puts"] == len(big) + len(small)
        assert len(_files(l2)) == len(big)
        assert sorted(f.stat().st_size for f in _files(l2)) == sorted(len(v) for v in big.values())
        assert remote.get_many(list(big)) == list(big.values())
        assert remote.get_many(list(small)) == list(small.values())
        big[b"ckpt/0"] = rng.randbytes(2 * MiB)
        client.put(b"ckpt/0", big[b"ckpt/0"], durable=True)  # an overwrite: the old file goes
        assert len(_files(l2)) == len(big)
    server.kill()
    restarted: CacheServer = cache_server(*_l2_args(l2), env=SHARED)
    with restarted.client(colocated=False) as remote:
        assert remote.get_many(list(big)) == list(big.values())
        assert remote.get_many(list(small)) == list(small.values())
        (tier,) = [t for t in remote.stats()["tiers"] if t["name"] == "l2"]
        on_disk = sum(f.stat().st_size for f in _files(l2))
        assert tier["used_bytes"] >= on_disk  # the files are counted in L2's bytes


def test_a_durable_put_syncs_its_files_and_index_and_a_plain_put_does_not(cache_server: Any, tmp_path: Path) -> None:
    # durable=True: the bytes and the index record on disk (each file fdatasynced, LMDB synced) before the put
    # returns, one sync per batch; durable=False: written, not synced (survives the process, not the machine).
    l2 = tmp_path / "l2"
    server: CacheServer = cache_server(*_l2_args(l2), env=SHARED)
    rng = random.Random(5)
    plain = {f"plain/{i}".encode(): rng.randbytes(2 * MiB) for i in range(3)}
    durable = {f"durable/{i}".encode(): rng.randbytes(2 * MiB + 5) for i in range(3)}
    remote_durable = {b"durable/grpc": rng.randbytes(3 * MiB)}
    with server.client(colocated=None) as client, server.client(colocated=False) as remote:
        _colocated(client)
        client.put_many(plain)
        counters = _counters(remote)
        assert counters["staging_placed_puts"] == len(plain), counters
        assert counters.get("l2_syncs", 0) == 0, counters
        client.put_many(durable, durable=True)  # written in place, one commit
        counters = _counters(remote)
        assert counters["staging_placed_puts"] == len(plain) + len(durable), counters
        assert counters["l2_syncs"] == 1 and counters["l2_synced_keys"] == len(durable), counters
        remote.put_many(remote_durable, durable=True)  # over gRPC: the server writes the file, and syncs it
        counters = _counters(remote)
        assert counters["l2_syncs"] == 2 and counters["l2_synced_keys"] == len(durable) + 1, counters
    server.kill()
    restarted: CacheServer = cache_server(*_l2_args(l2), env=SHARED)
    with restarted.client(colocated=False) as remote:
        everything = {**durable, **remote_durable}
        assert remote.get_many(list(everything)) == list(everything.values())


def _session(path: str) -> tuple[socket.socket, bytes]:
    fd = os.memfd_create("test-staging", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, MiB)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    socket.send_fds(sock, [b"STAGE1 \n"], [fd])
    os.close(fd)
    return sock, sock.recv(4096)


def _answer(sock: socket.socket) -> tuple[int, bytes, list[int]]:
    head, fds, _, _ = socket.recv_fds(sock, ANSWER.size, 1, socket.MSG_WAITALL)
    status, message_bytes, trailing_bytes = ANSWER.unpack(head)
    message = sock.recv(message_bytes, socket.MSG_WAITALL) if message_bytes else b""
    if trailing_bytes:
        sock.recv(trailing_bytes, socket.MSG_WAITALL)
    return status, message, fds


def _place(sock: socket.socket, size: int) -> tuple[int, int]:
    sock.sendall(PLACE.pack(PLACE_MAGIC, 1) + PLACE_SIZE.pack(size))
    status, message, fds = _answer(sock)
    assert status == 0 and len(fds) == 1, (status, message)
    return int(message), fds[0]


def _commit(sock: socket.socket, key: bytes, place: int, size: int, checksum: int) -> tuple[int, bytes]:
    sock.sendall(REQUEST.pack(MAGIC, FLAG_PLACED, 1, 0, 0.0, 0.0) + ITEM.pack(len(key), place, size, checksum) + key)
    status, message, _ = _answer(sock)
    return status, message


def test_a_writer_that_keeps_its_descriptor_never_gets_anyone_wrong_bytes(cache_server: Any, tmp_path: Path) -> None:
    l2 = tmp_path / "l2"
    server: CacheServer = cache_server(*_l2_args(l2), env=SHARED)
    value = os.urandom(2 * MiB)
    with server.client(colocated=False) as remote:
        sock, answer = _session(remote.info()["arena_socket"])
        assert answer.startswith(b"OK") and b"file_from=1048576" in answer
        place, fd = _place(sock, len(value))
        os.pwrite(fd, value, 0)
        # Still open for writing: the server cannot know the bytes are final, so it refuses the commit.
        status, message = _commit(sock, b"kept-open", place, len(value), xxhash.xxh3_64_intdigest(value))
        assert status == 3 and b"still open for writing" in message, message
        assert remote.get(b"kept-open") is None
        # A commit whose checksum is not the file's bytes: refused (the server checks the page cache).
        place, fd2 = _place(sock, len(value))
        os.pwrite(fd2, value, 0)
        os.close(fd2)
        status, message = _commit(sock, b"lie", place, len(value), 12345)
        assert status == 15 and b"checksum" in message, message
        # Done right, then written again behind the server's back (a buggy writer that reopened the file).
        place, fd3 = _place(sock, len(value))
        os.pwrite(fd3, value, 0)
        os.close(fd3)
        assert _commit(sock, b"good", place, len(value), xxhash.xxh3_64_intdigest(value)) == (0, b"")
        (stored,) = _files(l2)
        with open(stored, "r+b") as damaged, mmap.mmap(damaged.fileno(), 0) as m:
            m[100:104] = b"\x00\xff\x00\xff"
        # The read checks the bytes against the committed checksum: never the damaged bytes.
        got = remote.get(b"good")
        assert got is None, "a damaged large value was served"
        assert _counters(remote)["checksum_failures"] >= 1
        place, fd4 = _place(sock, len(value))
        os.pwrite(fd4, value, 0)
        os.close(fd4)
        assert _commit(sock, b"good-again", place, len(value), xxhash.xxh3_64_intdigest(value)) == (0, b"")
        assert remote.get(b"good-again") == value
        os.close(fd)
        sock.close()
        # The refused places and the session's leftovers are gone once it ends.
        wait_until(lambda: not list((l2 / "incoming").iterdir()), 10.0, "the session's places deleted")


_KILLED_WRITER = """
import os, sys
from cacheclient import CacheClient, InvalidRequestError
client = CacheClient(sys.argv[1])
assert client.transport.shared_l1(wait=True) is not None
client.put(b"first", b"f" * (3 << 20), durable=True)
print("ready", flush=True)
while True:
    client.put(b"again", os.urandom(16 << 20), durable=True)
"""


def test_a_writer_killed_mid_write_leaves_nothing_visible_and_no_space_held(cache_server: Any, tmp_path: Path) -> None:
    l2 = tmp_path / "l2"
    server: CacheServer = cache_server(*_l2_args(l2), env=SHARED)
    script = tmp_path / "writer.py"
    script.write_text(_KILLED_WRITER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    with server.client(colocated=False) as remote:
        writer = subprocess.Popen(
            [sys.executable, str(script), server.address], stdout=subprocess.PIPE, env=env, text=True
        )
        try:
            assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
            wait_until(lambda: _counters(remote).get("staging_places", 0) >= 4, 30.0, "the writer placing values")
        finally:
            writer.send_signal(signal.SIGKILL)
            writer.wait(10)
        wait_until(lambda: _counters(remote)["staging_sessions_open"] == 0, 10.0, "the killed writer's session")
        assert remote.get(b"first") == b"f" * (3 << 20)
        again = remote.get(b"again")
        assert again is None or len(again) == 16 << 20  # a whole value or none, never a torn one
        wait_until(lambda: not list((l2 / "incoming").iterdir()), 10.0, "the killed writer's place deleted")
        assert len(_files(l2)) == 1 + (again is not None)


def test_a_kill_between_write_and_index_leaves_files_that_the_next_start_deletes(
    cache_server: Any, tmp_path: Path
) -> None:
    l2 = tmp_path / "l2"
    server: CacheServer = cache_server(*_l2_args(l2), env=SHARED)
    with server.client(colocated=False) as remote:
        remote.put(b"kept", b"k" * (2 * MiB), durable=True)  # over gRPC: the server writes the file itself
        assert len(_files(l2)) == 1
    server.kill()
    # What a kill can leave: a place written and never committed, a file renamed and never indexed.
    (l2 / "incoming" / "place-00000000000000ab").write_bytes(b"x" * MiB)
    (l2 / FILE_VALUES_DIR / "00000000000000cd").write_bytes(b"y" * MiB)
    restarted: CacheServer = cache_server(*_l2_args(l2), env=SHARED)
    with restarted.client(colocated=False) as remote:
        assert remote.get(b"kept") == b"k" * (2 * MiB)
        assert not list((l2 / "incoming").iterdir())
        assert len(_files(l2)) == 1


def test_the_l2_budget_counts_the_files_of_large_values(cache_server: Any, tmp_path: Path) -> None:
    l2 = tmp_path / "l2"
    budget = 64 * MiB
    server: CacheServer = cache_server("--l1-bytes", "8MiB", "--l2-path", str(l2), "--l2-bytes", "64MiB", env=SHARED)
    rng = random.Random(5)
    with server.client(colocated=None) as client, server.client(colocated=False) as remote:
        _colocated(client)
        for i in range(40):  # about 3x the budget, large and small values mixed, co-located and over gRPC
            writer = client if i % 2 else remote
            writer.put(f"big/{i}".encode(), rng.randbytes(rng.choice([1, 2, 5]) * MiB))
            writer.put_many({f"small/{i}/{j}".encode(): rng.randbytes(3000) for j in range(50)})
            on_disk = sum(f.stat().st_size for f in _files(l2))
            assert on_disk <= budget, f"{on_disk} bytes of large values' files in an L2 of {budget}"
            (tier,) = [t for t in remote.stats()["tiers"] if t["name"] == "l2"]
            assert tier["used_bytes"] <= tier["capacity_bytes"], tier
        assert _files(l2), "no large value is a file of its own: the budget of files was not tested"
        assert (
            _counters(remote).get("evictions_l2", 0)
            + sum(t["evictions"] for t in remote.stats()["tiers"] if t["name"] == "l2")
            > 0
        )


def test_get_into_fills_each_kind_of_buffer_and_refuses_a_wrong_one(cache_server: Any, tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    l2 = tmp_path / "l2"
    server: CacheServer = cache_server(*_l2_args(l2), env=SHARED)
    big = os.urandom(4 * MiB)
    small = os.urandom(10_000)
    with server.client(colocated=None) as client, server.client(colocated=False) as remote:
        _colocated(client)
        client.put_many({b"big": big, b"small": small}, durable=True)
        for reader in (client, remote):  # the co-located file read, and chunks over gRPC
            for make in (
                bytearray,
                lambda n: np.zeros(n, dtype=np.uint8),
                lambda n: np.zeros(n // 4, dtype=np.float32),
                lambda n: torch.zeros(n // 2, dtype=torch.float16),
            ):
                for key, value in ((b"big", big), (b"small", small)):
                    buffer = make(len(value))
                    assert reader.get_into(key, buffer) == len(value)
                    assert (
                        bytes(memoryview(np.asarray(buffer) if not isinstance(buffer, bytearray) else buffer).cast("B"))
                        == value
                    )
            assert reader.get_into(b"missing", bytearray(10)) is None
            with pytest.raises(InvalidRequestError, match="cannot take"):
                reader.get_into(b"big", bytearray(len(big) - 1))
            with pytest.raises(InvalidRequestError, match="read-only"):
                reader.get_into(b"small", bytes(len(small)))
            with pytest.raises(InvalidRequestError, match="contiguous"):
                reader.get_into(b"small", np.zeros((200, 200), dtype=np.uint8)[:, ::2])
        assert client._l2 is not None, "the co-located client did not read L2's file"


def test_large_write_back_values_upload_from_their_files_and_read_back_from_s3(
    cache_server: Any, s3: Any, s3_prefix: str, tmp_path: Path
) -> None:
    config = tmp_path / "cachesvc.toml"
    config.write_text('[[namespaces]]\nprefix = "wb/"\nwrite_mode = "write-back"\n')
    args = (*_l2_args(tmp_path / "l2"), "--config", str(config), *s3_args(s3, s3_prefix))
    server: CacheServer = cache_server(*args, env=SHARED)
    rng = random.Random(11)
    values = {f"wb/{i}".encode(): rng.randbytes(rng.choice([1, 3, 9]) * MiB + i) for i in range(6)}
    with server.client(colocated=None) as client, server.client(colocated=False) as remote:
        _colocated(client)
        client.put_many(values, durable=True)
        assert _counters(remote)["staging_placed_puts"] == len(values)
        wait_until(lambda: _counters(remote)["dirty_keys"] == 0, 60.0, "every write-back value uploaded")
        assert _counters(remote)["writebacks"] >= len(values)
        files = _files(tmp_path / "l2")
    # Uploaded, each file's index entry lost its dirty flag (the file itself untouched): a restart on this L2
    # uploads nothing again.
    server.kill()
    restarted: CacheServer = cache_server(*args, env=SHARED)
    with restarted.client(colocated=False) as remote:
        counters = _counters(remote)
        assert counters["dirty_keys"] == 0 and counters.get("writebacks", 0) == 0, counters
        assert _files(tmp_path / "l2") == files
    # A server with an empty cache reads them all from S3: the uploads carried the files' bytes.
    fresh: CacheServer = cache_server("--l1-bytes", "64MiB", *s3_args(s3, s3_prefix))
    with fresh.client(colocated=False) as remote:
        assert remote.get_many(list(values)) == list(values.values())
