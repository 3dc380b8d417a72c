"""A dead actor of the job, as the trainer meets it on a real local Ray (components.py,
runtime.ActorProxy): a call on a dead actor, or on a live one whose work waited on a dead one,
raises `ComponentLost` naming it; the controller's probe finds a dead store shard while a
long call waits, and the watched call ends with that death, not by waiting."""

from __future__ import annotations

import time

import pytest
import ray

from rollout_recovery.components import dead
from rollout_recovery.errors import ComponentLost
from rollout_recovery.runtime import ActorProxy


class StoreShard:  # named as the job's store shard actor class: components.py goes by class
    def ping(self) -> str:
        return "pong"


class RolloutRecovery:  # stands in for the controller: its work waits on a shard
    def __init__(self, shard) -> None:
        self.shard = shard

    def through_shard(self) -> str:
        return ray.get(self.shard.ping.remote())

    def wait_long(self, seconds: float) -> str:
        time.sleep(seconds)
        return "finished"

    def lost_components(self) -> list[ComponentLost]:
        return dead([("store shard", self.shard)], 1.0)


@pytest.fixture
def job(ray_session):
    shard = ray.remote(StoreShard).remote()
    controller = ActorProxy(RolloutRecovery, (shard,), max_concurrency=2)
    yield shard, controller
    ray.kill(controller.actor)


def test_a_dead_shard_is_named_by_the_probe_and_by_a_call_that_waited_on_it(job):
    shard, controller = job
    assert controller.through_shard() == "pong" and controller.lost_components() == []
    ray.kill(shard)
    time.sleep(0.5)
    [found] = controller.lost_components()
    assert found.component == "store shard" and "ray.kill" in found.reason
    with pytest.raises(ComponentLost) as info:
        controller.through_shard()
    assert info.value.component == "store shard"


def test_a_watched_call_ends_when_the_probe_finds_a_death_and_a_dead_controller_at_once(job):
    shard, controller = job
    probes = []

    def probe() -> None:
        probes.append(time.monotonic())
        lost = controller.lost_components()
        if lost:
            raise lost[0]

    assert controller.watched("wait_long", (0.3,), probe, 0.1) == "finished" and probes
    ray.kill(shard)
    t0 = time.monotonic()
    with pytest.raises(ComponentLost, match="store shard"):
        controller.watched("wait_long", (60.0,), probe, 0.2)
    assert time.monotonic() - t0 < 10
    ray.kill(controller.actor)
    time.sleep(0.5)
    with pytest.raises(ComponentLost) as info:
        controller.through_shard()
    assert info.value.component == "controller"
