"""Config precedence (file < environment < flags), unknown keys, sizes; for the cache server and the metadata node."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachesvc.config import (
    ConfigError,
    MetaNodeConfig,
    ServerConfig,
    env_names,
    load_config,
    load_meta_node_config,
    parse_size,
)


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
    with pytest.raises(ConfigError, match="max_inflight_calls: 0 .workers. to workers=4, got 5"):
        load_config(env={}, overrides={"workers": "4", "max_inflight_calls": "5"})
    assert load_config(env={"CACHESVC_MAX_INFLIGHT_CALLS": "3"}, overrides={"workers": "4"}).max_inflight_calls == 3


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


@pytest.mark.parametrize(("name", "schema"), [("cachesvc.toml", ServerConfig), ("meta.toml", MetaNodeConfig)])
def test_the_shipped_configs_load_and_name_every_key(name: str, schema: type) -> None:
    import tomllib

    path = Path(__file__).resolve().parent.parent / "deploy" / name
    loaded = (load_config if schema is ServerConfig else load_meta_node_config)(path, env={})
    assert isinstance(loaded, schema)
    data = tomllib.loads(path.read_text())
    for dotted in env_names(schema).values():
        node = data
        for part in dotted:
            assert part in node, f"deploy/{name} does not show {'.'.join(dotted)}"
            node = node[part]


def test_meta_node_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    config = tmp_path / "meta.toml"
    config.write_text('id = 2\npeers = "1=127.0.0.1:7081,2=127.0.0.1:7082"\ndata_dir = "/m"\ntick_ms = 20\n')
    cfg = load_meta_node_config(config, env={})
    assert (cfg.id, cfg.address, cfg.tick_ms, cfg.batching) == (2, "127.0.0.1:7082", 20, True)
    env = {"CACHESVC_META_NODE_TICK_MS": "5", "CACHESVC_META_NODE_BATCHING": "false"}
    cfg = load_meta_node_config(config, env=env)
    assert (cfg.tick_ms, cfg.batching) == (5, False)
    cfg = load_meta_node_config(config, env=env, overrides={"tick_ms": "7", "listen": "0.0.0.0:9000"})
    node = cfg.node_config()
    assert (node.tick_ms, node.batching, node.data_dir, cfg.address) == (7, False, Path("/m"), "0.0.0.0:9000")
    # A node missing from its own peer list joins it at its listen address.
    cfg = load_meta_node_config(env={}, overrides={"id": "3", "peers": "1=h:1", "listen": "h:3", "data_dir": "/m"})
    assert cfg.node_config().peers == {1: "h:1", 3: "h:3"}


def test_meta_node_unknown_keys_and_missing_values_are_named(tmp_path: Path) -> None:
    required = {"id": "1", "peers": "1=127.0.0.1:7081", "data_dir": "/m"}
    config = tmp_path / "meta.toml"
    config.write_text("election_tiks = 30\n")
    with pytest.raises(ConfigError, match="unknown config key election_tiks"):
        load_meta_node_config(config, env={}, overrides=required)
    with pytest.raises(ConfigError, match="CACHESVC_META_NODE_PEER$"):
        load_meta_node_config(env={"CACHESVC_META_NODE_PEER": "1=h:1"}, overrides=required)
    for missing in required:
        with pytest.raises(ConfigError, match=missing):
            load_meta_node_config(env={}, overrides={k: v for k, v in required.items() if k != missing})
    with pytest.raises(ConfigError, match="peers: bad peer"):
        load_meta_node_config(env={}, overrides={**required, "peers": "1=nohost"})
    with pytest.raises(ConfigError, match="heartbeat"):
        load_meta_node_config(env={}, overrides={**required, "heartbeat_ticks": "40"})


def test_one_environment_serves_every_service() -> None:
    # `cachesvc up` hands one environment to the cache server and the metadata
    # nodes: each takes its own variables and passes over the other's.
    assert not set(env_names(ServerConfig)) & set(env_names(MetaNodeConfig))
    env = {
        "CACHESVC_L1_BYTES": "64MiB",
        "CACHESVC_META_NODE_ID": "1",
        "CACHESVC_META_NODE_PEERS": "1=127.0.0.1:7081",
        "CACHESVC_META_NODE_DATA_DIR": "/m",
        "CACHESVC_FAILPOINT": "",
    }
    assert load_config(env=env).l1.bytes == 64 << 20
    assert load_meta_node_config(env=env).id == 1
