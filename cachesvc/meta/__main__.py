"""`python -m cachesvc.meta ARGS`: the same as `cachesvc meta ARGS` (see `cachesvc.meta.cli`).

The log level comes from `CACHESVC_LOG_LEVEL` (default INFO).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from cachesvc.meta.cli import add_meta_command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cachesvc.meta")
    add_meta_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["meta", *(sys.argv[1:] if argv is None else argv)])
    level = os.environ.get("CACHESVC_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
