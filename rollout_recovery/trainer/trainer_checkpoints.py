"""Trainer checkpoints in the loop's own format, kept by the run: written, paired, verified,
pruned.

A checkpoint `trainer/step-NNNNNN/` holds the files the training loop handed over (their bytes
are its own business: safetensors, torch.save, anything) and two files of the run's:
`step.json`, the step's log record (from which the step log is completed when a crash came
between the checkpoint and the log line), and `meta.json`, written last, naming every file's
sha256, the JSON `extra` the loop saved with them, and the checkpoint's digest (a sha256 over
the files' names and digests). A checkpoint is complete exactly when its meta exists and
every file matches it.

Pairing: each snapshot's ledger records the digest of the trainer checkpoint its rollouts
continue from (`Ledger.trainer_checkpoint`), so a restore takes the checkpoint of the
snapshot's step only when its digest is the recorded one; any other (missing, torn, rewritten
by another run) makes the snapshot unusable, and the restore falls back to an older one.
Writes go through the run's fenced `RunStorage` (a stale owner writes nothing here).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from rollout_recovery import faults
from rollout_recovery.crashpoints import crash_point
from rollout_recovery.errors import RecoveryError
from rollout_recovery.storage import RunStorage

FORMAT = 3
META = "meta.json"
STEP_RECORD = "step.json"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class TrainerCheckpointError(RecoveryError):
    """A trainer checkpoint is missing, incomplete or altered; the message is one line.
    `kind` says which: `missing` (no complete checkpoint of the step), `damaged` (unreadable,
    another format, or a file missing or failing its sha256) or `differs` (another checkpoint
    than the one the snapshot paired with it)."""

    def __init__(self, message: str, kind: str = "damaged") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class TrainerCheckpoint:
    """A verified trainer checkpoint, as the loop saved it."""

    step: int  # trainer steps done when it was saved
    files: dict[str, bytes]  # the loop's files, each matching its recorded sha256
    extra: dict  # the JSON the loop saved with them
    digest: str  # over the files' names and digests (what a snapshot's ledger records)


def trainer_dir(step: int) -> str:
    return f"trainer/step-{step:06d}"


def trainer_steps(storage: RunStorage) -> list[int]:
    """Steps with a complete trainer checkpoint (a meta.json), oldest first."""
    names = storage.list_dir("trainer")
    return sorted(
        int(n[5:])
        for n in names
        if n.startswith("step-") and n[5:].isdigit() and storage.exists(f"trainer/{n}/{META}")
    )


def checkpoint_digest(file_digests: dict[str, str]) -> str:
    lines = "".join(f"{name}\0{digest}\n" for name, digest in sorted(file_digests.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def check_files(files: dict[str, bytes]) -> None:
    """The loop's file names must be plain names that are not the run's own."""
    if not files:
        raise RecoveryError("save_checkpoint(files={}) has no files: pass the trainer state "
                            "as {name: bytes}")  # fmt: skip
    for name, data in files.items():
        if not isinstance(name, str) or not _NAME.match(name) or name in (META, STEP_RECORD):
            raise RecoveryError(
                f"save_checkpoint: file name {name!r} is not allowed; use plain names of "
                f"letters, digits, '.', '_' and '-' other than {META} and {STEP_RECORD}"
            )
        if not isinstance(data, bytes | bytearray | memoryview):
            raise RecoveryError(
                f"save_checkpoint: file {name!r} is {type(data).__name__}, not bytes; "
                "serialize it first (e.g. safetensors.torch.save(state_dict))"
            )


def save(
    storage: RunStorage, step: int, files: dict[str, bytes], extra: dict, record: dict | None
) -> dict:
    """Write the checkpoint of `step` (meta last); returns its meta. An earlier, partial write
    of the same step is first made incomplete (its meta removed), so old meta never vouches
    for new files."""
    check_files(files)
    try:
        extra_json = json.loads(json.dumps(extra))
    except (TypeError, ValueError) as err:
        raise RecoveryError(
            f"save_checkpoint: extra is not a JSON value ({err}); pass plain numbers, strings, "
            "lists and dicts"
        ) from None
    where = trainer_dir(step)
    digests = {name: hashlib.sha256(bytes(data)).hexdigest() for name, data in files.items()}
    meta = {"format": FORMAT, "step": step, "files": dict(sorted(digests.items())),
            "digest": checkpoint_digest(digests), "extra": extra_json}  # fmt: skip
    storage.delete_file(f"{where}/{META}")
    for name in sorted(files):
        storage.write_bytes(f"{where}/{name}", bytes(files[name]))
        crash_point("trainer_checkpoint_file")
    if record is not None:
        storage.write_bytes(f"{where}/{STEP_RECORD}", json.dumps(record).encode())
        crash_point("trainer_checkpoint_file")
    storage.write_bytes(f"{where}/{META}", json.dumps(meta, indent=1).encode())
    crash_point("trainer_checkpoint_file")
    return meta


def read_meta(storage: RunStorage, step: int) -> dict:
    """The meta of a complete checkpoint; TrainerCheckpointError when there is none."""
    where = trainer_dir(step)
    try:
        meta = json.loads(storage.read_bytes(f"{where}/{META}"))
    except FileNotFoundError:
        raise TrainerCheckpointError(
            f"the trainer checkpoint of step {step} ({storage.display(where)}) is missing or "
            "incomplete",
            kind="missing",
        ) from None
    except ValueError:
        raise TrainerCheckpointError(f"{storage.display(where)}/{META} is unreadable") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else None
        raise TrainerCheckpointError(
            f"{storage.display(where)} has format {got!r}; this version reads format {FORMAT}"
        )
    return meta


def read(storage: RunStorage, step: int) -> TrainerCheckpoint:
    """The checkpoint of `step`, every file verified against its meta."""
    meta = read_meta(storage, step)
    where = trainer_dir(step)
    files = {}
    for name, digest in meta["files"].items():
        try:
            data = storage.read_bytes(f"{where}/{name}")
        except FileNotFoundError:
            raise TrainerCheckpointError(f"{storage.display(where)}/{name} is missing") from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise TrainerCheckpointError(
                f"{storage.display(where)}/{name} fails its sha256 check (altered or torn)"
            )
        files[name] = data
    if checkpoint_digest(meta["files"]) != meta["digest"]:
        raise TrainerCheckpointError(f"{storage.display(where)}/{META} fails its digest check")
    return TrainerCheckpoint(step, files, meta["extra"], meta["digest"])


def check_paired(storage: RunStorage, step: int, digest: str | None) -> TrainerCheckpoint | None:
    """The trainer checkpoint a snapshot taken at `step` pairs with, checked as a restore needs
    it: complete, every file matching its meta, and its digest the one the snapshot's ledger
    recorded (`digest`). None at step 0 (the base weights: no checkpoint pairs with it);
    TrainerCheckpointError (with its `kind`) when it fails. A restore and `snapshots verify`
    both check with this."""
    if step == 0:
        return None
    if digest is None:
        raise TrainerCheckpointError(
            f"the snapshot records no trainer checkpoint for step {step} (taken by a loop that "
            "saved none through the run), so none can be paired with it",
            kind="missing",
        )
    checkpoint = read(storage, step)
    if checkpoint.digest != digest and not faults.active("pairing_disabled"):
        raise TrainerCheckpointError(
            f"the trainer checkpoint of step {step} ({storage.display(trainer_dir(step))}) has "
            f"digest {checkpoint.digest[:12]}, the snapshot was paired with {digest[:12]}",
            kind="differs",
        )
    return checkpoint


def read_step_record(storage: RunStorage, step: int) -> dict | None:
    """The log record a trainer checkpoint kept of its step (None when it kept none)."""
    try:
        return json.loads(storage.read_bytes(f"{trainer_dir(step)}/{STEP_RECORD}"))
    except (FileNotFoundError, ValueError):
        return None


def prune(storage: RunStorage, keep_latest_k: int, paired: list[int]) -> list[int]:
    """Delete trainer checkpoints no kept snapshot pairs with (`paired`: the steps of the
    published snapshots), never the newest; returns the steps deleted. Without snapshots
    (save_data_plane=false) nothing pairs: the newest k + 1 are kept."""
    steps = trainer_steps(storage)
    keep = {s for s in steps if s >= min(paired)} if paired else set(steps[-keep_latest_k - 1 :])
    doomed = [s for s in steps[:-1] if s not in keep]
    for step in doomed:
        storage.delete_dir(trainer_dir(step))
    return doomed
