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
  (`l1.shared = true`): the blocks are copied from the server's arena into
  vLLM's paged blocks, no gRPC (`cacheclient.colocated`);
* colocated_async: the same, loading asynchronously (`load_async`);
* colocated_default: the same under vLLM's default scheduler settings
  (chunked prefill), where every other engine prefills in one chunk;
* ExampleConnector: vLLM's own connector (KV as safetensors files, a file
  per layer, on local disk: a directory under /tmp whose files are in the
  page cache after the producer wrote them; its only setting);
* vLLM's other connectors (`OTHER_CONNECTORS`) where they run on the CPU
  build; the JSON says what stops each that does not;
* floor: no connector, the prefix already in vLLM's own prefix cache: the
  TTFT a free load would give. TTFT less the floor is the prefix's own cost
  (its load, or its prefill), reported beside each TTFT.

vLLM's own prefix cache is reset before every timed request, so each one
loads (or computes) the prefix anew; every contender's first token is
checked against recompute's, and vLLM's counters must show the prefix
loaded, not computed, or the run fails. Every engine uses vLLM's CPU
defaults (all the machine's cores). Contenders take turns per round; the
numbers are medians. Beside each load: its own bytes/s (from the
connector's counters), a plain memcpy of as many bytes and a bare gRPC
stream of the same blocks in the same process. Then a throughput run: 32
requests sharing 4 long prefixes, with and without the connector.

Usage:
    python bench/vllm_kv.py            # about 20 minutes on 2 cores
    python bench/vllm_kv.py --models larger --rounds 1 --repeat 3
    python bench/vllm_kv.py --quick    # fewer samples, tiny model only

Needs the vLLM venv (`make venv-vllm`); the engines run with its python.
Writes `bench/results/vllm_kv.json` (and `vllm_kv.png` with matplotlib),
and prints the tables and the issue's targets, as ratios in this run:
co-located TTFT at most 0.67x ExampleConnector's at 2,048 and 8,192 tokens;
the co-located load at least 0.5x a memcpy's bytes/s; the gRPC load at
least 0.9x a bare stream's; vLLM's default chunked prefill within 10% of one
chunk; the shared-prefix run at least 2x the requests/s of no connector.
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
CONTENDERS = ("recompute", "cachesvc", "colocated", "colocated_async", "colocated_default", "example", "floor")
"""floor: the prefix already in vLLM's own prefix cache (no load, no prefill of it): what a free load would give.
colocated_async: loads with load_kv_async (a worker thread); colocated_default: vLLM's default scheduler settings
(chunked prefill, its default max_num_batched_tokens) instead of one chunk per prompt."""
OURS = ("cachesvc", "colocated", "colocated_async", "colocated_default")
OTHER_CONNECTORS = {
    "SimpleCPUOffloadConnector": {"cpu_bytes_to_use": 1 << 30},
    "SimpleCPUOffloadConnector (disk)": {"kv_offload_backend": "disk", "disk_path": "{work}/simple-disk"},
    "OffloadingConnector": {"cpu_bytes_to_use": 1 << 30},
    "LMCacheConnectorV1": {},
    "HF3FSKVConnector": {},
    "MooncakeStoreConnector": {},
}
"""vLLM's other connectors that could hold a prefix for another request: each is tried on the CPU build (a kv_both
engine, a prompt twice with vLLM's prefix cache reset between) and races when it loads, else its error is recorded."""
THROUGHPUT = {"documents": 4, "per_document": 8, "prefix": 2048, "question": 64, "new_tokens": 8}
"""The shared-prefix run: 32 requests, 8 on each of 4 documents of 2,048 tokens, each with its own 64-token question."""


# -- inside an engine process (the vLLM venv) ------------------------------------------


def engine_main(args: argparse.Namespace) -> None:
    """Times max_tokens=1 requests, one prompt at a time, vLLM's prefix cache reset before each."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {}
    connectors: list[Any] = []
    if args.connector:
        kwargs["kv_transfer_config"] = KVTransferConfig(**json.loads(args.connector))
        if "CacheConnector" in args.connector:
            connectors = _track_connectors()
    if not args.default_scheduler:
        # One chunk per prompt: ExampleConnector stores a prompt in the step that schedules it, so a prompt
        # prefilled in chunks (vLLM's default past 4,096 tokens here) leaves it a file it cannot load.
        kwargs["max_num_batched_tokens"] = max(SIZES) + 128
    try:
        llm = LLM(
            model=args.model,
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype="float32",
            max_model_len=max(SIZES) + 128,
            block_size=BLOCK,
            disable_log_stats=False,
            seed=0,
            **kwargs,
        )
    except Exception as exc:  # another connector that does not run on this build: say what stops it
        print("FAILED " + json.dumps(f"{type(exc).__name__}: {exc}"[:400]), flush=True)
        return
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True)
    prompts = json.loads(Path(args.prompts).read_text())
    if args.throughput:
        _throughput(llm, prompts, SamplingParams, args.keep_prefix_cache)
        return

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
            before, moved = counters(), _moved(connectors)
            began = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": prompt["tokens"]}], params, use_tqdm=False)[0]
            seconds = time.perf_counter() - began
            after, moved_after = counters(), _moved(connectors)
            record = {
                "size": prompt["size"],
                "seconds": seconds,
                "token": out.outputs[0].token_ids[0],
                "sources": {k: after.get(k, 0) - before.get(k, 0) for k in after},
                **{k: moved_after[k] - moved[k] for k in moved},
            }
            print("RESULT " + json.dumps(record), flush=True)
    if connectors:
        _ceilings(connectors, prompts)


def _track_connectors() -> list[Any]:
    """Every CacheConnector the engine makes (the scheduler's and the worker's)."""
    import cacheclient.vllm as connector_module

    made: list[Any] = []
    init = connector_module.CacheConnector.__init__

    def tracked(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    connector_module.CacheConnector.__init__ = tracked  # type: ignore[method-assign]
    return made


def _moved(connectors: list[Any]) -> dict[str, float]:
    """Bytes the connectors loaded (placed in the pages, checked) and the seconds their loads took."""
    return {
        "load_bytes": sum(c.counters["loaded_bytes"] for c in connectors),
        "load_seconds": sum(c.counters["load_seconds"] for c in connectors),
    }


def _ceilings(connectors: list[Any], prompts: list[dict[str, Any]]) -> None:
    """What this process's memory and gRPC allow for each prompt's bytes: a plain memcpy of as many bytes (one
    thread, as the load runs), and a bare gRPC stream of the same blocks (no copy, no check), best of 5 each."""
    worker = next(c for c in connectors if c._paged is not None)
    kv = worker.kv
    from cacheclient import CacheClient

    remote = CacheClient(kv.client.address, colocated=False)
    for prompt in prompts:
        keys = kv.block_keys(prompt["tokens"][: prompt["size"]])
        nbytes = len(keys) * worker._paged.record.size
        source, target = bytearray(nbytes), bytearray(nbytes)
        target[:] = source  # touched once: no page faults in the timed copies
        copy = stream = float("inf")
        for _ in range(5):
            began = time.perf_counter()
            target[:] = source
            copy = min(copy, time.perf_counter() - began)
            began = time.perf_counter()
            got = sum(
                sum(len(p) for p in pieces or ())
                for _, pieces in remote.transport.iter_pieces(keys, release=False, timeout=None, verify=False)
            )
            stream = min(stream, time.perf_counter() - began)
            if got != nbytes:
                raise RuntimeError(f"the bare stream read {got} bytes of {nbytes}")
        record = {"size": prompt["size"], "bytes": nbytes, "memcpy_seconds": copy, "stream_seconds": stream}
        print("CEILING " + json.dumps(record), flush=True)
    remote.close()


def _throughput(llm: Any, prompts: list[dict[str, Any]], sampling: Any, keep_prefix_cache: bool) -> None:
    """One generate call of every prompt: requests/s and vLLM's mean TTFT over them."""
    params = sampling(max_tokens=THROUGHPUT["new_tokens"], temperature=0.0, detokenize=False, ignore_eos=True)

    def ttft() -> tuple[float, float]:
        for metric in llm.get_metrics():
            if metric.name == "vllm:time_to_first_token_seconds":
                return metric.sum, metric.count
        return 0.0, 0.0

    # Untimed: another prompt of the same length pays the engine's one-off costs.
    warm = [{"prompt_token_ids": [t % 1000 + 1 for t in prompts[0]["tokens"][::-1]]}]
    llm.generate(warm, params, use_tqdm=False)
    if not keep_prefix_cache:
        llm.reset_prefix_cache()
    (sum0, count0), began = ttft(), time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p["tokens"]} for p in prompts], params, use_tqdm=False)
    seconds, (sum1, count1) = time.perf_counter() - began, ttft()
    record = {
        "requests": len(prompts),
        "seconds": seconds,
        "mean_ttft_seconds": (sum1 - sum0) / max(1, count1 - count0),
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
    }
    print("THROUGHPUT " + json.dumps(record), flush=True)


# -- the orchestrator ---------------------------------------------------------------


def _engine(
    model: Path,
    prompts: Path,
    connector: dict[str, Any] | None,
    repeat: int,
    keep_prefix_cache: bool = False,
    *flags: str,
) -> dict[str, list[Any]]:
    """Runs one engine process; its output lines by tag (RESULT, CEILING, THROUGHPUT, FAILED)."""
    argv = [str(VLLM_PYTHON), __file__, "engine", "--model", str(model), "--prompts", str(prompts)]
    argv += ["--repeat", str(repeat), *(["--keep-prefix-cache"] if keep_prefix_cache else []), *flags]
    if connector:
        argv += ["--connector", json.dumps(connector)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"engine failed:\n{done.stderr[-6000:]}")
    out: dict[str, list[Any]] = {"RESULT": [], "CEILING": [], "THROUGHPUT": [], "FAILED": []}
    for line in done.stdout.splitlines():
        tag, _, rest = line.partition(" ")
        if tag in out:
            out[tag].append(json.loads(rest))
    return out


def _connector(contender: str, role: str, servers: dict[str, str], disk: Path) -> dict[str, Any] | None:
    if contender in ("recompute", "floor", "none"):
        return None
    if contender in OURS:
        server = servers["cachesvc" if contender == "cachesvc" else "colocated"]
        return {
            "kv_connector": "CacheConnector",
            "kv_connector_module_path": "cacheclient.vllm",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            # cachesvc: over gRPC; colocated*: from the server's shared L1 (or fail).
            "kv_connector_extra_config": {
                "cache": server,
                "colocated": contender != "cachesvc",
                "load_async": contender == "colocated_async",
            },
        }
    if contender in OTHER_CONNECTORS:
        extra = {k: v.format(work=disk) if isinstance(v, str) else v for k, v in OTHER_CONNECTORS[contender].items()}
        return {"kv_connector": contender.split()[0], "kv_role": "kv_both", "kv_connector_extra_config": extra}
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
        argv = [sys.executable, "-m", "cachesvc", "serve", "--listen", f"127.0.0.1:{port}", "--l1-bytes", "4GiB"]
        env = {**os.environ, "CACHESVC_L1_SHARED": shared}
        server = ManagedProcess("cache", [*argv, "--config", str(config)], work / f"{contender}.log", env=env)
        processes.append(server)
        wait_for_port(port, timeout=30.0, proc=server.proc)
        servers[contender] = f"127.0.0.1:{port}"
    rows: list[dict[str, Any]] = []
    others: dict[str, str] = {}
    throughput: dict[str, Any] = {}
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
            contenders = list(CONTENDERS)
            if name == args.models[0]:
                small = work / f"{name}-probe.json"
                small.write_text(json.dumps(batch[:1]))
                for other in OTHER_CONNECTORS:
                    log(f"{name}: trying {other}")
                    got = _engine(model, small, _connector(other, "kv_both", servers, work), 1)
                    loaded = [r["sources"].get("external_kv_transfer", 0) for r in got["RESULT"]]
                    if got["FAILED"]:
                        others[other] = "does not start on the CPU build: " + got["FAILED"][0]
                    elif not any(loaded):
                        others[other] = "starts, but loaded nothing back after vLLM's prefix cache was reset"
                    else:
                        others[other] = "runs"
                        contenders.append(other)
            log(f"{name}: producers")
            for contender in ("cachesvc", "colocated", "example"):
                _engine(model, prompts, _connector(contender, "kv_producer", servers, disk), 1)
            samples: dict[str, list[dict[str, Any]]] = {c: [] for c in contenders}
            ceilings: dict[str, list[dict[str, Any]]] = {c: [] for c in contenders}
            for round_ in range(args.rounds):
                for contender in contenders:
                    log(f"{name}: round {round_ + 1}/{args.rounds}, {contender}")
                    connector = _connector(contender, "kv_consumer", servers, disk)
                    flags = ("--default-scheduler",) if contender == "colocated_default" else ()
                    got = _engine(model, prompts, connector, args.repeat, contender == "floor", *flags)
                    samples[contender] += got["RESULT"]
                    ceilings[contender] += got["CEILING"]
            rows += _rows(name, shape, samples, ceilings)
            if name == args.models[-1] and args.throughput:
                throughput = _throughput_run(model, work, servers, log)
    finally:
        for process in processes:
            process.stop(10.0)
    return {"rows": rows, "other_connectors": others, "throughput": throughput}


def _throughput_run(model: Path, work: Path, servers: dict[str, str], log: Any) -> dict[str, Any]:
    """32 requests sharing 4 long prefixes in one generate call, vLLM's default scheduler, its prefix cache on:
    without a connector (each document computed once, then shared in vLLM's own cache) and with the documents
    in cachesvc (stored by a producer beforehand: the chat history or the RAG documents are already there)."""
    rng = random.Random(11)
    shape = THROUGHPUT
    documents = [[rng.randrange(1, 1024) for _ in range(shape["prefix"])] for _ in range(shape["documents"])]
    requests = [
        {"size": shape["prefix"], "tokens": doc + [rng.randrange(1, 1024) for _ in range(shape["question"])]}
        for _ in range(shape["per_document"])
        for doc in documents
    ]
    prompts, stored = work / "throughput.json", work / "throughput-documents.json"
    prompts.write_text(json.dumps(requests))
    stored.write_text(json.dumps([{"size": shape["prefix"], "tokens": [*doc, 1, 2]} for doc in documents]))
    log("throughput: producer")
    _engine(model, stored, _connector("colocated", "kv_producer", servers, work), 1, False, "--default-scheduler")
    result: dict[str, Any] = {"requests": len(requests), **shape}
    tokens = {}
    for contender in ("none", "colocated", "colocated_async"):
        log(f"throughput: {contender}")
        connector = _connector(contender, "kv_consumer", servers, work)
        got = _engine(model, prompts, connector, 1, False, "--default-scheduler", "--throughput")["THROUGHPUT"][0]
        result[f"{contender}_requests_per_s"] = round(got["requests"] / got["seconds"], 2)
        result[f"{contender}_mean_ttft_ms"] = round(1000 * got["mean_ttft_seconds"], 1)
        tokens[contender] = got["tokens"]
    if len({json.dumps(t) for t in tokens.values()}) != 1:
        raise RuntimeError("throughput: the outputs differ between contenders")
    for contender in ("colocated", "colocated_async"):
        result[f"{contender}_speedup"] = round(result[f"{contender}_requests_per_s"] / result["none_requests_per_s"], 2)
    return result


def _rows(
    model: str,
    shape: dict[str, int],
    samples: dict[str, list[dict[str, Any]]],
    ceilings: dict[str, list[dict[str, Any]]],
) -> list[dict[str, Any]]:
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
            if contender in OURS:
                # The load's own rate (bytes placed and checked / seconds in the connector's load), against what
                # this process's memcpy and a bare gRPC stream of the same bytes do (best of 5 each).
                row[f"load_{contender}_gb_s"] = round(
                    statistics.median(r["load_bytes"] / r["load_seconds"] for r in mine) / 1e9, 2
                )
                ceiling = [c for c in ceilings[contender] if c["size"] == size]
                row[f"memcpy_{contender}_gb_s"] = round(max(c["bytes"] / c["memcpy_seconds"] for c in ceiling) / 1e9, 2)
                row[f"stream_{contender}_gb_s"] = round(max(c["bytes"] / c["stream_seconds"] for c in ceiling) / 1e9, 2)
        if len({frozenset(t) for t in tokens.values()}) != 1 or len(tokens["recompute"]) != 1:
            raise RuntimeError(f"{model} {size}: first tokens differ: {tokens}")
        example, floor = row["ttft_example_ms"], row["ttft_floor_ms"]
        for contender in samples:
            if contender not in ("example", "floor"):
                row[f"{contender}_vs_example"] = round(row[f"ttft_{contender}_ms"] / example, 2)
        # The least any load could give: the floor's TTFT (a free load) against ExampleConnector's.
        row["floor_vs_example"] = round(floor / example, 2)
        row["colocated_load_vs_memcpy"] = round(row["load_colocated_gb_s"] / row["memcpy_colocated_gb_s"], 2)
        row["grpc_load_vs_stream"] = round(row["load_cachesvc_gb_s"] / row["stream_cachesvc_gb_s"], 2)
        row["default_scheduler_vs_one_chunk"] = round(row["ttft_colocated_default_ms"] / row["ttft_colocated_ms"], 2)
        row["async_vs_sync"] = round(row["ttft_colocated_async_ms"] / row["ttft_colocated_ms"], 2)
        # The prefix's own cost: each TTFT less the floor's (computing the last tokens, the rest of a request).
        for contender in samples:
            if contender != "floor":
                row[f"prefix_{contender}_ms"] = round(max(row[f"ttft_{contender}_ms"] - floor, 0.01), 2)
        rows.append(row)
    return rows


def targets(rows: list[dict[str, Any]], throughput: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, as ratios measured in this run (lower is better for TTFT ratios)."""
    out: dict[str, Any] = {}

    def target(name: str, ratio: float, goal: float, at_most: bool, ceiling: float | None = None) -> None:
        out[name] = {"target": goal, "ratio": ratio, "met": ratio <= goal if at_most else ratio >= goal}
        if ceiling is not None:
            out[name]["ceiling"] = ceiling

    for row in rows:
        tag = f"{row['model']}_{row['prefix_tokens']}"
        if row["prefix_tokens"] in (2048, 8192):
            target(f"{tag}_colocated_ttft_vs_example", row["colocated_vs_example"], 0.67, True, row["floor_vs_example"])
        target(f"{tag}_colocated_load_vs_memcpy", row["colocated_load_vs_memcpy"], 0.5, False)
        target(f"{tag}_grpc_load_vs_bare_stream", row["grpc_load_vs_stream"], 0.9, False)
        target(f"{tag}_default_chunked_vs_one_chunk_ttft", row["default_scheduler_vs_one_chunk"], 1.1, True)
    if throughput:
        target("shared_prefix_requests_per_s_vs_none", throughput["colocated_speedup"], 2.0, False)
    return out


def table(result: dict[str, Any]) -> str:
    rows = result["rows"]
    head = [
        "| model | prefix tokens | floor | recompute | ExampleConnector | cachesvc gRPC | co-located "
        "| co-located async | co-located, vLLM defaults | co-located vs Example | floor vs Example |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines = ["TTFT, ms, median of the samples (floor: the prefix in vLLM's own cache)", "", *head]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['prefix_tokens']:,} | {r['ttft_floor_ms']:.1f} | {r['ttft_recompute_ms']:.1f} "
            f"| {r['ttft_example_ms']:.1f} | {r['ttft_cachesvc_ms']:.1f} | {r['ttft_colocated_ms']:.1f} "
            f"| {r['ttft_colocated_async_ms']:.1f} | {r['ttft_colocated_default_ms']:.1f} "
            f"| {r['colocated_vs_example']:.2f}x | {r['floor_vs_example']:.2f}x |"
        )
    lines += [
        "",
        "Load rates, GB/s (median of the loads; ceilings best of 5 in the consumer's process)",
        "",
        "| model | prefix tokens | co-located load | memcpy | ratio | gRPC load | bare gRPC stream | ratio |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['prefix_tokens']:,} | {r['load_colocated_gb_s']:.2f} "
            f"| {r['memcpy_colocated_gb_s']:.2f} | {r['colocated_load_vs_memcpy']:.2f} | {r['load_cachesvc_gb_s']:.2f} "
            f"| {r['stream_cachesvc_gb_s']:.2f} | {r['grpc_load_vs_stream']:.2f} |"
        )
    if result.get("throughput"):
        t = result["throughput"]
        lines += [
            "",
            f"Shared prefixes: {t['requests']} requests on {t['documents']} documents of {t['prefix']:,} tokens",
            "",
            "| | requests/s | mean TTFT, ms |",
            "| --- | ---: | ---: |",
            f"| no connector (vLLM's prefix cache) | {t['none_requests_per_s']} | {t['none_mean_ttft_ms']} |",
            f"| cachesvc co-located | {t['colocated_requests_per_s']} | {t['colocated_mean_ttft_ms']} |",
            f"| cachesvc co-located, async loads | {t['colocated_async_requests_per_s']} "
            f"| {t['colocated_async_mean_ttft_ms']} |",
        ]
    lines += ["", "Other connectors on the CPU build:", ""]
    lines += [f"- {name}: {what}" for name, what in result.get("other_connectors", {}).items()]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("no matplotlib: no plot", file=sys.stderr)
        return
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
        for contender, label in labels.items():
            ax.plot(xs, [r[f"ttft_{contender}_ms"] for r in mine], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs, [f"{x:,}" for x in xs])
        ax.set_xlabel("prefix tokens (2 more computed)")
        ax.set_ylabel("TTFT, ms (median)")
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
    engine.add_argument("--default-scheduler", action="store_true")
    engine.add_argument("--throughput", action="store_true")
    parser.add_argument("--quick", action="store_true", help="fewer samples, the tiny model only")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "vllm_kv.json")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), help="default: all (--quick: tiny)")
    parser.add_argument("--sizes", nargs="+", type=int, default=list(SIZES), help="prefix tokens (whole blocks)")
    parser.add_argument("--rounds", type=int, default=2, help="engine runs per contender")
    parser.add_argument("--repeat", type=int, help="timed requests per prompt and engine run (default 4, --quick 2)")
    parser.add_argument("--no-throughput", dest="throughput", action="store_false", help="skip the shared-prefix run")
    args = parser.parse_args(argv)
    if args.command == "engine":
        engine_main(args)
        return 0
    if not VLLM_PYTHON.exists():
        print(f"no vLLM venv at {VLLM_PYTHON}: run `make venv-vllm`", file=sys.stderr)
        return 2

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    args.models = args.models or (["tiny"] if args.quick else list(MODELS))
    args.repeat = args.repeat or (2 if args.quick else 4)
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
        "command": "python " + " ".join(["bench/vllm_kv.py", *(argv if argv is not None else sys.argv[1:])]),
        "seconds": round(time.perf_counter() - started, 1),
        "machine": info,
        **result,
        "targets": targets(result["rows"], result["throughput"]),
        "notes": [
            "TTFT: wall time of llm.generate(prompt, max_tokens=1) in a consumer engine (vllm.LLM, in-process "
            "engine core, CPU build, its default threads), vLLM's prefix cache reset before each request.",
            "Each prompt is `prefix_tokens` + 2 tokens: the prefix's blocks (128 tokens each) come from the "
            "contender, the last 2 tokens are computed (what ExampleConnector needs to load the whole prefix); vLLM's "
            "prompt_tokens_by_source counters are checked per request.",
            "cachesvc: CacheConnector against one `cachesvc serve` (L1 memory) on this machine, over gRPC on "
            "127.0.0.1. ExampleConnector: safetensors files per layer in a /tmp directory (page cache warm).",
            "Every engine but colocated_default prefills a prompt in one chunk (max_num_batched_tokens = "
            "max_model_len): ExampleConnector fails on prompts prefilled in chunks (it stores a prompt in the step "
            "that first schedules it). colocated_default: vLLM's default scheduler settings (chunked prefill).",
            "colocated_async: load_async=True (get_num_new_matched_tokens answers load_kv_async; the blocks load in a "
            "worker thread, completion through get_finished).",
            "load_*_gb_s: the connector's own load (bytes placed in the paged blocks and checked, over the seconds its "
            "load took), median; memcpy_*: one thread copying as many bytes between two bytearrays; stream_*: a "
            "bare gRPC stream of the same blocks (iter_pieces, no copy, no check), both best of 5 in the consumer.",
            "throughput: 32 requests (8 on each of 4 documents of 2,048 tokens, each + 64 tokens of its own), one "
            "generate call, max_tokens 8, vLLM's default scheduler and prefix cache on; the documents were stored "
            "in cachesvc by a producer beforehand. Requests/s over the call; mean TTFT from vLLM's histogram.",
            f"Samples per contender and size: {args.rounds} engine runs x {args.repeat} requests; the targets and "
            "ttft_*_ms are medians, ttft_*_best_ms the least of the samples.",
            "colocated: the same connector against a server with l1.shared = true, reading its shared L1 arena.",
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result["rows"], args.out.with_suffix(".png"))
    print(table(result))
    print(json.dumps(result["targets"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
