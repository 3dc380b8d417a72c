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


class IdentityCheck:
    """ASGI wrapper: a malformed call identity in `vllm_xargs` gets a 400 before it reaches the
    engine (inside the engine it would surface as an opaque 500). Other requests pass as is."""

    PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})

    def __init__(self, app) -> None:
        self.app = app

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
        reason = _identity_error(body)
        if reason is not None:
            error = {"message": reason, "type": "BadRequestError", "param": "vllm_xargs"}
            payload = json.dumps({"error": error | {"code": 400}}).encode()
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 400, "headers": headers})
            await send({"type": "http.response.body", "body": payload})
            return None
        replay = _replay([{"type": "http.request", "body": body}], receive)
        return await self.app(scope, replay, send)


def _replay(messages: list[dict], receive):
    """Hand the buffered messages to the app, then the real stream (vLLM watches it for the
    client's disconnect to abort the request)."""
    pending = list(messages)

    async def replay() -> dict:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


def _identity_error(body: bytes) -> str | None:
    from rollout_recovery.generation.capture import identity_from_extra_args

    try:
        data = json.loads(body or b"{}")
    except ValueError:
        return None  # vLLM answers malformed JSON itself
    xargs = data.get("vllm_xargs") if isinstance(data, dict) else None
    try:
        identity_from_extra_args(xargs if isinstance(xargs, dict) else None)
    except ValueError as err:
        return str(err)
    return None
