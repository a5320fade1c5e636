"""Model parameters in the cache (`cacheclient.prefetch`): save, load, and stream in execution order.

Against a real cache server process (and, for the cold start, SeaweedFS):
a random-weight transformers Llama and plain `nn.Sequential` models run
with their parameters streamed at several budgets, and every output is
compared bit for bit with the same model holding all its parameters. The
residency core and the tensor record format are also checked on their own.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from cacheclient import CacheClient
from cacheclient._residency import ABSENT, READY, Residency
from cacheclient.models.values import BufferPool
from cacheclient.prefetch import (
    ParameterValueError,
    Plan,
    load_model,
    read_manifest,
    save_model,
    stream_parameters,
)
from cacheclient.wire import tensors as records

from conftest import CacheServer, S3Server, s3_args

transformers = pytest.importorskip("transformers")

PROMPT = 24
NEW_TOKENS = 6


def llama_config(tie: bool = False) -> Any:
    return transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        initializer_range=0.1,
        tie_word_embeddings=tie,
        pad_token_id=0,
    )


def build_llama(tie: bool = False, meta: bool = False) -> Any:
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = transformers.LlamaForCausalLM(llama_config(tie)).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def build_sequential(meta: bool = False) -> nn.Sequential:
    torch.manual_seed(1)
    with torch.device("meta" if meta else "cpu"):
        model = nn.Sequential(
            nn.Linear(32, 64), nn.ReLU(), nn.BatchNorm1d(64), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8)
        )
    if not meta:
        with torch.no_grad():  # running statistics that are not the defaults
            norm: Any = model[2]
            norm.running_mean.uniform_(-1, 1)
            norm.running_var.uniform_(0.5, 2)
    return model.eval()


def execution_order(model: nn.Module, *args: Any) -> list[str]:
    """Paths of the modules with tensors of their own, in the order a forward calls them (the reference)."""
    order: list[str] = []
    handles = [
        module.register_forward_pre_hook(lambda *_, path=path: order.append(path))
        for path, module in model.named_modules()
        if any(t is not None for t in [*module._parameters.values(), *module._buffers.values()])
    ]
    with torch.inference_mode():
        model(*args)
    for handle in handles:
        handle.remove()
    return order


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CacheServer]:
    server = CacheServer(["--l1-bytes", "256MiB"], tmp_path_factory.mktemp("prefetch-models")).start()
    yield server
    server.stop(grace=10.0)


@pytest.fixture(scope="module")
def cache(server: CacheServer) -> Iterator[CacheClient]:
    with server.client() as client:
        yield client


@pytest.fixture(scope="module")
def llama(cache: CacheClient) -> dict[str, Any]:
    """The reference Llama, saved as "llama", with its outputs for one prompt."""
    model = build_llama()
    manifest = save_model(model, cache, "llama")
    ids = torch.tensor([random.Random(5).choices(range(3, 512), k=PROMPT)])
    with torch.inference_mode():
        logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    return {"model": model, "manifest": manifest, "ids": ids, "logits": logits, "tokens": tokens}


# -- the record format and the residency core, on their own ----------------------------


def test_tensor_record_round_trips_and_refuses_damage() -> None:
    owner = records.owner_digest("save", "layer.0")
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = torch.tensor(7, dtype=torch.int64)
    tensors = [
        (records.TensorEntry("weight", "float32", (3, 4)), a.reshape(-1).view(torch.uint8).numpy()),
        (records.TensorEntry("count", "int64", (), records.BUFFER), b.reshape(-1).view(torch.uint8).numpy()),
    ]
    value = bytes(records.pack(owner, tensors))
    out = records.unpack(value, owner)
    assert [(e.name, e.dtype, e.shape, e.kind) for e, _ in out] == [
        ("weight", "float32", (3, 4), records.PARAMETER),
        ("count", "int64", (), records.BUFFER),
    ]
    assert bytes(out[0][1]) == a.numpy().tobytes() and out[0][0].offset % records.ALIGN == 0
    flipped = bytearray(value)
    flipped[out[0][0].offset + 5] ^= 1
    with pytest.raises(records.TensorRecordError, match="'weight' failed its checksum"):
        records.unpack(bytes(flipped), owner)
    with pytest.raises(records.TensorRecordError, match="another owner"):
        records.unpack(value, records.owner_digest("save", "layer.1"))
    for bad in (value[:-1], value + b"\0", value[:40], b"not a record at all, not at all"):
        with pytest.raises(records.TensorRecordError):
            records.unpack(bad, owner)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 10), min_size=2, max_size=12),
    data=st.data(),
)
def test_residency_keeps_the_budget_and_refetches_only_streamed_units(sizes: list[int], data: Any) -> None:
    """Three rounds of a random loop with a fetcher that lands values at once, as the driver does.

    Every step finds its units held; the budget is never exceeded; a fetch
    ahead never drops a unit needed at or before its step; after the first
    round no kept unit is fetched again, and a round fetches at most the
    streamed units' bytes.
    """
    n = len(sizes)
    steps = data.draw(st.lists(st.lists(st.integers(0, n - 1), min_size=1, max_size=2), min_size=1, max_size=20))
    largest = max(sum(sizes[u] for u in set(step)) for step in steps)
    budget = data.draw(st.integers(largest, sum(sizes) + 1))
    lookahead = data.draw(st.sampled_from([0, 1, 3, 1 << 30]))
    core = Residency(sizes, budget)
    core.set_steps(steps)
    fetched_per_round = []
    for _ in range(3):
        fetched = [0] * n
        for index, step in enumerate(steps):
            core.advance(index)
            distances = {u: core.distance(u) for u in range(n)}
            units, victims = core.next_fetch(lookahead, 1 << 30)
            for unit in victims:  # do no harm: each goes for a step it is not needed before
                assert distances[unit] > min(distances[u] for u in units)
                assert unit not in core.kept
            for unit in units:
                core.fetched(unit)
                fetched[unit] += 1
            assert core.used <= budget
            absent = [u for u in step if core.state[u] == ABSENT]
            if absent:
                core.reserve_now(absent)
                for unit in absent:
                    core.fetched(unit)
                    fetched[unit] += 1
            assert all(core.state[u] == READY for u in step)
            assert core.used <= budget
            core.pin(step)
            core.unpin(step)
        fetched_per_round.append(fetched)
    streamed_reads = sum(sizes[u] for step in steps for u in set(step) if u not in core.kept)
    for fetched in fetched_per_round[1:]:
        assert all(fetched[u] == 0 for u in core.kept)
        assert sum(sizes[u] * k for u, k in enumerate(fetched)) <= streamed_reads


def test_buffer_pool_never_reuses_a_buffer_still_viewed() -> None:
    pool = BufferPool(limit=1 << 20)
    first = pool.take(4096)
    view = first[64:128].view(torch.float32)
    pool.give(first)
    second = pool.take(4096)
    assert second.data_ptr() != first.data_ptr() and pool.reused == 0  # the view still reads `first`
    del view
    pool.give(second)
    assert pool.take(4096).data_ptr() == second.data_ptr() and pool.reused == 1
    big = [pool.take(400 << 10) for _ in range(3)]  # handed out past the limit: the model needs them now
    for buffer in big:  # kept as room allows: buffers handed out and kept stay within the limit
        pool.give(buffer)
    assert 400 << 10 <= pool.bytes <= (1 << 20) - 4096


# -- save and load ----------------------------------------------------------------------


def test_load_model_fills_a_meta_model_from_a_config_with_tied_weights(cache: CacheClient) -> None:
    reference = build_llama(tie=True)
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    manifest = save_model(reference, cache, "llama-tied")
    assert [tie.module for m in manifest.modules for tie in m.ties] == ["model.embed_tokens"]
    assert read_manifest(cache, "llama-tied") == manifest

    loaded: Any = load_model(llama_config(tie=True), cache, "llama-tied").eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    state, expected = loaded.state_dict(), reference.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    ids = torch.tensor([[5, 9, 200, 31, 7]])
    with torch.inference_mode():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)


# -- streaming ------------------------------------------------------------------------


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25])
@pytest.mark.parametrize("lookahead", [None, 0], ids=["lookahead", "one-at-a-time"])
def test_streamed_llama_is_bit_identical_at_a_budget(
    cache: CacheClient, llama: dict[str, Any], fraction: float, lookahead: int | None
) -> None:
    budget = int(llama["manifest"].nbytes * fraction)
    model = build_llama(meta=True)
    with stream_parameters(model, cache, "llama", budget_bytes=budget, lookahead=lookahead) as stream:
        with torch.inference_mode():
            first = model(llama["ids"]).logits
            second = model(llama["ids"]).logits
            tokens = model.generate(llama["ids"], max_new_tokens=NEW_TOKENS, do_sample=False)
        stats = stream.stats
        assert stream.order == execution_order(llama["model"], llama["ids"])
    assert torch.equal(first, llama["logits"]) and torch.equal(second, llama["logits"])
    assert torch.equal(tokens, llama["tokens"])
    assert stats["peak_resident_bytes"] <= budget
    assert stats["recordings"] == 1 and stats["forwards"] == 2 + NEW_TOKENS
    total = llama["manifest"].nbytes
    if fraction == 1.0:
        assert stats["fetched_bytes"] == total  # once; every later forward finds all of it held
    else:
        assert stats["dropped"] > 0 and stats["fetched_bytes"] > total  # it streamed, within the budget
    if lookahead == 0:
        assert stats["fetched_ahead"] == 0
    else:
        assert stats["fetched_ahead"] > 0
    # The block leaves the model on meta: nothing of the streamed tensors stays behind.
    assert all(p.is_meta for p in model.parameters())


def test_streamed_sequential_records_its_order_and_matches(cache: CacheClient) -> None:
    reference = build_sequential()
    manifest = save_model(reference, cache, "sequential")
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        expected = reference(x)
    for fraction in (1.0, 0.5, 0.25):
        model = build_sequential(meta=True)
        largest = max(m.nbytes for m in manifest.modules)
        budget = max(int(manifest.nbytes * fraction), largest)
        with stream_parameters(model, cache, "sequential", budget_bytes=budget) as stream, torch.inference_mode():
            outputs = [model(x) for _ in range(3)]
            assert stream.order == ["0", "2", "3", "4", "5"] == execution_order(reference, x)
            assert stream.stats["peak_resident_bytes"] <= budget
        assert all(torch.equal(out, expected) for out in outputs)


class Reordered(nn.Module):
    """Three layers whose order a forward argument picks: a dynamic graph."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, order: str = "abc") -> torch.Tensor:
        for name in order:
            x = torch.tanh(getattr(self, name)(x))
        return x


def test_a_changed_order_re_records_and_stays_identical(cache: CacheClient) -> None:
    torch.manual_seed(2)
    reference = Reordered().eval()
    manifest = save_model(reference, cache, "reordered")
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(4))
    model = Reordered().to("meta").eval()
    budget = manifest.nbytes // 2
    with stream_parameters(model, cache, "reordered", budget_bytes=budget) as stream, torch.inference_mode():
        for order, recordings in [("abc", 1), ("abc", 1), ("cba", 2), ("cba", 2), ("acb", 3), ("abc", 4)]:
            assert torch.equal(model(x, order), reference(x, order)), order
            assert stream.stats["recordings"] == recordings, order
            assert stream.order == list(order)
        assert stream.stats["peak_resident_bytes"] <= budget


def test_a_missing_or_corrupt_value_is_an_error_naming_the_module(cache: CacheClient, llama: dict[str, Any]) -> None:
    manifest = save_model(llama["model"], cache, "llama-damaged")
    key = {m.path: m.keys[0] for m in manifest.modules}
    missing, corrupt, misplaced = "model.layers.1.mlp.up_proj", "model.layers.2.self_attn.o_proj", "model.norm"
    good = {path: cache.get(key[path]) for path in (missing, corrupt, misplaced)}

    def damage(path: str) -> None:
        for other, value in good.items():
            assert value is not None
            cache.put(key[other], value)
        if path == missing:
            assert cache.delete(key[path])
        elif path == corrupt:
            flipped = bytearray(good[path] or b"")
            flipped[-3] ^= 0x40  # in the last tensor's bytes, stored with a fresh value checksum: only ours can tell
            cache.put(key[path], bytes(flipped))
        else:
            cache.put(key[path], good[corrupt] or b"")  # a good record, of another module

    for path, what in [(missing, "missing"), (corrupt, "failed its checksum"), (misplaced, "another owner")]:
        damage(path)
        for lookahead in (None, 0):
            model = build_llama(meta=True)
            with stream_parameters(model, cache, "llama-damaged", lookahead=lookahead) as stream:
                with (
                    pytest.raises(ParameterValueError, match=f"module '{path}'.*{what}") as caught,
                    torch.inference_mode(),
                ):
                    model(llama["ids"])
                assert caught.value.module == path
                # Never a wrong tensor: the module still holds its placeholder.
                assert model.get_submodule(path).weight.is_meta
                assert stream.stats["forwards"] == 1
        with pytest.raises(ParameterValueError, match=f"module '{path}'.*{what}"):
            load_model(build_llama(meta=True), cache, "llama-damaged")


def test_plans_wrap_the_server_prefetch(cache: CacheClient, llama: dict[str, Any]) -> None:
    manifest = llama["manifest"]
    order = execution_order(llama["model"], llama["ids"])
    plan = Plan.execution_order(manifest, order)
    assert len(plan) == len(order) and plan.keys()[0] == b"llama/module/model.embed_tokens"
    assert plan.sizes is not None and all(size > 0 for size in plan.sizes)
    assert plan.keys_before(2) == 2 and plan.steps[1] == (b"llama/module/model.rotary_emb",)
    with plan.start(cache, window_bytes=1 << 20) as run:
        run.advance(3)
        assert run.wait(10.0), run.progress
        assert run.progress["planned"] == len(order) and run.progress["failed"] == 0

    keys = [f"samples/{i}" for i in range(5)]
    sampler = Plan.sampler_order(keys, [3, 1, 4, 0, 2], sizes=[10, 11, 12, 13, 14])
    assert sampler.keys() == [b"samples/3", b"samples/1", b"samples/4", b"samples/0", b"samples/2"]
    assert sampler.keys_before(2) == 2 and sampler.sizes == [13, 11, 14, 10, 12]
    with pytest.raises(IndexError):
        Plan.sampler_order(keys, [5])


def test_cold_stream_from_s3_is_bit_identical(
    tmp_path: Path, s3: S3Server, s3_prefix: str, llama: dict[str, Any]
) -> None:
    """Saved through one server to S3; a fresh server with an empty cache streams it from S3 at 25%."""
    first = CacheServer(["--l1-bytes", "64MiB", *s3_args(s3, s3_prefix)], tmp_path / "a").start()
    try:
        with first.client() as client:
            manifest = save_model(llama["model"], client, "llama-s3")
    finally:
        first.stop(grace=10.0)
    second = CacheServer(["--l1-bytes", "64MiB", *s3_args(s3, s3_prefix)], tmp_path / "b").start()
    try:
        with second.client() as client:
            assert client.stats()["tiers"][0]["entries"] == 0
            model = build_llama(meta=True)
            budget = manifest.nbytes // 4
            with stream_parameters(model, client, "llama-s3", budget_bytes=budget) as stream, torch.inference_mode():
                tokens = model.generate(llama["ids"], max_new_tokens=NEW_TOKENS, do_sample=False)
                assert stream.stats["peak_resident_bytes"] <= budget
            assert torch.equal(tokens, llama["tokens"])
    finally:
        second.stop(grace=10.0)


def test_the_docs_model_example_runs(server: CacheServer) -> None:
    page = (Path(__file__).parent.parent / "docs" / "inference.md").read_text()
    section = page[page.index("## Model parameters streamed from the cache") :]
    code = section[
        section.index("```python\n") + len("```python\n") : section.index("```\n", section.index("```python"))
    ]
    scope: dict[str, Any] = {}
    exec(compile(code.replace("127.0.0.1:7070", server.address), "docs/inference.md", "exec"), scope)
    stats = scope["stream"].stats
    assert 1 <= stats["forwards"] <= 8 and stats["peak_resident_bytes"] <= 10 << 20
    assert scope["out"].shape[1] > 4 and scope["run"].progress["planned"] == len(scope["plan"].keys())


def test_a_parameter_held_by_the_caller_keeps_its_values(cache: CacheClient, llama: dict[str, Any]) -> None:
    """Dropped modules' buffers are recycled for the next ones, but never one a caller still holds a view of."""
    model = build_llama(meta=True)
    held: list[torch.Tensor] = []
    model.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, args, out: held.append(m.weight))
    with stream_parameters(model, cache, "llama", budget_bytes=llama["manifest"].nbytes // 4) as stream:
        with torch.inference_mode():
            for _ in range(3):
                assert torch.equal(model(llama["ids"]).logits, llama["logits"])
        assert stream.stats["dropped"] > 0 and stream.stats["buffers_reused"] > 0
    expected = llama["model"].model.layers[0].mlp.up_proj.weight
    assert len(held) == 3 and all(torch.equal(w, expected) for w in held)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_dag_plan_runs_each_step_once_after_its_dependencies_in_listed_order(data: Any) -> None:
    n = data.draw(st.integers(1, 12))
    names = [f"s{i}" for i in data.draw(st.permutations(range(n)))]
    # Edges only from earlier to later in a hidden order: a DAG.
    hidden = data.draw(st.permutations(names))
    after = {name: [d for d in hidden[: hidden.index(name)] if data.draw(st.booleans())] for name in names}
    steps = {name: [f"{name}/a", f"{name}/b"] for name in names}
    plan = Plan.from_dag(steps, after)
    got = [step[0].decode().split("/")[0] for step in plan.steps]
    # The reference: repeatedly the first listed step whose dependencies are done.
    done: list[str] = []
    while len(done) < n:
        done.append(next(s for s in names if s not in done and all(d in done for d in after[s])))
    assert got == done
    assert plan.keys() == [k.encode() for s in done for k in steps[s]]


def test_a_dag_plan_names_a_cycle_or_an_unknown_step() -> None:
    steps = {"load": ["a"], "embed": ["b"], "head": ["c"]}
    with pytest.raises(ValueError, match="cycle"):
        Plan.from_dag(steps, {"embed": ["head"], "head": ["embed"]})
    with pytest.raises(ValueError, match="'nowhere', which is not in steps"):
        Plan.from_dag(steps, {"head": ["nowhere"]})
