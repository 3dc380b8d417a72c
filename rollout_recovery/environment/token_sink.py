"""Durable, idempotent TokenEntry sinks: the StagingStore, or an append-only JSONL file.

`put` returns only once the entry is durable (fsynced line, or acknowledged store put).
Putting the identical record again is a no-op; a different record under the same id is an
error, never an overwrite. `mark_incomplete` records a lost call so it is never silently
dropped.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa

from rollout_recovery.data_plane.schemas import TOKEN_ENTRY_ROW_SCHEMA, list_array, list_rows
from rollout_recovery.environment.token_entry import TokenEntry, read_token_entry
from rollout_recovery.errors import RecoveryError
from rollout_recovery.protocol import incomplete_key, is_incomplete_key


class ConflictingEntryError(RecoveryError, ValueError):
    """A different TokenEntry already exists under this id: the location's records name this
    call otherwise (a restore under other settings than the run's, which run_settings.py
    refuses first, or a bug). One line, like every RecoveryError."""


class TokenSink(Protocol):
    def put(self, entry: TokenEntry) -> bool: ...  # True if written, False if already there
    def get(self, entry_id: str) -> TokenEntry | None: ...
    def get_many(self, entry_ids: list[str]) -> dict[str, TokenEntry]: ...  # the ones found
    def mark_incomplete(self, rollout_id: str, model_call_id: str, reason: str) -> None: ...
    def incomplete(self) -> list[tuple[str, str, str]]: ...


def _conflict(entry_id: str) -> ConflictingEntryError:
    return ConflictingEntryError(
        f"a different TokenEntry already exists for {entry_id}: the run's records hold this "
        "call with other tokens, and entries are immutable (a regenerated call takes a new "
        "attempt number); nothing was overwritten. Continue the run with the settings it was "
        "started with (`train --restore`), or start a new run in another "
        "checkpointing.checkpoint_dir"
    )


class JsonlTokenSink:
    """One JSON object per line, fsynced per put; reloaded (and indexed) on open."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._entries: dict[str, TokenEntry] = {}
        self._sha: dict[str, str] = {}
        self._incomplete: dict[tuple[str, str], str] = {}
        self.torn_tail = False
        self._load()
        self._fh = open(self.path, "ab")  # noqa: SIM115 - kept open for appends

    def _load(self) -> None:
        if not self.path.exists():
            return
        lines = self.path.read_bytes().split(b"\n")
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                if i == len(lines) - 1:  # a crash mid-append: the last line is torn
                    self.torn_tail = True
                    continue
                raise ValueError(f"{self.path}:{i + 1} is not JSON") from None
            if rec.get("kind") == "incomplete":
                self._incomplete[(rec["rollout_id"], rec["model_call_id"])] = rec["reason"]
                continue
            entry = read_token_entry(rec["entry"])
            self._entries[entry.entry_id] = entry
            self._sha[entry.entry_id] = entry.payload_sha256()
        if self.torn_tail:
            # Drop the torn bytes so the next append starts on a clean line.
            good = b"\n".join(lines[:-1]) + b"\n"
            with open(self.path, "r+b") as fh:
                fh.truncate(len(good))

    def _append(self, record: dict) -> None:
        self._fh.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def put(self, entry: TokenEntry) -> bool:
        sha = entry.payload_sha256()
        with self._lock:
            old = self._sha.get(entry.entry_id)
            if old is not None:
                if old != sha:
                    raise _conflict(entry.entry_id)
                return False
            self._append({"kind": "entry", "entry": entry.model_dump(mode="json")})
            self._entries[entry.entry_id] = entry
            self._sha[entry.entry_id] = sha
            return True

    def get(self, entry_id: str) -> TokenEntry | None:
        with self._lock:
            return self._entries.get(entry_id)

    def get_many(self, entry_ids: list[str]) -> dict[str, TokenEntry]:
        with self._lock:
            return {i: self._entries[i] for i in entry_ids if i in self._entries}

    def mark_incomplete(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        with self._lock:
            self._append({"kind": "incomplete", "rollout_id": rollout_id,
                          "model_call_id": model_call_id, "reason": reason})  # fmt: skip
            self._incomplete[(rollout_id, model_call_id)] = reason

    def incomplete(self) -> list[tuple[str, str, str]]:
        with self._lock:
            return [(r, c, why) for (r, c), why in self._incomplete.items()]

    def close(self) -> None:
        self._fh.close()


class StoreTokenSink:
    """TokenEntries as typed rows in a StagingStore partition (snapshotted with the store)."""

    def __init__(self, store, partition: str = "token_entries") -> None:
        self.store, self.partition = store, partition

    @staticmethod
    def _row(entry: TokenEntry | None, key: str, rollout: str, call: str, meta: dict) -> pa.Table:
        e = entry
        payload = json.dumps(meta, sort_keys=True, separators=(",", ":"))
        return pa.Table.from_arrays(
            [
                pa.array([key]),
                pa.array([rollout]),
                pa.array([call]),
                pa.array([e is None]),
                list_array([np.asarray(e.prompt_token_ids if e else [], np.int32)], "int32"),
                list_array([np.asarray(e.generated_token_ids if e else [], np.int32)], "int32"),
                list_array([np.asarray(e.generated_logprobs if e else [], np.float32)], "float32"),
                pa.array([payload]),
                pa.array([e.payload_sha256() if e else ""]),
            ],
            schema=TOKEN_ENTRY_ROW_SCHEMA,
        )

    def put(self, entry: TokenEntry) -> bool:
        key = entry.entry_id
        existing = self._get_table(key)
        if existing is not None:
            if existing.column("payload_sha256")[0].as_py() != entry.payload_sha256():
                raise _conflict(key)
            return False
        meta = entry.model_dump(
            mode="json", exclude={"prompt_token_ids", "generated_token_ids", "generated_logprobs"}
        )
        self.store.put(self.partition, self._row(entry, key, entry.rollout_id,
                                                 entry.model_call_id, meta))  # fmt: skip
        return True

    def _get_table(self, key: str) -> pa.Table | None:
        table, missing = self.store.get(self.partition, [key])
        return None if missing else table

    def get(self, entry_id: str) -> TokenEntry | None:
        return self.get_many([entry_id]).get(entry_id)

    def get_many(self, entry_ids: list[str]) -> dict[str, TokenEntry]:
        """The entries found, in one store round trip (a restore reads many)."""
        if not entry_ids:
            return {}
        table, _ = self.store.get(self.partition, list(dict.fromkeys(entry_ids)))
        arrays = {
            n: list_rows(table, n)
            for n in ("prompt_token_ids", "generated_token_ids", "generated_logprobs")
        }
        keys, records = table.column("key").to_pylist(), table.column("record_json").to_pylist()
        return {
            key: read_token_entry(json.loads(rec) | {n: a[i].tolist() for n, a in arrays.items()})
            for i, (key, rec) in enumerate(zip(keys, records, strict=True))
        }

    def mark_incomplete(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        key = incomplete_key(rollout_id, model_call_id)
        meta = {"reason": reason}
        self.store.put(self.partition, self._row(None, key, rollout_id, model_call_id, meta))

    def incomplete(self) -> list[tuple[str, str, str]]:
        keys = [k for k in self.store.list(self.partition) if is_incomplete_key(k)]
        if not keys:
            return []
        table, _ = self.store.get(self.partition, keys)
        reasons = [json.loads(j)["reason"] for j in table.column("record_json").to_pylist()]
        return list(
            zip(table.column("rollout_id").to_pylist(), table.column("model_call_id").to_pylist(),
                reasons, strict=True)
        )  # fmt: skip
