"""Control routes on the worker's HTTP server (`/control/v1/...`, bearer token required).

vLLM's `--api-key` guards only its own prefixes, so these routes check their own token, in
constant time. Fence routes never queue behind a running cut: they do not take its lock.
"""

from __future__ import annotations

import json
import secrets

from fastapi import APIRouter, Depends, HTTPException
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field

from rollout_recovery.generation.cut import CutInventory, CutReceipt, CutService, InventoryTooLarge


class FenceBegin(BaseModel):
    model_config = ConfigDict(extra="forbid")

    epoch: int = Field(ge=0)
    lease_s: float = Field(gt=0, le=3600)


class FenceEnd(BaseModel):
    model_config = ConfigDict(extra="forbid")

    epoch: int = Field(ge=0)


class FenceReply(BaseModel):
    epoch: int | None
    held: bool
    expires_in_s: float | None
    released: bool | None = None


def make_control_router(service: CutService, token: str) -> APIRouter:
    bearer = HTTPBearer(auto_error=False)
    expected = token.encode()

    def require_token(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:  # noqa: B008
        given = (creds.credentials if creds else "").encode()
        if not secrets.compare_digest(given, expected):
            raise HTTPException(status_code=401, detail="bad or missing bearer token")

    router = APIRouter(prefix="/control/v1", dependencies=[Depends(require_token)])

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

    @router.get("/metrics")
    async def metrics() -> dict[str, float]:
        return service.metrics.snapshot()

    return router


class RequestGate:
    """ASGI wrapper in front of vLLM's app for the request extensions this project adds.

    - A malformed call identity in `vllm_xargs` gets a 400 before it reaches the engine
      (inside the engine it would surface as an opaque 500).
    - `required_prefix_token_ids` on a chat request is validated and handed to the engine
      (as `vllm_xargs`); on `/tokenize` the returned ids are spliced the same way, so the
      tokenize fallback sees the prompt generation used. The completions API is refused: it
      has no conversation to continue, so supply could not be proven there.
    Other requests pass through untouched.
    """

    PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/tokenize"})

    def __init__(self, app, turn_end_ids: set[int]) -> None:
        self.app, self.turn_end_ids = app, turn_end_ids

    def __getattr__(self, name: str):
        return getattr(self.app, name)  # uvicorn and vLLM look at app.state

    async def __call__(self, scope, receive, send) -> None:
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
        except ValueError:
            data = None  # vLLM answers malformed JSON itself
        prefix = None
        if isinstance(data, dict):
            try:
                _check_identity(data)
                prefix = self._take_prefix(scope["path"], data)
            except ValueError as err:
                return await _reject(send, str(err))
            if prefix is not None:
                body = json.dumps(data).encode()
                scope = _with_length(scope, len(body))
        replay = _replay([{"type": "http.request", "body": body}], receive)
        if scope["path"] == "/tokenize" and prefix is not None:
            return await self._tokenize_with_prefix(scope, replay, send, prefix)
        return await self.app(scope, replay, send)

    @staticmethod
    def _take_prefix(path: str, data: dict) -> list[int] | None:
        from rollout_recovery.generation import prefix_supply

        if prefix_supply.FIELD not in data:
            return None
        if path == "/v1/completions":
            raise ValueError(
                f"{prefix_supply.FIELD} is refused on /v1/completions (supply cannot be proven "
                "there); use chat completions or disable supply_prefix_token_ids"
            )
        prefix = prefix_supply.validate_prefix(data.pop(prefix_supply.FIELD))
        if path == "/v1/chat/completions":
            xargs = data.get("vllm_xargs") or {}
            data["vllm_xargs"] = xargs | {prefix_supply.XARG_REQUIRED_PREFIX: prefix}
        return prefix

    async def _tokenize_with_prefix(self, scope, receive, send, prefix: list[int]) -> None:
        from rollout_recovery.generation.prefix_supply import splice_prefix

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
                out["tokens"] = splice_prefix(out["tokens"], prefix, self.turn_end_ids)
                out["count"] = len(out["tokens"])
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


async def _reject(send, reason: str) -> None:
    error = {"message": reason, "type": "BadRequestError", "code": 400}
    payload = json.dumps({"error": error}).encode()
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
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


def _check_identity(data: dict) -> None:
    from rollout_recovery.generation.capture import identity_from_extra_args

    xargs = data.get("vllm_xargs")
    identity_from_extra_args(xargs if isinstance(xargs, dict) else None)
