"""Capture, cut and resume logic driven by a fake progress reader, without a vLLM engine.

The calls are registered through the same observer methods vllm_compat's output-processor
hooks call (`admit`, `added`, `stepped`, `swept`); their progress comes from `FakeReader`,
which offers what `vllm_compat.RequestProgress` reads from vLLM (generated ids, sampled
logprobs, the delivered finish). Staging goes to an in-memory store; the real StagingStore
and the real engine are covered by tests/engine.
"""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from rollout_recovery.data_plane.digest import CHAIN_ROOT, chain_digest, finish_digest
from rollout_recovery.data_plane.schemas import chunk_rows_to_table, table_to_chunk_rows
from rollout_recovery.generation.capture import TokenCapture
from rollout_recovery.generation.cut import CutService
from rollout_recovery.generation.metrics import WorkerMetrics
from rollout_recovery.generation.resume import Resumer
from rollout_recovery.generation.vllm_compat import AddedRequest, Step
from rollout_recovery.protocol import (
    RESUME_DIGEST_ARG,
    CallIdentity,
    CallRef,
    Continuation,
    CutInventory,
)

STAGING, TERMINAL = "rollout_staging", "rollout_terminal"
PROMPT = [5, 6, 7]
_ids = itertools.count()


class FakeReader:
    """A request's progress as the capture reads it: append-only ids and logprobs."""

    def __init__(self, ids=(), logprobs=None) -> None:
        self.ids: list[int] = list(ids)
        self.logprobs: list[float] | None = None if logprobs is None else list(logprobs)
        self.finish: tuple[str | None, Any] | None = None  # what vLLM delivered last
        self.starts: list[tuple[str, int]] = []

    def decode(self, ids, logprobs) -> None:
        self.ids += ids
        self.logprobs += logprobs

    def num_generated(self) -> int:
        return len(self.ids)

    def progress(self):
        return len(self.ids), self.ids

    def sampled_logprobs(self, start: int, end: int):
        if self.logprobs is None or len(self.logprobs) < end:
            return None
        return np.asarray(self.logprobs[start:end], dtype=np.float32)

    def weight_version_starts(self):
        return list(self.starts)

    def delivered_finish(self):
        return self.finish

    def transplant(self, primed, prompt_ids, max_tokens) -> None:
        raise AssertionError("no transplant without an engine")

    def output_logprobs(self, n: int):
        return self.logprobs[:n]


class MemoryStore:
    """The StagingStore's async API over a dict: one single-row table per key."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], pa.Table] = {}

    async def aput(self, partition: str, table: pa.Table) -> int:
        for i, key in enumerate(table.column("key").to_pylist()):
            self.rows[(partition, key)] = table.slice(i, 1)
        return table.num_rows

    async def aget(self, partition: str, keys):
        found = [self.rows[(partition, k)] for k in keys if (partition, k) in self.rows]
        missing = [k for k in keys if (partition, k) not in self.rows]
        return (pa.concat_tables(found) if found else None), missing

    async def adelete(self, partition: str, keys) -> int:
        return sum(self.rows.pop((partition, k), None) is not None for k in keys)

    def chunk(self, key: str):
        [row] = table_to_chunk_rows(self.rows[(STAGING, key)])
        return row


def _params(identity: CallIdentity, max_tokens: int = 64, **extra) -> SimpleNamespace:
    """The SamplingParams fields capture and resume read."""
    return SimpleNamespace(
        extra_args=identity.to_xargs() | extra,
        logprobs=None,
        flat_logprobs=False,
        max_tokens=max_tokens,
        min_tokens=0,
        stop=None,
        stop_token_ids=None,
        ignore_eos=True,
        frequency_penalty=0.0,
    )


class Worker:
    """A capture, its cut service and resumer over one MemoryStore, as a worker wires them."""

    def __init__(self, classify=lambda params: None) -> None:
        self.store = MemoryStore()
        self.finished: list = []
        self.capture = TokenCapture(on_finished=self.finished.append, classify=classify)
        self.service = CutService(self.capture, self.store, STAGING, TERMINAL, timeout_s=5.0)
        self.resumer = Resumer(self.capture, self.store, STAGING, classify)

    def start(self, reader: FakeReader, attempt: int = 0) -> CallIdentity:
        """Register a call as vLLM's add_request hook does."""
        identity = CallIdentity(f"unit-{next(_ids)}", "c0", attempt)
        params = _params(identity)
        admitted = self.capture.admit(params)
        request = AddedRequest(
            request_id=f"{identity.rollout_id}-internal",
            external_id=identity.rollout_id,
            params=params,
            prompt_token_ids=PROMPT,
            is_child=False,
            progress=reader,
        )
        self.capture.added(admitted, request)
        return identity

    async def cut(self, *identities: CallIdentity):
        refs = [CallRef(rollout_id=i.rollout_id, model_call_id=i.model_call_id) for i in identities]
        inventory = CutInventory(checkpoint_id=f"ckpt-{next(_ids)}", calls=refs)
        return (await self.service.cut(inventory)).calls


def _ids32(ids) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32)


# ------------------------------------------------------------------ capture


def test_admit_makes_an_identified_request_capturable():
    capture = TokenCapture(on_finished=lambda call: None)
    params = _params(CallIdentity("r", "c0", 0))
    assert capture.admit(params) == CallIdentity("r", "c0", 0)
    assert (params.logprobs, params.flat_logprobs) == (0, True)
    anonymous = SimpleNamespace(extra_args=None, logprobs=None)
    assert capture.admit(anonymous) is None
    assert anonymous.logprobs is None


def test_steps_count_decoded_tokens_and_an_abort_forgets_the_call():
    worker = Worker()
    identity = worker.start(FakeReader([1, 2], [-0.1, -0.2]))
    rid = f"{identity.rollout_id}-internal"
    worker.capture.stepped([Step(rid, 2, False, None, None), Step("other", 1, False, None, None)])
    worker.capture.swept(lambda request_id: request_id != rid)
    assert identity not in worker.capture.calls and rid not in worker.capture.by_request
    [record] = worker.capture.attempts.read(0).attempts
    assert (record.decoded_tokens, record.finish_reason) == (2, "abort")


# ------------------------------------------------------------------ cut


async def test_a_cut_of_an_active_call_stages_its_tokens_and_chain_digest():
    worker = Worker()
    ids, lps = [11, 12, 13, 14, 15], [-0.5, -1.0, -1.5, -2.0, -2.5]
    identity = worker.start(FakeReader(ids, lps))
    [receipt] = await worker.cut(identity)
    assert (receipt.disposition, receipt.cut_kind) == ("durable_prefix", "active_prefix")
    assert receipt.staging_keys == [identity.chunk_key(0)]
    assert receipt.prefix_token_count == 5
    assert receipt.prefix_digest == chain_digest(CHAIN_ROOT, _ids32(ids)).hex()
    row = worker.store.chunk(identity.chunk_key(0))
    assert row.token_ids.tolist() == ids and row.prev_len == 0
    assert row.logprobs.tolist() == pytest.approx(lps)
    assert row.prompt_token_ids.tolist() == PROMPT
    assert row.finish_reason is None


async def test_a_second_cut_chains_on_the_first():
    worker = Worker()
    reader = FakeReader([11, 12, 13], [-0.1, -0.2, -0.3])
    identity = worker.start(reader)
    [first] = await worker.cut(identity)
    reader.decode([14, 15], [-0.4, -0.5])
    [second] = await worker.cut(identity)
    assert second.staging_keys == [identity.chunk_key(0), identity.chunk_key(1)]
    assert second.prefix_token_count == 5
    expected = chain_digest(bytes.fromhex(first.prefix_digest), _ids32([14, 15]))
    assert second.prefix_digest == expected.hex()
    row = worker.store.chunk(identity.chunk_key(1))
    assert (row.token_ids.tolist(), row.prev_len, row.prompt_token_ids) == ([14, 15], 3, None)
    [again] = await worker.cut(identity)  # nothing new: the same keys, nothing staged
    assert again.staging_keys == second.staging_keys
    assert again.prefix_digest == second.prefix_digest


@pytest.mark.parametrize(
    ("delivered", "engine_reason", "reason", "stop_json"),
    [
        (None, "length", "length", None),  # only the engine core's finish
        (("stop", 42), "stop", "stop", "42"),  # vLLM delivered a stop token to the caller
    ],
)
async def test_a_finished_call_is_cut_as_terminal_completion(
    delivered, engine_reason, reason, stop_json
):
    worker = Worker()
    reader = FakeReader([21, 22, 42], [-0.1, -0.2, -0.3])
    identity = worker.start(reader)
    reader.finish = delivered
    rid = f"{identity.rollout_id}-internal"
    worker.capture.stepped([Step(rid, 3, True, engine_reason, None)])
    assert [c.identity for c in worker.finished] == [identity]
    [receipt] = await worker.cut(identity)
    assert (receipt.cut_kind, receipt.finish_reason) == ("terminal_completion", reason)
    chain = chain_digest(CHAIN_ROOT, _ids32([21, 22, 42]))
    assert receipt.prefix_digest == finish_digest(chain, reason, stop_json).hex()
    row = worker.store.chunk(identity.chunk_key(0))
    assert (row.finish_reason, row.stop_reason_json) == (reason, stop_json)


async def test_calls_that_cannot_be_cut_get_named_reasons():
    worker = Worker(classify=lambda params: "presence_penalty")
    uncuttable = worker.start(FakeReader([1], [-0.1]))
    unknown = CallIdentity("never-started", "c0", 0)
    receipts = await worker.cut(uncuttable, unknown)
    assert [(r.disposition, r.reason) for r in receipts] == [
        ("durable_failure", "presence_penalty"),
        ("durable_failure", "unknown_call"),
    ]
    empty = Worker()
    [receipt] = await empty.cut(empty.start(FakeReader([], [])))
    assert receipt.reason == "zero_generated_tokens"
    assert empty.store.rows == {}


async def test_weight_version_spans_come_from_the_reader():
    worker = Worker()
    reader = FakeReader([1, 2, 3, 4], [-0.1] * 4)
    worker.start(reader)
    [call] = worker.capture.calls.values()
    assert call.spans(4) == [(0, 0, 4)]
    reader.starts = [("0", 0), ("3", 2), ("not-a-version", 3)]
    assert call.spans(4) == [(0, 0, 2), (3, 2, 4)]


async def test_each_chunk_carries_its_own_tokens_versions_and_a_resume_keeps_them():
    """Weights pushed in flight (at token 3, then 5): each chunk row records the versions of its
    own tokens, the checked prefix all of them, and the resumed attempt's tokens keep the
    prefix's versions whatever the engine labels them (its tail is the engine's)."""
    worker = Worker()
    reader = FakeReader(IDS[:4], LPS[:4])
    identity = worker.start(reader)
    reader.starts = [("0", 0), ("1", 3)]
    await worker.cut(identity)
    reader.decode(IDS[4:], LPS[4:])
    reader.starts.append(("2", 5))
    [receipt] = await worker.cut(identity)
    keys = Continuation.from_receipt(receipt).keys
    assert [worker.store.chunk(k).weight_versions for k in keys] == [
        [(0, 0, 3), (1, 3, 4)],
        [(1, 4, 5), (2, 5, 6)],
    ]
    assert [worker.store.chunk(k).weight_version for k in keys] == [1, 2]
    extra = CallIdentity(identity.rollout_id, "c0", 1).to_xargs()
    extra |= Continuation.from_receipt(receipt).to_request_fields(limit=64)
    prefix = await _prepare(worker, extra)
    assert prefix.weight_versions == [(0, 0, 3), (1, 3, 5), (2, 5, 6)]
    # The resumed attempt: the engine labels everything from its creation on version 3.
    resumed = FakeReader([*IDS, 37, 38], [*LPS, -0.7, -0.8])
    resumed.starts = [("3", 6)]
    worker.start(resumed, attempt=1)
    call = next(c for c in worker.capture.calls.values() if c.reader is resumed)
    call.prefix_spans, call.durable_floor = prefix.weight_versions, 6
    assert call.spans(8) == [(0, 0, 3), (1, 3, 5), (2, 5, 6), (3, 6, 8)]
    resumed.starts = [("3", 0)]  # a label from before the prefix was transplanted
    assert call.spans(8) == [(0, 0, 3), (1, 3, 5), (2, 5, 6), (3, 6, 8)]


async def test_a_finished_calls_spans_wait_for_its_response_once():
    worker = Worker()
    reader = FakeReader([1, 2, 3], [-0.1] * 3)
    identity = worker.start(reader)
    reader.starts = [("0", 0), ("1", 2)]
    request_id = f"{identity.rollout_id}-internal"
    worker.capture.stepped([Step(request_id, 3, True, "stop", None)])
    assert worker.capture.take_spans(identity) == [(0, 0, 2), (1, 2, 3)]
    assert worker.capture.take_spans(identity) is None


# ------------------------------------------------------------------ resume validation


async def _staged(worker: Worker, ids, lps, split: int) -> tuple[CallIdentity, dict]:
    """A call cut twice (chunks of `split` and the rest): its identity and the request
    fields that resume it as attempt 1."""
    reader = FakeReader(ids[:split], lps[:split])
    identity = worker.start(reader)
    await worker.cut(identity)
    reader.decode(ids[split:], lps[split:])
    [receipt] = await worker.cut(identity)
    fields = Continuation.from_receipt(receipt).to_request_fields(limit=64)
    return identity, CallIdentity(identity.rollout_id, "c0", 1).to_xargs() | fields


async def _prepare(worker: Worker, extra: dict):
    params = _params(CallIdentity(extra["rr_rollout_id"], "c0", 1))
    return await worker.resumer._prepare({"prompt_token_ids": PROMPT}, params, extra)


def _verdict(worker: Worker, rollout: str) -> tuple[str, str | None]:
    [record] = [
        r
        for r in worker.capture.attempts.read(0).attempts
        if (r.rollout_id, r.attempt) == (rollout, 1)
    ]
    return record.resume, record.refused_reason


IDS, LPS = [31, 32, 33, 34, 35, 36], [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6]


async def test_a_valid_continuation_resumes_with_the_staged_prefix():
    worker = Worker()
    identity, extra = await _staged(worker, IDS, LPS, split=2)
    prefix = await _prepare(worker, extra)
    assert prefix is not None and prefix.done is None
    assert prefix.ids.tolist() == IDS
    assert prefix.logprobs.tolist() == pytest.approx(LPS)
    assert prefix.keys == [identity.chunk_key(0), identity.chunk_key(1)]
    assert _verdict(worker, identity.rollout_id) == ("resumed", None)


@pytest.mark.parametrize(
    ("eos_ids", "ignore_eos", "outcome"),
    [
        ({36}, False, ("stop", 36)),  # ends on it: answered as vLLM would, without decoding
        ({36}, True, None),  # a call that ignores EOS goes on past it
        ({33}, False, "prefix_past_stop"),  # holds it before its end: not from this call
    ],
)
async def test_a_generation_config_eos_ends_a_prefix_as_a_stop_token(eos_ids, ignore_eos, outcome):
    """Qwen3's generation config lists <|endoftext|> beside the tokenizer's <|im_end|>; vLLM
    stops a request on it as a stop token id, so a prefix ending on it has finished and one
    holding it earlier cannot have come from the call (tests/engine/test_finish_kinds.py runs
    the same on tiny://qwen3)."""
    worker = Worker()
    worker.resumer.generation_eos_ids = frozenset(eos_ids)
    identity, extra = await _staged(worker, IDS, LPS, split=2)
    params = _params(CallIdentity(identity.rollout_id, "c0", 1))
    params.ignore_eos = ignore_eos
    prefix = await worker.resumer._prepare({"prompt_token_ids": PROMPT}, params, extra)
    if outcome == "prefix_past_stop":
        assert prefix is None
        assert _verdict(worker, identity.rollout_id) == ("refused", outcome)
    else:
        assert prefix is not None and prefix.done == outcome


def _tampered_digest(worker: Worker, identity: CallIdentity, extra: dict) -> dict:
    return extra | {RESUME_DIGEST_ARG: "00" * 32}


def _tampered_token(worker: Worker, identity: CallIdentity, extra: dict) -> dict:
    row = worker.store.chunk(identity.chunk_key(1))
    row.token_ids = row.token_ids + np.int32(1)  # same length, other tokens
    worker.store.rows[(STAGING, row.key)] = chunk_rows_to_table([row])
    return extra


def _lost_chunk(worker: Worker, identity: CallIdentity, extra: dict) -> dict:
    del worker.store.rows[(STAGING, identity.chunk_key(0))]
    return extra


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        (_tampered_digest, "digest_mismatch"),
        (_tampered_token, "digest_mismatch"),
        (_lost_chunk, "missing_chunk"),
    ],
)
async def test_a_bad_continuation_is_refused_with_its_reason(fault, reason):
    worker = Worker()
    identity, extra = await _staged(worker, IDS, LPS, split=3)
    extra = fault(worker, identity, extra)
    before = WorkerMetrics().snapshot().get(f"resume.{reason}", 0)
    assert await _prepare(worker, extra) is None
    assert _verdict(worker, identity.rollout_id) == ("refused", reason)
    assert WorkerMetrics().snapshot()[f"resume.{reason}"] == before + 1


# ------------------------------------------------------------------ a kept engine's reset


async def test_a_rebind_drops_the_old_jobs_pending_writes_and_starts_the_fence_anew():
    """A worker kept for a restored job (GenerationWorker.reset): a terminal row still owed to
    the store that is gone must never reach the restored one, and an open call is recorded
    aborted while its attempt record stays."""
    worker = Worker()
    worker.capture.on_finished = worker.service.on_finished
    worker.service.fence.begin(5, 30.0)  # a checkpoint under way: terminal writes wait
    done = worker.start(FakeReader([1, 2], [-0.1, -0.2]))
    open_call = worker.start(FakeReader([3], [-0.3]))
    ends = Step(f"{done.rollout_id}-internal", 2, True, "length", None)
    worker.capture.stepped([ends, Step(f"{open_call.rollout_id}-internal", 1, False, None, None)])
    assert len(worker.service._background) == 1  # the finished call's row, waiting
    new = MemoryStore()
    await worker.service.rebind(new, None)
    assert worker.capture.clear() == 2
    assert not worker.service._background and worker.service.store is new
    assert (worker.service.fence.held, worker.service.fence.highest_epoch) == (False, 0)
    await asyncio.sleep(0.05)
    assert worker.store.rows == {} and new.rows == {}
    records = {r.rollout_id: r for r in worker.capture.attempts.read(0).attempts}
    assert records[open_call.rollout_id].finish_reason == "abort"
    assert records[done.rollout_id].finish_reason == "length"
    assert worker.capture.calls == {} and worker.capture.by_request == {}
