"""Expected failures a user can act on.

Each carries a one-line message naming the cause and the fix; the command line prints it and
exits non-zero. Raising one means nothing was deleted: the run's checkpoints are as they were.
"""

from __future__ import annotations


class RecoveryError(RuntimeError):
    """An expected failure with a one-line message (the cause and the fix)."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


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


def one_line(err: BaseException) -> str:
    """An exception as one line, unwrapped from Ray's task error."""
    cause = getattr(err, "cause", None) or err
    text = " ".join(str(cause).split()) or type(cause).__name__
    return text if len(text) < 500 else text[:497] + "..."
