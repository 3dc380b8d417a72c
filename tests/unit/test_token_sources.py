"""Token sources: inline precedence, agreement, partial sources, the /tokenize fallback."""

from __future__ import annotations

import copy
import json

import httpx
import pytest

from rollout_recovery.environment.token_sources import (
    PROMPT_AFFECTING_FIELDS,
    TokenBundle,
    TokenSourceError,
    capture_tokens,
    extract_inline,
    tokenize_request_body,
    validate_chat_request,
)

PROMPT = [1, 17, 42, 99]
GENERATED = [5, 6, 7]
LOGPROBS = [-0.25, -1.5, -0.125]
BASE_URL = "http://engine:8000"


def _entries(ids=None, logprobs=LOGPROBS, texts=("a", "b", "c")):
    out = []
    for k, lp in enumerate(logprobs):
        token = f"token_id:{ids[k]}" if ids is not None else texts[k]
        out.append(
            {"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []}
        )
    return out


def _response(*, message_bundle=None, response_ids=False, logprob_entries=None, n=1):
    message = {"role": "assistant", "content": "abc"}
    if message_bundle is not None:
        message.update(message_bundle)
    choice = {"index": 0, "message": message, "finish_reason": "stop"}
    if logprob_entries is not None:
        choice["logprobs"] = {"content": logprob_entries}
    if response_ids:
        choice["token_ids"] = list(GENERATED)
    body = {"id": "chatcmpl-1", "model": "m", "choices": [choice] * n}
    if response_ids:
        body["prompt_token_ids"] = list(PROMPT)
    return copy.deepcopy(body)


def _bundle():
    return {
        "prompt_token_ids": list(PROMPT),
        "generation_token_ids": list(GENERATED),
        "generation_log_probs": list(LOGPROBS),
    }


def _chat_request(**extra):
    req = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"x": 1}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "2"},
        ],
        "logprobs": True,
        "temperature": 1.0,
        "max_tokens": 8,
    }
    req.update(extra)
    return req


# ----------------------------------------------------------------------------- precedence


def test_message_bundle_is_used():
    got = extract_inline(_response(message_bundle=_bundle()))
    assert got == TokenBundle(PROMPT, GENERATED, LOGPROBS, "message")


def test_response_ids_are_used_without_message_bundle():
    got = extract_inline(_response(response_ids=True, logprob_entries=_entries()))
    assert got == TokenBundle(PROMPT, GENERATED, LOGPROBS, "response")


def test_response_ids_accept_token_id_placeholders_that_match():
    got = extract_inline(_response(response_ids=True, logprob_entries=_entries(ids=GENERATED)))
    assert got is not None and got.generated_token_ids == GENERATED


def test_response_ids_reject_a_placeholder_naming_another_token():
    entries = _entries(ids=[5, 9, 7])
    with pytest.raises(TokenSourceError, match=r"content\[1\] names token 9"):
        extract_inline(_response(response_ids=True, logprob_entries=entries))


def test_no_inline_source_returns_none():
    assert extract_inline(_response(logprob_entries=_entries())) is None


def test_both_sources_agreeing_prefer_the_message():
    got = extract_inline(
        _response(message_bundle=_bundle(), response_ids=True, logprob_entries=_entries())
    )
    assert got == TokenBundle(PROMPT, GENERATED, LOGPROBS, "message")


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("prompt_token_ids", [1, 17, 42, 98], "prompt ids"),
        ("generation_token_ids", [5, 6, 8], "generated ids"),
        ("generation_log_probs", [-0.25, -1.5, -0.1250001], "logprobs"),
    ],
)
def test_disagreeing_sources_name_the_field(field, value, named):
    bundle = _bundle()
    bundle[field] = value
    with pytest.raises(TokenSourceError, match="disagree") as info:
        extract_inline(
            _response(message_bundle=bundle, response_ids=True, logprob_entries=_entries())
        )
    message = str(info.value)
    assert named in message
    assert field in message
    others = {"prompt ids", "generated ids", "logprobs"} - {named}
    assert not any(other in message for other in others)


# ------------------------------------------------------------------------ partial sources


@pytest.mark.parametrize(
    "drop", [("generation_log_probs",), ("prompt_token_ids", "generation_token_ids")]
)
def test_partial_message_bundle_names_what_is_missing(drop):
    bundle = _bundle()
    for name in drop:
        del bundle[name]
    with pytest.raises(TokenSourceError, match="partial") as info:
        extract_inline(_response(message_bundle=bundle))
    for name in drop:
        assert f"message.{name}" in str(info.value)


def test_message_bundle_lengths_must_match():
    bundle = _bundle()
    bundle["generation_log_probs"] = LOGPROBS[:2]
    with pytest.raises(TokenSourceError, match="has 3 tokens"):
        extract_inline(_response(message_bundle=bundle))


def test_prompt_ids_without_token_ids_refused():
    response = _response(response_ids=True, logprob_entries=_entries())
    del response["choices"][0]["token_ids"]
    with pytest.raises(TokenSourceError, match=r"missing: choices\[0\]\.token_ids"):
        extract_inline(response)


def test_token_ids_without_prompt_ids_refused():
    response = _response(response_ids=True, logprob_entries=_entries())
    del response["prompt_token_ids"]
    with pytest.raises(TokenSourceError, match="missing: prompt_token_ids"):
        extract_inline(response)


def test_response_ids_without_logprobs_refused():
    with pytest.raises(TokenSourceError, match="logprobs are required"):
        extract_inline(_response(response_ids=True))


def test_response_ids_with_wrong_logprob_count_refused():
    entries = _entries()[:2]
    with pytest.raises(TokenSourceError, match=r"3 tokens but .* 2 entries"):
        extract_inline(_response(response_ids=True, logprob_entries=entries))


def test_two_choices_refused():
    with pytest.raises(TokenSourceError, match="only n=1 is captured"):
        extract_inline(_response(message_bundle=_bundle(), n=2))


def test_n_above_one_in_request_refused():
    with pytest.raises(TokenSourceError, match="only n=1 is captured"):
        validate_chat_request(_chat_request(n=2))


def test_empty_choices_refused():
    with pytest.raises(TokenSourceError, match="no choices"):
        extract_inline({"choices": []})


# ------------------------------------------------------------------------------- fallback


def _recording_client(tokens=PROMPT, status=200):
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path != "/tokenize":
            return httpx.Response(404)
        return httpx.Response(
            status, json={"count": len(tokens), "max_model_len": 4096, "tokens": tokens}
        )

    return httpx.AsyncClient(transport=httpx.MockTransport(handler)), seen


def test_tokenize_body_keeps_only_prompt_affecting_fields():
    request = _chat_request(tools=[], chat_template_kwargs={"enable_thinking": False})
    body = tokenize_request_body(request)
    assert set(body) == {"model", "messages", "tools", "chat_template_kwargs"} | {
        "add_generation_prompt"
    }
    assert body["add_generation_prompt"] is True


async def test_fallback_forwards_exactly_the_prompt_affecting_fields():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    request = _chat_request(
        tools=tools,
        chat_template_kwargs={"enable_thinking": False},
        mm_processor_kwargs={"num_crops": 4},
        required_prefix_token_ids=[1, 17],
        top_logprobs=0,
        return_tokens_as_token_ids=True,
    )
    client, seen = _recording_client(tokens=[3, 1, 4, 1, 5])
    async with client:
        got = await capture_tokens(
            client,
            BASE_URL + "/",
            request,
            _response(logprob_entries=_entries(ids=GENERATED)),
            headers={"Authorization": "Bearer t"},
        )

    assert got == TokenBundle([3, 1, 4, 1, 5], GENERATED, LOGPROBS, "tokenize")
    assert len(seen) == 1
    sent = seen[0]
    assert sent.method == "POST"
    assert str(sent.url) == BASE_URL + "/tokenize"
    assert sent.headers["authorization"] == "Bearer t"
    body = json.loads(sent.content)
    assert set(body) == set(PROMPT_AFFECTING_FIELDS) | {"add_generation_prompt"}
    for name in PROMPT_AFFECTING_FIELDS:
        assert body[name] == request[name]
    assert body["add_generation_prompt"] is True


async def test_fallback_accepts_explicit_token_id_entries():
    entries = [{"token_id": t, "logprob": lp} for t, lp in zip(GENERATED, LOGPROBS, strict=True)]
    client, _ = _recording_client()
    async with client:
        got = await capture_tokens(
            client, BASE_URL, _chat_request(), _response(logprob_entries=entries)
        )
    assert got == TokenBundle(PROMPT, GENERATED, LOGPROBS, "tokenize")


async def test_fallback_without_token_ids_refused_before_tokenizing():
    client, seen = _recording_client()
    async with client:
        with pytest.raises(TokenSourceError, match="enable return_token_ids"):
            await capture_tokens(
                client, BASE_URL, _chat_request(), _response(logprob_entries=_entries())
            )
    assert seen == []


async def test_fallback_without_logprobs_refused():
    client, seen = _recording_client()
    async with client:
        with pytest.raises(TokenSourceError, match="logprobs are required"):
            await capture_tokens(client, BASE_URL, _chat_request(), _response())
    assert seen == []


async def test_fallback_refused_tokenize_raises():
    client, _ = _recording_client(status=400)
    async with client:
        with pytest.raises(TokenSourceError, match="/tokenize answered 400"):
            await capture_tokens(
                client,
                BASE_URL,
                _chat_request(),
                _response(logprob_entries=_entries(ids=GENERATED)),
            )


async def test_inline_source_makes_no_request():
    client, seen = _recording_client()
    async with client:
        got = await capture_tokens(
            client,
            BASE_URL,
            _chat_request(),
            _response(response_ids=True, logprob_entries=_entries()),
        )
    assert got.source == "response"
    assert seen == []


# ------------------------------------------------------------------- request validation


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        (None, "non-empty list"),
        ("hi", "non-empty list"),
        (["hi"], r"messages\[0\] must be an object"),
        ([{"content": "hi"}], r"messages\[0\]\.role"),
        ([{"role": 3, "content": "hi"}], r"messages\[0\]\.role"),
    ],
)
async def test_malformed_messages_rejected(messages, match):
    client, seen = _recording_client()
    async with client:
        with pytest.raises(TokenSourceError, match=match):
            await capture_tokens(
                client,
                BASE_URL,
                _chat_request(messages=messages),
                _response(logprob_entries=_entries(ids=GENERATED)),
            )
    assert seen == []


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('"text"', "JSON object"),
        ({"x": 1}, "JSON string"),
    ],
)
def test_bad_tool_call_arguments_rejected(arguments, match):
    request = _chat_request()
    request["messages"][2]["tool_calls"][0]["function"]["arguments"] = arguments
    with pytest.raises(TokenSourceError, match=match) as info:
        validate_chat_request(request)
    assert "messages[2].tool_calls[0].function.arguments" in str(info.value)


def test_tool_call_without_function_rejected():
    request = _chat_request()
    request["messages"][2]["tool_calls"] = [{"id": "c1", "type": "function"}]
    with pytest.raises(TokenSourceError, match=r"tool_calls\[0\]\.function"):
        validate_chat_request(request)


def test_valid_request_passes():
    validate_chat_request(_chat_request())
