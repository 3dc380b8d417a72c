"""The one loop-on-a-thread helper and the one way a class becomes an actor."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rollout_recovery import faults, runtime


def test_a_loop_thread_runs_coroutines_and_steps_on_its_own_thread():
    loop = runtime.LoopThread("test-loop")
    try:

        async def where() -> str:
            await asyncio.sleep(0)
            return threading.current_thread().name

        assert loop.run(where()) == "test-loop"
        assert loop.call(lambda a, b: (threading.current_thread().name, a + b), 1, 2) == (
            "test-loop",
            3,
        )
        with pytest.raises(ZeroDivisionError):
            loop.call(lambda: 1 / 0)  # the step's error reaches the caller
    finally:
        loop.stop()
    assert not loop._thread.is_alive()


def test_actor_classes_carry_an_armed_fault_and_keep_their_options(monkeypatch):
    captured = {}

    class Remote:
        def options(self, **options):
            captured.update(options)
            return self

    monkeypatch.setattr(runtime.ray, "remote", lambda cls: Remote())
    env = {"env_vars": {"A": "1"}}
    runtime.actor_class(object, num_cpus=0, runtime_env=env)
    assert captured == {"num_cpus": 0, "runtime_env": env}
    monkeypatch.setenv(faults.ENV, "resume_disabled")
    runtime.actor_class(object, num_cpus=0, runtime_env=env)
    assert captured["runtime_env"]["env_vars"] == {"A": "1", faults.ENV: "resume_disabled"}
    assert env == {"env_vars": {"A": "1"}}  # the caller's options are not changed
