"""The gateway backend's own refusals, with the episode context replaced by a scripted one
(pure logic; the real path is tests/engine/test_gateway_recovery.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from rollout_recovery.environment.context import ChatReply, JournalDiverged
from rollout_recovery.environment.gateway_backend import EpisodeGateway
from rollout_recovery.gateway import CallRefused, RolloutFinished, UnknownRollout

BODY = {"messages": [{"role": "user", "content": "hi"}], "logprobs": False}
RESPONSE = {"choices": [{"message": {"role": "assistant", "content": "ok"}, "token_ids": [1],
                         "logprobs": {"content": []}}], "prompt_token_ids": [5]}  # fmt: skip


class HeldContext:
    """A rollout's ctx.chat that stays in flight until released, or diverges."""

    def __init__(self, diverge: bool = False) -> None:
        self.release, self.diverge = asyncio.Event(), diverge

    async def chat(self, messages, **fields) -> ChatReply:
        if self.diverge:
            raise JournalDiverged("step_request", "step 0 (c0) asks for other input")
        await self.release.wait()
        return ChatReply(RESPONSE["choices"][0]["message"], "ok", "stop", [1], RESPONSE,
                         "journal", "c0", 1)  # fmt: skip


def test_one_call_at_a_time_per_rollout_and_named_refusals():
    async def scenario() -> None:
        held = HeldContext()
        runner = SimpleNamespace(contexts={"r": held, "d": HeldContext(diverge=True)},
                                 finished={"f"}, opened_outside=lambda rid: False)  # fmt: skip
        gateway = EpisodeGateway(runner, asyncio.get_running_loop())
        first = asyncio.create_task(gateway._chat("r", dict(BODY)))
        await asyncio.sleep(0.01)
        with pytest.raises(CallRefused) as busy:  # refused at once, not queued behind it
            async with asyncio.timeout(5):
                await gateway._chat("r", dict(BODY))
        assert busy.value.reason == "call_in_progress"
        held.release.set()
        reply = await first
        assert reply.headers == {"x-rollout-recovery-source": "journal",
                                 "x-rollout-recovery-call-id": "c0",
                                 "x-rollout-recovery-attempt": "1"}  # fmt: skip
        # What the environment asked for on its own behalf is not passed on.
        assert "prompt_token_ids" not in reply.response
        assert reply.response["choices"][0]["logprobs"] is None
        with pytest.raises(CallRefused) as diverged:
            await gateway._chat("d", dict(BODY))
        assert diverged.value.reason == "replay_diverged"
        with pytest.raises(RolloutFinished):
            await gateway._chat("f", dict(BODY))
        with pytest.raises(UnknownRollout):
            await gateway._chat("nobody", dict(BODY))
        # A refused call leaves the rollout free for the next one.
        again = asyncio.create_task(gateway._chat("r", dict(BODY)))
        assert (await again).headers["x-rollout-recovery-source"] == "journal"

    asyncio.run(scenario())
