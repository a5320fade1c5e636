"""Where a cold sharded epoch's CPU goes: `CachedShardDataset` against `webdataset` and MosaicML streaming (issue 27).

`bench/dataloader.py` times the epochs; this one counts what each process
spent on them, because on a 2-core machine the cache server, the S3 server
and the DataLoader workers share the cores and a cold epoch is bound by their
sum, not by any one of them. For each contender and run it reports samples/s,
the time to the first batch, and CPU seconds (user + system) of:

* the loader: the DataLoader's workers (reaped when the epoch ends) and the
  main process that receives the batches;
* the cache server (ours only; its system time apart, since most of it is the
  kernel faulting in fresh pages for the values it fills);
* SeaweedFS, the S3 server, which serves the same bytes to both.

Ours runs twice: as configured by default, where the L2 copies of what the
epoch fills wait until the server is quiet (`l2.fill_idle_seconds`; the
CPU they take once the epoch is over is counted apart, `cache_server_after`,
and in `total_with_after`), and with them written during the epoch, behind
each read (`CACHESVC_L2_FILL_IDLE_SECONDS=0`, the behaviour before).

All read the dataset `bench/dataloader.py` builds (the same samples as MDS
shards and as tar shards of about 64 MiB, one per MDS shard), 2 workers,
batches of 32: webdataset with its documented S3 reader (`gopen` over a
boto3 stream) and ours with the same shuffle buffer (256 samples, the first
out after 64), ours cold on a fresh server with L1 and L2 twice and three
times the dataset, streaming's first epoch over the MDS shards into a fresh
local directory (its downloads run in the workers, its writes of the shards
to local disk included), as there. The page
cache is as the machine has it: on this VM, memory the kernel has not handed
out before costs several times more to fault in, so runs vary; alternate them
(`--repeat`).

With `--per-sample` it does the same for a cold epoch over one object per
sample (issue 23's cold co-located target): the best direct reader of
`bench/dataloader.py`, s3torchconnector's `S3MapDataset` with 16 samples in
flight per worker, against `CachedDataset` on a fresh co-located server
(32 S3 requests in flight on each side), in the same shuffled order.

    .venv/bin/python bench/shards_cpu.py                          # 4,000 x 100 KiB, 2 runs each
    .venv/bin/python bench/shards_cpu.py --samples 400 --kib 1024
    .venv/bin/python bench/shards_cpu.py --per-sample --out bench/results/per_sample_cpu.json

Writes bench/results/shards_cpu.json (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dataloader import (
    BUCKET,
    CacheServer,
    Epoch,
    InFlight,
    as_tensors,
    import_streaming,
    s3torchconnector_dataset,
    settle,
    webdataset_dataset,
    write_dataset,
    write_mds,
    write_tar,
)
from tiers import machine_info

from cacheclient.torch import CachedDataset, CachedShardDataset
from cachesvc.devcluster.seaweed import S3_ACCESS_KEY, S3_SECRET_KEY, SeaweedFS, SeaweedPorts, s3_client

BENCH_DIR = Path(__file__).resolve().parent


def cpu(process: psutil.Process) -> tuple[float, float]:
    """(user, system) CPU seconds of `process` so far."""
    times = process.cpu_times()
    return times.user, times.system


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run(
    name: str, loader: DataLoader[Any], epoch: Epoch, weed: psutil.Process, server: CacheServer | None = None
) -> dict[str, Any]:
    settle()
    process = psutil.Process(server.process.proc.pid) if server is not None else None
    weed_before, server_before = cpu(weed), cpu(process) if process is not None else (0.0, 0.0)
    workers_before, main_before = children_cpu(), self_cpu()
    result = epoch.run(loader, name)
    del loader  # its workers are joined and reaped: their CPU is in RUSAGE_CHILDREN
    weed_after, server_after = cpu(weed), cpu(process) if process is not None else (0.0, 0.0)
    result["cpu_s"] = {
        "loader_workers": round(children_cpu() - workers_before, 2),
        "loader_main": round(self_cpu() - main_before, 2),
        "cache_server": round(sum(server_after) - sum(server_before), 2),
        "cache_server_system": round(server_after[1] - server_before[1], 2),
        "s3_server": round(sum(weed_after) - sum(weed_before), 2),
    }
    result["cpu_s"]["total"] = round(sum(v for k, v in result["cpu_s"].items() if k != "cache_server_system"), 2)
    if server is not None and process is not None:
        ended = time.monotonic()
        # A copy leaves the count once it is written: 0 means all are on disk.
        while server.counters().get("l2_fills_deferred", 0) and time.monotonic() < ended + 120.0:
            time.sleep(0.2)
        result["l2_copies_done_after_s"] = round(time.monotonic() - ended, 1)
        result["cpu_s"]["cache_server_after"] = round(sum(cpu(process)) - sum(server_after), 2)
        result["cpu_s"]["total_with_after"] = round(result["cpu_s"]["total"] + result["cpu_s"]["cache_server_after"], 2)
    return result


def streaming_loader(work: Path, repeat: int, loader_args: dict[str, Any]) -> DataLoader[Any]:
    """MosaicML streaming's first epoch over the MDS shards, into a fresh local cache (as `bench/dataloader.py`)."""
    streaming = import_streaming()
    streaming.base.util.clean_stale_shared_memory()
    dataset = streaming.StreamingDataset(
        remote=f"s3://{BUCKET}/mds",
        local=str(work / f"mds-cache-{repeat}"),
        shuffle=True,
        shuffle_seed=0,
        batch_size=loader_args["batch_size"],
    )
    for stream in dataset.streams:  # each forked worker opens its own S3 client (see bench/dataloader.py)
        stream._downloader.clean_up()
    return DataLoader(dataset, **loader_args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--kib", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--per-sample", action="store_true", help="a cold epoch of one object per sample instead")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "shards_cpu.json")
    args = parser.parse_args()
    for name, value in [("AWS_ACCESS_KEY_ID", S3_ACCESS_KEY), ("AWS_SECRET_ACCESS_KEY", S3_SECRET_KEY)]:
        os.environ.setdefault(name, value)
    os.environ.setdefault("AWS_REGION", "us-east-1")
    machine = machine_info()
    n, size = args.samples, args.kib << 10
    work = Path(tempfile.mkdtemp(prefix="bench-shards-cpu-"))
    weed = SeaweedFS(work / "s3", SeaweedPorts.free())
    weed.start()
    ours, inline = "cachesvc tar shards cold", "cachesvc tar shards cold, L2 during the epoch"
    direct = "s3torchconnector 16 in flight"
    if args.per_sample:
        ours, inline = "cachesvc cold", "cachesvc cold, L2 during the epoch"
        runs: dict[str, list[dict[str, Any]]] = {direct: [], ours: [], inline: []}
    else:
        runs = {"webdataset": [], "streaming e1": [], ours: [], inline: []}
    try:
        weed.create_bucket(BUCKET)
        s3 = s3_client(weed.endpoint)
        _, digest = write_dataset(s3, "ds/", n, size, seed=args.kib)
        os.environ["S3_ENDPOINT_URL"] = weed.endpoint  # the MDS writer's, and webdataset's gopen in the workers
        tar_keys: list[str] = []
        if not args.per_sample:
            write_mds(n, size, args.kib, f"s3://{BUCKET}/mds", work)
            tar_keys, _ = write_tar(s3, n, size, args.kib, "mds", "wds")
        sample_order = list(range(n))
        random.Random(0).shuffle(sample_order)  # as bench/dataloader.py's per-sample epochs
        epoch = Epoch(n, n * size, digest)
        weed_process = psutil.Process(weed.pid)
        loader_args: dict[str, Any] = {"batch_size": 32, "num_workers": 2, "collate_fn": as_tensors}
        urls = [f"s3://{BUCKET}/{key}" for key in tar_keys]
        for repeat in range(args.repeat):
            order = list(runs)
            random.Random(repeat).shuffle(order)
            for name in order:
                if name == direct:
                    loader = DataLoader(
                        InFlight(s3torchconnector_dataset(weed.endpoint, "ds/")), sampler=sample_order, **loader_args
                    )
                    result = run(name, loader, epoch, weed_process, None)
                elif name == "webdataset":
                    loader = DataLoader(webdataset_dataset(urls), **loader_args)
                    result = run(name, loader, epoch, weed_process, None)
                elif name == "streaming e1":
                    result = run(name, streaming_loader(work, repeat, loader_args), epoch, weed_process, None)
                    shutil.rmtree(work / f"mds-cache-{repeat}", ignore_errors=True)
                else:
                    env = {"CACHESVC_L2_FILL_IDLE_SECONDS": "0"} if name == inline else None
                    server = CacheServer(work, weed.endpoint, 2 * n * size, 3 * n * size, env)
                    try:
                        if args.per_sample:
                            samples = CachedDataset.from_s3(f"s3://{BUCKET}/ds/", cache=server.address)
                            loader = DataLoader(samples, sampler=sample_order, **loader_args)
                        else:
                            dataset = CachedShardDataset.from_s3(
                                f"s3://{BUCKET}/wds/", format="webdataset", cache=server.address, seed=0
                            )
                            loader = DataLoader(dataset, **loader_args)
                        result = run(name, loader, epoch, weed_process, server)
                    finally:
                        server.stop()
                runs[name].append(result)
                print(f"{name}: {result['samples_per_s']} samples/s, first batch {result['first_batch_s']} s, "
                      f"CPU s {result['cpu_s']}", flush=True)  # fmt: skip
    finally:
        weed.stop(grace=10.0)
        shutil.rmtree(work, ignore_errors=True)

    def median(name: str, field: str, sub: str | None = None) -> float:
        return statistics.median(r[field][sub] if sub else r[field] for r in runs[name])

    summary: dict[str, Any] = {
        "cpu_s_median": {n: {k: median(n, "cpu_s", k) for k in runs[n][0]["cpu_s"]} for n in runs}
    }
    for theirs in (direct, inline) if args.per_sample else ("webdataset", "streaming e1", inline):
        speed = round(median(ours, "samples_per_s") / median(theirs, "samples_per_s"), 2)
        cost = round(median(ours, "cpu_s", "total") / median(theirs, "cpu_s", "total"), 2)
        whole = "total_with_after" if theirs == inline else "total"
        after = round(median(ours, "cpu_s", "total_with_after") / median(theirs, "cpu_s", whole), 2)
        summary[f"vs {theirs}"] = {"samples_per_s_ratio": speed, "cpu_total_ratio": cost, "cpu_with_after": after}
        print(f"ours / {theirs}: {speed}x the samples/s for {cost}x the CPU seconds ({after}x with L2 copies after)")
    report = {
        "benchmark": "shards_cpu",
        "command": "python " + " ".join([str(Path(sys.argv[0])), *sys.argv[1:]]),
        "config": {
            "samples": n,
            "sample_bytes": size,
            "workers": 2,
            "batch_size": 32,
            "repeat": args.repeat,
            "per_sample": args.per_sample,
        },
        "machine": machine,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "runs": runs,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
