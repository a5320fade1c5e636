"""`cachectl warm`: loads a prefix into the cache, resumes by skipping what is cached, and says what went wrong."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from cachesvc.commands import cachectl

from conftest import S3Server, s3_args


def warm(address: str, *argv: str) -> int:
    return cachectl.main(["--cache", address, "--timeout", "30", "warm", *argv])


def test_warm_loads_every_object_and_resumes(
    cache_server: Any, s3: S3Server, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = f"t/{uuid.uuid4().hex[:12]}/"
    objects = {f"data/{i:03d}": bytes([i]) * (1000 + 37 * i) for i in range(30)}
    client_s3 = s3.client()
    for name, body in objects.items():
        client_s3.put_object(Bucket=s3.bucket, Key=prefix + name, Body=body)  # type: ignore[attr-defined]
    server = cache_server(
        "--l1-bytes", "16MiB", "--l2-path", str(tmp_path / "l2"), "--l2-bytes", "16MiB", *s3_args(s3, prefix)
    )
    client = server.client()

    assert warm(server.address, f"s3://{s3.bucket}/data/", "--window", "8KiB") == 0
    out, err = capsys.readouterr()
    assert "30 objects" in out and "0 already cached, loading 30" in out
    assert "loaded 30 objects" in out
    assert "warm" in err and "30/30 objects" in err  # the progress bar
    assert all(client.contains(name, cached_only=True) for name in objects)
    # Warmed values are the objects' bytes, and the reads are cache hits.
    before = client.stats()["counters"].get("hits_l3", 0)
    assert client.get_many(list(objects)) == list(objects.values())
    assert client.stats()["counters"].get("hits_l3", 0) == before

    # Interrupted half-way (simulated by evicting a third): a second warm loads only the rest.
    for name in list(objects)[:10]:
        assert client.evict(name)
    assert warm(server.address, f"s3://{s3.bucket}/data/", "--no-progress") == 0
    out, _ = capsys.readouterr()
    assert "20 already cached, loading 10" in out
    assert all(client.contains(name, cached_only=True) for name in objects)


def test_warm_bad_input(cache_server: Any, s3: S3Server, capsys: pytest.CaptureFixture[str]) -> None:
    server = cache_server("--l1-bytes", "16MiB", *s3_args(s3, f"t/{uuid.uuid4().hex[:12]}/"))
    assert warm(server.address, "not-a-uri") == 2
    assert "not an S3 URI" in capsys.readouterr().err
    assert warm(server.address, f"s3://{s3.bucket}/nothing/") == 2
    assert f"no objects under s3://{s3.bucket}/nothing/" in capsys.readouterr().err
