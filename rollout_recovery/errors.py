"""Expected failures a user can act on.

Each carries a one-line message naming the cause and the fix; the command line prints it and
exits non-zero. Raising one means nothing was deleted: the run's checkpoints are as they were.

An error in the user's own code (episode, reward, effect or task function) is one too,
`UserCodeError`: its line names the function (`module:name`), the episode or step and the fix,
and it carries the user's own traceback frames as text (`user_frames`), which survive pickling
across the environment's loop thread and its Ray actor; the command line prints them under the
line, without the project's own frames.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import time
import traceback
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
# The shipped episodes are user code like the user's own (examples of episode functions).
_USER_PACKAGES = (_PACKAGE / "episodes",)
_LIBRARIES = tuple(
    Path(p).resolve()
    for p in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)
_MESSAGE_CHARS = 300  # of the user's exception text in a one-line message


class RecoveryError(RuntimeError):
    """An expected failure with a one-line message (the cause and the fix)."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


class StorageError(OSError, RecoveryError):
    """A write or read under the checkpoint location failed; the message is one line: what
    failed and why (`detail`), then what to do (`fix`, where one is known). A RecoveryError
    too, so a loop catches every expected failure of a run as one kind."""

    def __init__(self, detail: str, fix: str = "") -> None:
        super().__init__(f"{detail}; {fix}" if fix else detail)
        self.detail, self.fix = detail, fix


class RestoreError(RecoveryError):
    """A restore was refused: nothing usable, another model, a finished run, a wrong level."""


class RunExistsError(RecoveryError):
    """A fresh run would overwrite an existing run's checkpoints."""


class CheckpointWriteError(RecoveryError):
    """A checkpoint could not be written (a full or read-only disk, a lost object store)."""


class RunStalled(RecoveryError):
    """A step made no progress for `liveness.stall_timeout_s`; `reason` names how (counted
    as `run_stalled.<reason>`)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):  # crosses Ray as itself, reason included
        return (type(self), (self.reason, str(self)))


class WorkerDied(RecoveryError):
    """With `failover.enabled: false`, a model call's worker dropped it (the worker died or
    its connection broke): the call cannot move to another worker, so the step stops."""


class ComponentLost(RecoveryError):
    """An actor of the job died under the run (components.py names which): the controller, a
    store shard or the environment actor. `TrainingRun.keep_running` continues the run from
    its newest snapshot in the same process (`failover.max_restores` times); past that, or
    outside it, the message says to continue with `train --restore`. `component` names the
    actor kind, `reason` how it died (Ray's words, one line)."""

    def __init__(self, component: str, reason: str, message: str | None = None) -> None:
        super().__init__(message or f"the {component} died ({reason})")
        self.component, self.reason = component, reason
        self.at = time.time()  # when this process learned of it (time to recover, from here)

    def __reduce__(self):  # crosses Ray as itself
        return (type(self), (self.component, self.reason, str(self)))


class Preempted(SystemExit):
    """The run was told it will be stopped (SIGTERM, or `preemption.notice_file`) and took its
    final checkpoint (run.py): raised out of the training loop's call into the run, and, like
    `sys.exit(0)`, it ends the process with status 0 unless the loop catches it. `notice` says
    which notice came."""

    def __init__(self, notice: str) -> None:
        super().__init__(0)
        self.notice = notice


class UserCodeError(RecoveryError):
    """The user's own code raised (or returned what it must not): the message names the
    function, the episode or step and the fix; `frames` is the user's own part of the
    traceback as text ("" when none of it is the user's)."""

    def __init__(self, message: str, frames: str = "") -> None:
        super().__init__(message)
        self.frames = frames

    def __reduce__(self):  # crosses threads and Ray as itself, frames included
        return (type(self), (str(self), self.frames))


def one_line(err: BaseException) -> str:
    """An exception as one line, unwrapped from Ray's task error."""
    cause = getattr(err, "cause", None) or err
    text = " ".join(str(cause).split()) or type(cause).__name__
    return text if len(text) < 500 else text[:497] + "..."


def unwrapped(err: BaseException) -> BaseException:
    """The exception a Ray task raised, when `err` is Ray's wrapper of it (a RayTaskError
    whose `str` is the whole remote traceback); else `err`."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException) and type(err).__name__.startswith("RayTaskError"):
        return cause
    return err


def _is_user_file(filename: str, owners: tuple[Path, ...] = ()) -> bool:
    """Whether a traceback frame's file is the user's: in one of `owners` (where the user's
    configured functions live, even when installed), else not the project's own modules (the
    shipped episodes excepted), not the standard library, not an installed package."""
    if not filename or filename.startswith("<"):
        return False
    path = Path(os.path.abspath(filename))
    if any(path.is_relative_to(p) for p in (*owners, *_USER_PACKAGES)):
        return True
    if path.is_relative_to(_PACKAGE) or {"site-packages", "dist-packages"} & set(path.parts):
        return False
    return not any(path.is_relative_to(p) for p in _LIBRARIES)


def _home(fn: object) -> Path | None:
    """The directory of the top-level package (or the file of the top-level module) that
    defines `fn`; None for the project's own package or where it cannot be told."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    top = sys.modules.get((getattr(fn, "__module__", None) or "").partition(".")[0])
    file = getattr(top, "__file__", None)
    if not file:
        return None
    path = Path(os.path.abspath(file))
    home = path.parent if path.name == "__init__.py" else path
    return None if home == _PACKAGE or _PACKAGE.is_relative_to(home) else home


def user_frames(err: BaseException, *owners: object) -> str:
    """The frames of `err`'s traceback that are the user's own code, formatted as Python
    prints them, under a heading; "" when none is. `owners`: the user's functions involved,
    whose packages count as the user's wherever they are installed."""
    homes = tuple(h for h in map(_home, owners) if h is not None)
    frames = [
        f for f in traceback.extract_tb(err.__traceback__) if _is_user_file(f.filename, homes)
    ]
    if not frames:
        return ""
    body = "".join(traceback.format_list(frames))
    last = "".join(traceback.format_exception_only(type(err), err))
    return f"your code (most recent call last):\n{body}{last}".rstrip("\n")


def callable_name(fn: object) -> str:
    """`module:qualified.name` of a function (of the function a partial wraps)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    module = getattr(fn, "__module__", None) or type(fn).__module__
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}:{name}"


def exception_text(err: BaseException, chars: int = _MESSAGE_CHARS) -> str:
    """`Type: message` of an exception, on one line and cut to `chars` characters."""
    text = " ".join(str(err).split())
    if len(text) > chars:
        text = text[: chars - 3] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def user_code_error(
    what: str, err: BaseException, where: str, fix: str, *owners: object
) -> UserCodeError:
    """`what` (the user's function, named) raised `err` `where` (the episode or step): the
    error naming it and `fix`, carrying the user's own frames of `err` (`owners`: the user's
    functions involved, as for `user_frames`)."""
    message = f"{what} raised {exception_text(err)} {where}; {fix}"
    return UserCodeError(message, user_frames(err, *owners))


def in_chain(err: BaseException, target: BaseException | None) -> bool:
    """Whether `target` is `err` or an exception `err` was raised from or while handling."""
    seen: set[int] = set()
    at: BaseException | None = err
    while at is not None and id(at) not in seen:
        if at is target:
            return True
        seen.add(id(at))
        at = at.__cause__ or at.__context__
    return False


def short_repr(value: object, chars: int = 80) -> str:
    """`repr(value)` cut to `chars` characters, for a one-line message."""
    text = " ".join(repr(value).split())
    return text if len(text) <= chars else text[: chars - 3] + "..."
