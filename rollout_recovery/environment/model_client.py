"""One model call as the environment makes it: resolve the parent, supply its exact tokens,
call the worker, take the tokens from the best source, prove the supply, record the entry.

Order of a call: `LineageStore.resolve` runs once on the request as received; on RESOLVED
(and when supply is on and the parent ended its turn) the request carries
`required_prefix_token_ids`; the response's tokens come from `token_sources`; the entry
records `prefix_requested` always and `prefix_supplied` only when the returned prompt ids start
with the requested prefix. A worker that ignored the prefix fails the call closed. The entry
is durable in the sink before the call is recorded for lineage, so a child can only resolve to
a parent whose tokens are saved.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx

from rollout_recovery.environment.lineage import LineageStore, Resolution
from rollout_recovery.environment.token_entry import ParentResolution, TokenEntry
from rollout_recovery.environment.token_sink import TokenSink
from rollout_recovery.environment.token_sources import TokenSourceError, capture_tokens
from rollout_recovery.protocol import CallIdentity

PREFIX_FIELD = "required_prefix_token_ids"


class PrefixNotSuppliedError(RuntimeError):
    """The worker did not build the prompt from the required prefix."""


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
        **request_fields: Any,
    ) -> CallResult:
        resolution = self.lineage.resolve(rollout_id, messages)  # ValueError on bad messages
        self.diagnostics.add("calls.total", f"resolve.{resolution.reason or resolution.outcome}")
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
            # A parent cut by the length limit did not emit its end of turn; the chat template
            # closes its message with that token, so the prefix does too.
            closing = []
            if parent_finish == "length" and self.turn_end_token_id is not None:
                closing = [self.turn_end_token_id]
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
        choice = response["choices"][0]
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
        return CallResult(entry, response, assistant, resolution)

    def adopt(self, entry: TokenEntry, messages: list[dict], assistant: dict) -> None:
        """Register a call restored from a checkpoint, so its child resolves to it (and gets
        its exact tokens supplied) as if this client had made it."""
        self.lineage.record(
            entry.rollout_id, entry.model_call_id, messages, assistant, entry.cumulative_ids()
        )
        self._finish[(entry.rollout_id, entry.model_call_id)] = entry.finish_reason

    async def aclose(self) -> None:
        await self.client.aclose()
