"""The gateway's HTTP layer, driven by the official openai client against a real server.

The backend is a fake on purpose: these tests pin what the wire looks like (routes, auth,
validation, errors, synthesized streaming); the real backend has its own engine tests.
"""

from __future__ import annotations

import asyncio
import copy
import socket
import threading
from typing import Any

import httpx
import openai
import pytest

from rollout_recovery.gateway import (
    GatewayReply,
    GatewayServer,
    RolloutFinished,
    UnknownRollout,
    create_app,
)

TOKEN = "s3cret-gateway-token"
MAX_BODY = 64 * 1024
SOURCE = "x-rollout-recovery-source"
REASON = "x-rollout-recovery-reason"

TOKENS = [("Hello", -0.01), (",", -0.2), (" wor", -0.5), ("ld", -0.03), ("!", -1.25)]
CONTENT = "".join(t for t, _ in TOKENS)


def _lp(token: str, logprob: float) -> dict[str, Any]:
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(token.encode()),
        "top_logprobs": [{"token": token, "logprob": logprob, "bytes": list(token.encode())}],
    }


def _completion(message: dict[str, Any], finish: str, entries: list[dict] | None) -> dict:
    """A chat.completion as vLLM 0.32's server returns it, extra vLLM fields included."""
    full = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": [],
        "reasoning_content": None,
    }
    full.update(message)
    return {
        "id": "chatcmpl-7f3a",
        "object": "chat.completion",
        "created": 1760000000,
        "model": "policy",
        "choices": [
            {
                "index": 0,
                "message": full,
                "logprobs": None if entries is None else {"content": entries},
                "finish_reason": finish,
                "stop_reason": None,
                "token_ids": [11, 12, 13],
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": 17,
            "completion_tokens": 5,
            "total_tokens": 22,
            "prompt_tokens_details": None,
        },
        "prompt_logprobs": None,
        "prompt_token_ids": [1, 2, 3],
        "kv_transfer_params": None,
    }


TOOL_CALL = {
    "id": "chatcmpl-tool-1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]

REPLIES = {
    "r1": _completion({"content": CONTENT}, "stop", [_lp(t, lp) for t, lp in TOKENS]),
    # Tokens that do not add up to the content (e.g. detokenizer cleanup): one delta.
    "r.odd": _completion({"content": CONTENT}, "length", [_lp("Hi", -0.1)]),
    "tools": _completion({"tool_calls": [TOOL_CALL]}, "tool_calls", [_lp("<tc>", -0.4)]),
}


class FakeBackend:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    async def chat(self, rollout_id: str, body: dict) -> GatewayReply:
        self.calls.append((rollout_id, body))
        if rollout_id == "done":
            raise RolloutFinished("rollout 'done' already finished")
        if rollout_id == "boom":
            raise RuntimeError("engine exploded")
        if rollout_id not in REPLIES:
            raise UnknownRollout(f"unknown rollout {rollout_id!r}")
        headers = {SOURCE: "journal", "x-rollout-recovery-call-id": "c-0"}
        return GatewayReply(copy.deepcopy(REPLIES[rollout_id]), headers)

    def rollouts(self) -> list[str]:
        return [*REPLIES, "done", "boom"]


BACKEND = FakeBackend()
MESSAGES = [{"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def url():
    server = GatewayServer()
    base = server.start(create_app(BACKEND, token=TOKEN, max_body_bytes=MAX_BODY))
    yield base
    server.stop()


@pytest.fixture(autouse=True)
def _fresh_calls():
    BACKEND.calls.clear()


def client(url: str, rollout: str = "r1", api_key: str = TOKEN) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/rollouts/{rollout}/v1", api_key=api_key, max_retries=0)


def post_raw(url: str, path: str, **kwargs: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {TOKEN}", **kwargs.pop("headers", {})}
    return httpx.post(f"{url}{path}", headers=headers, timeout=10, **kwargs)


def assert_refused(resp: httpx.Response, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers[REASON] == code
    assert resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert error["code"] == code
    assert BACKEND.calls == []
    return error


def assert_api_error(exc: openai.APIStatusError, status: int, code: str) -> None:
    assert exc.status_code == status
    assert exc.code == code
    assert exc.response.headers[REASON] == code
    assert BACKEND.calls == []


def test_non_streaming_call(url):
    raw = client(url).chat.completions.with_raw_response.create(
        model="policy", messages=MESSAGES, logprobs=True, top_logprobs=1, temperature=1.0
    )
    assert raw.headers[SOURCE] == "journal"
    assert raw.headers["x-rollout-recovery-call-id"] == "c-0"
    completion = raw.parse()
    choice = completion.choices[0]
    assert choice.message.content == CONTENT
    assert choice.finish_reason == "stop"
    assert [e.token for e in choice.logprobs.content] == [t for t, _ in TOKENS]
    assert [e.logprob for e in choice.logprobs.content] == [lp for _, lp in TOKENS]
    assert completion.usage.total_tokens == 22
    # Passed through unchanged: vLLM's extra fields survive for callers that want them.
    assert completion.model_extra["prompt_token_ids"] == [1, 2, 3]

    [(rollout, body)] = BACKEND.calls
    assert rollout == "r1"
    assert body == {
        "model": "policy",
        "messages": MESSAGES,
        "logprobs": True,
        "top_logprobs": 1,
        "temperature": 1.0,
    }


def test_streaming_call_matches_the_completed_call(url):
    raw = client(url).chat.completions.with_raw_response.create(
        model="policy",
        messages=MESSAGES,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert raw.headers[SOURCE] == "journal"
    assert raw.headers["content-type"].startswith("text/event-stream")
    chunks = list(raw.parse())
    assert {c.id for c in chunks} == {"chatcmpl-7f3a"}
    assert {c.created for c in chunks} == {1760000000}
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(c.choices[0].delta.content for c in content_chunks) == CONTENT
    assert [c.choices[0].delta.content for c in content_chunks] == [t for t, _ in TOKENS]
    for chunk, (token, lp) in zip(content_chunks, TOKENS, strict=True):
        [entry] = chunk.choices[0].logprobs.content
        assert (entry.token, entry.logprob) == (token, lp)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    body = BACKEND.calls[0][1]
    assert "stream" not in body and "stream_options" not in body


def test_streaming_without_logprobs_or_usage(url):
    chunks = list(
        client(url).chat.completions.create(model="policy", messages=MESSAGES, stream=True)
    )
    content = [c.choices[0].delta.content or "" for c in chunks]
    assert "".join(content) == CONTENT
    assert all(c.choices[0].logprobs is None for c in chunks)
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_streaming_whole_content_when_tokens_do_not_add_up(url):
    chunks = list(
        client(url, "r.odd").chat.completions.create(model="policy", messages=MESSAGES, stream=True)
    )
    content = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert content == [CONTENT]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_tool_calls_streamed_and_not(url):
    c = client(url, "tools")
    completion = c.chat.completions.create(
        model="policy", messages=MESSAGES, tools=TOOLS, tool_choice="auto"
    )
    [call] = completion.choices[0].message.tool_calls
    assert (call.id, call.function.name) == ("chatcmpl-tool-1", "get_weather")
    assert call.function.arguments == '{"city": "Oslo"}'
    assert completion.choices[0].finish_reason == "tool_calls"

    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in c.chat.completions.create(
        model="policy", messages=MESSAGES, tools=TOOLS, tool_choice="auto", stream=True
    ):
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            acc = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            acc["id"] += delta.id or ""
            acc["name"] += delta.function.name or ""
            acc["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    assert calls == {
        0: {"id": "chatcmpl-tool-1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    }
    assert finish == "tool_calls"

    assert len(BACKEND.calls) == 2
    for _, body in BACKEND.calls:
        assert body["tools"] == TOOLS and body["tool_choice"] == "auto"


def test_unknown_rollout_is_404(url):
    with pytest.raises(openai.NotFoundError) as exc:
        client(url, "nope").chat.completions.create(model="policy", messages=MESSAGES)
    assert exc.value.status_code == 404
    assert exc.value.code == "unknown_rollout"
    assert exc.value.response.headers[REASON] == "unknown_rollout"
    assert [r for r, _ in BACKEND.calls] == ["nope"]  # refused by the backend, once


def test_call_after_finish_is_409_and_not_retried(url):
    harness = openai.OpenAI(base_url=f"{url}/rollouts/done/v1", api_key=TOKEN)  # default retries
    with pytest.raises(openai.ConflictError) as exc:
        harness.chat.completions.create(model="policy", messages=MESSAGES, stream=True)
    assert len(BACKEND.calls) == 1
    assert exc.value.status_code == 409
    assert exc.value.code == "rollout_finished"
    assert exc.value.response.headers[REASON] == "rollout_finished"


def test_backend_crash_is_502(url):
    with pytest.raises(openai.InternalServerError) as exc:
        client(url, "boom").chat.completions.create(model="policy", messages=MESSAGES)
    assert exc.value.status_code == 502
    assert exc.value.code == "backend_error"
    assert "engine exploded" in exc.value.message
    assert exc.value.response.headers[REASON] == "backend_error"


def test_malformed_json_is_400(url):
    resp = post_raw(url, "/rollouts/r1/v1/chat/completions", content=b'{"messages": [')
    assert_refused(resp, 400, "malformed_body")
    resp = post_raw(url, "/rollouts/r1/v1/chat/completions", json=["not", "an", "object"])
    assert_refused(resp, 400, "malformed_body")


def test_unknown_field_is_named(url):
    with pytest.raises(openai.BadRequestError) as exc:
        client(url).chat.completions.create(
            model="policy", messages=MESSAGES, extra_body={"best_of": 3}
        )
    assert_api_error(exc.value, 400, "unsupported_field")
    assert exc.value.param == "best_of"
    assert "best_of" in exc.value.message


@pytest.mark.parametrize(
    ("kwargs", "code", "param"),
    [
        ({"n": 2}, "unsupported_n", "n"),
        ({"tool_choice": "required", "tools": TOOLS}, "unsupported_tool_choice", "tool_choice"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
            "unsupported_tool_choice",
            "tool_choice",
        ),
        ({"frequency_penalty": 0.5}, "unsupported_sampling", "frequency_penalty"),
        ({"presence_penalty": -1.0}, "unsupported_sampling", "presence_penalty"),
        ({"max_tokens": 0}, "invalid_field", "max_tokens"),
        ({"temperature": -0.1}, "invalid_field", "temperature"),
        ({"top_logprobs": 21}, "invalid_field", "top_logprobs"),
        ({"messages": []}, "invalid_field", "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "invalid_field", "messages[0].role"),
        ({"messages": [{"role": "user", "content": 7}]}, "invalid_field", "messages[0].content"),
        ({"stream_options": {"include_usage": True}}, "invalid_field", "stream_options"),
        (
            {"stream": True, "stream_options": {"include_usage": True, "continuous": True}},
            "unsupported_field",
            "stream_options.continuous",
        ),
    ],
)
def test_refused_fields(url, kwargs, code, param):
    request = {"model": "policy", "messages": MESSAGES, **kwargs}
    with pytest.raises(openai.BadRequestError) as exc:
        client(url).chat.completions.create(**request)
    assert_api_error(exc.value, 400, code)
    assert exc.value.param == param


def test_zero_penalties_are_accepted(url):
    client(url).chat.completions.create(
        model="policy", messages=MESSAGES, frequency_penalty=0, presence_penalty=0.0
    )
    assert len(BACKEND.calls) == 1


def test_streaming_request_refused_as_plain_json(url):
    resp = post_raw(
        url, "/rollouts/r1/v1/chat/completions", json={"messages": MESSAGES, "stream": True, "n": 3}
    )
    assert_refused(resp, 400, "unsupported_n")


def test_wrong_or_missing_token_is_401(url):
    with pytest.raises(openai.AuthenticationError) as exc:
        client(url, api_key="wrong").chat.completions.create(model="policy", messages=MESSAGES)
    assert_api_error(exc.value, 401, "unauthorized")
    resp = httpx.post(f"{url}/rollouts/r1/v1/chat/completions", json={"messages": MESSAGES})
    assert_refused(resp, 401, "unauthorized")
    for path in ("/rollouts", "/rollouts/r1/v1/models"):
        assert_refused(httpx.get(f"{url}{path}"), 401, "unauthorized")
        resp = httpx.get(f"{url}{path}", headers={"authorization": "Basic " + TOKEN})
        assert_refused(resp, 401, "unauthorized")


@pytest.mark.parametrize("rollout", ["..%2Fx", "-bad", ".hidden", "a%20b", "x" * 201])
def test_bad_rollout_id_is_400(url, rollout):
    resp = post_raw(url, f"/rollouts/{rollout}/v1/chat/completions", json={"messages": MESSAGES})
    assert_refused(resp, 400, "bad_rollout_id")


def test_oversize_body_is_413(url):
    big = {"messages": [{"role": "user", "content": "x" * MAX_BODY}]}
    assert_refused(
        post_raw(url, "/rollouts/r1/v1/chat/completions", json=big), 413, "body_too_large"
    )

    def chunked():  # no Content-Length: the limit must hold while reading
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(MAX_BODY // 1024 + 1):
            yield b"y" * 1024
        yield b'"}]}'

    resp = post_raw(url, "/rollouts/r1/v1/chat/completions", content=chunked())
    assert_refused(resp, 413, "body_too_large")


def test_unrouted_path_uses_the_error_shape(url):
    resp = httpx.get(f"{url}/nowhere", headers={"authorization": f"Bearer {TOKEN}"})
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "not_found"


def test_listing_routes(url):
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    resp = httpx.get(f"{url}/rollouts", headers={"authorization": f"Bearer {TOKEN}"})
    assert resp.json() == {"rollouts": ["r1", "r.odd", "tools", "done", "boom"]}
    models = client(url).models.list()
    assert [m.id for m in models.data] == ["policy"]
    with pytest.raises(openai.NotFoundError) as exc:
        client(url, "nope").models.list()
    assert exc.value.code == "unknown_rollout"


def _health(base: str) -> int:
    return httpx.get(f"{base}/health", timeout=5).status_code


def test_server_starts_and_stops_twice_and_releases_its_port():
    app = create_app(FakeBackend())
    first = GatewayServer()
    base = first.start(app)
    port = int(base.rsplit(":", 1)[1])
    assert _health(base) == 200
    first.stop()
    first.stop()
    with pytest.raises(httpx.ConnectError):
        _health(base)
    with pytest.raises(RuntimeError):
        _ = first.url

    second = GatewayServer()
    assert second.start(app, port=port) == base  # the same port is free again
    assert _health(base) == 200
    second.stop()
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))


async def test_server_starts_inside_a_running_loop_and_off_the_main_thread():
    app = create_app(FakeBackend(), token=TOKEN)
    server = GatewayServer()
    base = server.start(app)  # the caller's loop is running; the server uses its own
    try:
        async with httpx.AsyncClient() as http:
            resp = await http.get(f"{base}/health")
        assert resp.status_code == 200
    finally:
        server.stop()

    result: dict[str, Any] = {}

    def in_thread() -> None:
        other = GatewayServer()
        result["url"] = other.start(app)
        result["status"] = _health(result["url"])
        other.stop()

    thread = threading.Thread(target=in_thread)
    await asyncio.to_thread(lambda: (thread.start(), thread.join(20)))
    assert result["status"] == 200


class ControlBackend(FakeBackend):
    """A standalone gateway's backend: rollouts opened, finished and leased over HTTP."""

    def __init__(self) -> None:
        super().__init__()
        self.opened: list[dict] = []

    async def open_rollout(self, body) -> dict:
        self.opened.append(body.model_dump())
        return {"rollout_id": f"{body.group_id}-g{body.generation_index}", "restored": False}

    async def finish_rollout(self, rollout_id: str, result: Any) -> dict:
        if rollout_id == "done":
            raise RolloutFinished("rollout 'done' already finished")
        return {"rollout_id": rollout_id, "reward": float(result["score"])}

    async def lease(self, body) -> dict:
        return {"lease_id": "L1", "rows": [], "max_rows": body.max_rows}

    async def ack(self, lease_id: str) -> dict:
        return {"acked": 2}


def test_rollout_control_routes_of_a_standalone_gateway():
    backend = ControlBackend()
    server = GatewayServer()
    base = server.start(create_app(backend, token=TOKEN))
    try:
        opened = post_raw(base, "/rollouts", json={"group_id": "q1", "generation_index": 2,
                                                   "task": {"messages": MESSAGES}})  # fmt: skip
        assert opened.status_code == 200 and opened.json()["rollout_id"] == "q1-g2"
        assert backend.opened == [{"group_id": "q1", "generation_index": 2,
                                   "task": {"messages": MESSAGES}, "seed": None}]  # fmt: skip
        done = post_raw(base, "/rollouts/q1-g2/finish", json={"result": {"score": 0.5}})
        assert done.json() == {"rollout_id": "q1-g2", "reward": 0.5}
        again = post_raw(base, "/rollouts/done/finish", json={"result": 1})
        assert again.status_code == 409 and again.headers[REASON] == "rollout_finished"
        lease = post_raw(base, "/replay/lease", json={"max_rows": 4})
        assert lease.json() == {"lease_id": "L1", "rows": [], "max_rows": 4}
        assert post_raw(base, "/replay/ack", json={"lease_id": "L1"}).json() == {"acked": 2}
        for path, body, code in (
            ("/rollouts", {"group_id": "../x"}, "invalid_field"),
            ("/rollouts", {"group_id": "q", "extra": 1}, "unsupported_field"),
            ("/rollouts", {"group_id": "q", "generation_index": -1}, "invalid_field"),
            ("/replay/lease", {"max_rows": 0}, "invalid_field"),
            ("/replay/ack", {}, "invalid_field"),
            ("/rollouts/q1-g2/finish", {"result": 1, "reward": 2}, "unsupported_field"),
        ):
            resp = post_raw(base, path, json=body)
            assert resp.status_code == 400 and resp.headers[REASON] == code, (path, resp.text)
        assert len(backend.opened) == 1  # nothing refused reached the backend
        unauthorized = httpx.post(f"{base}/rollouts", json={"group_id": "q"}, timeout=10)
        assert unauthorized.status_code == 401
    finally:
        server.stop()


def test_a_training_jobs_gateway_refuses_rollout_control(url):
    """Rollouts of a training job are opened by its own episodes: an outside open, finish
    or lease is refused with a reason, not half-served."""
    for path, body in (("/rollouts", {"group_id": "q"}), ("/rollouts/r1/finish", {}),
                       ("/replay/lease", {"max_rows": 1})):  # fmt: skip
        resp = post_raw(url, path, json=body)
        assert resp.status_code == 409 and resp.headers[REASON] == "rollouts_managed"
