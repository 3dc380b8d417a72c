"""Every fail-closed reason of resume and cut, injected alone on the real session worker.

Resume: each case stages a valid continuation (`_stage`), changes exactly one thing, and checks
that the worker counted that refusal reason once (and no resume), that its engine decoded the
whole call from scratch (the call-attempt record), and that the caller got the uninterrupted
answer. Cut: each case cuts a call that must be refused and checks the receipt's reason, its
`cut_failure.<reason>` counter, that nothing was staged for the call, and that the call itself
still completes with the uninterrupted answer.

Covered elsewhere, not repeated: a tampered token (digest_mismatch), an absent key
(missing_chunk), a claimed length one too long (prefix_length_mismatch) and an attempt that
resumes itself (foreign_chunk) in test_resume.py::test_bad_continuations_fail_closed_and_
regenerate; prefix_without_logprobs and frequency_penalty in test_resume.py; prefix_past_stop in
test_finish_kinds.py; the names of the uncuttable cut reasons in test_capture_cut.py; a cut
deadline against a slow store on a dedicated worker in test_cut_deadline.py.

Two resume reasons cannot be reached over HTTP, so they go through the worker's own engine
(`engine.generate` in the worker process: the same wrapped chain the OpenAI server calls): a
malformed continuation that carries a call identity (the request gate answers 400 before the
engine sees one) and a prompt that is not token ids (every generation route of the server
renders prompts to token ids first). A store outage, and a slow or failing staging put, are
injected in the worker for one rollout's keys only (`_StoreFault`), so the session worker
keeps its real store for everything else; the outage is a real StagingStore whose shard actor
was killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import pytest
from transformers import AutoTokenizer

from rollout_recovery.data_plane import StagingStore
from rollout_recovery.data_plane.digest import chain_digests, finish_digest
from rollout_recovery.data_plane.schemas import (
    chunk_rows_to_table,
    table_to_chunk_rows,
    table_to_terminal_rows,
)
from tests.engine.evidence import assert_from_scratch, attempt_record
from tests.engine.test_resume import PROMPTS, _body, _chat, _same, _stage

pytestmark = pytest.mark.engine
_ids = itertools.count()
STAGING = "rollout_staging"
K, SPLIT, MAX = 10, 4, 48  # staged prefix, its first chunk, the call's max_tokens


def _metrics(worker) -> dict:
    return worker.capture_metrics()


def _bumped(before: dict, after: dict, name: str, n: int = 1) -> bool:
    return after.get(name, 0) == before.get(name, 0) + n


@pytest.fixture(scope="module")
def refs(capture_worker):
    """Uninterrupted answers, one per distinct request (greedy or seeded: *the* answer)."""
    url = capture_worker[0].info.url
    cache: dict[str, dict] = {}

    def ref(**kw) -> dict:
        kw = {"max_tokens": MAX, "ignore_eos": True} | kw
        key = repr(sorted(kw.items()))
        if key not in cache:
            cache[key] = _chat(url, f"fc-ref-{next(_ids)}", **kw)
        return cache[key]

    return ref


# ------------------------------------------------------------ one fault in a continuation


def _rows(store, cont: dict):
    table, missing = store.get(STAGING, cont["rr_resume_keys"])
    assert not missing
    return table_to_chunk_rows(table)


def _put(store, rows) -> None:
    store.put(STAGING, chunk_rows_to_table(rows))


@dataclass
class Case:
    cont: dict
    request: dict = field(default_factory=dict)  # the resumed request's own settings


Build = Callable[..., Case]


def _valid(store, rollout: str, ref) -> dict:
    return _stage(store, rollout, ref(), K, split=SPLIT)


def _edit_rows(edit: Callable[[list], None]) -> Build:
    """Re-stage the continuation's chunk rows after `edit` changed one field."""

    def build(store, rollout, ref) -> Case:
        cont = _valid(store, rollout, ref)
        rows = _rows(store, cont)
        edit(rows)
        _put(store, rows)
        return Case(cont)

    return build


def _edit_cont(edit: Callable[[dict], dict] = dict, **request) -> Build:
    """Change one continuation field, or (with `request`) one setting of the resumed call."""
    return lambda store, rollout, ref: Case(edit(_valid(store, rollout, ref)), request)


def _set(row: int, **attrs) -> Callable[[list], None]:
    def edit(rows) -> None:
        for name, value in attrs.items():
            setattr(rows[row], name, value)

    return edit


def _drop_last_logprob(rows) -> None:
    rows[0].logprobs = rows[0].logprobs[:-1]


def _shorter_prompt(rows) -> None:
    rows[0].prompt_token_ids = rows[0].prompt_token_ids[:-1]


def _decreasing_versions(rows) -> None:
    rows[0].weight_version, rows[1].weight_version = 2, 1
    rows[0].weight_versions = [(2, 0, rows[0].cum_len)]
    rows[1].weight_versions = [(1, rows[1].prev_len, rows[1].cum_len)]


def _versions_not_covering(rows) -> None:
    rows[1].weight_versions = [(1, rows[1].prev_len + 1, rows[1].cum_len)]


def _versions_not_its_newest(rows) -> None:
    rows[1].weight_version = rows[1].weight_versions[-1][0] + 1


def _keys(edit: Callable[[list], list]) -> Callable[[dict], dict]:
    return lambda cont: cont | {"rr_resume_keys": edit(cont["rr_resume_keys"])}


def _flipped_digest(cont: dict) -> dict:
    d = cont["rr_resume_digest"]
    return cont | {"rr_resume_digest": d[:-1] + ("1" if d[-1] == "0" else "0")}


def _deleted_chunk(store, rollout, ref) -> Case:
    cont = _valid(store, rollout, ref)
    store.delete(STAGING, cont["rr_resume_keys"][1:])  # a chunk lost after its receipt
    return Case(cont)


def _other_rollouts_chunks(store, rollout, ref) -> Case:
    return Case(_valid(store, f"{rollout}-other", ref))


def _other_prompt(store, rollout, ref) -> Case:
    return Case(_valid(store, rollout, ref), {"content": PROMPTS["accents"]})


def _sealed(reason: str, stop_json: str | None) -> Build:
    """The last chunk carries a finish record, correctly sealed into its digest (and the
    continuation names that digest): only the record itself is wrong."""

    def build(store, rollout, ref) -> Case:
        cont = _valid(store, rollout, ref)
        rows = _rows(store, cont)
        rows[-1].finish_reason, rows[-1].stop_reason_json = reason, stop_json
        rows[-1].digest = finish_digest(
            chain_digests([r.token_ids for r in rows])[-1], reason, stop_json
        )
        _put(store, rows)
        return Case(cont | {"rr_resume_digest": rows[-1].digest.hex()})

    return build


CASES: dict[str, tuple[str, Build]] = {
    "missing_chunk-deleted": ("missing_chunk", _deleted_chunk),
    "chunk_order-swapped_keys": ("chunk_order", _edit_cont(_keys(lambda k: k[::-1]))),
    "chunk_order-repeated_key": ("chunk_order", _edit_cont(_keys(lambda k: [k[0], k[0]]))),
    "chunk_order-wrong_seq": ("chunk_order", _edit_rows(_set(1, chunk_seq=2))),
    "chunk_order-finish_before_last": ("chunk_order", _edit_rows(_set(0, finish_reason="stop"))),
    "chunk_counts-gap": ("chunk_counts", _edit_rows(_set(1, prev_len=SPLIT + 1))),
    "chunk_counts-logprobs": ("chunk_counts", _edit_rows(_drop_last_logprob)),
    "digest_mismatch-continuation": ("digest_mismatch", _edit_cont(_flipped_digest)),
    "foreign_chunk-other_rollout": ("foreign_chunk", _other_rollouts_chunks),
    "weight_version_order": ("weight_version_order", _edit_rows(_decreasing_versions)),
    "weight_version_spans-gap": ("weight_version_spans", _edit_rows(_versions_not_covering)),
    "weight_version_spans-newest": ("weight_version_spans", _edit_rows(_versions_not_its_newest)),
    "prefix_length_mismatch-short": (
        "prefix_length_mismatch",
        _edit_cont(lambda c: c | {"rr_resume_tokens": K - 1}),
    ),
    "prompt_mismatch-staged_prompt": ("prompt_mismatch", _edit_rows(_shorter_prompt)),
    "prompt_mismatch-no_staged_prompt": (
        "prompt_mismatch",
        _edit_rows(_set(0, prompt_token_ids=None)),
    ),
    "prompt_mismatch-other_request": ("prompt_mismatch", _other_prompt),
    "finish_record-unknown_reason": ("finish_record", _sealed("abort", None)),
    "finish_record-unreadable_stop": ("finish_record", _sealed("stop", "{not json")),
    "uncuttable-presence_penalty": ("uncuttable", _edit_cont(presence_penalty=0.5)),
    "uncuttable-top_logprobs": ("uncuttable", _edit_cont(top_logprobs=2)),
    "prefix_exceeds_limit": ("prefix_exceeds_limit", _edit_cont(max_tokens=K - 2)),
    "limit_mismatch": ("limit_mismatch", _edit_cont(lambda c: c | {"rr_resume_limit": MAX - 8})),
}


def _check_refused(worker, before: dict, rollout: str, reason: str, length: int) -> None:
    after = _metrics(worker)
    assert _bumped(before, after, f"resume.{reason}"), (reason, before, after)
    assert _bumped(before, after, "resume.resumed", 0)
    assert_from_scratch(worker, rollout, 1, reason, length)


@pytest.mark.parametrize("case", list(CASES))
def test_one_fault_in_a_continuation_fails_closed(capture_worker, refs, case):
    worker, store = capture_worker
    reason, build = CASES[case]
    rollout = f"fc-{case}-{next(_ids)}"
    injected = build(store, rollout, refs)
    kw = {"max_tokens": MAX, "ignore_eos": True} | injected.request
    expected = refs(**kw)
    before = _metrics(worker)
    out = _chat(worker.info.url, rollout, attempt=1, xargs=injected.cont, **kw)
    _check_refused(worker, before, rollout, reason, len(expected["choices"][0]["token_ids"]))
    _same(out, expected)


def test_a_continuation_without_a_call_identity_is_malformed(capture_worker, refs):
    """Over HTTP: the gate passes well-typed continuation fields without an identity; the
    worker refuses them. No identity means no capture and no attempt record: the evidence is
    the counter, no resume counted, no tail decoded as one."""
    worker, store = capture_worker
    url = worker.info.url
    rollout = f"fc-noid-{next(_ids)}"
    body = _body(rollout, 1, ignore_eos=True) | {"vllm_xargs": _valid(store, rollout, refs)}
    before = _metrics(worker)
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    after = _metrics(worker)
    assert _bumped(before, after, "resume.malformed_continuation")
    assert _bumped(before, after, "resume.resumed", 0)
    assert _bumped(before, after, "resume.decoded_tokens", 0)
    page = worker.call_attempts(0)
    assert not [r for r in page["attempts"] if r["rollout_id"] == rollout]
    _same(resp.json(), refs())


# ------------------------------------------------------------ inside the worker process


def _in_worker(worker, fn, *args, timeout_s: float = 120):
    """Run coroutine function `fn(worker_instance, *args)` on the worker's event loop."""

    def run(self, *a):
        loop = self._host.loop  # the actor's event loop, where engine and server run
        return asyncio.run_coroutine_threadsafe(fn(self, *a), loop).result(timeout_s)

    return worker.run_inside(run, *args)


async def _engine_generate(self, prompt, xargs: dict, request_id: str) -> dict:
    """One call through the worker's wrapped `engine.generate`, as the OpenAI server makes
    it for a greedy chat request with sampled logprobs."""
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=MAX, temperature=0.0, ignore_eos=True, logprobs=0, extra_args=dict(xargs)
    )
    final = None
    async for out in self._engine.generate(prompt, params, request_id):
        final = out
    comp = final.outputs[0]
    lp = comp.logprobs
    if hasattr(lp, "start_indices"):  # FlatLogprobs: the sampled entry first per position
        lps = [lp.logprobs[s] for s in lp.start_indices]
    else:
        lps = [next(iter(p.values())).logprob for p in lp]
    return {
        "prompt_token_ids": list(final.prompt_token_ids),
        "token_ids": list(comp.token_ids),
        "text": comp.text,
        "logprobs": lps,
        "finish_reason": comp.finish_reason,
    }


def _same_as_chat(out: dict, reference: dict) -> None:
    choice = reference["choices"][0]
    assert out["prompt_token_ids"] == reference["prompt_token_ids"]
    assert out["token_ids"] == choice["token_ids"]
    assert out["text"] == choice["message"]["content"]
    assert out["logprobs"] == [c["logprob"] for c in choice["logprobs"]["content"]]
    assert out["finish_reason"] == choice["finish_reason"]


def _identity(rollout: str, attempt: int = 1) -> dict:
    return {"rr_rollout_id": rollout, "rr_model_call_id": "c0", "rr_attempt": attempt}


MALFORMED = {
    "tokens_as_text": lambda c: c | {"rr_resume_tokens": str(c["rr_resume_tokens"])},
    "tokens_as_boolean": lambda c: c | {"rr_resume_tokens": True},
    "no_keys": lambda c: c | {"rr_resume_keys": []},
    "no_digest": lambda c: {k: v for k, v in c.items() if k != "rr_resume_digest"},
    "limit_as_text": lambda c: c | {"rr_resume_limit": str(MAX)},
    "key_not_a_chunk_key": lambda c: c | {"rr_resume_keys": ["no such key"]},
}


@pytest.mark.parametrize("fault", list(MALFORMED))
def test_a_malformed_continuation_with_an_identity_fails_closed(capture_worker, refs, fault):
    worker, store = capture_worker
    rollout = f"fc-malformed-{fault}-{next(_ids)}"
    ref = refs()
    xargs = _identity(rollout) | MALFORMED[fault](_valid(store, rollout, refs))
    before = _metrics(worker)
    prompt = {"prompt_token_ids": ref["prompt_token_ids"]}
    out = _in_worker(worker, _engine_generate, prompt, xargs, rollout)
    _check_refused(worker, before, rollout, "malformed_continuation", MAX)
    _same_as_chat(out, ref)


@pytest.mark.parametrize("form", ["text", "text_prompt"])
def test_a_text_prompt_is_an_unsupported_prompt(capture_worker, refs, tiny_model_dir, form):
    """The engine tokenizes a text prompt itself; only token prompts are resumed. The text
    is the chat-rendered prompt, so the call is the reference call."""
    worker, store = capture_worker
    rollout = f"fc-text-{form}-{next(_ids)}"
    ref = refs()
    text = AutoTokenizer.from_pretrained(tiny_model_dir).decode(ref["prompt_token_ids"])
    prompt = text if form == "text" else {"prompt": text}
    xargs = _identity(rollout) | _valid(store, rollout, refs)
    before = _metrics(worker)
    out = _in_worker(worker, _engine_generate, prompt, xargs, rollout)
    _check_refused(worker, before, rollout, "unsupported_prompt", MAX)
    _same_as_chat(out, ref)


class _StoreFault:
    """The worker's own store, except for one rollout's keys: with `dead`, its reads
    (`reads`) or chunk puts (`puts`) go to that store instead; with `put_delay_s`, its chunk
    puts are late. Installed in the worker by `_store_fault` (cut service and resumer)."""

    def __init__(
        self, rollout: str, dead=None, reads=False, puts=False, put_delay_s=0.0, read_delay_s=0.0
    ):
        self.prefix, self.dead = f"{rollout}/", dead
        self.reads, self.puts, self.put_delay_s = reads, puts, put_delay_s
        self.read_delay_s = read_delay_s
        self.live = self.saved_timeout_s = self.saved_fetch_timeout_s = None  # set in the worker

    def _ours(self, keys) -> bool:
        return any(k.startswith(self.prefix) for k in keys)

    async def aget(self, partition, keys):
        if self._ours(keys):
            await asyncio.sleep(self.read_delay_s)  # a store that hangs
        store = self.dead if self.reads and self._ours(keys) else self.live
        return await store.aget(partition, keys)

    async def aput(self, partition, table):
        if partition == STAGING and self._ours(table.column("key").to_pylist()):
            await asyncio.sleep(self.put_delay_s)
            if self.puts:
                return await self.dead.aput(partition, table)
        return await self.live.aput(partition, table)

    async def adelete(self, partition, keys):
        return await self.live.adelete(partition, keys)


def _install(
    self, fault: _StoreFault, cut_timeout_s: float | None, fetch_timeout_s: float | None
) -> None:
    service = self._service
    resumer = service.capture.on_added.__self__  # the Resumer (its add-request hook)
    assert resumer.store is service.store, "the worker's store is already replaced"
    fault.live, fault.saved_timeout_s = service.store, service.timeout_s
    fault.saved_fetch_timeout_s = resumer.fetch_timeout_s
    service.store = resumer.store = fault
    if fetch_timeout_s is not None:
        resumer.fetch_timeout_s = fetch_timeout_s
    if cut_timeout_s is not None:
        service.timeout_s = cut_timeout_s


def _uninstall(self) -> None:
    service = self._service
    fault = service.store
    resumer = service.capture.on_added.__self__
    service.store = resumer.store = fault.live
    service.timeout_s = fault.saved_timeout_s
    resumer.fetch_timeout_s = fault.saved_fetch_timeout_s


@contextlib.contextmanager
def _store_fault(
    worker, fault: _StoreFault, cut_timeout_s: float | None = None, fetch_timeout_s=None
):
    worker.run_inside(_install, fault, cut_timeout_s, fetch_timeout_s)
    try:
        yield
    finally:
        worker.run_inside(_uninstall)


@pytest.fixture(scope="module")
def dead_store(ray_session):
    """A real StagingStore whose shard actor is gone: every call to it raises."""
    store = StagingStore.create(num_shards=1)
    store.shutdown()
    return store


def test_an_unavailable_store_fails_closed(capture_worker, refs, dead_store):
    worker, store = capture_worker
    rollout = f"fc-outage-{next(_ids)}"
    cont = _valid(store, rollout, refs)
    before = _metrics(worker)
    with _store_fault(worker, _StoreFault(rollout, dead_store, reads=True)):
        out = _chat(worker.info.url, rollout, attempt=1, xargs=cont, ignore_eos=True)
    _check_refused(worker, before, rollout, "store_unavailable", MAX)
    _same(out, refs())
    assert not store.get(STAGING, cont["rr_resume_keys"])[1]  # only the read failed


def test_a_hung_store_times_out_and_fails_closed(capture_worker, refs):
    """A store that neither answers nor fails: the fetch gives up after its timeout
    (`token_capture.control_timeout_s` in a worker) and the call is decoded from scratch."""
    worker, store = capture_worker
    rollout = f"fc-hung-{next(_ids)}"
    cont = _valid(store, rollout, refs)
    before = _metrics(worker)
    t0 = time.monotonic()
    with _store_fault(worker, _StoreFault(rollout, read_delay_s=30), fetch_timeout_s=0.5):
        out = _chat(worker.info.url, rollout, attempt=1, xargs=cont, ignore_eos=True)
    assert time.monotonic() - t0 < 15
    _check_refused(worker, before, rollout, "store_unavailable", MAX)
    _same(out, refs())


# ------------------------------------------------------------ cut refusals

CUT_TOKENS = 240  # about a second of decoding: the call is still running when it is cut


def _inventory(*calls: tuple[str, str, int]) -> dict:
    return {
        "checkpoint_id": f"fc-cut-{next(_ids)}",
        "calls": [{"rollout_id": r, "model_call_id": c, "attempt": a} for r, c, a in calls],
    }


async def _decoding(worker, rollout: str, tokens: int = 1) -> dict:
    """Wait until the engine has sampled `tokens` for the call (0: until it is registered);
    it must still be running."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        page = await worker.acall_attempts(0)
        found = [r for r in page["attempts"] if (r["rollout_id"], r["attempt"]) == (rollout, 0)]
        if found and found[0]["requests"] and found[0]["decoded_tokens"] >= tokens:
            assert not found[0]["finished"], found[0]
            return found[0]
        await asyncio.sleep(0.01)
    raise AssertionError(f"{rollout} never decoded {tokens} tokens")


def _post(client: httpx.AsyncClient, worker, body: dict) -> asyncio.Task:
    return asyncio.create_task(
        client.post(f"{worker.info.url}/v1/chat/completions", json=body, timeout=300)
    )


async def _answer(task: asyncio.Task) -> dict:
    resp = await task
    assert resp.status_code == 200, resp.text
    return resp.json()


def _uninterrupted(out: dict, reference: dict) -> None:
    """Every choice (ids, text, logprobs, finish) and the usage are the reference's."""
    assert out["choices"] == reference["choices"]
    assert out["usage"] == reference["usage"]
    assert out["prompt_token_ids"] == reference["prompt_token_ids"]


def _refused(receipt: dict, reason: str) -> list[dict]:
    calls = receipt["calls"]
    assert all(c["disposition"] == "durable_failure" for c in calls), calls
    assert all(c["reason"] == reason and not c["staging_keys"] for c in calls), calls
    assert receipt["staged_rows"] == 0
    return calls


UNCUTTABLE = {
    "presence_penalty": {"presence_penalty": 0.5},
    "frequency_penalty": {"frequency_penalty": 0.5, "repetition_penalty": 1.2},
    "per_request_seed": {"seed": 7, "temperature": 1.0},
    "structured_output": {"response_format": {"type": "json_object"}},
    "multi_token_bad_words": {"bad_words": ["result answered"]},
    "unknown_logits_processor": {"xargs": {"my_proc": 1}},
    # n > 1 needs sampling; top_k=1 makes that sampling reproducible.
    "n_greater_than_1": {"n": 2, "temperature": 1.0, "top_k": 1},
    "top_logprobs": {"top_logprobs": 3},
    "output_state_counters": {"repetition_detection": {"max_pattern_size": 4, "min_count": 999}},
}


@pytest.mark.parametrize("reason", list(UNCUTTABLE))
def test_an_uncuttable_call_is_refused_and_completes(capture_worker, refs, reason):
    worker, store = capture_worker
    rollout = f"fc-uncut-{reason}-{next(_ids)}"
    settings = {"max_tokens": CUT_TOKENS, "ignore_eos": True} | UNCUTTABLE[reason]
    expected = refs(**settings)
    kw = dict(settings)
    body = _body(rollout, 0, kw.pop("xargs", None), **kw)
    before = _metrics(worker)

    async def scenario():
        async with httpx.AsyncClient() as client:
            task = _post(client, worker, body)
            await _decoding(worker, rollout)
            receipt = await worker.acut(_inventory((rollout, "c0", 0)))
            staged = store.list(STAGING, f"{rollout}/")
            return receipt, staged, await _answer(task)

    receipt, staged, out = asyncio.run(scenario())
    _refused(receipt, reason)
    assert staged == []
    assert _bumped(before, _metrics(worker), f"cut_failure.{reason}")
    _uninterrupted(out, expected)


def test_a_cut_naming_another_attempt_or_call_is_unknown_call(capture_worker, refs):
    worker, store = capture_worker
    rollout = f"fc-unknown-{next(_ids)}"
    before = _metrics(worker)

    async def scenario():
        async with httpx.AsyncClient() as client:
            task = _post(client, worker, _body(rollout, 0, max_tokens=CUT_TOKENS, ignore_eos=True))
            await _decoding(worker, rollout)
            # The running call is (rollout, c0, attempt 0); these name its neighbours.
            inv = _inventory((rollout, "c0", 1), (rollout, "c1", 0))
            receipt = await worker.acut(inv)
            staged = store.list(STAGING, f"{rollout}/")
            return receipt, staged, await _answer(task)

    receipt, staged, out = asyncio.run(scenario())
    assert len(_refused(receipt, "unknown_call")) == 2
    assert staged == []
    assert _bumped(before, _metrics(worker), "cut_failure.unknown_call", 2)
    _uninterrupted(out, refs(max_tokens=CUT_TOKENS))


def test_a_finished_call_is_already_terminal(capture_worker, refs):
    worker, store = capture_worker
    rollout = f"fc-done-{next(_ids)}"
    out = _chat(worker.info.url, rollout, ignore_eos=True)
    worker.drain()  # its terminal row is staged, its capture forgotten
    key = [f"{rollout}/c0/a0/terminal"]
    before = _metrics(worker)
    receipt = worker.cut(_inventory((rollout, "c0", 0)))
    _refused(receipt, "already_terminal")
    assert _bumped(before, _metrics(worker), "cut_failure.already_terminal")
    assert store.list(STAGING, f"{rollout}/") == []
    table, missing = store.get("rollout_terminal", key)
    assert not missing
    [row] = table_to_terminal_rows(table)
    assert row.token_ids.tolist() == out["choices"][0]["token_ids"]  # untouched by the cut
    _uninterrupted(out, refs())


async def _pause(self) -> None:
    await self._engine.pause_generation(mode="keep", clear_cache=False)


async def _unpause(self) -> None:
    await self._engine.resume_generation()


def test_a_call_without_a_sampled_token_is_zero_generated_tokens(capture_worker, refs):
    """The engine is paused (as for a weight update) with the call admitted but not
    scheduled: the cut finds it registered with no token yet."""
    worker, store = capture_worker
    rollout = f"fc-zero-{next(_ids)}"
    before = _metrics(worker)

    async def scenario():
        async with httpx.AsyncClient() as client:
            _in_worker(worker, _pause)
            try:
                task = _post(client, worker, _body(rollout, 0, ignore_eos=True))
                rec = await _decoding(worker, rollout, tokens=0)
                receipt = await worker.acut(_inventory((rollout, "c0", 0)))
                staged = store.list(STAGING, f"{rollout}/")
            finally:
                _in_worker(worker, _unpause)
            return rec, receipt, staged, await _answer(task)

    rec, receipt, staged, out = asyncio.run(scenario())
    assert rec["decoded_tokens"] == 0
    _refused(receipt, "zero_generated_tokens")
    assert staged == []
    assert _bumped(before, _metrics(worker), "cut_failure.zero_generated_tokens")
    _uninterrupted(out, refs())
    assert attempt_record(worker, rollout, 0)["decoded_tokens"] == MAX


def test_a_failed_staging_put_is_a_staging_error(capture_worker, refs, dead_store):
    """The chunk put goes to a store that is gone: the call is refused, nothing of it is
    staged, and the next cut (store back) stages its prefix from chunk 0."""
    worker, store = capture_worker
    rollout = f"fc-puterr-{next(_ids)}"
    before = _metrics(worker)

    async def scenario():
        async with httpx.AsyncClient() as client:
            task = _post(client, worker, _body(rollout, 0, max_tokens=CUT_TOKENS, ignore_eos=True))
            await _decoding(worker, rollout)
            with _store_fault(worker, _StoreFault(rollout, dead_store, puts=True)):
                failed = await worker.acut(_inventory((rollout, "c0", 0)))
            staged = store.list(STAGING, f"{rollout}/")
            again = await worker.acut(_inventory((rollout, "c0", 0)))
            return failed, staged, again, await _answer(task)

    failed, staged, again, out = asyncio.run(scenario())
    [call] = failed["calls"]
    assert call["disposition"] == "durable_failure" and not call["staging_keys"], call
    assert call["reason"].startswith("staging_error: "), call
    assert failed["staged_rows"] == 0
    assert staged == []
    assert _bumped(before, _metrics(worker), f"cut_failure.{call['reason']}")
    [later] = again["calls"]
    assert later["disposition"] == "durable_prefix"
    assert later["staging_keys"] == [f"{rollout}/c0/a0/c000000"]
    _uninterrupted(out, refs(max_tokens=CUT_TOKENS))


def test_a_late_put_is_control_deadline_then_cleanup_pending(capture_worker, refs):
    """A chunk put outlives the cut's deadline (control_deadline); a cut while its cleanup
    still waits for that put is refused (cleanup_pending); the late rows are then removed and
    the call completes as if never cut."""
    worker, store = capture_worker
    rollout = f"fc-late-{next(_ids)}"
    delay_s, tokens = 1.5, 600
    before = _metrics(worker)

    async def scenario():
        async with httpx.AsyncClient() as client:
            task = _post(client, worker, _body(rollout, 0, max_tokens=tokens, ignore_eos=True))
            await _decoding(worker, rollout)
            fault = _StoreFault(rollout, put_delay_s=delay_s)
            with _store_fault(worker, fault, cut_timeout_s=0.3):
                t0 = time.monotonic()
                late = await worker.acut(_inventory((rollout, "c0", 0)))
                pending = await worker.acut(_inventory((rollout, "c0", 0)))
                assert time.monotonic() - t0 < delay_s  # both refused before the put landed
            out = await _answer(task)
            await asyncio.sleep(max(0.0, t0 + delay_s + 0.5 - time.monotonic()))
            await worker.adrain()
            return late, pending, store.list(STAGING, f"{rollout}/"), out

    late, pending, staged, out = asyncio.run(scenario())
    _refused(late, "control_deadline")
    _refused(pending, "cleanup_pending")
    assert staged == []  # the late put's rows were deleted
    after = _metrics(worker)
    assert _bumped(before, after, "cut_failure.control_deadline")
    assert _bumped(before, after, "cut_failure.cleanup_pending")
    _uninterrupted(out, refs(max_tokens=tokens))


# ------------------------------------------------------------ the request gate


def _route_body(route: str, rollout: str, **xargs) -> dict:
    if route == "/v1/responses":
        body = {"input": PROMPTS["ascii"], "max_output_tokens": 4}
    else:
        body = {"messages": [{"role": "user", "content": PROMPTS["ascii"]}], "max_tokens": 4}
    identity = {"rr_rollout_id": rollout, "rr_model_call_id": "c0"}
    return body | {"model": "policy", "temperature": 0.0, "vllm_xargs": identity | xargs}


@pytest.mark.parametrize("route", ["/v1/responses", "/v1/messages"])
def test_every_generation_route_is_gated(capture_worker, route):
    """vLLM's request models turn `"rr_attempt": true` into attempt 1 on every route that
    takes `vllm_xargs`: the gate refuses it there too, not only on chat and completions (and
    a required prefix, which those routes would drop silently)."""
    worker, _ = capture_worker
    url = f"{worker.info.url}{route}"
    rollout = f"fc-route-{next(_ids)}"
    resp = httpx.post(url, json=_route_body(route, rollout, rr_attempt=True), timeout=60)
    assert resp.status_code == 400 and "rr_attempt" in resp.text, resp.text
    page = worker.call_attempts(0)
    assert not [r for r in page["attempts"] if r["rollout_id"] == rollout]
    body = _route_body(route, rollout) | {"required_prefix_token_ids": [1, 2]}
    resp = httpx.post(url, json=body, timeout=60)
    assert resp.status_code == 400 and f"refused on {route}" in resp.text, resp.text
    # Well-formed, the same requests are served.
    assert httpx.post(url, json=_route_body(route, rollout), timeout=60).status_code == 200
