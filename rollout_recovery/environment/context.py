"""EpisodeContext: what an episode function gets as `ctx` - durable execution by replay.

A user's episode is an ordinary loop, `async def episode(ctx, task) -> result`. Everything in
it that is not a pure function of its inputs goes through the context:

- `await ctx.chat(messages, **sampling)` - a model call (its tokens are captured, its parent
  resolved, the parent's exact tokens supplied);
- `await ctx.effect(name, fn, *args)` - a tool call or any side effect; `args` and the result
  must be JSON values;
- `ctx.random()` - randomness.

Each completed step is appended to the episode's journal with no await in between, so a
checkpoint (which reads journals between steps) holds each step whole or not at all. After a
restore the function runs again from the top: a step the journal holds is answered from it
(a model call without decoding, an effect without running), and the first step past the
journal is where real work resumes - a model call cut at the checkpoint continues from its
prefix. A step that asks for something else than the journal recorded (another kind, name,
messages or arguments) raises `JournalDiverged`: the episode starts over as a fresh attempt.

An effect that ran after the last checkpoint is not in the restored journal, so it runs again
on replay: an effect on state outside the episode must be idempotent under `ctx.effect_id`,
which is the same on every replay of the same step.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rollout_recovery.protocol import JournalStep

if TYPE_CHECKING:
    from rollout_recovery.environment.episode import EpisodeState
    from rollout_recovery.environment.token_entry import TokenEntry


class JournalDiverged(RuntimeError):
    """A replayed episode asked for another step than its journal recorded; `reason` names
    how (counted as `replay_diverged.<reason>`)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class NotJsonError(TypeError):
    """An effect's arguments or result, or a sampling field, is not a JSON value."""


@dataclass
class ChatReply:
    """A model call's answer, the same whether it was decoded, resumed or replayed."""

    message: dict  # the assistant message, to append to the conversation
    content: str  # its text ("" when none)
    finish_reason: str | None
    token_ids: list[int]  # the generated token ids
    response: dict | None = None  # the OpenAI response (kept for gateway calls)
    source: str = "decoded"  # decoded | resumed | journal
    call_id: str = ""
    attempt: int = 0
    response_text: str | None = None  # the response body as the worker returned it


def request_digest(kind: str, name: str, payload: Any) -> str:
    """The digest a journal step is matched by on replay (canonical JSON)."""
    try:
        text = json.dumps([kind, name, payload], sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as err:
        raise NotJsonError(f"{kind} {name!r}: its arguments are not JSON values ({err})") from None
    return hashlib.sha256(text.encode()).hexdigest()


def _json_value(value: Any, what: str) -> Any:
    """`value` as it comes back from a journal (a JSON round trip), or NotJsonError."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as err:
        raise NotJsonError(f"{what} is not a JSON value ({err})") from None


class ModelCalls(Protocol):
    """The environment's side of `ctx.chat`: a real call on the episode's worker, and the
    lineage of a call answered from the journal (so the next call's parent resolves)."""

    async def call(
        self, state: EpisodeState, messages: list[dict], request: dict
    ) -> tuple[ChatReply, TokenEntry]: ...

    def adopt(
        self, state: EpisodeState, entry: TokenEntry, messages: list[dict], message: dict
    ) -> None: ...


def reply_of(entry: TokenEntry, result: dict, source: str) -> ChatReply:
    """The reply a journaled call gives again. Its recorded response is the worker's body as
    text (a journal written before that kept the parsed object, with its keys sorted)."""
    message = result["message"]
    recorded = result.get("response")
    text = recorded if isinstance(recorded, str) else None
    response = json.loads(text) if text is not None else recorded
    return ChatReply(message, message.get("content") or "", entry.finish_reason,
                     list(entry.generated_token_ids), response, source, entry.model_call_id,
                     entry.attempt, text)  # fmt: skip


@dataclass
class EpisodeContext:
    """The `ctx` of one episode attempt; `calls` is the environment's model-call side."""

    state: EpisodeState
    calls: ModelCalls
    max_turns: int
    scratch_root: Path | None
    counts: Counter[str]  # the environment's counts
    settings: dict = field(default_factory=dict)  # environment.settings
    base_url: str | None = None  # this rollout's gateway base URL, when the gateway runs
    api_key: str | None = None  # the gateway's token
    effect_id: str | None = None  # while an effect runs: its stable id
    diverged: JournalDiverged | None = None  # set once a step diverged from the journal
    # The last step that raised into the function: ("chat", call id, None, error) or
    # ("effect", name, fn, error); the runner names the effect function, or the worker, by it.
    raised: tuple[str, str, Any, BaseException] | None = None

    @property
    def rollout_id(self) -> str:
        return self.state.rollout_id

    @property
    def task(self) -> dict:
        return self.state.task

    @property
    def seed(self) -> int:
        return self.state.seed

    @property
    def attempt(self) -> int:
        return self.state.attempt

    @property
    def scratch_dir(self) -> Path:
        """This episode's own directory on the environment's disk; it survives a crash, and a
        fresh start (after a divergence or a refused record) gets a new, empty one."""
        if self.scratch_root is None:
            raise RuntimeError(
                "this episode uses ctx.scratch_dir but no local scratch directory is configured: "
                "set environment.scratch_dir (needed when checkpointing.checkpoint_dir is remote)"
            )
        path = self.scratch_root / self.rollout_id / f"start-{self.state.restarts}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _replay(self, kind: str, name: str, digest: str) -> JournalStep | None:
        """The journal's step at this point when replaying, checked against the request."""
        st = self.state
        index = len(st.journal)
        if index >= len(st.replay):
            return None
        step = st.replay[index]
        if step.kind != kind:
            why = ("step_kind", f"step {index} was a {step.kind} ({step.name}), now a {kind}")
        elif step.name != name:
            why = ("step_name", f"step {index} was {step.name!r}, now {name!r}")
        elif step.request_sha256 != digest:
            why = ("step_request", f"step {index} ({name}) asks for other input")
        else:
            return step
        # Kept: the function may swallow the exception (a harness answered with an error).
        self.diverged = JournalDiverged(*why)
        raise self.diverged

    async def chat(
        self,
        messages: list[dict],
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        **fields: Any,
    ) -> ChatReply:
        """One model call. `fields` are further OpenAI / vLLM request fields (e.g. `tools`,
        `tool_choice`, `stop`, `ignore_eos`); they and the messages must be the same on
        replay."""
        st = self.state
        fields = {k: v for k, v in fields.items() if v is not None}
        keep_response = bool(fields.pop("keep_response", False))
        request = {"max_tokens": max_tokens, "temperature": temperature, **fields}
        call_id = f"c{len(st.turns)}"
        digest = request_digest("chat", call_id, {"messages": messages, "request": request})
        step = self._replay("chat", call_id, digest)
        if step is not None:
            entry = st.journaled_entry(step)
            self.calls.adopt(st, entry, messages, step.result["message"])
            st.record_chat(step, entry)
            self.counts["journal.chat_replayed"] += 1
            self.counts["restored_turn_tokens"] += len(entry.generated_token_ids)
            return reply_of(entry, step.result, "journal")
        sent = _json_value(messages, "messages")
        try:
            reply, entry = await self.calls.call(st, sent, request)
        except Exception as err:
            self.raised = ("chat", call_id, None, err)
            raise
        result = {"message": reply.message}
        if keep_response:  # the body as the worker returned it, so a replay answers the same
            text = reply.response_text
            result["response"] = text if text is not None else reply.response
        step = JournalStep(kind="chat", name=call_id, request_sha256=digest, result=result,
                           turn=len(st.turns))  # fmt: skip
        st.record_chat(step, entry)  # no await since the call returned: a turn boundary
        return reply

    async def effect(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` (sync or async) once for this step of the episode and return its
        result; on replay, the recorded result without running `fn`."""
        st = self.state
        digest = request_digest("effect", name, list(args))
        step = self._replay("effect", name, digest)
        if step is not None:
            st.journal.append(step)
            self.counts["effects.replayed"] += 1
            return step.result
        self.effect_id = f"{self.rollout_id}/start-{st.restarts}/step-{len(st.journal)}"
        try:
            value = fn(*args)
            if inspect.isawaitable(value):
                value = await value
            value = _json_value(value, f"the result of effect {name!r}")
        except Exception as err:
            self.raised = ("effect", name, fn, err)
            raise
        finally:
            self.effect_id = None
        st.journal.append(JournalStep(kind="effect", name=name, request_sha256=digest,
                                      result=value))  # fmt: skip
        self.counts["effects.executed"] += 1
        return value

    def random(self) -> float:
        """A uniform number in [0, 1), journaled (a replay gets the same one)."""
        st = self.state
        index = len(st.journal)
        digest = request_digest("random", "random", index)
        step = self._replay("random", "random", digest)
        if step is None:
            value = random.Random(f"{st.seed}/{st.restarts}/{index}").random()
            step = JournalStep(kind="random", name="random", request_sha256=digest, result=value)
        st.journal.append(step)
        return float(step.result)
