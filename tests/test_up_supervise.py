"""`cachesvc up` as the README tells a newcomer to watch it: kill a node, see it down and back; join; drain.

One `cachesvc up` with two cache servers runs as a process; the test kills
a cache server by the pid in `cluster.json` (SIGKILL, as `kill -9` does),
watches `cachectl status` show it down while its keys stay readable, sees
`up` restart it on its own L2, does the same to a metadata node, then adds
a node and drains and removes one from another "shell" (`cachesvc up
--state-dir DIR --add-node`, `--remove-node HOST:PORT`), and stops
everything with Ctrl-C (SIGINT).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cacheclient import CacheClient
from cachesvc.devcluster.procs import free_port, port_in_use
from cachesvc.devcluster.seaweed import SeaweedPorts

from conftest import wait_until

# About 2.5 minutes on 2 cores: a whole `up`, a restart, a join, a drain and a full stop.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _free_run(n: int) -> int:
    while True:
        first = free_port()
        if first + n < 65536 and not any(port_in_use(first + i) for i in range(n)):
            return first


def _status(meta: list[str]) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "cachesvc.commands.cachectl", "--meta", ",".join(meta), "status", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # Exit 3 while a node is down: the JSON still says what it found.
    assert result.stdout, result.stderr
    return {n["address"]: n for n in json.loads(result.stdout)["nodes"]}


def _up_states(meta: list[str]) -> dict[str, str]:
    return {address: node["state"] for address, node in _status(meta).items()}


def test_up_restarts_a_killed_node_and_adds_and_drains_nodes(tmp_path: Path) -> None:
    state = tmp_path / "state"
    ports = SeaweedPorts.free()
    argv = [
        sys.executable, "-m", "cachesvc", "up", "--nodes", "2", "--state-dir", str(state),
        "--cache-port", str(_free_run(2)), "--meta-port", str(_free_run(3)), "--metrics-port", str(_free_run(5)),
        "--s3-port", str(ports.s3), "--master-port", str(ports.master), "--volume-port", str(ports.volume),
        "--filer-port", str(ports.filer), "--l1-bytes", "16MiB", "--l2-bytes", "64MiB",
    ]  # fmt: skip
    console = tmp_path / "up.out"
    with open(console, "wb") as out:
        up = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: "running;" in console.read_text(), 180, "cachesvc up to be running", interval=0.5)
        info = json.loads((state / "cluster.json").read_text())
        meta, (first, second) = info["meta"], info["cache"]
        client = CacheClient(meta=",".join(meta), timeout=20.0)
        values = {f"watch/{i:03d}": os.urandom(2000) for i in range(200)}
        client.put_many(values)
        on_second = [k for k in values if client.cluster.placement().locate(k) == second]
        assert on_second

        # kill -9 of the second cache server, by its pid in cluster.json.
        victim = info["pids"]["cache-1"]
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: _up_states(meta).get(second) == "down", 10, "cachectl status to show it down", interval=0)
        assert client.get_many(on_second) == [values[k] for k in on_second]  # its keys, from the others (or S3)
        text = console.read_text()
        assert f"cache server {second} (cache-1) exited (signal 9)" in text, text
        wait_until(lambda: _up_states(meta).get(second) == "up", 60, "the killed node to come back up", interval=0.5)
        assert "(cache-1) restarted (pid" in console.read_text()
        restarted = json.loads((state / "cluster.json").read_text())["pids"]["cache-1"]
        assert restarted != victim and Path(f"/proc/{restarted}").exists()
        assert up.poll() is None and client.get_many(list(values)) == list(values.values())

        # A metadata node killed too: reported and restarted on its Raft directory; the shard answers throughout.
        os.kill(info["pids"]["meta2"], signal.SIGKILL)
        wait_until(lambda: "(meta2) restarted (pid" in console.read_text(), 30, "up to restart meta2", interval=0.5)
        assert f"metadata node {meta[1]} (meta2) exited (signal 9)" in console.read_text()
        wait_until(
            lambda: (
                subprocess.run(
                    [sys.executable, "-m", "cachesvc.commands.cachectl", "--meta", meta[1], "leader"],
                    capture_output=True,
                    timeout=60,
                ).returncode
                == 0
            ),
            30,
            "the restarted metadata node to answer",
            interval=0.5,
        )

        # Join: one more cache server, from another shell.
        added = subprocess.run(
            [sys.executable, "-m", "cachesvc", "up", "--state-dir", str(state), "--add-node"],
            capture_output=True,
            text=True,
            timeout=150,
        )
        assert added.returncode == 0, added.stdout + added.stderr
        info = json.loads((state / "cluster.json").read_text())
        assert len(info["cache"]) == 3 and info["cache"][2] in added.stdout
        assert sorted(client.cluster.placement(refresh=True).nodes) == sorted(info["cache"])
        assert _up_states(meta) == dict.fromkeys(info["cache"], "up")

        # Drain and remove the first: its slots move, its process stops, the shard forgets it.
        removed = subprocess.run(
            [sys.executable, "-m", "cachesvc", "up", "--state-dir", str(state), "--remove-node", first],
            capture_output=True,
            text=True,
            timeout=150,
        )
        assert removed.returncode == 0, removed.stdout + removed.stderr
        info = json.loads((state / "cluster.json").read_text())
        assert first not in info["cache"] and len(info["cache"]) == 2 and "cache" not in info["pids"]
        assert first not in _status(meta) and first not in client.cluster.placement(refresh=True).nodes
        assert client.get_many(list(values)) == list(values.values())
        client.close()
        pids = list(info["pids"].values())
    finally:
        # Ctrl-C stops everything.
        if up.poll() is None:
            os.kill(up.pid, signal.SIGINT)
        assert up.wait(120) == 0, console.read_text()
    wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in pids), 30, "every process to be gone")
