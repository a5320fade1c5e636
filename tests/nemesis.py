"""A Jepsen-style workload over a real cluster: writers that own their keys, readers, a nemesis, and a checker.

`JepsenCluster` starts a one-node metadata shard and cache servers that share
one S3 prefix (as `conftest.running_cluster` does); one of them, X, is
reached by clients and peers only through a `fault_proxy.FaultProxy` (it
registers that address, `--advertise`) and reaches the shard only through
another, so `cut()` takes it off the network both ways (`Fault.DOWN`: connects
refused, open connections reset) while it keeps running, and `heal()` lets it
back. The nemesis (`Nemesis`) SIGKILLs a server and restarts it on its L2,
joins a new server, drains one and puts it back, and cuts X off and heals it.

`Workload` runs writers (each owns its keys, write-through `wt/` and
write-back `wb/`; every put writes the next version, `versioned.value_of`) and
readers (`get` and `get_many` through routing clients) and records every
operation with its call and return times (`time.monotonic`). `History.check`
splits the history by key and checks each key as a register:

* a read returns bytes of a version of its key (byte for byte);
* a read that began after `put(K, v)` returned gives v or later, never older
  and never a miss (stale);
* the per-key history is linearizable (`linearizability.kv_model`): readers
  agree on one order;

and the final state (read once the load stopped and every write-back value is
uploaded) is the last acknowledged version of each key, through the cache and
through S3 alone (boto3 against SeaweedFS). Every offending operation is
printed with its key, kind, value and times.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import random
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fault_proxy import Fault, FaultProxy
from versioned import LARGE, value_of

from cacheclient import CacheClient, CacheClientError
from cacheclient.meta import MetaClient
from cacheclient.torch import CachedDataset
from cachesvc.devcluster.shard import LocalShard

from conftest import CacheServer, S3Server, s3_args, wait_until
from linearizability import CheckResult, KvInput, Operation, check_operations, kv_model

__all__ = ["History", "JepsenCluster", "Nemesis", "Op", "Workload"]

MAX_BYTES = 6_000
"""Values are 64 bytes to this much more (`value_of`): small, so many operations fit in a short run."""
LARGE_EVERY = 5
"""One key in this many takes large values (`versioned.LARGE`): files of their own in L2."""


NAMESPACES = """
[[namespaces]]
prefix = "wt/"
write_mode = "write-through"

[[namespaces]]
prefix = "wb/"
write_mode = "write-back"
"""


# ---------------------------------------------------------------------- the cluster


class JepsenCluster:
    """A one-node shard, `servers` cache servers (server 0 is X, behind fault proxies) and one S3 prefix."""

    def __init__(self, s3: S3Server, base: Path, servers: int = 3, lease_seconds: float = 2.0) -> None:
        self.s3 = s3
        self.base = base
        self.prefix = f"jepsen/{uuid.uuid4().hex[:8]}/"
        self.config = base / "cachesvc.toml"
        self.config.write_text(NAMESPACES)
        # One metadata node: X's shard client then never follows a leader hint (a node's own address).
        self.shard = LocalShard(1, base / "meta", args=["--lease-seconds", str(lease_seconds)])
        # Shared L1: clients on this machine read and write each key through its owner's arena and staging
        # areas (cacheclient.colocated), not over gRPC, so the history checks the co-located path too.
        self.env = {"CACHESVC_META_HEARTBEAT_SECONDS": "0.3", "CACHESVC_L1_SHARED": "true"}
        self.servers: list[CacheServer] = []
        self.proxies: list[FaultProxy] = []
        self._count = servers
        self.out: set[str] = set()  # drained or cut off: running, but not in the placement
        self.meta: MetaClient | None = None
        self.x: CacheServer | None = None
        self.front: FaultProxy | None = None

    def _args(self, i: int, meta: list[str]) -> list[str]:
        return [
            "--config", str(self.config), "--l1-bytes", "4MiB",
            "--l2-path", str(self.base / f"l2-{i}"), "--l2-bytes", "64MiB",
            "--meta", ",".join(meta), *s3_args(self.s3, self.prefix),
        ]  # fmt: skip

    def start(self) -> JepsenCluster:
        self.shard.start()
        self.shard.leader(timeout=20.0)
        self.meta = MetaClient(self.shard.addresses, timeout=5.0)
        x = self.x = CacheServer([], self.base / "logs", self.env)
        self.front = FaultProxy(x.address).start()
        to_meta = [FaultProxy(a).start() for a in self.shard.addresses]
        self.proxies = [self.front, *to_meta]
        x.args = [*self._args(0, [_hostport(p) for p in to_meta]), "--advertise", _hostport(self.front)]
        self.servers.append(x.start())
        for _ in range(1, self._count):
            self.join(wait=False)
        self.wait_placement()
        return self

    def address(self, server: CacheServer) -> str:
        """The address `server` registered (X's: its front proxy's)."""
        if server is self.x and self.front is not None:
            return _hostport(self.front)
        return server.address

    def running(self) -> list[CacheServer]:
        return [s for s in self.servers if s.process is not None and s.process.alive()]

    def expected(self) -> list[str]:
        """The addresses the placement should name: every running server not drained or cut."""
        return sorted(self.address(s) for s in self.running() if self.address(s) not in self.out)

    def placement_nodes(self) -> list[str]:
        assert self.meta is not None
        try:
            return sorted(self.meta.placement(refresh=True).nodes)
        except CacheClientError:
            return []

    def wait_placement(self, timeout: float = 30.0) -> None:
        wait_until(lambda: self.placement_nodes() == self.expected(), timeout, f"the placement {self.expected()}", 0.1)

    def join(self, wait: bool = True) -> CacheServer:
        i = len(self.servers)
        server = CacheServer(self._args(i, self.shard.addresses), self.base / "logs", self.env).start()
        self.servers.append(server)
        if wait:
            self.wait_placement()
        return server

    def client(self, **kwargs: Any) -> CacheClient:
        kwargs.setdefault("timeout", 10.0)
        return CacheClient(meta=",".join(self.shard.addresses), **kwargs)

    def counter(self, name: str) -> int:
        """The sum of a counter over the running servers (those killed and restarted counted since)."""
        total = 0
        for server in self.running():
            with CacheClient(server.address, timeout=10.0) as plain:
                total += int(plain.stats()["counters"].get(name, 0))
        return total

    def dirty(self) -> int:
        return self.counter("dirty_keys")

    def s3_get(self, key: bytes) -> bytes | None:
        client = self.s3.client()
        try:
            return bytes(client.get_object(Bucket=self.s3.bucket, Key=self.prefix + key.decode())["Body"].read())
        except client.exceptions.NoSuchKey:
            return None

    def stop(self) -> None:
        for server in self.servers:
            if server.process is not None and server.process.alive():
                server.stop(grace=10.0)
        for proxy in self.proxies:
            proxy.stop()
        if self.meta is not None:
            self.meta.close()
        self.shard.stop()

    # -- faults ---------------------------------------------------------------

    def kill_restart(self, server: CacheServer, down: float = 0.5) -> None:
        server.kill()
        time.sleep(down)
        server.start()  # on its L2
        self.wait_placement()

    def drain(self, server: CacheServer) -> None:
        assert self.meta is not None
        self.out.add(self.address(server))
        self.meta.set_node_state(self.address(server), "draining")
        self.wait_placement()

    def undrain(self, server: CacheServer) -> None:
        assert self.meta is not None
        self.out.discard(self.address(server))
        self.meta.set_node_state(self.address(server), "up")
        self.wait_placement()

    def blink(self, server: CacheServer, out: float = 0.15) -> None:
        """Drains `server` and puts it back `out` seconds later, within one of its placement fetches (every
        0.3 s here): it may never see the map of its drain, while its stand-in and clients do."""
        assert self.meta is not None
        self.meta.set_node_state(self.address(server), "draining")
        time.sleep(out)
        self.meta.set_node_state(self.address(server), "up")
        self.wait_placement()

    def alive(self, server: CacheServer) -> None:
        """Raises, with its log's tail, if `server` exited (the nemesis kills by SIGKILL and restarts at once)."""
        if server.process is None or not server.process.alive():
            raise RuntimeError(f"cache server {server.address} exited:\n{server.log() if server.process else ''}")

    def cut(self) -> None:
        assert self.x is not None
        self.alive(self.x)
        self.out.add(self.address(self.x))
        for proxy in self.proxies:
            proxy.set(Fault.DOWN)
        self.wait_placement()  # the shard dropped X after its lease

    def restore(self) -> None:
        """Ends every fault still on: X healed, drained servers put back."""
        for server in self.servers:
            if self.address(server) in self.out and server is self.x:
                self.heal()
            elif self.address(server) in self.out:
                self.undrain(server)

    def heal(self) -> None:
        assert self.x is not None
        for proxy in self.proxies:
            proxy.clear()
        self.out.discard(self.address(self.x))
        self.wait_placement()


# ---------------------------------------------------------------------- the history


@dataclass(frozen=True, slots=True)
class Op:
    """One operation on one key: a put of `version` or a get that returned `version` (None: a miss).

    `ret` is `math.inf` for a put whose outcome is unknown (it raised).
    """

    client: int
    kind: str
    key: bytes
    version: int | None
    call: float
    ret: float
    note: str = ""

    def __str__(self) -> str:
        ret = "never" if self.ret == math.inf else f"{self.ret:.3f}"
        value = "miss" if self.version is None else f"v{self.version}"
        return f"{self.key.decode()} {self.kind} {value} by {self.client} [{self.call:.3f} -> {ret}]{self.note}"


@dataclass
class History:
    """Operations, appended by many threads; `check` judges them."""

    ops: list[Op] = field(default_factory=list)
    wrong_bytes: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, op: Op) -> None:
        with self._lock:
            self.ops.append(op)

    def by_key(self) -> dict[bytes, list[Op]]:
        keys: dict[bytes, list[Op]] = defaultdict(list)
        for op in self.ops:
            keys[op.key].append(op)
        return keys

    def stale(self) -> list[tuple[Op, Op]]:
        """(read, the put it missed): reads that began after a put of a newer version returned."""
        found = []
        for ops in self.by_key().values():
            acked = sorted((op.ret, i) for i, op in enumerate(ops) if op.kind == "put" and op.ret < math.inf)
            ends = [ret for ret, _ in acked]
            newest: list[int] = []  # newest[j]: the index of the highest version among the first j + 1 returned
            for _, i in acked:
                newest.append(i if not newest or (ops[i].version or 0) > (ops[newest[-1]].version or 0) else newest[-1])
            for read in (op for op in ops if op.kind == "get"):
                j = bisect.bisect_left(ends, read.call)
                if j == 0:
                    continue
                put = ops[newest[j - 1]]
                if read.version is None or read.version < (put.version or 0):
                    found.append((read, put))
        return found

    def linearizable(self, max_steps: int = 20_000_000) -> tuple[CheckResult, list[Op]]:
        """The per-key register check of `linearizability`; for ILLEGAL, the operations of the failing key."""
        ops = [_operation(op, op.ret) for op in self.ops]
        result, part = check_operations(kv_model(), ops, max_steps=max_steps)
        if result is not CheckResult.ILLEGAL:
            return result, []
        key = part[0].input.key.encode()
        return result, [op for op in self.ops if op.key == key]

    @staticmethod
    def first_illegal(ops: Sequence[Op], max_steps: int = 2_000_000) -> Op | None:
        """The operation of a not-linearizable key's history whose return makes it so: the earliest return time
        t at which the operations returned by t (and the puts called by then, of unknown outcome) admit no
        order. Where the failure lies when no read was stale (two readers that saw a put under way in
        opposite orders: new, then old). None when the whole history checks (or past `max_steps`)."""

        def illegal(t: float) -> bool:
            upto = [_operation(op, op.ret) for op in ops if op.ret <= t]
            upto += [_operation(op, math.inf) for op in ops if op.kind == "put" and op.call <= t < op.ret]
            return check_operations(kv_model(), upto, max_steps=max_steps)[0] is CheckResult.ILLEGAL

        ends = sorted({op.ret for op in ops if op.ret < math.inf})
        if not ends or not illegal(ends[-1]):
            return None
        low, high = 0, len(ends) - 1  # illegal(ends[high]); the answer is the least such index
        while low < high:
            mid = (low + high) // 2
            if illegal(ends[mid]):
                high = mid
            else:
                low = mid + 1
        return next(op for op in ops if op.ret == ends[low])

    def dump(self, path: Path) -> None:
        """One JSON object per operation (`math.inf` as null), in the order they were recorded."""
        with path.open("w") as out:
            for op in self.ops:
                row = asdict(op) | {"key": op.key.decode(), "ret": None if op.ret == math.inf else op.ret}
                out.write(json.dumps(row) + "\n")

    @classmethod
    def load(cls, path: Path) -> History:
        history = cls()
        for line in path.read_text().splitlines():
            row = json.loads(line)
            row |= {"key": row["key"].encode(), "ret": math.inf if row["ret"] is None else row["ret"]}
            history.ops.append(Op(**row))
        return history

    def counts(self) -> Counter[str]:
        return Counter(f"{op.kind}s" if op.kind == "put" and op.ret < math.inf else
                       "puts_unknown" if op.kind == "put" else "reads" for op in self.ops)  # fmt: skip


def _operation(op: Op, ret: float) -> Operation:
    """`op` for the checker (`linearizability.kv_model`), returning at `ret` (`math.inf`: outcome unknown)."""
    return Operation(op.client, KvInput(op.kind, op.key.decode(), op.version), op.call, op.version, ret)


# ---------------------------------------------------------------------- the load


def _version_of(key: bytes, value: bytes) -> tuple[int | None, str]:
    """The version `value` is of `key`, and what is wrong with its bytes ("" when nothing)."""
    head = key + b"|"
    if not value.startswith(head):
        return None, f"{key!r}: {len(value)} bytes of no version of this key: {bytes(value[:40])!r}"
    end = value.find(b"|", len(head))
    try:
        version = int(value[len(head) : end])
    except ValueError:
        return None, f"{key!r}: an unreadable version: {bytes(value[:40])!r}"
    if value != value_of(key, version, MAX_BYTES):
        return version, f"{key!r}: version {version} with wrong bytes ({len(value)} bytes)"
    return version, ""


class Workload:
    """Writer threads (each owns `keys_per_writer` keys, half `wt/`, half `wb/`), reader threads, and one
    reader of the owners' L2 files as a dataset on the servers' machine reads them (`local_reads`)."""

    def __init__(self, cluster: JepsenCluster, writers: int, readers: int, keys_per_writer: int, seed: int) -> None:
        self.cluster = cluster
        self.history = History()
        self.owned = [
            [
                b"%s%s%d-%03d" % (b"wb/" if k % 2 else b"wt/", LARGE if k % LARGE_EVERY == 0 else b"", w, k)
                for k in range(keys_per_writer)
            ]
            for w in range(writers)
        ]
        self.keys = [k for keys in self.owned for k in keys]
        self.sent: dict[bytes, int] = {}
        self.acked: dict[bytes, int] = {}
        self.failed: Counter[str] = Counter()
        self.file_reads = 0
        """Values the L2-file reader read straight from an owner's file (its misses are not reads)."""
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._write, args=(w, keys, random.Random(seed * 100 + w)), daemon=True)
            for w, keys in enumerate(self.owned)
        ] + [
            threading.Thread(target=self._read, args=(writers + r, random.Random(seed * 100 + 50 + r)), daemon=True)
            for r in range(readers)
        ]
        self._threads.append(
            threading.Thread(
                target=self._read_files, args=(writers + readers, random.Random(seed * 100 + 99)), daemon=True
            )
        )

    def __enter__(self) -> Workload:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60.0)

    def _write(self, me: int, keys: list[bytes], rng: random.Random) -> None:
        client = self.cluster.client()
        try:
            while not self._stop.is_set():
                key = rng.choice(keys)
                version = self.sent[key] = self.sent.get(key, 0) + 1
                call = time.monotonic()
                try:
                    client.put(key, value_of(key, version, MAX_BYTES))
                except CacheClientError as exc:
                    self.history.add(Op(me, "put", key, version, call, math.inf, f" ({type(exc).__name__})"))
                    with self._lock:
                        self.failed["puts"] += 1
                    time.sleep(0.05)
                    continue
                self.history.add(Op(me, "put", key, version, call, time.monotonic()))
                self.acked[key] = version
        finally:
            client.close()

    def _read(self, me: int, rng: random.Random) -> None:
        client = self.cluster.client()
        try:
            while not self._stop.is_set():
                wanted = rng.sample(self.keys, rng.choice((1, 1, 8)))
                call = time.monotonic()
                try:
                    values = client.get_many(wanted) if len(wanted) > 1 else [client.get(wanted[0])]
                except CacheClientError:
                    with self._lock:
                        self.failed["reads"] += 1
                    time.sleep(0.05)
                    continue
                ret = time.monotonic()
                for key, value in zip(wanted, values, strict=True):
                    self.record_read(me, key, value, call, ret)
        finally:
            client.close()

    def _read_files(self, me: int, rng: random.Random) -> None:
        """Reads keys from their owners' L2 files directly, as a dataset on the servers' machine does."""
        client = self.cluster.client()
        source = CachedDataset(self.keys, cache=client, local_reads=True, fallback=False)._source
        try:
            while not self._stop.is_set():
                wanted = rng.sample(self.keys, 8)
                call = time.monotonic()
                try:
                    values = source.local_get(wanted)
                except CacheClientError:
                    time.sleep(0.05)  # the placement map could not be fetched
                    continue
                ret = time.monotonic()
                for key, value in zip(wanted, values, strict=True):
                    if value is not None:
                        self.file_reads += 1
                        self.record_read(me, key, value, call, ret, " (L2 file)")
                time.sleep(0.005)
        finally:
            client.close()

    def record_read(self, me: int, key: bytes, value: bytes | None, call: float, ret: float, note: str = "") -> None:
        version: int | None = None
        if value is not None:
            version, wrong = _version_of(key, bytes(value))
            if wrong:
                with self._lock:
                    self.history.wrong_bytes.append(wrong)
                if version is None:
                    return
        self.history.add(Op(me, "get", key, version, call, ret, note))

    def final(self) -> dict[str, list[str]]:
        """Once the load stopped: every key read through a fresh routing client and from S3 alone.

        Returns what is wrong, by where it was read: a key whose last put was
        acknowledged must read that version; one whose last put failed, the last
        acknowledged version or one sent after it.
        """
        wait_until(lambda: self.cluster.dirty() == 0, 90.0, "every write-back value uploaded", 0.2)
        wrong: dict[str, list[str]] = {"cache": [], "s3": []}
        with self.cluster.client(timeout=30.0) as client:
            cached = client.get_many(self.keys)
        for where, values in (("cache", cached), ("s3", [self.cluster.s3_get(k) for k in self.keys])):
            now = time.monotonic()
            for key, value in zip(self.keys, values, strict=True):
                acked, sent = self.acked.get(key, 0), self.sent.get(key, 0)
                version, bad = _version_of(key, bytes(value)) if value is not None else (None, "")
                if bad:
                    wrong[where].append(bad)
                elif (version or 0) < acked or (version or 0) > sent:
                    got = "a miss" if version is None else f"v{version}"
                    wrong[where].append(f"{key.decode()}: {got} at the end, v{acked} acknowledged, v{sent} sent")
                if where == "cache":
                    self.record_read(-1, key, value, now, now, " (final)")
        return wrong


# ---------------------------------------------------------------------- the nemesis


class Nemesis(threading.Thread):
    """Runs `steps` (name, action) one after the other, `pause` seconds apart, until told to stop or done.

    `stop()` lets the step under way finish (a restarted server serving, a healed one back in the placement).
    """

    def __init__(self, steps: Iterable[tuple[str, Callable[[], None]]], pause: tuple[float, float], seed: int) -> None:
        super().__init__(name="nemesis", daemon=True)
        self.steps = steps
        self.pause = pause
        self.rng = random.Random(seed)
        self.done: list[tuple[str, float, float]] = []
        self.error: BaseException | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            for name, action in self.steps:
                if self._stop_event.wait(self.rng.uniform(*self.pause)):
                    return
                began = time.monotonic()
                action()
                self.done.append((name, began, time.monotonic() - began))
        except BaseException as exc:  # reported by the test
            self.error = exc

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=120.0)


def nemesis_cycle(cluster: JepsenCluster, rounds: int | None) -> Iterator[tuple[str, Callable[[], None]]]:
    """Per round: SIGKILL and restart a server (on its L2), join one (the first round), drain one and put it back,
    cut X off and heal it, and drain one and put it back at once (`blink`). `rounds`
    None: round after round until the nemesis is stopped."""
    for r in itertools.count() if rounds is None else range(rounds):
        victim = cluster.servers[1 + r % (len(cluster.servers) - 1)]
        yield f"kill+restart {victim.address}", lambda v=victim: cluster.kill_restart(v)
        if r == 0:
            yield "join", lambda: _ignore(cluster.join())
        drained = cluster.servers[1 + (r + 1) % (len(cluster.servers) - 1)]
        yield f"drain {drained.address}", lambda d=drained: cluster.drain(d)
        yield f"undrain {drained.address}", lambda d=drained: cluster.undrain(d)
        yield "cut X", cluster.cut
        yield "heal X", cluster.heal
        # A drain undone within one of the servers' fetches (the node never sees the map of its drain).
        blinked = cluster.servers[1 + r % (len(cluster.servers) - 1)]
        yield f"blink {blinked.address}", lambda b=blinked: cluster.blink(b)


def report(cluster: JepsenCluster, load: Workload, wrong_final: dict[str, list[str]], nemesis: Nemesis | None,
           seconds: float, check_linearizable: bool = True) -> tuple[str, list[str]]:  # fmt: skip
    """The summary line and the list of problems (empty: the run passed)."""
    history = load.history
    stale = history.stale()
    problems: list[str] = []
    problems += [f"wrong bytes: {w}" for w in history.wrong_bytes[:20]]
    for read, put in stale[:30]:
        problems.append(f"stale read: {read}  (after {put})")
    for where, lines in wrong_final.items():
        problems += [f"lost ({where}): {line}" for line in lines[:20]]
    verdict = "not checked"
    if check_linearizable:
        result, ops = history.linearizable()
        verdict = result.value
        if result is CheckResult.ILLEGAL:
            ops = sorted(ops, key=lambda o: o.call)
            # Around the first stale read of this key when there is one (the interesting part), else around the
            # operation whose return made the history illegal.
            stale_read = next((read for read, _ in stale if read.key == ops[0].key), None)
            culprit = history.first_illegal(ops) if stale_read is None else None
            at = (stale_read or culprit or ops[0]).call
            first = max(0, bisect.bisect_left([o.call for o in ops], at) - 50)
            problems.append(f"not linearizable: key {ops[0].key.decode()}; its operations in call order from #{first}:")
            problems += [f"    {op}" for op in ops[first : first + 60]]
            if culprit is not None:
                problems.append(f"  no order admits the operations returned by {culprit.ret:.3f}: the last, {culprit}")
    if stale and nemesis is not None:
        after: Counter[str] = Counter()
        for read, _ in stale:
            began = [name for name, at, _ in nemesis.done if at <= read.call]
            after[began[-1] if began else "before the first fault"] += 1
        problems.append(f"stale reads by the nemesis step they followed: {dict(after)}")
        spaces = Counter(read.key.split(b"/", 1)[0].decode() + "/" for read, _ in stale)
        problems.append(f"stale reads by namespace: {dict(spaces)}")
    counts = history.counts()
    steps = ", ".join(f"{name} ({at:.3f}, {took:.1f}s)" for name, at, took in (nemesis.done if nemesis else []))
    summary = (
        f"{seconds:.0f}s, {len(history.ops)} operations ({counts['puts']} puts acknowledged, "
        f"{counts['puts_unknown']} unknown, {counts['reads']} reads checked, {load.failed['reads']} reads failed); "
        f"{load.file_reads} read from L2 files; {len(stale)} stale reads; "
        f"lost: {len(wrong_final['cache'])} through the cache, "
        f"{len(wrong_final['s3'])} in S3; "
        f"wrong bytes {len(history.wrong_bytes)}; linearizable: {verdict}; nemesis: {steps or 'none'}"
    )
    return summary, problems


def _ignore(_: object) -> None:
    pass


def _hostport(proxy: FaultProxy) -> str:
    return proxy.endpoint.removeprefix("http://")
