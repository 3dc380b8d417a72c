"""What the run does when a part of the job dies, or a preemption notice comes: one table.

Each row says, for a fault (which part died, or a notice) in a phase of the job (starting,
running its steps, taking a preemption's final checkpoint) and under which circumstances (the
`failover.*` settings, the restores left, whether a standby controller is up, whether a halted
controller's call ended), which action the run takes. The first row that matches decides.
`TrainingRun` (run.py) asks `decide` when a part died or a notice came, and the job
(controller/job.py) asks it whether a dead worker's calls move; docs/failover.md shows the
table as `markdown()` renders it (a test keeps the two equal).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum


class Fault(StrEnum):
    WORKER = "worker"
    STORE_SHARD = "store shard"
    ENVIRONMENT = "environment actor"
    CONTROLLER = "controller"
    OTHER = "another actor"  # of a class the job does not name (components.py)
    NOTICE = "preemption notice"


class Phase(StrEnum):
    STARTING = "starting"  # TrainingRun.open: the controller and engines start, a restore runs
    RUNNING = "running"  # the loop's steps
    PREEMPTING = "preempting"  # the final checkpoint under way


class Action(StrEnum):
    MOVE_CALLS = "mark the worker lost, move its calls, start a replacement; the run goes on"
    REBUILD_ON_KEPT_ENGINES = (
        "halt the controller (`halt`), which builds the job again on the same engines "
        "(`restart`); restore from the newest snapshot"
    )
    STANDBY_TAKES_OVER = (
        "the standby controller takes the job on the same engines; restore from the newest snapshot"
    )
    NEW_CONTROLLER_ON_KEPT_ENGINES = (
        "a new controller takes the job on the same engines; restore from the newest snapshot"
    )
    NEW_ENGINES = "stop what is left of the job, start it anew; restore from the newest snapshot"
    END_RUN = "end the run in one line naming `train --restore`"
    FINAL_CHECKPOINT = "hold every call, cut, publish a snapshot within the grace; exit 0"
    END_START = "stop the start (nothing published by it); exit 0 naming `train --restore`"
    GO_ON = (
        "the final checkpoint under way goes on, or fails saying so; exit 0 naming "
        "`train --restore`"
    )


@dataclass(frozen=True)
class Circumstances:
    """What a decision depends on besides the fault and the phase."""

    failover: bool = True  # failover.enabled
    keep_engines: bool = True  # failover.keep_engines
    restores_left: bool = True  # fewer than failover.max_restores restores in this process
    standby: bool = False  # a standby controller is up (failover.standby_controller)
    settled: bool | None = None  # after `halt`: the controller's waiting call ended in settle_s
    # Where a worker's death shows: "job" (the supervisor, or a model call it served),
    # "trainer" (a call of the trainer's through the controller failed on it: ComponentLost).
    seen: str = "trainer"


@dataclass(frozen=True)
class Row:
    fault: Fault
    phase: Phase
    when: str  # the circumstances in words ("" for any)
    test: Callable[[Circumstances], bool]
    action: Action


def _any(c: Circumstances) -> bool:
    return True


def _no_restores(c: Circumstances) -> bool:
    return not c.restores_left


def _not_kept(c: Circumstances) -> bool:
    return not c.keep_engines


_JOB_ACTORS = (Fault.STORE_SHARD, Fault.ENVIRONMENT)
_DEATHS = (Fault.WORKER, *_JOB_ACTORS, Fault.CONTROLLER, Fault.OTHER)

TABLE: tuple[Row, ...] = (
    Row(Fault.NOTICE, Phase.STARTING, "", _any, Action.END_START),
    Row(Fault.NOTICE, Phase.RUNNING, "", _any, Action.FINAL_CHECKPOINT),
    Row(Fault.NOTICE, Phase.PREEMPTING, "", _any, Action.GO_ON),
    *(Row(fault, Phase.PREEMPTING, "", _any, Action.GO_ON) for fault in _DEATHS),
    Row(
        Fault.WORKER,
        Phase.RUNNING,
        "failover.enabled, seen in the job",
        lambda c: c.failover and c.seen == "job",
        Action.MOVE_CALLS,
    ),
    Row(
        Fault.WORKER,
        Phase.RUNNING,
        "failover.enabled=false, seen in the job (a model call it served fails: `WorkerDied`)",
        lambda c: c.seen == "job",
        Action.END_RUN,
    ),
    *(
        Row(fault, phase, "no restore left", _no_restores, Action.END_RUN)
        for phase in (Phase.STARTING, Phase.RUNNING)
        for fault in _DEATHS
    ),
    *(Row(fault, Phase.STARTING, "", _any, Action.NEW_ENGINES) for fault in _DEATHS),
    Row(
        Fault.WORKER,
        Phase.RUNNING,
        "seen by the trainer (its call through the controller failed on the worker)",
        _any,
        Action.NEW_ENGINES,
    ),
    Row(Fault.OTHER, Phase.RUNNING, "", _any, Action.NEW_ENGINES),
    *(
        Row(fault, Phase.RUNNING, "failover.keep_engines=false", _not_kept, Action.NEW_ENGINES)
        for fault in (*_JOB_ACTORS, Fault.CONTROLLER)
    ),
    *(
        row
        for fault in _JOB_ACTORS
        for row in (
            Row(
                fault,
                Phase.RUNNING,
                "halted, its call ended within failover.settle_s",
                lambda c: c.settled is True,
                Action.REBUILD_ON_KEPT_ENGINES,
            ),
            Row(
                fault,
                Phase.RUNNING,
                "halted, its call did not end (or the halt failed)",
                lambda c: c.settled is False,
                Action.NEW_ENGINES,
            ),
            Row(fault, Phase.RUNNING, "", _any, Action.REBUILD_ON_KEPT_ENGINES),
        )
    ),
    Row(
        Fault.CONTROLLER,
        Phase.RUNNING,
        "a standby controller is up",
        lambda c: c.standby,
        Action.STANDBY_TAKES_OVER,
    ),
    Row(Fault.CONTROLLER, Phase.RUNNING, "", _any, Action.NEW_CONTROLLER_ON_KEPT_ENGINES),
)


def fault_of(component: str) -> Fault:
    """The fault a dead component means (`ComponentLost.component`)."""
    try:
        return Fault(component)
    except ValueError:
        return Fault.OTHER


def decide(fault: Fault | str, phase: Phase, c: Circumstances) -> Action:
    """The action of the first row for (`fault`, `phase`) whose circumstances hold."""
    fault = fault if isinstance(fault, Fault) else fault_of(fault)
    for row in TABLE:
        if row.fault is fault and row.phase is phase and row.test(c):
            return row.action
    raise LookupError(f"no healing row for {fault} while {phase}")  # the table is total


KEEPS_ENGINES = (
    Action.REBUILD_ON_KEPT_ENGINES,
    Action.STANDBY_TAKES_OVER,
    Action.NEW_CONTROLLER_ON_KEPT_ENGINES,
)
RESTORES = (*KEEPS_ENGINES, Action.NEW_ENGINES)


def markdown() -> str:
    """The table as docs/failover.md shows it: rows in the order they are tried."""
    lines = ["| what | while the job is | when | the run |", "|---|---|---|---|"]
    for row in TABLE:
        lines.append(f"| {row.fault} | {row.phase} | {row.when or 'otherwise'} | {row.action} |")
    return "\n".join(lines) + "\n"
