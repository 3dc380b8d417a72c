"""The ownership log of a snapshot root: which controller may publish there (owner epochs).

Layout: `<root>/ownership/<slot:010d>.json`, one entry per slot, each created exactly once with
a create-only write (`filesystem.create_only`: a hard link locally, `If-None-Match: *` on S3).
Owner claims and snapshot publications share the one slot sequence:

* `claim` writes a `claim` entry with epoch 1 + the highest epoch in the log, at the next slot.
  Losing that slot to another claim raises OwnershipConflict; losing it to a publication
  retries at the next slot.
* a publication (`snapshot_io.publish_manifest`, last step) writes a `publish` entry naming
  the snapshot directory and its manifest's sha256 at the next slot after the newest one the
  writer read, after checking that no claim with a higher epoch (and no unreadable entry)
  follows its own claim; a lost create re-reads the log and checks again. A stale writer's
  create therefore either collides with the newer claim or comes after it, where it is
  refused: no clocks, no leases to time out.

Readers (`OwnershipLog.publications`) count a snapshot as published when a valid publish entry
names it and no claim with a higher epoch sits at a lower slot. Each entry carries a sha256
over its body and its own slot, so a torn or flipped entry is unreadable, never a different
entry. A writer without an owner (standalone stores, tests, benchmarks) publishes with
epoch 0, which any claim fences.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal

import pyarrow.fs as pafs
from pydantic import BaseModel, ConfigDict

from rollout_recovery import faults
from rollout_recovery.data_plane import filesystem
from rollout_recovery.data_plane.errors import OwnerFenced, OwnershipConflict, SnapshotError
from rollout_recovery.data_plane.filesystem import create_only  # called by this name here

__all__ = [
    "OWNERSHIP_DIR",
    "EntryBody",
    "Fence",
    "Owner",
    "OwnerFenced",
    "OwnerInfo",
    "OwnershipConflict",
    "OwnershipEntry",
    "OwnershipLog",
    "OwnershipWatch",
    "check_current",
    "claim",
    "publish_entry",
    "read_log",
]

OWNERSHIP_DIR = "ownership"
ENTRY_RE = re.compile(r"^(\d{10})\.json$")


class OwnerInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str
    pid: int
    claimed_at: str


class EntryBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    slot: int  # the entry's own slot: a copied or renamed entry does not verify
    kind: Literal["claim", "publish"]
    epoch: int
    snapshot: str | None = None  # the snapshot directory's name (publish)
    manifest_sha256: str | None = None  # its Manifest.sha256 (publish)
    owner: OwnerInfo


class OwnershipEntry(BaseModel):
    """One log entry: its body plus a sha256 over the body's canonical JSON."""

    model_config = ConfigDict(extra="forbid")

    body: EntryBody
    sha256: str


@dataclass(frozen=True)
class Owner:
    """A controller's claim on a snapshot root (picklable: it crosses into Ray actors)."""

    epoch: int
    slot: int  # the slot of its claim entry (0: no claim, epoch 0)
    host: str
    pid: int
    claimed_at: str

    @classmethod
    def of(cls, slot: int, body: EntryBody) -> Owner:
        return cls(body.epoch, slot, body.owner.host, body.owner.pid, body.owner.claimed_at)

    @property
    def info(self) -> OwnerInfo:
        return OwnerInfo(host=self.host, pid=self.pid, claimed_at=self.claimed_at)

    def describe(self) -> str:
        return (
            f"epoch {self.epoch} (host {self.host}, pid {self.pid}, claimed at "
            f"{self.claimed_at}, slot {self.slot})"
        )


_NO_OWNER = Owner(0, 0, "-", 0, "-")  # a writer without a claim


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _digest(body: EntryBody) -> str:
    canonical = json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def encode(body: EntryBody) -> bytes:
    return OwnershipEntry(body=body, sha256=_digest(body)).model_dump_json().encode()


def decode(raw: bytes, slot: int) -> EntryBody:
    """The body of a stored entry; ValueError saying why it is unreadable."""
    try:
        entry = OwnershipEntry.model_validate_json(raw)
    except ValueError as err:
        raise ValueError(f"not an ownership entry ({' '.join(str(err).split())[:120]})") from None
    if _digest(entry.body) != entry.sha256:
        raise ValueError("fails its sha256 check")
    if entry.body.slot != slot:
        raise ValueError(f"says slot {entry.body.slot}")
    return entry.body


def entry_name(slot: int) -> str:
    return f"{slot:010d}.json"


def log_dir(root: str) -> str:
    return filesystem.join(root, OWNERSHIP_DIR)


def _outranks(claim_epoch: int, epoch: int) -> bool:
    """Whether a claim of `claim_epoch` fences a writer of `epoch` (the one fencing rule,
    shared by writers and readers)."""
    return claim_epoch > epoch


@dataclass
class OwnershipLog:
    """What one read of the log found: valid entries and unreadable ones (slot -> reason)."""

    root: str
    entries: dict[int, EntryBody] = field(default_factory=dict)
    unreadable: dict[int, str] = field(default_factory=dict)

    @property
    def last_slot(self) -> int:
        return max([*self.entries, *self.unreadable], default=0)

    def claims(self) -> list[tuple[int, EntryBody]]:
        return sorted((s, b) for s, b in self.entries.items() if b.kind == "claim")

    def newest_claim(self) -> Owner | None:
        claims = self.claims()
        if not claims:
            return None
        slot, body = max(claims, key=lambda c: (c[1].epoch, c[0]))
        return Owner.of(slot, body)

    def max_epoch(self) -> int:
        """The highest epoch any entry may hold: an unreadable entry at slot s could be a
        claim of epoch at most s (epochs grow by one per claim, one claim per slot)."""
        return max([b.epoch for b in self.entries.values()] + list(self.unreadable), default=0)

    def fencing(self, owner: Owner) -> str | None:
        """Why `owner` may no longer publish or delete here (None: it may): a claim with a
        higher epoch anywhere, or an unreadable entry after its claim (it could be one)."""
        newer = [(s, b) for s, b in self.claims() if _outranks(b.epoch, owner.epoch)]
        if newer:
            slot, body = max(newer, key=lambda c: (c[1].epoch, c[0]))
            return f"a newer controller owns it: {Owner.of(slot, body).describe()}"
        bad = sorted(s for s in self.unreadable if s > owner.slot)
        if bad:
            slot = bad[0]
            return (
                f"its ownership log entry {OWNERSHIP_DIR}/{entry_name(slot)} (slot {slot}) is "
                f"unreadable ({self.unreadable[slot]}) and could be a newer controller's claim"
            )
        return None

    def publications(self) -> dict[str, tuple[int, EntryBody]]:
        """Snapshot name -> (slot, entry) of its publication, for every valid publish entry
        no claim of a higher epoch precedes (the newest such entry per name)."""
        out: dict[str, tuple[int, EntryBody]] = {}
        top = 0
        for slot in sorted(self.entries):
            body = self.entries[slot]
            if body.kind == "claim":
                top = max(top, body.epoch)
            elif body.snapshot is not None and not _outranks(top, body.epoch):
                out[body.snapshot] = (slot, body)
        return out

    def why_unpublished(self, name: str) -> str:
        """Why a snapshot directory holding a manifest does not count as published."""
        top, top_slot = 0, 0
        for slot in sorted(self.entries):
            body = self.entries[slot]
            if body.kind == "claim" and body.epoch > top:
                top, top_slot = body.epoch, slot
            elif body.snapshot == name:
                return (
                    f"not published: its publish entry {OWNERSHIP_DIR}/{entry_name(slot)} "
                    f"(epoch {body.epoch}) comes after the claim of epoch {top} at slot "
                    f"{top_slot}; a stale controller wrote it"
                )
        where = f"{OWNERSHIP_DIR}/"
        if self.unreadable:
            bad = ", ".join(f"{entry_name(s)} ({r})" for s, r in sorted(self.unreadable.items()))
            return (
                f"not published: its manifest is in place but no valid entry of {where} names "
                f"it; unreadable entries: {bad}"
            )
        return (
            f"not published: its manifest is in place but no entry of {where} names it (its "
            "controller stopped, or was fenced by a newer one, before publishing)"
        )


def read_log(
    fs: pafs.FileSystem, root: str, known: dict[int, EntryBody] | None = None
) -> OwnershipLog:
    """Every entry of the log under `root` (none when it has no log yet); `known`: entries
    read before (by slot), taken as they are instead of read again."""
    log = OwnershipLog(root)
    directory = log_dir(root)
    try:
        infos = fs.get_file_info(pafs.FileSelector(directory, allow_not_found=True))
    except OSError as err:
        raise SnapshotError(f"cannot list {directory}: {err}") from None
    for info in infos:
        m = ENTRY_RE.match(info.base_name)
        if info.type != pafs.FileType.File or not m:
            continue
        slot = int(m.group(1))
        if known is not None and slot in known:
            log.entries[slot] = known[slot]
            continue
        try:
            with fs.open_input_stream(info.path) as f:
                raw = f.read()
        except FileNotFoundError:
            continue  # pruned while listing
        except OSError as err:
            log.unreadable[slot] = f"cannot be read: {' '.join(str(err).split())[:120]}"
            continue
        try:
            log.entries[slot] = decode(raw, slot)
        except ValueError as err:
            log.unreadable[slot] = str(err)
    return log


# ---------------------------------------------------------------------------- claims, publishing


def _ensure_dir(fs: pafs.FileSystem, root: str) -> None:
    filesystem.make_dirs(fs, log_dir(root).rstrip("/"))


def claim(fs: pafs.FileSystem, root: str, first: bool = False) -> Owner:
    """Become the owner of `root`: a claim entry with epoch 1 + the highest in the log, at the
    next slot. Raises OwnershipConflict when another claim takes that slot first. `first` (a
    fresh run): only as the log's first entry - a root another run owns, or is claiming at the
    same moment, raises OwnershipConflict naming that run."""
    _ensure_dir(fs, root)
    info = OwnerInfo(host=socket.gethostname(), pid=os.getpid(), claimed_at=_now())
    log = read_log(fs, root)
    if first:
        return _first_claim(fs, root, log, info)
    while True:
        slot, epoch = log.last_slot + 1, log.max_epoch() + 1
        body = EntryBody(slot=slot, kind="claim", epoch=epoch, owner=info)
        if create_only(fs, filesystem.join(log_dir(root), entry_name(slot)), encode(body)):
            return Owner.of(slot, body)
        log = read_log(fs, root)
        taken = log.entries.get(slot)
        if taken is None or taken.kind == "claim":
            other = (
                Owner.of(slot, taken).describe()
                if taken is not None
                else f"slot {slot} ({log.unreadable.get(slot, 'unreadable')})"
            )
            raise OwnershipConflict(
                f"another controller claimed {root} at the same time: {other}; this "
                "controller stops without publishing or deleting anything"
            )


def _first_claim(fs: pafs.FileSystem, root: str, log: OwnershipLog, info: OwnerInfo) -> Owner:
    """The first claim of an empty log, at slot 1, or OwnershipConflict naming who has it."""
    if not log.entries and not log.unreadable:
        body = EntryBody(slot=1, kind="claim", epoch=1, owner=info)
        if create_only(fs, filesystem.join(log_dir(root), entry_name(1)), encode(body)):
            return Owner.of(1, body)
        log = read_log(fs, root)
    owner = log.newest_claim()
    who = owner.describe() if owner is not None else f"an entry of its log ({log_dir(root)})"
    raise OwnershipConflict(f"{root} is owned by another run: {who}")


def fenced_error(root: str, owner: Owner, why: str, doing: str) -> OwnerFenced:
    me = "without an owner claim (epoch 0)" if owner.epoch == 0 else owner.describe()
    return OwnerFenced(
        f"this controller, {me}, no longer owns the snapshots under {root}: {why}. It stops "
        f"without {doing}; the newer controller goes on"
    )


def check_current(log: OwnershipLog, owner: Owner | None, doing: str) -> None:
    """Raise OwnerFenced when `owner` (None: epoch 0) was fenced in `log`."""
    owner = owner or _NO_OWNER
    why = log.fencing(owner)
    if why is not None:
        raise fenced_error(log.root, owner, why, doing)


def prepare_publish(fs: pafs.FileSystem, root: str, owner: Owner | None) -> OwnershipLog:
    """Read the log before a publication: OwnerFenced if `owner` was fenced already (then the
    manifest is not even moved into place)."""
    log = read_log(fs, root)
    check_current(log, owner, "publishing or deleting anything")
    return log


def publish_entry(
    fs: pafs.FileSystem,
    root: str,
    owner: Owner | None,
    snapshot: str,
    manifest_sha256: str,
    log: OwnershipLog | None = None,
) -> int:
    """Write the publish entry of `snapshot` (the step that publishes it); returns its slot.
    Raises OwnerFenced (nothing published) when a newer claim, or an unreadable entry, comes
    after the owner's claim."""
    me = owner or _NO_OWNER
    _ensure_dir(fs, root)
    log = log if log is not None else read_log(fs, root)
    while True:
        check_current(log, me, "publishing or deleting anything")
        slot = max(log.last_slot, me.slot) + 1
        body = EntryBody(slot=slot, kind="publish", epoch=me.epoch, snapshot=snapshot,
                         manifest_sha256=manifest_sha256, owner=me.info)  # fmt: skip
        if create_only(fs, filesystem.join(log_dir(root), entry_name(slot)), encode(body)):
            return slot
        log = read_log(fs, root)


def prune(fs: pafs.FileSystem, log: OwnershipLog, below: int) -> list[str]:
    """Delete the entries at slots below `below`, never the newest claim; returns them."""
    newest = log.newest_claim()
    keep = newest.slot if newest is not None else None
    doomed = [
        filesystem.join(log_dir(log.root), entry_name(s))
        for s in sorted([*log.entries, *log.unreadable])
        if s < below and s != keep
    ]
    for path in doomed:
        try:
            fs.delete_file(path)
        except FileNotFoundError:
            continue
    return doomed


# ---------------------------------------------------------------------------- fenced writes


class Fence(BaseModel):
    """What a writer under a run's location carries to check, before each write, that its
    owner still owns the run: the snapshot root whose ownership log decides, and the owner's
    claim. A pydantic value: it crosses into the workers inside their config."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    root: str
    epoch: int
    slot: int
    host: str
    pid: int
    claimed_at: str

    @classmethod
    def of(cls, root: str, owner: Owner) -> Fence:
        return cls(root=root, epoch=owner.epoch, slot=owner.slot, host=owner.host,
                   pid=owner.pid, claimed_at=owner.claimed_at)  # fmt: skip

    @property
    def owner(self) -> Owner:
        return Owner(self.epoch, self.slot, self.host, self.pid, self.claimed_at)


class OwnershipWatch:
    """Checks a fence against the ownership log before each write. Entries are created once
    and never change, so a valid one is read once and kept; each check lists the log and reads
    only the slots it has not seen (a log is a handful of entries: retention prunes it)."""

    def __init__(self, fence: Fence) -> None:
        self.fence = fence
        self.fs, self.path = filesystem.resolve(fence.root)
        self._seen: dict[int, EntryBody] = {}

    def check(self, doing: str) -> None:
        """OwnerFenced (one line naming the newer owner) when a newer claim, or an unreadable
        entry after the owner's claim, is in the log."""
        if faults.active("fencing_disabled"):
            return
        log = read_log(self.fs, self.path, known=self._seen)
        self._seen = dict(log.entries)
        check_current(log, self.fence.owner, doing)
