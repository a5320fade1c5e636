"""DataLoader benchmark (issue 5): an epoch of a dataset in S3, read by each way people read it today and by cachesvc.

In one run, for each dataset (N samples of S bytes of random data in the S3
server, SeaweedFS here), every contender reads one epoch through the same
`torch.utils.data.DataLoader` configuration (batch 32, 2 workers, fork, the
same seeded shuffle for the map-style ones):

* boto3: a map-style dataset doing one `get_object` per sample;
* boto3 16 in flight: the same, each worker reading its batch 16 samples at
  a time (a thread pool behind `__getitems__`), as our server fills a batch;
* s3torchconnector: Amazon's `S3MapDataset` pointed at the S3 endpoint;
* s3torchconnector 16 in flight: the same, 16 samples at a time per worker;
* streaming e1 / e2: MosaicML `StreamingDataset` over MDS shards written to
  the same S3 server, with a local cache directory: first and second epoch;
* cachesvc cold: `CachedDataset` on a cache server that holds nothing;
* cachesvc cold+prefetch: the same on another empty server, with the
  sampler's order handed over first (`prefetch_epoch`);
* cachesvc warm gRPC: the epoch after the cold one, over gRPC (L1 hits);
* cachesvc warm co-located: the same, read by the workers straight from the
  server's memory (its L1 is a shared arena, `l1.shared`; issue 23) and its
  L2 (LMDB) file, no gRPC on the bulk path;
* cachesvc shards cold / warm: `CachedShardDataset` over the same MDS shards
  streaming reads (each shard read whole through the cache, as range keys of
  16 MiB, with a prefetch plan of each worker's shards), on a cache server
  that holds nothing, then its second epoch.

* in memory (ceiling): no reader at all. The samples are made in the main
  process before the DataLoader forks, and each worker yields its share of
  them (every `workers`-th of the shuffled order) from memory it inherited.
  Every other contender's epoch also pays for a read; this one pays only
  for what the DataLoader itself does (the fork, the collate, the shared
  memory hand-over), so no reader through this DataLoader can beat it: the
  ceiling a ratio against another contender can reach;
* in memory (one copy): the same, each sample copied once (`bytes` of a view
  of it) before it is yielded. A reader has to put each sample's bytes in
  memory at least once (from a file, an arena or a socket), so this is the
  ceiling of any reader that yields samples as bytes, as every sharded
  contender here does.

The sharded contenders also read the same samples as WebDataset `.tar`
shards, one per MDS shard holding that shard's samples (`wds.TarWriter`,
a `<index>.data` member per sample; each tar is the MDS shard's size plus
512 bytes of header per sample):

* webdataset: `webdataset.WebDataset` over `s3://` URLs, shards shuffled
  (`shardshuffle`, seed 0) and split by worker, samples through a shuffle
  buffer of 256 that yields from 64 samples in, as ours. Its `s3:` scheme is a `gopen` handler that streams
  `get_object`'s body with a boto3 client per process: the documented
  `pipe:aws s3 cp s3://... -` pattern without a CLI process per shard (no
  AWS CLI here), one GET per shard, the one stream per worker webdataset
  reads;
* s3torchconnector tar: `S3IterableDataset.from_prefix(..., enable_sharding=True)`
  (objects split across workers, read by the CRT client's default
  sequential reader) fed to webdataset's `tar_file_expander` and
  `group_by_keys`, the pattern of s3torchconnector's WebDataset example,
  with the same shuffle buffer (256, yielding from 64 in);
* cachesvc tar shards cold / warm: `CachedShardDataset` over those tar
  shards (`format="webdataset"`), as for MDS.

Every sharded contender reads a shard whole once per epoch in each worker's
order; ours and streaming fetch ahead of the worker (the cache's prefetch
plan, streaming's download threads), webdataset and s3torchconnector read one
shard at a time per worker, which is how they are documented to read.

Samples reach the training loop as uint8 tensors made in the workers by one
collate function shared by every contender, so the DataLoader moves them
through shared memory, as it does a job's decoded samples. `--samples-as
bytes` hands over the raw bytes instead (pickled through a pipe, which caps
every contender at a few hundred MB/s on a small machine).

Each runs twice: against the S3 server as it is, and through
`bench/latency_proxy.py` (its own process), which adds 20 ms to every S3
request as a remote object store would. The cache server's own S3 traffic
goes through the proxy too; the cache server runs on this machine.

Every epoch is checked: N samples, N*S bytes, and an order-independent
xxh3 digest of the samples equal to that of the objects.

`--repeat N` runs every contender N times, alternating them (each run on a
fresh cache server and a fresh streaming cache directory, so every cold epoch
is cold), and reports each one's median run with all N runs' samples/s
(`runs_samples_per_s`): on a shared 2-core machine one epoch of a few
seconds can vary 2-3x from run to run.

Set-up: `make bench-setup` (the competitors' own dependencies would replace
torch 2.13.0, so s3torchconnector and mosaicml-streaming go in without them,
and the ones the benchmark uses come from the `bench` extra).

Usage:
    python bench/dataloader.py              # defaults below, about 10 minutes on 2 cores
    python bench/dataloader.py --quick      # a smoke run
    python bench/dataloader.py --only "streaming e1,streaming e2,cachesvc shards cold,cachesvc shards warm"
    python bench/dataloader.py --repeat 3 --out bench/results/dataloader_shards.json \
        --only "streaming e1,streaming e2,webdataset,s3torchconnector tar,cachesvc shards cold,\
cachesvc shards warm,cachesvc tar shards cold,cachesvc tar shards warm,in memory (ceiling),in memory (one copy)"
        # the sharded contenders and the two ceilings
    python bench/dataloader.py --samples 20000 --large-samples 2000   # the issue's full sizes

Defaults are scaled down from the issue's (20,000 x 100 KiB and 2,000 x
1 MiB) to fit a 2-core machine in about 10 minutes: 4,000 x 100 KiB and
400 x 1 MiB. Writes `bench/results/dataloader.json` and
`bench/results/dataloader.png`, and prints a table and the issue's target
ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import functools
import importlib.machinery
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import types
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.utils.data import DataLoader, Dataset

from cacheclient import CacheClient
from cacheclient.process_local import ProcessLocal
from cacheclient.torch import CachedDataset, CachedShardDataset
from cacheclient.wire import checksum_metadata
from cachesvc.devcluster.procs import ManagedProcess, free_port
from cachesvc.devcluster.seaweed import S3_ACCESS_KEY, S3_SECRET_KEY, SeaweedFS, SeaweedPorts, s3_client

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from tiers import machine_info  # noqa: E402

BUCKET = "bench-dataloader"
IN_FLIGHT = 16
"""Requests a batched contender keeps in flight per DataLoader worker. The cache server fills a batch 16
keys at a time (`request_fills`: half of `fill_concurrency`, 32), so with 2 workers each side has 32
requests in flight. With the sampler's order prefetched ("cachesvc cold+prefetch") the plan fetches 32 at
once (`prefetch_concurrency`), and a read the plan has not reached fills on its own slots beside them
(one that reaches a key the plan is fetching joins that fetch): that contender may have more than 32 in
flight, up to 64, so its ratios to the direct readers are not read as a like-for-like win."""
CONTENDERS = [
    "boto3",
    "boto3 16 in flight",
    "s3torchconnector",
    "s3torchconnector 16 in flight",
    "streaming e1",
    "streaming e2",
    "cachesvc cold",
    "cachesvc cold+prefetch",
    "cachesvc warm gRPC",
    "cachesvc warm co-located",
    "cachesvc shards cold",
    "cachesvc shards warm",
    "webdataset",
    "s3torchconnector tar",
    "cachesvc tar shards cold",
    "cachesvc tar shards warm",
    "in memory (ceiling)",
    "in memory (one copy)",
]
CEILING = "in memory (ceiling)"
ONE_COPY = "in memory (one copy)"
SHARD_BUFFER = 256
"""Samples in each sharded contender's shuffle buffer: `CachedShardDataset`'s default, given to webdataset's
`.shuffle` and to the s3torchconnector pipeline too."""
SHARD_INITIAL = 64
"""Samples in that buffer before the first comes out: `CachedShardDataset`'s default `shuffle_initial`, given
to webdataset's `.shuffle(initial=)` and to the s3torchconnector pipeline too."""
SHARD_CONTENDERS = ["streaming e1", "streaming e2", "webdataset", "s3torchconnector tar"]
OUR_SHARDS = ["cachesvc shards cold", "cachesvc shards warm", "cachesvc tar shards cold", "cachesvc tar shards warm"]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def as_list(batch: list[Any]) -> list[Any]:
    """Samples as the dataset returned them (bytes; a dict for MosaicML streaming)."""
    return batch


def as_tensors(batch: list[Any]) -> torch.Tensor:
    """The batch as one uint8 tensor, a row per sample, made in the worker (`default_collate`
    does the same with decoded samples): the DataLoader hands it over through shared memory."""
    return torch.stack([torch.frombuffer(bytearray(_payload(sample)), dtype=torch.uint8) for sample in batch])


def digest(values: list[bytes]) -> int:
    """Order-independent digest of a multiset of values."""
    return sum(xxhash.xxh3_64_intdigest(v) for v in values) % (1 << 64)


class Epoch:
    """Times one pass of a loader and checks what it delivered."""

    def __init__(self, expected_samples: int, expected_bytes: int, expected_digest: int) -> None:
        self.expected = (expected_samples, expected_bytes, expected_digest)

    def run(self, loader: Any, name: str) -> dict[str, Any]:
        began = time.perf_counter()
        samples = nbytes = 0
        total = 0
        first = None
        for batch in loader:
            if first is None:
                first = time.perf_counter() - began
            values = [_payload(v) for v in batch]
            samples += len(values)
            nbytes += sum(len(v) for v in values)
            total = (total + digest(values)) % (1 << 64)
        seconds = time.perf_counter() - began
        if (samples, nbytes, total) != self.expected:
            raise AssertionError(f"{name}: delivered {samples} samples / {nbytes} bytes, digest mismatch or count off")
        return {
            "seconds": round(seconds, 3),
            "samples_per_s": round(samples / seconds, 1),
            "MB_per_s": round(nbytes / seconds / 1e6, 2),
            "first_batch_s": round(first or seconds, 3),
        }


def _payload(sample: Any) -> bytes | memoryview:
    if isinstance(sample, dict):  # MosaicML streaming's column, or a WebDataset sample's `.data` file
        return bytes(sample["data"])
    if isinstance(sample, torch.Tensor):
        return memoryview(sample.numpy())
    return bytes(sample)


# -- contenders ------------------------------------------------------------------


class InMemory(torch.utils.data.IterableDataset[dict[str, bytes]]):
    """The ceiling: samples already in the workers' memory (made before the fork), each worker yielding every
    `num_workers`-th of `order` as a dict like a sharded sample's, so the collate pays what it pays for theirs;
    with `copy`, each copied once first (the least a reader does)."""

    def __init__(self, samples: list[bytes], order: list[int], copy: bool = False) -> None:
        self.samples = samples
        self.order = order
        self.copy = copy

    def __iter__(self) -> Iterator[dict[str, bytes]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in self.order[worker::workers]:
            yield {"data": bytes(memoryview(self.samples[i])) if self.copy else self.samples[i]}


class Boto3Samples(Dataset[bytes]):
    """One get_object per sample; a boto3 client per process."""

    def __init__(self, endpoint: str, names: list[str]) -> None:
        self.endpoint = endpoint
        self.names = names
        self._client = ProcessLocal(functools.partial(s3_client, endpoint))

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, index: int) -> bytes:
        body: bytes = self._client.get().get_object(Bucket=BUCKET, Key=self.names[index])["Body"].read()
        return body


class InFlight(Dataset[Any]):
    """A per-sample dataset whose batches are read `in_flight` samples at a time in each worker.

    The DataLoader hands a map-style dataset a whole batch's indices through
    `__getitems__` (as it does `CachedDataset`, which reads a batch in one
    call); here a thread pool per process reads them concurrently. boto3
    clients and s3torchconnector's CRT client are thread-safe.
    """

    def __init__(self, inner: Any, in_flight: int = IN_FLIGHT) -> None:
        self.inner = inner
        self.in_flight = in_flight
        self._pool = ProcessLocal(lambda: ThreadPoolExecutor(self.in_flight, thread_name_prefix="in-flight"))

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        return self.inner[index]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        return list(self._pool.get().map(self.inner.__getitem__, indices))


def read_s3_object(obj: Any) -> bytes:
    data: bytes = obj.read()
    return data


def s3torchconnector_dataset(endpoint: str, prefix: str) -> Any:
    from s3torchconnector import S3ClientConfig, S3MapDataset

    dataset = S3MapDataset.from_prefix(
        f"s3://{BUCKET}/{prefix}",
        region="us-east-1",
        endpoint=endpoint,
        s3client_config=S3ClientConfig(force_path_style=True),
        transform=read_s3_object,
    )
    len(dataset)  # list once here, not in every worker
    return dataset


_S3_BY_PROCESS: dict[str, ProcessLocal[Any]] = {}


def gopen_s3(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> Any:
    """webdataset's opener for `s3://bucket/key`: the object's body as a stream (boto3, a client per process).

    The endpoint comes from `S3_ENDPOINT_URL`, set before the DataLoader forks.
    """
    assert mode == "rb", mode
    endpoint = os.environ["S3_ENDPOINT_URL"]
    client = _S3_BY_PROCESS.setdefault(endpoint, ProcessLocal(functools.partial(s3_client, endpoint))).get()
    bucket, _, key = url.removeprefix("s3://").partition("/")
    return client.get_object(Bucket=bucket, Key=key)["Body"]


def webdataset_dataset(urls: list[str]) -> Any:
    import webdataset as wds

    wds.gopen_schemes["s3"] = gopen_s3
    return wds.WebDataset(urls, shardshuffle=len(urls), seed=0, empty_check=False).shuffle(
        SHARD_BUFFER, initial=SHARD_INITIAL
    )


def shard_to_dict(obj: Any) -> dict[str, Any]:
    """s3torchconnector's object as webdataset's tar expander takes it (s3torchconnector's WebDataset example)."""
    return {"url": obj.key, "stream": obj}


class S3TorchTarShards(torch.utils.data.IterableDataset[dict[str, Any]]):
    """`S3IterableDataset` over tar shards, expanded into samples by webdataset's tar reader."""

    def __init__(self, endpoint: str, uri: str) -> None:
        from s3torchconnector import S3ClientConfig, S3IterableDataset

        self.objects = S3IterableDataset.from_prefix(
            uri,
            region="us-east-1",
            endpoint=endpoint,
            s3client_config=S3ClientConfig(force_path_style=True),
            transform=shard_to_dict,
            enable_sharding=True,
        )

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from webdataset import filters, tariterators

        samples = tariterators.group_by_keys(tariterators.tar_file_expander(iter(self.objects)))
        return iter(filters._shuffle(samples, SHARD_BUFFER, SHARD_INITIAL, rng=random.Random(0)))


def import_streaming() -> Any:
    """MosaicML streaming, whose package imports torchvision for its vision datasets.

    The torchvision build that matches this torch cannot be installed here,
    and the benchmark uses no vision code: stand-in modules satisfy the import,
    and leave `sys.modules` once streaming has bound what it takes from them.
    streaming imports `transformers`, which decides once per process whether
    torchvision is there: it decides before the stand-ins exist (else it took
    them for torchvision, and its models then failed to import in the same
    process, as `tests/test_kv.py`'s did after `tests/test_shards.py`).
    """
    with contextlib.suppress(ImportError):
        import torchvision  # noqa: F401
    with contextlib.suppress(ImportError):
        from transformers.utils.import_utils import is_torchvision_available

        is_torchvision_available()
    stubs = (
        []
        if "torchvision" in sys.modules
        else ["torchvision", "torchvision.datasets", "torchvision.transforms", "torchvision.transforms.functional"]
    )
    for name in stubs:
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = module
    if stubs:
        sys.modules["torchvision.datasets"].VisionDataset = type("VisionDataset", (), {})  # type: ignore[attr-defined]
        sys.modules["torchvision.transforms.functional"].to_tensor = lambda x: x  # type: ignore[attr-defined]
    try:
        import streaming
    finally:
        for name in stubs:
            sys.modules.pop(name, None)
    return streaming


class CacheServer:
    """A `cachesvc serve` process with L1 (shared with co-located readers), an L2 under `root`, and S3 at
    `s3_endpoint`."""

    extra_env: dict[str, str] = {}
    """`CACHESVC_*` settings every server of the run starts with (`--server-env`), before the instance's own."""

    def __init__(
        self, root: Path, s3_endpoint: str, l1_bytes: int, l2_bytes: int, env: dict[str, str] | None = None
    ) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        name = uuid.uuid4().hex[:6]
        env = dict(
            os.environ,
            CACHESVC_S3_ACCESS_KEY=S3_ACCESS_KEY,
            CACHESVC_S3_SECRET_KEY=S3_SECRET_KEY,
            CACHESVC_L1_SHARED="true",
            **CacheServer.extra_env,
            **(env or {}),
        )
        self.l2_path = root / f"l2-{name}"
        argv = [
            sys.executable, "-m", "cachesvc", "serve", "--listen", self.address,
            "--l1-bytes", str(l1_bytes), "--l2-path", str(self.l2_path), "--l2-bytes", str(l2_bytes),
            "--s3-endpoint", s3_endpoint, "--s3-bucket", BUCKET,
        ]  # fmt: skip
        self.process = ManagedProcess("cache", argv, root / f"cache-{name}.log", env=env)
        with CacheClient(self.address, timeout=60.0) as client:
            client.wait_ready(30.0)

    def counters(self) -> dict[str, int]:
        # A client per call, closed at once: the DataLoader forks its workers right
        # after, and a fork while gRPC threads are busy in this process can crash them.
        with CacheClient(self.address, timeout=60.0) as client:
            counters: dict[str, int] = client.stats()["counters"]
        return counters

    def stop(self) -> None:
        self.process.stop(grace=20.0)
        # Its L2 holds the whole dataset: a run of --repeat 3 left 16 GB of them and filled the disk.
        shutil.rmtree(self.l2_path, ignore_errors=True)


def settle() -> None:
    """Lets this process's gRPC threads go idle before the DataLoader forks its workers.

    A fork while a gRPC thread of the parent is busy (the tail of a call just
    made) can crash or hang the child ("Other threads are currently calling
    into gRPC, skipping fork() handlers"). Outside the timed region.
    """
    time.sleep(0.5)


def counter_delta(before: dict[str, int], after: dict[str, int], name: str) -> int:
    return after.get(name, 0) - before.get(name, 0)


def run_variant(
    *,
    work: Path,
    endpoint: str,
    prefix: str,
    mds_remote: str,
    tar_remote: str,
    tar_urls: list[str],
    names: list[str],
    order: list[int],
    epoch: Epoch,
    args: argparse.Namespace,
    variant: str,
) -> dict[str, Any]:
    """Every contender's epoch against `endpoint` (the S3 server, or the proxy in front of it)."""
    results: dict[str, Any] = {}
    collate = as_tensors if args.samples_as == "tensors" else as_list
    loader_args: dict[str, Any] = {"batch_size": args.batch_size, "num_workers": args.workers, "collate_fn": collate}
    n = len(names)
    total_bytes = n * args.sample_bytes
    # Enough room for the whole dataset in both tiers: the warm epochs measure hits.
    l1 = max(2 * total_bytes, 64 << 20)
    l2 = max(3 * total_bytes, 256 << 20)

    def wanted(*contenders: str) -> bool:
        return not args.only or any(c in args.only for c in contenders)

    if wanted("boto3"):
        log(f"  boto3 per sample ({variant})")
        loader = DataLoader(Boto3Samples(endpoint, names), sampler=order, **loader_args)
        results["boto3"] = epoch.run(loader, "boto3")

    name = f"boto3 {IN_FLIGHT} in flight"
    if wanted(name):
        log(f"  boto3, {IN_FLIGHT} in flight per worker ({variant})")
        loader = DataLoader(InFlight(Boto3Samples(endpoint, names)), sampler=order, **loader_args)
        results[name] = epoch.run(loader, name)

    name = f"s3torchconnector {IN_FLIGHT} in flight"
    if wanted("s3torchconnector", name):
        log(f"  s3torchconnector ({variant})")
        s3t = s3torchconnector_dataset(endpoint, prefix)
        results["s3torchconnector"] = epoch.run(DataLoader(s3t, sampler=order, **loader_args), "s3torchconnector")
        log(f"  s3torchconnector, {IN_FLIGHT} in flight per worker ({variant})")
        results[name] = epoch.run(DataLoader(InFlight(s3t), sampler=order, **loader_args), name)

    if wanted("streaming e1", "streaming e2"):
        results.update(_streaming(work, endpoint, mds_remote, epoch, loader_args, variant))
    if wanted("webdataset"):
        log(f"  webdataset over tar shards in S3 ({variant})")
        os.environ["S3_ENDPOINT_URL"] = endpoint  # gopen_s3's endpoint, inherited by the forked workers
        results["webdataset"] = epoch.run(DataLoader(webdataset_dataset(tar_urls), **loader_args), "webdataset")
    if wanted("s3torchconnector tar"):
        log(f"  s3torchconnector S3IterableDataset over tar shards ({variant})")
        tar_loader = DataLoader(S3TorchTarShards(endpoint, f"{tar_remote}/"), **loader_args)
        results["s3torchconnector tar"] = epoch.run(tar_loader, "s3torchconnector tar")
    for label, remote, fmt in [("shards", mds_remote, "mds"), ("tar shards", tar_remote, "webdataset")]:
        cold, warm = f"cachesvc {label} cold", f"cachesvc {label} warm"
        if not wanted(cold, warm):
            continue
        log(f"  cachesvc {label} ({fmt}) cold, then warm ({variant})")
        server = CacheServer(work, endpoint, l1, l2)
        try:
            shards = CachedShardDataset.from_s3(f"{remote}/", format=fmt, cache=server.address, seed=0)
            for epoch_number, name in enumerate((cold, warm)):
                shards.set_epoch(epoch_number)
                before = server.counters()
                settle()
                results[name] = epoch.run(DataLoader(shards, **loader_args), name)
                after = server.counters()
                results[name]["s3_fills"] = counter_delta(before, after, "fills")
                # Reads the server answered: the rest came from its L2 straight (the co-located path).
                results[name]["server_gets"] = counter_delta(before, after, "gets")
                results[name]["shards"] = len(shards.shards)
        finally:
            server.stop()

    if wanted(CEILING, ONE_COPY):
        log(f"  in memory: the ceilings of any reader through this DataLoader ({variant})")
        samples = [body(args.seed, i, args.sample_bytes) for i in range(n)]
        for name, copy in [(CEILING, False), (ONE_COPY, True)]:
            if wanted(name):
                results[name] = epoch.run(DataLoader(InMemory(samples, order, copy), **loader_args), name)
        del samples
    if wanted("cachesvc cold", "cachesvc warm gRPC", "cachesvc warm co-located", "cachesvc cold+prefetch"):
        results.update(_cachesvc(work, endpoint, prefix, order, epoch, loader_args, variant, l1, l2, args))
    return results


def _streaming(
    work: Path, endpoint: str, mds_remote: str, epoch: Epoch, loader_args: dict[str, Any], variant: str
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    log(f"  MosaicML streaming ({variant})")
    streaming = import_streaming()
    os.environ["S3_ENDPOINT_URL"] = endpoint
    streaming.base.util.clean_stale_shared_memory()
    log(f"  MosaicML streaming, first epoch ({variant})")
    sds = streaming.StreamingDataset(
        remote=mds_remote,
        local=str(work / f"mds-cache-{variant}"),
        shuffle=True,
        shuffle_seed=0,
        batch_size=loader_args["batch_size"],
    )
    # The dataset downloaded its index with a boto3 client it keeps; forked workers
    # would inherit that client and share its keep-alive socket, and one of them then
    # waits out the 60 s read timeout. Dropping it makes each worker open its own.
    for stream in sds.streams:
        stream._downloader.clean_up()
    results["streaming e1"] = epoch.run(DataLoader(sds, **loader_args), "streaming e1")
    log(f"  MosaicML streaming, second epoch ({variant})")
    results["streaming e2"] = epoch.run(DataLoader(sds, **loader_args), "streaming e2")
    del sds
    shutil.rmtree(work / f"mds-cache-{variant}", ignore_errors=True)  # the dataset again, as for the L2s
    return results


def _cachesvc(
    work: Path,
    endpoint: str,
    prefix: str,
    order: list[int],
    epoch: Epoch,
    loader_args: dict[str, Any],
    variant: str,
    l1: int,
    l2: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    uri = f"s3://{BUCKET}/{prefix}"

    log(f"  cachesvc cold, then warm ({variant})")
    server = CacheServer(work, endpoint, l1, l2)
    try:
        cold = CachedDataset.from_s3(uri, cache=server.address)
        before = server.counters()
        settle()
        results["cachesvc cold"] = epoch.run(DataLoader(cold, sampler=order, **loader_args), "cachesvc cold")
        after = server.counters()
        results["cachesvc cold"]["s3_fills"] = counter_delta(before, after, "fills")

        warm = CachedDataset(cold._keys, cache=server.address, local_reads=False)
        before = server.counters()
        settle()
        results["cachesvc warm gRPC"] = epoch.run(DataLoader(warm, sampler=order, **loader_args), "warm gRPC")
        after = server.counters()
        results["cachesvc warm gRPC"]["s3_fills"] = counter_delta(before, after, "fills")

        local = CachedDataset(cold._keys, cache=server.address, local_reads=True)
        before = server.counters()
        settle()
        results["cachesvc warm co-located"] = epoch.run(
            DataLoader(local, sampler=order, **loader_args), "warm co-located"
        )
        after = server.counters()
        # Reads the server answered during the co-located epoch: ~0 when the workers read L2 themselves.
        results["cachesvc warm co-located"]["server_gets"] = counter_delta(before, after, "gets")
    finally:
        server.stop()

    log(f"  cachesvc cold with sampler-order prefetch ({variant})")
    server = CacheServer(work, endpoint, l1, l2)
    try:
        cold = CachedDataset.from_s3(uri, cache=server.address)
        before = server.counters()
        settle()
        with cold.prefetch_epoch(order, window_bytes=args.window_mib << 20):
            result = epoch.run(DataLoader(cold, sampler=order, **loader_args), "cold+prefetch")
        after = server.counters()
        gets = counter_delta(before, after, "gets")
        result["demand_hit_ratio"] = round(1 - counter_delta(before, after, "hits_l3") / max(gets, 1), 3)
        result["prefetched_bytes"] = counter_delta(before, after, "prefetched_bytes")
        results["cachesvc cold+prefetch"] = result
    finally:
        server.stop()
    return results


# -- setup -----------------------------------------------------------------------


def body(seed: int, index: int, size: int) -> bytes:
    """Sample `index` of a dataset: random bytes, the same every time."""
    return random.Random(seed * 1_000_003 + index).randbytes(size)


def write_dataset(s3: Any, prefix: str, n: int, size: int, seed: int) -> tuple[list[str], int]:
    """N objects of random bytes under `prefix`, with cachesvc's xxh3 metadata; (names, digest)."""
    names = [f"{prefix}{i:06d}.bin" for i in range(n)]

    def put(index: int) -> int:
        value = body(seed, index, size)
        value_digest = xxhash.xxh3_64_intdigest(value)
        s3.put_object(Bucket=BUCKET, Key=names[index], Body=value, Metadata=checksum_metadata(value_digest))
        return value_digest

    with ThreadPoolExecutor(8) as pool:
        total = sum(pool.map(put, range(n))) % (1 << 64)
    return names, total


def write_mds(n: int, size: int, seed: int, remote: str, work: Path) -> None:
    """The same samples as MDS shards (MosaicML's format), uploaded to `remote`."""
    streaming = import_streaming()
    local = work / f"mds-out-{uuid.uuid4().hex[:6]}"
    with streaming.MDSWriter(out=(str(local), remote), columns={"data": "bytes"}, compression=None) as writer:
        for i in range(n):
            writer.write({"data": body(seed, i, size)})


def mds_shard_bytes(s3: Any, mds_prefix: str) -> list[int]:
    index = json.loads(s3.get_object(Bucket=BUCKET, Key=f"{mds_prefix}/index.json")["Body"].read())
    return [int(shard["raw_data"]["bytes"]) for shard in index["shards"]]


def write_tar(s3: Any, n: int, size: int, seed: int, mds_prefix: str, tar_prefix: str) -> tuple[list[str], list[int]]:
    """The same samples as WebDataset tar shards, one per MDS shard with that shard's samples; (keys, sizes)."""
    import webdataset as wds

    index = json.loads(s3.get_object(Bucket=BUCKET, Key=f"{mds_prefix}/index.json")["Body"].read())
    counts = [int(shard["samples"]) for shard in index["shards"]]
    assert sum(counts) == n, (counts, n)
    keys: list[str] = []
    sizes: list[int] = []
    first = 0
    for number, count in enumerate(counts):
        out = io.BytesIO()
        with wds.TarWriter(out) as tar:
            for i in range(first, first + count):
                tar.write({"__key__": f"{i:06d}", "data": body(seed, i, size)})
        first += count
        keys.append(f"{tar_prefix}/shard-{number:05d}.tar")
        s3.put_object(Bucket=BUCKET, Key=keys[-1], Body=out.getvalue())
        sizes.append(len(out.getvalue()))
    return keys, sizes


@contextlib.contextmanager
def latency_proxy(upstream: str, delay_ms: float, work: Path) -> Iterator[str]:
    """`bench/latency_proxy.py` in its own process; yields its endpoint."""
    argv = [sys.executable, str(BENCH_DIR / "latency_proxy.py"), "--upstream", upstream, "--delay-ms", str(delay_ms)]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=open(work / "proxy.log", "wb"), text=True)  # noqa: SIM115
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)


# -- report ----------------------------------------------------------------------


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each contender's median run of `runs` (by samples/s), with every run's samples/s when there were several."""
    merged: dict[str, Any] = {}
    for contender in runs[0]:
        epochs = [run[contender] for run in runs]
        merged[contender] = dict(sorted(epochs, key=lambda e: e["samples_per_s"])[len(epochs) // 2])
        if len(epochs) > 1:
            merged[contender]["runs_samples_per_s"] = [e["samples_per_s"] for e in epochs]
    return merged


def ratios(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, per dataset, as measured ratios."""

    def rate(dataset: str, variant: str, contender: str) -> float:
        return float(results[dataset][variant][contender]["samples_per_s"])

    def measured(dataset: str, *contenders: str) -> bool:
        return all(c in results[dataset][v] for v in ("direct", "proxy") for c in contenders)

    checks = []
    for dataset in results:
        for numerator, denominator, variant, target in [
            # Issue 27: sharded datasets against MosaicML streaming over the same MDS shards, and
            # against webdataset reading the same samples as tar shards from S3.
            ("cachesvc shards cold", "streaming e1", "direct", 1.0),
            ("cachesvc shards cold", "streaming e1", "proxy", 1.0),
            ("cachesvc shards warm", "streaming e2", "direct", 1.2),
            ("cachesvc shards warm", "streaming e2", "proxy", 1.2),
            ("cachesvc tar shards cold", "streaming e1", "direct", 1.0),
            ("cachesvc tar shards cold", "streaming e1", "proxy", 1.0),
            ("cachesvc tar shards cold", "webdataset", "direct", 1.5),
            ("cachesvc tar shards cold", "webdataset", "proxy", 1.5),
            ("cachesvc tar shards warm", "streaming e2", "direct", 1.2),
            ("cachesvc tar shards warm", "streaming e2", "proxy", 1.2),
            ("cachesvc warm gRPC", "s3torchconnector", "proxy", 5.0),
            ("cachesvc warm gRPC", "s3torchconnector", "direct", 3.0),
            ("cachesvc warm co-located", "s3torchconnector", "proxy", 5.0),
            ("cachesvc warm co-located", "s3torchconnector", "direct", 3.0),
            ("cachesvc warm co-located", "streaming e2", "direct", 1.0),
            ("cachesvc warm co-located", "streaming e2", "proxy", 1.0),
            ("cachesvc cold+prefetch", "s3torchconnector", "proxy", 2.0),
        ]:
            if not measured(dataset, numerator, denominator):
                continue
            name = f"{numerator} / {denominator}, {'20 ms proxy' if variant == 'proxy' else 'no proxy'}"
            ratio = rate(dataset, variant, numerator) / rate(dataset, variant, denominator)
            check = {"dataset": dataset, "ratio": name, "value": round(ratio, 2), "target": target}
            check["met"] = ratio >= target
            for key, ceiling in [("ceiling", CEILING), ("ceiling_one_copy", ONE_COPY)]:
                if ceiling in results[dataset][variant]:
                    # The most any reader (that copies each sample once) could reach against this denominator.
                    check[key] = round(rate(dataset, variant, ceiling) / rate(dataset, variant, denominator), 2)
            checks.append(check)
        # Issue 15: the first epoch at least as fast as the best direct reader at its best setting.
        direct_readers = [
            "boto3",
            f"boto3 {IN_FLIGHT} in flight",
            "s3torchconnector",
            f"s3torchconnector {IN_FLIGHT} in flight",
        ]
        for numerator in ("cachesvc cold", "cachesvc cold+prefetch"):
            if not measured(dataset, numerator, *direct_readers):
                continue
            for variant in ("direct", "proxy"):
                best = max(direct_readers, key=lambda c: rate(dataset, variant, c))
                ratio = rate(dataset, variant, numerator) / rate(dataset, variant, best)
                name = (
                    f"{numerator} / best direct reader ({best}), {'20 ms proxy' if variant == 'proxy' else 'no proxy'}"
                )
                checks.append(
                    {"dataset": dataset, "ratio": name, "value": round(ratio, 2), "target": 1.0, "met": ratio >= 1.0}
                )
    return checks


def shard_ratios(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each of our sharded epochs against each other sharded contender measured, per dataset and variant."""
    rows = []
    for dataset, variants in results.items():
        for variant, measured in variants.items():
            for ours in [*OUR_SHARDS, CEILING, ONE_COPY]:
                if ours not in measured:
                    continue
                for other in SHARD_CONTENDERS:
                    if other in measured:
                        value = measured[ours]["samples_per_s"] / measured[other]["samples_per_s"]
                        row = {"dataset": dataset, "variant": variant, "ours": ours, "vs": other}
                        rows.append(row | {"value": round(value, 2)})
    return rows


def print_table(results: dict[str, Any]) -> None:
    for dataset, variants in results.items():
        print(f"\n{dataset}")
        print(f"{'contender':<26} {'samples/s':>10} {'MB/s':>8}   {'+20ms samples/s':>15} {'MB/s':>8}")
        for contender in CONTENDERS:
            if contender not in variants["direct"]:
                continue
            direct, proxy = variants["direct"][contender], variants["proxy"][contender]
            print(
                f"{contender:<26} {direct['samples_per_s']:>10,.0f} {direct['MB_per_s']:>8,.1f}   "
                f"{proxy['samples_per_s']:>15,.0f} {proxy['MB_per_s']:>8,.1f}"
            )


def plot(results: dict[str, Any], path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 5.5), squeeze=False)
    for ax, (dataset, variants) in zip(axes[0], results.items(), strict=True):
        shown = [c for c in CONTENDERS if c in variants["direct"]]
        xs = range(len(shown))
        width = 0.4
        for offset, variant, label in [(-width / 2, "direct", "S3 as is"), (width / 2, "proxy", "S3 + 20 ms")]:
            values = [variants[variant][c]["samples_per_s"] for c in shown]
            bars = ax.bar([x + offset for x in xs], values, width, label=label)
            ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=7, rotation=90, padding=2)
        ax.set_yscale("log")
        ax.set_xticks(list(xs), shown, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("samples/s (log)")
        ax.set_title(f"one epoch, {dataset}")
        ax.legend()
    fig.suptitle(f"DataLoader epoch: batch {args.batch_size}, {args.workers} workers, samples as {args.samples_as}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--samples", type=int, default=4000, help="samples of the small dataset (issue: 20000)")
    parser.add_argument("--sample-kib", type=int, default=100)
    parser.add_argument("--large-samples", type=int, default=400, help="samples of the large dataset (issue: 2000)")
    parser.add_argument("--large-kib", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--window-mib", type=int, default=256, help="prefetch window (default 256 MiB)")
    parser.add_argument(
        "--samples-as",
        choices=["tensors", "bytes"],
        default="tensors",
        help="what the workers hand to the training loop: uint8 tensors (shared memory; default) or bytes (pickled)",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs of every contender, alternating; the median run is reported"
    )
    parser.add_argument("--quick", action="store_true", help="1,000 x 100 KiB and 100 x 1 MiB")
    parser.add_argument(
        "--only", type=lambda text: set(filter(None, text.split(","))), default=set(),
        help="comma-separated contenders to run (default: all)",
    )  # fmt: skip
    parser.add_argument(
        "--server-env", action="append", default=[], metavar="CACHESVC_NAME=VALUE",
        help="a setting every cache server of the run starts with (old against new: CACHESVC_L2_FILL_IDLE_SECONDS=0)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "dataloader.json")
    args = parser.parse_args()
    for setting in args.server_env:
        name, _, value = setting.partition("=")
        if not name.startswith("CACHESVC_") or not _:
            parser.error(f"--server-env {setting!r}: expected CACHESVC_NAME=VALUE")
        CacheServer.extra_env[name] = value
    faulthandler.enable()
    if args.quick:
        args.samples, args.large_samples = 1000, 100

    os.environ.setdefault("AWS_ACCESS_KEY_ID", S3_ACCESS_KEY)
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", S3_SECRET_KEY)
    os.environ.setdefault("AWS_REGION", "us-east-1")
    machine = machine_info()
    began = time.monotonic()
    results: dict[str, Any] = {}
    details: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="bench-dataloader-"))
    log(f"work directory (logs; removed after a successful run): {work}")
    weed = SeaweedFS(work / "s3", SeaweedPorts.free())
    log("starting SeaweedFS")
    weed.start()
    try:
        weed.create_bucket(BUCKET)
        s3 = s3_client(weed.endpoint)
        with latency_proxy(weed.endpoint.removeprefix("http://"), args.delay_ms, work) as proxy:
            for n, kib in [(args.samples, args.sample_kib), (args.large_samples, args.large_kib)]:
                label = f"{n} x {kib} KiB"
                args.sample_bytes = kib << 10
                args.seed = kib  # of every copy of the samples: objects, shards, and the ceilings' in memory
                prefix = f"ds-{kib}k/"
                log(f"writing {label} to S3, and as MDS and tar shards")
                names, expected_digest = write_dataset(s3, prefix, n, kib << 10, seed=args.seed)
                mds_remote = f"s3://{BUCKET}/mds-{kib}k"
                os.environ["S3_ENDPOINT_URL"] = weed.endpoint
                write_mds(n, kib << 10, args.seed, mds_remote, work)
                tar_keys, tar_bytes = write_tar(s3, n, kib << 10, args.seed, f"mds-{kib}k", f"wds-{kib}k")
                tar_remote = f"s3://{BUCKET}/wds-{kib}k"
                tar_urls = [f"s3://{BUCKET}/{key}" for key in tar_keys]
                order = list(range(n))
                random.Random(0).shuffle(order)
                epoch = Epoch(n, n * (kib << 10), expected_digest)
                runs: dict[str, list[dict[str, Any]]] = {"direct": [], "proxy": []}
                for repeat in range(args.repeat):
                    for variant, endpoint in [("direct", weed.endpoint), ("proxy", proxy)]:
                        log(f"{label}: {variant}" + (f", run {repeat + 1} of {args.repeat}" if args.repeat > 1 else ""))
                        runs[variant].append(
                            run_variant(
                                work=work,
                                endpoint=endpoint,
                                prefix=prefix,
                                mds_remote=mds_remote,
                                tar_remote=tar_remote,
                                tar_urls=tar_urls,
                                names=names,
                                order=order,
                                epoch=epoch,
                                args=args,
                                variant=f"{variant}-{kib}k-{repeat}",
                            )
                        )
                results[label] = {variant: median_run(variant_runs) for variant, variant_runs in runs.items()}
                details[label] = {
                    "samples": n,
                    "sample_bytes": kib << 10,
                    "tar_shard_bytes": tar_bytes,
                    "mds_shard_bytes": mds_shard_bytes(s3, f"mds-{kib}k"),
                }
    finally:
        weed.stop(grace=10.0)

    shutil.rmtree(work, ignore_errors=True)
    checks = ratios(results)
    by_shard = shard_ratios(results)
    report = {
        "benchmark": "dataloader",
        "command": "python " + " ".join([str(Path(sys.argv[0])), *sys.argv[1:]]),
        "config": {
            "batch_size": args.batch_size,
            "workers": args.workers,
            "start_method": "fork",
            "samples_as": args.samples_as,
            "contenders": sorted(args.only) if args.only else "all",
            "delay_ms": args.delay_ms,
            "repeat": args.repeat,
            "prefetch_window_bytes": args.window_mib << 20,
            "server_env": CacheServer.extra_env,
            "datasets": details,
            "scaled_down_from": "20,000 x 100 KiB and 2,000 x 1 MiB (issue 5)",
        },
        "machine": machine,
        "loadavg_at_end": list(os.getloadavg()),
        "elapsed_s": round(time.monotonic() - began, 1),
        "results": results,
        "targets": checks,
        "shard_ratios": by_shard,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(results, args.out.with_suffix(".png"), args)
    print_table(results)
    print()
    for check in checks:
        mark = "met" if check["met"] else "MISSED"
        ceiling = "".join(
            f", {label} {check[key]:.2f}x"
            for key, label in [("ceiling", "ceiling"), ("ceiling_one_copy", "one copy")]
            if key in check
        )
        print(
            f"{check['dataset']:<18} {check['ratio']:<50} {check['value']:>6.2f}x "
            f"(target {check['target']}x{ceiling}) {mark}"
        )
    if by_shard:
        print("\nsharded: ours / theirs (samples/s)")
        for row in by_shard:
            variant = "20 ms proxy" if row["variant"] == "proxy" else "no proxy"
            print(f"{row['dataset']:<18} {variant:<12} {row['ours']:<26} / {row['vs']:<22} {row['value']:>6.2f}x")
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png')} in {report['elapsed_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
