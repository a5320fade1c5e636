"""`cachesvc demo`: the newcomer's first look at what the cache does for a training job.

On the cluster `cachesvc up` runs (found through `STATE_DIR/cluster.json`), or
on one it starts for the occasion, it writes a small synthetic dataset to S3
and reads it through a PyTorch DataLoader three times: straight from S3 with
boto3, then a cold and a warm epoch through cachesvc (`CachedDataset`, with
sampler-order prefetch), and prints the three rates side by side. The
dataset is removed afterwards, from S3 and from the cache.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cacheclient.process_local import ProcessLocal

__all__ = ["run_demo"]


@dataclass
class Cluster:
    cache: list[str]
    s3_endpoint: str
    bucket: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"
    meta: list[str] = field(default_factory=list)

    def client(self, timeout: float) -> Any:
        """A client of the cluster: routed by the metadata shard when there is one, else by a static map."""
        from cacheclient import CacheClient

        if self.meta:
            return CacheClient(meta=self.meta, timeout=timeout)
        if len(self.cache) > 1:
            return CacheClient(nodes=self.cache, timeout=timeout)
        return CacheClient(self.cache[0], timeout=timeout)


def _running_cluster(state_dir: Path) -> Cluster | None:
    from cacheclient import CacheClientError

    try:
        info = json.loads((state_dir / "cluster.json").read_text())
    except (OSError, ValueError):
        return None
    cluster = Cluster(
        cache=list(info["cache"]),
        s3_endpoint=info["s3_endpoint"],
        bucket=info["bucket"],
        access_key=info["access_key"],
        secret_key=info["secret_key"],
        region=info.get("region", "us-east-1"),
        meta=list(info.get("meta") or []),
    )
    client = cluster.client(timeout=3.0)
    try:
        client.info()
    except CacheClientError:
        return None  # a cluster.json left behind by a cluster that is gone
    finally:
        client.close()
    return cluster


def _start_cluster(state_dir: Path) -> tuple[Cluster, Any]:
    """Runs `cachesvc up` on free ports in `state_dir` until the returned process is stopped."""
    from cachesvc.devcluster.procs import ManagedProcess, free_port
    from cachesvc.devcluster.seaweed import SeaweedPorts

    ports = SeaweedPorts.free()
    argv = [
        sys.executable, "-m", "cachesvc", "up",
        "--state-dir", str(state_dir),
        "--cache-port", str(free_port()),
        "--s3-port", str(ports.s3),
        "--master-port", str(ports.master),
        "--volume-port", str(ports.volume),
        "--filer-port", str(ports.filer),
    ]  # fmt: skip
    process = ManagedProcess("up", argv, state_dir / "up.log")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        cluster = _running_cluster(state_dir)
        if cluster is not None:
            return cluster, process
        if not process.alive():
            break
        time.sleep(0.5)
    process.stop(grace=30.0)
    raise RuntimeError(f"`cachesvc up` did not come up:\n{process.tail()}")


class S3Samples:
    """The baseline: a map-style dataset reading each sample with one boto3 GET (a client per process)."""

    def __init__(self, cluster: Cluster, keys: list[str]) -> None:
        self.cluster = cluster
        self.keys = keys
        self._client = ProcessLocal(self._connect)

    def _connect(self) -> Any:
        from cachesvc.devcluster.seaweed import s3_client

        return s3_client(self.cluster.s3_endpoint, self.cluster.access_key, self.cluster.secret_key)

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> bytes:
        body: bytes = self._client.get().get_object(Bucket=self.cluster.bucket, Key=self.keys[index])["Body"].read()
        return body


def _as_list(batch: list[bytes]) -> list[bytes]:
    return batch


def _epoch(dataset: Any, batch_size: int, workers: int, order: list[int]) -> tuple[float, int]:
    """(seconds, bytes) of one DataLoader pass over `order`."""
    from torch.utils.data import DataLoader

    # forkserver: this process has made gRPC calls, and a plain fork while a
    # gRPC thread is busy can hang a worker. The server preloads torch and the
    # datasets, so starting workers costs milliseconds, not an import of torch
    # each. A stuck batch raises after 120 s.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "cacheclient.torch", "cachesvc.commands.demo"])
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=order,
        num_workers=workers,
        collate_fn=_as_list,
        multiprocessing_context=context if workers else None,
        timeout=120 if workers else 0,
    )
    began = time.perf_counter()
    nbytes = 0
    for batch in loader:
        nbytes += sum(len(sample) for sample in batch)
    return time.perf_counter() - began, nbytes


def run_demo(args: argparse.Namespace) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        print("cachesvc demo: needs PyTorch: pip install 'cachesvc[torch]'", file=sys.stderr)
        return 2
    from cacheclient import CacheClientError
    from cacheclient.torch import CachedDataset
    from cachesvc.devcluster.seaweed import s3_client

    state_dir = Path(args.state_dir).resolve()
    cluster = _running_cluster(state_dir)
    started = None
    scratch = None
    if cluster is None:
        scratch = tempfile.TemporaryDirectory(prefix="cachesvc-demo-")
        print(f"demo: no cluster running in {state_dir}; starting one (`cachesvc up`) for the demo", flush=True)
        try:
            cluster, started = _start_cluster(Path(scratch.name))
        except (OSError, RuntimeError) as exc:
            print(f"cachesvc demo: {exc}", file=sys.stderr)
            return 1
    else:
        print(f"demo: using the cluster in {state_dir} (cache {', '.join(cluster.cache)})", flush=True)
    s3 = s3_client(cluster.s3_endpoint, cluster.access_key, cluster.secret_key)
    prefix = f"demo/{uuid.uuid4().hex[:8]}/"
    keys = [f"{prefix}{i:06d}.bin" for i in range(args.samples)]
    client = cluster.client(timeout=30.0)
    try:
        began = time.perf_counter()
        put = s3.put_object  # type: ignore[attr-defined]
        with ThreadPoolExecutor(16) as pool:
            for done in [
                pool.submit(put, Bucket=cluster.bucket, Key=k, Body=os.urandom(args.sample_bytes)) for k in keys
            ]:
                done.result()
        total_mb = args.samples * args.sample_bytes / 1e6
        print(
            f"demo: wrote {args.samples} samples x {args.sample_bytes} B ({total_mb:.0f} MB) to "
            f"s3://{cluster.bucket}/{prefix} in {time.perf_counter() - began:.1f}s",
            flush=True,
        )
        order = _shuffled(args.samples)
        rows = []
        seconds, nbytes = _epoch(S3Samples(cluster, keys), args.batch_size, args.workers, order)
        rows.append(("S3 directly (boto3)", seconds, nbytes))
        print(f"demo: S3 directly: {args.samples / seconds:,.0f} samples/s", flush=True)
        dataset = CachedDataset.from_s3(f"s3://{cluster.bucket}/{prefix}", cache=client)
        for name in ("cachesvc, cold epoch", "cachesvc, warm epoch"):
            with dataset.prefetch_epoch(order):
                seconds, nbytes = _epoch(dataset, args.batch_size, args.workers, order)
            rows.append((name, seconds, nbytes))
            print(f"demo: {name}: {args.samples / seconds:,.0f} samples/s", flush=True)
        _print_table(rows, args)
        return 0
    except CacheClientError as exc:
        print(f"cachesvc demo: {exc}", file=sys.stderr)
        return 3
    finally:
        for key in keys:
            try:
                client.delete(key)  # every tier, S3 included
            except CacheClientError:
                break
        client.close()
        if started is not None:
            print("demo: stopping the cluster it started", flush=True)
            started.stop(grace=30.0)
        if scratch is not None:
            scratch.cleanup()


def _shuffled(n: int) -> list[int]:
    """A seeded shuffle, as a training job's sampler would read."""
    import random

    order = list(range(n))
    random.Random(0).shuffle(order)
    return order


def _print_table(rows: list[tuple[str, float, int]], args: argparse.Namespace) -> None:
    base = rows[0][1]
    print()
    print(f"{args.samples} samples x {args.sample_bytes // 1024} KiB, batch {args.batch_size}, {args.workers} workers")
    print(f"{'read path':<24} {'samples/s':>10} {'MB/s':>8} {'vs S3':>7}")
    for name, seconds, nbytes in rows:
        print(f"{name:<24} {args.samples / seconds:>10,.0f} {nbytes / seconds / 1e6:>8.1f} {base / seconds:>6.1f}x")
