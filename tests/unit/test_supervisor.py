"""The worker supervisor's decisions, driven by fake worker handles (fault injection: a dead
actor, a stopped engine, a health check that keeps failing). The real thing - an engine
SIGKILLed and an actor ray.killed mid-generation - is the failover check's
(functional_tests/worker_failover.py)."""

from __future__ import annotations

import asyncio

import ray

from rollout_recovery.config import FailoverConfig
from rollout_recovery.controller.metrics import RunMetrics
from rollout_recovery.controller.supervisor import WorkerSupervisor
from rollout_recovery.generation.pool import WorkerPool
from rollout_recovery.generation.worker import WorkerHealth


class FakeHandle:
    def __init__(self, name: str, health=None) -> None:
        self.name, self.health = name, health or WorkerHealth(healthy=True, url="u")
        self.actor = object()
        self.weight_version, self.pushed = 0, []

    async def ahealth(self) -> WorkerHealth:
        if isinstance(self.health, BaseException):
            raise self.health
        if self.health == "hang":
            await asyncio.sleep(3600)
        return self.health

    async def apush_weights(self, weights_dir: str, version: int) -> int:
        self.pushed.append(version)
        return version


class FakePool(WorkerPool):
    """The real pool's bookkeeping; replacements are fake handles, started at once."""

    def __init__(self, handles, on_start=None) -> None:
        super().__init__(handles)
        self.on_start = on_start or (lambda: None)

    async def start_replacement(self, index: int):
        handle = FakeHandle(f"new-{index}")
        if self.weights is not None:
            await handle.apush_weights(*self.weights)
            handle.weight_version = self.weights[1]
        self.on_start()  # e.g. newer weights pushed while it started
        return handle


class FakeEnv:
    def __init__(self) -> None:
        self.events = []

    async def worker_lost(self, index: int, cause: str) -> None:
        self.events.append(("lost", index, cause))

    async def worker_replaced(self, index: int, handle) -> None:
        self.events.append(("replaced", index, handle.name))


def _supervisor(pool, **cfg) -> tuple[WorkerSupervisor, FakeEnv, RunMetrics]:
    env, metrics = FakeEnv(), RunMetrics()
    config = FailoverConfig(**({"unhealthy_after_s": 0.2} | cfg))
    return WorkerSupervisor(config, pool, env, metrics, asyncio.Lock()), env, metrics


async def _settle(sup: WorkerSupervisor) -> None:
    await asyncio.gather(*sup._replacing.values())


async def test_a_dead_actor_is_lost_at_once_and_replaced_on_the_current_weights():
    dead = FakeHandle("w1", ray.exceptions.RayActorError())
    pool = FakePool([FakeHandle("w0"), dead])
    pool.weights = ("/weights", 3)
    sup, env, metrics = _supervisor(pool)
    await sup.check_once()
    assert pool.lost == {1: "actor_dead"}
    await _settle(sup)
    assert pool.lost == {} and pool[1].name == "new-1" and pool[1].pushed == [3]
    assert env.events == [("lost", 1, "actor_dead"), ("replaced", 1, "new-1")]
    assert metrics.controller["worker_failures.actor_dead"] == 1
    assert metrics.controller["workers_replaced"] == 1


async def test_a_stopped_engine_is_lost_at_once():
    pool = FakePool([FakeHandle("w0", WorkerHealth(healthy=False, reason="engine_dead", url="u"))])
    sup, env, _ = _supervisor(pool)
    await sup.check_once()
    assert env.events[0] == ("lost", 0, "engine_dead")
    await _settle(sup)


async def test_a_failing_health_check_is_lost_only_after_unhealthy_after_s():
    flaky = FakeHandle("w0", WorkerHealth(healthy=False, reason="engine_check_failed: x", url="u"))
    pool = FakePool([flaky])
    sup, env, _ = _supervisor(pool)
    await sup.check_once()
    assert pool.lost == {} and env.events == []  # failing, not yet for long enough
    flaky.health = WorkerHealth(healthy=True, url="u")
    await sup.check_once()  # recovered: the clock starts over
    flaky.health = "hang"  # no answer at all
    sup.cfg = sup.cfg.model_copy(update={"unhealthy_after_s": 0.05})
    await sup.check_once()
    assert pool.lost == {}
    await asyncio.sleep(0.06)
    await sup.check_once()
    assert pool.lost == {0: "health_timeout"}
    await _settle(sup)


async def test_a_replacement_that_started_on_older_weights_gets_the_newer_ones_first():
    pool = FakePool([FakeHandle("w0", ray.exceptions.RayActorError())])
    pool.weights = ("/weights", 1)
    pool.on_start = lambda: setattr(pool, "weights", ("/weights", 2))
    sup, env, _ = _supervisor(pool)
    await sup.check_once()
    await _settle(sup)
    assert pool[0].pushed == [1, 2] and pool[0].weight_version == 2
    assert env.events[-1] == ("replaced", 0, "new-0")


async def test_a_replacement_joins_only_between_checkpoint_attempts():
    pool = FakePool([FakeHandle("w0", ray.exceptions.RayActorError())])
    sup, env, _ = _supervisor(pool)
    async with sup.between_checkpoints:  # an attempt in progress
        await sup.check_once()
        await asyncio.sleep(0.05)
        assert pool.lost == {0: "actor_dead"} and env.events == [("lost", 0, "actor_dead")]
    await _settle(sup)
    assert pool.lost == {} and env.events[-1] == ("replaced", 0, "new-0")
