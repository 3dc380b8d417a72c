from __future__ import annotations

import pytest

from rollout_recovery.data_plane import StagingStore
from rollout_recovery.generation import WorkerPool


@pytest.fixture(scope="session")
def capture_worker(ray_session, tiny_cfg):
    """One worker with token capture and a tool-call parser on, and the StagingStore it stages
    into."""
    store = StagingStore.create(num_shards=1)
    cfg = tiny_cfg.model_copy(deep=True)
    cfg.token_capture.enabled = True
    cfg.token_capture.max_inventory_calls = 64
    cfg.vllm_cfg.tool_call_parser = "hermes"  # tools with tool_choice="auto" (the gateway test)
    pool = WorkerPool.start(cfg, num_workers=1, store=store)
    yield pool[0], store
    pool.stop()
    store.shutdown()
