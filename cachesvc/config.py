"""The cache server's typed configuration.

One dataclass tree, filled in this order, each step overriding the last:
embedded defaults, a TOML file (`--config FILE`), `CACHESVC_*` environment
variables (the field's path in upper case joined by "_", e.g.
`CACHESVC_L1_BYTES`, `CACHESVC_S3_ENDPOINT`, `CACHESVC_LRU_K_K`), then
command-line flags. An unknown key in the file or an unknown `CACHESVC_*`
variable is an error that names it. Byte sizes accept plain integers or
strings with a unit ("512MiB", "2GB"). `validate()` runs on every load.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ConfigError",
    "L1Config",
    "L2Config",
    "LRUKConfig",
    "MetaConfig",
    "NamespaceConfig",
    "S3Config",
    "SecurityConfig",
    "ServerConfig",
    "load_config",
    "parse_size",
]

ENV_PREFIX = "CACHESVC_"


class ConfigError(ValueError):
    """A configuration value or key is not acceptable; the message names it."""


_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int) -> int:
    """Bytes from an int or a string such as "64MiB" or "1.5GB"."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.match(str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"not a byte size: {value!r} (use e.g. 1048576, 512MiB, 2GB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass
class L1Config:
    """Memory tier. `bytes = 0` disables it."""

    bytes: int = 1 << 30
    device: str = "cpu"
    """"cpu" for host memory, or "cuda"/"cuda:N" for GPU memory."""


@dataclass
class L2Config:
    """Local-disk (LMDB) tier. `bytes = 0` disables it."""

    path: str = ""
    bytes: int = 0
    fill_on_read: bool = True
    """Values filled from object storage go into L2 as well as L1."""


@dataclass
class S3Config:
    """Object storage. No bucket: no L3."""

    endpoint: str = ""
    bucket: str = ""
    prefix: str = ""
    region: str = "us-east-1"
    access_key: str = ""
    secret_key: str = ""
    connect_timeout: float = 2.0
    read_timeout: float = 30.0
    max_attempts: int = 3


@dataclass
class LRUKConfig:
    k: int = 2
    correlated_period: float = 0.5
    """Seconds (chosen by bench/eviction.py); 0 gives the paper's plain LRU-K."""
    retained_history: int = -1
    """Evicted keys whose history is kept (Retained Information Period, by count):
    -1 (default) as many as there are resident keys; 0 forgets a key when it is evicted."""


@dataclass
class NamespaceConfig:
    prefix: str = ""
    write_mode: str = "write-through"
    lease_seconds: float = 0.0
    """Default lease of puts in the namespace (pinned until read with release, or until it ends)."""
    ttl_seconds: float = 0.0
    """Default time to live of puts in the namespace; 0: none."""


@dataclass
class MetaConfig:
    """The metadata shard this server registers with and heartbeats to."""

    addresses: str = ""
    """Comma-separated HOST:PORT of the shard's nodes; empty: no shard."""
    advertise: str = ""
    """The address other hosts reach this server at; empty: `listen`."""


@dataclass
class SecurityConfig:
    token: str = ""
    """Bearer token every client must present; empty: no authentication."""
    tls_cert: str = ""
    tls_key: str = ""


@dataclass
class ServerConfig:
    listen: str = "127.0.0.1:7070"
    max_value_bytes: int = 256 << 20
    workers: int = 16
    """gRPC handler threads; also bounds concurrent requests."""
    writeback_queue: int = 4096
    io_timeout: float = 60.0
    fill_concurrency: int = 16
    prefetch_concurrency: int = 16
    """Object-storage fetches all prefetch plans run at once."""
    max_prefetch_plans: int = 64
    policy: str = "lru-k"
    lru_k: LRUKConfig = field(default_factory=LRUKConfig)
    l1: L1Config = field(default_factory=L1Config)
    l2: L2Config = field(default_factory=L2Config)
    s3: S3Config = field(default_factory=S3Config)
    namespaces: list[NamespaceConfig] = field(default_factory=list)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    meta: MetaConfig = field(default_factory=MetaConfig)

    def validate(self) -> None:
        """Raises ConfigError naming the first value that is not acceptable."""
        from cachesvc.engine import WriteMode
        from cachesvc.policy import POLICY_NAMES

        host, _, port = self.listen.rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ConfigError(f"listen: expected HOST:PORT, got {self.listen!r}")
        for name, value in (
            ("max_value_bytes", self.max_value_bytes),
            ("workers", self.workers),
            ("writeback_queue", self.writeback_queue),
            ("fill_concurrency", self.fill_concurrency),
            ("prefetch_concurrency", self.prefetch_concurrency),
            ("max_prefetch_plans", self.max_prefetch_plans),
        ):
            if value <= 0:
                raise ConfigError(f"{name}: must be positive, got {value}")
        if self.l1.bytes < 0 or self.l2.bytes < 0:
            raise ConfigError("l1.bytes and l2.bytes must be >= 0")
        if self.l1.bytes == 0 and self.l2.bytes == 0:
            raise ConfigError("l1.bytes and l2.bytes are both 0: at least one cache tier is needed")
        if self.l2.bytes and not self.l2.path:
            raise ConfigError("l2.path: required when l2.bytes > 0")
        if self.l2.bytes and self.l2.bytes < 1 << 20:
            raise ConfigError(f"l2.bytes: at least 1MiB, got {self.l2.bytes}")
        if not (self.l1.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", self.l1.device)):
            raise ConfigError(f"l1.device: expected cpu, cuda or cuda:N, got {self.l1.device!r}")
        if self.s3.endpoint and not self.s3.bucket:
            raise ConfigError("s3.bucket: required when s3.endpoint is set")
        if self.policy not in POLICY_NAMES:
            raise ConfigError(f"policy: expected one of {', '.join(POLICY_NAMES)}, got {self.policy!r}")
        if self.lru_k.k < 1 or self.lru_k.correlated_period < 0 or self.lru_k.retained_history < -1:
            raise ConfigError("lru_k: k must be >= 1, correlated_period >= 0 and retained_history >= -1")
        modes = [m.value for m in WriteMode]
        for i, ns in enumerate(self.namespaces):
            if ns.write_mode not in modes:
                raise ConfigError(
                    f"namespaces[{i}].write_mode: expected one of {', '.join(modes)}, got {ns.write_mode!r}"
                )
            if ns.lease_seconds < 0 or ns.ttl_seconds < 0:
                raise ConfigError(f"namespaces[{i}]: lease_seconds and ttl_seconds must be >= 0")
            if ns.write_mode == "write-back" and not self.s3.bucket:
                raise ConfigError(f"namespaces[{i}]: write-back needs object storage (s3.bucket)")
        if bool(self.security.tls_cert) != bool(self.security.tls_key):
            raise ConfigError("security: tls_cert and tls_key go together")

    def redacted(self) -> dict[str, Any]:
        """The config as a dict with secrets masked, safe to log."""
        data = dataclasses.asdict(self)
        for section, key in (("s3", "secret_key"), ("s3", "access_key"), ("security", "token")):
            if data[section][key]:
                data[section][key] = "***"
        return data


def _env_paths(cls: type, prefix: tuple[str, ...] = ()) -> dict[str, tuple[str, ...]]:
    paths: dict[str, tuple[str, ...]] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = (*prefix, f.name)
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            paths.update(_env_paths(typing.cast(type, hint), path))
        elif typing.get_origin(hint) is not list:
            paths["_".join(path).upper()] = path
    return paths


def _coerce(value: Any, hint: Any, where: str) -> Any:
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a table, got {value!r}")
        return _build(typing.cast(type, hint), value, where)
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    try:
        if hint is bool:
            if isinstance(value, str):
                if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError(value)
                return value.lower() in ("1", "true", "yes")
            return bool(value)
        if hint is int:
            return parse_size(value) if where.endswith("bytes") else int(value)
        if hint is float:
            return float(value)
        return str(value)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: cannot read {value!r} as {getattr(hint, '__name__', hint)}") from exc


def _build(cls: type, data: Mapping[str, Any], where: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(f"unknown config key {where + '.' if where else ''}{key}")
    kwargs = {k: _coerce(v, hints[k], f"{where + '.' if where else ''}{k}") for k, v in data.items()}
    return cls(**kwargs)


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ServerConfig:
    """Builds and validates the server config: defaults, file, environment, then overrides.

    Args:
        path: a TOML file, or None.
        env: the environment to read `CACHESVC_*` from (default: os.environ).
        overrides: dotted paths to values, e.g. {"l1.bytes": "64MiB"}, from flags.

    Raises:
        ConfigError: an unknown key, an unreadable value or a failed validation.
    """
    data: dict[str, Any] = {}
    if path is not None:
        try:
            _merge(data, tomllib.loads(Path(path).read_text()))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    env_paths = _env_paths(ServerConfig)
    for name, value in sorted((env if env is not None else os.environ).items()):
        if not name.startswith(ENV_PREFIX):
            continue
        dotted = env_paths.get(name[len(ENV_PREFIX) :])
        if dotted is None:
            raise ConfigError(f"unknown config environment variable {name}")
        _set(data, dotted, value)
    for dotted_name, value in (overrides or {}).items():
        _set(data, tuple(dotted_name.split(".")), value)
    config: ServerConfig = _build(ServerConfig, data)
    config.validate()
    return config


def _set(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        data = data.setdefault(part, {})
    data[path[-1]] = value
