"""Looking at a run's snapshots before trusting one: list them, describe one, verify them.

These are what `rollout-recovery snapshots ls|show|verify` print. They read files and nothing
else (no Ray, no store, no model), and they never write, move or delete anything, so they are
safe to run beside a live run or on a crashed run's location before deciding to restore it.

A location is a run's checkpoint directory (snapshots under its `data_plane/`), a snapshot
root, or one snapshot directory; local paths and pyarrow.fs URIs alike. Listing is cheap: one
listing per snapshot directory plus its manifest and ledger, so it notices a torn or missing
file from sizes alone but not a flipped byte; `verify_location` reads every byte. The root's
ownership log is read once per call: a snapshot is published when a publish entry there names
it (its owner epoch and slot are shown), and `list_claims` lists the owner claims.

`verify_location` also checks what a restore needs outside the snapshot, with the checks the
restore makes, so `ok` means restorable: the ledger (a format this version restores), the
trainer checkpoint it pairs with (`trainer_checkpoints.check_paired`, by the digest the ledger
records, when the
run keeps trainer checkpoints) and the model identity (well-formed, and the model the ledger
names, or the one given, matched as `selection.check_model` does).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

import pyarrow.fs as pafs
from pydantic import BaseModel, ValidationError

from rollout_recovery.config import HUB_MODEL_SCHEME, STORAGE_SCHEMES, TINY_MODEL_SCHEME
from rollout_recovery.controller.selection import DATA_PLANE, LEDGER, check_model
from rollout_recovery.data_plane import ownership
from rollout_recovery.data_plane.errors import SnapshotError
from rollout_recovery.data_plane.filesystem import join, resolve
from rollout_recovery.data_plane.snapshot_io import (
    MANIFEST_NAME,
    SNAPSHOT_DIR_RE,
    Manifest,
    check_files,
    file_name,
    file_path,
    read_manifest,
    read_sidecar,
    verify_snapshot,
)
from rollout_recovery.errors import RestoreError, one_line
from rollout_recovery.model_identity import base_model_identity
from rollout_recovery.protocol import LEDGER_FORMAT, Ledger, ServedModel
from rollout_recovery.storage import RunStorage, StorageError
from rollout_recovery.trainer import trainer_checkpoints

Status = Literal["published", "unpublished", "damaged"]
_SHA_PREFIX = 12  # hex digits of a sha256 shown by `show`: enough to compare by eye
_HASH_CHUNK = 8 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")
# What a training run leaves in its location (run.py, trainer/trainer_checkpoints.py):
# a run holding either pairs its snapshots with trainer checkpoints.
_TRAINER_DIR, _STEPS_LOG = "trainer", "steps.jsonl"


class InspectionError(ValueError):
    """Nothing to inspect where the caller pointed (no snapshots, no such snapshot, a scheme
    pyarrow.fs cannot open): a usage error, distinct from a storage failure."""


class FileSummary(BaseModel):
    """A file of a snapshot; partition, rows and sha256 are known only from a manifest."""

    path: str  # relative to the snapshot directory
    bytes: int
    partition: str | None = None
    shard: int | None = None
    rows: int | None = None
    sha256: str | None = None  # the manifest's, first `_SHA_PREFIX` hex digits


class SidecarSummary(BaseModel):
    name: str
    bytes: int
    sha256: str  # first `_SHA_PREFIX` hex digits


class ContinuationSummary(BaseModel):
    """How one in-flight call goes on after a restore: resumed from `tokens` staged tokens
    (cut) or decoded again as the next attempt."""

    rollout_id: str
    call_id: str
    attempt: int
    cut: bool
    tokens: int | None
    cut_kind: str | None


class LedgerSummary(BaseModel):
    format: int
    model: ServedModel
    episodes: int
    turns: int  # committed turns over all episode records
    journaled_steps: int = 0  # journaled steps over all episode records (turns among them)
    continuations: list[ContinuationSummary]


class SnapshotSummary(BaseModel):
    """One snapshot directory as `snapshots ls` shows it."""

    name: str
    location: str  # path or URI without credentials or options
    seq: int
    status: Status
    problem: str | None = None  # why it is damaged, or why its ledger cannot be restored
    created_at: str | None = None
    step: int | None = None
    reason: str | None = None
    level: str | None = None
    rows: dict[str, int] = {}  # partition -> rows
    continuations: int | None = None  # calls in flight with a continuation in the ledger
    # Unfinished episodes the ledger records (a restore runs them again), how many of them are
    # partly done (at least one step journaled) and their journaled steps, by kind (chat,
    # effect, random): what a restore answers without decoding or running effects again.
    episodes: int | None = None
    partly_done: int | None = None
    journaled: dict[str, int] = {}
    bytes: int  # every file in the directory, manifest and sidecars included
    epoch: int | None = None  # the owner epoch that published it (ownership log)
    slot: int | None = None  # the slot of its publish entry in the ownership log


class ClaimSummary(BaseModel):
    """An owner claim in the snapshot root's ownership log."""

    slot: int
    epoch: int
    host: str
    pid: int
    claimed_at: str


class SnapshotDetail(SnapshotSummary):
    """One snapshot as `snapshots show` shows it."""

    snapshot_id: str | None = None
    num_shards: int | None = None
    payload_bytes: int | None = None
    meta: dict[str, str] = {}
    files: list[FileSummary] = []
    sidecars: list[SidecarSummary] = []
    ledger: LedgerSummary | None = None


class Check(BaseModel):
    """Something a restore of a snapshot needs beyond its own files, as `verify` found it."""

    status: Literal["ok", "failed", "not_checked"]
    code: str | None = None  # when failed, e.g. trainer_checkpoint_missing
    detail: str  # what was checked and found, or why it does not apply


class VerifyResult(BaseModel):
    """One published snapshot as `verify` found it. `ok`: restorable as far as files can tell:
    every byte verifies, and its ledger, the trainer checkpoint it pairs with and its model
    identity pass the checks a restore makes (one that does not apply is `not_checked`)."""

    name: str
    ok: bool
    file: str | None = None  # the first damaged file, relative to the snapshot directory
    reason: str | None = None  # the damaged file's problem, or the first failed check's code
    # None when the snapshot's files do not verify (nothing further is read):
    ledger: Check | None = None
    trainer_checkpoint: Check | None = None
    model: Check | None = None


@dataclass
class _Location:
    fs: pafs.FileSystem
    root: str  # the snapshot root, as a path on fs
    local: bool
    scheme: str
    only: str | None  # the target was this one snapshot directory
    run: str | None = None  # the run directory (path or URI) whose data_plane/ the root is

    def display(self, *parts: str) -> str:
        where = join(self.root, *parts) if parts else self.root
        return where if self.local else f"{self.scheme}://{where}"


def _redact(uri: str) -> str:
    """A URI without credentials or query options, for messages."""
    if "://" not in uri:
        return uri
    parts = urlsplit(uri)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"


def _info(fs: pafs.FileSystem, path: str, shown: str) -> pafs.FileInfo:
    try:
        return fs.get_file_info(path)
    except OSError as err:
        raise StorageError(f"cannot read {shown}: {one_line(err)}") from None


def _open(target: str, name: str | None = None) -> _Location:
    """Where the snapshots are: the target itself, its `data_plane/`, or the target's parent
    when the target is one snapshot directory; `name` picks one snapshot under the root."""
    scheme, sep, _ = target.partition("://")
    if sep and scheme not in STORAGE_SCHEMES:
        accepted = ", ".join(f"{s}://" for s in STORAGE_SCHEMES)
        raise InspectionError(
            f"unknown storage scheme `{scheme}://`; give a local path or a URI starting with "
            f"one of {accepted}"
        )
    try:
        fs, path = resolve(target)
    except SnapshotError as err:
        raise StorageError(f"cannot open {_redact(target)}: {one_line(err)}") from None
    path = path.rstrip("/") or "/"
    loc = _Location(fs, path, isinstance(fs, pafs.LocalFileSystem), scheme, None)
    info = _info(fs, path, loc.display())
    if info.type == pafs.FileType.NotFound:
        raise InspectionError(f"nothing at {loc.display()}: no such directory")
    if info.type != pafs.FileType.Directory:
        raise InspectionError(
            f"{loc.display()} is a file; give a run's checkpoint directory, a snapshot root "
            "or a snapshot directory"
        )
    parent, _, base = path.rpartition("/")
    up = 1 if base == DATA_PLANE else None  # levels from the target up to the run directory
    if SNAPSHOT_DIR_RE.match(base):
        loc.root, loc.only = parent or "/", base
        up = 2 if parent.rpartition("/")[2] == DATA_PLANE else None
    elif _info(fs, join(path, DATA_PLANE), loc.display()).type == pafs.FileType.Directory:
        loc.root, up = join(path, DATA_PLANE), 0
    loc.run = None if up is None else _ancestor(target, up)
    if name is not None and loc.only is not None and name != loc.only:
        raise InspectionError(f"{loc.display(loc.only)} is one snapshot; it holds no {name}")
    if name is not None and not SNAPSHOT_DIR_RE.match(name):
        raise InspectionError(f"{name!r} is not a snapshot name (snapshot-<seq>-<id>)")
    loc.only = loc.only or name
    return loc


def _ancestor(target: str, up: int) -> str:
    """The directory `up` levels above a path or URI (a URI keeps its query options)."""
    if "://" not in target:
        path = os.path.abspath(os.path.expanduser(target))
        for _ in range(up):
            path = os.path.dirname(path)
        return path
    parts = urlsplit(target)
    path = parts.path.rstrip("/")
    for _ in range(up):
        path = path.rpartition("/")[0]
    return urlunsplit(parts._replace(path=path))


def _seq(name: str) -> int:
    match = SNAPSHOT_DIR_RE.match(name)
    return int(match.group(1)) if match else -1


def _listing(loc: _Location) -> dict[str, dict[str, int]]:
    """Snapshot directory name -> {file path relative to it: bytes}, oldest first."""
    try:
        if loc.only is not None:
            info = loc.fs.get_file_info(join(loc.root, loc.only))
            if info.type != pafs.FileType.Directory:
                raise InspectionError(f"no snapshot {loc.only} under {loc.display()}")
            names = [loc.only]
        else:
            infos = loc.fs.get_file_info(pafs.FileSelector(loc.root, allow_not_found=True))
            names = [
                i.base_name
                for i in infos
                if i.type == pafs.FileType.Directory and SNAPSHOT_DIR_RE.match(i.base_name)
            ]
        out: dict[str, dict[str, int]] = {}
        for name in sorted(names, key=lambda n: (_seq(n), n)):
            base = join(loc.root, name)
            selector = pafs.FileSelector(base, recursive=True, allow_not_found=True)
            out[name] = {
                i.path[len(base) + 1 :]: i.size
                for i in loc.fs.get_file_info(selector)
                if i.type == pafs.FileType.File
            }
    except OSError as err:
        raise StorageError(f"cannot list {loc.display()}: {one_line(err)}") from None
    if not out:
        raise InspectionError(
            f"no snapshots under {loc.display()} (nor under its {DATA_PLANE}/); give a run's "
            "checkpoint directory, a snapshot root or a snapshot directory"
        )
    return out


def _manifest_problem(err: SnapshotError, snapshot_dir: str) -> str:
    """`read_manifest`'s reason without the directory (the caller names it) or pydantic's
    boilerplate: `unreadable: ...`, `fails its sha256 check`, `has format ...`."""
    text = one_line(err).split(" [type=", 1)[0]
    for prefix in (f"{MANIFEST_NAME} in {snapshot_dir} ", f"{snapshot_dir} ", "is "):
        text = text.removeprefix(prefix)
    return text


def _missing_or_torn(
    loc: _Location, path: str, manifest: Manifest, files: dict[str, int]
) -> str | None:
    """A listed file that is absent or of the wrong size, found from the listing (and, for
    the files an incremental snapshot lists from earlier ones, their metadata) alone."""
    listed = [(f"sidecars/{s.name}", s.bytes) for s in manifest.body.sidecars]
    listed += [(f.path, f.bytes) for f in manifest.body.files if f.snapshot is None]
    for rel, size in listed:
        if rel not in files:
            return f"{rel}: missing"
        if files[rel] != size:
            return f"{rel}: has {files[rel]} bytes, manifest says {size}"
    referenced = [f for f in manifest.body.files if f.snapshot is not None]
    try:
        check_files(loc.fs, path, referenced)
    except SnapshotError as err:
        return one_line(err).removeprefix("snapshot file ")
    return None


def _ledger(loc: _Location, name: str, manifest: Manifest) -> tuple[Ledger | None, str | None]:
    """(ledger, problem): the ledger when it is one this version restores; else why not.
    A sidecar that fails its checksum raises SnapshotError (the snapshot is damaged)."""
    entry = next((s for s in manifest.body.sidecars if s.name == LEDGER), None)
    if entry is None:
        return None, None  # a bare data-plane snapshot: nothing to restore episodes from
    try:
        raw = read_sidecar(loc.fs, join(loc.root, name), entry)
    except SnapshotError:
        raise SnapshotError(f"sidecars/{LEDGER}: fails its sha256 check") from None
    try:
        data = json.loads(raw)
    except ValueError:
        return None, f"its {LEDGER} is not JSON"
    got = data.get("format") if isinstance(data, dict) else None
    if got != LEDGER_FORMAT:
        return None, f"its ledger has format {got!r}; this version restores format {LEDGER_FORMAT}"
    try:
        return Ledger.model_validate(data), None
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return None, f"its ledger is malformed at `{where}`: {first['msg']}"


def _ownership(loc: _Location) -> ownership.OwnershipLog:
    try:
        return ownership.read_log(loc.fs, loc.root)
    except SnapshotError as err:
        raise StorageError(f"cannot read the ownership log: {one_line(err)}") from None


def _read(
    loc: _Location, name: str, files: dict[str, int], log: ownership.OwnershipLog
) -> tuple[SnapshotSummary, Manifest | None, Ledger | None]:
    summary = SnapshotSummary(
        name=name,
        location=loc.display(name),
        seq=_seq(name),
        status="unpublished",
        bytes=sum(files.values()),
    )
    if MANIFEST_NAME not in files:
        return summary, None, None
    publication = log.publications().get(name)
    if publication is None:  # a manifest, but no publish entry: the attempt never published
        summary.problem = log.why_unpublished(name)
        return summary, None, None
    summary.slot, summary.epoch = publication[0], publication[1].epoch
    path = join(loc.root, name)
    try:
        manifest = read_manifest(loc.fs, path)
    except SnapshotError as err:
        summary.status = "damaged"
        summary.problem = f"{MANIFEST_NAME}: {_manifest_problem(err, path)}"
        return summary, None, None
    body = manifest.body
    summary.status, summary.created_at = "published", body.created_at
    summary.rows = dict.fromkeys(body.partitions, 0)
    if body.rows:  # format v2: counted at the freeze (an incremental's files overlap)
        summary.rows |= body.rows
    else:
        for f in body.files:
            summary.rows[f.partition] = summary.rows.get(f.partition, 0) + f.rows
    step = body.meta.get("trainer_step", "")
    summary.step = int(step) if step.isdigit() else None
    summary.reason = body.meta.get("reason")
    ledger, damage = None, _missing_or_torn(loc, path, manifest, files)
    try:
        ledger, summary.problem = _ledger(loc, name, manifest)
    except SnapshotError as err:
        damage = damage or one_line(err)
    if damage is not None:
        summary.status, summary.problem = "damaged", damage
    if ledger is not None:
        summary.step, summary.reason, summary.level = ledger.step, ledger.reason, ledger.level
        summary.continuations = len(ledger.continuations)
        summary.episodes = len(ledger.episodes)
        summary.partly_done = sum(1 for e in ledger.episodes if e.journal)
        summary.journaled = dict(Counter(s.kind for e in ledger.episodes for s in e.journal))
    return summary, manifest, ledger


def list_snapshots(target: str) -> tuple[str, list[SnapshotSummary]]:
    """(snapshot root for display, every snapshot directory under it, oldest first)."""
    loc = _open(target)
    found = _listing(loc)
    log = _ownership(loc)
    return loc.display(), [_read(loc, name, files, log)[0] for name, files in found.items()]


def list_claims(target: str) -> list[ClaimSummary]:
    """The owner claims in the snapshot root's ownership log, oldest first (the last one is
    the controller that may publish there now)."""
    return [
        ClaimSummary(slot=slot, epoch=body.epoch, **body.owner.model_dump())
        for slot, body in _ownership(_open(target)).claims()
    ]


def _ledger_summary(ledger: Ledger) -> LedgerSummary:
    return LedgerSummary(
        format=ledger.format,
        model=ledger.model,
        episodes=len(ledger.episodes),
        turns=sum(len(e.turns) for e in ledger.episodes),
        journaled_steps=sum(len(e.journal) for e in ledger.episodes),
        continuations=[
            ContinuationSummary(
                rollout_id=rollout,
                call_id=c.call_id,
                attempt=c.attempt,
                cut=c.cut,
                tokens=c.tokens,
                cut_kind=c.cut_kind,
            )
            for rollout, c in sorted(ledger.continuations.items())
        ],
    )


def show_snapshot(target: str, name: str | None = None) -> SnapshotDetail:
    """One snapshot in full: `name` under the target, the target itself when it is a snapshot
    directory, else the newest snapshot directory (whatever its status, as `ls` ends with)."""
    loc = _open(target, name)
    name, files = next(reversed(_listing(loc).items()))
    summary, manifest, ledger = _read(loc, name, files, _ownership(loc))
    detail = SnapshotDetail(**summary.model_dump())
    if manifest is None:
        detail.files = [FileSummary(path=p, bytes=b) for p, b in sorted(files.items())]
        return detail
    body = manifest.body
    detail.snapshot_id, detail.num_shards = body.snapshot_id, body.num_shards
    detail.payload_bytes, detail.meta = body.payload_bytes, body.meta
    detail.files = [
        FileSummary(
            path=file_name(f),
            bytes=f.bytes,
            partition=f.partition,
            shard=f.shard,
            rows=f.rows,
            sha256=f.sha256[:_SHA_PREFIX],
        )
        for f in body.files
    ]
    detail.sidecars = [
        SidecarSummary(name=s.name, bytes=s.bytes, sha256=s.sha256[:_SHA_PREFIX])
        for s in body.sidecars
    ]
    detail.ledger = None if ledger is None else _ledger_summary(ledger)
    return detail


def _entry_problem(fs: pafs.FileSystem, path: str, size: int, sha256: str) -> str | None:
    """Why a listed file does not match its manifest entry (every byte is read), or None."""
    try:
        info = fs.get_file_info(path)
        if info.type != pafs.FileType.File:
            return "missing"
        if info.size != size:
            return f"has {info.size} bytes, manifest says {size}"
        hasher = hashlib.sha256()
        with fs.open_input_stream(path) as f:
            while chunk := f.read(_HASH_CHUNK):
                hasher.update(chunk)
    except OSError as err:
        return f"cannot be read: {one_line(err)}"
    return None if hasher.hexdigest() == sha256 else "fails its sha256 check"


def _first_damage(fs: pafs.FileSystem, snapshot_dir: str) -> tuple[str, str] | None:
    """(file, reason) of the first file that fails, in the order `verify_snapshot` checks."""
    try:
        body = read_manifest(fs, snapshot_dir).body
    except SnapshotError as err:
        return MANIFEST_NAME, _manifest_problem(err, snapshot_dir)
    entries = [(f"sidecars/{s.name}", join(snapshot_dir, "sidecars", s.name), s.bytes, s.sha256)
               for s in body.sidecars]  # fmt: skip
    entries += [(file_name(f), file_path(snapshot_dir, f), f.bytes, f.sha256) for f in body.files]
    for name, path, size, sha256 in entries:
        problem = _entry_problem(fs, path, size, sha256)
        if problem is not None:
            return name, problem
    return None


def _identity_problem(model: ServedModel) -> str | None:
    """Why the ledger's model identity is not one a restore can compare, or None."""
    path, sha = model.base.get("path"), model.base.get("sha256")
    if not isinstance(path, str) or not path:
        return f"model.base.path is {path!r}: the ledger names no model"
    for key, value in (("model.base.sha256", sha), ("model.weights_sha256", model.weights_sha256)):
        if value is not None and not (isinstance(value, str) and _SHA256.fullmatch(value)):
            return f"{key} is {str(value)[:40]!r}, not a sha256 (64 hex digits)"
    return None


def _sha_text(sha: str | None) -> str:
    return "none" if sha is None else sha[:_SHA_PREFIX]


def _ok(detail: str) -> Check:
    return Check(status="ok", detail=detail)


def _not_checked(detail: str) -> Check:
    return Check(status="not_checked", detail=detail)


def _failed(code: str, detail: str) -> Check:
    return Check(status="failed", code=code, detail=detail)


class _Restorable:
    """Checks what restoring a snapshot needs outside its files, with the restore's own checks:
    its ledger, the trainer checkpoint it pairs with and its model. What all the snapshots of a
    location share (the run directory, each model's digest, each step's trainer checkpoint) is
    found once."""

    def __init__(self, loc: _Location, model: str | None) -> None:
        self.loc, self.model = loc, model
        self._run: tuple[RunStorage | None, str] | None = None
        self._identities: dict[str, tuple[dict | None, str]] = {}
        self._paired: dict[tuple[int, str | None], Check] = {}

    def check(self, name: str, manifest: Manifest) -> VerifyResult:
        ledger, problem = _ledger(self.loc, name, manifest)
        if problem is not None:
            failed = _failed("ledger_unrestorable", problem)
            return VerifyResult(name=name, ok=False, reason=failed.code, ledger=failed)
        if ledger is None:
            bare = f"no {LEDGER}: a bare data-plane snapshot (StagingStore.restore loads it)"
            none = _not_checked(f"no {LEDGER}, so nothing names one")
            return VerifyResult(
                name=name, ok=True, ledger=_not_checked(bare), trainer_checkpoint=none, model=none
            )
        checks = {
            "ledger": _ok(
                f"format {ledger.format}, step {ledger.step}, reason {ledger.reason}, "
                f"level {ledger.level}"
            ),
            "trainer_checkpoint": self._trainer_checkpoint(ledger),
            "model": self._model(name, ledger),
        }
        failed = [c.code for c in checks.values() if c.status == "failed"]
        return VerifyResult(name=name, ok=not failed, reason=(failed or [None])[0], **checks)

    def _run_storage(self) -> tuple[RunStorage | None, str]:
        """The run directory when it keeps trainer checkpoints; else None and why not."""
        if self._run is None:
            self._run = self._find_run()
        return self._run

    def _find_run(self) -> tuple[RunStorage | None, str]:
        if self.loc.run is None:
            return None, (
                f"{self.loc.display()} is not a run's {DATA_PLANE}/, so no trainer checkpoints "
                "are known to pair with; give the run's checkpoint directory to check them"
            )
        storage = RunStorage(self.loc.run)
        try:
            keeps = storage.is_dir(_TRAINER_DIR) or storage.exists(_STEPS_LOG)
        except OSError as err:
            raise StorageError(f"cannot read {storage.display()}: {one_line(err)}") from None
        if keeps:
            return storage, ""
        return None, (
            f"the run keeps no trainer checkpoints (no {_TRAINER_DIR}/ or {_STEPS_LOG} in "
            f"{storage.display()}): a standalone gateway's, or a trainer of your own whose "
            "checkpoints are not paired here"
        )

    def _trainer_checkpoint(self, ledger: Ledger) -> Check:
        if ledger.step == 0:
            return _not_checked("step 0: the base weights; no trainer checkpoint pairs with it")
        storage, why = self._run_storage()
        if storage is None:
            return _not_checked(why)
        key = (ledger.step, ledger.trainer_checkpoint)
        if key not in self._paired:
            self._paired[key] = self._check_paired(storage, *key)
        return self._paired[key]

    @staticmethod
    def _check_paired(storage: RunStorage, step: int, digest: str | None) -> Check:
        where = storage.display(trainer_checkpoints.trainer_dir(step))
        try:
            trainer_checkpoints.check_paired(storage, step, digest)
        except trainer_checkpoints.TrainerCheckpointError as err:
            return _failed(f"trainer_checkpoint_{err.kind}", one_line(err))
        except OSError as err:
            raise StorageError(f"cannot read {where}: {one_line(err)}") from None
        return _ok(
            f"{where}: complete, every file passes its sha256 check, its digest is "
            f"{_sha_text(digest)} as the ledger records"
        )

    def _model(self, name: str, ledger: Ledger) -> Check:
        problem = _identity_problem(ledger.model)
        if problem is not None:
            return _failed("model_identity_malformed", problem)
        path, sha = ledger.model.base["path"], ledger.model.base.get("sha256")
        recorded = f"recorded {path} (weights sha256 {_sha_text(sha)})"
        against = self.model if self.model is not None else path
        identity, why = self._identity(against, given=self.model is not None)
        if identity is None:
            return _not_checked(f"{recorded}; {why}")
        try:
            check_model(self.loc.display(name), ledger, identity)
        except RestoreError as err:
            return _failed("model_differs", one_line(err))
        how = "name" if identity["sha256"] is None or sha is None else "digest"
        return _ok(f"{recorded}; {why} has the same {how}")

    def _identity(self, model_path: str, given: bool) -> tuple[dict | None, str]:
        """(the identity a restore with `model_path` computes, what it is) or (None, why it is
        not compared). Nothing is built or downloaded: the tiny model only when cached here."""
        if model_path not in self._identities:
            self._identities[model_path] = self._find_identity(model_path, given)
        return self._identities[model_path]

    @staticmethod
    def _find_identity(model_path: str, given: bool) -> tuple[dict | None, str]:
        said = f"the given model {model_path}" if given else f"{model_path} here"
        if model_path.startswith(HUB_MODEL_SCHEME):
            if not given:
                return None, (
                    "a hub model, which a restore compares by name: give the run's --config or "
                    "--model to compare it"
                )
            return {"path": model_path, "sha256": None}, said
        if model_path.startswith(TINY_MODEL_SCHEME):
            from rollout_recovery.tiny_model import TINY_MODELS, tiny_model_dir

            spec = TINY_MODELS.get(model_path.removeprefix(TINY_MODEL_SCHEME))
            if spec is None:
                return None, f"{model_path} is not a tiny model this version builds"
            where = tiny_model_dir(spec=spec)
            if not (where / "model.safetensors").is_file():
                return None, (
                    f"{model_path} is not built on this machine (at {where}; "
                    "`rollout-recovery make-tiny-model` or any run builds it)"
                )
            local = str(where)
        elif os.path.isdir(model_path):
            local = model_path
        else:
            return None, f"{model_path} is not a directory on this machine"
        try:
            return base_model_identity(model_path, local), said
        except OSError as err:
            return None, f"{model_path} cannot be read: {one_line(err)}"


def verify_location(
    target: str, name: str | None = None, model: str | None = None
) -> list[VerifyResult]:
    """Verify every published snapshot under the target (or the one named), reading every
    byte against its sha256 (`use_cache=False`: a success earlier in this process proves
    nothing about the files now), then what a restore of it needs outside its files (see
    `_Restorable`): `model` is a validated `policy.model_path` to compare the ledger's model
    with (None: the model the ledger names, when it is on this machine). Unpublished
    directories are not verified."""
    loc = _open(target, name)
    found = _listing(loc)
    publications = _ownership(loc).publications()
    published = [n for n, files in found.items() if MANIFEST_NAME in files and n in publications]
    if not published and loc.only is not None:
        raise InspectionError(
            f"{loc.display(loc.only)} is not published ("
            + (
                "no publish entry in the ownership log names it"
                if MANIFEST_NAME in found.get(loc.only, {})
                else f"no {MANIFEST_NAME}"
            )
            + "); nothing to verify"
        )
    if not published:
        raise InspectionError(
            f"no published snapshot to verify under {loc.display()} ({len(found)} unpublished "
            f"director{'y' if len(found) == 1 else 'ies'} without {MANIFEST_NAME})"
        )
    results = []
    restorable = _Restorable(loc, model)
    for snap in published:
        path = join(loc.root, snap)
        try:
            manifest = verify_snapshot(loc.fs, path, use_cache=False)
            results.append(restorable.check(snap, manifest))
        except SnapshotError as err:
            file, reason = _first_damage(loc.fs, path) or (None, one_line(err))
            results.append(VerifyResult(name=snap, ok=False, file=file, reason=reason))
    return results
