"""Which actor of the job died, in the run's words: Ray reports a dead actor by its class
(`RayActorError`), maybe wrapped in the error of the task that was waiting on it; this turns
that into one `ComponentLost` naming the component and how it died.

A dead controller fails the trainer's call at once. A dead store shard may not: the calls that
were writing to it fail inside the episodes, and the step can wait on them until the liveness
watch gives up. So while the trainer waits on a step it asks the controller, every
`failover.component_check_s`, which of its own actors are gone (`dead`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import ray

from rollout_recovery.errors import ComponentLost

# Actor class -> the component's name in messages, metrics and the step log.
COMPONENTS = {
    "RolloutRecovery": "controller",
    "StoreShard": "store shard",
    "RolloutEnvironment": "environment actor",
    "GenerationWorker": "worker",
}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_REASON_CHARS = 200


def lost(err: BaseException) -> ComponentLost | None:
    """The `ComponentLost` that `err` means (a dead actor, also behind task errors that waited
    on it), or None when it is about something else."""
    seen: BaseException | None = err
    for _ in range(8):  # task errors nest one per actor the failure crossed
        if isinstance(seen, ComponentLost):
            return seen
        if isinstance(seen, ray.exceptions.RayActorError):
            return ComponentLost(component_of(seen), death_reason(seen))
        cause = getattr(seen, "cause", None) or getattr(seen, "__cause__", None)
        if not isinstance(cause, BaseException):
            return None
        seen = cause
    return None


def component_of(err: ray.exceptions.RayActorError) -> str:
    """The component the dead actor was, from the class Ray names in its message."""
    found = re.search(r"class_name: (\w+)", str(getattr(err, "error_msg", "") or err))
    if found is None:
        return "actor"
    return COMPONENTS.get(found.group(1), found.group(1))


def death_reason(err: ray.exceptions.RayActorError) -> str:
    """How the actor died, in one line: Ray's message without its colour codes and without
    the lines that identify the actor (class, id, pid, address)."""
    text = _ANSI.sub("", str(getattr(err, "error_msg", "") or err))
    kept = [line.strip() for line in text.splitlines() if line.strip() and not line[:1].isspace()]
    words = " ".join(" ".join(kept).split()) or "the actor is gone"
    because = re.search(r"The actor is dead because (.+?)\.(\s|$)", words)
    words = because.group(1) if because else words
    return words if len(words) <= _REASON_CHARS else words[: _REASON_CHARS - 3] + "..."


def dead(actors: Sequence[tuple[str, Any]], timeout_s: float) -> list[ComponentLost]:
    """The actors of `actors` ((component, handle) pairs) that are dead: each is asked Ray's
    built-in readiness call; one that does not answer within `timeout_s` is busy, not dead (a
    hang is the liveness watch's to find)."""
    if not actors:
        return []
    refs = {actor.__ray_ready__.remote(): name for name, actor in actors}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    found = []
    for ref in ready:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as err:
            found.append(ComponentLost(refs[ref], death_reason(err)))
    return found
