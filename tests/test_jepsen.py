"""Jepsen-style runs over a real cluster (`nemesis.py`): writers owning their keys, readers, and a nemesis.

A one-node metadata shard, SeaweedFS, three cache servers (one reached only
through fault proxies) with shared L1s, write-through and write-back
namespaces; the clients run on the servers' machine, so they read from the
owners' shared L1s and write through their staging areas (a partition cuts
neither: the cut-off node stops both itself at half its lease), and one
reader reads the owners' L2 files directly, as a dataset there does. The nemesis
SIGKILLs a server and restarts it on its L2, joins a fourth, drains one and
puts it back, and cuts one off and heals it. The history is checked per key as
a register: no stale read (older than a version whose put had returned), no
wrong bytes, linearizable; at the end every key reads its last acknowledged
version through the cache and from S3 alone. A failing run prints the
offending operations (key, op, value, call and return times).

`test_the_harness_passes_with_no_nemesis`: the same load with no faults, so a
failure of the nemesis runs is the cluster's, not the harness's. `JEPSEN_SEED=N` runs the short
run with another seed (its load and nemesis pauses). The
several-minute run is `slow`; its figures are in docs/reliability.md.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from nemesis import History, JepsenCluster, Nemesis, Op, Workload, nemesis_cycle, report

from conftest import S3Server


def jepsen_run(
    s3: S3Server, base: Path, seconds: float, rounds: int | None, seed: int, nemesis_on: bool = True
) -> None:
    """At least `seconds` of load; the nemesis runs all of its `rounds` rounds (None: as many as fit in `seconds`),
    1-3 s between its steps."""
    cluster = JepsenCluster(s3, base, servers=3).start()
    nemesis: Nemesis | None = None
    began = time.monotonic()
    try:
        with Workload(cluster, writers=3, readers=2, keys_per_writer=20, seed=seed) as load:
            if nemesis_on:
                nemesis = Nemesis(nemesis_cycle(cluster, rounds), pause=(1.0, 3.0), seed=seed)
                nemesis.start()
            if nemesis is not None and rounds is not None:
                nemesis.join(timeout=seconds + 240.0)  # every step of its rounds, however long they take
            time.sleep(max(0.0, began + seconds - time.monotonic()))
            if nemesis is not None:
                nemesis.stop()  # the step under way finishes
                cluster.restore()  # X healed, a drained server back
        if nemesis is not None:
            assert nemesis.error is None, f"the nemesis failed: {nemesis.error!r}"
        elapsed = time.monotonic() - began
        wrong_final = load.final()
        # The clients ran on the servers' machine: reads came from the shared L1s and writes went through the
        # staging areas, not only over gRPC (the history checks the co-located path too).
        direct_reads, staged_bytes = cluster.counter("direct_hit_keys"), cluster.counter("staging_put_bytes")
        placed = cluster.counter("staging_placed_puts")  # large values written in place, files of their own in L2
    finally:
        cluster.stop()
    summary, problems = report(cluster, load, wrong_final, nemesis, elapsed)
    print(f"\njepsen: {summary}")
    for line in problems:
        print(line)
    counts = load.history.counts()
    if problems:
        # The whole history beside the servers' logs, for reading a failure after the run (History.load).
        load.history.dump(base / "history.jsonl")
        pytest.fail(f"{summary}\n" + "\n".join(problems), pytrace=False)
    assert counts["puts"] > 200 and counts["reads"] > 1000, summary
    assert direct_reads > 0 and staged_bytes > 0, f"co-located: {direct_reads} direct reads, {staged_bytes} B staged"
    assert load.file_reads > 0, f"nothing read from the owners' L2 files: {summary}"
    assert placed > 0, f"no large value was written in place: {summary}"
    assert sum(1 for k, v in load.acked.items() if k.startswith(b"wb/") and v > 0) > 0, summary


def test_a_failure_without_a_stale_read_is_located_at_the_operation_that_made_it(tmp_path: Path) -> None:
    # New, then old: a reader saw v2 while its put was under way, and a later reader saw v1. No read was
    # stale (v2's put had not returned), so the report must find where the order broke by itself.
    k = b"wt/0-001"
    ops = [Op(0, "put", k, 1, 0.0, 1.0), Op(0, "put", k, 2, 2.0, 5.0), Op(3, "get", k, 2, 2.5, 3.0)]
    ops += [Op(3, "get", k, 1, 1.5, 1.6), Op(4, "get", k, 1, 3.5, 4.0), Op(3, "get", k, 2, 6.0, 7.0)]
    history = History(ops=list(ops))
    assert not history.stale()
    assert history.first_illegal(ops) == ops[4]
    # What a failing run leaves beside its logs reads back the same, a put of unknown outcome too.
    kept = History(ops=[*ops, Op(5, "put", b"wt/0-002", 1, 8.0, math.inf, " (raised)")])
    kept.dump(tmp_path / "history.jsonl")
    assert History.load(tmp_path / "history.jsonl").ops == kept.ops
    assert History.first_illegal([op for i, op in enumerate(ops) if i != 4]) is None
    # The report names it (what a failing run prints; the history is all it reads of the load here).
    load = SimpleNamespace(history=history, file_reads=0, failed=Counter())
    _, problems = report(None, load, {"cache": [], "s3": []}, None, 1.0)  # type: ignore[arg-type]
    assert problems[-1].endswith(f"the last, {ops[4]}"), problems


def test_the_harness_passes_with_no_nemesis(s3: S3Server, tmp_path: Path) -> None:
    jepsen_run(s3, tmp_path, seconds=15.0, rounds=0, seed=1, nemesis_on=False)


@pytest.mark.timeout(300)
def test_jepsen_short_run_kill_join_drain_cut(s3: S3Server, tmp_path: Path) -> None:
    jepsen_run(s3, tmp_path, seconds=45.0, rounds=1, seed=int(os.environ.get("JEPSEN_SEED", "2")))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_jepsen_long_run(s3: S3Server, tmp_path: Path) -> None:
    jepsen_run(s3, tmp_path, seconds=300.0, rounds=None, seed=3)
