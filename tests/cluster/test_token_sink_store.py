"""TokenEntries in the StagingStore: durable, idempotent, conflict-refusing, snapshotted."""

from __future__ import annotations

import pytest

from rollout_recovery.environment.token_entry import ParentResolution, TokenEntry
from rollout_recovery.environment.token_sink import ConflictingEntryError, StoreTokenSink

pytestmark = pytest.mark.cluster


def _entry(**kw) -> TokenEntry:
    base = dict(
        rollout_id="r1",
        model_call_id="c1",
        prompt_token_ids=[1, 2, 3],
        generated_token_ids=[7, 8, 2],
        generated_logprobs=[-0.5, -1.25, -0.001],
        parent_resolution=ParentResolution.RESOLVED,
        parent_call_id="c0",
        prefix_requested=True,
        prefix_supplied=True,
        finish_reason="stop",
    )
    return TokenEntry.build(**(base | kw))


def test_store_sink_round_trip_idempotency_and_snapshot(make_store, tmp_path):
    store = make_store(2)
    sink = StoreTokenSink(store)
    e = _entry()
    assert sink.put(e) is True
    assert sink.put(_entry()) is False
    with pytest.raises(ConflictingEntryError):
        sink.put(_entry(generated_logprobs=[-0.5, -1.0, -0.001]))
    assert sink.get("r1/c1/a0") == e
    assert sink.get("r1/c9/a0") is None
    sink.mark_incomplete("r1", "c2", "worker_lost")
    assert sink.incomplete() == [("r1", "c2", "worker_lost")]
    snap = store.snapshot(str(tmp_path))
    fresh = make_store(1)
    fresh.restore(snap.uri)
    again = StoreTokenSink(fresh)
    assert again.get("r1/c1/a0") == e
    assert again.incomplete() == [("r1", "c2", "worker_lost")]
    other = _entry(model_call_id="c3", parent_call_id="c1", generated_token_ids=[9, 2],
                   generated_logprobs=[-0.25, -0.75])  # fmt: skip
    again.put(other)
    found = again.get_many(["r1/c3/a0", "r1/c9/a0", "r1/c1/a0", "r1/c3/a0"])
    assert found == {"r1/c1/a0": e, "r1/c3/a0": other}  # one round trip; missing ids left out
