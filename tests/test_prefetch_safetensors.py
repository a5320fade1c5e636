"""A safetensors file in S3 registered as a model (`register_safetensors`) and read by byte range.

Against a real cache server process over SeaweedFS: a random-weight
transformers Llama is written with `safetensors.torch.save`, uploaded with
boto3 under the server's prefix, registered, and then loaded and streamed
as a saved model is, every tensor and every output compared bit for bit
with the original. The file is never rewritten: the cache reads it by
ranges (range keys, `cacheclient.wire.ranges`), which are read-only.
"""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save as save_safetensors
from test_prefetch_models import NEW_TOKENS, PROMPT, build_llama, llama_config
from torch import nn

from cacheclient import CacheClient
from cacheclient.errors import InvalidRequestError, LimitExceededError
from cacheclient.prefetch import (
    RANGES,
    ParameterValueError,
    load_model,
    read_manifest,
    register_safetensors,
    stream_parameters,
)
from cacheclient.wire.ranges import range_key

from conftest import CacheServer, S3Server, s3_args

transformers = pytest.importorskip("transformers")

PREFIX = "t/safetensors/"
LLAMA_KEY = "models/llama.safetensors"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, s3: S3Server) -> Iterator[CacheServer]:
    args = ["--l1-bytes", "256MiB", "--max-value-bytes", "16MiB", *s3_args(s3, PREFIX)]
    server = CacheServer(args, tmp_path_factory.mktemp("prefetch-safetensors")).start()
    yield server
    server.stop(grace=10.0)


@pytest.fixture(scope="module")
def cache(server: CacheServer) -> Iterator[CacheClient]:
    with server.client() as client:
        yield client


def upload(s3: S3Server, key: str, data: bytes) -> None:
    s3.client().put_object(Bucket=s3.bucket, Key=PREFIX + key, Body=data)


def objects(s3: S3Server) -> dict[str, tuple[int, str]]:
    """(size, ETag) of every object under the server's prefix, by name."""
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix=PREFIX)
    return {o["Key"]: (o["Size"], o["ETag"]) for page in pages for o in page.get("Contents", [])}


@pytest.fixture(scope="module")
def llama(s3: S3Server) -> dict[str, Any]:
    """The reference Llama, its safetensors file uploaded under the server's prefix, and its outputs."""
    model = build_llama()
    data = save_safetensors({k: v.contiguous() for k, v in model.state_dict().items()})
    upload(s3, LLAMA_KEY, data)
    ids = torch.tensor([random.Random(5).choices(range(3, 512), k=PROMPT)])
    with torch.inference_mode():
        logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    return {"model": model, "size": len(data), "ids": ids, "logits": logits, "tokens": tokens}


def fill_bytes(cache: CacheClient) -> int:
    """Bytes the server has read from S3 into the cache."""
    return int(cache.stats()["counters"].get("fill_bytes", 0))  # counted from the first fill


def assert_same_tensors(got: nn.Module, want: nn.Module) -> None:
    got_tensors = dict(got.named_parameters()) | dict(got.named_buffers())
    want_tensors = dict(want.named_parameters()) | dict(want.named_buffers())
    assert got_tensors.keys() == want_tensors.keys()
    for name, tensor in want_tensors.items():
        other = got_tensors[name]
        assert other.device.type == "cpu" and other.dtype == tensor.dtype and other.shape == tensor.shape, name
        assert torch.equal(other.view(torch.uint8), tensor.view(torch.uint8)), name  # bit for bit


def test_a_registered_llama_loads_bit_for_bit_without_rewriting_the_file(
    s3: S3Server, cache: CacheClient, llama: dict[str, Any]
) -> None:
    before = objects(s3)
    fills_before = fill_bytes(cache)
    manifest = register_safetensors(cache, "llama-st", LLAMA_KEY, model=build_llama())
    # Every module with tensors in the file reads them as one range: they lie together in a state dict's file.
    in_file = [m for m in manifest.modules if m.layout == RANGES and m.tensors]
    assert in_file and all(len(m.keys) == 1 for m in in_file)
    assert read_manifest(cache, "llama-st") == manifest

    model = load_model(llama_config(), cache, "llama-st")  # built on meta from the config
    assert_same_tensors(model, llama["model"])
    with torch.inference_mode():
        assert torch.equal(model(llama["ids"]).logits, llama["logits"])

    # The file was read by ranges, each byte once, and never written: the only new objects are the
    # manifest and the rotary tables (non-persistent buffers, not in the file), a few KiB.
    after = objects(s3)
    assert after[PREFIX + LLAMA_KEY] == before[PREFIX + LLAMA_KEY]
    added = {name: size for name, (size, _) in after.items() if name not in before}
    assert all(name.startswith(PREFIX + "llama-st/") for name in added), added
    assert sum(added.values()) < llama["size"] // 100
    ranged = sum(size for m in manifest.modules if m.layout == RANGES for size in m.part_sizes().values())
    read = fill_bytes(cache) - fills_before
    assert ranged < read <= llama["size"] + 1, (ranged, read)  # each byte once; the last one twice
    assert not cache.contains(LLAMA_KEY, cached_only=True)  # the whole object never came into the cache


def test_a_registered_llama_streams_bit_identical_at_a_quarter_budget(
    cache: CacheClient, llama: dict[str, Any]
) -> None:
    manifest = register_safetensors(cache, "llama-st-stream", LLAMA_KEY, model=build_llama())
    model = build_llama(meta=True)
    budget = manifest.nbytes // 4
    with stream_parameters(model, cache, "llama-st-stream", budget_bytes=budget) as stream, torch.inference_mode():
        assert torch.equal(model(llama["ids"]).logits, llama["logits"])
        assert torch.equal(model.generate(llama["ids"], max_new_tokens=NEW_TOKENS, do_sample=False), llama["tokens"])
        stats = stream.stats
    assert stats["peak_resident_bytes"] <= budget and stats["dropped"] > 0


def test_tied_weights_are_tied_and_a_file_of_another_model_is_refused(s3: S3Server, cache: CacheClient) -> None:
    model = build_llama(tie=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # as HF writes it
    upload(s3, "tied.safetensors", save_safetensors(state))
    manifest = register_safetensors(cache, "tied", "tied.safetensors", model=build_llama(tie=True))
    (head,) = [m for m in manifest.modules if m.path == "lm_head"]
    assert not head.keys and [(t.module, t.tensor) for t in head.ties] == [("model.embed_tokens", "weight")]
    loaded = load_model(build_llama(tie=True, meta=True), cache, "tied")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)

    with pytest.raises(ValueError, match="tensor 'model.embed_tokens.weight' is float32 \\[512, 128\\] in the file"):
        register_safetensors(cache, "tied-half", "tied.safetensors", model=build_llama(tie=True, meta=True).half())
    with pytest.raises(ValueError, match="the model's tensor 'lm_head.weight' is not in the file"):
        register_safetensors(cache, "untied", "tied.safetensors", model=build_llama(meta=True))
    # A model on meta cannot give the rotary tables the file lacks: loading says which buffer is missing.
    register_safetensors(cache, "tied-meta", "tied.safetensors", model=build_llama(tie=True, meta=True))
    with pytest.raises(ValueError, match="'model.rotary_emb' buffer 'inv_freq' is not stored"):
        load_model(build_llama(tie=True, meta=True), cache, "tied-meta")


def test_without_a_model_each_tensor_is_a_parameter_of_its_name_prefix(s3: S3Server, cache: CacheClient) -> None:
    torch.manual_seed(3)
    # Tensors of one module apart in the file: safetensors puts larger dtypes first, so a.scale (F16) comes
    # after b.weight (F32), and module "a" reads two ranges.
    want = {
        "a.weight": torch.randn(5, 3),
        "a.scale": torch.randn(3).half(),
        "b.weight": torch.randn(4),
        "b.flag": torch.tensor([True, False]),
        "b.empty": torch.zeros(0, 2),
        "c.ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "c.bf": torch.randn(7).bfloat16(),
    }
    upload(s3, "plain.safetensors", save_safetensors(want))
    manifest = register_safetensors(cache, "plain", b"plain.safetensors")
    by_path = {m.path: m for m in manifest.modules}
    assert len(by_path["a"].keys) == 2 and {t.kind for m in manifest.modules for t in m.tensors} == {"parameter"}

    with torch.device("meta"):
        model = nn.Module()
        for path in ("a", "b", "c"):
            module = nn.Module()
            for full, tensor in want.items():
                if full.startswith(path + "."):
                    module.register_parameter(full[2:], nn.Parameter(torch.empty_like(tensor), requires_grad=False))
            model.add_module(path, module)
    load_model(model, cache, "plain")
    for full, tensor in want.items():
        path, _, name = full.partition(".")
        got = getattr(getattr(model, path), name)
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), full


def header_bytes(header: dict[str, Any]) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"\x05\x00", "cannot read the safetensors header length"),  # shorter than the length field
        (struct.pack("<Q", 1 << 40) + b"{}", "header length is 1099511627776 bytes"),
        (struct.pack("<Q", 50) + b"{}", "cannot read the 50-byte safetensors header"),  # truncated header
        (struct.pack("<Q", 6) + b"{nope}", "header is not JSON"),
        (header_bytes({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}) + bytes(12), "tensor 'w'"),
        (header_bytes({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}) + bytes(16), "needs 16"),
        (header_bytes({"w": {"dtype": "U16", "shape": [2], "data_offsets": [0, 4]}}) + bytes(4), "dtype 'U16'"),
        (header_bytes({"w": {"dtype": "F32", "shape": [2]}}) + bytes(8), "tensor 'w': malformed entry"),
        (
            header_bytes(
                {
                    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
                }
            )
            + bytes(12),
            "tensors 'a' and 'b' overlap",
        ),
    ],
    ids=["short", "huge-header", "cut-header", "not-json", "cut-data", "size-mismatch", "dtype", "entry", "overlap"],
)
def test_a_corrupt_or_truncated_file_is_an_error_naming_the_problem(
    s3: S3Server, cache: CacheClient, data: bytes, problem: str
) -> None:
    key = f"bad/{abs(hash(data))}.safetensors"
    upload(s3, key, data)
    with pytest.raises(ParameterValueError, match=problem):
        register_safetensors(cache, "bad", key)
    with pytest.raises(ParameterValueError, match="no object 'bad/missing.safetensors'"):
        register_safetensors(cache, "bad", "bad/missing.safetensors")


def test_a_file_truncated_after_registration_is_an_error_never_a_wrong_tensor(s3: S3Server, cache: CacheClient) -> None:
    want = {"a.weight": torch.randn(64, 64), "b.weight": torch.randn(64, 64)}
    data = save_safetensors(want)
    upload(s3, "cut.safetensors", data)
    register_safetensors(cache, "cut", "cut.safetensors")
    upload(s3, "cut.safetensors", data[: len(data) - 100])  # replaced by a truncated copy before any read
    with torch.device("meta"):
        model = nn.Module()
        for path in ("a", "b"):
            model.add_module(path, nn.Module())
            getattr(model, path).register_parameter("weight", nn.Parameter(torch.empty(64, 64)))
    with pytest.raises(InvalidRequestError, match=r"ends past the end of object .*\(\d+ bytes\)"):
        load_model(model, cache, "cut")


def test_range_keys_are_read_only_and_checked(s3: S3Server, cache: CacheClient) -> None:
    data = bytes(range(256)) * 4
    upload(s3, "raw/blob", data)
    assert cache.get(range_key(b"raw/blob", 10, 19)) == data[10:20]
    assert cache.get_many([range_key(b"raw/blob", 1000, 1023), range_key(b"raw/blob", 0, 0)]) == [data[1000:], b"\x00"]
    assert cache.get(range_key(b"raw/missing", 0, 3)) is None
    with pytest.raises(InvalidRequestError, match=r"ends past the end of object 't/safetensors/raw/blob' \(1024"):
        cache.get(range_key(b"raw/blob", 1000, 1024))
    with pytest.raises(InvalidRequestError, match="ends past the end"):
        cache.get(range_key(b"raw/blob", 5000, 5001))
    with pytest.raises(InvalidRequestError, match="ends before it starts"):
        cache.get(b"raw/blob\x00bytes=9-3")
    with pytest.raises(InvalidRequestError, match="is not START-END"):
        cache.get(b"raw/blob\x00bytes=nine")
    with pytest.raises(LimitExceededError, match="max_value_bytes"):
        cache.get(range_key(b"raw/blob", 0, 16 << 20))

    # No one can shadow a range with other bytes: a range key cannot be written, alone or in a batch.
    for key in (range_key(b"raw/blob", 10, 19), b"raw/blob\x00bytes=junk"):
        with pytest.raises(InvalidRequestError):
            cache.put(key, b"0123456789")
        with pytest.raises(InvalidRequestError):
            cache.put_many([(b"raw/other", b"x"), (key, b"0123456789")])
    assert cache.get(b"raw/other") is None  # the batch was refused whole
    assert cache.get(range_key(b"raw/blob", 10, 19)) == data[10:20]

    # Deleting a range drops the cached copy only; the object stays.
    assert cache.contains(range_key(b"raw/blob", 10, 19), cached_only=True)
    cache.delete(range_key(b"raw/blob", 10, 19))
    assert not cache.contains(range_key(b"raw/blob", 10, 19), cached_only=True)
    assert cache.contains(range_key(b"raw/blob", 10, 19)) and not cache.contains(range_key(b"raw/blob", 10, 1024))
    assert objects(s3)[PREFIX + "raw/blob"][0] == len(data)


def test_the_s3_tier_reads_a_range_in_parts_and_through_boto3(s3: S3Server, tmp_path: Path) -> None:
    from cachesvc.devcluster.seaweed import S3_ACCESS_KEY, S3_SECRET_KEY
    from cachesvc.errors import InvalidKey
    from cachesvc.tiers.s3 import S3Tier

    data = random.Random(2).randbytes(3000)
    upload(s3, "parts/blob", data)
    upload(s3, "parts//odd", data)  # an empty path segment: obstore cannot address it, boto3 reads it
    tier = S3Tier(
        endpoint=s3.endpoint,
        bucket=s3.bucket,
        prefix=PREFIX,
        access_key=S3_ACCESS_KEY,
        secret_key=S3_SECRET_KEY,
        part_bytes=1000,
    )
    try:
        for key in (b"parts/blob", b"parts//odd"):
            entry = tier.get(range_key(key, 100, 2899))  # three parts
            assert entry is not None and entry.value == data[100:2900]
            with pytest.raises(InvalidKey, match=r"\(3000 bytes\)|ends past the end"):
                tier.get(range_key(key, 2990, 3000))
            assert tier.contains(range_key(key, 0, 2999)) and not tier.contains(range_key(key, 0, 3000))
    finally:
        tier.close()
