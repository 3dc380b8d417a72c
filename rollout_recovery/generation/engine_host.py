"""Hosting one vLLM engine behind vLLM's OpenAI app on a Ray actor's event loop.

vLLM's own launch helpers install signal handlers, which fail off the main thread where an
async actor runs its coroutines, so the host assembles the same pieces itself: the engine,
the app and its state, and a signal-free uvicorn server. Shutdown is explicit: stop HTTP, then
the engine; Ray's child cleanup and the EngineCore's parent-death signal are the backstop when
a worker dies without it. vLLM is imported only once a host starts (the driver imports this
module without it); what is private about it is in vllm_compat.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

import httpx
import psutil
import uvicorn

from rollout_recovery.config import WorkerConfig
from rollout_recovery.generation import vllm_compat
from rollout_recovery.generation.engine_setup import engine_env, serve_args
from rollout_recovery.model_identity import resolve_model_path


class EngineHost:
    """One AsyncLLM and the HTTP server in front of it, built in steps so that the caller can
    hook the engine and wrap the app in between: `create_engine`, `create_app`, `serve`,
    `warm_up`, and at the end `stop`."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.host = cfg.vllm_cfg.host
        self.port = 0
        self.model = ""
        self.vllm_version = ""
        self.engine: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None  # where engine and server run
        self._args: Any = None
        self._sock: socket.socket | None = None
        self._app: Any = None
        self._server: Any = None
        self._tasks: list[asyncio.Task] = []  # the HTTP server, then vLLM's watchdog

    @property
    def url(self) -> str:
        """The address others reach this server at: a wildcard bind advertises this node's
        IP as Ray knows it, so the workers of a multi-node cluster are reachable from every
        node without a per-node setting."""
        host = self.host
        if host in ("0.0.0.0", "::"):
            import ray

            host = ray.util.get_node_ip_address()
        return f"http://{host}:{self.port}"

    async def create_engine(self) -> Any:
        """The AsyncLLM, after the environment check and vLLM gate. Created on the actor's
        event-loop thread, which lives as long as the actor: the EngineCore's parent-death
        signal is tied to it."""
        _check_engine_env(self.cfg)
        self.vllm_version = vllm_compat.check_supported()
        vllm_compat.install_parent_death_signal()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.entrypoints.launchers.launcher import create_server_socket
        from vllm.usage.usage_lib import UsageContext
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        from vllm.v1.engine.async_llm import AsyncLLM

        self.loop = asyncio.get_running_loop()
        self.model = resolve_model_path(self.cfg.policy.model_path)
        self._sock = create_server_socket((self.host, 0), reuse_port=False)
        self.port = self._sock.getsockname()[1]
        argv = serve_args(self.cfg, self.model, self.host, self.port)
        self._args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        validate_parsed_serve_args(self._args)
        usage = UsageContext.OPENAI_API_SERVER
        self.engine = AsyncLLM.from_vllm_config(
            AsyncEngineArgs.from_cli_args(self._args).create_engine_config(usage),
            usage_context=usage,
            enable_log_requests=False,
            disable_log_stats=True,
        )
        return self.engine

    async def create_app(self, routers: list[Any]) -> Any:
        """vLLM's OpenAI app for the engine, with `routers` added, and its state."""
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app

        tasks = await self.engine.get_supported_tasks()
        self._app = build_app(self._args, tasks, self.engine.model_config)
        for router in routers:
            self._app.include_router(router)
        await init_app_state(self.engine, self._app.state, self._args, tasks)
        return self._app

    async def serve(self, asgi_app: Any) -> None:
        """Serve `asgi_app` (the app, or a wrapper around it) until `stop`; returns once the
        server listens."""
        from vllm.entrypoints.launchers.launcher import NoSignalServer, watchdog_loop

        config = uvicorn.Config(
            asgi_app, log_level="warning", access_log=False, timeout_keep_alive=30
        )
        self._server = NoSignalServer(config)
        self._app.state.server = self._server
        self._tasks = [
            asyncio.create_task(self._server.serve(sockets=[self._sock])),
            asyncio.create_task(watchdog_loop(self._server, self.engine)),
        ]
        while not self._server.started:
            if self._tasks[0].done():
                self._tasks[0].result()
                raise RuntimeError("HTTP server exited during startup")
            await asyncio.sleep(0.02)

    async def warm_up(self) -> None:
        """Pay the one-time costs (~2-3 s: first engine step, first logprobs, chat template)
        at startup, through the same HTTP path callers use."""
        body = {
            "model": self.cfg.policy.served_model_name,
            "messages": [{"role": "user", "content": "warm up"}],
            "max_tokens": 2,
            "temperature": 0.0,
            "logprobs": True,
            "return_token_ids": True,
        }
        async with httpx.AsyncClient() as client:
            resp = await client.post(f"{self.url}/v1/chat/completions", json=body, timeout=120)
        if resp.status_code != 200:
            raise RuntimeError(f"warm-up request failed: {resp.status_code} {resp.text[:300]}")

    @property
    def tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    def http_stopped(self) -> bool:
        return not self._tasks or self._tasks[0].done()

    async def stop(self, timeout_s: float) -> None:
        """Stop HTTP, then the engine, leaving no child process and no shared-memory segment."""
        if self._server is not None:
            self._server.should_exit = True
            try:
                async with asyncio.timeout(timeout_s):
                    await asyncio.shield(self._tasks[0])
            except (TimeoutError, asyncio.CancelledError):
                self._tasks[0].cancel()
            for task in self._tasks[1:]:
                task.cancel()
            self._server = None
        if self.engine is not None:
            engine, self.engine = self.engine, None
            # With HTTP stopped nothing waits on the output handler (vllm_compat says why).
            await vllm_compat.cancel_output_handler(engine)
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, lambda: engine.shutdown(timeout=timeout_s))


def _check_engine_env(cfg: WorkerConfig) -> None:
    """The engine's process environment must be set before vLLM is imported (WorkerPool.start
    sets it through the actor's runtime environment)."""
    wrong = {k: os.environ.get(k) for k, v in engine_env(cfg).items() if os.environ.get(k) != v}
    if wrong:
        raise RuntimeError(
            f"engine environment not applied ({wrong}); start workers with WorkerPool.start()"
        )


def child_pids() -> list[int]:
    """The pids of this process's children (the EngineCore and anything it started)."""
    return sorted(p.pid for p in psutil.Process().children(recursive=True))
