"""Fixtures that start the real parts: a SeaweedFS S3 server, cache servers and metadata shards as processes.

Everything binds 127.0.0.1 on ports picked here, and everything started is
stopped by its pid. `running_cluster` starts a whole cluster (a metadata
shard, cache servers routed by it, sharing one S3 prefix) for the test
modules that need one.
"""

from __future__ import annotations

import _thread
import ast
import contextlib
import faulthandler
import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import pytest

from cacheclient import CacheClient, NodeClient
from cacheclient.meta import MetaClient, PlacementMap
from cacheclient.routing import Router
from cacheclient.wire import PLACEMENT_VERSION_METADATA
from cacheclient.wire.record import SERVING_LOCK
from cachesvc.devcluster.procs import ManagedProcess, free_port, free_port_run, wait_for_port
from cachesvc.devcluster.seaweed import S3_ACCESS_KEY, S3_SECRET_KEY, SeaweedFS, s3_client
from cachesvc.devcluster.shard import LocalShard

BUCKET = "cachesvc-test"

STUCK_CHILD_SECONDS = 150.0
"""A forked child of a test (a DataLoader worker) still running after this long writes its stacks to stderr."""


def _dump_stacks_when_stuck() -> None:
    # Forked DataLoader workers hung a few times in CI (the parent waited for data until the test's
    # timeout) and nothing said where: their stacks land in the failed test's captured stderr. A thread of
    # the child's own, gone with it at exec or exit and not in its forks (which start their own). Not
    # `faulthandler.dump_traceback_later`: arming it again in a fork of this child waits forever for a
    # watchdog thread the fork does not have. Not `signal.alarm`: its timer outlives an exec (a Popen with
    # `preexec_fn` runs this hook), and the program exec'd would be killed by the SIGALRM.
    def watch() -> None:
        time.sleep(STUCK_CHILD_SECONDS)
        faulthandler.dump_traceback(all_threads=True)

    _thread.start_new_thread(watch, ())


os.register_at_fork(after_in_child=_dump_stacks_when_stuck)


@dataclass
class S3Server:
    endpoint: str
    bucket: str
    weed: SeaweedFS

    def client(self) -> Any:
        return s3_client(self.endpoint)


def start_seaweed(data_dir: Path, bucket: str = BUCKET) -> SeaweedFS:
    weed = SeaweedFS.on_free_ports(data_dir)
    try:
        weed.create_bucket(bucket)
    except BaseException:
        weed.stop(grace=5.0)
        raise
    return weed


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One SeaweedFS S3 server for the whole test run."""
    weed = start_seaweed(tmp_path_factory.mktemp("seaweed"))
    try:
        yield S3Server(weed.endpoint, BUCKET, weed)
    finally:
        weed.stop(grace=5.0)


@pytest.fixture
def s3_prefix() -> str:
    """A prefix no other test uses, so tests share the bucket without meeting."""
    return f"t/{uuid.uuid4().hex[:12]}/"


class CacheServer:
    """A `cachesvc serve` process on a free 127.0.0.1 port."""

    def __init__(self, args: list[str], log_dir: Path, env: dict[str, str] | None = None, ports: int = 1) -> None:
        """`ports`: how many consecutive ports it listens on from `port` (`--processes N`)."""
        self.args = args
        self.log_dir = log_dir
        self.env = env
        self.port = free_port() if ports == 1 else free_port_run(ports)
        self.address = f"127.0.0.1:{self.port}"
        self.process: ManagedProcess | None = None

    def start(self) -> CacheServer:
        env = dict(os.environ, CACHESVC_S3_ACCESS_KEY=S3_ACCESS_KEY, CACHESVC_S3_SECRET_KEY=S3_SECRET_KEY)
        env.update(self.env or {})
        argv = [sys.executable, "-m", "cachesvc", "serve", "--listen", self.address, *self.args]
        self.process = ManagedProcess("cache", argv, self.log_dir / f"cache-{self.port}.log", env=env)
        try:
            wait_for_port(self.port, timeout=30.0, proc=self.process.proc)
        except Exception as exc:
            raise RuntimeError(f"cache server did not start:\n{self.process.tail()}") from exc
        return self

    def client(self, **kwargs: Any) -> CacheClient:
        """A client of this server over gRPC; `colocated=None` (or True) reads its shared L1 directly, as a
        client on the server's machine does by default (tests/test_colocated_l1.py)."""
        kwargs.setdefault("timeout", 30.0)
        kwargs.setdefault("colocated", False)
        return CacheClient(self.address, **kwargs)

    def counters(self) -> dict[str, int]:
        """This server's Stats counters, read now."""
        with self.client(timeout=10.0) as plain:
            return dict(plain.stats()["counters"])

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()

    def stop(self, grace: float = 20.0) -> int | None:
        assert self.process is not None
        return self.process.stop(grace)

    def log(self) -> str:
        assert self.process is not None
        return self.process.tail(200)


@pytest.fixture
def cache_server(tmp_path: Path) -> Iterator[Any]:
    """Factory: `cache_server(*args)` starts a `cachesvc serve` with those flags."""
    started: list[CacheServer] = []

    def start(*args: str, env: dict[str, str] | None = None) -> CacheServer:
        server = CacheServer(list(args), tmp_path / "logs", env)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        if server.process is not None and server.process.alive():
            server.stop(grace=10.0)


def self_signed_cert(directory: Path, name: str = "server", common_name: str = "localhost") -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost, made by openssl: (key file, certificate file)."""
    key, cert = directory / f"{name}.key", directory / f"{name}.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={common_name}",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return key, cert


def s3_args(s3: S3Server, prefix: str) -> list[str]:
    return ["--s3-endpoint", s3.endpoint, "--s3-bucket", s3.bucket, "--s3-prefix", prefix]


class ThreadedLoad:
    """Worker threads that start when a `with` block begins; when it ends they are told to stop (`_stop`, which
    their loops check) and joined, each for at most `join_seconds`."""

    join_seconds = 30.0

    def __init__(self, workers: Sequence[tuple[Callable[..., object], tuple[Any, ...]]]) -> None:
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=target, args=args, daemon=True) for target, args in workers]

    def __enter__(self) -> Self:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.join_seconds)


def wait_until(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.02) -> None:
    """Waits until `condition()` is true; fails the test, naming `what`, when `timeout` seconds pass first.

    A wait is an assertion: a test that waits for a counter must not go on
    as if it had reached it.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout:g}s for {what}", pytrace=False)
        time.sleep(interval)


def stopped(pid: int) -> bool:
    """Whether every thread of process `pid` is stopped (state T in /proc)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except FileNotFoundError:
            continue  # a thread that has exited
        if state not in ("T", "t"):
            return False
    return True


def hang(pid: int) -> None:
    """SIGSTOP `pid` and wait until the whole process has stopped.

    `kill` returns once the signal is queued. The stop takes effect when the
    thread that received it next runs, and on a loaded machine that can be
    milliseconds later, while the process's other threads go on answering
    RPCs (seen: a read answered in 3 ms by a server just sent SIGSTOP).
    """
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: stopped(pid), 10.0, f"every thread of process {pid} to stop")


class Cluster:
    """The shard, the servers and their S3 prefix; `client()` makes a routing client."""

    def __init__(
        self,
        shard: LocalShard,
        servers: list[CacheServer],
        s3: S3Server,
        prefix: str,
        replicas: dict[str, int] | None = None,
        heartbeat_seconds: float = 0.3,
        admin_token: str = "",
    ) -> None:
        self.shard = shard
        self.servers = servers
        self.s3 = s3
        self.prefix = prefix
        self.replicas = dict(replicas or {})
        self.heartbeat_seconds = heartbeat_seconds
        """The servers' heartbeat: each fetches the shard's map after every one."""
        self.admin_token = admin_token
        """The servers' and the shard's admin token ("": none); the shard's client and the probes present it."""
        self.meta = MetaClient(shard.addresses, timeout=5.0, token=admin_token or None)

    def client(self, **kwargs: Any) -> CacheClient:
        kwargs.setdefault("timeout", 20.0)
        if self.admin_token:
            kwargs.setdefault("token", self.admin_token)
        return CacheClient(meta=",".join(self.shard.addresses), replicas=self.replicas, **kwargs)

    def placement(self) -> PlacementMap:
        return self.meta.placement(refresh=True)

    def up(self) -> list[str]:
        return sorted(self.placement().nodes)

    def server(self, address: str) -> CacheServer:
        return next(s for s in self.servers if s.address == address)

    def wait_placement(self, addresses: list[str], what: str) -> PlacementMap:
        wait_until(lambda: self.up() == sorted(addresses), 30.0, what, interval=0.1)
        placement = self.placement()
        # Every running server routes by it too (they fetch it after each heartbeat: one that fetched just
        # before another registered learns the newer map at its next heartbeat).
        running = [s for s in self.servers if s.process is not None and s.process.alive()]
        if len(placement.nodes) < 2:
            return placement  # one node owns every key by any map: the probe below cannot tell its version
        probe = {"token": self.admin_token} if self.admin_token else {}
        wait_until(
            lambda: all(server_version(s, **probe) >= placement.version for s in running),
            max(10.0, 2 * self.heartbeat_seconds),
            f"servers to learn placement version {placement.version}",
            interval=0.1,
        )
        return placement


def router_of(client: CacheClient) -> Router:
    """The routing transport of a cluster client (its map, per-node clients, counters), for tests that look inside."""
    transport = client.transport
    assert isinstance(transport, Router), transport
    return transport


def server_version(server: CacheServer, **client_kwargs: Any) -> int:
    """The placement version `server` routes by (0: none yet); `client_kwargs` reach it (`tls_ca=`)."""
    # A routed call names version 0 (older than any map): a server that has a
    # map refuses a key it does not own and tells its version.
    key = b"probe/" + uuid.uuid4().bytes.hex().encode()
    client = NodeClient(server.address, timeout=5.0, **client_kwargs).with_metadata(
        ((PLACEMENT_VERSION_METADATA, "0"),)
    )
    try:
        for i in range(64):
            client.contains(key + str(i).encode())
    except Exception as exc:  # NotOwnerError names the version
        return int(getattr(exc, "version", 0))
    finally:
        client.close()
    return 0


@contextlib.contextmanager
def running_cluster(
    s3: S3Server,
    base: Path,
    config: str,
    sizes: Sequence[tuple[str, str]],
    *,
    meta_nodes: int = 3,
    lease_seconds: float = 2.0,
    heartbeat_seconds: float = 0.3,
    replicas: dict[str, int] | None = None,
    s3_endpoint: str | None = None,
    tokens: tuple[str, str] | None = None,
) -> Iterator[Cluster]:
    """A metadata shard of `meta_nodes` nodes and one cache server per (L1, L2) size in `sizes`.

    The servers read `config` (TOML), register with the shard and share one
    fresh S3 prefix; the cluster is yielded once every server is in the
    placement map and routes by it. `replicas` is what routing clients are
    told (the same as the config's `[[namespaces]] replicas`); `s3_endpoint`
    puts something (a proxy) between the servers and `s3`. `tokens` (data, admin) secures the shard and
    the servers with them.
    """
    data_token, admin_token = tokens or ("", "")
    shard = LocalShard(
        meta_nodes,
        base / "meta",
        args=["--lease-seconds", str(lease_seconds)],
        token=data_token,
        admin_token=admin_token,
        peer_token=f"peer-{uuid.uuid4().hex}" if data_token else "",
    )
    servers: list[CacheServer] = []
    try:
        shard.start()
        shard.leader(timeout=20.0)
        config_path = base / "cachesvc.toml"
        config_path.write_text(config)
        prefix = f"cluster/{uuid.uuid4().hex[:8]}/"
        # Shared L1: routing clients here read each key from its owner's arena (the Jepsen runs check it).
        env = {"CACHESVC_META_HEARTBEAT_SECONDS": str(heartbeat_seconds), "CACHESVC_L1_SHARED": "true"}
        if data_token:
            env.update(CACHESVC_SECURITY_TOKEN=data_token, CACHESVC_SECURITY_ADMIN_TOKEN=admin_token)
        s3_flags = s3_args(s3, prefix)
        if s3_endpoint:
            s3_flags[s3_flags.index("--s3-endpoint") + 1] = s3_endpoint
        for i, (l1, l2) in enumerate(sizes):
            args = [
                "--config", str(config_path),
                "--l1-bytes", l1,
                "--l2-path", str(base / f"l2-{i}"),
                "--l2-bytes", l2,
                "--meta", ",".join(shard.addresses),
                *s3_flags,
            ]  # fmt: skip
            servers.append(CacheServer(args, base / "logs", env).start())
        cluster = Cluster(shard, servers, s3, prefix, replicas, heartbeat_seconds, admin_token)
        cluster.wait_placement([s.address for s in servers], f"all {len(servers)} cache servers in the placement")
        try:
            yield cluster
        except BaseException:
            _report_exited(servers)
            raise
    finally:
        for server in servers:
            if server.process is not None and server.process.alive():
                server.stop(grace=10.0)
        shard.stop()


def _report_exited(servers: Sequence[CacheServer]) -> None:
    """Prints the log tail of each of `servers` that is not running when its test failed (shown with the
    failure): a server that crashed, or one the test stopped on purpose."""
    for server in servers:
        process = server.process
        if process is not None and not process.alive():
            print(f"cache server {server.address} had exited ({process.proc.returncode}):\n{process.tail(40)}")


def read_directly(l2: Path, keys: list[bytes]) -> list[bytes | None]:
    """What a co-located client reads from the L2 file at `l2` (another process: this one has it open)."""
    code = (
        "import sys; from cacheclient._lmdb_reader import L2Reader\n"
        "print(repr(L2Reader(sys.argv[1]).get_many([k.encode() for k in sys.argv[2:]])))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(l2), *(k.decode() for k in keys)],
        check=True, timeout=60, capture_output=True, text=True,
    )  # fmt: skip
    values: list[bytes | None] = ast.literal_eval(out.stdout)
    return values


@contextlib.contextmanager
def serving_l2(path: Path) -> Iterator[None]:
    """Holds the lock a server holds on its L2 directory while co-located clients may read the file
    (`SERVING_LOCK`), for a test that wrote the file with the tier alone and closed it."""
    fd = os.open(path / SERVING_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)
