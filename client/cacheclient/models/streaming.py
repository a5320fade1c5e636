"""`stream_parameters`: a model running while its parameters stream from the cache, ahead of use.

Inside `with stream_parameters(model, cache, name, budget_bytes=...)` the
model (or its `generate`) runs as usual while its parameters live in the
cache. Forward pre-hooks record the order in which modules run; that order,
round and round (one forward after another), is the plan. A fetcher thread
reads the next modules' values while the current module computes, holding
at most `budget_bytes` of parameters: when room is needed it drops what is
used again furthest away, and it fetches ahead only when that drops nothing
needed sooner (`cacheclient._residency`). A forward whose order differs from
the plan is still served, each module loading what it needs, and its order
becomes the new plan. Results are bit-identical to the model with every
parameter local. A value that is missing or corrupt raises
`ParameterValueError`, naming the module, when that module runs.

The server follows too: a `cacheclient.plans.FollowedPlan` keeps a prefetch
plan on the server one forward ahead of the model, so it reads values from
object storage before the client asks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from cacheclient._residency import ABSENT, FETCHING, READY, Residency
from cacheclient.client import CacheClient
from cacheclient.models.manifest import ModelManifest, read_manifest
from cacheclient.models.values import Bound, BufferPool, Held, fetch_units, tensor_slots
from cacheclient.plans import FollowedPlan, Plan
from cacheclient.wire import tensors as records

__all__ = ["ParameterStream", "stream_parameters"]

log = logging.getLogger(__name__)


@dataclass
class _Counters:
    forwards: int = 0
    recordings: int = 0
    diverged: int = 0
    hits: int = 0
    late: int = 0
    loaded_on_demand: int = 0
    fetched_ahead: int = 0
    fetched_bytes: int = 0
    dropped: int = 0
    stall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class ParameterStream:
    """A model running while its parameters stream from the cache; made by `stream_parameters`.

    Attributes read while it runs: `stats` (counters), `order` (the module
    paths of the recorded execution order), `plan` (that order as a `Plan`).
    """

    def __init__(
        self,
        model: nn.Module,
        cache: CacheClient,
        manifest: ModelManifest,
        *,
        budget_bytes: int | None,
        lookahead: int | None,
        window_bytes: int | None,
        fetch_bytes: int,
        device: torch.device,
        server_window_bytes: int,
    ) -> None:
        self._ABSENT, self._FETCHING, self._READY = ABSENT, FETCHING, READY
        self.model = model
        self.cache = cache
        self.manifest = manifest
        self.device = device
        self._bound = Bound(model, manifest)
        self._bound.check_kept()
        sizes = [entry.nbytes for entry in manifest.modules]
        largest = max((sum(sizes[u] for u in needs) for needs in self._bound.needs), default=0)
        self.budget_bytes = budget_bytes if budget_bytes is not None else max(sum(sizes), 1)
        if self.budget_bytes < largest:
            raise ValueError(
                f"budget_bytes={self.budget_bytes} is less than the largest module's parameters ({largest} bytes)"
            )
        self._core = Residency(sizes, self.budget_bytes, window_bytes)
        self._lookahead = lookahead
        self._fetch_bytes = fetch_bytes
        self._cond = threading.Condition()
        self._held: dict[int, Held] = {}
        self._pool = BufferPool(self.budget_bytes)
        self._errors: dict[int, BaseException] = {}
        self._counters = _Counters()
        hooked = [i for i, needs in enumerate(self._bound.needs) if needs]
        # The first forward runs in registration order, the best guess before one is recorded.
        self._order: list[int] = hooked
        self._core.set_steps([self._bound.needs[i] for i in self._order])
        self._recorded: list[int] = []
        self._expect = 0
        self._depth = 0
        self._closed = False
        self._placeholders = self._offload()
        self._handles: list[Any] = []
        self._handles.append(model.register_forward_pre_hook(self._forward_starts))
        for i in hooked:
            module = self._bound.modules[i]
            self._handles.append(module.register_forward_pre_hook(functools.partial(self._module_starts, i)))
            self._handles.append(
                module.register_forward_hook(functools.partial(self._module_ends, i), always_call=True)
            )
        self._handles.append(model.register_forward_hook(self._forward_ends, always_call=True))
        self._server: FollowedPlan | None = None
        if server_window_bytes > 0:
            self._server = FollowedPlan(cache, manifest.name, server_window_bytes)
            self._server.restart(*self._passes())
        self._fetcher: threading.Thread | None = None
        if lookahead is None or lookahead > 0:
            self._fetcher = threading.Thread(target=self._fetch_ahead, name="parameter-prefetch", daemon=True)
            self._fetcher.start()

    def _passes(self) -> tuple[Plan, Plan]:
        """The planned order as two `Plan`s of keys, a step per module: every module's keys, and the
        streamed modules' (the kept ones are read once, then stay with the client)."""
        with self._cond:
            steps = list(self._core.steps)
            kept = self._core.kept
        sizes: dict[bytes, int] = {}
        every: list[list[bytes]] = []
        streamed: list[list[bytes]] = []
        for needs in steps:
            every.append([])
            streamed.append([])
            for unit in needs:
                entry = self.manifest.modules[unit]
                sizes.update(entry.part_sizes())
                every[-1].extend(entry.keys)
                if unit not in kept:
                    streamed[-1].extend(entry.keys)
        return Plan(every, sizes=sizes), Plan(streamed, sizes=sizes)

    # -- the model's tensors --

    def _offload(self) -> list[dict[tuple[int, str], torch.Tensor]]:
        """Puts a meta tensor in place of every stored tensor (freeing the model's own); those placeholders."""
        placeholders: list[dict[tuple[int, str], torch.Tensor]] = []
        for targets in self._bound.targets:
            held: dict[tuple[int, str], torch.Tensor] = {}
            for module, kind, name, _ in targets:
                tensors = tensor_slots(module, kind)
                current = tensors[name]
                empty = torch.empty(current.shape, dtype=current.dtype, device="meta")
                meta = nn.Parameter(empty, requires_grad=False) if kind == records.PARAMETER else empty
                held[(id(module), name)] = meta
                tensors[name] = meta
            placeholders.append(held)
        return placeholders

    def _drop(self, units: Iterable[int], *, evicted: bool = True) -> None:
        """Lets go of units' tensors: their places get the meta placeholders back, their buffers go to the pool."""
        for unit in units:
            for module, kind, name, _ in self._bound.targets[unit]:
                tensor_slots(module, kind)[name] = self._placeholders[unit][(id(module), name)]
            held = self._held.pop(unit, None)
            if held is not None and held.buffer is not None:
                buffer = held.buffer
                del held  # the views go first, so the pool can tell whether anything else holds the buffer
                self._pool.give(buffer)
            self._counters.dropped += evicted

    # -- hooks (the model's thread) --

    def _forward_starts(self, module: nn.Module, args: Any) -> None:
        with self._cond:
            first = self._depth == 0
            if first:
                self._recorded = []
                self._expect = 0
                self._counters.forwards += 1
            self._depth += 1
        if first and self._server is not None:
            self._server.forward_starts()  # outside the lock: it may start a plan (a round trip)

    def _forward_ends(self, module: nn.Module, args: Any, output: Any) -> None:
        recorded = False
        with self._cond:
            self._depth -= 1
            if self._depth or output is None or not self._recorded:
                return
            if self._recorded != self._order or self._counters.recordings == 0:
                self._order = self._recorded
                self._core.set_steps([self._bound.needs[i] for i in self._order])
                self._counters.recordings += 1
                recorded = True
            else:
                self._core.advance(0)
            self._expect = 0
            self._cond.notify_all()
        if recorded and self._server is not None:
            self._server.follow(*self._passes())

    def _module_starts(self, index: int, module: nn.Module, args: Any) -> None:
        needs = self._bound.needs[index]
        with self._cond:
            if self._depth:
                self._recorded.append(index)
            order = self._order
            if self._expect < len(order) and order[self._expect] == index:
                step: int | None = self._expect
            else:
                step = self._core.find(needs, self._expect % max(len(order), 1)) if order else None
                self._counters.diverged += 1
            if step is not None:
                self._core.advance(step)
                self._expect = step + 1
                if self._server is not None:
                    self._server.reached(step)
            self._cond.notify_all()
            self._acquire(needs)

    def _module_ends(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        with self._cond:
            self._core.unpin(self._bound.needs[index])
            self._cond.notify_all()

    def _acquire(self, needs: tuple[int, ...]) -> None:
        """Holds `needs` for the running module: waits for those on the way, loads those absent. Under the lock."""
        core = self._core
        counted = False
        while True:
            for unit in needs:
                error = self._errors.pop(unit, None)
                if error is not None:
                    raise error
            absent = [u for u in needs if core.state[u] == self._ABSENT]
            waiting = [u for u in needs if core.state[u] == self._FETCHING]
            if not counted:
                self._counters.hits += len(needs) - len(absent) - len(waiting)
                self._counters.late += len(waiting) + (len(absent) if self._fetcher is not None else 0)
                counted = True
            if not absent and not waiting:
                break
            began = time.perf_counter()
            if absent and self._fetcher is None:
                self._drop(core.reserve_now(absent))
                self._counters.loaded_on_demand += len(absent)
                self._cond.release()
                try:
                    fetch_units(self.cache, self.manifest, absent, self.device, self._deliver_unlocked, self._pool.take)
                except Exception:
                    pass  # delivered to the units as errors: raised at the top of the loop
                finally:
                    self._cond.acquire()
            else:
                # The fetcher takes the running step's units first, whatever it is doing next.
                self._cond.wait()
            self._counters.stall_s += time.perf_counter() - began
        core.pin(needs)
        for unit in needs:
            self._bound.install(unit, self._held[unit].tensors)

    # -- fetching --

    def _deliver_unlocked(self, unit: int, result: Held | BaseException | None) -> None:
        with self._cond:
            self._deliver(unit, result)

    def _deliver(self, unit: int, result: Held | BaseException | None) -> None:
        if isinstance(result, Held):
            self._held[unit] = result
            self._core.fetched(unit)
            self._counters.fetched_bytes += self.manifest.modules[unit].nbytes
        else:
            self._core.dropped(unit)
            if result is not None:
                self._errors[unit] = result
        self._cond.notify_all()

    def _fetch_ahead(self) -> None:
        """The fetcher thread: reads what the plan needs next, as the budget allows, until closed."""
        lookahead = self._lookahead if self._lookahead is not None else 1 << 30
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    units, victims = self._core.next_fetch(lookahead, self._fetch_bytes, skip=self._errors)
                    if units:
                        break
                    self._cond.wait()
                self._drop(victims)
                self._counters.fetched_ahead += len(units)
            try:
                fetch_units(self.cache, self.manifest, units, self.device, self._deliver_unlocked, self._pool.take)
            except Exception as exc:
                # Delivered to the units as errors, which the fetcher passes over:
                # the model raises when it needs one of them.
                log.debug("parameter prefetch failed: %s", exc)

    # -- what the caller sees --

    @property
    def order(self) -> list[str]:
        """Module paths in the execution order now planned (registration order before the first forward)."""
        with self._cond:
            return [self.manifest.modules[i].path for i in self._order]

    @property
    def plan(self) -> Plan:
        """The planned execution order as a `Plan` of keys."""
        return Plan.execution_order(self.manifest, self.order)

    @property
    def stats(self) -> dict[str, Any]:
        """Counters: forwards, recordings (orders recorded), diverged (calls off the plan), hits (values
        held when their module ran), late (on the way), loaded_on_demand, fetched_ahead, fetched_bytes,
        dropped, buffers_reused, stall_s (the model's time waiting for values), resident_bytes, peak_resident_bytes,
        budget_bytes, server_plans_started and server_passes_appended (the server plan that follows the forwards)."""
        with self._cond:
            c = self._counters
            return {
                "forwards": c.forwards,
                "recordings": c.recordings,
                "diverged": c.diverged,
                "hits": c.hits,
                "late": c.late,
                "loaded_on_demand": c.loaded_on_demand,
                "fetched_ahead": c.fetched_ahead,
                "fetched_bytes": c.fetched_bytes,
                "dropped": c.dropped,
                "buffers_reused": self._pool.reused,
                "stall_s": round(c.stall_s, 6),
                "resident_bytes": self._core.used,
                "peak_resident_bytes": self._core.peak,
                "budget_bytes": self.budget_bytes,
                "server_plans_started": self._server.started if self._server is not None else 0,
                "server_passes_appended": self._server.extended if self._server is not None else 0,
            }

    def close(self) -> None:
        """Stops fetching, removes the hooks and lets go of every held value (the model is left on `meta`)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self._fetcher is not None:
            self._fetcher.join(60.0)
        for handle in self._handles:
            handle.remove()
        if self._server is not None:
            self._server.close()
        with self._cond:
            held = list(self._held)
            for unit in held:
                self._core.dropped(unit)
            self._drop(held, evicted=False)
            self._pool.clear()


@contextlib.contextmanager
def stream_parameters(
    model: nn.Module,
    cache: CacheClient,
    name: str,
    *,
    budget_bytes: int | None = None,
    lookahead: int | None = None,
    window_bytes: int | None = None,
    fetch_bytes: int = 8 << 20,
    device: str | torch.device = "cpu",
    server_window_bytes: int = 256 << 20,
) -> Iterator[ParameterStream]:
    """Runs `model` inside the block with its parameters streamed from the model saved as `name`.

    On entry every stored tensor of `model` is replaced by a `meta`
    placeholder (build the model on `meta`: nothing is allocated). Calls to
    the model, or its `generate`, then fetch each module's parameters before
    it runs, ahead of time once the order is recorded, while holding at most
    `budget_bytes`. On exit the tensors are `meta` placeholders again.

    Meant for inference (`torch.inference_mode()`): parameters come back with
    `requires_grad=False`, and buffers a forward changes are not written back.
    Tensors read outside their module's forward (`model.lm_head.weight`
    read by another module) are `meta` there.

    Args:
        model: the module saved as `name`, or one of the same structure.
        cache: the cache holding it.
        name: the saved model's name.
        budget_bytes: most bytes of parameters held at once; None: all of them.
            At least the largest module's. A module that runs inside another
            holds both, and the budget gives way rather than fail.
        lookahead: how many modules past the running one to fetch ahead;
            None: as far as the window allows; 0: none, each module fetched
            when it runs (as offload hooks without prefetch do).
        window_bytes: bytes of the budget for modules streamed through it;
            the rest holds a fixed set of modules across forwards (on a loop,
            every byte held is a byte not fetched again). None: the
            largest two consecutive streamed modules' parameters, the least
            that lets one module arrive while the one before it runs.
        fetch_bytes: bytes one fetch of ahead modules reads at most.
        device: where the parameters go.
        server_window_bytes: window of a plan handed to the server, so it reads
            the values from object storage ahead of the client; 0: none. The
            plan follows the forwards (the running one and the next, a pass
            appended at each), so the server's plan-aware eviction keeps a
            stable subset of a model larger than its memory.

    Raises:
        ParameterValueError: no model `name` in the cache; inside the block,
            when a module runs whose value is missing or corrupt.
        ValueError: the model does not match the saved one, or the budget is too small.
    """
    manifest = read_manifest(cache, name)
    stream = ParameterStream(
        model,
        cache,
        manifest,
        budget_bytes=budget_bytes,
        lookahead=lookahead,
        window_bytes=window_bytes,
        fetch_bytes=fetch_bytes,
        device=torch.device(device),
        server_window_bytes=server_window_bytes,
    )
    try:
        yield stream
    finally:
        stream.close()
