"""Token capture: observe every identified call's progress inside a running AsyncLLM.

`vllm_compat.hook_output_processor` calls this registry from the engine's output processor
(admitted, added, stepped, swept), under the registry's lock. Requests carry their identity in
the OpenAI body's `vllm_xargs` (protocol.py), which vLLM passes through as
`SamplingParams.extra_args`. Each call keeps a progress reader over its request (generated
ids and sampled logprobs, both append-only), so a cut copies only tokens past what was
already staged. Nothing here reads vLLM state itself: tests drive it with a fake reader.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_recovery.data_plane.digest import CHAIN_ROOT
from rollout_recovery.data_plane.spans import Span, from_starts, resumed
from rollout_recovery.generation.attempts import AttemptLog
from rollout_recovery.generation.vllm_compat import AddedRequest, ProgressReader, Step
from rollout_recovery.protocol import CallIdentity, identity_from_extra_args


@dataclass
class CapturedCall:
    """What the worker knows about one in-flight (or just finished) call."""

    identity: CallIdentity
    request_id: str
    reader: ProgressReader  # its request's progress (kept after vLLM frees it)
    prompt_token_ids: np.ndarray
    max_tokens: int | None
    uncuttable: str | None
    weight_version: int
    staged_tokens: int = 0
    chunk_keys: list[str] = field(default_factory=list)
    superseded_keys: list[str] = field(default_factory=list)  # a resumed attempt's old chunks
    durable_floor: int = 0  # tokens durable in those old chunks (a resumed call's prefix)
    chain_digest: bytes = CHAIN_ROOT
    prefix_spans: list[Span] = field(default_factory=list)  # a resumed call's prefix's versions
    staged_at: float = field(default_factory=time.monotonic)  # its last row (or its start)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or stop string
    finish_staged: bool = False  # a chunk sealed with the finish record is durable
    terminal_staged: bool = False
    # Deleting the rows of a cut that missed its deadline: the next cut of this call reuses
    # their keys, so it must not stage until this is done.
    cleanup: asyncio.Future | None = None

    def finish_record(self) -> tuple[str, str | None] | None:
        """(finish_reason, stop_reason as JSON) once the call finished, else None. Read it
        under the capture lock together with `progress()`: both then describe one moment."""
        if not self.finished:
            return None
        stop = None if self.stop_reason is None else json.dumps(self.stop_reason)
        return self.finish_reason or "stop", stop

    def num_generated(self) -> int:
        return self.reader.num_generated()

    def spans(self, n: int) -> list[Span]:
        """The weight-version spans of its first `n` tokens: a resumed call's prefix keeps its
        own, the rest are the engine's (the version of the step that sampled each token; the
        version the call started on where the engine reported none)."""
        starts = [(int(v), s) for v, s in self.reader.weight_version_starts() if str(v).isdigit()]
        tail = from_starts(starts, n, self.weight_version)
        if not self.prefix_spans:
            return tail
        return resumed(self.prefix_spans, tail, self.durable_floor, n)

    def not_durable(self, count: int) -> int:
        """Of `count` tokens, how many are in no staged row yet (its own chain's, or, for a
        resumed call, the earlier attempt's rows it was resumed from)."""
        return max(0, count - max(self.staged_tokens, self.durable_floor))

    def progress(self) -> tuple[int, Sequence[int]]:
        """(tokens so far, the generated-ids list). Take it under the capture lock: the first
        n entries never change afterwards and can be copied once the lock is released."""
        return self.reader.progress()

    def generated_ids(self, start: int, end: int, ids: Sequence[int] | None = None) -> np.ndarray:
        ids = self.reader.progress()[1] if ids is None else ids
        return np.asarray(ids[start:end], dtype=np.int32)

    def sampled_logprobs(self, start: int, end: int) -> np.ndarray | None:
        """Sampled-token logprobs of positions [start, end), or None when the call has none.
        Append-only, read without the lock."""
        return self.reader.sampled_logprobs(start, end)


class TokenCapture:
    """Registry of identified calls, kept by the output-processor hooks of one AsyncLLM (an
    `OutputObserver` of vllm_compat)."""

    def __init__(
        self,
        on_finished: Callable[[CapturedCall], None],
        force_flat_logprobs: bool = True,
        max_attempt_records: int = 100_000,
        classify: Callable[[Any], str | None] = lambda params: None,
    ) -> None:
        self.lock = threading.Lock()
        self.attempts = AttemptLog(max_attempt_records)  # what the engine did, per attempt
        self.calls: dict[CallIdentity, CapturedCall] = {}
        self.completed: OrderedDict[CallIdentity, None] = OrderedDict()  # terminal rows staged
        # The spans of each finished call, until its response takes them (bounded).
        self.finished_spans: OrderedDict[CallIdentity, list[Span]] = OrderedDict()
        self.by_request: dict[str, CapturedCall] = {}
        self.on_finished = on_finished
        self.force_flat_logprobs = force_flat_logprobs
        self.weight_version = 0
        self.classify = classify  # the reason a call's params make it uncuttable, or None
        self.on_added: Callable[[CapturedCall, AddedRequest], None] | None = None
        # Called under the lock with the calls that just got new tokens (the token log's nudge).
        self.on_stepped: Callable[[list[CapturedCall]], None] | None = None

    # ------------------------------------------------------------------ observer hooks

    def admit(self, params) -> CallIdentity | None:
        """Runs before vLLM builds the request's state and before the engine sees it."""
        identity = identity_from_extra_args(params.extra_args)
        if identity is not None:
            self.prepare_params(params, self.force_flat_logprobs)
        return identity

    @staticmethod
    def prepare_params(params, flat: bool) -> None:
        """Make an identified request's engine state capturable (invisible to the caller:
        the OpenAI layer decides from the HTTP request whether to return logprobs)."""
        if params.logprobs is None:
            params.logprobs = 0
        if flat:
            params.flat_logprobs = True

    def added(self, identity: CallIdentity, request: AddedRequest) -> None:
        """Runs under the lock right after vLLM created the request's state."""
        if request.progress is None:
            return
        old = self.calls.get(identity)
        if old is not None and not old.finished:
            # The same call again (client retry): the newest request is the one to follow.
            self.by_request.pop(old.request_id, None)
        call = CapturedCall(
            identity=identity,
            request_id=request.request_id,
            reader=request.progress,
            prompt_token_ids=np.asarray(request.prompt_token_ids, dtype=np.int32),
            max_tokens=request.params.max_tokens,
            # n>1 children share the call's identity and carry n=1 themselves.
            uncuttable="n_greater_than_1" if request.is_child else self.classify(request.params),
            weight_version=self.weight_version,
        )
        if self.on_added is not None:
            self.on_added(call, request)
        self.calls[identity] = call
        self.by_request[request.request_id] = call
        self.attempts.started(identity)

    def stepped(self, steps: list[Step]) -> None:
        """Count each followed request's newly sampled tokens (the engine core's own
        outputs), then hand on the calls that finished."""
        progressed = []
        for step in steps:
            call = self.by_request.get(step.request_id)
            if call is None:
                continue
            self.attempts.decoded(call.identity, step.new_tokens)
            progressed.append(call)
            if not step.finished:
                continue
            del self.by_request[step.request_id]
            reason, stop = None, step.stop_reason
            delivered = call.reader.delivered_finish()
            if delivered is not None:
                reason, stop = delivered
            reason = reason or step.finish_reason
            self.attempts.finished(call.identity, reason)
            if reason == "abort":
                self.calls.pop(call.identity, None)
                continue
            call.finished, call.finish_reason, call.stop_reason = True, reason, stop
            self.keep_spans(call.identity, call.spans(call.num_generated()))
            self.on_finished(call)
        if progressed and self.on_stepped is not None:
            self.on_stepped(progressed)

    def clear(self) -> int:
        """Forget every call (a restore that keeps the engine, once its requests were
        aborted); an attempt still open is recorded `abort`. The attempt records stay: they
        are the engine's evidence across the restore. Returns the calls forgotten."""
        with self.lock:
            n = len(self.calls)
            for call in self.calls.values():
                if not call.finished:
                    self.attempts.finished(call.identity, "abort")
            self.calls.clear()
            self.by_request.clear()
            self.completed.clear()
            self.finished_spans.clear()
        return n

    def swept(self, is_live: Callable[[str], bool]) -> None:
        """After an abort: calls whose request vLLM dropped are gone."""
        for rid in [r for r in self.by_request if not is_live(r)]:
            call = self.by_request.pop(rid)
            self.attempts.finished(call.identity, "abort")
            if self.calls.get(call.identity) is call:
                del self.calls[call.identity]

    def keep_spans(self, identity: CallIdentity, spans: list[Span]) -> None:
        """A finished call's spans, for its response (`take_spans`)."""
        self.finished_spans[identity] = spans
        while len(self.finished_spans) > 4096:  # responses never read (a client gone)
            self.finished_spans.popitem(last=False)

    def take_spans(self, identity: CallIdentity) -> list[Span] | None:
        with self.lock:
            return self.finished_spans.pop(identity, None)

    def forget(self, call: CapturedCall) -> None:
        """Drop a call whose terminal row is durable (remembered as completed, bounded)."""
        with self.lock:
            if self.calls.get(call.identity) is call:
                del self.calls[call.identity]
            self.completed[call.identity] = None
            while len(self.completed) > 100_000:
                self.completed.popitem(last=False)
