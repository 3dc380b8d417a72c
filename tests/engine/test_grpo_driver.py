"""The shipped GRPO driver end to end: rollouts through a worker, training, push, checkpoints."""

from __future__ import annotations

import json

import pytest

from rollout_recovery.data_plane import StagingStore
from rollout_recovery.training.driver import train

pytestmark = pytest.mark.engine


def test_grpo_driver_learns_the_toy_task_and_checkpoints(ray_session, tiny_cfg, tmp_path):
    cfg = tiny_cfg.model_copy(deep=True)
    cfg.token_capture.enabled = True
    cfg.checkpointing.save_data_plane = True
    cfg.checkpointing.checkpoint_dir = str(tmp_path / "run")
    cfg.rollout_checkpointing.keep_latest_k = 2
    cfg.grpo.steps = 6
    history = train(cfg)
    assert [h["step"] for h in history] == list(range(1, 7))
    assert [h["weight_version"] for h in history] == list(range(1, 7))
    assert history[-1]["mean_reward"] > history[0]["mean_reward"] + 0.2
    lines = (tmp_path / "run" / "steps.jsonl").read_text().splitlines()
    steps = [json.loads(x) for x in lines]
    assert [s["step"] for s in steps] == list(range(1, 7))
    # One vocabulary: the environment's capture counts and the workers' tallies reach the log.
    assert all(s["capture.calls.total"] == 16 for s in steps)
    assert all(s["worker_resumes_refused"] == 0 for s in steps)
    assert sum(s.get("worker.terminal_rows", 0) for s in steps) > 0
    workers = json.loads((tmp_path / "run" / "workers.json").read_text())
    assert workers["metrics_url"].startswith("http://127.0.0.1:") and len(workers["workers"]) == 1
    meta = json.loads((tmp_path / "run" / "trainer" / "step-000006" / "meta.json").read_text())
    assert meta["extra"] == {"data_cursor": 6} and meta["format"] == 3
    root = str(tmp_path / "run" / "data_plane")
    latest = StagingStore.latest(root)
    assert latest is not None
    data_plane = tmp_path / "run" / "data_plane"
    # keep_latest_k, and the earlier snapshots whose files those two list (incremental ones).
    names = sorted(p.name for p in data_plane.glob("snapshot-*"))
    kept = names[-2:]
    chains = {c for n in kept for c in StagingStore.manifest(str(data_plane / n)).body.chain()}
    assert set(names) == set(kept) | chains and len(chains) >= 1
    assert (data_plane / "ownership").is_dir()  # the owner claim and the publish entries
    # Every rollout was consumed exactly once: the replay partition is empty in the snapshot.
    store = StagingStore.create(num_shards=1)
    try:
        manifest = store.restore(latest)
        assert manifest.body.meta == {"trainer_step": "6", "reason": "trainer_checkpoint"}
        assert store.list("replay") == []
        assert len(store.list("token_entries")) == 6 * 4 * 4
    finally:
        store.shutdown()


def test_async_grpo_trains_each_prompt_once_on_young_enough_groups(ray_session, tiny_cfg, tmp_path):
    """Asynchronous GRPO (generation goes on while the trainer trains, weights pushed into the
    calls in flight, snapshots on the cadence meanwhile): every step trains on whole groups no
    older than the bound, no prompt twice, every training row carries its tokens' weight
    versions, and the cursor in the last checkpoint accounts for every dispatched prompt."""
    import pyarrow as pa

    from rollout_recovery.data_plane import table_to_replay_rows
    from rollout_recovery.trainer.producer import CURSOR_KEY

    cfg = tiny_cfg.model_copy(deep=True)
    cfg.token_capture.enabled = True
    cfg.checkpointing.save_data_plane = True
    cfg.checkpointing.checkpoint_dir = str(tmp_path / "run")
    cfg.rollout_recovery.target_level = "prefix"
    cfg.rollout_checkpointing.snapshot_attempt_interval_s = 0.5
    cfg.grpo.steps = 4
    cfg.grpo.async_grpo.enabled = True
    history = train(cfg)
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    groups = [g for h in history for g in h["groups"]]
    assert len(groups) == len(set(groups)) == 4 * cfg.grpo.prompts_per_step
    assert all(h["age_max"] <= cfg.grpo.async_grpo.max_trajectory_age_steps for h in history)
    assert all(h["importance_weight_mean"] > 0 for h in history)
    for h in history:
        path = tmp_path / "run" / "batches" / f"step-{h['step']:06d}.arrow"
        rows = table_to_replay_rows(pa.ipc.open_file(pa.BufferReader(path.read_bytes())).read_all())
        assert {r.group_id for r in rows} == set(h["groups"])
        assert all(r.weight_versions for r in rows)  # every token's version, from the workers
        assert all(r.weight_version_max <= h["weight_version"] - 1 for r in rows)
    meta = json.loads((tmp_path / "run" / "trainer" / "step-000004" / "meta.json").read_text())
    cursor = meta["extra"][CURSOR_KEY]
    trained = 4 * cfg.grpo.prompts_per_step
    assert cursor["trained"] == trained and cursor["next"] == trained + len(cursor["open"])
