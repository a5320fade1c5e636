"""A model saved through a cluster: its manifest is committed by a record in the metadata shard, and it
loads and streams through another routing client, with a cache node SIGKILLed in between."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_prefetch_models import build_sequential

from cacheclient import CacheClient
from cacheclient.meta import MetaClient
from cacheclient.prefetch import (
    ParameterValueError,
    load_model,
    manifest_key,
    model_record,
    read_manifest,
    save_model,
    stream_parameters,
)

from conftest import S3Server, running_cluster

pytestmark = pytest.mark.timeout(180)


def test_a_model_saved_through_a_cluster_is_committed_in_the_shard_and_survives_a_node(
    s3: S3Server, tmp_path: Path
) -> None:
    sizes = [("32MiB", "32MiB")] * 3
    with running_cluster(s3, tmp_path, "", sizes, meta_nodes=1) as cluster:
        meta = ",".join(cluster.shard.addresses)
        reference = build_sequential()
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))
        with torch.inference_mode():
            expected = reference(x)
        with CacheClient(meta=meta) as writer:
            first = save_model(reference, writer, "seq")
        # The shard's record names the manifest's value, by size and checksum; no plain manifest key is written.
        record = MetaClient(cluster.shard.addresses).get_manifest(model_record("seq"))
        assert record is not None and len(record.items) == 1
        with CacheClient(meta=meta) as reader:
            assert reader.get(manifest_key("seq")) is None
            assert reader.get(record.items[0].key) is not None
            assert read_manifest(reader, "seq") == first
            # Saved again: the record moves to the new manifest in one write.
            with torch.no_grad():
                reference[0].weight.add_(1.0)
                expected = reference(x)
            second = save_model(reference, reader, "seq")
            assert second.save_id != first.save_id and read_manifest(reader, "seq") == second
            # One node dies; what it held is read from S3 (write-through) by the next candidate.
            cluster.servers[1].kill()
            model = load_model(build_sequential(meta=True), reader, "seq")
            with torch.inference_mode():
                assert torch.equal(model(x), expected)
            streamed = build_sequential(meta=True)
            largest = max(m.nbytes for m in second.modules)
            with stream_parameters(streamed, reader, "seq", budget_bytes=largest), torch.inference_mode():
                assert torch.equal(streamed(x), expected)
            with pytest.raises(ParameterValueError, match="no saved model"):
                read_manifest(reader, "absent")
