"""Import paths in configs: `package.module:function` names a user's episode, reward or task
function. Each process that runs one (the driver, the environment actor) imports it by name,
so the module must be importable there (installed, or on PYTHONPATH).

`signature_mismatch` checks, when the config loads, that the function can be called the way the
project calls it (`EPISODE`, `REWARD`, `TASKS`): an episode function that takes only the task,
or a task function configured as the episode, fails at load instead of inside the run.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple


class ImportPathError(ValueError):
    """An import path that does not name a callable; the message says why in one line."""


class Signature(NamedTuple):
    """How the project calls a configured function."""

    is_async: bool  # awaited (an `async def`), or called and its result used as it is
    arity: int  # positional arguments passed
    text: str  # as the docs write it
    called: str  # what it is called with, and when


EPISODE = Signature(
    is_async=True,
    arity=2,
    text="async def episode(ctx, task)",
    called="the environment awaits it with the episode's context and its task",
)
REWARD = Signature(
    is_async=False,
    arity=2,
    text="def reward(task, result) -> float",
    called="a plain function, called with the task and what the episode function returned",
)
TASKS = Signature(
    is_async=False,
    arity=2,
    text="def tasks(n, seed) -> list",
    called="a plain function, called with the number of tasks a step needs and the step's seed",
)


def load_callable(path: str) -> Callable[..., Any]:
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ImportPathError(f"{path!r} is not of the form package.module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # the user's module may fail in any way while importing
        raise ImportPathError(
            f"cannot import {module_name!r}: {type(err).__name__}: {err}"
        ) from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ImportPathError(f"module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ImportPathError(f"{path!r} is a {type(target).__name__}, not a function")
    return target


def is_async(fn: Callable[..., Any]) -> bool:
    """Whether calling `fn` gives an awaitable: an `async def` (also behind a partial, a
    decorator that sets `__wrapped__`, or an object's `async def __call__`)."""
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(inspect.unwrap(fn)):
        return True
    if inspect.isclass(fn):  # calling a class makes an instance
        return False
    return inspect.iscoroutinefunction(inspect.getattr_static(type(fn), "__call__", None))


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without one: it cannot be checked
        return None


def describe(fn: Callable[..., Any]) -> str:
    """How `fn` is declared, without annotations: `async def episode(ctx, task)`."""
    kind = "async def" if is_async(fn) else "def"
    name = getattr(fn, "__name__", None) or type(fn).__name__
    sig = _signature(fn)
    if sig is None:
        return f"{kind} {name}(...)"
    bare = sig.replace(
        parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
        return_annotation=sig.empty,
    )
    return f"{kind} {name}{bare}"


def signature_mismatch(fn: Callable[..., Any], want: Signature) -> str | None:
    """Why `fn` cannot be called as `want` (one clause), or None when it can."""
    if is_async(fn) != want.is_async:
        return "it is not async" if want.is_async else "it is async"
    sig = _signature(fn)
    if sig is None:
        return None
    try:
        sig.bind(*range(want.arity))
    except TypeError:
        return f"it cannot take {want.arity} positional arguments"
    return None
