"""What an episode's failure is, in the words its fix needs (docs/errors.md).

An episode function that raised fails its step. The error is classified here: an expected
failure passes as itself; a model call its worker dropped while failover is off is
`WorkerDied`; a call the worker or the model client refused, an effect, the episode function,
the reward and its value are the user's code, a `UserCodeError` naming the function, the
episode and the fix, with the user's own frames only; anything else is the project's own
failure, raised with its traceback.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx

from rollout_recovery.config import EnvironmentActorConfig
from rollout_recovery.environment.context import EpisodeContext, NotJsonError
from rollout_recovery.environment.episode import EpisodeState
from rollout_recovery.environment.model_client import ModelCallFailed
from rollout_recovery.errors import (
    RecoveryError,
    UserCodeError,
    WorkerDied,
    callable_name,
    exception_text,
    in_chain,
    short_repr,
    user_code_error,
    user_frames,
)
from rollout_recovery.protocol import CallIdentity


def episode_failure(
    cfg: EnvironmentActorConfig,
    st: EpisodeState,
    ctx: EpisodeContext,
    fn: Callable,
    configured: bool,
    err: Exception,
) -> Exception:
    """What the step fails with when episode `st`'s function raised `err`: an expected
    failure under it as itself; a model call its worker dropped while failover is off as
    `WorkerDied`, one the worker refused as the request's error; another failure of a
    model call as an unexpected error (not the user's code); else the user's code (the
    effect function when an effect raised, else the episode function) as a
    `UserCodeError` with the user's own frames."""
    if isinstance(err, RecoveryError):
        return err
    episode = f"environment.episode={cfg.environment.episode}"
    if not configured:
        episode = f"episode function {callable_name(fn)}"
    where = f"in episode {st.rollout_id} (attempt {st.attempt})"
    resume = "continue the run with `train --restore` (nothing was deleted)"
    then = f"then {resume}"
    kind, name, effect_fn, raised = ctx.raised or ("", "", None, None)
    if kind == "chat" and in_chain(err, raised):
        call = CallIdentity(st.rollout_id, name, st.attempt).key_prefix()
        dropped = isinstance(raised, httpx.TransportError) or (
            isinstance(raised, ModelCallFailed) and raised.status >= 500
        )
        if dropped and not cfg.failover.enabled:
            return WorkerDied(
                f"worker {st.worker} dropped model call {call} ({exception_text(raised)}): "
                "it died or its connection broke, and with failover.enabled=false the call "
                "cannot move to another worker, so the step stopped. Set "
                "failover.enabled=true to move calls off a dead worker, or continue the "
                "run from its last snapshot with `train --restore` (nothing was deleted)"
            )
        if isinstance(raised, ModelCallFailed) and raised.status < 500:
            return UserCodeError(
                f"worker {st.worker} refused model call {call} {where} of {episode} "
                f"({exception_text(raised)}); fix the request the episode function sends "
                f"(messages, max_tokens, fields), {then}",
                user_frames(err, fn),
            )
        if not dropped and type(raised).__module__ == ModelCallFailed.__module__:
            # The model client refused the call (e.g. it does not continue the episode's
            # conversation, or the worker ignored the prefix); its message names the fix.
            return UserCodeError(
                f"model call {call} {where} of {episode} was refused: "
                f"{exception_text(raised, 600)}; once that is fixed, {resume}",
                user_frames(err, fn),
            )
        return RuntimeError(  # not the user's code: raised with its traceback
            f"model call {call} {where} of {episode} failed: {exception_text(raised)}"
        )
    if kind == "effect" and raised is err:
        what = f"effect {name!r} ({callable_name(effect_fn)})"
        if isinstance(err, NotJsonError):  # its result: the journal cannot hold it
            why = exception_text(err.__context__ or err).partition(": ")[2]
            return UserCodeError(
                f"{what} returned a value JSON cannot hold {where} of {episode} ({why}); "
                f"make it return JSON values only (dict, list, str, number, bool, None), "
                f"{then}",
                user_frames(err, fn, effect_fn),
            )
        fix = f"fix the effect function, {then}"
        return user_code_error(what, err, f"{where} of {episode}", fix, fn, effect_fn)
    return user_code_error(episode, err, where, f"fix the episode function, {then}", fn)


def reward_of(
    cfg: EnvironmentActorConfig, reward_fn: Callable | None, st: EpisodeState, result: Any
) -> float:
    """Finished episode `st`'s reward: `environment.reward(task, result)`, or the result
    itself without one; an error in it, or a reward that is not a number, names it."""
    env = cfg.environment
    where = f"for episode {st.rollout_id} (attempt {st.attempt})"
    then = "then continue the run with `train --restore` (nothing was deleted)"
    fix = f"return a float, {then}"
    if reward_fn is None:
        what = f"environment.episode={env.episode} (the reward, as environment.reward is null)"
        fix = f"return a number from it or set environment.reward to score its result, {then}"
    else:
        what = f"environment.reward={env.reward}"
        try:
            result = reward_fn(st.task, result)
        except Exception as err:
            why = ("fix the reward function (it gets the task and what the episode "
                   "function returned)")  # fmt: skip
            raise user_code_error(what, err, where, f"{why}, {then}", reward_fn) from err
    try:
        return float(result)
    except (TypeError, ValueError, OverflowError):
        raise UserCodeError(
            f"{what} returned {short_repr(result)} ({type(result).__name__}) {where}, which "
            f"is not a number; {fix}"
        ) from None


def result_json(
    cfg: EnvironmentActorConfig, st: EpisodeState, fn: Callable, configured: bool, result: Any
) -> str:
    """What episode `st`'s function returned, as the JSON its training row keeps (a restored
    run reports it like an uninterrupted one); a value JSON cannot hold names the function."""
    what = f"environment.episode={cfg.environment.episode}"
    if not configured:
        what = f"episode function {callable_name(fn)}"
    try:
        return json.dumps(result, sort_keys=True)
    except (TypeError, ValueError) as err:
        raise UserCodeError(
            f"{what} returned {short_repr(result)} ({type(result).__name__}) for episode "
            f"{st.rollout_id} (attempt {st.attempt}), which JSON cannot hold ({err}): its "
            "result is kept with the episode's training row, so return JSON values (dict, "
            "list, str, number, bool, None), then continue the run with `train --restore` "
            "(nothing was deleted)"
        ) from None
