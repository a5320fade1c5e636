"""One client process of the soak run (tests/test_soak.py): a seeded mix of every kind of call, checked byte for byte.

    python tests/soak_worker.py META WORKER SEED SECONDS DATASET_KEYS

Prints "ready" once its imports are done, waits for a line on stdin, runs
for SECONDS, then prints one JSON line: calls and errors by kind, wrong
reads (with the first few described), and every call's latency in
milliseconds by kind. Kinds: get, get_many, put, delete (its own keys, in a
write-through and a write-back namespace), plan (a prefetch plan of dataset
keys, read in steps of 4), kv_put and kv_get (KV blocks; every fourth worker).
Dataset keys are `ds/NNNNN`, written by the test as version 1.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections import defaultdict
from typing import Any

from versioned import Versions, check_read, value_of

from cacheclient import CacheClient, CacheClientError

KINDS = ["get", "get_many", "put", "delete", "plan", "kv_put", "kv_get"]
WEIGHTS = [30, 15, 20, 5, 5, 10, 15]


def dataset_key(i: int) -> bytes:
    return b"ds/%05d" % i


class Worker:
    def __init__(self, meta: str, worker: int, seed: int, dataset_keys: int) -> None:
        self.client = CacheClient(meta=meta, timeout=30.0)
        self.rng = random.Random(seed)
        self.dataset = [dataset_key(i) for i in range(dataset_keys)]
        self.own = [b"%s%d-%03d" % (ns, worker, k) for ns in (b"wt/", b"wb/") for k in range(30)]
        self.versions = Versions()
        self.calls: dict[str, int] = defaultdict(int)
        self.errors: dict[str, int] = defaultdict(int)
        self.error_messages: list[str] = []
        self.wrong: list[str] = []
        self.values_verified = 0
        self.latency_ms: dict[str, list[float]] = defaultdict(list)
        self.kv: Any = None
        if worker % 4 == 0:  # torch in a quarter of the workers: 16 imports of it would crowd two cores
            self._start_kv(seed)
        self.kinds = [k for k in KINDS if self.kv is not None or not k.startswith("kv_")]
        self.weights = [w for k, w in zip(KINDS, WEIGHTS, strict=True) if k in self.kinds]

    def _start_kv(self, seed: int) -> None:
        from test_kv import LAYOUT, _random_kv, _tokens

        from cacheclient.kv import KVCache

        self.kv = KVCache(self.client, "soak-model", 64, layout=LAYOUT, release_on_read=False)
        self.prompts = [(_tokens(64 * (1 + p % 4), seed=seed * 10 + p), seed * 10 + p) for p in range(6)]
        self.random_kv = _random_kv

    def check(self, key: bytes, value: bytes | None, low: int, high: int) -> None:
        problem = check_read(key, value, low, high)
        self.values_verified += value is not None
        if problem:
            self.wrong.append(problem)

    # -- calls --------------------------------------------------------------

    def get(self) -> None:
        if self.rng.random() < 0.5:
            key = self.rng.choice(self.dataset)
            self.check(key, self.client.get(key), 1, 1)
        else:
            key = self.rng.choice(self.own)
            low = self.versions.low(key)
            self.check(key, self.client.get(key), low, self.versions.high(key))

    def get_many(self) -> None:
        keys = self.rng.sample(self.dataset, 6) + self.rng.sample(self.own, 2)
        low = [1] * 6 + [self.versions.low(k) for k in keys[6:]]
        values = self.client.get_many(keys)
        for key, value, lo in zip(keys, values, low, strict=True):
            self.check(key, value, lo, 1 if key.startswith(b"ds/") else self.versions.high(key))

    def put(self) -> None:
        key = self.rng.choice(self.own)
        version = self.versions.next(key)
        self.client.put(key, value_of(key, version))
        self.versions.ack(key, version)

    def delete(self) -> None:
        key = self.rng.choice(self.own)
        version = self.versions.next(key)
        try:
            self.client.delete(key)
        except CacheClientError:
            self.versions.unknown(key)
            raise
        self.versions.deleted(key, version)

    def plan(self) -> None:
        start = self.rng.randrange(len(self.dataset) - 32)
        keys = self.dataset[start : start + 32]
        # The client's plan call (cacheclient.prefetch.Plan wraps it, and imports torch).
        with self.client.prefetch(keys, window_bytes=1 << 20):
            for step in range(0, len(keys), 4):
                wanted = keys[step : step + 4]
                for key, value in zip(wanted, self.client.get_many(wanted), strict=True):
                    self.check(key, value, 1, 1)

    def kv_put(self) -> None:
        tokens, seed = self.rng.choice(self.prompts)
        self.kv.put(tokens, self.random_kv(len(tokens), seed=seed))

    def kv_get(self) -> None:
        import torch

        tokens, seed = self.rng.choice(self.prompts)
        got = self.kv.get(tokens, len(tokens))
        if got is None:  # a cache-only block may be evicted, or not put yet: a miss, never wrong bytes
            self.calls["kv_miss"] += 1
            return
        want = self.random_kv(len(tokens), seed=seed)
        if not all(torch.equal(k, wk) and torch.equal(v, wv) for (k, v), (wk, wv) in zip(got, want, strict=True)):
            self.wrong.append(f"KV of prompt {seed}: tensors differ from those put")
        self.values_verified += 1

    def run(self, seconds: float) -> dict[str, Any]:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            kind = self.rng.choices(self.kinds, self.weights)[0]
            started = time.perf_counter()
            try:
                getattr(self, kind)()
            except CacheClientError as exc:
                self.errors[kind] += 1
                if len(self.error_messages) < 5:
                    self.error_messages.append(f"{kind}: {type(exc).__name__}: {exc}")
            self.calls[kind] += 1
            self.latency_ms[kind].append((time.perf_counter() - started) * 1000)
        self.client.close()
        return {
            "calls": self.calls,
            "errors": self.errors,
            "error_messages": self.error_messages,
            "wrong": len(self.wrong),
            "wrong_examples": self.wrong[:5],
            "values_verified": self.values_verified,
            "latency_ms": self.latency_ms,
        }


def main() -> None:
    meta, worker, seed, seconds, dataset_keys = sys.argv[1:6]
    w = Worker(meta, int(worker), int(seed), int(dataset_keys))
    print("ready", flush=True)
    sys.stdin.readline()
    print(json.dumps(w.run(float(seconds))), flush=True)


if __name__ == "__main__":
    main()
