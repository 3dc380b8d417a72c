"""Resuming a restored call from its staged prefix, so the caller sees the uninterrupted result.

A request may carry a continuation in `vllm_xargs` (protocol.py: the staged chunk keys, the
prefix length and digest, optionally the output limit). Before the engine sees it, the worker
fetches the chunk rows and validates all of them (present, in order, counts, digest chain, identity,
weight versions, prompt); any mismatch fails closed with a named reason and the call is
generated from scratch. Otherwise the engine prompt becomes the original prompt ids plus the
prefix ids (never re-rendered), max/min tokens shrink by the prefix length, and when vLLM
creates the request's state its detokenizer is replaced by one primed on the original prompt
with the prefix replayed, and the prefix's logprobs are prefilled. Text that ends inside a
multi-byte character, and stop strings that span the cut, then come out exactly as without
the crash.

A prefix that already finished is answered without decoding: from the finish record its last
chunk carries (a cut of a finished call), or, for a prefix without one, from the call's own
stop conditions (stop token, EOS, stop string, length). A prefix that runs past one of its stop
conditions cannot have come from this call and is refused (`prefix_past_stop`). Refusals are
decided before anything is counted as resumed; the call is then decoded from scratch.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Collection
from typing import Any

import numpy as np

from rollout_recovery import faults
from rollout_recovery.data_plane.chain import Prefix, ResumeRefused, validate_chunks
from rollout_recovery.data_plane.schemas import table_to_chunk_rows
from rollout_recovery.generation.capture import CapturedCall, TokenCapture
from rollout_recovery.generation.metrics import WorkerMetrics
from rollout_recovery.generation.vllm_compat import (
    AddedRequest,
    GenerateFn,
    PrimedState,
    ProgressReader,
    primed_state,
)
from rollout_recovery.protocol import (
    RESUME_DIGEST_ARG,
    RESUME_KEYS_ARG,
    RESUME_TOKENS_ARG,
    ResumeRequest,
    identity_from_extra_args,
    resume_request,
)


def parse_continuation(extra: dict) -> ResumeRequest | None:
    """The continuation a request carries; ResumeRefused(malformed_continuation) when bad."""
    try:
        return resume_request(extra)
    except ValueError as err:
        raise ResumeRefused("malformed_continuation", str(err)) from None


MAX_LOGIT_BIAS = 100.0  # vLLM clamps biases to this


def frequency_penalty_bias(params, prefix_ids: np.ndarray) -> dict[int, float]:
    """The penalty counts output tokens, and the prefix is now prompt: subtract
    `penalty x count` for the prefix's tokens as a logit bias (additive, like the penalty).
    Refused when vLLM would clamp the bias (the emulation would no longer be exact)."""
    ids, counts = np.unique(prefix_ids, return_counts=True)
    bias = dict(params.logit_bias or {})
    for tok, n in zip(ids.tolist(), counts.tolist(), strict=True):
        bias[tok] = bias.get(tok, 0.0) - params.frequency_penalty * n
    if any(abs(b) > MAX_LOGIT_BIAS for b in bias.values()):
        raise ResumeRefused("frequency_penalty", "the emulating logit bias would be clamped")
    return bias


def _is_delta(params) -> bool:
    from vllm.sampling_params import RequestOutputKind

    return params.output_kind == RequestOutputKind.DELTA


class Resumer:
    """The resume layer of one AsyncLLM's `generate` (`wrap`), and the capture's add-request
    callback that transplants a staged prefix into the request vLLM just created.

    `retire(keys)` is called with an earlier attempt's chunk keys when a resume answered the
    call without decoding (no captured call will delete them with its terminal row). Fetching
    a continuation's chunks that takes longer than `fetch_timeout_s` is `store_unavailable`.
    `tokenizer` is the one the engine's detokenizers use (vllm_compat.output_tokenizer).
    `generation_eos_ids`: the end-of-sequence ids the model's generation config adds to the
    tokenizer's (Qwen3: `<|endoftext|>` beside `<|im_end|>`); vLLM makes them stop token ids
    of every request that does not ignore EOS, after this layer sees the request.
    """

    def __init__(
        self,
        capture: TokenCapture,
        store,
        partition: str,
        classify,
        retire: Callable[[list[str]], None] | None = None,
        fetch_timeout_s: float = 10.0,
        tokenizer: Any = None,
        generation_eos_ids: Collection[int] = (),
    ) -> None:
        self.capture, self.store, self.partition = capture, store, partition
        self.fetch_timeout_s = fetch_timeout_s
        self.classify = classify
        self.retire = retire or (lambda keys: None)
        self.metrics = WorkerMetrics()
        self.pending: dict[str, tuple[Prefix, Any]] = {}  # external request id -> plan
        self.states: dict[str, ProgressReader] = {}  # external request id -> transplanted
        self.tokenizer = tokenizer
        self.generation_eos_ids = frozenset(generation_eos_ids)
        capture.on_added = self._transplant

    def wrap(self, orig_generate: GenerateFn) -> GenerateFn:
        """`generate` with continuations honoured (a `vllm_compat.GenerateLayer`)."""
        disabled = faults.active("resume_disabled")

        async def generate(prompt, sampling_params, request_id, **kwargs):
            extra = getattr(sampling_params, "extra_args", None) or {}
            prefix = None
            if disabled:  # deliberate fault (faults.py): continuations silently ignored
                for arg in (RESUME_KEYS_ARG, RESUME_TOKENS_ARG, RESUME_DIGEST_ARG):
                    extra.pop(arg, None)
            if RESUME_KEYS_ARG in extra:
                prefix = await self._prepare(prompt, sampling_params, extra)
            if prefix is not None:
                original = copy.copy(sampling_params)
                k = len(prefix.ids)
                if prefix.done is not None:
                    with self.capture.lock:  # for the response (control.RequestGate)
                        self.capture.keep_spans(prefix.identity, prefix.weight_versions)
                    yield self._complete_output(request_id, prefix, original, *prefix.done)
                    self.capture.attempts.finished(prefix.identity, prefix.done[0])
                    self.retire(prefix.keys)
                    return
                if prefix.logit_bias is not None:
                    sampling_params.logit_bias = prefix.logit_bias
                prompt = dict(prompt, prompt_token_ids=[*prefix.prompt_ids, *prefix.ids.tolist()])
                prompt.pop("prompt", None)
                sampling_params.max_tokens = original.max_tokens - k
                sampling_params.min_tokens = max(0, (original.min_tokens or 0) - k)
                self.pending[request_id] = (prefix, original)
            streamed = prefix is not None and _is_delta(sampling_params)
            try:
                async for out in orig_generate(prompt, sampling_params, request_id, **kwargs):
                    if streamed:
                        streamed = False
                        self._prepend_prefix(out, prefix, request_id)
                    yield out
            finally:
                decoded = prefix and self.capture.attempts.decoded_tokens(prefix.identity)
                if decoded:  # the engine's own count for this attempt (attempts.py)
                    self.metrics.count("resume.decoded_tokens", decoded)
                self.pending.pop(request_id, None)
                self.states.pop(request_id, None)

        return generate

    async def _prepare(self, prompt, params, extra: dict) -> Prefix | None:
        """Fetch and validate a continuation and decide how the call goes on; every refusal
        is counted by reason and the call is decoded from scratch."""
        identity = None
        try:
            identity = identity_from_extra_args(extra)
            if identity is None:
                raise ResumeRefused("malformed_continuation", "a continuation needs an identity")
            cont = parse_continuation(extra)
            keys, tokens, digest, limit = cont
            if not isinstance(prompt, dict) or "prompt_token_ids" not in prompt:
                raise ResumeRefused("unsupported_prompt", "only token prompts can be resumed")
            reason = self.classify(params)
            if reason is not None or (params.logprobs or 0) > 0:
                raise ResumeRefused("uncuttable", reason or "top_logprobs")
            if params.max_tokens is not None and tokens > params.max_tokens:
                raise ResumeRefused("prefix_exceeds_limit", f"{tokens} > {params.max_tokens}")
            if limit is not None and params.max_tokens is not None and limit != params.max_tokens:
                raise ResumeRefused("limit_mismatch", f"{limit} != {params.max_tokens}")
            try:
                async with asyncio.timeout(self.fetch_timeout_s):
                    table, missing = await self.store.aget(self.partition, keys)
            except Exception as err:  # a hung store times out: refused, not stuck
                raise ResumeRefused("store_unavailable", type(err).__name__) from None
            if missing:
                raise ResumeRefused("missing_chunk", f"{len(missing)} staging keys not found")
            rows = sorted(table_to_chunk_rows(table), key=lambda r: keys.index(r.key))
            prefix = validate_chunks(
                rows, identity, keys, list(prompt["prompt_token_ids"]), tokens, digest
            )
            prefix.keys = list(keys)
            if prefix.logprobs is None:
                raise ResumeRefused("prefix_without_logprobs", "a chunk has no sampled logprobs")
            prefix.done = prefix.finish or self._prefix_finish(prefix, params)
            if prefix.done is None and params.frequency_penalty:
                prefix.logit_bias = frequency_penalty_bias(params, prefix.ids)
        except ResumeRefused as refused:
            self.metrics.restore(refused.reason)
            if identity is not None:
                self.capture.attempts.verdict(identity, "refused", refused.reason)
            return None
        self.metrics.restore("resumed", len(prefix.ids))
        prefix.identity = identity
        self.capture.attempts.verdict(identity, "resumed", prefix_tokens=len(prefix.ids))
        return prefix

    def _prefix_finish(self, prefix: Prefix, params) -> tuple[str, Any] | None:
        """(finish_reason, stop_reason) when a prefix without a finish record already ends the
        call by its stop conditions, None when it must go on. A stop condition met before the
        prefix's last token means the prefix did not come from this call: refused."""
        ids = prefix.ids.tolist()
        k, min_tokens = len(ids), params.min_tokens or 0
        eos = None if params.ignore_eos else getattr(self.tokenizer, "eos_token_id", None)
        stop_ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:  # as SamplingParams.update_from_generation_config adds them
            stop_ids |= self.generation_eos_ids - {eos}

        def stop_at(i: int) -> tuple[str, Any] | None:
            if i + 1 < min_tokens:
                return None
            if ids[i] == eos:
                return "stop", None
            return ("stop", ids[i]) if ids[i] in stop_ids else None

        for i in range(k - 1):
            if stop_at(i) is not None:
                raise ResumeRefused("prefix_past_stop", f"stop token at position {i} of {k}")
        if params.stop:
            primed = self._primed("stop-check", prefix, params)
            stop = primed.stop
            if stop is not None:
                if primed.num_output_tokens() < k:
                    raise ResumeRefused("prefix_past_stop", f"stop string {stop!r} before the end")
                return "stop", stop
        done = stop_at(k - 1)
        if done is not None:
            return done
        if params.max_tokens is not None and k >= params.max_tokens:
            return "length", None
        return None

    def _primed(
        self, request_id: str, prefix: Prefix, params, stop_terminated: bool = False
    ) -> PrimedState:
        """vLLM's detokenizer and logprobs container for this request with the prefix fed
        through them (`stop_terminated`: the last token is a stop token, left out of the
        text as vLLM does)."""
        return primed_state(
            self.tokenizer,
            request_id,
            prefix.prompt_ids,
            params,
            prefix.ids,
            prefix.logprobs,
            stop_terminated,
        )

    def _complete_output(self, request_id: str, prefix: Prefix, params, reason, stop_reason):
        """The whole answer of a call whose prefix had already finished, as vLLM would have
        returned it: a stop token's text is left out, a stop string truncates the text."""
        from vllm.outputs import CompletionOutput, RequestOutput

        by_token = reason == "stop" and not isinstance(stop_reason, str)
        primed = self._primed(request_id, prefix, params, stop_terminated=by_token)
        if primed.stop:
            reason, stop_reason = "stop", primed.stop
        self.metrics.restore("finished_without_decoding")
        completion = CompletionOutput(
            index=0,
            text=primed.final_text(),
            token_ids=prefix.ids.tolist(),
            cumulative_logprob=primed.cumulative_logprob,
            logprobs=primed.logprobs,
            finish_reason=reason,
            stop_reason=stop_reason,
        )
        return RequestOutput(
            request_id=request_id,
            prompt=None,
            prompt_token_ids=prefix.prompt_ids,
            prompt_logprobs=None,
            outputs=[completion],
            finished=True,
        )

    def _prepend_prefix(self, out, prefix: Prefix, request_id: str) -> None:
        """A streamed resume: the caller never saw the prefix (its connection died with the
        crash), so the first delta carries the prefix's ids and logprobs before the tail's.
        Its text already does: the transplanted detokenizer has not emitted the prefix yet."""
        comp = out.outputs[0]
        n_new = len(comp.token_ids)
        comp.token_ids = [*prefix.ids.tolist(), *comp.token_ids]
        reader = self.states.get(request_id)
        if comp.logprobs is not None and reader is not None:
            comp.logprobs = reader.output_logprobs(len(prefix.ids) + n_new)

    def _transplant(self, call: CapturedCall, request: AddedRequest) -> None:
        """Runs under the capture lock right after vLLM created the request's state."""
        plan = self.pending.get(request.external_id)
        if plan is None:
            return
        prefix, original = plan
        params = copy.copy(request.params)  # the processed clone (stop ids, EOS)
        params.max_tokens, params.min_tokens = original.max_tokens, original.min_tokens
        primed = self._primed(request.request_id, prefix, params)
        call.reader.transplant(primed, prefix.prompt_ids, original.max_tokens)
        self.states[request.external_id] = call.reader
        call.prompt_token_ids = np.asarray(prefix.prompt_ids, dtype=np.int32)
        call.max_tokens = original.max_tokens
        call.superseded_keys = list(prefix.keys)  # deleted with this call's own chunks
        call.durable_floor = len(prefix.ids)  # durable already, in the earlier attempt's rows
        call.prefix_spans = list(prefix.weight_versions)  # its tokens keep their versions
