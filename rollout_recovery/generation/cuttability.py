"""Which calls may be cut: a resumed tail must sample exactly as the uninterrupted call would.

Each refusal has a name (counted in metrics). Settings whose state depends on the output
tokens so far cannot be carried across a cut, because a resumed request sees the prefix as
prompt (docs/design.md §8).
"""

from __future__ import annotations

from rollout_recovery.generation.vllm_compat import bad_words_token_ids
from rollout_recovery.protocol import REQUEST_FIELDS, XARG_SEED

KNOWN_EXTRA_ARGS = REQUEST_FIELDS

UNCUTTABLE_REASONS = (
    "presence_penalty",
    "frequency_penalty",
    "multi_token_bad_words",
    "structured_output",
    "unknown_logits_processor",
    "per_request_seed",
    "n_greater_than_1",
    "top_logprobs",
    "output_state_counters",
)


def uncuttable_reason(params, sampler_enabled: bool) -> str | None:
    """The reason a call with these SamplingParams must not be cut, or None."""
    if params.presence_penalty:
        return "presence_penalty"
    if params.frequency_penalty and params.repetition_penalty != 1.0:
        # Emulated on resume as a logit bias, which is only exact when no multiplicative
        # repetition penalty is applied after it.
        return "frequency_penalty"
    if any(len(ids) > 1 for ids in bad_words_token_ids(params)):
        return "multi_token_bad_words"
    if params.structured_outputs is not None:
        return "structured_output"
    extra = params.extra_args or {}
    if set(extra) - KNOWN_EXTRA_ARGS:
        return "unknown_logits_processor"
    if params.seed is not None:
        return "per_request_seed"
    if XARG_SEED in extra and not sampler_enabled:
        return "per_request_seed"
    if params.n > 1:
        return "n_greater_than_1"
    if (params.logprobs or 0) > 0:
        return "top_logprobs"  # only sampled-token logprobs are staged with prefixes
    if getattr(params, "thinking_token_budget", None) or getattr(
        params, "repetition_detection", None
    ):
        return "output_state_counters"
    return None
