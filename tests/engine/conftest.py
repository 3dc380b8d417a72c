from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from rollout_recovery.config import RolloutRecoveryConfig
from rollout_recovery.data_plane import StagingStore
from rollout_recovery.generation import WorkerPool
from rollout_recovery.generation.pool import WorkerHandle
from tests.engine.two_models import ModelWorker


def _capture_cfg(cfg: RolloutRecoveryConfig) -> RolloutRecoveryConfig:
    cfg = cfg.model_copy(deep=True)
    cfg.token_capture.enabled = True
    cfg.token_capture.max_inventory_calls = 64
    cfg.vllm_cfg.tool_call_parser = "hermes"  # tools with tool_choice="auto" (the gateway test)
    return cfg


def _serve(cfg: RolloutRecoveryConfig) -> Iterator[tuple[WorkerHandle, StagingStore]]:
    store = StagingStore.create(num_shards=1)
    pool = WorkerPool.start(cfg, num_workers=1, store=store)
    yield pool[0], store
    pool.stop()
    store.shutdown()


@pytest.fixture(scope="session")
def capture_worker(ray_session, tiny_cfg):
    """One worker with token capture and a tool-call parser on, and the StagingStore it stages
    into."""
    yield from _serve(_capture_cfg(tiny_cfg))


@pytest.fixture(scope="package")
def qwen3_capture_worker(ray_session, qwen3_cfg):
    """capture_worker on tiny://qwen3. It reserves no Ray CPU: the session's 4 are taken by
    two_workers, capture_worker and the worker an engine test starts for itself, and this
    worker only computes while a qwen3 test runs. Stopped with the last engine test, not the
    session: its 2.1 GB would otherwise sit beside the functional checks' engines."""
    cfg = _capture_cfg(qwen3_cfg)
    cfg.vllm_cfg.worker_num_cpus = 0
    yield from _serve(cfg)


@pytest.fixture
def worker_of(request, tiny_cfg, tiny_model_dir) -> Callable[[str], ModelWorker]:
    """The capture worker of a model named in two_models.MODELS; the qwen3 one is started by
    the first test that asks for it, so a run without qwen3 tests never pays its start."""

    def get(model: str) -> ModelWorker:
        if model == "tiny":
            worker, store = request.getfixturevalue("capture_worker")
            return ModelWorker(model, worker, store, tiny_cfg, tiny_model_dir)
        if model == "qwen3":
            worker, store = request.getfixturevalue("qwen3_capture_worker")
            cfg, model_dir = (request.getfixturevalue(n) for n in ("qwen3_cfg", "qwen3_model_dir"))
            return ModelWorker(model, worker, store, cfg, model_dir)
        raise ValueError(f"unknown model {model!r}")

    return get
