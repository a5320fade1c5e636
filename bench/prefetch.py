"""Model parameters streamed from the cache (issue 11): offloaded inference at a budget, and a cold start from S3.

One random-weight Llama (transformers, fixed seed), stored once in S3 as a
safetensors file and once through a cache server (`save_model`, written
through to S3). Every contender runs in this process with the same torch
threads, and every output is compared bit for bit with the model holding
all its parameters locally.

Offloaded inference (the values warm in a cache server's L1 on this
machine), at a resident budget of 25% and 50% of the parameters:

* cachesvc with lookahead: `stream_parameters` fetching the next modules in
  a background thread while the current one computes (the default);
* cachesvc co-located, with and without lookahead: the same from a client
  reading the server's shared L1 straight from memory (`l1.shared`, issue
  23), no gRPC on the bulk path; the two above read over gRPC
  (`colocated=False`);
* cachesvc without lookahead: `lookahead=0`, each module fetched when it
  runs, as offload hooks without prefetch do (HF accelerate's), with the
  same residency (the same modules kept across forwards), so the two differ
  only in the overlap;
* accelerate disk offload, the anchor: HF accelerate's own offload from
  local disk (`infer_auto_device_map(model, max_memory={"cpu": budget,
  "disk": ...})` then `dispatch_model(..., offload_dir=...)`, or
  `disk_offload` when the map puts the whole model on disk). As accelerate
  documents, the CPU budget keeps room for the largest layer, so at 25%
  nothing stays resident and every module is read from its memory-mapped
  file at each forward. The files are left in the OS page cache, as the
  cache server's L1 holds cachesvc's values in memory on the same machine;
* accelerate disk offload, page cache dropped: the same, with the files'
  pages dropped (`posix_fadvise(DONTNEED)`) before every forward, so each
  forward reads them from the disk: the budget respected by all memory;
* all parameters local, the ceiling.

Prefill: tokens/s of one forward over a `--prompt`-token prompt, after one
that records the order. Decode: tokens/s of greedy `generate` after the
first new token, timed by a streamer. `--rounds` rounds run every variant in
turn (a fresh model and stream each time); the medians are reported, with
every round's figures.

Cold start, the weights in S3 behind bench/latency_proxy.py (`--delay-ms`,
20 ms per request), time to the first output (a forward over a 16-token
prompt) from a model built on `meta`:

* boto3: `download_fileobj` of the safetensors file (its TransferConfig
  defaults: 8 MiB parts, 10 in flight), then `safetensors.torch.load` and
  `load_state_dict(assign=True)`;
* s3torchconnector: `S3Client.get_object(...).read()` of the same file, then
  the same load;
* cachesvc cold: a fresh cache server (empty L1, no L2) reading S3 through
  the proxy; `stream_parameters` with the whole model as budget, the server
  handed the registration order as a prefetch plan;
* cachesvc `load_model`, cold (another fresh server): read every value, then run;
* cachesvc from the user's safetensors file (another fresh server): the very
  file the download contenders read, registered once beforehand
  (`register_safetensors`, reading only its header) and streamed as the
  cold contender is, each module's bytes a ranged GET of the file;
* cachesvc warm: the first server again, its L1 now holding the values.

Writes bench/results/prefetch.json (and prefetch.png when matplotlib is
installed). The default model has about 130 MB of parameters and runs in a
few minutes on 2 cores; `--large` uses about 800 MB (the issue's size),
`--small` about 20 MB (a smoke run). `--sections offload` (or `cold`) runs
one section only and merges it into the existing file: the other section's
results stay, the section run replaces its own (the previous one is kept
under `previous_offload` / `previous_cold_start`), and `section_runs`
records each section's own command, commit and model.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _machine
import torch

from cacheclient import CacheClient
from cacheclient.colocated import Colocated
from cacheclient.prefetch import load_model, register_safetensors, save_model, stream_parameters
from cachesvc.devcluster.procs import ManagedProcess, free_port
from cachesvc.devcluster.seaweed import S3_ACCESS_KEY, S3_SECRET_KEY, SeaweedFS, s3_client

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
BUCKET = "bench-prefetch"
NAME = "bench-llama"
REGISTERED_NAME = "bench-llama-safetensors"
S3_PREFIX = "cache/"
FILE_KEY = "models/model.safetensors"
"""The safetensors file's cache key: under the cache servers' S3 prefix, so they can read it by range."""
SAFETENSORS_KEY = S3_PREFIX + FILE_KEY
FIRST_PROMPT = 16

PRESETS: dict[str, dict[str, Any]] = {
    "small": {"vocab_size": 4096, "hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 2},
    "default": {"vocab_size": 4096, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 4},
    "large": {"vocab_size": 16384, "hidden_size": 1536, "intermediate_size": 4096, "num_hidden_layers": 6},
}


def log(message: str) -> None:
    print(f"[prefetch {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def machine_info() -> dict[str, Any]:
    return _machine.machine_info(["transformers", "safetensors", "s3torchconnector", "boto3"], torch=True)


# -- the model --------------------------------------------------------------------


def config(preset: str) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        **PRESETS[preset],
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=PRESETS[preset]["hidden_size"] // 12,
        max_position_embeddings=4096,
        initializer_range=0.1,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def build(cfg: Any, meta: bool) -> Any:
    """The model in eval mode; on `meta`, parameters are placeholders, but buffers (rotary) are real."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = LlamaForCausalLM(cfg).eval()
    if meta:  # as accelerate's init_empty_weights(include_buffers=False) leaves them
        model.model.rotary_emb = LlamaRotaryEmbedding(cfg)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def prompt(n: int, seed: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (1, n), generator=generator)


class Clock:
    """A `generate` streamer that notes when each batch of tokens comes out (the prompt first)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def measure(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    """One round on one model: a forward that records the order, a timed prefill, a timed greedy decode."""
    vocab = model.config.vocab_size
    long_prompt = prompt(args.prompt, 1, vocab)
    short_prompt = prompt(32, 2, vocab)
    with torch.inference_mode():
        began = time.perf_counter()
        logits = model(long_prompt).logits[:, -1]
        first_s = time.perf_counter() - began
        began = time.perf_counter()
        model(long_prompt)
        prefill_s = time.perf_counter() - began
        clock = Clock()
        tokens = model.generate(short_prompt, max_new_tokens=args.decode_tokens, do_sample=False, streamer=clock)
    return {
        "first_forward_s": first_s,
        "prefill_s": prefill_s,
        "decode_s": clock.times[-1] - clock.times[1],
        "logits": logits,
        "tokens": tokens,
    }


def summary(rounds: list[dict[str, Any]], args: argparse.Namespace, reference: dict[str, Any]) -> dict[str, Any]:
    """Medians over the rounds, every round's figures, and whether every output matched `reference`."""
    prefill = statistics.median(r["prefill_s"] for r in rounds)
    decode = statistics.median(r["decode_s"] for r in rounds)
    return {
        "prefill_tokens_per_s": round(args.prompt / prefill, 1),
        "decode_tokens_per_s": round((args.decode_tokens - 1) / decode, 2),
        "prefill_s": [round(r["prefill_s"], 3) for r in rounds],
        "decode_s": [round(r["decode_s"], 3) for r in rounds],
        "first_forward_s": [round(r["first_forward_s"], 3) for r in rounds],
        "identical": all(
            torch.equal(r["logits"], reference["logits"]) and torch.equal(r["tokens"], reference["tokens"])
            for r in rounds
        ),
        **({"stream": rounds[-1]["stream"]} if "stream" in rounds[-1] else {}),
        **({"accelerate": rounds[-1]["accelerate"]} if "accelerate" in rounds[-1] else {}),
    }


# -- accelerate, the anchor ---------------------------------------------------------


def accelerate_offloaded(cfg: Any, budget: int, offload_dir: Path, drop_cache: bool) -> tuple[Any, dict[str, Any]]:
    """The model dispatched by accelerate with at most `budget` bytes on the CPU and the rest offloaded to disk.

    With `drop_cache`, the offload files' pages leave the OS page cache before every forward.
    """
    from accelerate import disk_offload, dispatch_model, infer_auto_device_map

    model = build(cfg, meta=False)  # the same seed: the reference's weights
    device_map = infer_auto_device_map(
        model,
        max_memory={"cpu": budget, "disk": 1 << 50},
        no_split_module_classes=list(model._no_split_modules or []),
    )
    if set(device_map.values()) == {"disk"}:
        # No room beside the largest layer: accelerate's whole-model disk offload
        # (dispatch_model cannot offload the root module, "").
        disk_offload(model, str(offload_dir), execution_device="cpu")
    else:
        model = dispatch_model(model, device_map=device_map, main_device="cpu", offload_dir=str(offload_dir))
    files = sorted(offload_dir.glob("*.dat"))
    for file in files:  # written through np.memmap: clean pages, so DONTNEED can drop them
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if drop_cache:

        def drop(module: Any, args: Any) -> None:
            for file in files:
                fd = os.open(file, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)

        model.register_forward_pre_hook(drop)
    resident = sum(t.numel() * t.element_size() for t in model.parameters() if t.device.type != "meta")
    info = {
        "resident_bytes": resident,
        "offloaded_bytes": sum(f.stat().st_size for f in files),
        "device_map": {name: device for name, device in device_map.items()},
        "page_cache_dropped_each_forward": drop_cache,
    }
    return model, info


# -- servers ----------------------------------------------------------------------


class CacheServer:
    """A `cachesvc serve` process with an L1 of `l1` (shared with co-located readers) and S3 at `s3_endpoint`,
    no L2."""

    def __init__(self, work: Path, s3_endpoint: str, l1: str) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        name = uuid.uuid4().hex[:6]
        env = dict(
            os.environ,
            CACHESVC_S3_ACCESS_KEY=S3_ACCESS_KEY,
            CACHESVC_S3_SECRET_KEY=S3_SECRET_KEY,
            CACHESVC_L1_SHARED="true",
        )
        argv = [
            sys.executable, "-m", "cachesvc", "serve", "--listen", self.address, "--l1-bytes", l1,
            "--s3-endpoint", s3_endpoint, "--s3-bucket", BUCKET, "--s3-prefix", S3_PREFIX,
        ]  # fmt: skip
        self.process = ManagedProcess("cache", argv, work / f"cache-{name}.log", env=env)
        with CacheClient(self.address, timeout=120.0) as client:
            client.wait_ready(30.0)

    def client(self, colocated: bool | None = False) -> CacheClient:
        """A client over gRPC (the figures before issue 23), or with `colocated=True` through the shared L1."""
        return CacheClient(self.address, timeout=120.0, colocated=colocated)

    def stop(self) -> None:
        self.process.stop(grace=20.0)


@contextlib.contextmanager
def latency_proxy(upstream: str, delay_ms: float, work: Path) -> Iterator[str]:
    """`bench/latency_proxy.py` in its own process; yields its endpoint."""
    argv = [sys.executable, str(BENCH_DIR / "latency_proxy.py"), "--upstream", upstream, "--delay-ms", str(delay_ms)]
    with open(work / "proxy.log", "wb") as errors:
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=errors, text=True)
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)


# -- cold start -------------------------------------------------------------------


def first_output(model: Any, vocab: int) -> torch.Tensor:
    with torch.inference_mode():
        logits: torch.Tensor = model(prompt(FIRST_PROMPT, 3, vocab)).logits
    return logits


def load_safetensors(cfg: Any, data: bytes) -> Any:
    from safetensors.torch import load

    model = build(cfg, meta=True)
    model.load_state_dict(load(data), assign=True, strict=False)
    return model


def download_then_load(cfg: Any, download: Callable[[], bytes]) -> dict[str, Any]:
    """Times a contender that downloads the whole safetensors file, then loads it and runs the first forward."""
    began = time.perf_counter()
    data = download()
    downloaded = time.perf_counter()
    model = load_safetensors(cfg, data)
    loaded = time.perf_counter()
    logits = first_output(model, cfg.vocab_size)
    done = time.perf_counter()
    return {
        "download_s": round(downloaded - began, 3),
        "load_s": round(loaded - downloaded, 3),
        "forward_s": round(done - loaded, 3),
        "first_output_s": round(done - began, 3),
        "logits": logits,
    }


def cold_boto3(cfg: Any, proxy: str) -> dict[str, Any]:
    from boto3.s3.transfer import TransferConfig

    s3: Any = s3_client(proxy)

    def download() -> bytes:
        buffer = io.BytesIO()
        s3.download_fileobj(BUCKET, SAFETENSORS_KEY, buffer, Config=TransferConfig())
        return buffer.getvalue()

    return download_then_load(cfg, download)


def cold_s3torchconnector(cfg: Any, proxy: str) -> dict[str, Any]:
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client

    client = S3Client("us-east-1", endpoint=proxy, s3client_config=S3ClientConfig(force_path_style=True))
    return download_then_load(cfg, lambda: client.get_object(BUCKET, SAFETENSORS_KEY).read())


def cold_stream(cfg: Any, cache: CacheClient, name: str = NAME) -> dict[str, Any]:
    began = time.perf_counter()
    model = build(cfg, meta=True)
    with stream_parameters(model, cache, name) as stream:
        logits = first_output(model, cfg.vocab_size)
        done = time.perf_counter()
        stats = stream.stats
    return {"first_output_s": round(done - began, 3), "logits": logits, "stream": stats}


def cold_load_model(cfg: Any, cache: CacheClient) -> dict[str, Any]:
    began = time.perf_counter()
    model = load_model(build(cfg, meta=True), cache, NAME)
    loaded = time.perf_counter()
    logits = first_output(model, cfg.vocab_size)
    done = time.perf_counter()
    return {
        "load_s": round(loaded - began, 3),
        "forward_s": round(done - loaded, 3),
        "first_output_s": round(done - began, 3),
        "logits": logits,
    }


# -- the run ----------------------------------------------------------------------

ACCELERATE = "accelerate disk offload"
ACCELERATE_COLD = "accelerate disk offload, page cache dropped"


def offloaded(
    args: argparse.Namespace,
    cfg: Any,
    reference_model: Any,
    stored_bytes: int,
    cache: CacheClient,
    address: str,
    work: Path,
) -> dict[str, Any]:
    """Offloaded inference: every variant at every budget, `args.rounds` rounds; the values warm in `cache`."""
    # Rounds of every variant in turn, medians per variant: a shared machine's load
    # drifts over minutes, and each variant then meets the same drift.
    variants: list[tuple[str, float | None, int | str | None]] = [("all local", None, None)]
    shared = CacheClient(address, timeout=120.0, colocated=True)
    for fraction in args.budgets:
        pct = int(fraction * 100)
        variants += [(f"{pct}% lookahead", fraction, None), (f"{pct}% no lookahead", fraction, 0)]
        variants += [
            (f"{pct}% lookahead, co-located", fraction, None),
            (f"{pct}% no lookahead, co-located", fraction, 0),
        ]
        if not args.no_accelerate:
            variants += [(f"{pct}% {ACCELERATE}", fraction, ACCELERATE)]
            variants += [(f"{pct}% {ACCELERATE_COLD}", fraction, ACCELERATE_COLD)]
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in variants}
    for round_ in range(args.rounds):
        for name, fraction, how in variants:
            log(f"offloaded inference, round {round_ + 1}/{args.rounds}: {name}")
            if fraction is None:
                samples[name].append(measure(reference_model, args))
                continue
            budget = int(stored_bytes * fraction)
            if isinstance(how, str):
                with tempfile.TemporaryDirectory(prefix="offload-", dir=work) as offload_dir:
                    model, info = accelerate_offloaded(cfg, budget, Path(offload_dir), how == ACCELERATE_COLD)
                    sample = measure(model, args)
                    sample["accelerate"] = info
                    del model
            else:
                model = build(cfg, meta=True)
                reader = shared if name.endswith("co-located") else cache
                with stream_parameters(
                    model, reader, NAME, budget_bytes=budget, lookahead=how, server_window_bytes=0
                ) as stream:
                    sample = measure(model, args)
                    sample["stream"] = stream.stats
            samples[name].append(sample)
    transport = shared.transport
    assert isinstance(transport, Colocated) and transport.counts["arena"] > 0, "no co-located reads"
    shared.close()
    local = samples["all local"][0]
    offload = {name: summary(rounds, args, local) for name, rounds in samples.items()}
    for name, r in offload.items():
        log(f"{name}: prefill {r['prefill_tokens_per_s']} tok/s, decode {r['decode_tokens_per_s']} tok/s")
    return offload


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from safetensors.torch import save

    cfg = config(args.preset)
    reference_model = build(cfg, meta=False)
    total = sum(p.numel() * p.element_size() for p in reference_model.parameters())
    log(f"model: {args.preset}, {total / 1e6:.0f} MB of parameters; torch threads {torch.get_num_threads()}")
    results: dict[str, Any] = {"model": {"preset": args.preset, **PRESETS[args.preset], "parameter_bytes": total}}

    log("starting SeaweedFS")
    weed = SeaweedFS.on_free_ports(work / "s3")
    servers: list[CacheServer] = []
    try:
        weed.create_bucket(BUCKET)
        if "cold" in args.sections:
            state = {k: v.contiguous() for k, v in reference_model.state_dict().items()}
            uploader: Any = s3_client(weed.endpoint)
            uploader.put_object(Bucket=BUCKET, Key=SAFETENSORS_KEY, Body=save(state))
        log("saving through a cache server (written through to S3)")
        writer = CacheServer(work, weed.endpoint, "2GiB")
        servers.append(writer)
        with writer.client() as cache:
            began = time.perf_counter()
            manifest = save_model(reference_model, cache, NAME)
            results["save_model_s"] = round(time.perf_counter() - began, 3)
            if "cold" not in args.sections:
                # The offload section alone: the values are warm in this server's L1, as they are
                # in the cold section's server after its warm run.
                results["offload"] = offloaded(args, cfg, reference_model, manifest.nbytes, cache, writer.address, work)
                return results
            began = time.perf_counter()
            register_safetensors(cache, REGISTERED_NAME, FILE_KEY, model=reference_model)
            results["register_safetensors_s"] = round(time.perf_counter() - began, 3)
        writer.stop()
        servers.remove(writer)

        with latency_proxy(weed.endpoint.removeprefix("http://"), args.delay_ms, work) as proxy:
            log("local reference")
            with torch.inference_mode():
                reference = {"logits": first_output(reference_model, cfg.vocab_size)}
            cold: dict[str, Any] = {}
            contenders: list[tuple[str, Callable[[], dict[str, Any]]]] = [
                ("boto3 download, then load", lambda: cold_boto3(cfg, proxy)),
                ("s3torchconnector read, then load", lambda: cold_s3torchconnector(cfg, proxy)),
            ]
            for name, fn in contenders:
                log(f"cold start: {name}")
                try:
                    cold[name] = fn()
                except ImportError as exc:
                    cold[name] = {"skipped": str(exc)}

            log("cold start: cachesvc load_model (a fresh server)")
            fresh = CacheServer(work, proxy, "2GiB")
            servers.append(fresh)
            with fresh.client() as cache:
                cold["cachesvc load_model, cold"] = cold_load_model(cfg, cache)
            fresh.stop()
            servers.remove(fresh)

            name = "cachesvc from the user's safetensors file (registered, streamed), cold"
            log(f"cold start: {name} (a fresh server)")
            fresh = CacheServer(work, proxy, "2GiB")
            servers.append(fresh)
            with fresh.client() as cache:
                cold[name] = cold_stream(cfg, cache, REGISTERED_NAME)
            fresh.stop()
            servers.remove(fresh)

            log("cold start: cachesvc streamed (a fresh server)")
            server = CacheServer(work, proxy, "2GiB")
            servers.append(server)
            with server.client() as cache:
                cold["cachesvc streamed, cold"] = cold_stream(cfg, cache)
                log("cold start: cachesvc streamed, warm")
                cold["cachesvc streamed, warm"] = cold_stream(cfg, cache)
                for entry in cold.values():
                    if "logits" in entry:
                        entry["identical"] = bool(torch.equal(entry.pop("logits"), reference["logits"]))
                results["cold_start"] = cold

                if "offload" in args.sections:
                    results["offload"] = offloaded(
                        args, cfg, reference_model, manifest.nbytes, cache, server.address, work
                    )
    finally:
        for server in servers:
            server.stop()
        weed.stop(grace=10.0)
    return results


def targets(results: dict[str, Any], budgets: list[float]) -> dict[str, Any]:
    """The issue's targets as ratios: lookahead >= 1.5x at 25%; cold first output <= 0.5x download-then-load.

    Also, with no target, cachesvc with lookahead against the anchor, accelerate's disk offload."""
    out: dict[str, Any] = {}
    offload = results.get("offload", {})
    for fraction in budgets:
        pct = int(fraction * 100)
        on, off = offload.get(f"{pct}% lookahead"), offload.get(f"{pct}% no lookahead")
        anchor = offload.get(f"{pct}% {ACCELERATE}")
        near, near_off = offload.get(f"{pct}% lookahead, co-located"), offload.get(f"{pct}% no lookahead, co-located")
        for metric in ("prefill", "decode"):
            key = f"{metric}_tokens_per_s"
            if on is not None and off is not None:
                out[f"{metric} with lookahead / without, {pct}%"] = {
                    "ratio": round(on[key] / off[key], 2),
                    "target": 1.5 if pct == 25 else None,
                }
            if on is not None and anchor is not None:
                out[f"{metric} with lookahead / {ACCELERATE}, {pct}%"] = {
                    "ratio": round(on[key] / anchor[key], 2),
                    "target": None,
                }
            # Issue 23: co-located decode at 25% at least accelerate's (warm page cache); prefill with
            # lookahead at least 1.5x without.
            if near is not None and anchor is not None:
                out[f"{metric} co-located with lookahead / {ACCELERATE}, {pct}%"] = {
                    "ratio": round(near[key] / anchor[key], 2),
                    "target": 1.0 if pct == 25 and metric == "decode" else None,
                }
            if near is not None and near_off is not None:
                out[f"{metric} co-located with lookahead / without, {pct}%"] = {
                    "ratio": round(near[key] / near_off[key], 2),
                    "target": 1.5 if pct == 25 and metric == "prefill" else None,
                }
    cold = results.get("cold_start")
    if cold is not None:
        ratio = cold["cachesvc streamed, cold"]["first_output_s"] / cold["boto3 download, then load"]["first_output_s"]
        out["cold first output, cachesvc streamed / boto3 download-then-load"] = {
            "ratio": round(ratio, 2),
            "target": 0.5,
        }
    return out


def table(results: dict[str, Any]) -> str:
    lines = [
        f"{'offloaded inference':48} {'prefill tok/s':>14} {'decode tok/s':>13} {'resident MB':>12}"
        f" {'fetched MB':>11} {'stall s':>8}"
    ]
    for name, r in results.get("offload", {}).items():
        stream = r.get("stream", {})
        resident = stream.get("peak_resident_bytes", r.get("accelerate", {}).get("resident_bytes"))
        fetched = f"{stream['fetched_bytes'] / 1e6:.0f}" if "fetched_bytes" in stream else "-"
        stall = f"{stream['stall_s']:.2f}" if "stall_s" in stream else "-"
        lines.append(
            f"{name:48} {r['prefill_tokens_per_s']:>14} {r['decode_tokens_per_s']:>13}"
            f" {'-' if resident is None else f'{resident / 1e6:.0f}':>12} {fetched:>11} {stall:>8}"
        )
    if "cold_start" in results:
        lines.append("")
        lines.append(f"{'cold start (S3 +20 ms)':36} {'first output s':>15}")
        for name, r in results["cold_start"].items():
            lines.append(f"{name:36} {r.get('first_output_s', '-')!s:>15}")
    return "\n".join(lines)


SECTION_RESULTS = {"cold": "cold_start", "offload": "offload"}


def merge(previous: dict[str, Any], new: dict[str, Any], sections: list[str], budgets: list[float]) -> dict[str, Any]:
    """`previous` (the file's report) with the sections of `new` (a run of `sections` only) in place of its own.

    The replaced sections are kept under `previous_<name>` with their provenance; `section_runs`
    records each section's command, config, machine and model; the targets are recomputed.
    """
    merged = dict(previous)
    results = dict(previous.get("results", {}))
    runs = dict(previous.get("section_runs", {}))
    for section in sections:
        key = SECTION_RESULTS[section]
        if key in results:
            earlier = runs.get(section, previous)
            merged[f"previous_{key}"] = {
                "command": earlier.get("command"),
                "commit": (earlier.get("machine") or {}).get("commit"),
                "results": results[key],
            }
        results[key] = new["results"][key]
        runs[section] = {
            **{k: new[k] for k in ("command", "config", "machine", "loadavg_at_end", "elapsed_s")},
            "model": new["results"]["model"],
        }
    merged["results"] = results
    merged["section_runs"] = runs
    merged["targets"] = targets(results, budgets)
    return merged


def plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    if "offload" not in results or "cold_start" not in results:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    offload = results["offload"]
    names = list(offload)
    for ax, metric, title in (
        (axes[0], "prefill_tokens_per_s", "prefill tokens/s"),
        (axes[1], "decode_tokens_per_s", "decode tokens/s"),
    ):
        ax.barh(names, [offload[n][metric] for n in names])
        ax.set_title(title)
        ax.invert_yaxis()
    cold = {n: r["first_output_s"] for n, r in results["cold_start"].items() if "first_output_s" in r}
    axes[2].barh(list(cold), list(cold.values()))
    axes[2].set_title("cold start: time to first output (s)")
    axes[2].invert_yaxis()
    fig.suptitle(f"bench/prefetch.py: {results['model']['parameter_bytes'] / 1e6:.0f} MB Llama, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--large", action="store_true", help="about 800 MB of parameters (default about 130 MB)")
    parser.add_argument("--small", action="store_true", help="about 20 MB of parameters (a smoke run)")
    parser.add_argument(
        "--sections",
        default="cold,offload",
        help="sections to run: cold, offload or both; one alone is merged into the existing --out file",
    )
    parser.add_argument("--no-accelerate", action="store_true", help="leave out the accelerate anchor")
    parser.add_argument("--prompt", type=int, default=512, help="prefill prompt tokens")
    parser.add_argument("--decode-tokens", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every offload variant (medians reported)")
    parser.add_argument("--budgets", default="0.25,0.5", help="resident budgets, fractions of the parameters")
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 leaves a core to the fetching)")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "prefetch.json")
    args = parser.parse_args()
    args.preset = "large" if args.large else "small" if args.small else "default"
    args.sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    if not args.sections or any(x not in SECTION_RESULTS for x in args.sections):
        parser.error(f"--sections: a comma-separated list of {', '.join(SECTION_RESULTS)}")
    args.budgets = [float(x) for x in args.budgets.split(",")]
    torch.set_num_threads(args.threads)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", S3_ACCESS_KEY)
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", S3_SECRET_KEY)
    os.environ.setdefault("AWS_REGION", "us-east-1")
    machine = machine_info()
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-prefetch-") as tmp:
        results = run(args, Path(tmp))
    report: dict[str, Any] = {
        "benchmark": "prefetch",
        "command": "python " + " ".join([str(Path(sys.argv[0])), *sys.argv[1:]]),
        "config": {
            "prompt_tokens": args.prompt,
            "decode_tokens": args.decode_tokens,
            "rounds": args.rounds,
            "budgets": args.budgets,
            "delay_ms": args.delay_ms,
            "torch_threads": args.threads,
            "sections": args.sections,
        },
        "machine": machine,
        "loadavg_at_end": list(os.getloadavg()),
        "elapsed_s": round(time.monotonic() - began, 1),
        "results": results,
        "targets": targets(results, args.budgets),
    }
    if set(args.sections) != set(SECTION_RESULTS) and args.out.exists():
        report = merge(json.loads(args.out.read_text()), report, args.sections, args.budgets)
        log(f"merged the {', '.join(args.sections)} section into {args.out}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report["results"], args.out.with_suffix(".png"))
    print(table(results))
    print(json.dumps(report["targets"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
