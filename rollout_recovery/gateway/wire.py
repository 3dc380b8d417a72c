"""What crosses the gateway's HTTP boundary: the accepted request, the errors, the backend seam.

The request model is deliberately narrower than OpenAI's: a field is accepted only when the
backend can journal the call and, after a crash, resume or replay it so that the harness
cannot tell. Everything else is refused before the backend sees it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

ROLES = ("system", "user", "assistant", "tool", "developer")
# Fields the app consumes itself; the backend always gets a complete, non-streamed call.
STREAM_FIELDS = ("stream", "stream_options")


class GatewayError(Exception):
    """A refusal with an HTTP status and a stable machine-readable reason."""

    status: int = 400
    reason: str = "bad_request"

    def __init__(self, message: str, reason: str | None = None, status: int | None = None):
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason
        if status is not None:
            self.status = status


class UnknownRollout(GatewayError):
    status = 404
    reason = "unknown_rollout"


class RolloutFinished(GatewayError):
    status = 409
    reason = "rollout_finished"


class CallRefused(GatewayError):
    """The backend will not serve this call (e.g. ``replay_diverged``); the reason is its own."""

    status = 409
    reason = "call_refused"


class RequestRejected(GatewayError):
    """A request the app refuses before the backend; ``param`` names the offending field."""

    def __init__(
        self,
        message: str,
        reason: str | None = None,
        status: int | None = None,
        param: str | None = None,
    ):
        super().__init__(message, reason, status)
        self.param = param


@dataclass
class GatewayReply:
    response: dict  # a complete non-streamed OpenAI chat.completion object
    headers: dict[str, str] = field(default_factory=dict)  # e.g. x-rollout-recovery-source


class GatewayBackend(Protocol):
    """What the app serves from. `rollouts()`: the rollouts whose calls are served (their
    `/v1/models` answers). A backend may also have `async listing()`, every open rollout as
    `{"rollout_id", "state", ...}` (`GET /rollouts` lists those, else `rollouts()`)."""

    async def chat(self, rollout_id: str, body: dict) -> GatewayReply: ...

    def rollouts(self) -> list[str]: ...


@runtime_checkable
class RolloutControl(Protocol):
    """What a standalone gateway (`rollout-recovery gateway`) adds: rollouts opened and
    finished from outside, and the finished ones leased for training."""

    async def open_rollout(self, body: OpenRolloutBody) -> dict: ...

    async def finish_rollout(self, rollout_id: str, result: Any) -> dict: ...

    async def lease(self, body: LeaseBody) -> dict: ...

    async def ack(self, lease_id: str) -> dict: ...


class OpenRolloutBody(BaseModel):
    """`POST /rollouts`: one episode of a GRPO group. Its rollout id is derived from the group
    id and the index, so a harness that restarts after a crash opens the same rollout again
    and gets its journal."""

    model_config = ConfigDict(extra="forbid", strict=True)

    group_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=160)
    generation_index: int = Field(default=0, ge=0, le=9999)
    task: dict[str, Any] = {}
    seed: int | None = Field(default=None, ge=0, lt=2**63)


class FinishRolloutBody(BaseModel):
    """`POST /rollouts/{rollout_id}/finish`: the harness's result, scored by
    `environment.reward` (without one, the result is the reward)."""

    model_config = ConfigDict(extra="forbid")

    result: Any = None


class LeaseBody(BaseModel):
    """`POST /replay/lease`: finished rollouts for training, redelivered unless acknowledged
    within `ttl_s`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_rows: int = Field(ge=1, le=4096)
    ttl_s: float = Field(default=600.0, gt=0, le=86400)


class AckBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    lease_id: str = Field(min_length=1, max_length=200)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool | None = None


class ChatCompletionBody(BaseModel):
    """The chat fields the gateway accepts. Unknown fields are refused, not silently dropped,
    so that a harness never believes a setting took effect when it did not."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def backend_body(self) -> dict[str, Any]:
        """The call as the backend sees it: unset fields and the streaming fields left out."""
        dumped = self.model_dump(exclude=set(STREAM_FIELDS))
        return {k: v for k, v in dumped.items() if v is not None}


def _param(loc: tuple[int | str, ...]) -> str | None:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Decode a request body; anything but a JSON object is ``malformed_body``."""
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestRejected(f"request body is not valid JSON: {e}", "malformed_body") from e
    if not isinstance(data, dict):
        raise RequestRejected("request body must be a JSON object", "malformed_body")
    return data


_Body = TypeVar("_Body", bound=BaseModel)


def parse_body(model: type[_Body], data: dict[str, Any]) -> _Body:
    """Validate a request body: an unknown field is `unsupported_field`, a bad value
    `invalid_field`, each naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        extra = next((err for err in errors if err["type"] == "extra_forbidden"), None)
        if extra is not None:
            name = _param(extra["loc"])
            raise RequestRejected(
                f"unsupported field {name!r}", "unsupported_field", param=name
            ) from None
        err = errors[0]
        name = _param(err["loc"])
        raise RequestRejected(
            f"invalid {name!r}: {err['msg']}", "invalid_field", param=name
        ) from None


def parse_chat_body(data: dict[str, Any]) -> ChatCompletionBody:
    """Validate a chat request and refuse what the gateway cannot serve exactly."""
    body = parse_body(ChatCompletionBody, data)
    _check_supported(body)
    return body


def _check_supported(body: ChatCompletionBody) -> None:
    for i, msg in enumerate(body.messages):
        role = msg.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise RequestRejected(
                f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role!r}",
                "invalid_field",
                param=f"messages[{i}].role",
            )
        content = msg.get("content")
        if content is not None and not isinstance(content, str | list):
            raise RequestRejected(
                f"messages[{i}].content must be a string, a list of parts or null",
                "invalid_field",
                param=f"messages[{i}].content",
            )
    if body.n is not None and body.n != 1:
        raise RequestRejected("only n=1 is supported", "unsupported_n", param="n")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(body, name)
        if value is not None and value != 0:
            raise RequestRejected(
                f"{name} must be 0: a penalty depends on the whole sampled history, so a call "
                "resumed after a crash could not continue it exactly",
                "unsupported_sampling",
                param=name,
            )
    choice = body.tool_choice
    if isinstance(choice, dict) or choice == "required":
        raise RequestRejected(
            "tool_choice must be 'auto' or 'none'; forced tool calls are not supported",
            "unsupported_tool_choice",
            param="tool_choice",
        )
    if choice is not None and choice not in ("auto", "none"):
        raise RequestRejected(
            f"tool_choice must be 'auto' or 'none'; got {choice!r}",
            "invalid_field",
            param="tool_choice",
        )
    if body.stream_options is not None and not body.stream:
        raise RequestRejected(
            "stream_options is only allowed with stream=true",
            "invalid_field",
            param="stream_options",
        )


Chunk = dict[str, Any]


def completion_to_chunks(
    response: dict[str, Any], *, include_usage: bool, include_logprobs: bool
) -> list[Chunk]:
    """Split a finished chat.completion into the chunks vLLM's server would have streamed.

    Content is cut at the per-token strings from the logprobs when they add up to it exactly,
    so a harness that reads tokens as they stream sees the real token boundaries; otherwise
    the content arrives as one delta. Per-token logprobs ride on their chunks only when the
    request asked for them (the backend may have asked vLLM for them for its own use).
    """
    base = {
        "id": response["id"],
        "object": "chat.completion.chunk",
        "created": response["created"],
        "model": response["model"],
    }
    if response.get("system_fingerprint") is not None:
        base["system_fingerprint"] = response["system_fingerprint"]

    def chunk(index: int, delta: dict[str, Any], **extra: Any) -> Chunk:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        choice.update(extra)
        return {**base, "choices": [choice]}

    chunks: list[Chunk] = []
    for choice in response["choices"]:
        index = choice.get("index", 0)
        message = choice["message"]
        chunks.append(chunk(index, {"role": message.get("role") or "assistant", "content": ""}))
        entries = (choice.get("logprobs") or {}).get("content") or []
        pending = list(entries) if include_logprobs else []

        def take_pending() -> dict[str, Any] | None:
            nonlocal pending
            if not pending:
                return None
            out, pending = {"content": pending}, []
            return out

        for key in ("reasoning_content", "reasoning"):
            if isinstance(message.get(key), str) and message[key]:
                chunks.append(chunk(index, {key: message[key]}))
        content = message.get("content")
        if isinstance(content, str) and content:
            tokens = [e.get("token") for e in entries]
            if entries and all(isinstance(t, str) for t in tokens) and "".join(tokens) == content:
                pending = []
                for entry in entries:
                    lp = {"content": [entry]} if include_logprobs else None
                    chunks.append(chunk(index, {"content": entry["token"]}, logprobs=lp))
            else:
                chunks.append(chunk(index, {"content": content}, logprobs=take_pending()))
        tool_calls = message.get("tool_calls") or []
        if tool_calls:
            delta_calls = []
            for i, call in enumerate(tool_calls):
                entry = {"index": i}
                entry.update({k: v for k, v in call.items() if k != "index"})
                delta_calls.append(entry)
            chunks.append(chunk(index, {"tool_calls": delta_calls}, logprobs=take_pending()))
        final: dict[str, Any] = {"finish_reason": choice.get("finish_reason")}
        if "stop_reason" in choice:
            final["stop_reason"] = choice["stop_reason"]
        chunks.append(chunk(index, {}, logprobs=take_pending(), **final))
    if include_usage:
        chunks.append({**base, "choices": [], "usage": response.get("usage")})
    return chunks


def dumps(obj: Any) -> bytes:
    """Strict JSON: a non-finite float is an error rather than non-standard output."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
