"""Failures on the train path that the user acts on, each in one line (issue 25, items 5 and
6): a worker that dies under a call while failover is off names the worker, the call and the
fix; an error in the user's own code (episode, effect, reward and task functions) names the
function (`module:name`), the episode or step and the fix, and carries the user's own frames
as text, so they survive the environment's loop thread, pickling and Ray's task error. The
command line prints the line, and the user's frames under it, never the project's.

The environment runs in process (a real `EpisodeRunner` on a `LoopThread`, fake workers); the
crossing into the driver is pickling plus Ray's own task-error wrapper. The same failures in
real runs are in tests/engine/test_train_failures.py."""

from __future__ import annotations

import asyncio
import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import ray

from rollout_recovery.cli import main
from rollout_recovery.config import ConfigError, load_config
from rollout_recovery.environment.dispatch import EpisodeFailed
from rollout_recovery.environment.episode import EpisodeState
from rollout_recovery.environment.model_client import ModelCallFailed, PrefixNotSuppliedError
from rollout_recovery.environment.runner import EpisodeRunner
from rollout_recovery.episodes import tally
from rollout_recovery.errors import RecoveryError, UserCodeError, WorkerDied, user_frames
from rollout_recovery.generation.pool import WorkerPool
from rollout_recovery.runtime import LoopThread, expected, remote_result
from rollout_recovery.trainer.tasks import make_tasks
from rollout_recovery.training import driver

HERE = Path(__file__).name
THEN = "then continue the run with `train --restore` (nothing was deleted)"
INTERNALS = ("rollout_recovery/environment", "runtime.py", "concurrent", "asyncio", "ray/")


# ------------------------------------------------------------------ the user's own code


def divide(a, b):
    return a / b


def a_set():
    return {1, 2}


async def effect_divides_by_zero(ctx, task):
    return await ctx.effect("divide", divide, 1, 0)


async def effect_returns_a_set(ctx, task):
    return await ctx.effect("pair", a_set)


async def reads_a_missing_key(ctx, task):
    return task["missing"]


async def one_call(ctx, task):
    await ctx.chat([{"role": "user", "content": "hi"}])
    return 1.0


async def returns_a_dict(ctx, task):
    return {"text": "12"}


def reward_reads_a_missing_key(task, result):
    return result["nope"]


def reward_of_words(task, result):
    return "high"


def tasks_that_raise(n, seed):
    raise ValueError(f"no tasks for seed {seed}")


def one_task_too_few(n, seed):
    return [{"messages": []} for _ in range(n - 1)]


def parses(text):
    return json.loads(text)


# ------------------------------------------------------------------ fakes and helpers


class Handle:
    info = SimpleNamespace(url="http://w", served_model_name="policy", eos_token_id=2)

    async def ahealth(self):
        raise ray.exceptions.RayActorError()


class Client:
    """A worker's model-call client whose calls all fail with `error`."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def call(self, rollout_id, model_call_id, messages, attempt=0, **fields):
        raise self.error

    async def aclose(self) -> None:
        pass


class Store:
    async def alist(self, partition, prefix=None):
        return []

    async def aput(self, partition, table):
        pass


def _runner(*overrides: str, error: Exception | None = None) -> EpisodeRunner:
    cfg = load_config(None, ["token_capture.enabled=true", *overrides]).environment_config()
    runner = EpisodeRunner(cfg, WorkerPool([Handle()]), Store())
    if error is not None:
        runner.dispatch.clients = [Client(error)]
    return runner


def _raised(runner: EpisodeRunner) -> Exception:
    """What running one episode raises on the environment's loop thread."""
    loop = LoopThread("test-environment")
    st = EpisodeState("s0000-p000-g1", "s0000-p000", 1, 7, {"messages": []})
    try:
        loop.run(runner.run_episode(st, 0, False))
    except Exception as err:
        return err
    finally:
        loop.stop()
    raise AssertionError("the episode did not fail")


def _across_ray(err: Exception) -> Exception:
    """`err` as the driver receives it from the environment actor: pickled, then wrapped in
    Ray's task error (whose `str` is the whole remote traceback)."""
    cause = pickle.loads(pickle.dumps(err))
    return ray.exceptions.RayTaskError(
        "RolloutEnvironment.run_groups", "Traceback (most recent call last): ...", cause,
        proctitle="ray::RolloutEnvironment.run_groups", pid=1, ip="127.0.0.1",
    ).as_instanceof_cause()  # fmt: skip


def _user_frames_only(frames: str, functions: list[str], last: str) -> None:
    lines = frames.splitlines()
    assert lines[0] == "your code (most recent call last):", frames
    files = [ln for ln in lines if ln.startswith('  File "')]
    assert [ln.rsplit(" in ", 1)[1] for ln in files] == functions, frames
    assert all(HERE in ln for ln in files), frames
    assert lines[-1] == last, frames
    assert not any(part in frames for part in INTERNALS), frames


def _train_raises(monkeypatch, err: Exception) -> None:
    def train(cfg, ray_address="local", restore=False):
        raise err

    monkeypatch.setattr(driver, "train", train)


# ------------------------------------------------------------------ a dead worker, failover off


@pytest.mark.parametrize(
    "error",
    [
        httpx.RemoteProtocolError("Server disconnected without sending a response."),
        httpx.ConnectError("connection refused"),
        ModelCallFailed(503, "engine dead"),
    ],
)
def test_a_dead_worker_with_failover_off_is_one_line_naming_worker_call_and_fix(error):
    runner = _runner("failover.enabled=false", f"environment.episode={__name__}:one_call",
                     error=error)  # fmt: skip
    err = _raised(runner)
    assert type(err) is WorkerDied
    assert str(err).startswith(
        f"worker 0 dropped model call s0000-p000-g1/c0/a0 ({type(error).__name__}: "
    )
    assert "with failover.enabled=false the call cannot move to another worker" in str(err)
    assert "Set failover.enabled=true" in str(err) and "`train --restore`" in str(err)
    assert type(expected(_across_ray(err))) is WorkerDied  # raised as itself in the driver


def test_train_prints_a_dead_worker_in_one_line_and_exits_1(monkeypatch, capsys, tmp_path):
    runner = _runner("failover.enabled=false", f"environment.episode={__name__}:one_call",
                     error=httpx.RemoteProtocolError("Server disconnected"))  # fmt: skip
    _train_raises(monkeypatch, _across_ray(_raised(runner)))
    assert main(["train", f"checkpointing.checkpoint_dir={tmp_path}"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("rollout-recovery: worker 0 dropped model call s0000-p000-g1/c0/a0")
    assert "RayTaskError" not in err and "Traceback" not in err


def test_a_call_that_cannot_move_is_one_line_not_the_users_error():
    """With failover on, a call whose worker died more often than failover.max_migrations
    fails the step naming the reason and the fix, not as an error in the episode function."""
    runner = _runner("failover.max_migrations=0", f"environment.episode={__name__}:one_call",
                     error=httpx.ConnectError("connection refused"))  # fmt: skip
    err = _raised(runner)
    assert type(err) is EpisodeFailed and isinstance(err, RecoveryError)
    assert "max_migrations" in str(err) and "raise failover.max_migrations" in str(err)


# ------------------------------------------------------------------ errors in the user's code


def test_an_effect_that_raises_names_the_effect_function_episode_and_fix():
    runner = _runner(f"environment.episode={__name__}:effect_divides_by_zero")
    err = expected(_across_ray(_raised(runner)))  # loop thread, pickling, Ray: all crossed
    assert type(err) is UserCodeError
    assert str(err) == (
        f"effect 'divide' ({__name__}:divide) raised ZeroDivisionError: division by zero in "
        f"episode s0000-p000-g1 (attempt 0) of environment.episode={__name__}:"
        f"effect_divides_by_zero; fix the effect function, {THEN}"
    )
    _user_frames_only(err.frames, ["effect_divides_by_zero", "divide"],
                      "ZeroDivisionError: division by zero")  # fmt: skip

    async def run_groups():  # the environment client awaiting the actor's answer
        raise _across_ray(err)

    with pytest.raises(UserCodeError) as info:
        asyncio.run(remote_result(run_groups()))
    assert type(info.value) is UserCodeError and info.value.frames == err.frames


def test_an_effect_returning_what_json_cannot_hold_is_the_users_error():
    runner = _runner(f"environment.episode={__name__}:effect_returns_a_set")
    err = expected(_across_ray(_raised(runner)))
    assert type(err) is UserCodeError
    assert str(err).startswith(
        f"effect 'pair' ({__name__}:a_set) returned a value JSON cannot hold in episode "
        f"s0000-p000-g1 (attempt 0) of environment.episode={__name__}:effect_returns_a_set "
        "(Object of type set is not JSON serializable); make it return JSON values only"
    )
    assert err.frames.splitlines()[1].endswith("in effect_returns_a_set")


def test_an_episode_function_that_raises_names_itself_the_episode_and_the_fix():
    runner = _runner(f"environment.episode={__name__}:reads_a_missing_key")
    err = expected(_across_ray(_raised(runner)))
    assert type(err) is UserCodeError
    assert str(err) == (
        f"environment.episode={__name__}:reads_a_missing_key raised KeyError: 'missing' in "
        f"episode s0000-p000-g1 (attempt 0); fix the episode function, {THEN}"
    )
    _user_frames_only(err.frames, ["reads_a_missing_key"], "KeyError: 'missing'")


def test_a_refused_request_points_at_the_users_call():
    runner = _runner(f"environment.episode={__name__}:one_call",
                     error=ModelCallFailed(400, "max_tokens is too large"))  # fmt: skip
    err = _raised(runner)
    assert type(err) is UserCodeError
    assert str(err).startswith("worker 0 refused model call s0000-p000-g1/c0/a0 in episode ")
    assert "400 max_tokens is too large" in str(err) and "fix the request" in str(err)
    # the fake worker's frame is in this file too: the first frame is the user's call
    assert err.frames.splitlines()[1].endswith("in one_call"), err.frames
    assert not any(part in err.frames for part in INTERNALS), err.frames


def test_a_call_the_model_client_refuses_names_the_call_and_what_it_says():
    """A refusal of the model client (here: the worker ignored the required prefix) is one
    line naming the call and the client's own reason and fix, with the user's frames."""
    refusal = PrefixNotSuppliedError("the worker ignored the prefix; set supply off to go on")
    runner = _runner(f"environment.episode={__name__}:one_call", error=refusal)
    err = expected(_across_ray(_raised(runner)))
    assert type(err) is UserCodeError
    assert str(err) == (
        "model call s0000-p000-g1/c0/a0 in episode s0000-p000-g1 (attempt 0) of "
        f"environment.episode={__name__}:one_call was refused: PrefixNotSuppliedError: the "
        "worker ignored the prefix; set supply off to go on; once that is fixed, continue the "
        "run with `train --restore` (nothing was deleted)"
    )
    assert err.frames.splitlines()[1].endswith("in one_call"), err.frames


def test_a_reward_function_that_raises_or_returns_no_number_names_itself():
    runner = _runner(f"environment.episode={__name__}:returns_a_dict",
                     f"environment.reward={__name__}:reward_reads_a_missing_key")  # fmt: skip
    err = expected(_across_ray(_raised(runner)))
    assert str(err) == (
        f"environment.reward={__name__}:reward_reads_a_missing_key raised KeyError: 'nope' for "
        "episode s0000-p000-g1 (attempt 0); fix the reward function (it gets the task and what "
        f"the episode function returned), {THEN}"
    )
    _user_frames_only(err.frames, ["reward_reads_a_missing_key"], "KeyError: 'nope'")
    runner = _runner(f"environment.episode={__name__}:returns_a_dict",
                     f"environment.reward={__name__}:reward_of_words")  # fmt: skip
    assert str(_raised(runner)) == (
        f"environment.reward={__name__}:reward_of_words returned 'high' (str) for episode "
        f"s0000-p000-g1 (attempt 0), which is not a number; return a float, {THEN}"
    )
    runner = _runner(f"environment.episode={__name__}:returns_a_dict", "environment.reward=null")
    assert str(_raised(runner)).startswith(
        f"environment.episode={__name__}:returns_a_dict (the reward, as environment.reward is "
        "null) returned {'text': '12'} (dict) for episode s0000-p000-g1 (attempt 0), which is "
        "not a number; return a number from it or set environment.reward"
    )


def test_a_tasks_function_that_raises_or_returns_too_few_names_itself_and_the_step():
    cfg = load_config(None, [f"environment.tasks={__name__}:tasks_that_raise",
                             "grpo.prompts_per_step=2"])  # fmt: skip
    seed = 3  # grpo.seed * 1_000_003 + step
    with pytest.raises(UserCodeError) as info:
        make_tasks(cfg, 3)
    assert str(info.value) == (
        f"environment.tasks={__name__}:tasks_that_raise raised ValueError: no tasks for seed "
        f"{seed} at step 3 (called as tasks(n=2, seed={seed})); fix the tasks function, {THEN}"
    )
    _user_frames_only(info.value.frames, ["tasks_that_raise"],
                      f"ValueError: no tasks for seed {seed}")  # fmt: skip
    cfg = load_config(None, [f"environment.tasks={__name__}:one_task_too_few",
                             "grpo.prompts_per_step=2"])  # fmt: skip
    with pytest.raises(UserCodeError, match=r"returned 1 tasks at step 0 \(called as tasks\("
                       r"n=2, seed=0\)\); it must return a list of n=2 tasks"):  # fmt: skip
        make_tasks(cfg, 0)
    assert make_tasks(load_config(None, ["grpo.prompts_per_step=2"]), 0) == tally.tasks(2, 0)


def test_train_prints_the_line_and_the_users_frames_under_it(monkeypatch, capsys, tmp_path):
    runner = _runner(f"environment.episode={__name__}:effect_divides_by_zero")
    _train_raises(monkeypatch, _across_ray(_raised(runner)))
    assert main(["train", f"checkpointing.checkpoint_dir={tmp_path}"]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(f"rollout-recovery: effect 'divide' ({__name__}:divide) raised ")
    assert lines[1] == "  your code (most recent call last):"
    assert lines[2].startswith('    File "') and lines[2].endswith("in effect_divides_by_zero")
    assert lines[-1] == "  ZeroDivisionError: division by zero"
    text = "\n".join(lines)
    assert "Traceback" not in text and "RayTaskError" not in text
    assert not any(part in text for part in INTERNALS), text


def test_user_frames_keep_the_users_files_and_the_shipped_episodes_only():
    with pytest.raises(ValueError) as info:
        parses("{")
    text = user_frames(info.value)
    assert "in parses" in text and "json" + "/" not in text.replace("json.loads", "")
    with pytest.raises(TypeError) as info:
        tally.reward({}, {"text": 5})  # the shipped episodes are user code like the user's
    assert "rollout_recovery/episodes/tally.py" in user_frames(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(None, ["grpo.steps=0"])
    err = info.value.with_traceback(info.value.__traceback__.tb_next)  # below this test
    assert user_frames(err) == ""  # the project's frames only: nothing of it is the user's


def test_the_frames_of_a_users_package_installed_as_a_library_are_kept(tmp_path, monkeypatch):
    """A user environment installed into site-packages is still the user's code: the package
    of the configured functions counts as the user's wherever it lives."""
    site = tmp_path / "site-packages"
    (site / "my_installed_env").mkdir(parents=True)
    (site / "my_installed_env" / "__init__.py").write_text("")
    (site / "my_installed_env" / "agent.py").write_text(
        "def divide(a, b):\n    return a / b\n\n\n"
        "async def episode(ctx, task):\n    return await ctx.effect('divide', divide, 1, 0)\n"
    )
    monkeypatch.syspath_prepend(str(site))
    err = _raised(_runner("environment.episode=my_installed_env.agent:episode"))
    files = [ln for ln in err.frames.splitlines() if ln.startswith('  File "')]
    assert [f.rsplit(" in ", 1)[1] for f in files] == ["episode", "divide"], err.frames
    assert all("site-packages/my_installed_env/agent.py" in f for f in files)
    assert not any(part in err.frames for part in INTERNALS), err.frames
