"""Sharded datasets through the cache: WebDataset tar and MosaicML MDS shards, fetched whole, served sample by sample.

The dataset (`CachedShardDataset`, which imports torch) is
`cacheclient.torch.CachedShardDataset`; this package's top holds what needs
no torch: the formats' parsers and errors, and how a shard's parts are
named as range keys (which `cachectl warm` uses too).
"""

from cacheclient.shards.formats import CorruptShardError, MDSColumns, ShardError
from cacheclient.shards.source import DEFAULT_PART_BYTES, SHARD_SUFFIXES, is_shard, part_keys

__all__ = [
    "DEFAULT_PART_BYTES",
    "SHARD_SUFFIXES",
    "CorruptShardError",
    "MDSColumns",
    "ShardError",
    "is_shard",
    "part_keys",
]
