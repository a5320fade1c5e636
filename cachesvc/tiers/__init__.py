"""The cache tiers: L1 memory, L2 LMDB, L3 S3, behind one contract (`base.Tier`)."""

from cachesvc.tiers.base import Entry, ResidentKey, Tier
from cachesvc.tiers.lmdb_tier import LMDBTier
from cachesvc.tiers.memory import MemoryTier
from cachesvc.tiers.s3 import S3Tier

__all__ = ["Entry", "LMDBTier", "MemoryTier", "ResidentKey", "S3Tier", "Tier"]
