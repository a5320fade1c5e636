"""Fixtures that start the real parts: a SeaweedFS S3 server and cache servers as processes.

Everything binds 127.0.0.1 on ports picked here, and everything started is
stopped by its pid.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cacheclient import CacheClient
from cachesvc.devcluster.procs import ManagedProcess, free_port, wait_for_port
from cachesvc.devcluster.seaweed import S3_ACCESS_KEY, S3_SECRET_KEY, SeaweedFS, SeaweedPorts, s3_client

BUCKET = "cachesvc-test"


@dataclass
class S3Server:
    endpoint: str
    bucket: str
    weed: SeaweedFS

    def client(self) -> Any:
        return s3_client(self.endpoint)


def start_seaweed(data_dir: Path, bucket: str = BUCKET) -> SeaweedFS:
    weed = SeaweedFS(data_dir, SeaweedPorts.free())
    weed.start()
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

    def __init__(self, args: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log_dir = log_dir
        self.env = env
        self.port = free_port()
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
        kwargs.setdefault("timeout", 30.0)
        return CacheClient(self.address, **kwargs)

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


def s3_args(s3: S3Server, prefix: str) -> list[str]:
    return ["--s3-endpoint", s3.endpoint, "--s3-bucket", s3.bucket, "--s3-prefix", prefix]


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
