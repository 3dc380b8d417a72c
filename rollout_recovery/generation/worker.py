"""GenerationWorker: a Ray actor that owns one vLLM AsyncLLM and serves vLLM's OpenAI API.

vLLM's own launch helpers install signal handlers, which fail off the main thread where an
async actor runs its coroutines, so the worker assembles the same pieces itself (engine, app,
app state, a signal-free uvicorn server) on the actor's event loop. Shutdown is explicit: stop
HTTP, then `engine.shutdown`, then the caller kills the actor; Ray's child cleanup and the
EngineCore's parent-death signal are the backstop when a worker dies without that.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any

import ray
from pydantic import BaseModel

from rollout_recovery import faults
from rollout_recovery.config import RolloutRecoveryConfig
from rollout_recovery.generation.engine_setup import (
    SUPPORTED_VLLM_SERIES,
    engine_env,
    serve_args,
)


class WorkerInfo(BaseModel):
    """What a started worker reports about itself."""

    worker_index: int
    url: str
    host: str
    port: int
    served_model_name: str
    model: str
    pid: int
    engine_pids: list[int]
    vllm_version: str
    startup_s: float
    eos_token_id: int | None = None  # closes an assistant turn in the chat template


class WorkerHealth(BaseModel):
    healthy: bool
    reason: str | None = None
    url: str


class GenerationWorker:
    """One vLLM engine plus its OpenAI-compatible HTTP server (an async Ray actor)."""

    def __init__(self, config: dict[str, Any], worker_index: int = 0, store=None) -> None:
        self._cfg = RolloutRecoveryConfig.model_validate(config)
        self._index = worker_index
        self._store = store
        self._service = None
        self._weight_version = 0
        self._engine = None
        self._server = None
        self._tasks: list[asyncio.Task] = []
        self._info: WorkerInfo | None = None

    async def start(self) -> WorkerInfo:
        """Build the engine and start serving; returns once a warm-up generation has run."""
        if self._info is not None:
            return self._info
        t0 = time.monotonic()
        want = engine_env(self._cfg)
        wrong = {k: os.environ.get(k) for k, v in want.items() if os.environ.get(k) != v}
        if wrong:
            raise RuntimeError(
                f"engine environment not applied ({wrong}); start workers with start_workers()"
            )

        import uvicorn
        import vllm
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.entrypoints.launchers.launcher import (
            NoSignalServer,
            create_server_socket,
            watchdog_loop,
        )
        from vllm.usage.usage_lib import UsageContext
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        from vllm.v1.engine.async_llm import AsyncLLM

        if not vllm.__version__.startswith(SUPPORTED_VLLM_SERIES):
            raise RuntimeError(
                f"rollout_recovery needs vLLM {SUPPORTED_VLLM_SERIES}x, found {vllm.__version__}; "
                "install the pinned version (scripts/setup.sh, or the `gpu` extra)"
            )
        from rollout_recovery.generation import pdeath
        from rollout_recovery.tiny_model import resolve_model_path

        pdeath.install()
        model = resolve_model_path(self._cfg.policy.model_path)
        host = self._cfg.vllm_cfg.host
        sock = create_server_socket((host, 0), reuse_port=False)
        port = sock.getsockname()[1]
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(
            serve_args(self._cfg, model, host, port)
        )
        validate_parsed_serve_args(args)
        engine_args = AsyncEngineArgs.from_cli_args(args)
        usage = UsageContext.OPENAI_API_SERVER
        # Created on the actor's event-loop thread: that thread lives as long as the actor,
        # which the EngineCore's parent-death signal is tied to.
        self._engine = AsyncLLM.from_vllm_config(
            engine_args.create_engine_config(usage),
            usage_context=usage,
            enable_log_requests=False,
            disable_log_stats=True,
        )
        tasks = await self._engine.get_supported_tasks()
        app = build_app(args, tasks, self._engine.model_config)
        if self._cfg.token_capture.enabled:
            app.include_router(self._install_capture())
        await init_app_state(self._engine, app.state, args, tasks)
        from rollout_recovery.generation import prefix_supply
        from rollout_recovery.generation.control import RequestGate

        ends = prefix_supply.turn_end_ids(self._engine.output_processor.tokenizer)
        prefix_supply.install(self._engine, ends)  # outermost: resume sees the spliced prompt
        served = RequestGate(app, ends)
        self._server = NoSignalServer(
            uvicorn.Config(served, log_level="warning", access_log=False, timeout_keep_alive=30)
        )
        app.state.server = self._server
        self._tasks = [
            asyncio.create_task(self._server.serve(sockets=[sock])),
            asyncio.create_task(watchdog_loop(self._server, self._engine)),
        ]
        while not self._server.started:
            if self._tasks[0].done():
                self._tasks[0].result()
                raise RuntimeError("HTTP server exited during startup")
            await asyncio.sleep(0.02)
        await self._warm_up(f"http://{host}:{port}")
        self._info = WorkerInfo(
            worker_index=self._index,
            url=f"http://{host}:{port}",
            host=host,
            port=port,
            served_model_name=self._cfg.policy.served_model_name,
            model=model,
            pid=os.getpid(),
            engine_pids=_child_pids(),
            vllm_version=vllm.__version__,
            startup_s=round(time.monotonic() - t0, 3),
            eos_token_id=self._engine.output_processor.tokenizer.eos_token_id,
        )
        return self._info

    def _install_capture(self):
        """Token capture hooks on the engine, the cut service, and its control routes."""
        from rollout_recovery.generation.capture import TokenCapture
        from rollout_recovery.generation.control import make_control_router
        from rollout_recovery.generation.cut import CutService
        from rollout_recovery.generation.cuttability import uncuttable_reason
        from rollout_recovery.generation.resume import Resumer

        tc = self._cfg.token_capture
        if self._store is None:
            raise RuntimeError("token_capture.enabled needs a StagingStore: pass store=")
        if not tc.control_auth_token:
            raise RuntimeError("token_capture.control_auth_token is unset; use start_workers()")
        capture = TokenCapture(
            on_finished=lambda call: self._service.on_finished(call),
            force_flat_logprobs=self._cfg.vllm_cfg.flat_logprobs,
            max_attempt_records=tc.max_attempt_records,
        )
        sampler_on = self._cfg.vllm_cfg.position_keyed_sampler
        capture.classify = lambda params: uncuttable_reason(params, sampler_on)
        self._service = CutService(
            capture,
            self._store,
            partition=tc.staging_partition,
            terminal_partition=tc.terminal_partition,
            timeout_s=tc.control_timeout_s,
            max_calls=tc.max_inventory_calls,
        )
        capture.install(self._engine)
        resumer = Resumer(
            capture,
            self._store,
            tc.staging_partition,
            capture.classify,
            self._service.retire,
            fetch_timeout_s=tc.control_timeout_s,
        )
        resumer.install(self._engine)
        return make_control_router(self._service, tc.control_auth_token)

    def _require_capture(self):
        if self._service is None:
            raise RuntimeError("token capture is off (token_capture.enabled=false)")
        return self._service

    async def cut(self, inventory: dict[str, Any]) -> dict[str, Any]:
        """Ray twin of POST /control/v1/generation-cut."""
        from rollout_recovery.generation.cut import CutInventory

        receipt = await self._require_capture().cut(CutInventory.model_validate(inventory))
        return receipt.model_dump()

    async def begin_fence(self, epoch: int, lease_s: float) -> dict[str, Any]:
        return vars(self._require_capture().fence.begin(epoch, lease_s))

    async def end_fence(self, epoch: int) -> bool:
        return self._require_capture().fence.end(epoch)

    async def fence_state(self) -> dict[str, Any]:
        """The fence as it is now: held epoch, held, lease left, and the highest epoch seen
        (the next fence must use a newer one)."""
        fence = self._require_capture().fence
        return vars(fence.state()) | {"highest_epoch": fence.highest_epoch}

    async def capture_metrics(self) -> dict[str, float]:
        service = self._require_capture()
        return service.metrics.snapshot() | {"fence_hold_s": service.fence.hold_seconds_total}

    async def lock_hold_samples(self) -> list[float]:
        """Capture-lock hold of each recent cut (us, oldest first): exact percentiles for
        benchmarks, which the Prometheus histogram's buckets cannot give."""
        return self._require_capture().metrics.lock_hold_samples()

    async def call_attempts(self, since: int = 0, limit: int | None = None) -> dict[str, Any]:
        """What the engine did per call attempt (decoded tokens, prefix spliced in, resume
        verdict, finish), changed after cursor `since`: an `AttemptPage` as a dict."""
        return self._require_capture().capture.attempts.read(since, limit).model_dump()

    async def drain(self) -> None:
        """Wait until background terminal-row writes are done."""
        await self._require_capture().drain()

    async def push_weights(self, weights_dir: str, weight_version: int) -> int:
        """Load new policy weights (a directory of safetensors with the served checkpoint's
        tensor names) and tag every token generated from now on with `weight_version`."""
        from rollout_recovery.generation.weights import push_weights

        if self._engine is None or self._info is None:
            raise RuntimeError("worker not started")
        if weight_version <= self._weight_version:
            raise ValueError(
                f"weight_version {weight_version} must be newer than {self._weight_version}"
            )
        await push_weights(self._engine, self._info.model, weights_dir, weight_version)
        self._weight_version = weight_version
        if self._service is not None:
            self._service.capture.weight_version = weight_version
        return weight_version

    async def _warm_up(self, url: str) -> None:
        """Pay the one-time costs (~2-3 s: first engine step, first logprobs, chat template)
        at startup, through the same HTTP path callers use."""
        import httpx

        body = {
            "model": self._cfg.policy.served_model_name,
            "messages": [{"role": "user", "content": "warm up"}],
            "max_tokens": 2,
            "temperature": 0.0,
            "logprobs": True,
            "return_token_ids": True,
        }
        async with httpx.AsyncClient() as client:
            resp = await client.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        if resp.status_code != 200:
            raise RuntimeError(f"warm-up request failed: {resp.status_code} {resp.text[:300]}")

    async def info(self) -> WorkerInfo:
        if self._info is None:
            raise RuntimeError("worker not started")
        return self._info.model_copy(update={"engine_pids": _child_pids()})

    async def health(self) -> WorkerHealth:
        url = self._info.url if self._info else ""
        if self._engine is None or self._info is None:
            return WorkerHealth(healthy=False, reason="not_started", url=url)
        if self._engine.errored:
            return WorkerHealth(healthy=False, reason="engine_dead", url=url)
        if self._tasks[0].done():
            return WorkerHealth(healthy=False, reason="http_server_stopped", url=url)
        try:
            await asyncio.wait_for(self._engine.check_health(), timeout=10)
        except Exception as err:  # reported, not raised: health is a query
            return WorkerHealth(healthy=False, reason=f"engine_check_failed: {err!r}", url=url)
        return WorkerHealth(healthy=True, url=url)

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop HTTP, then the engine, leaving no child process and no shared-memory segment."""
        if self._service is not None:
            # Terminal rows of finished calls are still owed to the store.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._service.drain(), timeout=timeout_s)
        if self._server is not None:
            self._server.should_exit = True
            try:
                await asyncio.wait_for(asyncio.shield(self._tasks[0]), timeout=timeout_s)
            except (TimeoutError, asyncio.CancelledError):
                self._tasks[0].cancel()
            for task in self._tasks[1:]:
                task.cancel()
            self._server = None
        if self._engine is not None:
            engine, self._engine = self._engine, None
            # vLLM stops the EngineCore before cancelling its output handler, which then logs
            # a spurious EngineDeadError; with HTTP stopped nothing waits on it, so cancel first.
            handler = getattr(engine, "output_handler", None)
            if handler is not None and not handler.done():
                handler.cancel()
                await asyncio.gather(handler, return_exceptions=True)
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, lambda: engine.shutdown(timeout=timeout_s))
        self._info = None


def _child_pids() -> list[int]:
    import psutil

    return sorted(p.pid for p in psutil.Process().children(recursive=True))


@dataclass
class WorkerHandle:
    """A started worker: its actor and what it reported."""

    actor: ray.actor.ActorHandle
    info: WorkerInfo
    control_token: str | None = None


def worker_actor_options(cfg: RolloutRecoveryConfig) -> dict[str, Any]:
    """Ray options for a GenerationWorker: resources, no restarts, and the engine environment."""
    return {
        "num_cpus": cfg.vllm_cfg.worker_num_cpus,
        "num_gpus": 1 if cfg.vllm_cfg.device == "cuda" else 0,
        "max_restarts": 0,
        "resources": dict(cfg.vllm_cfg.worker_resources),
        "runtime_env": {"env_vars": engine_env(cfg) | faults.actor_env_vars()},
    }


def start_workers(
    cfg: RolloutRecoveryConfig, num_workers: int | None = None, store=None
) -> list[WorkerHandle]:
    """Start `num_workers` (default `vllm_cfg.num_workers`) workers concurrently.

    With token capture on, `store` (a StagingStore) receives the chunk and terminal rows, and
    a control token is minted for the run unless the config names one.
    """
    import secrets

    n = cfg.vllm_cfg.num_workers if num_workers is None else num_workers
    if cfg.token_capture.enabled and not cfg.token_capture.control_auth_token:
        cfg = cfg.model_copy(deep=True)
        cfg.token_capture.control_auth_token = secrets.token_urlsafe(24)
    actor_cls = ray.remote(GenerationWorker).options(**worker_actor_options(cfg))
    config = cfg.model_dump(mode="json")
    actors = [actor_cls.remote(config, i, store) for i in range(n)]
    try:
        infos = ray.get([a.start.remote() for a in actors], timeout=cfg.vllm_cfg.startup_timeout_s)
    except BaseException:
        for a in actors:
            ray.kill(a)
        raise
    token = cfg.token_capture.control_auth_token
    return [
        WorkerHandle(actor=a, info=i, control_token=token)
        for a, i in zip(actors, infos, strict=True)
    ]


def stop_workers(handles: list[WorkerHandle], timeout_s: float = 60.0) -> None:
    """Graceful shutdown of every worker, then kill the actors (even if shutdown failed)."""
    refs = [h.actor.shutdown.remote() for h in handles]
    try:
        ray.get(refs, timeout=timeout_s)
    finally:
        for h in handles:
            ray.kill(h.actor)
