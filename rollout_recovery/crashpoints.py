"""Named crash points: places between durable steps where a test can kill the whole job.

Arm one with `ROLLOUT_RECOVERY_CRASH_AT=<name>` (the first time it is reached) or
`<name>@<n>` (the n-th time). The process group is then killed with SIGKILL, as a power cut,
an OOM kill or a preemption would: no cleanup, no flush, no `finally`. Start the job in its own
session (`start_new_session=True`) so that only it dies.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

ENV = "ROLLOUT_RECOVERY_CRASH_AT"
POINTS = (
    "after_trainer_checkpoint",  # trainer checkpoint written, its snapshot not yet taken
    "after_trainer_snapshot",  # snapshot published, the step not yet in steps.jsonl
)
_reached: Counter[str] = Counter()


def crash_point(name: str) -> None:
    if name not in POINTS:
        raise ValueError(f"unknown crash point {name!r}; known: {POINTS}")
    armed = os.environ.get(ENV)
    if not armed:
        return
    target, _, nth = armed.partition("@")
    if target != name:
        return
    _reached[name] += 1
    if _reached[name] == int(nth or 1):
        os.killpg(os.getpgrp(), signal.SIGKILL)
