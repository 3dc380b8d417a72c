"""Resuming a restored call from its staged prefix, so the caller sees the uninterrupted result.

A request may carry a continuation in `vllm_xargs` (`rr_resume_keys`, `rr_resume_tokens`,
`rr_resume_digest`, optionally `rr_resume_limit`). Before the engine sees it, the worker fetches
the chunk rows and validates all of them (present, in order, counts, digest chain, identity,
weight versions, prompt); any mismatch fails closed with a named reason and the call is
generated from scratch. Otherwise the engine prompt becomes the original prompt ids plus the
prefix ids (never re-rendered), max/min tokens shrink by the prefix length, and when vLLM
creates the request's state its detokenizer is replaced by one primed on the original prompt
with the prefix replayed, and the prefix's logprobs are prefilled. Text that ends inside a
multi-byte character, and stop strings that span the cut, then come out exactly as without
the crash. A prefix that already finished is answered without decoding.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from rollout_recovery.data_plane.digest import CHAIN_ROOT, chain_digest
from rollout_recovery.data_plane.schemas import table_to_chunk_rows
from rollout_recovery.generation.capture import CallIdentity, TokenCapture
from rollout_recovery.generation.metrics import WorkerMetrics

RESUME_KEYS_ARG = "rr_resume_keys"
RESUME_TOKENS_ARG = "rr_resume_tokens"
RESUME_DIGEST_ARG = "rr_resume_digest"
RESUME_LIMIT_ARG = "rr_resume_limit"


class ResumeRefused(Exception):
    """The continuation cannot be trusted; `reason` is counted and the call regenerates."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class Prefix:
    prompt_ids: list[int]
    ids: np.ndarray
    logprobs: np.ndarray
    weight_version: int
    keys: list[str] = field(default_factory=list)  # the earlier attempt's chunk rows


def validate_chunks(
    rows,
    identity: CallIdentity,
    keys: list[str],
    prompt_ids: list[int],
    expected_tokens: int,
    expected_digest: str,
) -> Prefix:
    """Check every staged chunk of a continuation; raises ResumeRefused on any mismatch."""
    if not rows:
        raise ResumeRefused("missing_chunk", "no staged rows")
    if [r.key for r in rows] != keys:
        raise ResumeRefused("missing_chunk", "not every staging key was found")
    prev, digest, versions = 0, CHAIN_ROOT, []
    for seq, row in enumerate(rows):
        if (row.rollout_id, row.model_call_id) != identity[:2] or row.attempt >= identity.attempt:
            raise ResumeRefused("foreign_chunk", f"{row.key} belongs to another call or attempt")
        if row.chunk_seq != seq:
            raise ResumeRefused("chunk_order", f"{row.key} has chunk_seq {row.chunk_seq}")
        if row.prev_len != prev or len(row.logprobs) != row.delta_len:
            raise ResumeRefused("chunk_counts", f"{row.key} does not continue at {prev}")
        digest = chain_digest(digest, row.token_ids)
        if digest != row.digest:
            raise ResumeRefused("digest_mismatch", f"{row.key} fails its chained digest")
        prev += row.delta_len
        versions.append(row.weight_version)
    if any(b < a for a, b in itertools.pairwise(versions)):
        raise ResumeRefused("weight_version_order", "weight versions decrease")
    if prev != expected_tokens:
        raise ResumeRefused("prefix_length_mismatch", f"{prev} staged, {expected_tokens} expected")
    if digest.hex() != expected_digest:
        raise ResumeRefused("digest_mismatch", "final digest differs from the continuation's")
    if rows[0].prompt_token_ids is None or rows[0].prompt_token_ids.tolist() != list(prompt_ids):
        raise ResumeRefused("prompt_mismatch", "the request's prompt is not the staged prompt")
    return Prefix(
        prompt_ids=list(prompt_ids),
        ids=np.concatenate([r.token_ids for r in rows]),
        logprobs=np.concatenate([r.logprobs for r in rows]),
        weight_version=versions[-1],
    )


def parse_continuation(extra: dict) -> tuple[list[str], int, str, int | None] | None:
    if RESUME_KEYS_ARG not in extra:
        return None
    keys, tokens = extra[RESUME_KEYS_ARG], extra.get(RESUME_TOKENS_ARG)
    digest, limit = extra.get(RESUME_DIGEST_ARG), extra.get(RESUME_LIMIT_ARG)
    if (
        not isinstance(keys, list)
        or not all(isinstance(k, str) for k in keys)
        or not isinstance(tokens, int)
        or tokens < 1
        or not isinstance(digest, str)
        or (limit is not None and not isinstance(limit, int))
    ):
        raise ResumeRefused("malformed_continuation", "keys, tokens and digest are required")
    return keys, tokens, digest, limit


MAX_LOGIT_BIAS = 100.0  # vLLM clamps biases to this


def _emulate_frequency_penalty(params, prefix_ids: np.ndarray) -> None:
    """The penalty counts output tokens, and the prefix is now prompt: subtract
    `penalty x count` for the prefix's tokens as a logit bias (additive, like the penalty)."""
    ids, counts = np.unique(prefix_ids, return_counts=True)
    bias = dict(params.logit_bias or {})
    for tok, n in zip(ids.tolist(), counts.tolist(), strict=True):
        bias[tok] = bias.get(tok, 0.0) - params.frequency_penalty * n
    if any(abs(b) > MAX_LOGIT_BIAS for b in bias.values()):
        raise ResumeRefused("frequency_penalty", "the emulating logit bias would be clamped")
    params.logit_bias = bias


def _is_delta(params) -> bool:
    from vllm.sampling_params import RequestOutputKind

    return params.output_kind == RequestOutputKind.DELTA


class Resumer:
    """Hooks on one AsyncLLM: a `generate` wrapper and the capture's add-request callback."""

    def __init__(self, capture: TokenCapture, store, partition: str, classify) -> None:
        self.capture, self.store, self.partition = capture, store, partition
        self.classify = classify
        self.metrics = WorkerMetrics()
        self.pending: dict[str, tuple[Prefix, Any]] = {}  # external request id -> plan
        self.states: dict[str, Any] = {}  # external request id -> its transplanted state
        self.tokenizer = None

    def install(self, engine) -> None:
        self.tokenizer = engine.output_processor.tokenizer
        orig_generate = engine.generate
        self.capture.on_added = self._transplant

        async def generate(prompt, sampling_params, request_id, **kwargs):
            extra = getattr(sampling_params, "extra_args", None) or {}
            prefix = None
            if RESUME_KEYS_ARG in extra:
                prefix = await self._prepare(prompt, sampling_params, extra)
            if prefix is not None:
                original = copy.copy(sampling_params)
                k = len(prefix.ids)
                done = self._finished_reason(prefix, original)
                if done is not None:
                    yield self._complete_output(request_id, prefix, original, *done)
                    return
                if sampling_params.frequency_penalty:
                    _emulate_frequency_penalty(sampling_params, prefix.ids)
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
                self.pending.pop(request_id, None)
                self.states.pop(request_id, None)

        engine.generate = generate

    async def _prepare(self, prompt, params, extra: dict) -> Prefix | None:
        from rollout_recovery.generation.capture import identity_from_extra_args

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
                table, missing = await self.store.aget(self.partition, keys)
            except Exception as err:
                raise ResumeRefused("store_unavailable", type(err).__name__) from None
            if missing:
                raise ResumeRefused("missing_chunk", f"{len(missing)} staging keys not found")
            rows = sorted(table_to_chunk_rows(table), key=lambda r: keys.index(r.key))
            prefix = validate_chunks(
                rows, identity, keys, list(prompt["prompt_token_ids"]), tokens, digest
            )
            prefix.keys = list(keys)
        except ResumeRefused as refused:
            self.metrics.restore(refused.reason)
            return None
        self.metrics.restore("resumed", len(prefix.ids))
        return prefix

    def _finished_reason(self, prefix: Prefix, params) -> tuple[str, Any] | None:
        """(finish_reason, stop_reason) when the prefix already ended the call."""
        k = len(prefix.ids)
        last = int(prefix.ids[-1])
        if k >= (params.min_tokens or 0):
            if last in (params.stop_token_ids or []):
                return "stop", last
            eos = getattr(self.tokenizer, "eos_token_id", None)
            if not params.ignore_eos and last == eos:
                return "stop", None
        if params.max_tokens is not None and k >= params.max_tokens:
            return "length", None
        return None

    def _states_for(self, request_id: str, prefix: Prefix, params):
        """A detokenizer primed on the original prompt with the prefix replayed, and a
        logprobs container prefilled with the prefix (the same code vLLM uses per step)."""
        from vllm.v1.engine.detokenizer import IncrementalDetokenizer
        from vllm.v1.engine.logprobs import LogprobsProcessor
        from vllm.v1.outputs import LogprobsLists

        fake = SimpleNamespace(
            request_id=request_id, prompt_token_ids=prefix.prompt_ids, sampling_params=params
        )
        tokenizer = self.tokenizer if params.detokenize else None
        detok = IncrementalDetokenizer.from_new_request(tokenizer, fake)
        stop = detok.update(prefix.ids.tolist(), False)
        lp = LogprobsProcessor.from_new_request(tokenizer, fake)
        if lp.logprobs is not None:
            k = len(prefix.ids)
            lp._update_sample_logprobs(
                LogprobsLists(
                    prefix.ids.reshape(k, 1).astype(np.int64),
                    prefix.logprobs.reshape(k, 1).astype(np.float32),
                    np.ones(k, np.int64),
                )
            )
        return detok, lp, stop

    def _complete_output(self, request_id: str, prefix: Prefix, params, reason, stop_reason):
        from vllm.outputs import CompletionOutput, RequestOutput

        detok, lp, stop = self._states_for(request_id, prefix, params)
        if stop:
            reason, stop_reason = "stop", stop
        self.metrics.restore("finished_without_decoding")
        completion = CompletionOutput(
            index=0,
            text=detok.get_next_output_text(True, False),
            token_ids=prefix.ids.tolist(),
            cumulative_logprob=lp.cumulative_logprob,
            logprobs=lp.logprobs,
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
        state = self.states.get(request_id)
        if comp.logprobs is not None and state is not None:
            comp.logprobs = state.logprobs_processor.logprobs[: len(prefix.ids) + n_new]

    def _transplant(self, call, request) -> None:
        """Runs under the capture lock right after vLLM created the request's state."""
        plan = self.pending.get(request.external_req_id)
        if plan is None:
            return
        prefix, original = plan
        state = call.state
        params = copy.copy(request.sampling_params)  # the processed clone (stop ids, EOS)
        params.max_tokens, params.min_tokens = original.max_tokens, original.min_tokens
        detok, lp, _ = self._states_for(request.request_id, prefix, params)
        if lp.logprobs is not None and state.logprobs_processor is not None:
            state.logprobs_processor.logprobs = lp.logprobs
            state.logprobs_processor.cumulative_logprob = lp.cumulative_logprob
        state.detokenizer = detok
        self.states[request.external_req_id] = state
        state.prompt_token_ids = prefix.prompt_ids
        state.prompt_len = len(prefix.prompt_ids)
        state.max_tokens_param = original.max_tokens
        call.prompt_token_ids = np.asarray(prefix.prompt_ids, dtype=np.int32)
        call.max_tokens = original.max_tokens
        call.superseded_keys = list(prefix.keys)  # deleted with this call's own chunks
