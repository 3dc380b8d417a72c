"""The OpenAI-compatible HTTP face of the rollout gateway.

Each rollout has its own base URL, ``/rollouts/{rollout_id}/v1``, so an unmodified harness
only sets ``base_url``. The app authenticates, validates and refuses everything it cannot
serve exactly before the backend is called; the backend always answers with a complete call,
and streaming is synthesized from it here.
"""

from __future__ import annotations

import hmac
import logging
import re
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout_recovery.gateway.wire import (
    AckBody,
    FinishRolloutBody,
    GatewayBackend,
    GatewayError,
    LeaseBody,
    OpenRolloutBody,
    RequestRejected,
    RolloutControl,
    UnknownRollout,
    completion_to_chunks,
    dumps,
    parse_body,
    parse_chat_body,
    parse_json_object,
)

log = logging.getLogger(__name__)

ROLLOUT_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
MAX_ROLLOUT_ID_LEN = 200
REASON_HEADER = "x-rollout-recovery-reason"
_HTTP_REASONS = {404: "not_found", 405: "method_not_allowed"}


def error_response(status: int, reason: str, message: str, param: str | None = None) -> Response:
    """An error in OpenAI's shape, so clients raise their usual typed exceptions."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = {"error": {"message": message, "type": kind, "code": reason, "param": param}}
    headers = {REASON_HEADER: reason}
    if status < 500:
        # OpenAI clients retry 408/409/429 by default; none of these refusals would change.
        headers["x-should-retry"] = "false"
    if status == 401:
        headers["www-authenticate"] = "Bearer"
    return Response(dumps(body), status, headers=headers, media_type="application/json")


def _from_gateway_error(err: GatewayError) -> Response:
    return error_response(err.status, err.reason, err.message, getattr(err, "param", None))


def check_rollout_id(rollout_id: str) -> None:
    """Rollout ids become journal keys and path parts downstream; refuse anything odd here."""
    if len(rollout_id) > MAX_ROLLOUT_ID_LEN or not ROLLOUT_ID_RE.match(rollout_id):
        raise RequestRejected(
            f"invalid rollout id {rollout_id[:MAX_ROLLOUT_ID_LEN]!r}: expected "
            f"{ROLLOUT_ID_RE.pattern} and at most {MAX_ROLLOUT_ID_LEN} characters",
            "bad_rollout_id",
        )


async def read_body(request: Request, limit: int) -> bytes:
    """Read at most ``limit`` bytes, refusing early on Content-Length and again while streaming
    (a chunked body has no length to trust)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise RequestRejected("invalid Content-Length header", "malformed_body") from None
        if size > limit:
            raise RequestRejected(
                f"request body of {size} bytes exceeds the limit of {limit}", "body_too_large", 413
            )
    parts: list[bytes] = []
    total = 0
    async for part in request.stream():
        total += len(part)
        if total > limit:
            raise RequestRejected(
                f"request body exceeds the limit of {limit} bytes", "body_too_large", 413
            )
        parts.append(part)
    return b"".join(parts)


def _bearer_check(token: str | None) -> Callable[[Request], None]:
    expected = token.encode() if token is not None else None

    def require_token(request: Request) -> None:
        if expected is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
            raise RequestRejected("missing or wrong bearer token", "unauthorized", 401)

    return require_token


def create_app(
    backend: GatewayBackend,
    token: str | None = None,
    max_body_bytes: int = 4 << 20,
    model_name: str = "policy",
) -> FastAPI:
    """Build the gateway app over ``backend``; with ``token`` set every route but /health
    needs ``Authorization: Bearer <token>`` (what an OpenAI client sends as its api_key)."""
    app = FastAPI(title="rollout_recovery gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.backend = backend
    created = int(time.time())
    auth = [Depends(_bearer_check(token))]

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, exc: GatewayError) -> Response:
        return _from_gateway_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        reason = _HTTP_REASONS.get(exc.status_code, "bad_request")
        return error_response(exc.status_code, reason, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        return error_response(400, "invalid_field", str(exc.errors()))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/rollouts", dependencies=auth)
    async def list_rollouts() -> Response:
        """The open rollouts' ids; with a backend that lists them (`listing`), each one's
        state under `details` too."""
        listing = getattr(backend, "listing", None)
        try:
            if listing is None:
                out = {"rollouts": list(backend.rollouts())}
            else:
                details = list(await listing())
                out = {"rollouts": [d["rollout_id"] for d in details], "details": details}
        except GatewayError as e:
            return _from_gateway_error(e)
        except Exception as e:
            log.exception("gateway backend failed to list rollouts")
            return error_response(502, "backend_error", f"backend failed: {e!r}")
        return Response(dumps(out), media_type="application/json")

    # `:path` so that an id with an encoded slash still reaches the id check (a 400 that says
    # why) instead of falling through the router as a bare 404.
    @app.get("/rollouts/{rollout_id:path}/v1/models", dependencies=auth)
    async def list_models(rollout_id: str) -> Response:
        check_rollout_id(rollout_id)
        try:
            known = rollout_id in backend.rollouts()
        except Exception as e:
            log.exception("gateway backend failed to list rollouts")
            return error_response(502, "backend_error", f"backend failed: {e!r}")
        if not known:
            return _from_gateway_error(UnknownRollout(f"unknown rollout {rollout_id!r}"))
        model = {"id": model_name, "object": "model", "created": created, "owned_by": "rollout"}
        return Response(dumps({"object": "list", "data": [model]}), media_type="application/json")

    async def control(call) -> Response:
        """A rollout-control call: only a standalone gateway's backend serves them."""
        if not isinstance(backend, RolloutControl):
            return error_response(
                409, "rollouts_managed", "this gateway's rollouts are opened and finished by "
                "the training job; open rollouts from outside with `rollout-recovery gateway`",
            )  # fmt: skip
        try:
            out = await call(backend)
        except GatewayError as e:
            return _from_gateway_error(e)
        except Exception as e:
            log.exception("gateway backend failed on a rollout-control call")
            return error_response(502, "backend_error", f"backend failed: {e!r}")
        return Response(dumps(out), media_type="application/json")

    @app.post("/rollouts", dependencies=auth)
    async def open_rollout(request: Request) -> Response:
        raw = parse_json_object(await read_body(request, max_body_bytes))
        body = parse_body(OpenRolloutBody, raw)
        return await control(lambda b: b.open_rollout(body))

    @app.post("/rollouts/{rollout_id:path}/finish", dependencies=auth)
    async def finish_rollout(rollout_id: str, request: Request) -> Response:
        check_rollout_id(rollout_id)
        raw = parse_json_object(await read_body(request, max_body_bytes))
        body = parse_body(FinishRolloutBody, raw)
        return await control(lambda b: b.finish_rollout(rollout_id, body.result))

    @app.post("/replay/lease", dependencies=auth)
    async def lease(request: Request) -> Response:
        body = parse_body(LeaseBody, parse_json_object(await read_body(request, max_body_bytes)))
        return await control(lambda b: b.lease(body))

    @app.post("/replay/ack", dependencies=auth)
    async def ack(request: Request) -> Response:
        body = parse_body(AckBody, parse_json_object(await read_body(request, max_body_bytes)))
        return await control(lambda b: b.ack(body.lease_id))

    @app.post("/rollouts/{rollout_id:path}/v1/chat/completions", dependencies=auth)
    async def chat_completions(rollout_id: str, request: Request) -> Response:
        check_rollout_id(rollout_id)
        body = parse_chat_body(parse_json_object(await read_body(request, max_body_bytes)))
        try:
            reply = await backend.chat(rollout_id, body.backend_body())
        except GatewayError as e:
            return _from_gateway_error(e)
        except Exception as e:
            log.exception("gateway backend failed on rollout %s", rollout_id)
            return error_response(502, "backend_error", f"backend failed: {e!r}")
        try:
            if not body.stream:
                return Response(
                    dumps(reply.response), headers=reply.headers, media_type="application/json"
                )
            chunks = completion_to_chunks(
                reply.response,
                include_usage=body.include_usage,
                include_logprobs=bool(body.logprobs),
            )
            events = [b"data: " + dumps(c) + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            log.exception("gateway backend returned an unusable response on %s", rollout_id)
            return error_response(502, "backend_error", f"backend response unusable: {e!r}")
        headers = {"cache-control": "no-cache", **reply.headers}
        return StreamingResponse(_iterate(events), headers=headers, media_type="text/event-stream")

    return app


async def _iterate(events: list[bytes]) -> AsyncIterator[bytes]:
    for event in events:
        yield event


__all__ = ["check_rollout_id", "create_app", "error_response", "read_body"]
