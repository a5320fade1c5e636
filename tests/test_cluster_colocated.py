"""Co-located reads in a cluster: a dataset on the cache servers' machine reads each key from its owner's L2 file."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from cacheclient import CacheClient
from cacheclient.torch import CachedDataset

from conftest import S3Server, running_cluster, wait_until

pytestmark = pytest.mark.timeout(120)


def test_a_dataset_reads_each_key_from_its_owner_s_l2_on_this_machine(s3: S3Server, tmp_path: Path) -> None:
    sizes = [("8MiB", "16MiB"), ("8MiB", "16MiB"), ("8MiB", "16MiB")]
    with running_cluster(s3, tmp_path, "", sizes, meta_nodes=1) as cluster:
        rng = random.Random(3)
        samples = {f"co/{i:04d}": rng.randbytes(rng.randrange(100, 5000)) for i in range(120)}
        s3_client = cluster.s3.client()
        for name, body in samples.items():
            s3_client.put_object(Bucket=cluster.s3.bucket, Key=cluster.prefix + name, Body=body)
        client = cluster.client()
        try:
            # The first read fills each key on its owner, into L1, and into L2 once the owner has been quiet
            # for `l2.fill_idle_seconds` (its L1 is shared, and under half full).
            assert client.get_many(list(samples)) == list(samples.values())
            for server in cluster.servers:
                with CacheClient(server.address) as node:
                    wait_until(
                        lambda node=node: node.stats()["counters"].get("l2_fills_deferred", 1) == 0,
                        30.0,
                        f"{server.address}'s L2 copies of what it filled",
                    )
            placement = cluster.placement()
            dataset = CachedDataset(list(samples), cache=cluster.client(), return_key=True, local_reads=True)
            got = {key: value for key, value in (dataset[i] for i in range(len(samples)))}
            assert got == samples
            assert dataset.local_reads == len(samples), f"{dataset.local_reads} of {len(samples)} read locally"
            owners = {placement.locate(k) for k in samples}
            assert len(owners) == 3  # the local reads came from every node's file
        finally:
            client.close()
