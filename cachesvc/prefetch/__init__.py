"""Fetching ahead of need, from a plan of what a job reads next."""

from cachesvc.prefetch.planner import PrefetchPlanner, Progress
from cachesvc.prefetch.reads import PlannedReads
from cachesvc.prefetch.runner import Plan, Prefetcher
from cachesvc.prefetch.schedule import FetchScheduler, Priority

__all__ = ["FetchScheduler", "Plan", "PlannedReads", "PrefetchPlanner", "Prefetcher", "Priority", "Progress"]
