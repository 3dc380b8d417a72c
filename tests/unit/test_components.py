"""Naming a dead actor of the job from Ray's error (components.py): the class Ray names becomes
the component, its reason one short line, also behind the task errors that waited on it."""

from __future__ import annotations

import ray

from rollout_recovery.components import lost
from rollout_recovery.errors import ComponentLost

KILLED = (
    "The actor died unexpectedly before finishing this task.\n"
    "\tclass_name: {cls}\n\tactor_id: 44624885465c8d45346a429d01000000\n\tpid: 3125\n"
    "\tip: 192.0.2.2\n"
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR "
    "Worker exit detail: Worker unexpectedly exits with a connection error code 2."
)


def _died(cls: str) -> ray.exceptions.RayActorError:
    return ray.exceptions.RayActorError(error_msg=KILLED.format(cls=cls))


def test_each_actor_class_is_named_as_its_component_with_a_short_reason():
    classes = ("RolloutRecovery", "StoreShard", "RolloutEnvironment", "GenerationWorker")
    names = [lost(_died(cls)).component for cls in classes]
    assert names == ["controller", "store shard", "environment actor", "worker"]
    err = lost(_died("StoreShard"))
    assert err.reason == "its worker process has died"
    assert str(err) == "the store shard died (its worker process has died)"
    killed = ray.exceptions.RayActorError(error_msg=KILLED.split("The actor is dead")[0]
                                          + "The actor is dead because it was killed by "
                                          "`ray.kill`.")  # fmt: skip
    assert lost(killed).reason == "it was killed by `ray.kill`"


def test_a_death_behind_the_errors_that_waited_on_it_is_found_and_others_are_not():
    class TaskError(Exception):
        def __init__(self, cause: BaseException) -> None:
            super().__init__("a task failed")
            self.cause = cause

    assert lost(TaskError(TaskError(_died("RolloutEnvironment")))).component == (
        "environment actor")  # fmt: skip
    already = ComponentLost("controller", "oom")
    assert lost(TaskError(already)) is already
    assert lost(TaskError(ValueError("a bug"))) is None and lost(ValueError("x")) is None
