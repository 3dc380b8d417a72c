"""One call's state through its life (environment/inflight.py): what a checkpoint records for
it and which staged rows a sweep keeps, at each step. The sweep decides from these alone."""

from __future__ import annotations

from rollout_recovery.environment.inflight import CallTable
from rollout_recovery.protocol import CallIdentity, Continuation

RID = "g-g0"
RESTORED = Continuation(call_id="c1", attempt=0, keys=["g-g0/c1/a0/c000000"], tokens=4)


def test_a_call_from_restore_through_a_lost_worker_to_its_answer():
    calls = CallTable()
    calls.wait_on(RID, RESTORED, moved=False)  # restored, not made again yet
    assert calls.continuation(RID) == RESTORED
    assert calls.kept() == ({"g-g0/c1/a0/c000000"}, set())
    assert not calls.get(RID).moving and not calls.get(RID).in_flight

    first = CallIdentity(RID, "c1", 1)
    calls.start(RID, 0, first, RESTORED)  # in flight, resuming from the restored rows
    assert calls.continuation(RID) == Continuation(call_id="c1", attempt=1)  # not cut
    assert calls.kept() == ({"g-g0/c1/a0/c000000"}, {first})
    cut = Continuation(call_id="c1", attempt=1, keys=["g-g0/c1/a1/c000000"], tokens=9)
    calls.record_cut(RID, cut)
    assert calls.continuation(RID) == cut
    assert calls.kept()[0] == {"g-g0/c1/a0/c000000", "g-g0/c1/a1/c000000"}
    calls.clear_cuts()  # the next checkpoint starts with no receipt

    calls.lose(RID)  # its worker died; the attempt comes back
    calls.ended(RID)
    assert calls.get(RID).moving and not calls.get(RID).in_flight
    assert calls.continuation(RID) == Continuation(call_id="c1", attempt=1)
    assert calls.kept() == ({"g-g0/c1/a0/c000000"}, {first})  # both its own and its prefix

    moved = Continuation(call_id="c1", attempt=1, keys=["g-g0/c1/a1/c000000"], tokens=12)
    calls.wait_on(RID, moved, moved=True)
    assert calls.get(RID).moving and calls.continuation(RID) == moved
    assert calls.kept() == ({"g-g0/c1/a1/c000000"}, set())

    second = CallIdentity(RID, "c1", 2)
    calls.start(RID, 1, second, moved)
    assert not calls.get(RID).moving and calls.kept() == ({"g-g0/c1/a1/c000000"}, {second})
    calls.ended(RID)  # answered: nothing is kept
    assert RID not in calls and calls.kept() == (set(), set())


def test_a_loss_that_was_not_a_workers_death_keeps_nothing():
    calls = CallTable()
    attempt = CallIdentity(RID, "c0", 0)
    calls.start(RID, 0, attempt, None)
    calls.lose(RID)
    calls.forget_loss(RID)
    calls.ended(RID)
    assert RID not in calls and len(calls) == 0


def test_a_cut_of_an_earlier_attempt_is_not_recorded_for_the_next():
    calls = CallTable()
    calls.start(RID, 0, CallIdentity(RID, "c1", 1), None)
    calls.record_cut(RID, Continuation(call_id="c1", attempt=0, keys=["k"], tokens=3))
    assert calls.continuation(RID) == Continuation(call_id="c1", attempt=1)
