"""One episode (rollout) as the environment runs it, and its checkpoint record.

An episode is a conversation of up to `environment.max_turns` model calls. After every call
but the last, the environment's tool acts on the episode's state and its result is the next
message. The turns committed so far, the state, and (prefix level) the in-flight call's cut
continuation make the episode's record: restoring it re-admits the episode as attempt + 1
from its last committed turn, so no committed turn is decoded again and no tool effect is
applied twice. A record names each turn's TokenEntry by id and payload digest; the tokens
themselves are in the data plane's `token_entries` partition, in the same snapshot.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_recovery.data_plane import ReplayRow
from rollout_recovery.environment.token_entry import TokenEntry
from rollout_recovery.protocol import (
    EPISODE_RECORD_FORMAT,
    Continuation,
    EpisodeRecord,
    TurnRef,
    replay_key,
)


class ToolEffectRepeated(RuntimeError):
    """A tool was asked to act twice for the same turn of an episode."""


class RecordError(ValueError):
    """A record cannot be restored exactly; `reason` names why (counted by the caller)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class TrajectoryError(RuntimeError):
    """An episode's turns do not form one token sequence (the prefix was not supplied)."""


class TallyTool:
    """A tool with a side effect on environment state: it adds the digits of the model's
    reply (plus one) to the episode's tally and answers with the new tally. Repeating a turn
    would be visible in the tally, in every later prompt and in the reward."""

    name = "tally"

    def __init__(self) -> None:
        self.applications = 0  # effects applied by this environment process

    @staticmethod
    def initial_state() -> dict[str, Any]:
        return {"tally": 0, "effects": []}

    def apply(self, state: dict[str, Any], turn: int, reply: str) -> str:
        if turn in state["effects"]:
            raise ToolEffectRepeated(f"the {self.name} tool already acted for turn {turn}")
        state["tally"] += sum(c.isdigit() for c in reply) + 1
        state["effects"].append(turn)
        self.applications += 1
        return json.dumps({"tally": state["tally"]})


def call_seed(seed: int, turn: int) -> int:
    """The sampler seed of an episode's call `turn` (turn 0 uses the episode's own seed)."""
    if turn == 0:
        return seed
    digest = hashlib.sha256(f"{seed}/{turn}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


@dataclass
class TurnRecord:
    """A finished call: its token entry and where its messages sit in the conversation."""

    entry: TokenEntry
    request_messages: int  # the call's request was messages[:request_messages]


@dataclass
class Episode:
    rollout_id: str
    group_id: str
    generation_index: int
    seed: int
    messages: list[dict]
    state: dict[str, Any]
    attempt: int = 0
    turns: list[TurnRecord] = field(default_factory=list)
    continuation: Continuation | None = None  # the call in flight at the checkpoint

    @property
    def next_call_id(self) -> str:
        return f"c{len(self.turns)}"

    @classmethod
    def restart(cls, rec: EpisodeRecord, initial_state: dict[str, Any]) -> Episode:
        """The record's episode from its first prompt, with nothing kept (attempt preserved):
        what a record that cannot be restored exactly falls back to."""
        first = rec.turns[0].request_messages if rec.turns else len(rec.messages)
        return cls(**_identity(rec), messages=rec.messages[:first], state=initial_state)

    def replies(self) -> list[str]:
        return [self.messages[t.request_messages].get("content") or "" for t in self.turns]

    def to_record(self) -> EpisodeRecord:
        """The episode as it is now. Its messages and state are copied: the episode goes on
        (a call in flight at the checkpoint finishes, its tool acts) while the record is
        still on its way into the snapshot, which must hold this moment only."""
        turns = [
            TurnRef(
                entry_id=t.entry.entry_id,
                payload_sha256=t.entry.payload_sha256(),
                request_messages=t.request_messages,
            )
            for t in self.turns
        ]
        return EpisodeRecord(
            rollout_id=self.rollout_id,
            group_id=self.group_id,
            generation_index=self.generation_index,
            seed=self.seed,
            attempt=self.attempt,
            messages=copy.deepcopy(self.messages),
            state=copy.deepcopy(self.state),
            turns=turns,
            continuation=self.continuation,
        )

    @classmethod
    def from_record(
        cls, rec: EpisodeRecord, entries: Callable[[str], TokenEntry | None]
    ) -> Episode:
        """Rebuild an episode; `entries` looks a TokenEntry up by id. A missing entry or one
        whose payload differs from the committed one raises RecordError."""
        if rec.format != EPISODE_RECORD_FORMAT:
            raise RecordError("record_format", f"{rec.format!r} is not {EPISODE_RECORD_FORMAT}")
        turns = []
        for t in rec.turns:
            entry = entries(t.entry_id)
            if entry is None:
                raise RecordError("missing_entry", f"{t.entry_id} is not in the snapshot")
            if entry.payload_sha256() != t.payload_sha256:
                raise RecordError("entry_digest_mismatch", f"{t.entry_id} was changed")
            turns.append(TurnRecord(entry, t.request_messages))
        return cls(**_identity(rec), messages=rec.messages, state=rec.state, turns=turns,
                   continuation=rec.continuation)  # fmt: skip


def _identity(rec: EpisodeRecord) -> dict[str, Any]:
    """The fields that name a recorded episode and its attempt."""
    return rec.model_dump(include={"rollout_id", "group_id", "generation_index", "seed",
                                   "attempt"})  # fmt: skip


def replay_row(ep: Episode, reward: float, weight_version: int) -> ReplayRow:
    """The training row of a finished episode: the last call's prompt and generated tokens,
    with the loss mask and logprobs on every turn's generated tokens. Each turn's tokens must
    sit where the next call's prompt put them, otherwise the episode fails closed."""
    last = ep.turns[-1].entry
    ids = np.asarray(last.cumulative_ids(), np.int32)
    mask = np.zeros(len(ids), np.int8)
    logprobs = np.zeros(len(ids), np.float32)
    for t in ep.turns:
        e = t.entry
        start, gen = len(e.prompt_token_ids), e.generated_token_ids
        if ids[start : start + len(gen)].tolist() != gen:
            raise TrajectoryError(
                f"{ep.rollout_id}/{e.model_call_id}: its tokens are not in the final sequence; "
                "multi-turn episodes need token_capture.supply_prefix_token_ids=true"
            )
        mask[start : start + len(gen)] = 1
        logprobs[start : start + len(gen)] = e.generated_logprobs
    first = ep.turns[0].entry
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
        weight_version_min=weight_version,
        weight_version_max=weight_version,
    )
