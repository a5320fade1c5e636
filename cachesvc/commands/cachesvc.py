"""The `cachesvc` command: `serve` a cache server, `meta` a metadata-shard node, bring a local cluster `up`, `demo`.

`serve` and `meta` read their typed config (`cachesvc.config`): defaults, a
TOML file (`--config`), `CACHESVC_*` environment variables, then the flags
given on the command line. A config error exits with status 2, a port that
cannot be bound with 1. Each subcommand imports its own service when it
runs, so a metadata node never loads the engine, its tiers or their S3
clients, and a cache server never loads the Raft driver.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from typing import Any

from cachesvc import logs
from cachesvc.config import ConfigError, load_config, load_meta_node_config

__all__ = ["build_parser", "main"]

log = logging.getLogger("cachesvc")

# Flag -> (dotted config path, help). Only flags given on the command line override;
# the config loader reads their values ("64MiB", "3") as it reads the file's.
SERVE_FLAGS: dict[str, tuple[str, str]] = {
    "--listen": ("listen", "HOST:PORT to listen on (default 127.0.0.1:7070)"),
    "--metrics-listen": ("metrics_listen", "HOST:PORT to serve Prometheus metrics on, at /metrics (default: off)"),
    "--max-value-bytes": ("max_value_bytes", "largest value accepted (default 256MiB)"),
    "--processes": (
        "processes",
        "engine processes, each a cluster node on port + i with 1/N of the budgets (default 1; 0: one per core; "
        "N > 1 needs --meta)",
    ),
    "--workers": ("workers", "gRPC handler threads (default 16)"),
    "--l1-bytes": ("l1.bytes", "memory tier budget, e.g. 1GiB; 0 disables L1"),
    "--l1-device": ("l1.device", "cpu (default), cuda or cuda:N"),
    "--l1-socket": ("l1.socket", "Unix socket co-located clients get a shared L1 from (default: l1-PID.sock)"),
    "--l2-path": ("l2.path", "directory of the LMDB tier"),
    "--l2-bytes": ("l2.bytes", "disk tier budget, e.g. 20GiB; 0 disables L2 (default)"),
    "--s3-endpoint": ("s3.endpoint", "S3 endpoint URL; absent with no bucket: no L3"),
    "--s3-bucket": ("s3.bucket", "bucket of the object-storage tier"),
    "--s3-prefix": ("s3.prefix", "object-name prefix in the bucket"),
    "--s3-region": ("s3.region", "S3 region (default us-east-1)"),
    "--policy": ("policy", "eviction policy: lru-k (default) or lru"),
    "--lru-k": ("lru_k.k", "K of LRU-K (default 2)"),
    "--lru-k-crp": ("lru_k.correlated_period", "LRU-K correlated reference period, seconds (default 0.5; 0: plain)"),
    "--meta": ("meta.addresses", "metadata shard nodes HOST:PORT,... to register with"),
    "--advertise": ("meta.advertise", "address to register in the shard (default: the listen address)"),
    "--meta-tls-ca": ("meta.tls_ca", "PEM CA of the shard's TLS certificates (default: plaintext to the shard)"),
    "--token": ("security.token", "bearer token clients must present (prefer CACHESVC_SECURITY_TOKEN)"),
    "--admin-token": ("security.admin_token", "bearer token of admin calls (prefer CACHESVC_SECURITY_ADMIN_TOKEN)"),
    "--tls-cert": ("security.tls_cert", "PEM certificate; enables TLS with --tls-key"),
    "--tls-key": ("security.tls_key", "PEM private key"),
    "--tls-ca": ("security.tls_ca", "PEM CA that signed the other cache nodes' certificates (default: --tls-cert)"),
}

META_FLAGS: dict[str, tuple[str, str]] = {
    "--id": ("id", "this node's id (positive, unique in the shard)"),
    "--listen": ("listen", "HOST:PORT for clients and peers (default: this node's address in --peers)"),
    "--metrics-listen": ("metrics_listen", "HOST:PORT to serve Prometheus metrics on, at /metrics (default: off)"),
    "--peers": ("peers", "every member as ID=HOST:PORT,... (this node included)"),
    "--data-dir": ("data_dir", "directory of the Raft log and snapshots"),
    "--tick-ms": ("tick_ms", "Raft tick, ms (default 10)"),
    "--election-ticks": ("election_ticks", "election timeout in ticks (default 20)"),
    "--heartbeat-ticks": ("heartbeat_ticks", "leader heartbeat interval in ticks (default 3)"),
    "--snapshot-every": ("snapshot_every", "compact the log every N entries (default 10000)"),
    "--lease-seconds": ("lease_seconds", "lease a cache-node heartbeat buys (default 10)"),
    "--max-proposal-bytes": ("max_proposal_bytes", "largest client proposal accepted (default 16MiB)"),
    "--max-raft-message-bytes": ("max_raft_message_bytes", "largest batch of Raft messages accepted (default 64MiB)"),
    "--log-map-bytes": ("log_map_bytes", "most the Raft log may occupy on disk (default 1GiB)"),
    "--token": ("security.token", "bearer token clients must present (prefer CACHESVC_META_NODE_SECURITY_TOKEN)"),
    "--admin-token": ("security.admin_token", "bearer token of admin calls (prefer the env)"),
    "--peer-token": ("security.peer_token", "secret the shard's nodes present to each other (prefer the env)"),
    "--tls-cert": ("security.tls_cert", "PEM certificate; TLS for clients and peers, with --tls-key"),
    "--tls-key": ("security.tls_key", "PEM private key"),
    "--tls-ca": ("security.tls_ca", "PEM CA that signed the peers' certificates (default: --tls-cert)"),
}


def _overrides(args: argparse.Namespace, flags: dict[str, tuple[str, str]]) -> dict[str, Any]:
    given = {path: getattr(args, _dest(flag)) for flag, (path, _) in flags.items()}
    return {path: value for path, value in given.items() if value is not None}


def _tune_runtime() -> None:
    """Settings of the server process itself, made before its modules load (`_serve` freezes what they
    loaded once they have).

    Under `perf` over a cold epoch (4,000 fills), numpy's OpenBLAS threads
    took 2.3% of the server's CPU spinning, though the server does no linear
    algebra: one thread (unless the environment says otherwise). Python's
    cyclic collector took 4-4.5%: what start-up loaded (about 60,000 objects)
    is frozen out of its scans, and the youngest generation is collected
    every 20,000 allocations instead of 700 (a few MB of cycles at most wait
    for it).
    """
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    gc.set_threshold(20_000, 20, 20)


def _serve(args: argparse.Namespace) -> int:
    _tune_runtime()
    from cachesvc.server.server import serve

    gc.freeze()  # what start-up loaded stays out of the collector's scans (`_tune_runtime`)

    try:
        cfg = load_config(args.config, overrides=_overrides(args, SERVE_FLAGS))
    except ConfigError as exc:
        print(f"cachesvc serve: config error: {exc}", file=sys.stderr)
        return 2
    log.info("config: %s", cfg.redacted())
    if cfg.process_count() > 1:
        from cachesvc.server.processes import run_processes

        given = [a for flag in SERVE_FLAGS if (v := getattr(args, _dest(flag))) is not None for a in (flag, v)]
        config = ["--config", args.config] if args.config else []
        return run_processes(cfg, config + given, ["--log-level", args.log_level, "--log-format", args.log_format])
    try:
        serve(cfg)
    except OSError as exc:
        print(f"cachesvc serve: {exc}", file=sys.stderr)
        return 1
    return 0


def _meta(args: argparse.Namespace) -> int:
    from cachesvc.meta.service import serve

    overrides = _overrides(args, META_FLAGS)
    if args.no_batching:
        overrides["batching"] = False
    try:
        cfg = load_meta_node_config(args.config, overrides=overrides)
        node = cfg.node_config()
    except ConfigError as exc:
        print(f"cachesvc meta: config error: {exc}", file=sys.stderr)
        return 2
    log.info("config: %s", cfg.redacted())
    try:
        serve(
            node,
            cfg.address,
            metrics_listen=cfg.metrics_listen,
            metrics_open=cfg.metrics_open,
            security=cfg.security,
            max_proposal_bytes=cfg.max_proposal_bytes,
            max_raft_message_bytes=cfg.max_raft_message_bytes,
        )
    except OSError as exc:
        print(f"cachesvc meta: {exc}", file=sys.stderr)
        return 1
    return 0


def _up(args: argparse.Namespace) -> int:
    from cachesvc.devcluster.up import run_up

    return run_up(args)


def _demo(args: argparse.Namespace) -> int:
    from cachesvc.commands.demo import run_demo

    return run_demo(args)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def build_parser() -> argparse.ArgumentParser:
    """The `cachesvc` parser with every subcommand."""
    from cachesvc.devcluster.up import DEFAULT_PORTS

    parser = argparse.ArgumentParser(prog="cachesvc", description="A tiered data cache for AI training and inference.")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="text (default), or json: one JSON object per line (time, level, logger, message, exception)",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run a cache server")
    serve.add_argument("--config", help="TOML config file (every key: deploy/cachesvc.toml)")
    for flag, (_, help_text) in SERVE_FLAGS.items():
        serve.add_argument(flag, dest=_dest(flag), default=None, help=help_text)
    serve.set_defaults(func=_serve)

    meta = commands.add_parser(
        "meta",
        help="run a metadata-shard (Raft) node",
        description=(
            "Run one node of the metadata shard. Every node gets the same --peers; the Raft log, vote and "
            "snapshots live under --data-dir, and restarting on the same directory recovers the node."
        ),
    )
    meta.add_argument("--config", help="TOML config file (every key: deploy/meta.toml)")
    for flag, (_, help_text) in META_FLAGS.items():
        meta.add_argument(flag, dest=_dest(flag), default=None, help=help_text)
    meta.add_argument(
        "--no-batching", action="store_true", help="one log entry and fsync per client request (for benchmarks)"
    )
    meta.set_defaults(func=_meta)

    up = commands.add_parser("up", help="run a whole local cluster: metadata shard, S3 server, cache servers")
    up.add_argument("--state-dir", default="state", help="where data, logs and cluster.json go (default ./state)")
    for name, port in DEFAULT_PORTS.items():
        up.add_argument(f"--{name}-port", type=int, default=port, help=f"default {port}")
    up.add_argument("--l1-bytes", default="1GiB", help="cache server memory tier (default 1GiB)")
    up.add_argument("--l2-bytes", default="4GiB", help="cache server disk tier (default 4GiB)")
    up.add_argument("--bucket", default="cachesvc", help="bucket to create and cache (default cachesvc)")
    up.add_argument("--s3-endpoint", default=None, help="use this S3 server instead of starting one")
    up.add_argument("--meta-nodes", type=int, default=3, help="metadata shard size (default 3; 0: none)")
    up.add_argument(
        "--nodes", type=int, default=1, help="cache servers (default 1), on --cache-port, --cache-port + 1, ..."
    )
    up.add_argument(
        "--tokens",
        action="store_true",
        help="secure the cluster with a data and an admin token (made unless CACHESVC_SECURITY_TOKEN and "
        "CACHESVC_SECURITY_ADMIN_TOKEN are set), written to cluster.json (mode 0600) for `cachectl --state-dir`; "
        "tenants need them",
    )
    up.add_argument("--check", action="store_true", help="stop after the start-up round trip (and the demo)")
    running = up.add_mutually_exclusive_group()
    running.add_argument(
        "--add-node", action="store_true", help="ask the `cachesvc up` running on --state-dir for one more cache server"
    )
    running.add_argument(
        "--remove-node",
        metavar="HOST:PORT",
        default=None,
        help="ask the `cachesvc up` running on --state-dir to drain, stop and remove this cache server",
    )
    up.add_argument(
        "--demo", action="store_true", help="once up, run `cachesvc demo`: a DataLoader epoch from S3, cold and warm"
    )
    up.set_defaults(func=_up)

    demo = commands.add_parser(
        "demo", help="read a synthetic dataset from S3 directly, then cold and warm through the cache"
    )
    demo.add_argument("--state-dir", default="state", help="where `cachesvc up` keeps cluster.json (default ./state)")
    demo.add_argument("--samples", type=int, default=2000, help="samples in the dataset (default 2000)")
    demo.add_argument("--sample-bytes", type=int, default=64 << 10, help="bytes per sample (default 65536)")
    demo.add_argument("--batch-size", type=int, default=32)
    demo.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs `cachesvc ARGS`; returns the exit status."""
    parser = build_parser()
    args: Any = parser.parse_args(argv)
    logs.configure(args.log_level, args.log_format)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
