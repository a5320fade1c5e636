"""Where checkpoints are committed: the metadata shard's records, or each run's index in the cache.

`commits(cache, keys)` is the one choice: `ShardCommits` when the client
routes by a metadata shard, else `IndexCommits`. Both answer the same calls
(`Commits`), so the catalog's public functions never ask which they have.
The manifest value and its commit go through `cacheclient.manifests`, the
same as a saved model's. `cacheclient.checkpoint.catalog` describes the two
protocols.

Freeing follows one order in both: chunks first, then manifests, then the
record or index entry that lists them, so a pass that dies halfway leaves
entries that the next pass finishes. A retired checkpoint a loader has
marked (`mark_reader`) within its lease is kept until a later pass.

Freeing fails closed. A chunk is deleted only when the manifest of every
checkpoint that is kept (listed, or retired but in use) was read; one that
reads as missing, damaged or unreachable stops the pass before it retires or
deletes anything (`RetentionBlocked`), since a manifest that is away for a
moment (its node restarting) would otherwise protect none of its chunks. A
marker that cannot be read counts as a load in progress. What may leak
instead: the chunks of a retired checkpoint whose own manifest is gone (a
pass that died after deleting it had deleted its chunks first).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from cacheclient.checkpoint.chunks import delete_chunks, wait_durable
from cacheclient.checkpoint.layout import (
    MANIFEST_FORMAT,
    CheckpointCorrupt,
    CheckpointEntry,
    CheckpointError,
    CheckpointKeys,
    CheckpointNotFound,
    Durability,
    RetentionBlocked,
    parse_manifest,
    split_name,
)
from cacheclient.client import CacheClient
from cacheclient.errors import CacheClientError, CorruptValueError, ReplicasFailedError
from cacheclient.manifests import CacheManifests, Record, RecordMismatch, ShardManifests, ShardRecords
from cacheclient.meta import CommandRefusedError, MetaClient

__all__ = ["Commits", "IndexCommits", "ShardCommits", "commits", "in_use", "mark_reader"]

log = logging.getLogger(__name__)

_RETIRE_TIMEOUT = 60.0
"""Seconds a retention pass waits for a run index it rewrites to be durable."""


class Commits(Protocol):
    """The calls the catalog makes of where checkpoints are committed."""

    def manifest_at(self, name: str) -> tuple[dict[str, Any], bytes]:
        """The committed manifest of `name` and its cache key.

        Raises:
            CheckpointNotFound: none is committed.
            CheckpointCorrupt: the commit names a manifest that is missing or another.
        """
        ...

    def commit(self, name: str, manifest: dict[str, Any], durability: Durability, timeout: float) -> None:
        """Stores the manifest, durable as `durability` says, then commits it; frees what it replaces."""
        ...

    def retain(self, run: str, keep_last: int) -> list[str]:
        """Retires all but the newest `keep_last` checkpoints of `run`, frees what no loader uses; their names."""
        ...

    def delete(self, name: str) -> bool:
        """Retires checkpoint `name` and frees what no loader uses; whether it was listed."""
        ...

    def runs(self) -> list[str]:
        """The runs with committed checkpoints."""
        ...

    def entries(self, run: str | None) -> list[CheckpointEntry]:
        """The committed checkpoints of `run` (of every run when None), oldest first within a run."""
        ...

    def latest(self, run: str) -> str | None:
        """The newest committed checkpoint of `run`, or None."""
        ...


def commits(cache: CacheClient, keys: CheckpointKeys) -> ShardCommits | IndexCommits:
    """The metadata shard's records when `cache` routes by a shard, else the run index in the cache."""
    shard = cache.cluster.shard
    return ShardCommits(cache, keys, shard) if shard is not None else IndexCommits(cache, keys)


def mark_reader(cache: CacheClient, name: str, lease: float, keys: CheckpointKeys | None = None) -> None:
    """Records that a load of `name` runs, so retention keeps it for `lease` seconds.

    With replicas, a marker that reached some of them only (one is down) is
    enough: retention reads it from one that answers, and counts a marker it
    cannot read as a load in progress (`in_use`). So the load goes on.
    """
    keys = keys or CheckpointKeys()
    try:
        cache.put(keys.reader(name), json.dumps({"until": time.time() + lease}).encode(), ttl=lease)
    except ReplicasFailedError as exc:
        log.warning("checkpoint %r: its reader marker reached only some replicas (%s); the load goes on", name, exc)


def in_use(cache: CacheClient, keys: CheckpointKeys, name: str) -> bool:
    """Whether a loader marked checkpoint `name` within its lease; True when its marker cannot be read."""
    try:
        raw = cache.get(keys.reader(name))
        return raw is not None and json.loads(raw).get("until", 0) > time.time()
    except (CacheClientError, ValueError, AttributeError) as exc:
        log.warning("checkpoint %r: its reader marker cannot be read (%s); kept as if a load runs", name, exc)
        return True


def _blocked(run: str, name: str, exc: Exception) -> RetentionBlocked:
    return RetentionBlocked(
        f"retention of run {run!r} deleted nothing: the manifest of {name!r}, which it keeps, cannot be read "
        f"({exc}); the next pass frees what this one could not, once it reads again "
        "(or once that checkpoint is deleted)"
    )


def _encode(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, sort_keys=True).encode()


def _settle(cache: CacheClient, durability: Durability, timeout: float) -> Callable[[bytes], None]:
    """What runs between storing a manifest and its commit: a wait until it is durable as `durability` says."""
    return lambda key: wait_durable(cache, [key], durability, timeout)


class ShardCommits:
    """Commits as records in the metadata shard, linearizable through Raft.

    One `propose` is one Raft log entry, so the commands of one call here
    (a commit and the retired record of the manifest it replaces; a run's
    retirements) are applied together or not at all.
    """

    def __init__(self, cache: CacheClient, keys: CheckpointKeys, meta: MetaClient) -> None:
        self.cache = cache
        self.keys = keys
        self.records = ShardRecords(meta)
        self.manifests = ShardManifests(
            cache,
            self.records,
            record=keys.commit_record,
            value_key=keys.manifest_value,
            retired=lambda r: keys.retired_record(r.name, r.checksum),
        )

    def manifest_at(self, name: str) -> tuple[dict[str, Any], bytes]:
        record = self.manifests.get(name)
        if record is None:
            raise CheckpointNotFound(f"no checkpoint {name!r} committed in the metadata shard")
        return self._manifest(record), record.key

    def _manifest(self, record: Record) -> dict[str, Any]:
        """The manifest a record names, checked against the record's size and checksum."""
        try:
            raw = self.manifests.read(record)
        except CorruptValueError as exc:
            raise CheckpointCorrupt(f"checkpoint {record.name!r}: its manifest is damaged: {exc}") from exc
        except RecordMismatch as exc:
            what = "is missing from the cache and object storage"
            if not exc.missing:
                what = "does not match the committed checksum"
            raise CheckpointCorrupt(f"checkpoint {record.name!r}: its manifest {what}") from None
        return parse_manifest(record.name, raw)

    def commit(self, name: str, manifest: dict[str, Any], durability: Durability, timeout: float) -> None:
        try:
            saved = self.manifests.save(
                name,
                _encode(manifest),
                settle=_settle(self.cache, durability, timeout),
                durable=durability is not Durability.S3,
            )
        except CommandRefusedError as exc:
            raise CheckpointError(str(exc)) from None
        if saved.replaced is not None and saved.replaced.key != saved.key:
            try:
                self._free_retired(split_name(name)[0])
            except RetentionBlocked as exc:  # committed all the same; a later pass frees the replaced one
                log.warning("%s", exc)

    def retain(self, run: str, keep_last: int) -> list[str]:
        committed = self.committed(run)
        chunks: dict[bytes, set[str]] = {}
        self._kept_chunks(run, committed[-keep_last:], chunks)  # fails closed before anything is retired
        self._retire(committed[:-keep_last])
        return self._free_retired(run, chunks)

    def delete(self, name: str) -> bool:
        run, _ = split_name(name)
        record = self.manifests.get(name)
        listed = record is not None or any(r.name == name for r in self.retired(run))
        if record is not None:
            self._retire([record])
        self._free_retired(run)
        return listed

    def runs(self) -> list[str]:
        names = self._names(self.keys.record_roots()[0], None, retired=False)
        return sorted({split_name(name)[0] for _, name in names})

    def entries(self, run: str | None) -> list[CheckpointEntry]:
        return [self._entry(record) for record in self.committed(run)]

    def latest(self, run: str) -> str | None:
        records = self.committed(run)
        return records[-1].name if records else None

    def committed(self, run: str | None = None) -> list[Record]:
        """The commit records (of `run`, or of every run), by run, oldest commit first."""
        return self._records(self._names(self.keys.record_roots()[0], run, retired=False))

    def retired(self, run: str) -> list[Record]:
        """The retired records of `run`."""
        return self._records(self._names(self.keys.record_roots()[1], run, retired=True))

    def _entry(self, record: Record) -> CheckpointEntry:
        try:
            manifest = self._manifest(record)
        except CheckpointCorrupt:  # listed all the same: its status says "damaged"
            return CheckpointEntry(record.name, 0.0, 0, 0)
        return CheckpointEntry(record.name, manifest["created"], manifest["bytes"], len(manifest["chunks"]))

    def _names(self, root: str, run: str | None, *, retired: bool) -> list[tuple[str, str]]:
        """(record, checkpoint name) of every record under `root`, of `run` if given."""
        out = []
        for record in self.records.names(root):
            record_run, sep, step = record[len(root) :].rpartition("/~/")
            if retired:
                step = step.rpartition("~")[0]
            if not sep or (run is not None and record_run != run):
                continue
            try:
                split_name(f"{record_run}/{step}")
            except CheckpointError:
                continue  # not a record of ours
            out.append((record, f"{record_run}/{step}"))
        return out

    def _records(self, names: list[tuple[str, str]]) -> list[Record]:
        records = self.records.get_many(names)  # those deleted since the listing are left out
        return sorted(records, key=lambda r: (split_name(r.name)[0], r.revision))

    def _propose(self, commands: list[Any]) -> None:
        try:
            self.records.propose(commands)
        except CommandRefusedError as exc:
            raise CheckpointError(str(exc)) from None

    def _retire(self, records: Sequence[Record]) -> None:
        """Moves committed checkpoints to retired records (no longer listed or loadable), in one entry."""
        commands = []
        for record in records:
            commands.append(self.records.put(self.keys.retired_record(record.name, record.checksum), record))
            commands.append(self.records.delete(self.keys.commit_record(record.name)))
        self._propose(commands)

    def _kept_chunks(self, run: str, kept: Sequence[Record], known: dict[bytes, set[str]]) -> set[str]:
        """Every chunk the manifests of `kept` name (read once per call into `known`).

        Raises:
            RetentionBlocked: one of them cannot be read.
        """
        out: set[str] = set()
        for record in kept:
            if record.key not in known:
                try:
                    known[record.key] = set(self._manifest(record)["chunks"])
                except CacheClientError as exc:  # CheckpointCorrupt: missing (its node away), or damaged
                    raise _blocked(run, record.name, exc) from exc
            out |= known[record.key]
        return out

    def _free_retired(self, run: str, known: dict[bytes, set[str]] | None = None) -> list[str]:
        """Deletes the retired manifests of `run` that no loader uses, then their records; returns their names.

        Raises:
            RetentionBlocked: a kept manifest cannot be read (nothing is deleted).
        """
        known = {} if known is None else known
        retired = self.retired(run)
        free = [r for r in retired if not in_use(self.cache, self.keys, r.name)]
        if not free:
            return []
        kept = self._kept_chunks(run, [r for r in retired if r not in free] + self.committed(run), known)
        candidates: set[str] = set()
        for record in free:
            try:
                candidates |= set(self._manifest(record)["chunks"])
            except CheckpointCorrupt as exc:  # deleted by a pass that died (after its chunks), or away: leaked
                log.info("retired checkpoint %r: its manifest is gone (%s); its record goes", record.name, exc)
        delete_chunks(self.cache, self.keys, run, candidates - kept)
        for record in free:
            self.cache.delete(record.key)
        self._propose([self.records.delete(self.keys.retired_record(r.name, r.checksum)) for r in free])
        return list(dict.fromkeys(r.name for r in free))


class IndexCommits:
    """Commits as entries in each run's index, a value in the cache (a client of one server).

    One writer per run is assumed (one training job): two jobs saving into
    one run at once could race on its index.
    """

    def __init__(self, cache: CacheClient, keys: CheckpointKeys) -> None:
        self.cache = cache
        self.keys = keys
        self.manifests = CacheManifests(cache, key=keys.manifest)

    def manifest_at(self, name: str) -> tuple[dict[str, Any], bytes]:
        found = self.manifests.load(name)
        if found is None:
            raise CheckpointNotFound(f"no checkpoint {name!r} in the cache or object storage")
        key, raw = found
        return parse_manifest(name, raw), key

    def commit(self, name: str, manifest: dict[str, Any], durability: Durability, timeout: float) -> None:
        """Stores the manifest, then lists it in its run's index; frees the chunks of the one it replaces."""
        run, _ = split_name(name)
        try:
            replaced: dict[str, Any] | None = self.manifest_at(name)[0]
        except CheckpointNotFound:
            replaced = None
        self.manifests.save(
            name,
            _encode(manifest),
            settle=_settle(self.cache, durability, timeout),
            durable=durability is not Durability.S3,
        )
        index = self._read_index(run)
        entry = {
            "name": name,
            "created": manifest["created"],
            "bytes": manifest["bytes"],
            "chunks": len(manifest["chunks"]),
        }
        index["checkpoints"] = [c for c in index["checkpoints"] if c["name"] != name] + [entry]
        index["retired"] = [n for n in index["retired"] if n != name]
        self._write_index(run, index, timeout)
        if replaced is not None:
            stale = set(replaced["chunks"]) - set(manifest["chunks"])
            try:
                self._delete_unreferenced(run, index, stale)
            except RetentionBlocked as exc:  # committed all the same; those chunks leak
                log.warning("%s", exc)

    def retain(self, run: str, keep_last: int) -> list[str]:
        index = self._read_index(run)
        self._kept_chunks(run, [c["name"] for c in index["checkpoints"][-keep_last:]])  # fails closed first
        old = index["checkpoints"][:-keep_last]
        return self._retire(run, index, [c["name"] for c in old])

    def delete(self, name: str) -> bool:
        run, _ = split_name(name)
        index = self._read_index(run)
        listed = any(c["name"] == name for c in index["checkpoints"]) or name in index["retired"]
        if not listed and self.cache.get(self.keys.manifest(name)) is not None:
            listed = True  # committed but never indexed (a crash between the two)
        self._retire(run, index, [name])
        return listed

    def runs(self) -> list[str]:
        """The runs whose index object storage or the cache holds, by name: a run's index is written back, so a
        run whose first checkpoint has just been saved may be in the cache only (its chunks and manifest can
        be uploaded before its index is)."""
        root = self.keys.index_root()
        runs: set[str] = set()
        for cached in (False, True):
            for key, _ in self.cache.list(root, cached=cached):
                if key.endswith(b"/~index"):
                    runs.add(key[len(root) : -len(b"/~index")].decode())
        return sorted(runs)

    def entries(self, run: str | None) -> list[CheckpointEntry]:
        runs = [run] if run is not None else self.runs()
        return [
            CheckpointEntry(c["name"], c["created"], c["bytes"], c["chunks"])
            for r in runs
            for c in self._read_index(r)["checkpoints"]
        ]

    def latest(self, run: str) -> str | None:
        entries = self.entries(run)
        return entries[-1].name if entries else None

    def _read_index(self, run: str) -> dict[str, Any]:
        raw = self.cache.get(self.keys.index(run))
        if raw is None:
            return {"format": MANIFEST_FORMAT, "run": run, "checkpoints": [], "retired": []}
        index: dict[str, Any] = json.loads(raw)
        index.setdefault("retired", [])
        return index

    def _write_index(self, run: str, index: dict[str, Any], timeout: float) -> None:
        key = self.keys.index(run)
        self.cache.put(key, json.dumps(index, sort_keys=True).encode(), durable=True)
        wait_durable(self.cache, [key], Durability.CACHE, timeout)

    def _retire(self, run: str, index: dict[str, Any], names: list[str]) -> list[str]:
        """Moves `names` to the retired list, then deletes every retired checkpoint no loader uses.

        Raises:
            RetentionBlocked: a kept manifest cannot be read (`names` are
                retired, nothing is deleted).
        """
        index["checkpoints"] = [c for c in index["checkpoints"] if c["name"] not in names]
        index["retired"] = sorted(set(index["retired"]) | set(names))
        if names:
            self._write_index(run, index, _RETIRE_TIMEOUT)
        free = [name for name in index["retired"] if not in_use(self.cache, self.keys, name)]
        if not free:
            return []
        kept = [c["name"] for c in index["checkpoints"]] + [n for n in index["retired"] if n not in free]
        referenced = self._kept_chunks(run, kept)  # before anything is deleted
        candidates: set[str] = set()
        for name in free:
            with contextlib.suppress(CheckpointNotFound):  # committed-and-deleted halfway before
                candidates |= set(self.manifest_at(name)[0]["chunks"])
        delete_chunks(self.cache, self.keys, run, candidates - referenced)
        for name in free:
            self.cache.delete(self.keys.manifest(name))
            self.cache.delete(self.keys.reader(name))
        index["retired"] = [n for n in index["retired"] if n not in free]
        self._write_index(run, index, _RETIRE_TIMEOUT)
        return free

    def _kept_chunks(self, run: str, names: Sequence[str]) -> set[str]:
        """Every chunk the manifests of `names` name.

        Raises:
            RetentionBlocked: one of them cannot be read.
        """
        out: set[str] = set()
        for name in names:
            try:
                out |= set(self.manifest_at(name)[0]["chunks"])
            except CacheClientError as exc:  # CheckpointNotFound: listed, so away for now (or lost)
                raise _blocked(run, name, exc) from exc
        return out

    def _delete_unreferenced(self, run: str, index: dict[str, Any], candidates: set[str]) -> None:
        """Deletes the chunks in `candidates` that no listed or retired checkpoint of `run` references.

        Raises:
            RetentionBlocked: one of their manifests cannot be read (nothing is deleted).
        """
        if not candidates:
            return
        referenced = self._kept_chunks(run, [c["name"] for c in index["checkpoints"]] + index["retired"])
        delete_chunks(self.cache, self.keys, run, candidates - referenced)
