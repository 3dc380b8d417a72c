"""A step's tasks from `environment.tasks(n, seed)`: one JSON object per group, checked, with
an error in the user's function named as its own (errors.user_code_error)."""

from __future__ import annotations

import json

from rollout_recovery.config import RolloutRecoveryConfig
from rollout_recovery.errors import UserCodeError, short_repr, user_code_error
from rollout_recovery.imports import load_callable


def _tasks_problem(tasks: object, n: int) -> str | None:
    """What is wrong with a task function's result for a step of `n` groups, or None."""
    if not isinstance(tasks, list | tuple):
        return f"{short_repr(tasks)} ({type(tasks).__name__})"
    if len(tasks) != n:
        return f"{len(tasks)} tasks"
    for i, task in enumerate(tasks):
        if not isinstance(task, dict):
            return f"task {i} = {short_repr(task)} ({type(task).__name__})"
        try:
            json.dumps(task)
        except (TypeError, ValueError) as err:
            return f"task {i}, which is not a JSON value ({err})"
    return None


def make_tasks(cfg: RolloutRecoveryConfig, step: int) -> list[dict]:
    """Step `step`'s tasks, `environment.tasks(n, seed)`: one JSON object per group. An error
    in the function, or a result of another shape, fails the step naming the function."""
    n, seed = cfg.grpo.prompts_per_step, cfg.grpo.seed * 1_000_003 + step
    what = f"environment.tasks={cfg.environment.tasks}"
    where = f"at step {step} (called as tasks(n={n}, seed={seed}))"
    then = "then continue the run with `train --restore` (nothing was deleted)"
    make = load_callable(cfg.environment.tasks)
    try:
        tasks = make(n, seed)
    except Exception as err:
        raise user_code_error(what, err, where, f"fix the tasks function, {then}", make) from err
    problem = _tasks_problem(tasks, n)
    if problem is not None:
        raise UserCodeError(
            f"{what} returned {problem} {where}; it must return a list of n={n} tasks "
            f"(grpo.prompts_per_step), each a JSON object, {then}"
        )
    return list(tasks)
