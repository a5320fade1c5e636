"""`CachedShardDataset`: WebDataset and MDS shards through a real cache server and SeaweedFS, in real DataLoaders.

The shards are written by `webdataset`'s and MosaicML `streaming`'s own
writers, and every epoch is compared with what their own readers return
from the same files, sample by sample and byte for byte.
"""

from __future__ import annotations

import random
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from cacheclient import CacheClientError
from cacheclient.shards.dataset import _shuffled, balanced
from cacheclient.shards.formats import MDSColumns, ShardStream, mds_records, tar_samples
from cacheclient.torch import CachedShardDataset, CachedShardMapDataset, CorruptShardError, ShardError
from cachesvc.commands import cachectl

from conftest import CacheServer, S3Server, s3_args

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from dataloader import import_streaming
from latency_proxy import LatencyProxy

wds = pytest.importorskip("webdataset")

SAMPLES = 96  # 8 shards of 12
COLUMNS = {"key": "str", "data": "bytes", "label": "int", "score": "float32", "meta": "json"}


def as_list(batch: list[Any]) -> list[Any]:
    return batch


def upload(s3: S3Server, directory: Path, prefix: str) -> None:
    client = s3.client()
    for path in sorted(directory.iterdir()):
        client.put_object(Bucket=s3.bucket, Key=prefix + path.name, Body=path.read_bytes())


def test_streamings_torchvision_stand_ins_leave_transformers_importable() -> None:
    """The benchmark's stand-in torchvision modules (streaming imports torchvision, which cannot be installed
    here) are gone once streaming is imported, and transformers, which streaming imports, does not take them
    for torchvision: a model still imports in the same process (tests/test_kv.py's did not, run after this file)."""
    had_torchvision = "torchvision" in sys.modules
    streaming = import_streaming()
    assert streaming.StreamingDataset is not None
    assert ("torchvision" in sys.modules) == had_torchvision
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=64))  # fmt: skip
    assert sum(p.numel() for p in model.parameters()) > 0


def write_wds(directory: Path, n: int, per_shard: int, seed: int) -> None:
    rng = random.Random(seed)
    directory.mkdir(parents=True)
    with wds.ShardWriter(str(directory / "shard-%04d.tar"), maxcount=per_shard, verbose=0) as writer:
        for i in range(n):
            sample = {"__key__": f"s{i:05d}", "bin": rng.randbytes(rng.randrange(100, 4000)), "json": b'{"i": %d}' % i}
            if i % 3 == 0:
                sample["txt"] = f"caption {i}".encode()
            writer.write(sample)


def write_mds(directory: Path, n: int, seed: int) -> None:
    streaming = import_streaming()
    rng = random.Random(seed)
    with streaming.MDSWriter(out=str(directory), columns=COLUMNS, size_limit=30_000) as writer:
        for i in range(n):
            data = rng.randbytes(rng.randrange(100, 4000))
            writer.write({"key": f"m{i:05d}", "data": data, "label": i, "score": i / 7, "meta": {"i": i, "n": [i]}})


def wds_reference(directory: Path) -> dict[str, dict[str, Any]]:
    """What `webdataset` itself reads from the tar files, by key (without its file-path fields)."""
    urls = sorted(str(p) for p in directory.glob("*.tar"))
    out = {}
    for sample in wds.WebDataset(urls, shardshuffle=False):
        out[sample["__key__"]] = {k: v for k, v in sample.items() if k not in ("__url__", "__local_path__")}
    return out


def mds_reference(directory: Path) -> dict[str, dict[str, Any]]:
    """What `streaming.StreamingDataset` itself reads from the MDS files, by key."""
    streaming = import_streaming()
    dataset = streaming.StreamingDataset(local=str(directory), shuffle=False, batch_size=1)
    return {s["key"]: s for s in (dataset[i] for i in range(len(dataset)))}


def sample_key(sample: dict[str, Any]) -> str:
    return str(sample.get("__key__", sample.get("key")))


def check_epoch(delivered: list[dict[str, Any]], reference: dict[str, dict[str, Any]]) -> None:
    counts = Counter(sample_key(s) for s in delivered)
    assert not [k for k, n in counts.items() if n > 1], "samples delivered more than once"
    assert set(counts) == set(reference), f"missing: {sorted(set(reference) - set(counts))[:5]}"
    for sample in delivered:
        want = reference[sample_key(sample)]
        got = {k: v for k, v in sample.items() if k != "__url__"}
        assert got.keys() == want.keys()
        for name, value in want.items():
            assert type(got[name]) is type(value) and got[name] == value, f"{sample_key(sample)}: column {name} differs"


@pytest.fixture(scope="module")
def server_prefix() -> str:
    return f"t/{uuid.uuid4().hex[:12]}/"


@pytest.fixture(scope="module")
def shards(s3: S3Server, server_prefix: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same kind of samples as WebDataset tars (wds/) and MDS shards (mds/), in S3; their references."""
    root = tmp_path_factory.mktemp("shards")
    write_wds(root / "wds", SAMPLES, 12, seed=1)
    write_mds(root / "mds", SAMPLES, seed=2)
    upload(s3, root / "wds", server_prefix + "wds/")
    upload(s3, root / "mds", server_prefix + "mds/")
    return {"webdataset": wds_reference(root / "wds"), "mds": mds_reference(root / "mds"), "root": root}


@pytest.fixture(scope="module")
def shared_server(s3: S3Server, server_prefix: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("cache")
    server = CacheServer(
        ["--l1-bytes", "32MiB", "--l2-path", str(tmp / "l2"), "--l2-bytes", "64MiB", *s3_args(s3, server_prefix)],
        tmp / "logs",
    )
    server.start()
    yield server
    server.stop(grace=10.0)


def dataset(server: CacheServer, s3: S3Server, fmt: str, **kwargs: Any) -> CachedShardDataset:
    prefix = "wds/" if fmt == "webdataset" else "mds/"
    return CachedShardDataset.from_s3(f"s3://{s3.bucket}/{prefix}", format=fmt, cache=server.address, **kwargs)


# -- every sample exactly once, as the formats' own readers read it -------------------------


def test_the_shuffle_buffer_yields_once_it_holds_its_initial_samples_and_keeps_every_one() -> None:
    # With 1 MiB samples, a worker filled its whole 256-sample buffer (its whole share of a small epoch)
    # before its first batch; now it yields once `initial` are in, as webdataset's shuffle does.
    taken = 0

    def counted(n: int) -> Iterator[int]:
        nonlocal taken
        for i in range(n):
            taken += 1
            yield i

    out = _shuffled(counted(1000), 256, random.Random(1), 64)
    first = next(out)
    assert taken == 64, f"read {taken} samples before the first came out"
    rest = list(out)
    assert sorted([first, *rest]) == list(range(1000))  # each once
    assert [first, *rest] != list(range(1000))  # shuffled
    again = list(_shuffled(iter(range(1000)), 256, random.Random(1), 64))
    assert again == [first, *rest]  # a function of the seed
    assert sorted(_shuffled(iter(range(10)), 256, random.Random(2), 64)) == list(range(10))  # fewer than initial


def test_shards_are_split_among_workers_by_bytes() -> None:
    # The benchmark's warm epoch: 6 shards of 68 MiB and a 7 MiB one, in that epoch's shuffled order, over
    # 2 DataLoader workers. Dealt round-robin, one worker read 4 full shards (272 MiB) and the other 143 MiB:
    # the epoch took as long as the larger share. By bytes, each reads about half.
    sizes = [68] * 6 + [7]
    order = [3, 6, 5, 2, 0, 4, 1]
    split = [balanced(order, sizes, 2, w) for w in range(2)]
    assert sorted(split[0] + split[1]) == list(range(7))
    loads = [sum(sizes[i] for i in part) for part in split]
    assert max(loads) - min(loads) <= 68, loads
    assert max(loads) < 272
    rng = random.Random(4)
    for _ in range(200):
        n, parts = rng.randint(1, 30), rng.randint(1, 5)
        sizes = [rng.choice([1, 50, 100, rng.randint(1, 100)]) for _ in range(n)]
        order = rng.sample(range(n), n)
        split = [balanced(order, sizes, parts, p) for p in range(parts)]
        assert sorted(i for part in split for i in part) == list(range(n))  # each shard to one part
        assert all(part == [i for i in order if i in part] for part in split)  # in the epoch's order
        loads = [sum(sizes[i] for i in part) for part in split]
        assert max(loads) - min(loads) <= max(sizes)
    assert [balanced(range(7), [5] * 7, 3, p) for p in range(3)] == [[0, 3, 6], [1, 4], [2, 5]]  # round-robin


@pytest.mark.parametrize("fmt", ["webdataset", "mds"])
def test_two_ranks_two_workers_read_every_sample_once_as_the_reference_reader(
    shared_server: CacheServer, s3: S3Server, shards: dict[str, Any], fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small parts: samples straddle the parts of a shard.
    ds = dataset(shared_server, s3, fmt, seed=3, shuffle_buffer=16, part_bytes=5000)
    assert len(ds.shards) >= 4
    delivered: list[dict[str, Any]] = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        ds.set_epoch(1)
        loader = DataLoader(
            ds, batch_size=4, num_workers=2, collate_fn=as_list, multiprocessing_context="fork", timeout=200.0
        )  # a worker stuck 150 s dumps its stacks (conftest), then this raises
        delivered += [s for batch in loader for s in batch]
    check_epoch(delivered, shards[fmt])


def test_map_style_mds_reads_any_sample_by_index_as_streaming_does(
    shared_server: CacheServer, s3: S3Server, shards: dict[str, Any]
) -> None:
    ds = CachedShardMapDataset.from_s3(f"s3://{s3.bucket}/mds/", cache=shared_server.address)
    assert len(ds) == SAMPLES and len(ds.shards) >= 4
    # Index order is the index's shard order, as StreamingDataset(local=...)[i] (written as m00000, m00001, ...).
    assert [ds[i]["key"] for i in (0, 1, SAMPLES // 2, SAMPLES - 1, -1)] == [
        "m00000", "m00001", f"m{SAMPLES // 2:05d}", f"m{SAMPLES - 1:05d}", f"m{SAMPLES - 1:05d}"
    ]  # fmt: skip
    with pytest.raises(IndexError):
        ds[SAMPLES]
    # Shuffled, in two forked workers: every sample once, equal to the reference reader's, column by column.
    loader = DataLoader(
        ds, batch_size=5, shuffle=True, num_workers=2, collate_fn=as_list, multiprocessing_context="fork", timeout=200.0
    )
    delivered = [s for batch in loader for s in batch]
    check_epoch(delivered, shards["mds"])
    # Warm now: every sample and offset table comes from the co-located server's L2 file, none over gRPC.
    again = CachedShardMapDataset.from_s3(f"s3://{s3.bucket}/mds/", cache=shared_server.address)
    check_epoch([again[i] for i in range(len(again))], shards["mds"])
    assert again.local_reads == SAMPLES + len(again.shards)


def test_shuffle_is_per_epoch_and_seeded(shared_server: CacheServer, s3: S3Server, shards: dict[str, Any]) -> None:
    def keys(epoch: int, seed: int) -> list[str]:
        ds = dataset(shared_server, s3, "webdataset", seed=seed, shuffle_buffer=8)
        ds.set_epoch(epoch)
        return [s["__key__"] for s in ds]

    first = keys(0, 1)
    assert first == keys(0, 1)
    assert first != keys(1, 1) and first != keys(0, 2)
    assert sorted(first) == sorted(shards["webdataset"])
    plain = dataset(shared_server, s3, "webdataset", shuffle=False)
    assert [s["__key__"] for s in plain] == sorted(shards["webdataset"])
    # Warm parts came from the co-located server's L2 file, not over gRPC.
    assert plain.local_reads == len(plain.shards)


def test_equal_shards_gives_every_rank_as_many_shards(
    shared_server: CacheServer, s3: S3Server, shards: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    per_rank = []
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        per_rank.append([s["__key__"] for s in dataset(shared_server, s3, "webdataset", equal_shards=True)])
    assert [len(keys) for keys in per_rank] == [24, 24, 24]  # 8 shards of 12: the last 2 of the order dropped
    everything = [k for keys in per_rank for k in keys]
    assert len(set(everything)) == len(everything)


def test_resume_mid_epoch_from_state_dict(shared_server: CacheServer, s3: S3Server, shards: dict[str, Any]) -> None:
    import torchdata.stateful_dataloader as stateful

    def loader() -> Any:
        ds = dataset(shared_server, s3, "mds", seed=9, shuffle_buffer=10)
        ds.set_epoch(2)
        return stateful.StatefulDataLoader(ds, batch_size=3, num_workers=2, collate_fn=as_list)

    first = loader()
    before: list[dict[str, Any]] = []
    for n, batch in enumerate(first):
        before += batch
        if n == 6:
            break
    state = first.state_dict()
    del first
    second = loader()
    second.load_state_dict(state)
    after = [s for batch in second for s in batch]
    assert len(before) == 21
    check_epoch(before + after, shards["mds"])

    # Without workers, straight from the dataset's own state.
    ds = dataset(shared_server, s3, "webdataset", seed=4)
    it = iter(ds)
    head = [next(it) for _ in range(30)]
    resumed = dataset(shared_server, s3, "webdataset", seed=4)
    resumed.load_state_dict(ds.state_dict())
    check_epoch(head + list(resumed), shards["webdataset"])
    with pytest.raises(ShardError, match="cannot resume"):
        dataset(shared_server, s3, "webdataset", seed=5).load_state_dict(ds.state_dict())


# -- corrupt shards and indexes ---------------------------------------------------------------


def test_corrupt_and_truncated_shards_name_the_shard_and_offset(
    shared_server: CacheServer, s3: S3Server, server_prefix: str, shards: dict[str, Any]
) -> None:
    root: Path = shards["root"]
    tar = (root / "wds" / "shard-0000.tar").read_bytes()
    client = s3.client()
    flipped = bytearray(tar)
    # The second member's header: after the first header and its padded data.
    first_size = int(tar[124:136].split(b"\x00")[0].strip() or b"0", 8)
    second_header = 512 + first_size + (-first_size % 512)
    flipped[second_header + 10] ^= 0x20
    bad = {
        "bad/flipped.tar": (bytes(flipped), second_header, "checksum"),
        "bad/truncated.tar": (tar[: len(tar) // 2], None, "past the end|ends"),
        "bad/nomarker.tar": (tar[:second_header], second_header, "end-of-archive"),
    }
    for name, (body, _, _) in bad.items():
        client.put_object(Bucket=s3.bucket, Key=server_prefix + name, Body=body)
    for name, (_, offset, problem) in bad.items():
        ds = CachedShardDataset.from_s3(f"s3://{s3.bucket}/{name}", format="webdataset", cache=shared_server.address)
        with pytest.raises(CorruptShardError, match=problem) as caught:
            list(ds)
        assert caught.value.shard == name and name in str(caught.value)
        if offset is not None:
            assert caught.value.offset == offset

    # MDS: an index that names a shard of another size; a shard whose sample count is not its index's.
    mds = root / "mds"
    index = (mds / "index.json").read_text()
    shard = (mds / "shard.00000.mds").read_bytes()
    client.put_object(Bucket=s3.bucket, Key=server_prefix + "badmds/index.json", Body=index.encode())
    for path in mds.glob("shard.*.mds"):
        client.put_object(Bucket=s3.bucket, Key=server_prefix + "badmds/" + path.name, Body=path.read_bytes())
    client.put_object(Bucket=s3.bucket, Key=server_prefix + "badmds/shard.00000.mds", Body=shard[:-5])
    with pytest.raises(CorruptShardError, match=r"badmds/shard.00000.mds.*index.json says"):
        CachedShardDataset.from_s3(f"s3://{s3.bucket}/badmds/", format="mds", cache=shared_server.address)
    miscounted = (len(shard) // 4 + 1).to_bytes(4, "little") + shard[4:]
    client.put_object(Bucket=s3.bucket, Key=server_prefix + "badmds/shard.00000.mds", Body=miscounted)
    ds = CachedShardDataset.from_s3(
        f"s3://{s3.bucket}/badmds/", format="mds", cache=shared_server.address, shuffle=False
    )
    with pytest.raises(CorruptShardError, match="shard.00000.mds: corrupt at byte 0: the shard holds"):
        list(ds)


def test_tar_parser_reads_what_tarfile_writes(tmp_path: Path) -> None:
    """Long names (GNU and pax), directories and links are read as `tarfile` and `webdataset` read them."""
    import io
    import tarfile

    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT):
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
            names = ["d/" + "x" * 120 + "/a.cls", "d/" + "x" * 120 + "/a.jpg", "b.one.two"]
            for i, name in enumerate(names):
                info = tarfile.TarInfo(name)
                info.size = 10 + i
                tar.addfile(info, io.BytesIO(bytes([i]) * info.size))
            tar.addfile(tarfile.TarInfo("dir"))  # a regular empty file named without an extension: skipped
        data = out.getvalue()
        got = list(tar_samples(ShardStream("t.tar", len(data), [(0, len(data) - 1)], [data].__getitem__), "u"))
        path = tmp_path / f"{fmt}.tar"
        path.write_bytes(data)
        want = list(wds.WebDataset([str(path)], shardshuffle=False))
        assert [{k: v for k, v in s.items() if k != "__url__"} for s in got] == [
            {k: v for k, v in s.items() if k not in ("__url__", "__local_path__")} for s in want
        ]


def test_tar_header_with_a_signed_checksum_is_still_read() -> None:
    """Old tars summed header bytes as signed chars; the signed sum is checked when the unsigned one fails."""
    import io
    import tarfile

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT, encoding="latin-1") as tar:
        info = tarfile.TarInfo("s\xe9\xe9.data")  # bytes over 127 in the name: the two sums differ
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    data = bytearray(out.getvalue())
    header = data[:512]
    signed = sum(b - 256 if b > 127 else b for b in header[:148] + header[156:]) + 256
    data[148:156] = b"%06o\x00 " % signed
    got = list(tar_samples(ShardStream("t.tar", len(data), [(0, len(data) - 1)], [bytes(data)].__getitem__), "u"))
    assert [(s["__key__"], s["data"]) for s in got] == [
        ("s\udce9\udce9", b"abc")
    ]  # latin-1 names: surrogate-escaped, as `_tar_files` reads
    data[148:156] = b"%06o\x00 " % (signed + 1)
    with pytest.raises(CorruptShardError, match="checksum"):
        list(tar_samples(ShardStream("t.tar", len(data), [(0, len(data) - 1)], [bytes(data)].__getitem__), "u"))


def test_mds_samples_read_as_views_decode_to_copies() -> None:
    """A sample read as a view of its part decodes to values that hold no view of it (bytes, str, ints), with
    every part read into one reused buffer and samples that straddle parts."""
    import struct

    columns = MDSColumns(("data", "name", "n"), ("bytes", "str", "int32"), (None, None, 4))
    samples = [(bytes([i]) * (100 + i), f"sample {i}", i) for i in range(40)]
    bodies = [
        struct.pack("<II", len(d), len(n.encode())) + d + n.encode() + struct.pack("<i", k) for d, n, k in samples
    ]
    header = 4 + 4 * (len(bodies) + 1)
    offsets = [header]
    for body in bodies:
        offsets.append(offsets[-1] + len(body))
    shard = struct.pack(f"<I{len(offsets)}I", len(bodies), *offsets) + b"".join(bodies)
    spans = [(start, min(start + 1000, len(shard)) - 1) for start in range(0, len(shard), 1000)]  # samples span parts
    buffer = bytearray(1000)  # every part read into one buffer, as from the co-located L2 (`L2Reader.get_into`)

    def read_part(j: int) -> memoryview:
        view = memoryview(buffer)[: spans[j][1] - spans[j][0] + 1]
        view[:] = shard[spans[j][0] : spans[j][1] + 1]
        return view

    stream = ShardStream("s.mds", len(shard), spans, read_part)
    decoders = columns.decoders(False, "s.mds")
    got = [columns.decode(data, decoders, "s.mds", at) for at, data in mds_records(stream, len(bodies), views=True)]
    assert [(s["data"], s["name"], int(s["n"])) for s in got] == samples
    assert all(type(s["data"]) is bytes for s in got)


# -- cache outage, S3 requests, warm ----------------------------------------------------------


def test_cache_down_mid_epoch_the_epoch_completes_from_s3(
    cache_server: Any, s3: S3Server, server_prefix: str, shards: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "any")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "any")
    server = cache_server("--l1-bytes", "16MiB", *s3_args(s3, server_prefix))
    common = {"s3_endpoint": s3.endpoint, "s3_key_prefix": server_prefix, "retry_cache_after": 60.0}
    ds = dataset(server, s3, "webdataset", part_bytes=8000, shuffle_buffer=0, **common)
    strict = dataset(server, s3, "webdataset", part_bytes=8000, fallback=False, **common)
    delivered = []
    for n, sample in enumerate(ds):
        delivered.append(sample)
        if n == 20:
            server.kill()
    check_epoch(delivered, shards["webdataset"])
    assert ds.fallback_reads > 0
    with pytest.raises(CacheClientError):
        list(strict)


def test_cold_epoch_reads_each_shard_with_about_one_s3_get(
    cache_server: Any, s3: S3Server, server_prefix: str, shards: dict[str, Any], tmp_path: Path
) -> None:
    proxy = LatencyProxy(s3.endpoint.removeprefix("http://"), delay=0.0).start()
    try:
        server = cache_server(
            "--l1-bytes", "32MiB", "--s3-endpoint", proxy.endpoint, "--s3-bucket", s3.bucket,
            "--s3-prefix", server_prefix,
        )  # fmt: skip
        for fmt in ("webdataset", "mds"):
            ds = dataset(server, s3, fmt)  # default parts: one per shard here
            before = proxy.requests
            check_epoch(list(ds), shards[fmt])
            cold = proxy.requests - before
            n = len(ds.shards)
            assert n <= cold <= n + 2, f"{fmt}: a cold epoch of {n} shards made {cold} S3 requests"
            before = proxy.requests
            ds.set_epoch(1)
            check_epoch(list(ds), shards[fmt])
            assert proxy.requests == before, "a warm epoch went to S3"

        # `cachectl warm` loads shards as the dataset's range keys: the epoch after it is warm.
        other = cache_server(
            "--l1-bytes", "32MiB", "--s3-endpoint", proxy.endpoint, "--s3-bucket", s3.bucket,
            "--s3-prefix", server_prefix,
        )  # fmt: skip
        argv = ["--cache", other.address, "--timeout", "30", "warm", f"s3://{s3.bucket}/wds/", "--no-progress"]
        assert cachectl.main(argv) == 0
        warmed = dataset(other, s3, "webdataset")
        before = proxy.requests
        check_epoch(list(warmed), shards["webdataset"])
        assert proxy.requests == before, "an epoch after cachectl warm went to S3"
    finally:
        proxy.stop()
