"""One episode (rollout) as the environment runs it, and its checkpoint record.

An episode is a run of the configured episode function (environment/context.py). Its
`EpisodeState` is the one object that holds the unit of work: identity, task, attempt, the
journal of completed steps, the token entry of every model call, and - after a restore - the
journal being replayed and the in-flight call's cut continuation. A record names each call's
TokenEntry by id and payload digest; the tokens themselves are in the data plane's
`token_entries` partition, in the same snapshot.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_recovery.data_plane import ReplayRow
from rollout_recovery.data_plane.spans import Span, shifted, version_range
from rollout_recovery.environment.context import JournalDiverged
from rollout_recovery.environment.token_entry import TokenEntry
from rollout_recovery.protocol import (
    EPISODE_RECORD_FORMAT,
    Continuation,
    EpisodeRecord,
    JournalStep,
    TurnRef,
    replay_key,
)


class RecordError(ValueError):
    """A record cannot be restored exactly; `reason` names why (counted by the caller)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class TrajectoryError(RuntimeError):
    """An episode's turns do not form one token sequence (the prefix was not supplied)."""


def call_seed(seed: int, turn: int) -> int:
    """The sampler seed of an episode's call `turn` (turn 0 uses the episode's own seed)."""
    if turn == 0:
        return seed
    digest = hashlib.sha256(f"{seed}/{turn}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


@dataclass
class EpisodeState:
    rollout_id: str
    group_id: str
    generation_index: int
    seed: int
    task: dict[str, Any]
    attempt: int = 0
    restarts: int = 0
    journal: list[JournalStep] = field(default_factory=list)  # completed steps, in order
    turns: list[TokenEntry] = field(default_factory=list)  # each model call's entry
    replay: list[JournalStep] = field(default_factory=list)  # a restored journal to answer from
    replay_turns: list[TokenEntry] = field(default_factory=list)  # its calls' entries
    continuation: Continuation | None = None  # the call in flight at the checkpoint
    worker: int = 0  # the index of the worker its calls go to
    decoded: int = 0  # tokens the engines decoded for it in this run
    started_over: bool = False  # waiting after its replay diverged: nothing to replay

    @property
    def next_call_id(self) -> str:
        return f"c{len(self.turns)}"

    def record_chat(self, step: JournalStep, entry: TokenEntry) -> None:
        """A finished model call joins the journal and the turns together."""
        self.journal.append(step)
        self.turns.append(entry)

    def journaled_entry(self, step: JournalStep) -> TokenEntry:
        if step.turn is None or not 0 <= step.turn < len(self.replay_turns):
            raise JournalDiverged("journal_turn", f"{step.name} names no committed call")
        return self.replay_turns[step.turn]

    def fresh_start(self, started_over: bool = False) -> EpisodeState:
        """The episode from the top with nothing kept, as the next attempt: what a record that
        cannot be replayed exactly falls back to (`started_over`: one stopped from outside,
        waiting to be opened again)."""
        return EpisodeState(self.rollout_id, self.group_id, self.generation_index, self.seed,
                            self.task, self.attempt + 1, self.restarts + 1, worker=self.worker,
                            started_over=started_over)  # fmt: skip

    def to_record(self, continuation: Continuation | None) -> EpisodeRecord:
        """The episode as it is now: its completed steps (copied: the episode goes on while
        the record is on its way into the snapshot, which must hold this moment only). While
        a restored episode has not replayed its journal yet, its record is the restored one."""
        journal, turns = self.journal, self.turns
        if len(self.replay) > len(self.journal):
            journal, turns = self.replay, self.replay_turns
        return EpisodeRecord(
            rollout_id=self.rollout_id,
            group_id=self.group_id,
            generation_index=self.generation_index,
            seed=self.seed,
            attempt=self.attempt,
            restarts=self.restarts,
            task=copy.deepcopy(self.task),
            journal=[s.model_copy(deep=True) for s in journal],
            turns=[TurnRef(entry_id=e.entry_id, payload_sha256=e.payload_sha256()) for e in turns],
            continuation=continuation,
        )

    @classmethod
    def from_record(cls, rec: EpisodeRecord, entries, step: int = 1) -> EpisodeState:
        """The restored episode, to replay as attempt + `step` (distinct per restore of one
        record); `entries` looks a TokenEntry up by id. A missing entry or one whose payload
        differs from the committed one raises RecordError."""
        if rec.format != EPISODE_RECORD_FORMAT:
            raise RecordError("record_format", f"{rec.format!r} is not {EPISODE_RECORD_FORMAT}")
        turns = []
        for t in rec.turns:
            entry = entries(t.entry_id)
            if entry is None:
                raise RecordError("missing_entry", f"{t.entry_id} is not in the snapshot")
            if entry.payload_sha256() != t.payload_sha256:
                raise RecordError("entry_digest_mismatch", f"{t.entry_id} was changed")
            turns.append(entry)
        return cls(**_identity(rec), attempt=rec.attempt + step, restarts=rec.restarts,
                   replay=list(rec.journal), replay_turns=turns,
                   continuation=rec.continuation)  # fmt: skip

    @classmethod
    def restart(cls, rec: EpisodeRecord, step: int = 1) -> EpisodeState:
        """A record's episode from the top, nothing kept, as a fresh start (attempt + `step`)."""
        return cls(**_identity(rec), attempt=rec.attempt + step, restarts=rec.restarts + 1)


def _identity(rec: EpisodeRecord) -> dict[str, Any]:
    """The fields that name a recorded episode and its task."""
    return rec.model_dump(include={"rollout_id", "group_id", "generation_index", "seed",
                                   "task"})  # fmt: skip


def replay_row(
    ep: EpisodeState, reward: float, weight_version: int, result_json: str | None = None
) -> ReplayRow:
    """The training row of a finished episode: the last call's prompt and generated tokens,
    with the loss mask, logprobs and weight-version spans on every turn's generated tokens.
    Each turn's tokens must sit where the next call's prompt put them, otherwise the episode
    fails closed. Without spans from every call, the row records `weight_version` (the one the
    episode started on) as its oldest and newest version and no spans."""
    if not ep.turns:
        raise TrajectoryError(f"{ep.rollout_id}: the episode function made no model call")
    last = ep.turns[-1]
    ids = np.asarray(last.cumulative_ids(), np.int32)
    mask = np.zeros(len(ids), np.int8)
    logprobs = np.zeros(len(ids), np.float32)
    spans: list[Span] | None = []
    for e in ep.turns:
        start, gen = len(e.prompt_token_ids), e.generated_token_ids
        if ids[start : start + len(gen)].tolist() != gen:
            raise TrajectoryError(
                f"{ep.rollout_id}/{e.model_call_id}: its tokens are not in the final sequence; "
                "multi-turn episodes need token_capture.supply_prefix_token_ids=true"
            )
        mask[start : start + len(gen)] = 1
        logprobs[start : start + len(gen)] = e.generated_logprobs
        if spans is not None and e.generated_weight_versions is not None:
            spans += shifted(e.generated_weight_versions, start)
        else:
            spans = None
    oldest, newest = version_range(spans or []) or (weight_version, weight_version)
    first = ep.turns[0]
    return ReplayRow(
        key=replay_key(ep.group_id, ep.generation_index),
        rollout_id=ep.rollout_id,
        group_id=ep.group_id,
        generation_index=ep.generation_index,
        prompt_len=len(first.prompt_token_ids),
        token_ids=ids,
        loss_mask=mask,
        logprobs=logprobs,
        reward=reward,
        weight_version_min=oldest,
        weight_version_max=newest,
        weight_versions=spans,
        result_json=result_json,
    )
