"""Fetching ahead of need, from a plan of what a job reads next."""

from cachesvc.prefetch.planner import PrefetchPlanner, Progress
from cachesvc.prefetch.reads import PlannedReads
from cachesvc.prefetch.runner import Plan, Prefetcher

__all__ = ["Plan", "PlannedReads", "PrefetchPlanner", "Prefetcher", "Progress"]
