"""Running episode functions on the real `EpisodeContext` with a scripted model in place of
the workers (pure logic: the engine path has its own tests)."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

from rollout_recovery.environment.context import ChatReply, EpisodeContext
from rollout_recovery.environment.episode import EpisodeState
from rollout_recovery.environment.token_entry import TokenEntry
from rollout_recovery.protocol import EpisodeRecord


def entry(call: str, prompt: list[int], gen: list[int], attempt: int = 0) -> TokenEntry:
    return TokenEntry.build(
        rollout_id="r-g0",
        model_call_id=call,
        attempt=attempt,
        prompt_token_ids=prompt,
        generated_token_ids=gen,
        generated_logprobs=[-0.5 - i for i in range(len(gen))],
        finish_reason="stop",
    )


class ScriptedModel:
    """The environment's model-call side with scripted replies; records what it decoded
    (call ids) and which journaled calls it adopted as lineage."""

    def __init__(self, replies: list[str]) -> None:
        self.replies = replies
        self.decoded: list[str] = []
        self.adopted: list[str] = []

    async def call(self, st: EpisodeState, messages: list[dict], request: dict):
        turn = len(st.turns)
        prompt = [*(st.turns[-1].cumulative_ids() if st.turns else [1, 2]), 3 + turn]
        made = entry(st.next_call_id, prompt, [10 + turn, 2], st.attempt)
        self.decoded.append(made.model_call_id)
        text = self.replies[turn]
        return ChatReply({"role": "assistant", "content": text}, text, "stop", [10 + turn, 2]), made

    def adopt(self, st, made, messages, message) -> None:
        self.adopted.append(made.model_call_id)


def run_episode(fn, st: EpisodeState, model, turns: int, scratch: Path | None = None,
                counts: Counter | None = None):  # fmt: skip
    ctx = EpisodeContext(st, model, turns, scratch, Counter() if counts is None else counts)
    return asyncio.run(fn(ctx, st.task))


def new_state(task: dict) -> EpisodeState:
    return EpisodeState("r-g0", "r", 0, 7, task)


def restored(st: EpisodeState, steps: int) -> EpisodeState:
    """`st` as a checkpoint after `steps` journal steps holds it, restored as attempt + 1
    (through the record's wire form, as a snapshot carries it)."""
    turns = sum(1 for s in st.journal[:steps] if s.kind == "chat")
    part = new_state(st.task)
    part.journal, part.turns = st.journal[:steps], st.turns[:turns]
    record = EpisodeRecord.model_validate_json(part.to_record(None).model_dump_json())
    return EpisodeState.from_record(record, {e.entry_id: e for e in st.turns}.get)
