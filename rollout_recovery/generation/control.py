"""Control routes on the worker's HTTP server (`/control/v1/...`, bearer token required).

vLLM's `--api-key` guards only its own prefixes, so these routes check their own token, in
constant time. FastAPI reads and parses a body before any dependency runs, so the token and
the body size are checked first by `RequestGate`, in front of the app: an unauthenticated or
oversized body is refused unread. Fence routes never queue behind a running cut: they do not
take its lock.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from http import HTTPStatus
from typing import Annotated, ClassVar

from fastapi import APIRouter, Depends, HTTPException, Query
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from rollout_recovery.data_plane.spans import Span
from rollout_recovery.generation import prefix_supply
from rollout_recovery.generation.attempts import AttemptPage
from rollout_recovery.generation.cut import CutService, InventoryTooLarge
from rollout_recovery.generation.fence import MAX_EPOCH
from rollout_recovery.protocol import (
    WEIGHT_VERSIONS_HEADER,
    XARG_REQUIRED_PREFIX,
    CallIdentity,
    CutInventory,
    CutReceipt,
    check_continuation_fields,
    encode_spans,
    identity_from_extra_args,
)

CONTROL_PREFIX = "/control/"

MAX_CONTROL_BODY_BYTES = 4 * 1024 * 1024
"""Largest control request body (4 MiB). The largest legitimate body is a cut inventory of
`token_capture.max_inventory_calls` calls (default 4096) of at most ~300 bytes each (two ids of
up to 128 characters and an attempt), about 1.2 MiB; 4 MiB leaves room for ~14k such calls and
bounds what any client can make the worker buffer. Larger bodies get 413 unread."""


MAX_ATTEMPTS_PAGE = 10_000
"""Most call-attempt records one control reply carries (a page of ~2 MB of JSON)."""


def _not_bool(value: object) -> object:
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean")
    return value


Epoch = Annotated[int, Field(strict=True, ge=0, le=MAX_EPOCH)]
LeaseSeconds = Annotated[float, BeforeValidator(_not_bool), Field(gt=0, le=3600)]


class FenceBegin(BaseModel):
    model_config = ConfigDict(extra="forbid")

    epoch: Epoch
    lease_s: LeaseSeconds


class FenceEnd(BaseModel):
    model_config = ConfigDict(extra="forbid")

    epoch: Epoch


class FenceReply(BaseModel):
    epoch: int | None
    held: bool
    expires_in_s: float | None
    released: bool | None = None


class ControlRoute(APIRoute):
    """Route class of the control router. It carries the token so that `RequestGate`, which
    wraps the whole app, finds it among the app's routes (FastAPI keeps a route's class when
    the router is included) and can check it before the body is read."""

    control_token: ClassVar[bytes] = b""


def control_token_of(app) -> bytes | None:
    """The control token of `app`'s control routes; None when it has none."""
    for route in getattr(app, "routes", ()):
        if isinstance(route, ControlRoute) and route.control_token:
            return route.control_token
    return None


def make_control_router(service: CutService, token: str) -> APIRouter:
    if not token:
        raise ValueError("control routes need a non-empty bearer token")
    bearer = HTTPBearer(auto_error=False)
    expected = token.encode()

    def require_token(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:  # noqa: B008
        """Second check, for an app served without `RequestGate` in front."""
        given = (creds.credentials if creds else "").encode()
        if not secrets.compare_digest(given, expected):
            raise HTTPException(status_code=401, detail="bad or missing bearer token")

    class TokenRoute(ControlRoute):
        control_token = expected

    router = APIRouter(
        prefix="/control/v1", dependencies=[Depends(require_token)], route_class=TokenRoute
    )

    @router.post("/generation-cut", response_model=CutReceipt)
    async def generation_cut(inventory: CutInventory) -> CutReceipt:
        try:
            return await service.cut(inventory)
        except InventoryTooLarge as err:
            raise HTTPException(status_code=413, detail=str(err)) from None

    @router.post("/fence/begin", response_model=FenceReply)
    async def fence_begin(body: FenceBegin) -> FenceReply:
        try:
            state = service.fence.begin(body.epoch, body.lease_s)
        except ValueError as err:
            raise HTTPException(status_code=409, detail=str(err)) from None
        return FenceReply(**vars(state))

    @router.post("/fence/end", response_model=FenceReply)
    async def fence_end(body: FenceEnd) -> FenceReply:
        released = service.fence.end(body.epoch)
        return FenceReply(**vars(service.fence.state()), released=released)

    @router.get("/call-attempts", response_model=AttemptPage)
    async def call_attempts(
        since: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int | None, Query(ge=1, le=MAX_ATTEMPTS_PAGE)] = MAX_ATTEMPTS_PAGE,
    ) -> AttemptPage:
        """What the engine did per call attempt, changed after cursor `since` (read again
        from the reply's `next` for more)."""
        return service.capture.attempts.read(since, limit)

    @router.get("/metrics")
    async def metrics() -> dict[str, float]:
        """Counters, and the highest fence epoch seen (a new fence may go at most
        MAX_EPOCH_ADVANCE above it)."""
        return service.metrics.snapshot() | {
            "fence_highest_epoch": float(service.fence.highest_epoch)
        }

    return router


class RequestGate:
    """ASGI wrapper in front of vLLM's app for the request extensions this project adds.

    - Requests under `/control/` need the control bearer token (401) and a body of at most
      MAX_CONTROL_BODY_BYTES (413), both checked before the body is read. The token is
      `control_token`, or else the one the app's control routes carry.
    - JSON nested too deeply for the parser gets a 400 (it would surface as a 500).
    - A malformed call identity in `vllm_xargs` gets a 400 before it reaches the engine
      (inside the engine it would surface as an opaque 500).
    - `required_prefix_token_ids` on a chat request is validated and handed to the engine
      (as `vllm_xargs`); on `/tokenize` the returned ids are spliced the same way, so the
      tokenize fallback sees the prompt generation used. Other generation routes refuse it
      (completions has no conversation to continue; responses and messages would drop it
      silently), so supply could not be proven there.
    - The response of an identified, non-streamed chat call carries its tokens' weight-version
      spans in the `WEIGHT_VERSIONS_HEADER` header (`spans_of`: the capture's finished spans;
      a streamed response goes out before its last token and has none).
    Other requests pass through untouched.
    """

    # Every route of the served app that takes `vllm_xargs` (vLLM's request models turn a
    # JSON `true` into 1 on all of them), plus /tokenize for prefix supply.
    PATHS = frozenset(
        {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/tokenize"}
    )

    def __init__(
        self, app, turn_end_ids: set[int], control_token: str | None = None,
        spans_of: Callable[[CallIdentity], list[Span] | None] | None = None,
    ) -> None:  # fmt: skip
        self.app, self.turn_end_ids = app, turn_end_ids
        self.control_token = control_token.encode() if control_token else None
        self.spans_of = spans_of

    def __getattr__(self, name: str):
        return getattr(self.app, name)  # uvicorn and vLLM look at app.state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(CONTROL_PREFIX):
            return await self._control(scope, receive, send)
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.PATHS:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            data = json.loads(body or b"{}")
        except RecursionError:
            return await _reject(send, NESTED_TOO_DEEPLY)
        except ValueError:
            data = None  # vLLM answers malformed JSON itself
        prefix, identity = None, None
        if isinstance(data, dict):
            try:
                identity = _check_identity(data)
                prefix = self._take_prefix(scope["path"], data)
                if prefix is not None:
                    body = json.dumps(data).encode()
            except RecursionError:
                return await _reject(send, NESTED_TOO_DEEPLY)
            except ValueError as err:
                return await _reject(send, str(err))
            if prefix is not None:
                scope = _with_length(scope, len(body))
        replay = _replay([{"type": "http.request", "body": body}], receive)
        if scope["path"] == "/tokenize" and prefix is not None:
            return await self._tokenize_with_prefix(scope, replay, send, prefix)
        if identity is not None and self.spans_of is not None and not data.get("stream"):
            send = self._with_spans(send, identity)
        return await self.app(scope, replay, send)

    def _with_spans(self, send, identity: CallIdentity):
        """`send` with the call's spans added to its response's headers (taken once)."""

        async def send_with_spans(message: dict) -> None:
            if message["type"] == "http.response.start" and message.get("status") == 200:
                spans = self.spans_of(identity)
                if spans is not None:
                    header = (WEIGHT_VERSIONS_HEADER.encode(), encode_spans(spans).encode())
                    message = message | {"headers": [*message.get("headers", []), header]}
            await send(message)

        return send_with_spans

    async def _control(self, scope, receive, send) -> None:
        """Token, then size, then the body: an unauthenticated or oversized request costs the
        worker no buffering (uvicorn drops the unread rest of a body it was not asked for)."""
        if self.control_token is None:
            self.control_token = control_token_of(self.app)
        if self.control_token is None:
            return await self.app(scope, receive, send)  # no control routes: the app's 404
        if not secrets.compare_digest(_bearer_token(scope), self.control_token):
            challenge = [(b"www-authenticate", b"Bearer")]
            return await _reject(send, "bad or missing bearer token", 401, challenge)
        too_large = (
            f"control request body is larger than MAX_CONTROL_BODY_BYTES "
            f"({MAX_CONTROL_BODY_BYTES} bytes); split the inventory"
        )
        declared = _header(scope, b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await _reject(send, f"bad Content-Length header {declared!r}")
            if int(declared) > MAX_CONTROL_BODY_BYTES:
                return await _reject(send, too_large, 413)
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_CONTROL_BODY_BYTES:
                return await _reject(send, too_large, 413)
            chunks.append(chunk)
            more = message.get("more_body", False)
        replay = _replay([{"type": "http.request", "body": b"".join(chunks)}], receive)
        return await self.app(scope, replay, send)

    @staticmethod
    def _take_prefix(path: str, data: dict) -> list[int] | None:
        if prefix_supply.FIELD not in data:
            return None
        if path not in ("/v1/chat/completions", "/tokenize"):
            raise ValueError(
                f"{prefix_supply.FIELD} is refused on {path} (supply cannot be proven "
                "there); use chat completions or disable supply_prefix_token_ids"
            )
        prefix = prefix_supply.validate_prefix(data.pop(prefix_supply.FIELD))
        if path == "/v1/chat/completions":
            xargs = data.get("vllm_xargs") or {}
            data["vllm_xargs"] = xargs | {XARG_REQUIRED_PREFIX: prefix}
        return prefix

    async def _tokenize_with_prefix(self, scope, receive, send, prefix: list[int]) -> None:
        start: dict = {}
        parts: list[bytes] = []

        async def capture(message: dict) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            else:
                parts.append(message.get("body", b""))

        await self.app(scope, receive, capture)
        body = b"".join(parts)
        if start.get("status") == 200:
            try:
                out = json.loads(body)
                tokens = prefix_supply.splice_prefix(out["tokens"], prefix, self.turn_end_ids)
                out["tokens"], out["count"] = tokens, len(tokens)
            except ValueError as err:
                return await _reject(send, str(err))
            body = json.dumps(out).encode()
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": start.get("status", 500),
                    "headers": headers})  # fmt: skip
        await send({"type": "http.response.body", "body": body})


def _with_length(scope: dict, length: int) -> dict:
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
    return scope | {"headers": [*headers, (b"content-length", str(length).encode())]}


NESTED_TOO_DEEPLY = "request body JSON is nested too deeply to parse"


def _header(scope: dict, name: bytes) -> bytes | None:
    """The first value of header `name` (ASGI lower-cases header names)."""
    return next((v for k, v in scope["headers"] if k == name), None)


def _bearer_token(scope: dict) -> bytes:
    """The credentials of an `Authorization: Bearer ...` header, b"" when there is none."""
    scheme, _, credentials = (_header(scope, b"authorization") or b"").partition(b" ")
    return credentials.strip() if scheme.lower() == b"bearer" else b""


async def _reject(send, reason: str, status: int = 400, headers=()) -> None:
    """An OpenAI-style error body, as vLLM's own handlers write it."""
    kind = "BadRequestError" if status == 400 else HTTPStatus(status).phrase
    error = {"message": reason, "type": kind, "param": None, "code": status}
    payload = json.dumps({"error": error}).encode()
    headers = [(b"content-type", b"application/json"), *headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def _replay(messages: list[dict], receive):
    """Hand the buffered messages to the app, then the real stream (vLLM watches it for the
    client's disconnect to abort the request)."""
    pending = list(messages)

    async def replay() -> dict:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


def _check_identity(data: dict) -> CallIdentity | None:
    """The call identity and continuation fields as sent (vLLM's request model would turn a
    JSON `true` into 1 before the engine sees it); the identity, None when there is none."""
    xargs = data.get("vllm_xargs")
    identity = identity_from_extra_args(xargs if isinstance(xargs, dict) else None)
    if isinstance(xargs, dict):
        check_continuation_fields(xargs)
    return identity
