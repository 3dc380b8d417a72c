"""Where one model call's tokens come from: the chat response itself, or a `/tokenize` call.

A training record needs, per model call, the exact prompt token ids, the generated token ids
and the logprob of each sampled token. They are taken from the first source available:

1. ``message``: a complete bundle on ``choices[0].message`` (``prompt_token_ids``,
   ``generation_token_ids``, ``generation_log_probs``), as a training-side server attaches it.
2. ``response``: vLLM's ``return_token_ids`` output, top-level ``prompt_token_ids`` with
   ``choices[0].token_ids``, the logprobs read from ``choices[0].logprobs.content``.
3. ``tokenize``: neither is present; the prompt is re-rendered by ``POST /tokenize`` with
   every prompt-affecting field of the chat request, and the generated ids are read from the
   logprob entries (vLLM writes them there as ``token_id:<id>`` when the chat request sets
   ``return_tokens_as_token_ids``).

A partial source, or two inline sources that disagree, is an error, never silently
repaired. Only one choice per request (``n`` = 1) is captured.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Literal

import httpx

__all__ = [
    "PROMPT_AFFECTING_FIELDS",
    "TokenBundle",
    "TokenSourceError",
    "capture_tokens",
    "extract_inline",
    "tokenize_request_body",
    "validate_chat_request",
]

# Chat-request fields that change the rendered prompt, forwarded as-is to `/tokenize`.
# vLLM 0.32's TokenizeChatRequest declares all but `required_prefix_token_ids`, which its
# permissive base model accepts and ignores; our generation worker honours it.
PROMPT_AFFECTING_FIELDS = (
    "model",
    "messages",
    "tools",
    "chat_template_kwargs",
    "mm_processor_kwargs",
    "required_prefix_token_ids",
)

# vLLM's placeholder for a logprob entry's token under `return_tokens_as_token_ids`.
_TOKEN_ID_PLACEHOLDER = re.compile(r"^token_id:(-?\d+)$")

Source = Literal["message", "response", "tokenize"]


class TokenSourceError(ValueError):
    """A request or response from which exact tokens cannot be captured."""


@dataclass(frozen=True)
class TokenBundle:
    """One model call's exact tokens, and which source they came from."""

    prompt_token_ids: list[int]
    generated_token_ids: list[int]
    logprobs: list[float]
    source: Source

    def __post_init__(self) -> None:
        if len(self.generated_token_ids) != len(self.logprobs):
            raise TokenSourceError(
                f"{len(self.generated_token_ids)} generated token ids but "
                f"{len(self.logprobs)} logprobs"
            )


# --------------------------------------------------------------------------- validation


def _int_list(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise TokenSourceError(f"{where} must be a list of integers")
    return value


def _float_list(value: Any, where: str) -> list[float]:
    if not isinstance(value, list) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) and not math.isnan(v) for v in value
    ):
        raise TokenSourceError(f"{where} must be a list of numbers")
    return [float(v) for v in value]


def validate_chat_request(chat_request: Any) -> None:
    """Refuse a chat request whose tokens could not be captured faithfully.

    ``messages`` must be a non-empty list of objects with a string ``role``; every tool
    call's ``function.arguments`` must be a string holding a JSON object; ``n`` must be 1.
    """
    if not isinstance(chat_request, dict):
        raise TokenSourceError("the chat request must be a JSON object")
    n = chat_request.get("n")
    if n is not None and n != 1:
        raise TokenSourceError(f"only n=1 is captured (the request asks for n={n!r})")
    messages = chat_request.get("messages")
    if not isinstance(messages, list) or not messages:
        raise TokenSourceError("messages must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TokenSourceError(f"messages[{i}] must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise TokenSourceError(f"messages[{i}].role must be a non-empty string")
        tool_calls = message.get("tool_calls")
        if tool_calls is None:
            continue
        if not isinstance(tool_calls, list):
            raise TokenSourceError(f"messages[{i}].tool_calls must be a list")
        for j, call in enumerate(tool_calls):
            where = f"messages[{i}].tool_calls[{j}]"
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                raise TokenSourceError(f"{where}.function must be an object")
            arguments = function.get("arguments")
            if not isinstance(arguments, str):
                raise TokenSourceError(f"{where}.function.arguments must be a JSON string")
            try:
                parsed = json.loads(arguments)
            except json.JSONDecodeError as exc:
                raise TokenSourceError(
                    f"{where}.function.arguments is not valid JSON: {exc.msg}"
                ) from None
            if not isinstance(parsed, dict):
                raise TokenSourceError(f"{where}.function.arguments must encode a JSON object")


# ------------------------------------------------------------------------ inline sources


def _only_choice(response: Any) -> dict[str, Any]:
    if not isinstance(response, dict):
        raise TokenSourceError("the chat response must be a JSON object")
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        raise TokenSourceError("the chat response has no choices")
    if len(choices) > 1:
        raise TokenSourceError("only n=1 is captured")
    choice = choices[0]
    if not isinstance(choice, dict):
        raise TokenSourceError("choices[0] must be an object")
    return choice


def _logprob_entries(choice: dict[str, Any]) -> list[Any]:
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if content is None:
        raise TokenSourceError(
            "choices[0].logprobs.content is missing; logprobs are required for training "
            "(request logprobs=true)"
        )
    if not isinstance(content, list):
        raise TokenSourceError("choices[0].logprobs.content must be a list")
    for k, entry in enumerate(content):
        if not isinstance(entry, dict):
            raise TokenSourceError(f"choices[0].logprobs.content[{k}] must be an object")
    return content


def _entry_token_id(entry: dict[str, Any]) -> int | None:
    """The token id an entry states outright (``token_id``, or vLLM's placeholder text)."""
    token_id = entry.get("token_id")
    if isinstance(token_id, int) and not isinstance(token_id, bool):
        return token_id
    token = entry.get("token")
    if isinstance(token, str) and (match := _TOKEN_ID_PLACEHOLDER.match(token)):
        return int(match.group(1))
    return None


def _entry_logprobs(entries: list[dict[str, Any]]) -> list[float]:
    return _float_list(
        [entry.get("logprob") for entry in entries], "choices[0].logprobs.content[*].logprob"
    )


def _message_bundle(choice: dict[str, Any]) -> TokenBundle | None:
    message = choice.get("message")
    if not isinstance(message, dict):
        return None
    names = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
    present = [name for name in names if message.get(name) is not None]
    if not present:
        return None
    missing = [name for name in names if name not in present]
    if missing:
        raise TokenSourceError(
            "choices[0].message carries a partial token bundle; missing: "
            + ", ".join(f"message.{name}" for name in missing)
        )
    prompt = _int_list(message["prompt_token_ids"], "message.prompt_token_ids")
    generated = _int_list(message["generation_token_ids"], "message.generation_token_ids")
    logprobs = _float_list(message["generation_log_probs"], "message.generation_log_probs")
    if len(generated) != len(logprobs):
        raise TokenSourceError(
            f"message.generation_token_ids has {len(generated)} tokens but "
            f"message.generation_log_probs has {len(logprobs)}"
        )
    return TokenBundle(list(prompt), list(generated), logprobs, "message")


def _response_bundle(response: dict[str, Any], choice: dict[str, Any]) -> TokenBundle | None:
    prompt = response.get("prompt_token_ids")
    generated = choice.get("token_ids")
    if prompt is None and generated is None:
        return None
    if prompt is None or generated is None:
        missing = "prompt_token_ids" if prompt is None else "choices[0].token_ids"
        raise TokenSourceError(
            f"the response carries partial token ids; missing: {missing} "
            "(both come with return_token_ids=true)"
        )
    prompt = _int_list(prompt, "prompt_token_ids")
    generated = _int_list(generated, "choices[0].token_ids")
    entries = _logprob_entries(choice)
    if len(entries) != len(generated):
        raise TokenSourceError(
            f"choices[0].token_ids has {len(generated)} tokens but "
            f"choices[0].logprobs.content has {len(entries)} entries"
        )
    # Entries carry token text (and its bytes) only; nothing is decoded. Where an entry
    # states its id outright, it must be the id at that position.
    for k, (entry, token_id) in enumerate(zip(entries, generated, strict=True)):
        stated = _entry_token_id(entry)
        if stated is not None and stated != token_id:
            raise TokenSourceError(
                f"choices[0].logprobs.content[{k}] names token {stated} but "
                f"choices[0].token_ids[{k}] is {token_id}"
            )
    return TokenBundle(list(prompt), list(generated), _entry_logprobs(entries), "response")


def extract_inline(response: dict[str, Any]) -> TokenBundle | None:
    """The call's tokens from the chat response alone, or None when it carries none.

    A complete message bundle wins; vLLM's ``return_token_ids`` output is used otherwise.
    When both are present they must agree exactly (logprobs compared as floats).
    """
    choice = _only_choice(response)
    from_message = _message_bundle(choice)
    from_response = _response_bundle(response, choice)
    if from_message is not None and from_response is not None:
        disagree = [
            label
            for label, same in (
                (
                    "prompt ids (message.prompt_token_ids vs prompt_token_ids)",
                    from_message.prompt_token_ids == from_response.prompt_token_ids,
                ),
                (
                    "generated ids (message.generation_token_ids vs choices[0].token_ids)",
                    from_message.generated_token_ids == from_response.generated_token_ids,
                ),
                (
                    "logprobs (message.generation_log_probs vs choices[0].logprobs)",
                    from_message.logprobs == from_response.logprobs,
                ),
            )
            if not same
        ]
        if disagree:
            raise TokenSourceError("inline token sources disagree on: " + "; ".join(disagree))
    return from_message if from_message is not None else from_response


# ------------------------------------------------------------------------------ fallback


def tokenize_request_body(chat_request: dict[str, Any]) -> dict[str, Any]:
    """The ``POST /tokenize`` body that renders the same prompt as ``chat_request``.

    Copies each prompt-affecting field the request sets, and asks for the generation
    prompt exactly as the chat request did (vLLM's default is to add it).
    """
    body = {name: chat_request[name] for name in PROMPT_AFFECTING_FIELDS if name in chat_request}
    body["add_generation_prompt"] = chat_request.get("add_generation_prompt", True)
    return body


def _fallback_generated_ids(choice: dict[str, Any]) -> tuple[list[int], list[float]]:
    entries = _logprob_entries(choice)
    ids: list[int] = []
    for entry in entries:
        token_id = _entry_token_id(entry)
        if token_id is None:
            raise TokenSourceError(
                "the fallback needs token ids in logprobs; enable return_token_ids "
                "(or return_tokens_as_token_ids)"
            )
        ids.append(token_id)
    return ids, _entry_logprobs(entries)


async def capture_tokens(
    client: httpx.AsyncClient,
    base_url: str,
    chat_request: dict[str, Any],
    response: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> TokenBundle:
    """The exact tokens of one chat call: inline when the response has them, else re-tokenized.

    ``base_url`` is the server root (vLLM serves ``/tokenize`` beside, not under, ``/v1``).
    Transport failures propagate as ``httpx`` errors; a refused ``/tokenize`` or a malformed
    request or response raises :class:`TokenSourceError`.
    """
    validate_chat_request(chat_request)
    inline = extract_inline(response)
    if inline is not None:
        return inline

    generated, logprobs = _fallback_generated_ids(_only_choice(response))
    reply = await client.post(
        base_url.rstrip("/") + "/tokenize",
        json=tokenize_request_body(chat_request),
        headers=headers,
    )
    if reply.status_code != 200:
        raise TokenSourceError(f"/tokenize answered {reply.status_code}: {reply.text[:500]}")
    try:
        payload = reply.json()
    except ValueError:
        raise TokenSourceError("/tokenize answered with a body that is not JSON") from None
    tokens = payload.get("tokens") if isinstance(payload, dict) else None
    prompt = _int_list(tokens, "/tokenize tokens")
    return TokenBundle(list(prompt), generated, logprobs, "tokenize")
