"""Continuous logging and where a migrated call goes on from, without an engine.

The token log's rows are the chain a cut extends, so a cut after the token log stages only the
rest; the time trigger and the engine-step nudge both start a pass; and a lost attempt's
token log is read back, checked like a restore's continuation, and refused (counted) when any
row fails. The engine-level behaviour (a worker killed mid-generation) is the failover check's
(functional_tests/worker_failover.py).
"""

from __future__ import annotations

import asyncio

import numpy as np

from rollout_recovery.data_plane.digest import CHAIN_ROOT, chain_digest
from rollout_recovery.data_plane.schemas import chunk_rows_to_table
from rollout_recovery.environment.migration import token_log_continuation
from rollout_recovery.generation.metrics import WorkerMetrics
from rollout_recovery.generation.token_log import TokenLog
from rollout_recovery.generation.vllm_compat import Step
from rollout_recovery.protocol import Continuation
from tests.unit.test_capture_logic import STAGING, FakeReader, Worker


class ListingStore:
    """MemoryStore plus the prefix listing the migration reads."""

    def __init__(self, store) -> None:
        self.inner = store

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def alist(self, partition: str, prefix: str = "") -> list[str]:
        return sorted(k for p, k in self.inner.rows if p == partition and k.startswith(prefix))


def _decode(reader: FakeReader, n: int, start: int = 100) -> None:
    base = len(reader.ids) + start
    reader.decode(list(range(base, base + n)), [-0.01 * (i + 1) for i in range(n)])


async def test_the_journal_stages_every_k_tokens_on_the_chain_a_cut_extends():
    worker = Worker()
    token_log = TokenLog(worker.service, interval_tokens=4)
    reader = FakeReader([], [])
    identity = worker.start(reader)
    _decode(reader, 5)
    assert await worker.service.log_calls(token_log._is_due) == 5
    _decode(reader, 2)
    assert await worker.service.log_calls(token_log._is_due) == 0  # 2 < K: not due
    _decode(reader, 3)
    assert await worker.service.log_calls(token_log._is_due) == 5
    keys = [identity.chunk_key(0), identity.chunk_key(1)]
    assert [k for _, k in worker.store.rows] == keys
    row = worker.store.chunk(keys[1])
    assert (row.prev_len, row.delta_len) == (5, 5)
    _decode(reader, 1)
    [receipt] = await worker.cut(identity)  # the cut stages only the one new token
    assert receipt.staging_keys == [*keys, identity.chunk_key(2)]
    assert worker.store.chunk(identity.chunk_key(2)).token_ids.tolist() == reader.ids[10:]
    digest = CHAIN_ROOT
    for a, b in ((0, 5), (5, 10), (10, 11)):
        digest = chain_digest(digest, np.asarray(reader.ids[a:b], np.int32))
    assert receipt.prefix_digest == digest.hex()


async def test_finished_and_uncuttable_calls_are_not_journaled_and_lag_is_sampled():
    worker = Worker(classify=lambda params: None)
    token_log = TokenLog(worker.service, interval_tokens=1)
    done_reader, odd_reader = FakeReader([1, 2, 3], [-0.1] * 3), FakeReader([4, 5], [-0.1] * 2)
    done, odd = worker.start(done_reader), worker.start(odd_reader)
    worker.capture.calls[done].finished = True
    worker.capture.calls[odd].uncuttable = "n_greater_than_1"
    assert await worker.service.log_calls(token_log._is_due) == 0
    assert not worker.store.rows
    live = worker.start(FakeReader([7, 8], [-0.1, -0.2]))
    WorkerMetrics().log_lags.clear()
    worker.service.sample_log_lag()  # the in-flight call only: 2 tokens not durable
    assert list(WorkerMetrics().log_lags) == [2]
    assert await worker.service.log_calls(token_log._is_due) == 2
    assert worker.capture.calls[live].staged_tokens == 2
    worker.service.sample_log_lag()
    assert list(WorkerMetrics().log_lags) == [2, 0]


async def test_an_engine_step_past_k_wakes_the_journal_task():
    worker = Worker()
    token_log = TokenLog(worker.service, interval_tokens=3)
    token_log.start()
    try:
        reader = FakeReader([], [])
        identity = worker.start(reader)
        _decode(reader, 2)
        worker.capture.stepped([Step(f"{identity.rollout_id}-internal", 2, False, None, None)])
        await asyncio.sleep(0.05)
        assert not worker.store.rows  # 2 < K
        _decode(reader, 1)
        worker.capture.stepped([Step(f"{identity.rollout_id}-internal", 1, False, None, None)])
        for _ in range(50):
            if worker.store.rows:
                break
            await asyncio.sleep(0.01)
        assert worker.store.chunk(identity.chunk_key(0)).delta_len == 3
    finally:
        await token_log.stop()


async def test_the_time_trigger_journals_a_slow_call():
    worker = Worker()
    token_log = TokenLog(worker.service, interval_tokens=None, interval_s=0.05)
    reader = FakeReader([1], [-0.1])
    identity = worker.start(reader)
    token_log.start()
    try:
        for _ in range(100):
            if worker.store.rows:
                break
            await asyncio.sleep(0.01)
        assert worker.store.chunk(identity.chunk_key(0)).token_ids.tolist() == [1]
    finally:
        await token_log.stop()


# ------------------------------------------------------------------ migration


async def _journaled(worker: Worker, tokens: int = 6):
    token_log = TokenLog(worker.service, interval_tokens=2)
    reader = FakeReader([], [])
    identity = worker.start(reader)
    for _ in range(tokens // 2):
        _decode(reader, 2)
        await worker.service.log_calls(token_log._is_due)
    return identity, reader


async def test_a_lost_attempt_goes_on_from_its_verified_journal():
    worker = Worker()
    identity, _ = await _journaled(worker)
    store = ListingStore(worker.store)
    cont, refused = await token_log_continuation(store, STAGING, identity, None)
    assert refused is None
    assert cont.keys == [identity.chunk_key(i) for i in range(3)]
    assert (cont.tokens, cont.attempt, cont.call_id) == (6, 0, "c0")
    assert cont.digest == worker.capture.calls[identity].chain_digest.hex()
    older = Continuation(call_id="c0", attempt=0, keys=["x"], tokens=9, digest="00")
    longer, _ = await token_log_continuation(store, STAGING, identity, older)
    assert longer is older  # the prefix it was resumed from is the longer one


async def test_a_journal_that_fails_a_check_is_refused_and_the_call_starts_over():
    worker = Worker()
    identity, _ = await _journaled(worker)
    row = worker.store.chunk(identity.chunk_key(1))
    row.token_ids = row.token_ids + np.int32(1)  # a flipped token: the chain breaks
    worker.store.rows[(STAGING, row.key)] = chunk_rows_to_table([row])
    cont, refused = await token_log_continuation(
        ListingStore(worker.store), STAGING, identity, None
    )
    assert (cont, refused) == (None, "digest_mismatch")
    del worker.store.rows[(STAGING, identity.chunk_key(0))]  # a lost first row
    cont, refused = await token_log_continuation(
        ListingStore(worker.store), STAGING, identity, None
    )
    assert cont is None and refused == "chunk_order"


async def test_no_journal_falls_back_to_the_prefix_the_attempt_resumed_from():
    worker = Worker()
    identity = worker.start(FakeReader([], []))
    older = Continuation(call_id="c0", attempt=0, keys=["k"], tokens=4, digest="00")
    store = ListingStore(worker.store)
    assert await token_log_continuation(store, STAGING, identity, older) == (older, None)
    assert await token_log_continuation(store, STAGING, identity, None) == (None, None)
