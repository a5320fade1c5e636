"""The `cachesvc` command: `serve` a cache server, or bring a local cluster `up`."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from cachesvc.config import ConfigError, load_config

__all__ = ["main"]

log = logging.getLogger("cachesvc")

# Flag -> dotted config path. Only flags given on the command line override.
SERVE_FLAGS: dict[str, tuple[str, str]] = {
    "--listen": ("listen", "HOST:PORT to listen on (default 127.0.0.1:7070)"),
    "--max-value-bytes": ("max_value_bytes", "largest value accepted (default 256MiB)"),
    "--workers": ("workers", "gRPC handler threads (default 16)"),
    "--l1-bytes": ("l1.bytes", "memory tier budget, e.g. 1GiB; 0 disables L1"),
    "--l1-device": ("l1.device", "cpu (default), cuda or cuda:N"),
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
    "--token": ("security.token", "bearer token clients must present (prefer CACHESVC_SECURITY_TOKEN)"),
    "--tls-cert": ("security.tls_cert", "PEM certificate; enables TLS with --tls-key"),
    "--tls-key": ("security.tls_key", "PEM private key"),
}


def _serve(args: argparse.Namespace) -> int:
    from cachesvc.server.server import serve

    overrides = {path: getattr(args, _dest(flag)) for flag, (path, _) in SERVE_FLAGS.items()}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    try:
        cfg = load_config(args.config, overrides=overrides)
    except ConfigError as exc:
        print(f"cachesvc serve: config error: {exc}", file=sys.stderr)
        return 2
    log.info("config: %s", cfg.redacted())
    try:
        serve(cfg)
    except OSError as exc:
        print(f"cachesvc serve: {exc}", file=sys.stderr)
        return 1
    return 0


def _up(args: argparse.Namespace) -> int:
    from cachesvc.devcluster.up import run_up

    return run_up(args)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cachesvc", description="A tiered data cache for AI training and inference.")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run a cache server")
    serve.add_argument("--config", help="TOML config file")
    for flag, (_, help_text) in SERVE_FLAGS.items():
        serve.add_argument(flag, dest=_dest(flag), default=None, help=help_text)
    serve.set_defaults(func=_serve)

    from cachesvc.devcluster.up import add_up_arguments

    up = commands.add_parser("up", help="run a whole local cluster: S3 server, cache server")
    add_up_arguments(up)
    up.set_defaults(func=_up)

    from cachesvc.demo import add_demo_command
    from cachesvc.meta.cli import add_meta_command

    add_demo_command(commands)
    add_meta_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args: Any = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
