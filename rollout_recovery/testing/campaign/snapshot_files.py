"""The snapshot-file campaign: damage one file of the newest snapshot, restore, classify.

A small real history is written by a real `StagingStore`: snapshot A, then B with different
rows and ledger, both published by one owner claim. Each case damages one file of B (a
byte-prefix truncation or a one-bit flip), B's publish entry in the root's ownership log
included,
runs what a restart runs (`select_snapshot(root, "latest", "prefix")`, then a restore of the
chosen snapshot) and compares the restored rows and ledger with the state recorded when that
snapshot was taken. The only acceptable outcomes are "restored B exactly" and "refused B,
said why, restored A exactly"; anything that yields data other than a snapshot's true state
is silent corruption. B's pristine bytes are written back after every case, and one store is
reused for every restore, so the campaign stays fast enough to run in CI.
"""

from __future__ import annotations

import hashlib
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rollout_recovery.controller.selection import LEDGER, SnapshotChoice, select_snapshot
from rollout_recovery.data_plane import StagingStore, filesystem, ownership, snapshot_io
from rollout_recovery.data_plane.digest import token_digest
from rollout_recovery.data_plane.ownership import Owner
from rollout_recovery.data_plane.schemas import (
    SCHEMAS,
    ChunkRow,
    ReplayRow,
    chunk_rows_to_table,
    conform,
    replay_rows_to_table,
)
from rollout_recovery.errors import RestoreError
from rollout_recovery.protocol import LEDGER_FORMAT, Ledger

CASE_CLASSES = ("control", "byte_prefix", "bit_flip_meta", "bit_flip_data")
OUTCOMES = (
    "restored_exact",
    "refused_fell_back",
    "refused_no_fallback",
    "restore_failed",
    "silent_corruption",
)
PARTITIONS = {"replay": "replay_row", "rollout_staging": "chunk_row"}
CANARY = "campaign-canary"
MODEL = {
    "base": {"path": "tiny://campaign", "sha256": "ab" * 32},
    "weight_version": 0,
    "weights_sha256": None,
}
Rows = dict[str, pa.Table]  # partition -> its rows sorted by key (empty partitions left out)
Restorer = Callable[[str], Rows]


# ---------------------------------------------------------------------------- rows and history


def key_tokens(key: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and logprobs that are a pure function of the key (so tearing shows)."""
    rng = np.random.default_rng(zlib.crc32(key.encode()))
    return rng.integers(0, 50_000, n, dtype=np.int32), rng.standard_normal(n).astype(np.float32)


def replay_rows(keys: list[str], tokens: int = 8) -> pa.Table:
    """Replay rows whose content is a pure function of the key."""
    rows = []
    for i, k in enumerate(keys):
        ids, lps = key_tokens(k, tokens)
        rows.append(
            ReplayRow(
                key=k,
                rollout_id=k,
                group_id=f"g{i // 4}",
                generation_index=i % 4,
                prompt_len=4,
                token_ids=ids,
                loss_mask=np.ones(tokens, np.int8),
                logprobs=lps,
                reward=float(i),
                weight_version_min=0,
                weight_version_max=0,
            )
        )
    return replay_rows_to_table(rows)


def chunk_rows(keys: list[str], tokens: int = 8) -> pa.Table:
    """Staged chunk rows whose content is a pure function of the key."""
    rows = []
    for k in keys:
        ids, lps = key_tokens(k, tokens)
        rows.append(
            ChunkRow(
                key=k,
                rollout_id=k.split("/")[0],
                model_call_id="call0",
                attempt=0,
                chunk_seq=0,
                token_ids=ids,
                logprobs=lps,
                weight_version=1,
                prev_len=0,
                digest=token_digest(ids),
                prompt_token_ids=ids[:4],
            )
        )
    return chunk_rows_to_table(rows)


def _sorted(table: pa.Table, kind: str) -> pa.Table:
    table = conform(table.drop_columns([c for c in ("_seq",) if c in table.column_names]),
                    SCHEMAS[kind], "campaign rows")  # fmt: skip
    return table.take(pc.sort_indices(table, [("key", "ascending")])).combine_chunks()


def store_rows(store: StagingStore) -> Rows:
    """Every row the store holds, per partition, in key order."""
    out: Rows = {}
    for name, kind in store.partitions.items():
        keys = store.list(name)
        if keys:
            table, missing = store.get(name, keys)
            if missing:
                raise RuntimeError(f"{name}: listed keys vanished: {missing[:3]}")
            out[name] = _sorted(table, kind)
    return out


def same_rows(a: Rows, b: Rows) -> bool:
    return a.keys() == b.keys() and all(a[p].equals(b[p]) for p in a)


@dataclass(frozen=True)
class SnapshotState:
    """A published snapshot and the truth it must restore to."""

    uri: str
    ledger: Ledger
    rows: Rows


@dataclass(frozen=True)
class History:
    root: str
    a: SnapshotState
    b: SnapshotState
    b_entry: str = ""  # B's publish entry, relative to the root (ownership/<slot>.json)

    @property
    def b_dir(self) -> Path:
        return Path(self.b.uri)

    def path(self, rel: str) -> Path:
        """A file the campaign attacks: B's own (relative to its directory) or B's entry in
        the ownership log (relative to the root)."""
        return Path(self.root) / rel if rel == self.b_entry else self.b_dir / rel

    def files(self) -> dict[str, bytes]:
        """Every file the campaign attacks -> its bytes: B's files and its log entry."""
        out = snapshot_files(self.b_dir)
        if self.b_entry:
            out[self.b_entry] = self.path(self.b_entry).read_bytes()
        return out


def _take(store: StagingStore, root: str, step: int, owner: Owner | None = None) -> SnapshotState:
    ledger = Ledger.model_validate(
        {
            "format": LEDGER_FORMAT,
            "step": step,
            "weight_version": step,
            "reason": "cadence",
            "level": "prefix",
            "model": MODEL,
        }
    )
    rows = store_rows(store)
    uri = store.snapshot(
        root, meta={"trainer_step": str(step), "reason": "cadence"},
        sidecars={LEDGER: ledger.to_json()}, owner=owner,
    ).uri  # fmt: skip
    return SnapshotState(uri, ledger, rows)


def build_history(store: StagingStore, root: str, rows_per_partition: int = 4) -> History:
    """Snapshots A then B on a local root; B adds, replaces and deletes rows so that restoring
    the wrong one is always visible."""
    n = rows_per_partition
    owner = StagingStore.claim(root)
    store.put("replay", replay_rows([f"r{i}" for i in range(n)]))
    store.put("rollout_staging", chunk_rows([f"s{i}/c0" for i in range(n)]))
    a = _take(store, root, 1, owner)
    store.put("replay", replay_rows([f"r{i}" for i in range(n // 2, n + n // 2)], tokens=12))
    store.delete("rollout_staging", [f"s{i}/c0" for i in range(n // 2)])
    store.put("rollout_staging", chunk_rows([f"t{i}/c0" for i in range(n // 2)]))
    b = _take(store, root, 2, owner)
    fs, path = filesystem.resolve(root)
    slot, _ = ownership.read_log(fs, path).publications()[Path(b.uri).name]
    return History(root, a, b, f"{ownership.OWNERSHIP_DIR}/{ownership.entry_name(slot)}")


def store_restorer(store: StagingStore) -> Restorer:
    """Restore into a live store (the product path) and read every row back. A canary row is
    put first: a restore that silently left the store as it was cannot pass as exact."""

    def restore(uri: str) -> Rows:
        store.put("replay", replay_rows([CANARY]))
        store.restore(uri)
        return store_rows(store)

    return restore


def file_restorer(uri: str) -> Rows:
    """Read a snapshot's rows in-process with the reader the shard actors use
    (`snapshot_io.read_partitions`, which verifies each file with `read_verified`); fast, and
    patchable by tests."""
    fs, path = filesystem.resolve(uri)
    body = snapshot_io.read_manifest(fs, path).body
    parts = snapshot_io.read_partitions(fs, path, body.files)
    return {name: _sorted(table, body.partitions[name]) for name, table in parts.items()}


# ---------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """Damage to one file of B: keep its first `offset` bytes, or flip `bit` of byte `offset`."""

    klass: str
    file: str  # relative to the snapshot directory
    kind: Literal["prefix", "flip"]
    offset: int
    bit: int = 0

    def apply(self, pristine: bytes) -> bytes:
        if self.kind == "prefix":
            return pristine[: self.offset]
        damaged = bytearray(pristine)
        damaged[self.offset] ^= 1 << self.bit
        return bytes(damaged)

    def describe(self) -> str:
        what = f"truncated to {self.offset} bytes" if self.kind == "prefix" else (
            f"bit {self.bit} of byte {self.offset} flipped")  # fmt: skip
        return f"{self.file} {what}"


def spread(n: int, k: int | None) -> list[int]:
    """`k` offsets evenly spread over range(n), first and last included (all when k is None)."""
    if k is None or k >= n:
        return list(range(n))
    if k <= 1:
        return [0][:k]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def is_data(rel: str) -> bool:
    return rel.endswith(".arrow")


def generate_cases(
    sizes: dict[str, int],
    data_flips: int | None = 64,
    data_prefixes: int | None = None,
) -> list[Case]:
    """Every case for files of the given sizes (relative path -> bytes): a control per file
    (rewritten whole, so B must restore exactly: the refusals are not vacuous), every byte prefix of
    every file (`data_prefixes` samples a data file's prefixes instead), a bit flip at every
    byte of the manifest and sidecars, and `data_flips` evenly spread flips per data file
    (None: every byte). The flipped bit rotates with the offset, so every bit position is hit."""
    cases: list[Case] = []
    for rel in sorted(sizes):
        n = sizes[rel]
        data = is_data(rel)
        cases.append(Case("control", rel, "prefix", n))
        prefixes = spread(n, data_prefixes if data else None)
        cases += [Case("byte_prefix", rel, "prefix", i) for i in prefixes]
        klass = "bit_flip_data" if data else "bit_flip_meta"
        cases += [
            Case(klass, rel, "flip", i, i % 8) for i in spread(n, data_flips if data else None)
        ]
    return cases


def snapshot_files(snapshot_dir: Path) -> dict[str, bytes]:
    """Relative path -> bytes of every file in a published snapshot directory."""
    return {
        p.relative_to(snapshot_dir).as_posix(): p.read_bytes()
        for p in sorted(snapshot_dir.rglob("*"))
        if p.is_file()
    }


# ---------------------------------------------------------------------------- outcomes


@dataclass
class CaseOutcome:
    case: Case
    outcome: str
    detail: str
    accepted_damage: bool = False  # B chosen although its bytes differ (must restore exactly)


def classify(
    case: Case,
    history: History,
    choice: SnapshotChoice | None,
    rows: Rows | None,
    error: str | None,
) -> CaseOutcome:
    """The outcome of one case, from what selection chose and what the restore produced."""
    if choice is None:
        if error is not None and error.startswith("RestoreError"):
            return CaseOutcome(case, "refused_no_fallback", error)
        return CaseOutcome(case, "silent_corruption", error or "selection found no snapshot")
    want = {history.a.uri: history.a, history.b.uri: history.b}.get(choice.snapshot)
    if want is None:
        return CaseOutcome(case, "silent_corruption", f"chose unknown {choice.snapshot}")
    if rows is None:
        return CaseOutcome(case, "restore_failed", f"chose {choice.snapshot}, then {error}")
    if choice.ledger != want.ledger or not same_rows(rows, want.rows):
        return CaseOutcome(
            case, "silent_corruption", f"chose {choice.snapshot}; restored data differs from it"
        )
    if want is history.b:
        return CaseOutcome(case, "restored_exact", "B chosen and restored exactly", True)
    reasons = [r for u, r in choice.skipped if u == history.b.uri]
    if not reasons:
        return CaseOutcome(case, "silent_corruption", "A chosen but B was not reported skipped")
    return CaseOutcome(case, "refused_fell_back", reasons[0])


class MemoRestorer:
    """A restorer that runs for real once per distinct content of the chosen snapshot.

    A restore replaces the whole store with what the snapshot's bytes hold, so its result is a
    function of those bytes: the key is a sha256 over every file of the chosen directory.
    Most cases choose A, untouched, or B undamaged; any damaged B still restores for real.
    """

    def __init__(self, restore: Restorer) -> None:
        self.restore = restore
        self.memo: dict[tuple[str, str], Rows] = {}
        self.real = 0
        self.paths: dict[str, list[Path]] = {}

    def __call__(self, uri: str) -> Rows:
        if uri not in self.paths:  # the campaign damages files in place, never adds any
            self.paths[uri] = sorted(p for p in Path(uri).rglob("*") if p.is_file())
        digest = hashlib.sha256()
        for path in self.paths[uri]:
            data = path.read_bytes()
            digest.update(f"{path}\0{len(data)}\0".encode())
            digest.update(data)
        key = (uri, digest.hexdigest())
        if key not in self.memo:
            self.memo[key] = self.restore(uri)
            self.real += 1
        return self.memo[key]


def run_case(case: Case, history: History, pristine: bytes, restore: Restorer) -> CaseOutcome:
    """Damage, select, restore, classify; then put B's pristine bytes back."""
    target = history.path(case.file)
    damaged = case.apply(pristine)
    target.write_bytes(damaged)
    try:
        choice: SnapshotChoice | None = None
        rows: Rows | None = None
        error: str | None = None
        try:
            choice = select_snapshot(history.root, "latest", "prefix")
        except RestoreError as err:
            error = f"RestoreError: {err}"
        if choice is not None:
            try:
                rows = restore(choice.snapshot)
            except Exception as err:  # any failure to restore is classified, never hidden
                error = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
        out = classify(case, history, choice, rows, error)
        out.accepted_damage = out.accepted_damage and damaged != pristine
        return out
    finally:
        target.write_bytes(pristine)


@dataclass
class CampaignResult:
    """Counts by case class and outcome, with every silent corruption spelled out."""

    counts: dict[str, dict[str, int]] = field(
        default_factory=lambda: {c: dict.fromkeys(OUTCOMES, 0) for c in CASE_CLASSES}
    )
    silent: list[dict[str, Any]] = field(default_factory=list)
    unexpected: list[dict[str, Any]] = field(default_factory=list)  # restore_failed, no fallback
    unnamed_reasons: list[dict[str, Any]] = field(default_factory=list)
    accepted_damage: list[str] = field(default_factory=list)
    data_flip_offsets: dict[str, int] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)
    real_restores: int = 0
    elapsed_s: float = 0.0

    def add(self, out: CaseOutcome) -> None:
        self.counts[out.case.klass][out.outcome] += 1
        info = {"case": out.case.describe(), "outcome": out.outcome, "detail": out.detail}
        if out.outcome == "silent_corruption":
            self.silent.append(info)
        elif out.outcome in ("restore_failed", "refused_no_fallback"):
            self.unexpected.append(info)
        elif out.outcome == "refused_fell_back" and Path(out.case.file).name not in out.detail:
            self.unnamed_reasons.append(info)
        if out.accepted_damage:
            self.accepted_damage.append(out.case.describe())

    def total(self, outcome: str | None = None) -> int:
        return sum(
            n for per in self.counts.values() for o, n in per.items() if outcome in (None, o)
        )

    @property
    def cases(self) -> int:
        return self.total()

    @property
    def silent_corruption(self) -> int:
        return self.total("silent_corruption")

    def to_json(self) -> dict[str, Any]:
        return {
            "campaign": "snapshot_files",
            "cases": self.cases,
            "by_class": self.counts,
            "restored_exact": self.total("restored_exact"),
            "refused_safely": self.total("refused_fell_back"),
            "silent_corruption": self.silent_corruption,
            "restore_failed": self.total("restore_failed"),
            "refused_no_fallback": self.total("refused_no_fallback"),
            "silent": self.silent,
            "unexpected": self.unexpected,
            "reasons_not_naming_file": self.unnamed_reasons,
            "accepted_damage": self.accepted_damage,
            "data_flip_offsets_per_file": self.data_flip_offsets,
            "files": self.files,
            "real_restores": self.real_restores,
            "elapsed_s": round(self.elapsed_s, 2),
        }

    def table(self) -> str:
        cols = ("cases", "restored exactly", "refused safely", "no fallback")
        cols += ("restore failed", "silent corruption")
        lines = [f"{'class':<14}" + "".join(f"{c:>19}" for c in cols)]
        for klass in (*CASE_CLASSES, "total"):
            per = self.counts[klass] if klass != "total" else {o: self.total(o) for o in OUTCOMES}
            vals = [sum(per.values())] + [per[o] for o in OUTCOMES]
            lines.append(f"{klass:<14}" + "".join(f"{v:>19}" for v in vals))
        flips = ", ".join(f"{f}: {n}" for f, n in self.data_flip_offsets.items())
        lines.append(f"data-file flip offsets per file: {flips}")
        lines.append(f"damage accepted with identical data: {len(self.accepted_damage)}")
        lines.append(f"restores run for real (the rest memoised by content): {self.real_restores}")
        lines.append(f"time: {self.elapsed_s:.1f} s")
        return "\n".join(lines)


def run_campaign(
    history: History,
    restore: Restorer,
    data_flips: int | None = 64,
    data_prefixes: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    cases: Iterable[Case] | None = None,
    memo: bool = True,
) -> CampaignResult:
    """Run every case (by default `generate_cases` over B's files and its ownership log
    entry) against `history`; `memo` restores each distinct chosen content once (see
    MemoRestorer)."""
    start = time.monotonic()
    pristine = history.files()
    todo = list(cases) if cases is not None else generate_cases(
        {rel: len(data) for rel, data in pristine.items()}, data_flips, data_prefixes
    )  # fmt: skip
    result = CampaignResult(files={rel: len(data) for rel, data in pristine.items()})
    for case in todo:
        if case.klass == "bit_flip_data":
            result.data_flip_offsets[case.file] = result.data_flip_offsets.get(case.file, 0) + 1
    restorer = MemoRestorer(restore) if memo else None
    for i, case in enumerate(todo):
        result.add(run_case(case, history, pristine[case.file], restorer or restore))
        if progress is not None:
            progress(i + 1, len(todo))
    if history.files() != pristine:
        raise RuntimeError("the campaign left snapshot B damaged")
    result.real_restores = restorer.real if restorer is not None else len(todo)
    result.elapsed_s = time.monotonic() - start
    return result
