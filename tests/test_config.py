"""Config precedence (file < environment < flags), unknown keys, sizes."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachesvc.config import ConfigError, load_config, parse_size


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(
        'listen = "127.0.0.1:9000"\npolicy = "lru"\n[l1]\nbytes = "64MiB"\n[l2]\npath = "/x"\nbytes = "2GiB"\n'
    )
    cfg = load_config(config, env={})
    assert (cfg.listen, cfg.l1.bytes, cfg.l2.bytes) == ("127.0.0.1:9000", 64 << 20, 2 << 30)
    cfg = load_config(config, env={"CACHESVC_L1_BYTES": "128MiB", "CACHESVC_LISTEN": "127.0.0.1:9001"})
    assert (cfg.listen, cfg.l1.bytes) == ("127.0.0.1:9001", 128 << 20)
    cfg = load_config(config, env={"CACHESVC_L1_BYTES": "128MiB"}, overrides={"l1.bytes": "1GB"})
    assert cfg.l1.bytes == 10**9 and cfg.l2.path == "/x"


def test_unknown_keys_and_bad_values_are_named(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("[s3]\nendpoint_url = 'x'\n")
    with pytest.raises(ConfigError, match="unknown config key s3.endpoint_url"):
        load_config(config, env={})
    with pytest.raises(ConfigError, match="CACHESVC_L3_BYTES"):
        load_config(env={"CACHESVC_L3_BYTES": "1"})
    with pytest.raises(ConfigError, match="l1.bytes: cannot read 'lots'"):
        load_config(env={}, overrides={"l1.bytes": "lots"})
    with pytest.raises(ConfigError, match="policy"):
        load_config(env={}, overrides={"policy": "fifo"})
    with pytest.raises(ConfigError, match="l2.path"):
        load_config(env={}, overrides={"l2.bytes": "1GiB"})
    with pytest.raises(ConfigError, match="write-back needs object storage"):
        config.write_text('[[namespaces]]\nprefix = "kv/"\nwrite_mode = "write-back"\n')
        load_config(config, env={})
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.toml", env={})


def test_secrets_are_redacted() -> None:
    cfg = load_config(env={"CACHESVC_S3_SECRET_KEY": "hunter2", "CACHESVC_SECURITY_TOKEN": "tok"})
    assert cfg.s3.secret_key == "hunter2"
    redacted = cfg.redacted()
    assert redacted["s3"]["secret_key"] == "***" and redacted["security"]["token"] == "***"
    assert "hunter2" not in repr(redacted)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0", 0), (4096, 4096), ("4KiB", 4096), ("1.5GiB", 3 << 29), ("2GB", 2 * 10**9), ("7 mib", 7 << 20)],
)
def test_sizes(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


def test_bad_size() -> None:
    with pytest.raises(ConfigError, match="not a byte size"):
        parse_size("12 parsecs")


def test_the_shipped_config_loads_and_names_every_key() -> None:
    import tomllib

    from cachesvc.config import ServerConfig, _env_paths

    path = Path(__file__).resolve().parent.parent / "deploy" / "cachesvc.toml"
    load_config(path, env={})
    data = tomllib.loads(path.read_text())
    for dotted in _env_paths(ServerConfig).values():
        node = data
        for part in dotted:
            assert part in node, f"deploy/cachesvc.toml does not show {'.'.join(dotted)}"
            node = node[part]
