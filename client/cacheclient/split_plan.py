"""`SplitPrefetchPlan`: a prefetch plan split over the owners of its keys, run as one.

The routed transport (`cacheclient.routing.Router.prefetch`) starts one
node's plan per owner of the plan's keys and hands back this plan over
them: progress summed, `consumed` told to each part in its own positions,
`extend` sending each new key to its owner's part.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from typing import Any

from cacheclient._batches import as_key
from cacheclient.errors import CacheClientError, InvalidRequestError, UnavailableError
from cacheclient.node import NodeClient
from cacheclient.node_plan import PrefetchPlan

__all__ = ["SplitPrefetchPlan"]


class SplitPrefetchPlan(PrefetchPlan):
    """A prefetch plan split over the owners of its keys: one node's plan per owner, run as one.

    It implements the `PrefetchPlan` protocol over its parts, each a plan of its own.
    """

    def __init__(
        self,
        plans: list[tuple[list[int], PrefetchPlan]],
        owners: list[str],
        planned: int,
        locate: Callable[[bytes], str | None],
        client: Callable[[str], NodeClient],
        window_bytes: int,
        priority: str,
    ) -> None:
        self._parts = plans
        self._planned = planned
        self._consumed = [0] * len(plans)
        self._owners = {owner: i for i, owner in enumerate(owners)}
        self._locate = locate
        self._client_of = client
        self._window_bytes = window_bytes
        self._priority_name = priority

    @property
    def planned(self) -> int:
        """Keys in the plan: those it started with and every `extend` since."""
        return self._planned

    @property
    def progress(self) -> dict[str, Any]:
        """The parts' progress, summed; "done" once every part is."""
        parts = [plan.progress for _, plan in self._parts]
        total: dict[str, Any] = {"planned": self._planned}
        for name in ("fetched", "consumed", "window_used_bytes", "failed"):
            total[name] = sum(int(p.get(name, 0)) for p in parts)
        total["done"] = all(p.get("done") for p in parts)
        return total

    @property
    def error(self) -> CacheClientError | None:
        """The first part's error, if any failed."""
        return next((plan.error for _, plan in self._parts if plan.error is not None), None)

    def consumed(self, n: int) -> None:
        """The first `n` keys of the whole plan are read: each part learns how many of its own that is."""
        for i, (positions, plan) in enumerate(self._parts):
            mine = bisect.bisect_left(positions, n)
            if mine != self._consumed[i]:
                self._consumed[i] = mine
                plan.consumed(mine)

    def extend(self, keys: Sequence[bytes | str], sizes: Sequence[int] | None = None) -> None:
        """Appends keys to the plan: each goes to the part of its owner (in the placement the plan
        started with); an owner with no part yet gets one, with the window share of the first part."""
        wanted = [as_key(k) for k in keys]
        if sizes is not None and len(sizes) != len(wanted):
            raise InvalidRequestError(f"sizes has {len(sizes)} entries for {len(wanted)} keys")
        by_owner: dict[str, list[int]] = {}
        for n, key in enumerate(wanted):
            owner = self._locate(key)
            if owner is None:
                raise UnavailableError("no cache node is up in the placement map")
            by_owner.setdefault(owner, []).append(n)
        for owner, ns in by_owner.items():
            part_keys = [wanted[n] for n in ns]
            part_sizes = [sizes[n] for n in ns] if sizes is not None else None
            positions = [self._planned + n for n in ns]
            if owner in self._owners:
                held, plan = self._parts[self._owners[owner]]
                plan.extend(part_keys, part_sizes)
                held.extend(positions)
            else:
                share = max(1, self._window_bytes // max(1, len(self._parts) + 1))
                plan = self._client_of(owner).prefetch(
                    part_keys, window_bytes=share, sizes=part_sizes, priority=self._priority_name
                )
                self._owners[owner] = len(self._parts)
                self._parts.append((positions, plan))
                self._consumed.append(0)
        self._planned += len(wanted)

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(plan.wait(max(0.0, deadline - time.monotonic())) for _, plan in self._parts)

    def close(self) -> None:
        for _, plan in self._parts:
            plan.close()
