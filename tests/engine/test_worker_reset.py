"""A worker kept for a restored job (GenerationWorker.reset): its calls are aborted and forgotten,
nothing of the job before reaches the new store, it is back on the model's own weights as
version 0, and its call-attempt records go on."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import ray
import torch

from rollout_recovery.data_plane import StagingStore
from rollout_recovery.data_plane.schemas import table_to_terminal_rows
from tests.engine.test_weight_push import _chat, _variant

pytestmark = pytest.mark.engine


def _attempt(worker, rollout_id: str) -> dict | None:
    page = worker.call_attempts(0)
    found = [a for a in page["attempts"] if a["rollout_id"] == rollout_id]
    return found[-1] if found else None


def _perturb(tensors: dict) -> None:
    w = tensors["model.layers.1.mlp.down_proj.weight"]
    w += 0.05 * torch.randn(w.shape, generator=torch.Generator().manual_seed(7))


def test_a_reset_worker_serves_a_new_store_on_its_own_weights_and_keeps_its_records(
    capture_worker, tiny_model_dir, tmp_path
):
    worker, old_store = capture_worker
    url = worker.info.url
    version = worker.health().weight_version
    worker.push_weights(str(tiny_model_dir), version + 1)  # the model's own weights, known
    own = _chat(url)["choices"][0]["token_ids"]
    perturbed = _variant(tiny_model_dir, tmp_path / "v", _perturb)
    worker.push_weights(perturbed, version + 2)
    assert _chat(url)["choices"][0]["token_ids"] != own

    # A long call in flight when the reset comes.
    answered: list = []
    body = {"model": "policy", "messages": [{"role": "user", "content": "Count."}],
            "max_tokens": 300, "temperature": 0.0, "ignore_eos": True,
            "vllm_xargs": {"rr_rollout_id": "reset", "rr_model_call_id": "c0"}}  # fmt: skip

    def call() -> None:
        try:
            answered.append(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120))
        except httpx.HTTPError as err:
            answered.append(err)

    thread = threading.Thread(target=call)
    thread.start()
    deadline = time.monotonic() + 60
    while (_attempt(worker, "reset") or {}).get("decoded_tokens", 0) < 4:
        assert thread.is_alive() and time.monotonic() < deadline, answered
        time.sleep(0.05)
    new_store = StagingStore.create(num_shards=1)
    try:
        out = worker.actor.reset.remote(new_store, None)
        assert ray.get(out, timeout=120)["requests_aborted"] == 1
        thread.join(60)
        assert not thread.is_alive()
        record = _attempt(worker, "reset")
        assert record["finish_reason"] == "abort" and 4 <= record["decoded_tokens"] < 300
        worker.drain()
        for store in (old_store, new_store):  # the aborted call staged nothing anywhere
            _, missing = store.get("rollout_terminal", ["reset/c0/a0/terminal"])
            assert missing == ["reset/c0/a0/terminal"]

        # The model's own weights as version 0; the next push may be any newer version.
        assert worker.health().weight_version == 0
        again = _chat(url, rr_rollout_id="after", rr_model_call_id="c0")
        assert again["choices"][0]["token_ids"] == own
        worker.drain()
        table, missing = new_store.get("rollout_terminal", ["after/c0/a0/terminal"])
        assert not missing
        assert table_to_terminal_rows(table)[0].weight_versions == [(0, 0, 16)]
        _, missing = old_store.get("rollout_terminal", ["after/c0/a0/terminal"])
        assert missing == ["after/c0/a0/terminal"]
        assert worker.push_weights(perturbed, 1) == 1
        assert worker.fence_state()["highest_epoch"] == 0  # the new controller's epochs start at 1
    finally:
        ray.get(worker.actor.reset.remote(old_store, None), timeout=120)
        new_store.shutdown()
