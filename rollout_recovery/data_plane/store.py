"""StagingStore: the client of a sharded Arrow data plane on Ray, usable from sync and async code.

Each operation is planned once (validate, split by shard, issue actor calls) and then either
awaited (`a*` methods) or waited on (`ray.get`); validation happens before any shard is
touched, so bad input writes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import ray

from rollout_recovery.data_plane.errors import (
    BadInputError,
    BatchTooLargeError,
    InvalidKeyError,
    SnapshotCorruptError,
    UnknownPartitionError,
)
from rollout_recovery.data_plane.filesystem import child_uri, join, resolve
from rollout_recovery.data_plane.ownership import Owner, claim
from rollout_recovery.data_plane.retention import gc
from rollout_recovery.data_plane.schemas import SCHEMAS, check_version, conform
from rollout_recovery.data_plane.shard import StoreShard, shard_of
from rollout_recovery.data_plane.snapshot_io import (
    FileEntry,
    Manifest,
    ManifestBody,
    PublishGate,
    check_files,
    latest_uri,
    new_snapshot_dir,
    now_iso,
    publish_manifest,
    read_manifest,
    read_sidecar,
    verify_snapshot,
    write_sidecar,
)
from rollout_recovery.protocol import KEY_PATTERN
from rollout_recovery.runtime import actor_class

KEY_RE = re.compile(KEY_PATTERN)
log = logging.getLogger("rollout_recovery")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9._/-]*$")
DEFAULT_PARTITIONS = {
    "rollout_staging": "chunk_row",
    "rollout_terminal": "terminal_row",
    "replay": "replay_row",
    "token_entries": "token_entry_row",
}


@dataclass(frozen=True)
class StoreLimits:
    max_batch_rows: int = 65_536
    max_batch_bytes: int = 1 << 30
    max_key_len: int = 512


@dataclass
class LeaseResult:
    lease_id: str
    rows: pa.Table


@dataclass
class SnapshotResult:
    uri: str
    manifest: Manifest


@dataclass(frozen=True)
class _Parent:
    """The newest snapshot this client published under a root: what an incremental one
    references."""

    name: str
    files: list[FileEntry]  # every file a restore of it reads, each naming its snapshot
    boundaries: list[int]  # per shard
    chain_length: int
    live_rows: int


@dataclass(frozen=True)
class FrozenSnapshot:
    """A snapshot frozen on every shard and not written yet (`StagingStore.write`)."""

    root_uri: str
    filesystem: pafs.FileSystem | None
    seq: int
    path: str  # its directory
    uri: str
    token: str  # names the freeze on the shards
    parent: _Parent | None  # None: a full snapshot
    stats: list[dict]  # per shard: boundary, rows (per partition), changed_rows

    @property
    def changed_rows(self) -> int:
        return sum(st["changed_rows"] for st in self.stats)


def _resolve(uri: str, filesystem: pafs.FileSystem | None) -> tuple[pafs.FileSystem, str]:
    """`resolve`, with `filesystem` (when given) in place of the URI's own filesystem."""
    return resolve(uri) if filesystem is None else resolve(uri, filesystem)


def validate_key(key: str, limits: StoreLimits = StoreLimits()) -> None:
    if not isinstance(key, str) or not KEY_RE.fullmatch(key) or len(key) > limits.max_key_len:
        raise InvalidKeyError(
            f"invalid key {key!r}: keys match {KEY_PATTERN} "
            f"and are at most {limits.max_key_len} characters"
        )


class _Plan:
    """Actor calls of one operation plus how to combine their results."""

    def __init__(self, refs: list, finish: Callable[[list], Any]) -> None:
        self.refs, self.finish = refs, finish

    def wait(self, timeout: float | None) -> Any:
        return self.finish(ray.get(self.refs, timeout=timeout))

    async def wait_async(self) -> Any:
        return self.finish(list(await asyncio.gather(*self.refs)))


class StagingStore:
    """Named partitions of typed Arrow rows on S shard actors (key-hash placement)."""

    def __init__(
        self,
        shards: Sequence[ray.actor.ActorHandle],
        partitions: dict[str, str],
        limits: StoreLimits = StoreLimits(),
        timeout_s: float | None = 300.0,
    ) -> None:
        self.shards = list(shards)
        self.partitions = dict(partitions)
        self.limits = limits
        self.timeout_s = timeout_s
        self._parents: dict[str, _Parent] = {}  # root URI -> its newest snapshot by this client
        self._lease_turn = 0  # which shard a lease asks first

    @classmethod
    def create(
        cls,
        num_shards: int = 1,
        partitions: dict[str, str] | None = None,
        limits: StoreLimits = StoreLimits(),
        num_cpus: float = 0,
        actor_options: dict[str, Any] | None = None,
        shard_options: Sequence[dict[str, Any]] | None = None,
        wait: bool = True,
    ) -> StagingStore:
        """Start `num_shards` shard actors.

        `actor_options` go to Ray as they are (e.g. a runtime_env with object-store
        credentials); `shard_options[i]`, when given, are added for shard i alone (where it
        runs: resources, a scheduling strategy; rollout_recovery/placement.py makes them).
        `wait=False` returns before the shards answer (`ready` waits), so that other actors
        start beside them.
        """
        if num_shards < 1:
            raise ValueError("num_shards must be >= 1")
        partitions = dict(partitions or DEFAULT_PARTITIONS)
        for pname, kind in partitions.items():
            if kind not in SCHEMAS:
                raise ValueError(f"partition {pname!r}: unknown row kind {kind!r}")
            validate_key(pname)
        opts: dict[str, Any] = {"num_cpus": num_cpus, "max_concurrency": 64}
        if shard_options is not None and len(shard_options) != num_shards:
            raise ValueError(f"shard_options has {len(shard_options)} entries, not {num_shards}")
        base = opts | (actor_options or {})
        shards = [
            actor_class(
                StoreShard, **base | dict(shard_options[i] if shard_options else {})
            ).remote(i, num_shards, partitions)
            for i in range(num_shards)
        ]
        store = cls(shards, partitions, limits)
        if wait:
            store.ready()
        return store

    def ready(self) -> None:
        """Wait until every shard answers (raises if one failed to start)."""
        ray.get([s.stats.remote() for s in self.shards])

    def shutdown(self) -> None:
        for s in self.shards:
            ray.kill(s)

    # ------------------------------------------------------------------ planning

    def _check_partition(self, partition: str) -> pa.Schema:
        if partition not in self.partitions:
            raise UnknownPartitionError(
                f"unknown partition {partition!r}; known: {sorted(self.partitions)}"
            )
        return SCHEMAS[self.partitions[partition]]

    def _check_keys(self, keys: Sequence[str]) -> list[str]:
        if isinstance(keys, str):
            raise BadInputError("keys must be a list of strings, not one string")
        keys = list(keys)
        for k in keys:
            validate_key(k, self.limits)
        return keys

    def _split(self, keys: list[str]) -> list[list[int]]:
        groups: list[list[int]] = [[] for _ in self.shards]
        for i, k in enumerate(keys):
            groups[shard_of(k, len(self.shards))].append(i)
        return groups

    def _plan_put(self, partition: str, table: pa.Table | pa.RecordBatch) -> _Plan:
        schema = self._check_partition(partition)
        table = conform(table, schema, f"put to {partition!r}")
        if table.num_rows > self.limits.max_batch_rows:
            raise BatchTooLargeError(
                f"put to {partition!r}: {table.num_rows} rows > max_batch_rows "
                f"{self.limits.max_batch_rows}; split the batch"
            )
        if table.nbytes > self.limits.max_batch_bytes:
            raise BatchTooLargeError(
                f"put to {partition!r}: {table.nbytes} bytes > max_batch_bytes "
                f"{self.limits.max_batch_bytes}; split the batch"
            )
        keys = self._check_keys(table.column("key").to_pylist())
        if len(set(keys)) != len(keys):
            raise BadInputError(f"put to {partition!r}: duplicate keys in one batch")
        if len(self.shards) == 1:
            return _Plan([self.shards[0].put.remote(partition, table)], sum)
        refs = []
        for shard, rows in zip(self.shards, self._split(keys), strict=True):
            if rows:
                part = table.take(pa.array(rows, pa.int64()))
                refs.append(shard.put.remote(partition, part))
        return _Plan(refs, sum)

    def _plan_get(self, partition: str, keys: Sequence[str]) -> _Plan:
        schema = self._check_partition(partition)
        keys = self._check_keys(keys)
        groups = self._split(keys)
        refs, order = [], []
        for shard, rows in zip(self.shards, groups, strict=True):
            if rows:
                refs.append(shard.get.remote(partition, [keys[i] for i in rows]))
                order.append(rows)

        def finish(results: list) -> tuple[pa.Table, list[str]]:
            missing = [k for _, miss in results for k in miss]
            tables = [t for t, _ in results]
            if len(tables) <= 1:
                return (tables[0] if tables else schema.empty_table()), missing
            table = pa.concat_tables(tables)
            # Restore the caller's order across shards.
            found = set(missing)
            wanted = [keys[i] for rows in order for i in rows if keys[i] not in found]
            pos = {k: i for i, k in enumerate(wanted)}
            idx = [pos[k] for k in keys if k in pos]
            return table.take(pa.array(idx, pa.int64())), missing

        return _Plan(refs, finish)

    def _plan_delete(self, partition: str, keys: Sequence[str]) -> _Plan:
        self._check_partition(partition)
        keys = self._check_keys(keys)
        refs = [
            shard.delete.remote(partition, [keys[i] for i in rows])
            for shard, rows in zip(self.shards, self._split(keys), strict=True)
            if rows
        ]
        return _Plan(refs, sum)

    def _plan_list(self, partition: str, prefix: str) -> _Plan:
        self._check_partition(partition)
        if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
            raise InvalidKeyError(f"invalid key prefix {prefix!r}")
        refs = [s.list_keys.remote(partition, prefix) for s in self.shards]
        return _Plan(refs, lambda res: sorted(k for keys in res for k in keys))

    def _check_lease(self, partition: str, consumer: str, max_rows: int, ttl_s: float):
        schema = self._check_partition(partition)
        validate_key(consumer, self.limits)
        if max_rows < 1 or ttl_s <= 0:
            raise BadInputError("lease needs max_rows >= 1 and ttl_s > 0")
        return schema

    def _lease_order(self) -> list[ray.actor.ActorHandle]:
        """The shards in the order a lease asks them, starting one further each time, so no
        shard's rows wait behind another's for good."""
        start = self._lease_turn % len(self.shards)
        self._lease_turn += 1
        return self.shards[start:] + self.shards[:start]

    @staticmethod
    def _lease_result(schema: pa.Schema, lease_id: str, tables: list[pa.Table]) -> LeaseResult:
        tables = [t for t in tables if t.num_rows]
        rows = pa.concat_tables(tables) if tables else schema.empty_table()
        return LeaseResult(lease_id, rows)

    def _plan_lease_keys(
        self, partition: str, consumer: str, keys: Sequence[str], ttl_s: float
    ) -> _Plan:
        schema = self._check_lease(partition, consumer, max(1, len(keys)), ttl_s)
        keys = self._check_keys(keys)
        lease_id = uuid.uuid4().hex
        split = zip(self.shards, self._split(keys), strict=True)
        refs = [shard.lease.remote(partition, consumer, len(rows), ttl_s, lease_id,
                                   [keys[i] for i in rows])
                for shard, rows in split if rows]  # fmt: skip
        return _Plan(refs, lambda tables: self._lease_result(schema, lease_id, tables))

    def _plan_ack(self, lease_id: str) -> _Plan:
        return _Plan([s.ack.remote(lease_id) for s in self.shards], sum)

    # ------------------------------------------------------------------ sync API

    def put(self, partition: str, table: pa.Table | pa.RecordBatch) -> int:
        """Insert or replace rows by key; returns once every row is visible to every reader."""
        return self._plan_put(partition, table).wait(self.timeout_s)

    def get(self, partition: str, keys: Sequence[str]) -> tuple[pa.Table, list[str]]:
        """Rows for the keys, in the order asked, and the keys that were not found."""
        return self._plan_get(partition, keys).wait(self.timeout_s)

    def delete(self, partition: str, keys: Sequence[str]) -> int:
        return self._plan_delete(partition, keys).wait(self.timeout_s)

    def list(self, partition: str, prefix: str = "") -> list[str]:
        return self._plan_list(partition, prefix).wait(self.timeout_s)

    def lease(
        self, partition: str, consumer: str, max_rows: int, ttl_s: float = 60.0
    ) -> LeaseResult:
        """Lease up to max_rows unleased rows (oldest first per shard) until ack or ttl.

        The shards are asked one after another, each for what is still wanted: rows are
        placed by key hash, so an even share per shard would come back short whenever the
        unleased rows are not spread evenly (a trainer step's few keys often are not)."""
        schema = self._check_lease(partition, consumer, max_rows, ttl_s)
        lease_id, tables, need = uuid.uuid4().hex, [], max_rows
        for shard in self._lease_order():
            ref = shard.lease.remote(partition, consumer, need, ttl_s, lease_id)
            tables.append(ray.get(ref, timeout=self.timeout_s))
            need -= tables[-1].num_rows
            if need == 0:
                break
        return self._lease_result(schema, lease_id, tables)

    def lease_keys(
        self, partition: str, consumer: str, keys: Sequence[str], ttl_s: float = 60.0
    ) -> LeaseResult:
        """Lease the rows of `keys` that are available (present and not leased); the result
        says which by its rows' keys."""
        return self._plan_lease_keys(partition, consumer, keys, ttl_s).wait(self.timeout_s)

    def ack(self, lease_id: str) -> int:
        """Consume a lease's rows; returns how many. A second ack (or an expired lease) is 0."""
        return self._plan_ack(lease_id).wait(self.timeout_s)

    def stats(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for shard_stats in ray.get([s.stats.remote() for s in self.shards]):
            for part, counts in shard_stats.items():
                acc = out.setdefault(part, {})
                for k, v in counts.items():
                    acc[k] = acc.get(k, 0) + v
        return out

    # ------------------------------------------------------------------ async API

    async def aput(self, partition: str, table: pa.Table | pa.RecordBatch) -> int:
        return await self._plan_put(partition, table).wait_async()

    async def aget(self, partition: str, keys: Sequence[str]) -> tuple[pa.Table, list[str]]:
        return await self._plan_get(partition, keys).wait_async()

    async def adelete(self, partition: str, keys: Sequence[str]) -> int:
        return await self._plan_delete(partition, keys).wait_async()

    async def alist(self, partition: str, prefix: str = "") -> list[str]:
        return await self._plan_list(partition, prefix).wait_async()

    async def alease(
        self, partition: str, consumer: str, max_rows: int, ttl_s: float = 60.0
    ) -> LeaseResult:
        schema = self._check_lease(partition, consumer, max_rows, ttl_s)
        lease_id, tables, need = uuid.uuid4().hex, [], max_rows
        for shard in self._lease_order():
            tables.append(await shard.lease.remote(partition, consumer, need, ttl_s, lease_id))
            need -= tables[-1].num_rows
            if need == 0:
                break
        return self._lease_result(schema, lease_id, tables)

    async def alease_keys(
        self, partition: str, consumer: str, keys: Sequence[str], ttl_s: float = 60.0
    ) -> LeaseResult:
        return await self._plan_lease_keys(partition, consumer, keys, ttl_s).wait_async()

    async def aack(self, lease_id: str) -> int:
        return await self._plan_ack(lease_id).wait_async()

    # ------------------------------------------------------------------ snapshots

    def snapshot(
        self,
        root_uri: str,
        meta: dict[str, str] | None = None,
        sidecars: dict[str, bytes] | None = None,
        deadline: float | None = None,
        gate: PublishGate | None = None,
        filesystem: pafs.FileSystem | None = None,
        owner: Owner | None = None,
        full_every: int = 1,
    ) -> SnapshotResult:
        """Write a consistent copy of every shard under root_uri and publish it (manifest last).

        Every put that returned before this call is in it; each shard is frozen atomically.
        `sidecars` (name -> bytes, e.g. a controller ledger) are written, checksummed and listed
        in the manifest before it is published. The publish step runs under `gate` (one per
        attempt): once `gate.abort()` returned True, or past `deadline` (time.monotonic()),
        nothing is published and SnapshotAborted is raised; the unpublished directory is
        garbage-collected later. `filesystem`, when given, is used instead of the URI's own
        (by the shards too; every method taking a URI accepts it), e.g. a fault-injecting one.
        `owner` is the controller's claim on the root (ownership.claim); publication is
        refused with OwnerFenced once a newer controller claimed it (None: epoch 0, fenced by
        any claim). `full_every` > 1: incremental (see `freeze`).
        """
        gate = gate or PublishGate()
        frozen = self.freeze(root_uri, full_every, deadline, gate, filesystem)
        return self.write(frozen, meta, sidecars, deadline, gate, owner)

    def freeze(
        self,
        root_uri: str,
        full_every: int = 1,
        deadline: float | None = None,
        gate: PublishGate | None = None,
        filesystem: pafs.FileSystem | None = None,
    ) -> FrozenSnapshot:
        """The first half of `snapshot`: a new snapshot directory and every shard frozen
        atomically (one consistent moment of the store); `write` then writes and publishes it while
        puts and deletes go on. With `full_every` > 1 the freeze is incremental - only what
        changed since the previous snapshot this client published under root_uri - unless
        that parent already ends a chain of `full_every` snapshots, holds more dead rows than
        live ones, or a file it lists is gone; then it is full."""
        if full_every < 1:
            raise ValueError("full_every must be >= 1")
        gate = gate or PublishGate()
        fs, root = _resolve(root_uri, filesystem)
        gate.check(f"under {root}", deadline)
        parent = self._parent_for(root_uri, fs, full_every)
        seq, path = new_snapshot_dir(fs, root)
        uri = child_uri(root_uri, path.rstrip("/").rsplit("/", 1)[-1])
        token = uuid.uuid4().hex
        refs = [
            shard.freeze.remote(token, parent.boundaries[i] if parent else None,
                                 self._keep_changes_from(i))
            for i, shard in enumerate(self.shards)
        ]  # fmt: skip
        stats = ray.get(refs, timeout=self._timeout(deadline))
        return FrozenSnapshot(root_uri, filesystem, seq, path, uri, token, parent, stats)

    def write(
        self,
        frozen: FrozenSnapshot,
        meta: dict[str, str] | None = None,
        sidecars: dict[str, bytes] | None = None,
        deadline: float | None = None,
        gate: PublishGate | None = None,
        owner: Owner | None = None,
    ) -> SnapshotResult:
        """The second half of `snapshot`: the frozen files, the sidecars, then the manifest
        (listing the parent's files too when incremental), published under `gate`."""
        gate = gate or PublishGate()
        c = frozen
        fs, _ = _resolve(c.root_uri, c.filesystem)
        try:
            results = ray.get(
                [s.write.remote(c.token, c.uri, c.filesystem) for s in self.shards],
                timeout=self._timeout(deadline),
            )
        except BaseException:
            for s in self.shards:
                s.discard.remote(c.token)
            raise
        own = [f for fs_, _ in results for f in fs_]
        leases = [le for _, ls in results for le in ls]
        files = [*(c.parent.files if c.parent else []), *own]
        side = [write_sidecar(fs, c.path, n, d) for n, d in (sidecars or {}).items()]
        name = c.path.rstrip("/").rsplit("/", 1)[-1]
        body = ManifestBody(
            snapshot_id=name.rsplit("-", 1)[-1],
            seq=c.seq,
            created_at=now_iso(),
            num_shards=len(self.shards),
            partitions=self.partitions,
            files=files,
            leases=leases,
            payload_bytes=sum(f.bytes for f in files),
            meta=dict(meta or {}),
            sidecars=side,
            base=c.parent.name if c.parent else None,
            chain_length=c.parent.chain_length + 1 if c.parent else 1,
            boundaries=[st["boundary"] for st in c.stats],
            rows={p: sum(st["rows"].get(p, 0) for st in c.stats) for p in self.partitions},
            written_bytes=sum(f.bytes for f in own),
        )
        manifest = publish_manifest(fs, c.path, body, gate, deadline, owner)
        self._parents[c.root_uri] = _Parent(
            name=name,
            files=[f.model_copy(update={"snapshot": f.snapshot or name}) for f in files],
            boundaries=body.boundaries,
            chain_length=body.chain_length,
            live_rows=sum(body.rows.values()),
        )
        return SnapshotResult(uri=c.uri, manifest=manifest)

    def _keep_changes_from(self, shard: int) -> int | None:
        """The oldest boundary a later incremental snapshot may start from on `shard`: that
        of the oldest parent over every root this client writes to (None: no parent, the
        shard forgets every change before this freeze)."""
        bounds = [p.boundaries[shard] for p in self._parents.values()
                  if len(p.boundaries) == len(self.shards)]  # fmt: skip
        return min(bounds, default=None)

    def _parent_for(self, root_uri: str, fs: pafs.FileSystem, full_every: int) -> _Parent | None:
        """The parent an incremental snapshot under root_uri builds on, or None: full."""
        parent = self._parents.get(root_uri)
        if parent is None or full_every <= 1 or parent.chain_length >= full_every:
            return None
        if len(parent.boundaries) != len(self.shards):
            return None
        stored = sum(f.rows for f in parent.files if f.content == "rows")
        if stored > 2 * parent.live_rows + 1024:  # dead rows dominate: rewrite them away
            return None
        _, root = _resolve(root_uri, fs)
        try:
            check_files(fs, join(root, parent.name), parent.files)
        except SnapshotCorruptError as err:
            log.warning("snapshot %s cannot be a parent (%s); writing a full one", parent.name,
                        err)  # fmt: skip
            return None
        return parent

    def _timeout(self, deadline: float | None) -> float | None:
        """The shard-call timeout: the store's, shortened to what is left of the deadline."""
        if deadline is None:
            return self.timeout_s
        left = max(0.0, deadline - time.monotonic())
        return left if self.timeout_s is None else min(self.timeout_s, left)

    @staticmethod
    def manifest(snapshot_uri: str, filesystem: pafs.FileSystem | None = None) -> Manifest:
        """The verified manifest of a published snapshot."""
        fs, path = _resolve(snapshot_uri, filesystem)
        return read_manifest(fs, path)

    @staticmethod
    def verify(
        snapshot_uri: str, use_cache: bool = True, filesystem: pafs.FileSystem | None = None
    ) -> Manifest:
        """The manifest of a snapshot whose every file matches it (hashed once per process,
        unless `use_cache=False`)."""
        fs, path = _resolve(snapshot_uri, filesystem)
        return verify_snapshot(fs, path, use_cache)

    @staticmethod
    def read_sidecar(
        snapshot_uri: str, name: str, filesystem: pafs.FileSystem | None = None
    ) -> bytes:
        """A verified sidecar of a published snapshot."""
        fs, path = _resolve(snapshot_uri, filesystem)
        manifest = read_manifest(fs, path)
        for entry in manifest.body.sidecars:
            if entry.name == name:
                return read_sidecar(fs, path, entry)
        raise SnapshotCorruptError(f"snapshot {snapshot_uri} has no sidecar {name!r}")

    def restore(self, snapshot_uri: str, filesystem: pafs.FileSystem | None = None) -> Manifest:
        """Replace the store's contents with a verified snapshot; a bad one changes nothing.

        Leases are not restored: rows leased but unacked at snapshot time are delivered again.
        """
        fs, path = _resolve(snapshot_uri, filesystem)
        manifest = read_manifest(fs, path)
        body = manifest.body
        for pname, kind in body.partitions.items():
            if pname not in self.partitions or self.partitions[pname] != kind:
                raise SnapshotCorruptError(
                    f"snapshot partition {pname!r} ({kind}) does not match this store's "
                    f"partitions {self.partitions}"
                )
        for f in body.files:
            check_version(f.row_kind, f.schema_version, f"snapshot file {f.path}")
        n = len(self.shards)
        if body.num_shards == n:
            per_shard = [[f for f in body.files if f.shard == i] for i in range(n)]
            boundaries = body.boundaries or [0] * n
        else:
            per_shard = [list(body.files) for _ in self.shards]
            boundaries = [max(body.boundaries, default=0)] * n
        refs = [
            s.restore_prepare.remote(snapshot_uri, files, body.num_shards, filesystem, b)
            for s, files, b in zip(self.shards, per_shard, boundaries, strict=True)
        ]
        try:
            ray.get(refs, timeout=self.timeout_s)
        except Exception as err:
            ray.get([s.restore_abort.remote() for s in self.shards])
            cause = getattr(err, "cause", None) or err
            if isinstance(cause, SnapshotCorruptError | BadInputError):
                raise cause from None
            raise
        ray.get([s.restore_commit.remote() for s in self.shards])
        self._parents.clear()  # the next snapshot starts a new chain
        return manifest

    async def asnapshot(
        self,
        root_uri: str,
        meta: dict[str, str] | None = None,
        sidecars: dict[str, bytes] | None = None,
        deadline: float | None = None,
        gate: PublishGate | None = None,
        filesystem: pafs.FileSystem | None = None,
        owner: Owner | None = None,
        full_every: int = 1,
    ) -> SnapshotResult:
        """`snapshot` in a thread. Cancelling this coroutine (e.g. a timeout running
        out) aborts the publication, since the thread itself cannot be stopped; a caller that
        must know whether the snapshot was published anyway passes a gate and calls
        `gate.abort()`."""
        gate = gate or PublishGate()
        try:
            return await asyncio.to_thread(
                self.snapshot, root_uri, meta, sidecars, deadline, gate, filesystem, owner,
                full_every,
            )  # fmt: skip
        except asyncio.CancelledError:
            gate.abort()
            raise

    async def afreeze(
        self,
        root_uri: str,
        full_every: int = 1,
        deadline: float | None = None,
        gate: PublishGate | None = None,
    ) -> FrozenSnapshot:
        return await asyncio.to_thread(self.freeze, root_uri, full_every, deadline, gate)

    async def awrite(
        self,
        frozen: FrozenSnapshot,
        meta: dict[str, str] | None = None,
        sidecars: dict[str, bytes] | None = None,
        deadline: float | None = None,
        gate: PublishGate | None = None,
        owner: Owner | None = None,
    ) -> SnapshotResult:
        """`write` in a thread; cancelling it aborts the publication (see `asnapshot`)."""
        gate = gate or PublishGate()
        try:
            return await asyncio.to_thread(
                self.write, frozen, meta, sidecars, deadline, gate, owner
            )
        except asyncio.CancelledError:
            gate.abort()
            raise

    async def arestore(
        self, snapshot_uri: str, filesystem: pafs.FileSystem | None = None
    ) -> Manifest:
        return await asyncio.to_thread(self.restore, snapshot_uri, filesystem)

    @staticmethod
    def latest(root_uri: str, filesystem: pafs.FileSystem | None = None) -> str | None:
        """URI of the newest published snapshot under root_uri (unpublished ones are ignored)."""
        return latest_uri(root_uri, filesystem)

    @staticmethod
    def gc(
        root_uri: str,
        keep_latest_k: int,
        filesystem: pafs.FileSystem | None = None,
        owner: Owner | None = None,
    ) -> list[str]:
        """Keep the newest keep_latest_k snapshots that verify; delete only directories older
        than the oldest of them (see retention.gc). OwnerFenced, deleting nothing, when a
        newer controller than `owner` claimed the root."""
        fs, root = _resolve(root_uri, filesystem)
        return gc(fs, root, keep_latest_k, owner)

    @staticmethod
    def claim(
        root_uri: str, filesystem: pafs.FileSystem | None = None, first: bool = False
    ) -> Owner:
        """Become the owner of the snapshot root (see data_plane.ownership.claim; `first`: only
        as its first owner, for a fresh run)."""
        fs, root = _resolve(root_uri, filesystem)
        return claim(fs, root, first)
