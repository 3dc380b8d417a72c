"""GenerationWorker: a Ray actor that owns one vLLM engine and serves vLLM's OpenAI API.

The engine and its HTTP server are hosted by `EngineHost`; this module wires the project's
parts onto them (token capture, cut service, resumer, control routes, prefix supply) and is
the Ray surface the pool calls. The driver imports it without vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel

from rollout_recovery.config import WorkerConfig
from rollout_recovery.data_plane.ownership import Fence
from rollout_recovery.data_plane.token_log_segments import TokenLogSegments
from rollout_recovery.generation import prefix_supply, vllm_compat
from rollout_recovery.generation.capture import TokenCapture
from rollout_recovery.generation.control import RequestGate, make_control_router
from rollout_recovery.generation.cut import CutService
from rollout_recovery.generation.cuttability import uncuttable_reason
from rollout_recovery.generation.engine_host import EngineHost, child_pids
from rollout_recovery.generation.resume import Resumer
from rollout_recovery.generation.token_log import TokenLog
from rollout_recovery.generation.weights import push_weights
from rollout_recovery.protocol import CutInventory


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
    actor_name: str | None = None  # the Ray actor's name (namespace rollout_recovery)


class WorkerHealth(BaseModel):
    healthy: bool
    reason: str | None = None
    url: str
    weight_version: int = 0


@dataclass
class CaptureWiring:
    """Token capture and what hangs off it: the cut service, the resumer, the control routes."""

    capture: TokenCapture
    service: CutService
    resumer: Resumer
    router: APIRouter
    token_log: TokenLog


def generation_eos_ids(engine: Any) -> frozenset[int]:
    """The end-of-sequence ids the model's generation_config.json lists (Qwen3: `<|im_end|>`
    and `<|endoftext|>`); vLLM stops a request on each of them unless it ignores EOS."""
    listed = engine.model_config.try_get_generation_config().get("eos_token_id")
    return frozenset([listed] if isinstance(listed, int) else listed or ())


def wire_capture(
    cfg: WorkerConfig,
    store,
    tokenizer: Any,
    writer: str = "worker",
    eos_ids: Collection[int] = (),
) -> CaptureWiring:
    """Build the capture parts of a worker; `tokenizer` is the one its detokenizers use,
    `writer` names its token log segments (docs/failover.md), `eos_ids` are the model's
    generation-config end-of-sequence ids (`generation_eos_ids`)."""
    tc = cfg.token_capture
    if store is None:
        raise RuntimeError("token_capture.enabled needs a StagingStore: pass store=")
    if not tc.control_auth_token:
        raise RuntimeError("token_capture.control_auth_token is unset; use WorkerPool.start()")
    sampler_on = cfg.vllm_cfg.position_keyed_sampler

    def classify(params) -> str | None:
        return uncuttable_reason(params, sampler_on)

    capture = TokenCapture(
        on_finished=lambda call: service.on_finished(call),
        force_flat_logprobs=cfg.vllm_cfg.flat_logprobs,
        max_attempt_records=tc.max_attempt_records,
        classify=classify,
    )
    service = CutService(
        capture,
        store,
        partition=tc.staging_partition,
        terminal_partition=tc.terminal_partition,
        timeout_s=tc.control_timeout_s,
        max_calls=tc.max_inventory_calls,
        segments=TokenLogSegments(tc.log_uri, writer, tc.log_fence) if tc.log_uri else None,
    )
    resumer = Resumer(
        capture,
        store,
        tc.staging_partition,
        classify,
        service.retire,
        fetch_timeout_s=tc.control_timeout_s,
        tokenizer=tokenizer,
        generation_eos_ids=eos_ids,
    )
    token_log = TokenLog(service, tc.log_interval_tokens, tc.log_interval_s)
    router = make_control_router(service, tc.control_auth_token)
    return CaptureWiring(capture, service, resumer, router, token_log)


class GenerationWorker:
    """One vLLM engine plus its OpenAI-compatible HTTP server (an async Ray actor)."""

    def __init__(
        self,
        config: dict[str, Any],
        worker_index: int = 0,
        store=None,
        actor_name: str | None = None,
    ) -> None:
        self._cfg = WorkerConfig.from_dict(config)
        self._index, self._actor_name = worker_index, actor_name
        self._store = store
        self._host: EngineHost | None = None
        self._engine: Any = None
        self._service: CutService | None = None
        self._wiring: CaptureWiring | None = None
        self._token_log: TokenLog | None = None
        self._weight_version = 0
        self._info: WorkerInfo | None = None

    async def start(self) -> WorkerInfo:
        """Build the engine and start serving; returns once a warm-up generation has run."""
        if self._info is not None:
            return self._info
        t0 = time.monotonic()
        self._host = host = EngineHost(self._cfg)
        self._engine = engine = await host.create_engine()
        wiring = None
        if self._cfg.token_capture.enabled:
            tokenizer = vllm_compat.output_tokenizer(engine)
            eos_ids = generation_eos_ids(engine)
            wiring = wire_capture(self._cfg, self._store, tokenizer, self._writer(), eos_ids)
            self._service, self._token_log = wiring.service, wiring.token_log
            self._wiring = wiring
            wiring.token_log.start()
        app = await host.create_app([wiring.router] if wiring else [])
        ends = prefix_supply.turn_end_ids(host.tokenizer)
        vllm_compat.install_engine_hooks(
            engine,
            prefix_supply=prefix_supply.layer(ends),
            capture=wiring.capture if wiring else None,
            resume=wiring.resumer.wrap if wiring else None,
        )
        spans_of = wiring.capture.take_spans if wiring else None
        await host.serve(RequestGate(app, ends, spans_of=spans_of))
        await host.warm_up()
        self._info = WorkerInfo(
            worker_index=self._index,
            url=host.url,
            host=host.host,
            port=host.port,
            served_model_name=self._cfg.policy.served_model_name,
            model=host.model,
            pid=os.getpid(),
            engine_pids=child_pids(),
            vllm_version=host.vllm_version,
            startup_s=round(time.monotonic() - t0, 3),
            eos_token_id=host.tokenizer.eos_token_id,
            actor_name=self._actor_name,
        )
        return self._info

    def _require_capture(self) -> CutService:
        if self._service is None:
            raise RuntimeError("token capture is off (token_capture.enabled=false)")
        return self._service

    async def cut(self, inventory: dict[str, Any]) -> dict[str, Any]:
        """Ray twin of POST /control/v1/generation-cut."""
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

    async def push_weights(
        self, weights_dir: str, weight_version: int, in_flight: bool = True
    ) -> int:
        """Load new policy weights (a directory of safetensors with the served checkpoint's
        tensor names) and tag every token generated from now on with `weight_version`; into the
        calls in flight, or (`in_flight=False`) once they ended (generation/weights.py)."""
        if self._engine is None or self._info is None:
            raise RuntimeError("worker not started")
        if weight_version <= self._weight_version:
            raise ValueError(
                f"weight_version {weight_version} must be newer than {self._weight_version}"
            )
        await push_weights(self._engine, self._info.model, weights_dir, weight_version, in_flight)
        self._weight_version = weight_version
        if self._service is not None:
            self._service.capture.weight_version = weight_version
        return weight_version

    async def hold_generation(self) -> int:
        """Stop decoding, keeping every call in flight where it is (a preemption: the calls
        are cut next, and the process ends before they go on). Returns the calls held."""
        if self._engine is None:
            raise RuntimeError("worker not started")
        await self._engine.pause_generation(mode="keep", clear_cache=False)
        if self._service is None:
            return 0
        capture = self._service.capture
        # The engine's last outputs may still be on their way to the capture: wait until the
        # captured token counts stop moving, so a cut now holds every token decoded.
        seen, deadline = None, time.monotonic() + 2.0
        while time.monotonic() < deadline:
            with capture.lock:
                now = sum(call.progress()[0] for call in capture.calls.values())
            if now == seen:
                break
            seen = now
            await asyncio.sleep(0.05)
        return len(capture.calls)

    async def reset(self, store, log_fence: dict[str, Any] | None) -> dict[str, int]:
        """Return this engine to the state of a fresh start, for a restore of the job that
        keeps it (api.py `restart`): every request is aborted, the capture forgets its calls
        and serves the restored job's `store` and token log (fenced by `log_fence`, the new
        controller's claim), the fence starts over, and the model's own weights are loaded
        again as version 0 (the restore pushes its checkpoint's next). The call-attempt
        records are kept: what this engine decoded stays on record across the restore."""
        if self._engine is None or self._info is None:
            raise RuntimeError("worker not started")
        wiring = self._wiring
        if wiring is not None:
            with wiring.capture.lock:
                requests = list(wiring.capture.by_request)
            if requests:
                await self._engine.abort(requests)
        await self._engine.pause_generation(mode="abort", clear_cache=True)
        await self._engine.resume_generation()
        forgotten = 0
        if wiring is not None:
            forgotten = wiring.capture.clear()
            wiring.resumer.pending.clear()
            wiring.resumer.states.clear()
            wiring.resumer.store = store
            tc = self._cfg.token_capture
            fence = Fence.model_validate(log_fence) if log_fence else None
            segments = TokenLogSegments(tc.log_uri, self._writer(), fence) if tc.log_uri else None
            await wiring.service.rebind(store, segments)
        self._store = store
        model = self._info.model
        await push_weights(self._engine, model, model, 0, in_flight=False)
        self._weight_version = 0
        if wiring is not None:
            wiring.capture.weight_version = 0
        return {"calls_forgotten": forgotten, "requests_aborted": len(requests) if wiring else 0}

    def _writer(self) -> str:
        """The name of this worker's token log segments (docs/failover.md)."""
        return self._actor_name or f"worker-{self._index}-{os.getpid()}"

    async def info(self) -> WorkerInfo:
        if self._info is None:
            raise RuntimeError("worker not started")
        return self._info.model_copy(update={"engine_pids": child_pids()})

    async def health(self) -> WorkerHealth:
        url = self._info.url if self._info else ""
        if self._host is None or self._engine is None or self._info is None:
            return WorkerHealth(healthy=False, reason="not_started", url=url)
        if self._engine.errored:
            return WorkerHealth(healthy=False, reason="engine_dead", url=url)
        if self._host.http_stopped():
            return WorkerHealth(healthy=False, reason="http_server_stopped", url=url)
        try:
            async with asyncio.timeout(10):
                await self._engine.check_health()
        except Exception as err:  # reported, not raised: health is a query
            return WorkerHealth(healthy=False, reason=f"engine_check_failed: {err!r}", url=url)
        return WorkerHealth(healthy=True, url=url, weight_version=self._weight_version)

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Write what is owed to the store, then stop HTTP and the engine."""
        if self._token_log is not None:
            await self._token_log.stop()
        if self._service is not None:
            # Terminal rows of finished calls are still owed to the store.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._service.drain()
        if self._host is not None:
            host, self._host, self._engine = self._host, None, None
            await host.stop(timeout_s)
        self._info = None
