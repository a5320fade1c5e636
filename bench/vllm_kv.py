"""vLLM KV benchmark: a consumer engine's time to first token with its prompt's prefix from cachesvc, recomputed, or
from vLLM's ExampleConnector.

For prompts of 512, 2,048 and 8,192 tokens, on two random Llama models that
vLLM's CPU build runs (fp32, head dim 32, block size 128):

* tiny: 2 layers, hidden 128, 2 KV heads (1 KiB of KV per token);
* larger: 8 layers, hidden 512, 8 KV heads (16 KiB of KV per token);

a producer engine computes each prompt once and stores its KV; then a
consumer engine, another process, times `llm.generate(prompt, max_tokens=1)`
(its TTFT, in-process engine, as `vllm.LLM` runs it) with each contender:

* recompute: no connector; vLLM prefills the whole prompt;
* cachesvc: `cacheclient.vllm.CacheConnector` (kv_consumer) against a
  `cachesvc serve` on this machine (L1 memory), looking up from its local
  index and loading every full block of the prefix, over gRPC;
* colocated: the same against a server whose L1 is shared memory
  (`l1.shared = true`): the blocks are read from the server's arena on this
  machine, no gRPC (`cacheclient.colocated`);
* ExampleConnector: vLLM's own connector (KV as safetensors files, a file
  per layer, on local disk: a directory under /tmp whose files are in the
  page cache after the producer wrote them; its only setting);
* floor: no connector, the prefix already in vLLM's own prefix cache: the
  TTFT a free load would give. TTFT less the floor is the prefix's own cost
  (its load, or its prefill), reported beside each TTFT.

vLLM's own prefix cache is reset before every timed request, so each one
loads (or computes) the prefix anew; every contender's first token is
checked against recompute's, and vLLM's counters must show the prefix
loaded, not computed, or the run fails. Every engine uses vLLM's CPU
defaults (all the machine's cores). Contenders take turns per round; the
numbers are medians.

Usage:
    python bench/vllm_kv.py            # about 10 minutes on 2 cores
    python bench/vllm_kv.py --quick    # fewer samples, tiny model only

Needs the vLLM venv (`make venv-vllm`); the engines run with its python.
Writes `bench/results/vllm_kv.json` and `vllm_kv.png`, and prints a table
and the targets: a 2,048-token prefix loaded at least 10x faster than
recomputed, and at least 2x faster than ExampleConnector (over gRPC and co-located).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
VLLM_PYTHON = Path(os.environ.get("CACHESVC_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
ENGINE = ROOT / "tests" / "vllm_engine.py"
BLOCK = 128
SIZES = (512, 2048, 8192)
MODELS = {"tiny": {"layers": 2, "hidden": 128}, "larger": {"layers": 8, "hidden": 512}}
CONTENDERS = ("recompute", "cachesvc", "colocated", "example", "floor")
"""floor: the prefix already in vLLM's own prefix cache (no load, no prefill of it): what a free load would give."""


# -- inside an engine process (the vLLM venv) ------------------------------------------


def engine_main(args: argparse.Namespace) -> None:
    """Times max_tokens=1 requests, one prompt at a time, vLLM's prefix cache reset before each."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {}
    if args.connector:
        kwargs["kv_transfer_config"] = KVTransferConfig(**json.loads(args.connector))
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=max(SIZES) + 128,
        # One chunk per prompt: ExampleConnector stores a prompt in the step that schedules it, so a prompt
        # prefilled in chunks (vLLM's default past 4,096 tokens here) leaves it a file it cannot load.
        max_num_batched_tokens=max(SIZES) + 128,
        block_size=BLOCK,
        disable_log_stats=False,
        seed=0,
        **kwargs,
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True)
    prompts = json.loads(Path(args.prompts).read_text())

    def counters() -> dict[str, float]:
        counts: dict[str, float] = {}
        for metric in llm.get_metrics():
            if metric.name == "vllm:prompt_tokens_by_source":
                source = metric.labels.get("source", "")
                counts[source] = counts.get(source, 0) + metric.value
        return counts

    # One untimed pass first: the first requests of an engine pay one-off costs (connections, allocations).
    for prompt in prompts:
        if not args.keep_prefix_cache:
            llm.reset_prefix_cache()
        llm.generate([{"prompt_token_ids": prompt["tokens"]}], params, use_tqdm=False)
    for _ in range(args.repeat):
        for prompt in prompts:
            if not args.keep_prefix_cache:
                llm.reset_prefix_cache()
            before = counters()
            began = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": prompt["tokens"]}], params, use_tqdm=False)[0]
            seconds = time.perf_counter() - began
            after = counters()
            record = {
                "size": prompt["size"],
                "seconds": seconds,
                "token": out.outputs[0].token_ids[0],
                "sources": {k: after.get(k, 0) - before.get(k, 0) for k in after},
            }
            print("RESULT " + json.dumps(record), flush=True)


# -- the orchestrator ---------------------------------------------------------------


def _engine(
    model: Path, prompts: Path, connector: dict[str, Any] | None, repeat: int, keep_prefix_cache: bool = False
) -> list[dict[str, Any]]:
    argv = [str(VLLM_PYTHON), __file__, "engine", "--model", str(model), "--prompts", str(prompts)]
    argv += ["--repeat", str(repeat), *(["--keep-prefix-cache"] if keep_prefix_cache else [])]
    if connector:
        argv += ["--connector", json.dumps(connector)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"engine failed:\n{done.stderr[-6000:]}")
    return [json.loads(line[len("RESULT ") :]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]


def _connector(contender: str, role: str, servers: dict[str, str], disk: Path) -> dict[str, Any] | None:
    if contender in ("recompute", "floor"):
        return None
    if contender in ("cachesvc", "colocated"):
        return {
            "kv_connector": "CacheConnector",
            "kv_connector_module_path": "cacheclient.vllm",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            # cachesvc: over gRPC; colocated: from the server's shared L1 (or fail).
            "kv_connector_extra_config": {"cache": servers[contender], "colocated": contender == "colocated"},
        }
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(disk)},
    }


def run(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    from cachesvc.devcluster.procs import ManagedProcess, free_port, wait_for_port

    work = Path(tempfile.mkdtemp(prefix="vllm-kv-bench-"))
    config = work / "kv.toml"
    config.write_text('[[namespaces]]\nprefix = "kv/"\nwrite_mode = "cache-only"\n')
    servers: dict[str, str] = {}
    processes = []
    # Two servers: L1 a private dict (read over gRPC), and L1 in shared memory (read co-located).
    for contender, shared in (("cachesvc", "false"), ("colocated", "true")):
        port = free_port()
        argv = [sys.executable, "-m", "cachesvc", "serve", "--listen", f"127.0.0.1:{port}", "--l1-bytes", "2GiB"]
        env = {**os.environ, "CACHESVC_L1_SHARED": shared}
        server = ManagedProcess("cache", [*argv, "--config", str(config)], work / f"{contender}.log", env=env)
        processes.append(server)
        wait_for_port(port, timeout=30.0, proc=server.proc)
        servers[contender] = f"127.0.0.1:{port}"
    rows: list[dict[str, Any]] = []
    try:
        for name in args.models:
            shape = MODELS[name]
            model = work / name
            subprocess.run(
                [str(VLLM_PYTHON), str(ENGINE), "model", str(model), "--layers", str(shape["layers"]),
                 "--hidden", str(shape["hidden"]), "--seed", "0"],
                check=True, capture_output=True, timeout=300,
            )  # fmt: skip
            rng = random.Random(7)
            prompts = work / f"{name}-prompts.json"
            # The prefix is `size` tokens (whole blocks) and 2 more are computed: ExampleConnector loads the
            # whole blocks of all but the last token less one, CacheConnector those of all but the last.
            batch = [{"size": s, "tokens": [rng.randrange(1, 1024) for _ in range(s + 2)]} for s in args.sizes]
            prompts.write_text(json.dumps(batch))
            disk = work / f"{name}-example-kv"
            disk.mkdir()
            log(f"{name}: producers")
            for contender in ("cachesvc", "colocated", "example"):
                _engine(model, prompts, _connector(contender, "kv_producer", servers, disk), 1)
            samples: dict[str, list[dict[str, Any]]] = {c: [] for c in CONTENDERS}
            for round_ in range(args.rounds):
                for contender in CONTENDERS:
                    log(f"{name}: round {round_ + 1}/{args.rounds}, {contender}")
                    connector = _connector(contender, "kv_consumer", servers, disk)
                    samples[contender] += _engine(model, prompts, connector, args.repeat, contender == "floor")
            rows += _rows(name, shape, samples)
    finally:
        for process in processes:
            process.stop(10.0)
    return {"rows": rows}


def _rows(model: str, shape: dict[str, int], samples: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for size in sorted({s["size"] for s in samples["recompute"]}):
        row: dict[str, Any] = {"model": model, **shape, "prefix_tokens": size}
        tokens = {}
        for contender, records in samples.items():
            mine = [r for r in records if r["size"] == size]
            row[f"ttft_{contender}_ms"] = round(1000 * statistics.median(r["seconds"] for r in mine), 2)
            row[f"ttft_{contender}_best_ms"] = round(1000 * min(r["seconds"] for r in mine), 2)
            row[f"samples_{contender}"] = len(mine)
            tokens[contender] = {r["token"] for r in mine}
            loaded = {r["sources"].get("external_kv_transfer", 0) for r in mine}
            local = {r["sources"].get("local_cache_hit", 0) for r in mine}
            expected = {0} if contender in ("recompute", "floor") else {size}
            if loaded != expected or local != ({size} if contender == "floor" else {0}):
                raise RuntimeError(
                    f"{model} {size} {contender}: loaded {loaded}, local hits {local}, expected {expected}"
                )
        if len({frozenset(t) for t in tokens.values()}) != 1 or len(tokens["recompute"]) != 1:
            raise RuntimeError(f"{model} {size}: first tokens differ: {tokens}")
        row["speedup_vs_recompute"] = round(row["ttft_recompute_ms"] / row["ttft_cachesvc_ms"], 2)
        row["speedup_vs_example"] = round(row["ttft_example_ms"] / row["ttft_cachesvc_ms"], 2)
        row["colocated_speedup_vs_recompute"] = round(row["ttft_recompute_ms"] / row["ttft_colocated_ms"], 2)
        row["colocated_speedup_vs_example"] = round(row["ttft_example_ms"] / row["ttft_colocated_ms"], 2)
        # The prefix's own cost: each TTFT less the floor's (computing the last tokens, the rest of a request).
        floor = row["ttft_floor_ms"]
        for contender in ("recompute", "cachesvc", "colocated", "example"):
            row[f"prefix_{contender}_ms"] = round(max(row[f"ttft_{contender}_ms"] - floor, 0.01), 2)
        row["prefix_speedup_vs_recompute"] = round(row["prefix_recompute_ms"] / row["prefix_cachesvc_ms"], 2)
        row["prefix_speedup_vs_example"] = round(row["prefix_example_ms"] / row["prefix_cachesvc_ms"], 2)
        # Best of the samples: on a machine shared with other work the least disturbed request of each.
        row["best_speedup_vs_recompute"] = round(row["ttft_recompute_best_ms"] / row["ttft_cachesvc_best_ms"], 2)
        row["best_speedup_vs_example"] = round(row["ttft_example_best_ms"] / row["ttft_cachesvc_best_ms"], 2)
        row["best_colocated_speedup_vs_recompute"] = round(
            row["ttft_recompute_best_ms"] / row["ttft_colocated_best_ms"], 2
        )
        row["best_colocated_speedup_vs_example"] = round(row["ttft_example_best_ms"] / row["ttft_colocated_best_ms"], 2)
        rows.append(row)
    return rows


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for row in rows:
        if row["prefix_tokens"] != 2048:
            continue
        for path, prefix in (("grpc", ""), ("colocated", "colocated_")):
            for rival, target in (("recompute", 10.0), ("example", 2.0)):
                ratio = row[f"{prefix}speedup_vs_{rival}"]
                out[f"{row['model']}_2048_{path}_vs_{rival}"] = {
                    "target": target,
                    "ratio": ratio,
                    "met": ratio >= target,
                }
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = [
        "| model | prefix tokens | floor | recompute | ExampleConnector | cachesvc gRPC | cachesvc co-located "
        "| co-located vs recompute | vs Example |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines = ["TTFT, ms, median of the samples (floor: the prefix in vLLM's own cache)", "", *head]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['prefix_tokens']:,} | {r['ttft_floor_ms']:.1f} | {r['ttft_recompute_ms']:.1f} "
            f"| {r['ttft_example_ms']:.1f} | {r['ttft_cachesvc_ms']:.1f} | {r['ttft_colocated_ms']:.1f} "
            f"| {r['colocated_speedup_vs_recompute']:.1f}x | {r['colocated_speedup_vs_example']:.2f}x |"
        )
    lines += ["", "TTFT, ms, best of the samples (the least disturbed request of each)", "", *head]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['prefix_tokens']:,} | {r['ttft_floor_best_ms']:.1f} "
            f"| {r['ttft_recompute_best_ms']:.1f} | {r['ttft_example_best_ms']:.1f} | {r['ttft_cachesvc_best_ms']:.1f} "
            f"| {r['ttft_colocated_best_ms']:.1f} | {r['best_colocated_speedup_vs_recompute']:.1f}x "
            f"| {r['best_colocated_speedup_vs_example']:.2f}x |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows}, key=list(MODELS).index)
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    labels = {
        "recompute": "recompute",
        "example": "vLLM ExampleConnector (disk)",
        "cachesvc": "cachesvc (gRPC)",
        "colocated": "cachesvc (co-located, shared L1)",
        "floor": "floor: prefix in vLLM's own cache",
    }
    for ax, model in zip(axes[0], models, strict=True):
        mine = [r for r in rows if r["model"] == model]
        xs = [r["prefix_tokens"] for r in mine]
        for contender in ("recompute", "example", "cachesvc", "colocated", "floor"):
            ax.plot(xs, [r[f"ttft_{contender}_best_ms"] for r in mine], marker="o", label=labels[contender])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs, [f"{x:,}" for x in xs])
        ax.set_xlabel("prefix tokens (2 more computed)")
        ax.set_ylabel("TTFT, ms (best of the samples)")
        ax.set_title(f"{model}: {mine[0]['layers']} layers, hidden {mine[0]['hidden']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("vLLM (CPU build) consumer: time to first token by where the prefix's KV comes from")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    engine = sub.add_parser("engine", help=argparse.SUPPRESS)
    engine.add_argument("--model", required=True)
    engine.add_argument("--prompts", required=True)
    engine.add_argument("--connector", default="")
    engine.add_argument("--repeat", type=int, default=1)
    engine.add_argument("--keep-prefix-cache", action="store_true")
    parser.add_argument("--quick", action="store_true", help="fewer samples, the tiny model only")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "vllm_kv.json")
    args = parser.parse_args(argv)
    if args.command == "engine":
        engine_main(args)
        return 0
    if not VLLM_PYTHON.exists():
        print(f"no vLLM venv at {VLLM_PYTHON}: run `make venv-vllm`", file=sys.stderr)
        return 2

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    args.models = ["tiny"] if args.quick else list(MODELS)
    args.sizes = SIZES
    args.rounds = 2
    args.repeat = 2 if args.quick else 4
    sys.path.insert(0, str(BENCH_DIR))
    from _machine import machine_info, version

    started = time.perf_counter()
    info = machine_info()
    info["vllm_cpu"] = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    info["cachesvc"] = version("cachesvc")
    result = run(args, log)
    info["loadavg_at_end"] = list(os.getloadavg())
    result = {
        "benchmark": "vllm_kv",
        "command": "python bench/vllm_kv.py" + (" --quick" if args.quick else ""),
        "seconds": round(time.perf_counter() - started, 1),
        "machine": info,
        **result,
        "targets": targets(result["rows"]),
        "notes": [
            "TTFT: wall time of llm.generate(prompt, max_tokens=1) in a consumer engine (vllm.LLM, in-process "
            "engine core, CPU build, its default threads), vLLM's prefix cache reset before each request.",
            "Each prompt is `prefix_tokens` + 2 tokens: the prefix's blocks (128 tokens each) come from the "
            "contender, the last 2 tokens are computed (what ExampleConnector needs to load the whole prefix); vLLM's "
            "prompt_tokens_by_source counters are checked per request.",
            "cachesvc: CacheConnector against one `cachesvc serve` (L1 memory) on this machine, over gRPC on "
            "127.0.0.1. ExampleConnector: safetensors files per layer in a /tmp directory (page cache warm).",
            "Every engine prefills a prompt in one chunk (max_num_batched_tokens = max_model_len): ExampleConnector "
            "fails on prompts prefilled in chunks (it stores a prompt in the step that first schedules it).",
            f"Samples per contender and size: {args.rounds} engine runs x {args.repeat} requests; the targets and "
            "ttft_*_ms are medians, ttft_*_best_ms the least of the samples.",
            "colocated: the same connector against a server with l1.shared = true, reading its shared L1 arena.",
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result["rows"], args.out.with_suffix(".png"))
    print(table(result["rows"]))
    print(json.dumps(result["targets"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
