"""Shared fixtures: one local Ray and one pair of vLLM workers for the whole session, and the
crash-point campaign started with the session to run beside the in-process tests."""

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
def qwen3_model_dir() -> Path:
    """tiny://qwen3 (Qwen's real vocabulary on tiny random weights), built once and cached."""
    from rollout_recovery.tiny_model import ensure_tiny_model, tiny_spec

    return ensure_tiny_model(spec=tiny_spec("qwen3"))


@pytest.fixture(scope="session")
def qwen3_cfg(qwen3_model_dir):
    """The tiny job's config with tiny://qwen3 as the policy."""
    from rollout_recovery.config import load_config

    return load_config(TINY_CONFIG, [f"policy.model_path={qwen3_model_dir}"])


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


@pytest.fixture(scope="session", autouse=True)
def functional_checks(request, tmp_path_factory):
    """The functional checks' jobs (tests/functional/checks.py) a selected test needs, started
    before the first test, one at a time: the reduced crash-point campaign (`crash_chain`)
    beside the cluster tests, then the recovery checks beside the engine tests, which leave
    one of the two cores mostly idle. test_recovery_functional.py widens this to four at once
    when the session reaches it. None when no selected test needs a job; ended with the
    session, also when it ends early."""
    from tests.functional.checks import JOBS, Checks

    names = {n for item in request.session.items for n in getattr(item, "fixturenames", ())}
    functional = any(item.path.name == FUNCTIONAL for item in request.session.items)
    jobs = [j for j in JOBS if (j.name in names if j.name == "crash_chain" else functional)]
    checks = Checks(jobs, tmp_path_factory.mktemp("checks"), limit=1).start() if jobs else None
    yield checks
    if checks is not None:
        checks.stop()


FUNCTIONAL = "test_recovery_functional.py"


@pytest.fixture(scope="session")
def crash_chain(functional_checks):
    """The reduced crash-point campaign (rollout_recovery/testing/campaign/crash_points.py): one
    3-step run killed three times in a row under power loss and restored to the end, with the
    uninterrupted reference run beside it, run as a job of the functional checks. Its checks
    are in tests/functional/test_crash_campaign.py; its finished run also serves
    tests/engine/test_train_failures.py. Returns (workdir, result)."""
    from tests.functional.checks import crash_chain_result

    proc, work = functional_checks.wait("crash_chain")
    if proc.returncode != 0:
        pytest.fail(f"the crash-point campaign failed:\n{proc.stdout[-3000:]}")
    return work, crash_chain_result(work)


TIERS = ("unit", "cluster", "engine", "functional")


def pytest_terminal_summary(terminalreporter) -> None:
    """Per tier (tests/<tier>/), the seconds its tests took, setup and teardown included (the
    functional checks run beside the other tiers, so the tiers overlap in wall time)."""
    spent: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for rep in reports:
            nodeid = getattr(rep, "nodeid", "")
            parts = nodeid.split("/")
            if len(parts) > 2 and parts[0] == "tests" and parts[1] in TIERS:
                spent[parts[1]] = spent.get(parts[1], 0.0) + getattr(rep, "duration", 0.0)
    if spent:
        line = ", ".join(f"{t} {spent[t]:.0f} s" for t in TIERS if t in spent)
        terminalreporter.write_line(f"[test] time in tests per tier: {line}")
