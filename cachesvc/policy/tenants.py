"""Tenants in a tier: each tenant's bytes against its quota, and whose keys go first when the tier is full.

`TenantShares` is what every tier of a server knows of the tenants (the
table the server follows: which prefix is whose, each tenant's quota per
tier, its priority); `TenantPolicy` wraps a tier's eviction policy. Pure,
like every policy: events in, victims out, no I/O.

Within the wrapper each key is tracked twice, by the policy the tier was
configured with (LRU-K, plan-aware, ...): once among the keys of its
priority (low, normal, high; a key under no tenant is normal) and once
among its tenant's keys. So:

* a tenant over its quota in this tier gives the next victim, from its own
  keys in the policy's order (`excess` names them until it is back under:
  the tier evicts them right after the insert that went over);
* an insert by a tenant at its quota makes room from its own keys, never
  another's (`admit` tells the wrapper whose insert comes next);
* otherwise the victim is the policy's own choice among the lowest
  priority that has keys;
* an insert by a tenant below `high` that would evict a `high` key is not
  admitted (`admit` is False): the tier refuses it and the value goes to
  the next tier down, or only to object storage, so a low tenant's scan
  does not enter L1 while it would evict high keys.

Quotas are the cluster's: a node holds a tenant to its quota times the
node's share of the placement (`node_share`: the slots it owns over all,
so its capacity's weight), which the server sets from each placement map
it follows (`TenantShares.set_share`); a lower quota or share is enforced
from the next insert into the tier.

A key keeps the tenant and priority it had when it came in until it leaves
the tier (a table change applies to keys inserted after it). Held keys
(leased, dirty with nowhere to go) are out of every policy, so out of the
tenants' counts too.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cachesvc.policy.base import EvictionPolicy

if TYPE_CHECKING:
    from cacheclient.wire.placement import PlacementMap

__all__ = ["PRIORITY_RANKS", "TenantPolicy", "TenantReads", "TenantShares", "node_share", "tenant_counters"]

PRIORITY_RANKS = {"low": 0, "normal": 1, "high": 2}
"""A priority's rank: lower goes first."""

_NORMAL = PRIORITY_RANKS["normal"]
_HIGH = PRIORITY_RANKS["high"]


@dataclass(frozen=True, slots=True)
class _Tenant:
    name: str
    rank: int
    quotas: dict[str, int]
    """Tier name ("l1", "l2") -> bytes; absent or 0: no quota."""


class TenantShares:
    """The tenants every tier of one server accounts by: replaced whole when the server follows a new table."""

    def __init__(self) -> None:
        self._prefixes: tuple[tuple[bytes, _Tenant], ...] = ()
        self._by_name: dict[str, _Tenant] = {}
        self.share = 1.0
        """This node's share of the cluster's placement (`node_share`): each quota here is the cluster's times it.
        1.0 until the node follows a placement map (a lone node, or one not placed yet)."""

    def set_share(self, share: float) -> None:
        """This node's share of the placement, 0 < share <= 1, from the map it follows."""
        if not 0.0 < share <= 1.0:
            raise ValueError(f"a node's share of the placement is in (0, 1], not {share}")
        self.share = share

    def replace(self, tenants: Sequence[tuple[str, Sequence[str], str, dict[str, int]]]) -> None:
        """The tenants as (name, prefixes, priority, {tier: quota bytes}); keys inserted from now on follow them."""
        by_name = {
            name: _Tenant(name, PRIORITY_RANKS.get(priority, _NORMAL), dict(quotas))
            for name, _, priority, quotas in tenants
        }
        prefixes = [(prefix.encode(), by_name[name]) for name, owned, _, _ in tenants for prefix in owned]
        self._by_name = by_name
        self._prefixes = tuple(sorted(prefixes, key=lambda p: -len(p[0])))

    def __bool__(self) -> bool:
        return bool(self._prefixes)

    def tenant_of(self, key: bytes) -> _Tenant | None:
        for prefix, tenant in self._prefixes:
            if key.startswith(prefix):
                return tenant
        return None

    def quota(self, name: str, tier: str) -> int:
        """`name`'s quota in `tier` on this node, in bytes: the cluster's times this node's `share` (at least 1);
        0: none (or no such tenant any more)."""
        tenant = self._by_name.get(name)
        quota = tenant.quotas.get(tier, 0) if tenant is not None else 0
        if not quota or self.share >= 1.0:
            return quota
        return max(1, math.ceil(quota * self.share))

    def names(self) -> list[str]:
        """The tenants' names."""
        return list(self._by_name)


def node_share(placement: PlacementMap, address: str) -> float | None:
    """The share of `placement`'s slots that `address` owns: its capacity's weight in the rendezvous hashing
    (`cacheclient.wire.placement`). None when it owns none (not placed, draining): its quotas stay as they were.

    Only owned slots count: a replicated namespace's copies on other nodes count against the quota there too, so
    the cluster quota bounds a tenant's bytes with every copy counted.
    """
    if address not in placement.nodes or not placement.slots:
        return None
    owned = placement.slots.count(placement.nodes.index(address))
    return owned / len(placement.slots) if owned else None


class TenantPolicy:
    """A tier's eviction policy, by tenant and priority; see the module docstring.

    Args:
        make: builds one instance of the tier's configured policy.
        tier: the tier's name ("l1", "l2"): which quota applies.
        shares: the tenants, shared by the server's tiers.
    """

    def __init__(self, make: Callable[[], EvictionPolicy], tier: str, shares: TenantShares) -> None:
        self._make = make
        self._tier = tier
        self._shares = shares
        first = make()
        self.name = getattr(first, "name", type(first).__name__)
        self._ranks: dict[int, EvictionPolicy] = {_NORMAL: first}
        self._tenants: dict[str, EvictionPolicy] = {}
        self._keys: dict[bytes, tuple[str, int, int]] = {}
        """Resident key -> (tenant, or "" for none; rank; size)."""
        self.bytes: Counter[str] = Counter()
        """Resident bytes by tenant ("" for keys under none)."""
        self._arriving: tuple[str, int] | None = None
        """(tenant, size) of the insert `admit` let in and the evictions before it make room for."""
        self.quota_evictions: Counter[str] = Counter()
        """Victims given because their tenant was over (or at) its quota, by tenant."""
        self.hits: Counter[str] = Counter()
        """Hits in this tier, by tenant."""
        self.evictions: Counter[str] = Counter()
        """Keys evicted from this tier, by tenant."""
        self._offered: bytes | None = None
        """The last victim named (`victim`, `excess`): its on_evict is an eviction; any other, a replacement."""

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    # Events.

    def on_insert(self, key: bytes, size: int) -> None:
        self._arriving = None
        known = self._keys.get(key)
        if known is None:
            tenant = self._shares.tenant_of(key)
            name, rank = (tenant.name, tenant.rank) if tenant is not None else ("", _NORMAL)
        else:
            name, rank, old = known
            self.bytes[name] -= old
        self._keys[key] = (name, rank, size)
        self.bytes[name] += size
        self._rank(rank).on_insert(key, size)
        if name:
            self._tenant(name).on_insert(key, size)

    def on_access(self, key: bytes) -> None:
        known = self._keys.get(key)
        if known is None:
            return
        name, rank, _ = known
        self.hits[name] += 1
        self._ranks[rank].on_access(key)
        if name:
            self._tenants[name].on_access(key)

    def on_evict(self, key: bytes) -> None:
        self._leave(key, evicted=True)

    def on_delete(self, key: bytes) -> None:
        self._leave(key, evicted=False)

    def _leave(self, key: bytes, *, evicted: bool) -> None:
        known = self._keys.pop(key, None)
        if known is None:
            if not evicted:  # a held key's delete: its history goes (unknown keys are ignored)
                for policy in (*self._ranks.values(), *self._tenants.values()):
                    policy.on_delete(key)
            return
        name, rank, size = known
        self.bytes[name] -= size
        if evicted and key == self._offered:
            self.evictions[name] += 1  # not a put's replacement, which leaves by on_evict too (history kept)
            self._offered = None
        policies = [self._ranks[rank], *([self._tenants[name]] if name else [])]
        for policy in policies:
            if evicted:
                policy.on_evict(key)
            else:
                policy.on_delete(key)

    # Decisions.

    def admit(self, key: bytes, size: int, full: bool) -> bool:
        """Whether `key` (`size` bytes) may come into the tier; `full`: only by evicting. Remembers the insert,
        so the victims that make room for it are its tenant's own when it is at its quota."""
        tenant = self._shares.tenant_of(key)
        name, rank = (tenant.name, tenant.rank) if tenant is not None else ("", _NORMAL)
        known = self._keys.get(key)
        growth = size - (known[2] if known is not None else 0)
        quota = self._shares.quota(name, self._tier) if name else 0
        if quota and size > quota:
            return False  # larger than its whole quota here
        self._arriving = (name, growth)
        if not full or (quota and self.bytes[name] + growth > quota):
            return True  # room, or room from its own keys
        if rank == _HIGH or self._over_quota() is not None:
            return True
        lowest = self._lowest_rank()
        return lowest is None or lowest < _HIGH

    def victim(self) -> bytes | None:
        self._offered = self._victim()
        return self._offered

    def _victim(self) -> bytes | None:
        arriving = self._arriving
        if arriving is not None and arriving[0]:
            name, growth = arriving
            quota = self._shares.quota(name, self._tier)
            if quota and self.bytes[name] + growth > quota:
                own = self._tenants[name].victim() if name in self._tenants else None
                if own is not None:
                    self.quota_evictions[name] += 1
                    return own
        over = self._over_quota()
        if over is not None:
            self.quota_evictions[over] += 1
            return self._tenants[over].victim()
        lowest = self._lowest_rank()
        return None if lowest is None else self._ranks[lowest].victim()

    def excess(self) -> bytes | None:
        """A key of a tenant over its quota in this tier (its own policy's victim); None when none is over."""
        over = self._over_quota()
        if over is None:
            return None
        self.quota_evictions[over] += 1
        self._offered = self._tenants[over].victim()
        return self._offered

    def quotas(self) -> dict[str, int]:
        """Each tenant's quota in this tier on this node (bytes), for those that have one."""
        shares, tier = self._shares, self._tier
        return {name: quota for name in shares.names() if (quota := shares.quota(name, tier))}

    def _over_quota(self) -> str | None:
        """The tenant furthest over its quota here (with keys to give), or None."""
        worst, by = None, 0
        for name, policy in self._tenants.items():
            quota = self._shares.quota(name, self._tier)
            if quota and self.bytes[name] - quota > by and len(policy):
                worst, by = name, self.bytes[name] - quota
        return worst

    def _lowest_rank(self) -> int | None:
        for rank in sorted(self._ranks):
            if len(self._ranks[rank]):
                return rank
        return None

    def _rank(self, rank: int) -> EvictionPolicy:
        policy = self._ranks.get(rank)
        if policy is None:
            policy = self._ranks[rank] = self._make()
        return policy

    def _tenant(self, name: str) -> EvictionPolicy:
        policy = self._tenants.get(name)
        if policy is None:
            policy = self._tenants[name] = self._make()
        return policy


class TenantReads:
    """Demand reads by tenant (subscribed to the engine's read feed): with the tiers' hits, the misses."""

    def __init__(self, shares: TenantShares) -> None:
        self._shares = shares
        self.reads: Counter[str] = Counter()

    def on_read(self, keys: Sequence[bytes]) -> None:
        if not self._shares:
            return
        for key in keys:
            tenant = self._shares.tenant_of(key)
            if tenant is not None:
                self.reads[tenant.name] += 1


def tenant_counters(policies: Sequence[tuple[str, TenantPolicy]], reads: TenantReads) -> dict[str, int]:
    """Each tenant's figures as Stats counters: "tenant_{bytes,hits,evictions}/TIER/NAME", "tenant_misses/NAME"
    (its demand reads no tier answered), and "tenant_quota/TIER/NAME" (its quota on this node, for a tenant with
    one). Keys under no tenant are left out."""
    counters: dict[str, int] = {}
    hits: Counter[str] = Counter()
    for tier, policy in policies:
        # Copies first (one C call each): the engine changes them under its lock while a scrape reads them.
        tier_hits = dict(policy.hits)
        for what, by_tenant in (
            ("bytes", dict(policy.bytes)),
            ("hits", tier_hits),
            ("evictions", dict(policy.evictions)),
            ("quota", policy.quotas()),
        ):
            for name, value in by_tenant.items():
                if name:
                    counters[f"tenant_{what}/{tier}/{name}"] = max(0, value)
        hits.update(tier_hits)
    for name, read in dict(reads.reads).items():
        counters[f"tenant_misses/{name}"] = max(0, read - hits[name])
    return counters
