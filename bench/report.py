"""One Markdown page from bench/results/*.json: each benchmark's headline ratios and plots, with provenance.

Every result file becomes one section: the benchmark, the command that
produced it, the commit and date it was measured at (from its `machine`
record; "unknown" where a file lacks them), its headline ratios against their
targets, and the PNG plots written beside it (`NAME.png`, `NAME_*.png`). A
result is marked **stale** when the code it measures (`MEASURES`, below)
changed in a commit that its own commit does not contain; a result whose
commit is unknown, or not in this repository's history, is marked so too.

Usage:
    python bench/report.py                          # writes bench/results/REPORT.md
    python bench/report.py --results DIR --out FILE
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["MEASURES", "Freshness", "Result", "freshness", "headlines", "load", "main", "render"]

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent

_SERVER = ["cachesvc/server", "cachesvc/engine", "cachesvc/tiers", "cachesvc/policy", "cachesvc/config.py"]
_CLIENT = [
    "client/cacheclient/client.py", "client/cacheclient/node.py", "client/cacheclient/node_plan.py",
    "client/cacheclient/_batches.py", "client/cacheclient/transport.py", "client/cacheclient/wire",
    "client/cacheclient/process_local.py",
]  # fmt: skip

MEASURES: dict[str, list[str]] = {
    # benchmark: the code paths (git pathspecs) whose change makes its results stale; its own script included.
    "tiers": ["bench/tiers.py", "bench/_echo_server.py", *_SERVER, *_CLIENT],
    "meta": ["bench/meta.py", "cachesvc/meta", "client/cacheclient/meta.py"],
    "colocated": ["bench/colocated.py", *_SERVER, *_CLIENT, "client/cacheclient/colocated.py"],
    "smallvalues": ["bench/smallvalues.py", *_SERVER, *_CLIENT, "client/cacheclient/_lmdb_reader.py"],
    "eviction": ["bench/eviction.py", "cachesvc/policy"],
    "plan_eviction": ["bench/plan_eviction.py", "bench/eviction.py", "cachesvc/policy", "cachesvc/prefetch"],
    "idle": [
        "bench/idle.py", "bench/cluster.py", *_SERVER, *_CLIENT, "cachesvc/meta", "client/cacheclient/meta.py",
        "client/cacheclient/routing.py", "client/cacheclient/_kvindex.py",
    ],
    "s3_clients": ["bench/s3_clients.py", "cachesvc/tiers/s3.py", "client/cacheclient/wire"],
    "kvcache": [
        "bench/kvcache.py", "bench/_echo_server.py", *_SERVER, *_CLIENT, "client/cacheclient/kv.py",
        "client/cacheclient/_kvindex.py", "client/cacheclient/hf.py", "examples/pd_disaggregation/model.py",
    ],
    "vllm_kv": [
        "bench/vllm_kv.py", "tests/vllm_engine.py", *_SERVER, *_CLIENT, "client/cacheclient/kv.py",
        "client/cacheclient/_kvindex.py", "client/cacheclient/vllm.py", "client/cacheclient/_paged.py",
        "client/cacheclient/colocated.py", "client/cacheclient/staged.py",
    ],
    "paged_store": [
        "bench/paged_store.py", *_SERVER, *_CLIENT, "client/cacheclient/kv.py", "client/cacheclient/_paged.py",
        "client/cacheclient/colocated.py", "client/cacheclient/staged.py",
    ],
    "prefetch": [
        "bench/prefetch.py", "bench/latency_proxy.py", *_SERVER, *_CLIENT, "cachesvc/prefetch",
        "client/cacheclient/prefetch.py", "client/cacheclient/_residency.py",
    ],
    "dataloader": [
        "bench/dataloader.py", "bench/latency_proxy.py", *_SERVER, *_CLIENT, "cachesvc/prefetch",
        "client/cacheclient/torch.py", "client/cacheclient/_lmdb_reader.py", "client/cacheclient/prefetch.py",
    ],
    "checkpoint": [
        "bench/checkpoint.py", "bench/latency_proxy.py", *_SERVER, *_CLIENT, "client/cacheclient/checkpoint",
    ],
    "large_values": [
        "bench/large_values.py", *_SERVER, *_CLIENT, "client/cacheclient/staged.py",
        "client/cacheclient/_lmdb_reader.py",
    ],
    "cluster": [
        "bench/cluster.py", *_SERVER, *_CLIENT, "cachesvc/meta", "client/cacheclient/meta.py",
        "client/cacheclient/routing.py",
    ],
    "processes": ["bench/processes.py", "bench/cluster.py", *_SERVER, *_CLIENT, "cachesvc/meta"],
    "restart": ["bench/restart.py", "bench/latency_proxy.py", *_SERVER, *_CLIENT],
    "moves": [
        "bench/moves.py", "bench/restart.py", "bench/cluster.py", "bench/latency_proxy.py", *_SERVER, *_CLIENT,
        "cachesvc/meta", "client/cacheclient/meta.py", "client/cacheclient/routing.py",
    ],
    "pyspy_profile": ["bench/pyspy_profile.py", *_SERVER, *_CLIENT],
    "tenants": [
        "bench/tenants.py", *_SERVER, *_CLIENT, "cachesvc/meta", "cachesvc/rpc.py", "cachesvc/tenancy.py",
        "client/cacheclient/meta.py", "client/cacheclient/routing.py",
    ],
    "soak": [
        "tests/test_soak.py", "tests/soak_worker.py", *_SERVER, *_CLIENT, "cachesvc/meta", "client/cacheclient/meta.py",
        "client/cacheclient/routing.py", "client/cacheclient/kv.py",
    ],
}  # fmt: skip

UNKNOWN = "unknown"


@dataclass
class Freshness:
    """Whether a result still measures the code as it is: "fresh", "stale" or "unknown", and why."""

    state: str
    reason: str


@dataclass
class Result:
    """One results file, read."""

    path: Path
    benchmark: str
    doc: dict[str, Any]
    commit: str
    date: str
    uncommitted: list[str] = field(default_factory=list)
    plots: list[Path] = field(default_factory=list)


def _git(*args: str, root: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)


def _benchmark_of(path: Path, doc: dict[str, Any]) -> str:
    if isinstance(doc.get("benchmark"), str):
        return str(doc["benchmark"])
    # cluster.json, meta.json, dataloader.bytes.json, checkpoint-1g.json: the name up to the first . or -
    return path.stem.split(".")[0].split("-")[0]


def load(path: Path) -> Result:
    """A results file with its benchmark, commit and date (UNKNOWN where it does not say)."""
    doc = json.loads(path.read_text())
    machine: dict[str, Any] = doc["machine"] if isinstance(doc.get("machine"), dict) else {}
    code: dict[str, Any] = machine["code"] if isinstance(machine.get("code"), dict) else {}
    commit = code.get("commit") or machine.get("commit") or doc.get("commit") or UNKNOWN
    date = machine.get("date_utc") or doc.get("date_utc") or doc.get("date") or UNKNOWN
    uncommitted = [str(p) for p in code.get("uncommitted_changes") or []]
    return Result(path, _benchmark_of(path, doc), doc, str(commit), str(date), uncommitted)


def freshness(result: Result, root: Path = ROOT, measures: dict[str, list[str]] | None = None) -> Freshness:
    """Fresh when the result's commit contains the last commit that changed the code its benchmark measures."""
    paths = (measures or MEASURES).get(result.benchmark)
    if paths is None:
        return Freshness(UNKNOWN, f"no code paths listed for benchmark {result.benchmark!r} in report.py")
    if result.commit == UNKNOWN:
        return Freshness(UNKNOWN, "the result does not record the commit it was measured at")
    resolved = _git("rev-parse", "--verify", "--quiet", f"{result.commit}^{{commit}}", root=root)
    if resolved.returncode != 0:
        return Freshness(UNKNOWN, f"commit {result.commit} is not in this repository's history")
    commit = resolved.stdout.strip()
    last = _git("log", "-1", "--format=%H", "--", *paths, root=root).stdout.strip()
    if not last:
        return Freshness("fresh", "no commit changed the measured code")
    if _git("merge-base", "--is-ancestor", last, commit, root=root).returncode != 0:
        since = _git("rev-list", "--count", f"{commit}..{last}", "--", *paths, root=root).stdout.strip() or "?"
        subject = _git("log", "-1", "--format=%h %cs %s", last, root=root).stdout.strip()
        subject = subject if len(subject) <= 90 else subject[:89] + "…"
        return Freshness("stale", f"{since} later commit(s) changed the code it measures, the last {subject}")
    touched = [p for p in result.uncommitted if any(p == m or p.startswith(m.rstrip("/") + "/") for m in paths)]
    if touched:
        return Freshness("fresh", f"measured with uncommitted changes to {', '.join(touched)}")
    return Freshness("fresh", "no later commit changed the measured code")


# -- headline ratios ---------------------------------------------------------


def _number(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value).lower()
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _met(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    return str(value)


def _row(name: str, value: Any, target: Any = None, met: Any = None) -> tuple[str, str, str, str]:
    return name, _number(value), _number(target) if target is not None else "-", _met(met)


def _from_targets(targets: Any) -> list[tuple[str, str, str, str]]:
    rows: list[tuple[str, str, str, str]] = []
    if isinstance(targets, list):  # [{"target"|"ratio"|"dataset": ..., "value"|"ratio": ..., "limit"|"target": ...}]
        for t in targets:
            if not isinstance(t, dict):
                continue
            label = " ".join(str(t[k]) for k in ("dataset", "target", "ratio") if isinstance(t.get(k), str))
            value = next((t[k] for k in ("value", "ratio", "measured") if isinstance(t.get(k), int | float)), None)
            target = next((t[k] for k in ("limit", "target") if isinstance(t.get(k), int | float)), None)
            rows.append(_row(label, value, target, t.get("met")))
    elif isinstance(targets, dict):
        for name, t in targets.items():
            if isinstance(t, dict):
                value = next((t[k] for k in ("ratio", "value", "measured", "min_rate") if k in t), None)
                if isinstance(value, dict):  # measured per case: one row each
                    met_by = t.get("met_by_tokens") or {}
                    rows += [
                        _row(f"{name} ({case})", v, t.get("target"), met_by.get(case)) for case, v in value.items()
                    ]
                    continue
                rows.append(_row(name, value, t.get("target"), t.get("met")))
            else:
                rows.append(_row(name, t))
    return rows


def _s3_clients(doc: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rows = []
    for size, section in (doc.get("results") or {}).items():
        clients = section.get("clients") or {}
        base = clients.get("boto3", {})
        for name, ops in clients.items():
            if name == "boto3":
                continue
            for op in ("get", "put"):
                if op in ops and op in base and base[op].get("objects_per_s"):
                    ratio = ops[op]["objects_per_s"] / base[op]["objects_per_s"]
                    rows.append(_row(f"{size} {op}: {name} objects/s over boto3", ratio))
    return rows


def _smallvalues(doc: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rows = []
    for size, rates in (doc.get("rates_per_second_best_of_rounds") or {}).items():
        before, after = rates.get("before", {}), rates.get("after", {})
        for op in ("put", "get", "server_get_many", "colocated_get_many"):
            if before.get(op) and after.get(op):
                rows.append(_row(f"{size} {op}/s: packed over one record per value", after[op] / before[op]))
    for keys, sizes in (doc.get("space") or {}).items():
        for size, layouts in sizes.items():
            b, a = layouts.get("before", {}), layouts.get("after", {})
            if b.get("charged_per_value_byte") and a.get("charged_per_value_byte"):
                ratio = a["charged_per_value_byte"] / b["charged_per_value_byte"]
                rows.append(_row(f"{keys}, {size}: bytes charged per value byte, packed over one record", ratio))
    return rows


def _cluster(doc: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rows = []
    by_servers = doc.get("throughput_by_servers") or {}
    if "1" in by_servers:
        for n, sizes in by_servers.items():
            if n == "1":
                continue
            for size, row in sizes.items():
                one = by_servers["1"].get(size, {}).get("values_per_s")
                if one and row.get("values_per_s"):
                    rows.append(_row(f"{size}: values/s, {n} servers over 1", row["values_per_s"] / one))
    for move in doc.get("movement") or []:
        if isinstance(move, dict) and "moved_keys_over_ideal" in move:
            rows.append(_row(f"keys moved on {move.get('nodes')}, over the ideal", move["moved_keys_over_ideal"]))
    for kind, kill in (doc.get("sigkill") or {}).items():
        if isinstance(kill, dict) and "recovery_s_p50" in kill:
            rows.append(_row(f"SIGKILL ({kind}): reads flowing again, p50 s", kill["recovery_s_p50"]))
    return rows


def headlines(result: Result) -> list[tuple[str, str, str, str]]:
    """(what, measured, target, met) rows: the file's own targets and ratios, else a few ratios computed here."""
    doc = result.doc
    rows = _from_targets(doc.get("targets")) + _from_targets(doc.get("ratios"))
    if rows:
        return rows
    computed = {"s3_clients": _s3_clients, "smallvalues": _smallvalues, "cluster": _cluster}.get(result.benchmark)
    return computed(doc) if computed else []


# -- the page ------------------------------------------------------------------


def _plots(results: list[Result], results_dir: Path) -> list[Path]:
    """Attaches each PNG to the result of the same name (NAME.png, NAME_*.png); returns the PNGs left over."""
    left = sorted(results_dir.glob("*.png"))
    for result in sorted(results, key=lambda r: -len(r.path.stem)):  # dataloader.bytes before dataloader
        stem = result.path.stem
        mine = [p for p in left if p.stem == stem or p.stem.startswith(stem + "_")]
        result.plots = mine
        left = [p for p in left if p not in mine]
    return left


def _image(path: Path, out: Path) -> str:
    return f"![{path.name}]({os.path.relpath(path, out.parent)})"


def render(results_dir: Path, out: Path, root: Path = ROOT, measures: dict[str, list[str]] | None = None) -> str:
    """The Markdown page for every *.json in `results_dir`; `out` is where it will live (for the plots' links)."""
    results = [load(p) for p in sorted(results_dir.glob("*.json"))]
    orphans = _plots(results, results_dir)
    head = _git("log", "-1", "--format=%h %cs", root=root).stdout.strip() or UNKNOWN
    lines = [
        "# Benchmark results",
        "",
        f"Made by `bench/report.py` from `{os.path.relpath(results_dir, root)}/*.json` at commit {head}. A result is",
        "**stale** when the code it measures (`MEASURES` in `bench/report.py`) changed in a commit after the one",
        "it was measured at; rerun it (`make bench BENCHES=NAME`) to refresh it. Each benchmark's own docstring",
        "says what it compares and at which settings.",
        "",
        "| result | benchmark | measured at | date (UTC) | freshness |",
        "| --- | --- | --- | --- | --- |",
    ]
    checked = {r.path: freshness(r, root, measures) for r in results}
    for r in results:
        state = checked[r.path].state
        shown = f"**{state}**" if state != "fresh" else state
        lines.append(
            f"| [{r.path.name}](#{_anchor(r.path.name)}) | {r.benchmark} | {r.commit[:10]} | {r.date} | {shown} |"
        )
    for r in results:
        fresh = checked[r.path]
        lines += ["", f"## {r.path.name}", ""]
        lines.append(f"- benchmark: `{r.benchmark}`; command: `{r.doc.get('command', UNKNOWN)}`")
        lines.append(f"- measured at commit {r.commit} on {r.date}")
        label = f"**{fresh.state.upper()}**" if fresh.state != "fresh" else "fresh"
        lines.append(f"- {label}: {fresh.reason}")
        if isinstance(r.doc.get("note"), str):
            lines.append(f"- note: {r.doc['note']}")
        rows = headlines(r)
        if rows:
            lines += ["", "| headline | measured | target | met |", "| --- | ---: | ---: | --- |"]
            lines += [f"| {what} | {value} | {target} | {met} |" for what, value, target, met in rows]
        else:
            lines += ["", "No headline ratios recorded; see the file."]
        lines += [*(f"\n{_image(p, out)}" for p in r.plots)]
    if orphans:
        lines += ["", "## Other plots", "", *(_image(p, out) for p in orphans)]
    return "\n".join(lines) + "\n"


def _anchor(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=BENCH_DIR / "results", help="the *.json (and *.png) to read")
    parser.add_argument("--out", type=Path, default=None, help="the page to write (default RESULTS/REPORT.md)")
    args = parser.parse_args(argv)
    out = args.out or args.results / "REPORT.md"
    page = render(args.results, out)
    out.write_text(page)
    stale = page.count("| **stale** |")
    print(f"wrote {out}: {len(list(args.results.glob('*.json')))} results, {stale} stale")
    return 0


if __name__ == "__main__":
    sys.exit(main())
