"""Import paths in configs: `package.module:function` names a user's episode, reward or task
function. Each process that runs one (the driver, the environment actor) imports it by name,
so the module must be importable there (installed, or on PYTHONPATH)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


class ImportPathError(ValueError):
    """An import path that does not name a callable; the message says why in one line."""


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
