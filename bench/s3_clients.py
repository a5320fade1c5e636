"""S3 client cost: client CPU per object and per GiB for each candidate L3 client, against the real S3 server.

Issue 15 moves the L3 tier off boto3. This measures the candidates inside
one process on this machine, as the cache server would run them, against a
SeaweedFS started here (127.0.0.1, its own temp dir), on the same objects:

* boto3: `get_object(...)["Body"].read()` / `put_object`, one client shared
  by the threads (boto3 clients are thread-safe), cachesvc's botocore
  settings (`cacheclient.wire.s3_config`, 64 pooled connections);
* obstore: `obstore.get(store, name).bytes()` / `obstore.put`, one
  `S3Store` shared by the threads (Rust's object_store, tokio underneath);
* awscrt: the AWS common runtime's `S3Client` (what s3torchconnector uses),
  one meta request per object, each thread waiting on its own;
* S3Tier: `cachesvc.tiers.S3Tier.get` / `put` as the server calls them:
  object naming, the first ranged GET, the xxh3 check, metadata on put.

Every contender runs 16 requests in flight (16 threads, each with its own
slice of the object list, so no dispatch queue is measured), GETs of every
seeded object, then PUTs of half as many. Objects are random bytes carrying
cachesvc's xxh3 metadata, as the cache writes them; every GET's length is
checked. Client CPU is `time.process_time()` of this process over the run:
every thread, Python's and the client library's own (tokio, CRT event loops).
The S3 server's CPU over the same run is read from /proc and reported beside
it, since it shares the machine's cores and bounds the objects per second.

The contenders take turns over several rounds (order rotating); the table
gives each one's median round.

Usage:
    python bench/s3_clients.py            # about 3 minutes on 2 cores
    python bench/s3_clients.py --quick    # under a minute

Writes `bench/results/s3_clients.json` and prints the table.
`bench/results/s3_clients.before-obstore.json` is the same run with the
S3Tier of the commit before it moved to obstore (boto3 throughout).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import boto3

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cacheclient.wire import checksum, checksum_metadata, s3_config
from cachesvc.devcluster.seaweed import S3_ACCESS_KEY, S3_SECRET_KEY, SeaweedFS, s3_client
from cachesvc.tiers import S3Tier

BENCH_DIR = Path(__file__).resolve().parent
BUCKET = "cachesvc-bench"
IN_FLIGHT = 16
REGION = "us-east-1"

Get = Callable[[str], int]  # object name -> bytes read
Put = Callable[[str, bytes, dict[str, str]], None]  # name, value, user metadata


class Contender:
    """One client under test: a GET and a PUT of a whole object by name."""

    def __init__(self, name: str, get: Get, put: Put, close: Callable[[], None] = lambda: None) -> None:
        self.name = name
        self.get = get
        self.put = put
        self.close = close


def boto3_contender(endpoint: str) -> Contender:
    client: Any = boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=S3_ACCESS_KEY,
        aws_secret_access_key=S3_SECRET_KEY,
        config=s3_config(max_pool_connections=64),
    )

    def get(name: str) -> int:
        return len(client.get_object(Bucket=BUCKET, Key=name)["Body"].read())

    def put(name: str, value: bytes, meta: dict[str, str]) -> None:
        client.put_object(Bucket=BUCKET, Key=name, Body=value, Metadata=meta)

    return Contender("boto3", get, put, client.close)


def obstore_contender(endpoint: str) -> Contender:
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        BUCKET,
        endpoint=endpoint,
        region=REGION,
        access_key_id=S3_ACCESS_KEY,
        secret_access_key=S3_SECRET_KEY,
        virtual_hosted_style_request=False,
        client_options={"allow_http": True, "pool_max_idle_per_host": "64"},
    )

    def get(name: str) -> int:
        return len(obstore.get(store, name).bytes())

    def put(name: str, value: bytes, meta: dict[str, str]) -> None:
        obstore.put(store, name, value, attributes=meta, use_multipart=False)

    return Contender("obstore", get, put)


def awscrt_contender(endpoint: str) -> Contender:
    from awscrt.auth import AwsCredentialsProvider
    from awscrt.http import HttpHeaders, HttpRequest
    from awscrt.io import ClientBootstrap, DefaultHostResolver, EventLoopGroup
    from awscrt.s3 import S3Client, S3RequestTlsMode, S3RequestType

    host = endpoint.removeprefix("http://")
    loops = EventLoopGroup()
    client = S3Client(
        bootstrap=ClientBootstrap(loops, DefaultHostResolver(loops)),
        region=REGION,
        tls_mode=S3RequestTlsMode.DISABLED,
        credential_provider=AwsCredentialsProvider.new_static(S3_ACCESS_KEY, S3_SECRET_KEY),
        part_size=8 << 20,
        throughput_target_gbps=10.0,
    )

    def get(name: str) -> int:
        chunks: list[tuple[int, bytes]] = []
        status: list[int] = []
        request = client.make_request(
            type=S3RequestType.GET_OBJECT,
            request=HttpRequest("GET", f"/{BUCKET}/{name}", HttpHeaders([("Host", host)])),
            on_headers=lambda status_code, headers, **_: status.append(status_code),
            on_body=lambda chunk, offset, **_: chunks.append((offset, chunk)),
        )
        request.finished_future.result(60)
        if status[-1] != 200:
            raise RuntimeError(f"awscrt GET {name}: HTTP {status[-1]}")
        chunks.sort(key=lambda c: c[0])
        return len(b"".join(c for _, c in chunks))

    def put(name: str, value: bytes, meta: dict[str, str]) -> None:
        import io

        headers = [("Host", host), ("Content-Length", str(len(value)))]
        headers += [(f"x-amz-meta-{k}", v) for k, v in meta.items()]
        request = client.make_request(
            type=S3RequestType.PUT_OBJECT,
            request=HttpRequest("PUT", f"/{BUCKET}/{name}", HttpHeaders(headers), io.BytesIO(value)),
        )
        request.finished_future.result(60)

    return Contender("awscrt", get, put)


def tier_contender(endpoint: str) -> Contender:
    tier = S3Tier(endpoint=endpoint, bucket=BUCKET, access_key=S3_ACCESS_KEY, secret_key=S3_SECRET_KEY)

    def get(name: str) -> int:
        entry = tier.get(name.encode())
        assert entry is not None, name
        return len(entry.value)

    def put(name: str, value: bytes, meta: dict[str, str]) -> None:
        del meta  # the tier writes its own
        tier.put(name.encode(), value, checksum(value))

    return Contender("S3Tier", get, put, tier.close)


CONTENDERS: dict[str, Callable[[str], Contender]] = {
    "boto3": boto3_contender,
    "obstore": obstore_contender,
    "awscrt": awscrt_contender,
    "S3Tier": tier_contender,
}


# -- measuring -------------------------------------------------------------


def cpu_seconds_of(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def in_flight(work: Callable[[str], Any], names: Sequence[str]) -> None:
    """Calls `work(name)` for every name, IN_FLIGHT at a time (each thread its own slice)."""
    errors: list[BaseException] = []

    def run(mine: Sequence[str]) -> None:
        try:
            for name in mine:
                work(name)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(names[i::IN_FLIGHT],)) for i in range(IN_FLIGHT)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def measure(work: Callable[[str], Any], names: Sequence[str], size: int, server_pid: int) -> dict[str, float]:
    server_cpu = cpu_seconds_of(server_pid)
    cpu = time.process_time()
    wall = time.perf_counter()
    in_flight(work, names)
    wall = time.perf_counter() - wall
    cpu = time.process_time() - cpu
    server_cpu = cpu_seconds_of(server_pid) - server_cpu
    n = len(names)
    gib = n * size / (1 << 30)
    return {
        "objects_per_s": n / wall,
        "mib_per_s": n * size / (1 << 20) / wall,
        "client_cpu_ms_per_object": cpu / n * 1e3,
        "client_cpu_s_per_gib": cpu / gib,
        "s3_server_cpu_ms_per_object": server_cpu / n * 1e3,
    }


def one_round(c: Contender, names: Sequence[str], size: int, server_pid: int) -> tuple[dict[str, float], ...]:
    """GETs of every object in `names`, then PUTs of half as many new ones."""

    def get(name: str) -> None:
        if c.get(name) != size:
            raise AssertionError(f"{c.name}: {name} read back short")

    value = os.urandom(size)
    meta = checksum_metadata(checksum(value))
    run = uuid.uuid4().hex[:8]
    puts = [f"put-{size}/{c.name}/{run}/{i:06d}" for i in range(len(names) // 2)]
    return measure(get, names, size, server_pid), measure(lambda n: c.put(n, value, meta), puts, size, server_pid)


def seed(endpoint: str, names: Sequence[str], size: int) -> None:
    client: Any = s3_client(endpoint)

    def put(name: str) -> None:
        value = os.urandom(size)
        client.put_object(Bucket=BUCKET, Key=name, Body=value, Metadata=checksum_metadata(checksum(value)))

    in_flight(put, names)


def median_round(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in rounds), 3) for k in rounds[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer objects and two rounds")
    parser.add_argument("--only", nargs="*", choices=list(CONTENDERS), help="contenders to run (default: all)")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "s3_clients.json")
    args = parser.parse_args()
    counts = {100 << 10: 400, 1 << 20: 80} if args.quick else {100 << 10: 1500, 1 << 20: 240}
    rounds = 2 if args.quick else 3
    chosen = args.only or list(CONTENDERS)
    if "awscrt" in chosen and importlib.util.find_spec("awscrt") is None:
        print("awscrt is not installed (pip install 'cachesvc[bench]'): running without it", file=sys.stderr)
        chosen.remove("awscrt")
    began = time.monotonic()

    work = Path(tempfile.mkdtemp(prefix="bench-s3-clients-"))
    weed = SeaweedFS.on_free_ports(work / "s3")
    results: dict[str, Any] = {}
    try:
        weed.create_bucket(BUCKET)
        assert weed.process is not None
        server_pid = weed.process.pid
        contenders = {name: CONTENDERS[name](weed.endpoint) for name in chosen}
        for size, n in counts.items():
            label = f"{size >> 10} KiB" if size < (1 << 20) else f"{size >> 20} MiB"
            names = [f"get-{size}/{i:06d}" for i in range(n)]
            print(f"seeding {n} x {label}", file=sys.stderr)
            seed(weed.endpoint, names, size)
            for c in contenders.values():  # connections up, lazy imports done
                in_flight(c.get, names[:IN_FLIGHT])
            runs: dict[str, dict[str, list[dict[str, float]]]] = {c: {"get": [], "put": []} for c in contenders}
            for r in range(rounds):
                order = chosen[r % len(chosen) :] + chosen[: r % len(chosen)]
                for name in order:
                    get, put = one_round(contenders[name], names, size, server_pid)
                    runs[name]["get"].append(get)
                    runs[name]["put"].append(put)
                    print(f"round {r + 1}/{rounds} {label} {name}: get {get}", file=sys.stderr)
            results[label] = {
                "objects": {"get": n, "put": n // 2},
                "clients": {name: {op: median_round(rs) for op, rs in ops.items()} for name, ops in runs.items()},
            }
        for c in contenders.values():
            c.close()
    finally:
        weed.stop(grace=10.0)
    shutil.rmtree(work, ignore_errors=True)

    report = {
        "benchmark": "s3_clients",
        "command": "python " + " ".join([str(Path(sys.argv[0])), *sys.argv[1:]]),
        "in_flight": IN_FLIGHT,
        "rounds": rounds,
        "statistic": "median round",
        "versions": {p: _version(p) for p in ("boto3", "botocore", "obstore", "awscrt")},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "elapsed_s": round(time.monotonic() - began, 1),
        "loadavg_at_end": list(os.getloadavg()),  # other work on the machine moves objects/s, less so CPU per object
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(results)
    return 0


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def print_table(results: dict[str, Any]) -> None:
    print(
        f"{'size':>8} {'op':>4} {'client':>8} {'obj/s':>8} {'MiB/s':>8} "
        f"{'CPU ms/obj':>11} {'CPU s/GiB':>10} {'S3 server ms/obj':>17}"
    )
    for label, result in results.items():
        for op in ("get", "put"):
            for name, ops in result["clients"].items():
                m = ops[op]
                print(
                    f"{label:>8} {op:>4} {name:>8} {m['objects_per_s']:8.0f} {m['mib_per_s']:8.1f} "
                    f"{m['client_cpu_ms_per_object']:11.3f} {m['client_cpu_s_per_gib']:10.2f} "
                    f"{m['s3_server_cpu_ms_per_object']:17.3f}"
                )


if __name__ == "__main__":
    sys.exit(main())
