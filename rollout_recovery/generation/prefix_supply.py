"""Required-prefix supply: build a call's prompt from its parent's exact tokens.

Multi-turn rollouts drift when the history is re-rendered and re-tokenized: the ids the model
generated are not the ids a chat template produces from their text. When a request carries
`required_prefix_token_ids` (the parent's prompt + generated ids), the worker keeps vLLM's
rendering only for the new turns: it finds the end-of-turn token that closed the parent's
last turn in the rendered prompt and replaces everything up to it with the required ids.
The response's prompt ids are the generation-time proof the environment checks.
"""

from __future__ import annotations

from collections.abc import Iterable

from rollout_recovery.generation.vllm_compat import GenerateFn, GenerateLayer
from rollout_recovery.protocol import XARG_REQUIRED_PREFIX

FIELD = "required_prefix_token_ids"


class PrefixSupplyError(ValueError):
    pass


def validate_prefix(value) -> list[int]:
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    ):
        raise PrefixSupplyError(f"{FIELD} must be a non-empty list of non-negative token ids")
    return value


def splice_prefix(rendered: list[int], prefix: list[int], turn_end_ids: Iterable[int]) -> list[int]:
    """`prefix` + the part of `rendered` after the turn end that closes the prefix.

    The prefix must end with an end-of-turn token; the rendered prompt must contain at least
    as many of that token (one per turn of the history). Anything else cannot be aligned and
    is refused: a wrong prompt is worse than no supply.
    """
    end = prefix[-1]
    if end not in set(turn_end_ids):
        raise PrefixSupplyError(
            f"{FIELD} must end with an end-of-turn token (it ends with {end}); only calls whose "
            "parent finished its turn can be continued exactly"
        )
    need = prefix.count(end)
    seen = 0
    for pos, tok in enumerate(rendered):
        if tok == end:
            seen += 1
            if seen == need:
                return [*prefix, *rendered[pos + 1 :]]
    raise PrefixSupplyError(
        f"{FIELD} closes {need} turns but the rendered conversation has only {seen}; "
        "the messages do not continue the supplied prefix"
    )


def layer(turn_end_ids: set[int]) -> GenerateLayer:
    """The prefix-supply layer of `generate`: a request whose `vllm_xargs` carries the
    required prefix gets its token prompt spliced before anything else (resume, capture)
    sees it (vllm_compat.wrap_generate puts this layer outermost)."""

    def wrap(orig_generate: GenerateFn) -> GenerateFn:
        async def generate(prompt, sampling_params, request_id, **kwargs):
            extra = getattr(sampling_params, "extra_args", None) or {}
            if XARG_REQUIRED_PREFIX in extra:
                prefix = validate_prefix(extra.pop(XARG_REQUIRED_PREFIX))
                if not isinstance(prompt, dict) or "prompt_token_ids" not in prompt:
                    raise PrefixSupplyError(f"{FIELD} needs a token prompt (chat completions)")
                ids = splice_prefix(list(prompt["prompt_token_ids"]), prefix, turn_end_ids)
                prompt = dict(prompt, prompt_token_ids=ids)
                prompt.pop("prompt", None)
            async for out in orig_generate(prompt, sampling_params, request_id, **kwargs):
                yield out

        return generate

    return wrap


def turn_end_ids(tokenizer) -> set[int]:
    """End-of-turn ids: the EOS token and a chat template's explicit end markers."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for marker in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
        tid = tokenizer.convert_tokens_to_ids(marker)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            ids.add(tid)
    return ids
