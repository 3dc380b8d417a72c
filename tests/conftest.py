"""Shared fixtures: one local Ray and one pair of vLLM workers for the whole session."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO / "configs" / "grpo_tiny_cpu.yaml"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from rollout_recovery.tiny_model import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tiny_cfg(tiny_model_dir):
    from rollout_recovery.config import load_config

    return load_config(TINY_CONFIG, [f"policy.model_path={tiny_model_dir}"])


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from rollout_recovery.runtime import init_ray

    init_ray("local", num_cpus=4)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def two_workers(ray_session, tiny_cfg):
    """Two GenerationWorkers started at once; shared by every engine test."""
    from rollout_recovery.generation import WorkerPool

    pool = WorkerPool.start(tiny_cfg, num_workers=2)
    yield pool
    pool.stop()


@pytest.fixture(scope="session")
def crash_chain(tmp_path_factory):
    """The reduced crash-point campaign (rollout_recovery/testing/campaign/crash_points.py):
    one 3-step run killed three times in a row under power loss and restored to the end, with
    the uninterrupted reference run beside it. Its checks are in
    tests/functional/test_crash_campaign.py; its finished run also serves
    tests/engine/test_train_failures.py. Returns (workdir, result)."""
    from rollout_recovery.testing.campaign import crash_points

    work = tmp_path_factory.mktemp("crash-points")
    result = crash_points.run_crash_campaign(
        work,
        points=[],
        power_loss=True,
        chains=[crash_points.CHAINS[0]],
        reference_alongside=True,
    )
    return work, result
