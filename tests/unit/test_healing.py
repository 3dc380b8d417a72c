"""The healing table (rollout_recovery/healing.py): total, each decision as documented, the docs'
table rendered from it, and `TrainingRun.close` doing what it decides against fake actors."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from rollout_recovery.errors import ComponentLost
from rollout_recovery.healing import (
    KEEPS_ENGINES,
    TABLE,
    Action,
    Circumstances,
    Fault,
    Phase,
    decide,
    fault_of,
    markdown,
)
from tests.unit.test_keep_running import _closed, _Engines, _Proxy

REPO = Path(__file__).resolve().parents[2]


def _every_circumstance():
    for failover, keep, left, standby in itertools.product((True, False), repeat=4):
        for settled, seen in itertools.product((None, True, False), ("job", "trainer")):
            yield Circumstances(failover, keep, left, standby, settled, seen)


def test_every_fault_in_every_phase_has_a_decision():
    for fault, phase, c in itertools.product(Fault, Phase, _every_circumstance()):
        assert isinstance(decide(fault, phase, c), Action)


def test_every_row_decides_somewhere():
    """No row is shadowed by the rows before it."""
    used = {
        next(i for i, r in enumerate(TABLE) if r.fault is f and r.phase is p and r.test(c))
        for f, p, c in itertools.product(Fault, Phase, _every_circumstance())
    }
    assert used == set(range(len(TABLE)))


C = Circumstances
CASES = [
    (Fault.NOTICE, Phase.STARTING, C(), Action.END_START),
    (Fault.NOTICE, Phase.RUNNING, C(), Action.FINAL_CHECKPOINT),
    (Fault.CONTROLLER, Phase.PREEMPTING, C(), Action.GO_ON),
    (Fault.WORKER, Phase.RUNNING, C(seen="job"), Action.MOVE_CALLS),
    (Fault.WORKER, Phase.RUNNING, C(failover=False, seen="job"), Action.END_RUN),
    (Fault.WORKER, Phase.RUNNING, C(), Action.NEW_ENGINES),
    (Fault.WORKER, Phase.RUNNING, C(restores_left=False), Action.END_RUN),
    (Fault.STORE_SHARD, Phase.RUNNING, C(), Action.REBUILD_ON_KEPT_ENGINES),
    (Fault.STORE_SHARD, Phase.RUNNING, C(settled=False), Action.NEW_ENGINES),
    (Fault.ENVIRONMENT, Phase.RUNNING, C(keep_engines=False), Action.NEW_ENGINES),
    (Fault.ENVIRONMENT, Phase.STARTING, C(), Action.NEW_ENGINES),
    (Fault.ENVIRONMENT, Phase.RUNNING, C(restores_left=False), Action.END_RUN),
    (Fault.CONTROLLER, Phase.RUNNING, C(standby=True), Action.STANDBY_TAKES_OVER),
    (Fault.CONTROLLER, Phase.RUNNING, C(), Action.NEW_CONTROLLER_ON_KEPT_ENGINES),
    (Fault.CONTROLLER, Phase.RUNNING, C(standby=True, keep_engines=False), Action.NEW_ENGINES),
    (Fault.OTHER, Phase.RUNNING, C(), Action.NEW_ENGINES),
]


@pytest.mark.parametrize(("fault", "phase", "c", "action"), CASES)
def test_the_documented_decisions(fault, phase, c, action):
    assert decide(fault, phase, c) is action


def test_a_component_the_job_does_not_name_is_another_actor():
    assert fault_of("store shard") is Fault.STORE_SHARD and fault_of("Mystery") is Fault.OTHER


def test_the_failover_docs_show_the_table_as_rendered():
    """docs/failover.md holds `markdown()` verbatim: a changed row changes the docs too."""
    assert markdown() in (REPO / "docs" / "failover.md").read_text()


@pytest.mark.parametrize("component", ["store shard", "environment actor", "controller", "worker"])
@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("standby", [True, False])
@pytest.mark.parametrize("proxy", ["settles", "stuck", "halt_fails"])
@pytest.mark.parametrize("left", [True, False])
def test_close_after_a_death_does_what_the_table_decides(
    tmp_path, component, keep, standby, proxy, left
):
    """Fake actors: what `TrainingRun.close(lost=...)` keeps, halts and kills follows the table
    for every death, setting and controller behaviour."""
    fake = _Proxy(settles=proxy == "settles", halt_fails=proxy == "halt_fails")
    engines, spare = _Engines(), _Proxy() if standby else None
    lost = ComponentLost(component, "its worker process has died")
    run = _closed(tmp_path, fake, engines, lost, keep, spare, restores_left=left)
    c = Circumstances(keep_engines=keep, restores_left=left, standby=standby)
    action = decide(component, Phase.RUNNING, c)
    if action is Action.REBUILD_ON_KEPT_ENGINES:  # asked again once the halt settled or not
        settled = Circumstances(keep_engines=keep, restores_left=left, standby=standby,
                                settled=proxy == "settles")  # fmt: skip
        action = decide(component, Phase.RUNNING, settled)
    if action in KEEPS_ENGINES:
        assert run.kept is not None and run.kept.engines is engines
        assert engines.calls == ["drop_store"] and run.kept.standby is spare
        halted = action is Action.REBUILD_ON_KEPT_ENGINES
        assert (run.kept.controller is fake) is halted
        assert ("kill" in fake.calls) is not halted
    else:
        assert run.kept is None and engines.calls[-1] == "stop" and "kill" in fake.calls
        assert spare is None or spare.calls == ["kill"]
