"""One model call as the environment makes it: resolve the parent, supply its exact tokens,
call the worker, take the tokens from the best source, prove the supply, record the entry.

Order of a call: `LineageStore.resolve` runs once on the request as received; on RESOLVED
(and when supply is on and the parent ended its turn) the request carries
`required_prefix_token_ids`; the response's tokens come from `token_sources`; the entry
records `prefix_requested` always and `prefix_supplied` only when the returned prompt ids start
with the requested prefix. A worker that ignored the prefix fails the call closed. The entry
is durable in the sink before the call is recorded for lineage, so a child can only resolve to
a parent whose tokens are saved.

A call made as the next call of an episode (`continues`: the episode's earlier calls) must
continue them, since an episode's calls become one token sequence (its training row): a call
whose messages start another conversation or continue an earlier call than the latest is
refused before dispatch, and one whose prompt tokens do not hold every earlier call's generated
tokens where that sequence has them is refused once its tokens are known - before its entry is
saved or recorded for lineage, so the episode can make the call again, corrected
(`CallNotContinued`, counted as `not_continued.<reason>`).
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import httpx

from rollout_recovery.data_plane.spans import Span, check_spans
from rollout_recovery.environment.lineage import LineageStore, Resolution
from rollout_recovery.environment.token_entry import ParentResolution, TokenEntry
from rollout_recovery.environment.token_sink import TokenSink
from rollout_recovery.environment.token_sources import TokenSourceError, capture_tokens
from rollout_recovery.protocol import WEIGHT_VERSIONS_HEADER, CallIdentity, decode_spans

PREFIX_FIELD = "required_prefix_token_ids"


class PrefixNotSuppliedError(RuntimeError):
    """The worker did not build the prompt from the required prefix."""


class CallNotContinued(RuntimeError):
    """A call that does not continue its episode's previous call, so the episode's tokens could
    not form one sequence; `reason` names how. Nothing of the call was recorded."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ModelCallFailed(RuntimeError):
    """The worker answered a call with an HTTP error (`status`: 4xx refused the request)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"model call failed: {status} {text[:300]}")
        self.status, self.text = status, text


@dataclass
class CallResult:
    entry: TokenEntry
    response: dict
    assistant_message: dict
    resolution: Resolution
    response_text: str | None = None  # the response body as the worker returned it


class CaptureDiagnostics:
    """Counters safe under concurrent calls. They reach the run's counts as `capture.<event>`
    (controller/metrics.py), served by the controller's /metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()

    def add(self, *names: str) -> None:
        with self._lock:
            for n in names:
                self.counts[n] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


def turn_closing(tokens: Sequence[int], finish: str | None, end: int | None) -> list[int]:
    """The end-of-turn token a finished parent turn's tokens lack: one cut by the length limit,
    or stopped by another end-of-sequence id (Qwen3's <|endoftext|>), a stop token or a stop
    string, did not emit it, and the chat template closes its message with it, so a prefix
    supplied from those tokens does too."""
    if finish not in ("stop", "length") or end is None or (tokens and tokens[-1] == end):
        return []
    return [end]


class ModelCallClient:
    def __init__(
        self,
        base_url: str,
        model: str,
        sink: TokenSink,
        lineage: LineageStore,
        supply_prefix: bool = False,
        request_token_ids: bool = True,
        client: httpx.AsyncClient | None = None,
        turn_end_token_id: int | None = None,
        finish: dict[tuple[str, str], str | None] | None = None,
    ) -> None:
        self.base_url, self.model = base_url.rstrip("/"), model
        self.sink, self.lineage = sink, lineage
        self.supply_prefix, self.request_token_ids = supply_prefix, request_token_ids
        self.turn_end_token_id = turn_end_token_id
        # No cap on connections: every call in flight needs its own (httpx's default of 100
        # would hold the rest back in this process, uncut and undecoded).
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.client = client or httpx.AsyncClient(timeout=600, limits=limits)
        self.diagnostics = CaptureDiagnostics()
        # Parent finish reasons, by (rollout, call); shared by the clients of one environment,
        # so a call moved to another worker still gets its parent's exact prefix.
        self._finish: dict[tuple[str, str], str | None] = {} if finish is None else finish

    async def call(
        self,
        rollout_id: str,
        model_call_id: str,
        messages: list[dict],
        attempt: int = 0,
        *,
        continues: Sequence[TokenEntry] = (),
        **request_fields: Any,
    ) -> CallResult:
        """One call; `continues`: the calls of its episode it must continue, in order (none:
        any conversation, e.g. a fork)."""
        resolution = self.lineage.resolve(rollout_id, messages)  # ValueError on bad messages
        self.diagnostics.add("calls.total", f"resolve.{resolution.reason or resolution.outcome}")
        call = f"{rollout_id}/{model_call_id}"
        if continues:
            self._check_parent(call, resolution, continues[-1])
        request: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "logprobs": True,
            **copy.deepcopy(request_fields),
        }
        if self.request_token_ids:
            request["return_token_ids"] = True
        else:  # the /tokenize fallback reads generated ids from the logprob entries
            request["return_tokens_as_token_ids"] = True
        xargs = request.setdefault("vllm_xargs", {})
        xargs |= CallIdentity(rollout_id, model_call_id, attempt).to_xargs()
        prefix = None
        if resolution.outcome == ParentResolution.RESOLVED and self.supply_prefix:
            parent_finish = self._finish.get((rollout_id, resolution.parent_call_id))
            closing = turn_closing(resolution.parent_tokens, parent_finish, self.turn_end_token_id)
            if parent_finish == "stop" or closing:  # its tokens continue exactly
                prefix = [*resolution.parent_tokens, *closing]
                request[PREFIX_FIELD] = prefix
                self.diagnostics.add("supply.eligible")
            else:
                self.diagnostics.add("supply.ineligible_parent_unfinished")
        resp = await self.client.post(f"{self.base_url}/v1/chat/completions", json=request)
        if resp.status_code != 200:
            self.diagnostics.add("capture.http_error")
            raise ModelCallFailed(resp.status_code, resp.text)
        response_text = resp.text
        response = resp.json()
        try:
            bundle = await capture_tokens(self.client, self.base_url, request, response)
        except TokenSourceError:
            self.diagnostics.add("capture.failed")
            raise
        supplied = prefix is not None and bundle.prompt_token_ids[: len(prefix)] == prefix
        if prefix is not None and not supplied:
            self.diagnostics.add("supply.not_honoured")
            raise PrefixNotSuppliedError(
                f"the worker did not build {rollout_id}/{model_call_id}'s prompt from the "
                "required prefix (its prompt ids do not start with the parent's tokens); fix the "
                "worker, or set token_capture.supply_prefix_token_ids=false to disable supply"
            )
        if supplied:
            self.diagnostics.add("supply.supplied")
        if continues:
            self._check_prompt(call, bundle.prompt_token_ids, resolution, prefix, continues)
        choice = response["choices"][0]
        spans = self._spans(resp.headers.get(WEIGHT_VERSIONS_HEADER), bundle.generated_token_ids)
        entry = TokenEntry.build(
            rollout_id=rollout_id,
            model_call_id=model_call_id,
            attempt=attempt,
            prompt_token_ids=bundle.prompt_token_ids,
            generated_token_ids=bundle.generated_token_ids,
            generated_logprobs=bundle.logprobs,
            finish_reason=choice.get("finish_reason"),
            parent_call_id=resolution.parent_call_id,
            parent_resolution=resolution.outcome,
            resolution_reason=resolution.reason,
            prefix_requested=prefix is not None,
            prefix_supplied=supplied,
            generated_weight_versions=spans,
        )
        # Durable before any child can resolve to it; off the loop (a store put blocks).
        await asyncio.to_thread(self.sink.put, entry)
        assistant = {
            "role": "assistant",
            "content": choice["message"].get("content"),
            **({"tool_calls": choice["message"]["tool_calls"]}
               if choice["message"].get("tool_calls") else {}),
        }  # fmt: skip
        self.lineage.record(rollout_id, model_call_id, messages, assistant, entry.cumulative_ids())
        self._finish[(rollout_id, model_call_id)] = entry.finish_reason
        return CallResult(entry, response, assistant, resolution, response_text)

    def _spans(self, header: str | None, generated: list[int]) -> list[Span] | None:
        """The weight-version spans the worker reported for the generated tokens; None (and
        counted) when it reported none or ones that do not cover them."""
        if header is None:
            self.diagnostics.add("capture.weight_versions_missing")
            return None
        try:
            spans = decode_spans(header)
            check_spans(spans, 0, len(generated))
        except ValueError:
            self.diagnostics.add("capture.weight_versions_invalid")
            return None
        return spans

    def _refuse(self, reason: str, message: str) -> NoReturn:
        self.diagnostics.add(f"not_continued.{reason}")
        raise CallNotContinued(reason, message)

    def _check_parent(self, call: str, resolution: Resolution, latest: TokenEntry) -> None:
        """Before dispatch: a call that surely does not continue the latest call."""
        last = latest.model_call_id
        if resolution.outcome == ParentResolution.ROOT:
            self._refuse("conversation_restarted",
                         f"{call} has no assistant message, but its rollout already made calls up "
                         f"to {last}: a rollout is one conversation, so each call sends the "
                         f"previous call's messages with its answer appended ({last}'s); open "
                         "another rollout for another conversation")  # fmt: skip
        if resolution.outcome == ParentResolution.RESOLVED and resolution.parent_call_id != last:
            self._refuse("earlier_call_continued",
                         f"{call} continues {resolution.parent_call_id}, not its rollout's latest "
                         f"call {last}: a rollout is one conversation, so each call sends the "
                         f"previous call's messages with its answer appended ({last}'s); open "
                         "another rollout for another branch")  # fmt: skip

    def _check_prompt(
        self,
        call: str,
        prompt: list[int],
        resolution: Resolution,
        prefix: list[int] | None,
        continues: Sequence[TokenEntry],
    ) -> None:
        """Once the prompt's tokens are known: every earlier call's generated tokens must sit
        where the episode's one sequence has them (what its training row needs)."""
        for earlier in continues:
            start, gen = len(earlier.prompt_token_ids), earlier.generated_token_ids
            if prompt[start : start + len(gen)] != gen:
                break
        else:
            return
        latest = continues[-1]
        last = latest.model_call_id
        rerender = (
            "with token_capture.supply_prefix_token_ids=false the worker renders the conversation "
            "again, which need not reproduce the tokens the model generated"
        )
        if resolution.outcome != ParentResolution.RESOLVED:
            reason = "assistant_turn_changed"
            hint = (
                f"its last assistant message is not the one {last} returned, or the messages "
                "before it changed: send them back exactly as they were"
            )
            if self.supply_prefix:
                hint += f" (then {last}'s exact tokens are supplied)"
            else:
                hint += f", and set token_capture.supply_prefix_token_ids=true ({rerender})"
        else:
            reason = "prompt_not_continued"
            if not self.supply_prefix:
                hint = f"{rerender}, and here it did not: set it to true"
            elif prefix is None:
                hint = (
                    f"{last} stopped with finish_reason={latest.finish_reason!r} before the end "
                    "of its turn, so its tokens cannot be continued exactly: finish the rollout "
                    "here, or give its calls max_tokens enough to end their turn"
                )
            else:
                hint = f"the worker did not continue {last}'s exact tokens"
        self._refuse(
            reason,
            f"{call}: its prompt does not hold the tokens {earlier.model_call_id} generated, so "
            f"its rollout's calls cannot form one token sequence; {hint}. Nothing of this call "
            "was recorded: make it again, corrected",
        )

    def adopt(self, entry: TokenEntry, messages: list[dict], assistant: dict) -> None:
        """Register a call restored from a checkpoint, so its child resolves to it (and gets
        its exact tokens supplied) as if this client had made it."""
        self.lineage.record(
            entry.rollout_id, entry.model_call_id, messages, assistant, entry.cumulative_ids()
        )
        self._finish[(entry.rollout_id, entry.model_call_id)] = entry.finish_reason

    async def aclose(self) -> None:
        await self.client.aclose()
