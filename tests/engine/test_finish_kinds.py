"""A call cut at (or around) the point where it finishes resumes to exactly the uninterrupted
answer, for every finish kind: stop string (one and several characters), stop token, EOS and
length. Cuts are placed one token before the finish, exactly at it, and one token past it, and
a real terminal-completion cut (taken after the call finished, under a fence) is resumed too.
What the engine did is counted, not inferred from the answer: tokens it decoded for the resumed
call, answers given without decoding, refusals by reason. Each case runs on both tiny models
(tests/engine/two_models.py); on qwen3 also for its second end-of-sequence id, <|endoftext|>.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable

import httpx
import numpy as np
import pytest

from rollout_recovery.data_plane.digest import chain_digests
from rollout_recovery.data_plane.schemas import ChunkRow, chunk_rows_to_table
from tests.engine.test_resume import _body, _chat
from tests.engine.two_models import MODELS, ModelWorker

pytestmark = pytest.mark.engine
_ids = itertools.count()


def _stage(store, rollout: str, out: dict, ids: list[int], lps: list[float]) -> dict:
    """Stage `ids` as one attempt-0 chunk of `rollout` (a cut without a finish record)."""
    row = ChunkRow(
        key=f"{rollout}/c0/a0/c000000", rollout_id=rollout, model_call_id="c0", attempt=0,
        chunk_seq=0, token_ids=np.array(ids, np.int32), logprobs=np.array(lps, np.float32),
        weight_version=0, prev_len=0, digest=chain_digests([ids])[0],
        prompt_token_ids=np.array(out["prompt_token_ids"], np.int32),
    )  # fmt: skip
    store.put("rollout_staging", chunk_rows_to_table([row]))
    return {"rr_resume_keys": [row.key], "rr_resume_tokens": len(ids),
            "rr_resume_digest": row.digest.hex()}  # fmt: skip


def _lps(out: dict) -> list[float]:
    return [c["logprob"] for c in out["choices"][0]["logprobs"]["content"]]


def _same(resumed: dict, reference: dict) -> None:
    a, b = resumed["choices"][0], reference["choices"][0]
    assert a["token_ids"] == b["token_ids"]
    assert a["message"]["content"] == b["message"]["content"]
    assert (a["finish_reason"], a.get("stop_reason")) == (b["finish_reason"], b.get("stop_reason"))
    assert resumed["usage"] == reference["usage"]
    assert _lps(resumed) == _lps(reference)


def _metrics(worker) -> dict:
    return worker.capture_metrics()


def _next_epoch(worker) -> int:
    return worker.fence_state()["highest_epoch"] + 1


def _delta(before: dict, after: dict, name: str) -> float:
    return after.get(name, 0) - before.get(name, 0)


def _references(mw: ModelWorker) -> dict[str, tuple]:
    """One reference per finish kind of the model: (vllm_xargs, other request fields, the
    stopped answer, the same call run on past its stop condition)."""
    url, tok = mw.url, mw.tokenizer
    # Seeded temperature-1 sampling: greedy answers of these random models soon repeat one
    # token, which leaves no new text to place a stop string on.
    seeded = {"rr_seed": 11, "rr_temperature": 1.0}
    free = _chat(url, f"free-{next(_ids)}", xargs=seeded, ignore_eos=True)
    ids = free["choices"][0]["token_ids"]
    text = [tok.decode(ids[:i]) for i in range(len(ids) + 1)]
    j = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])  # first occurrence
    stop_id = {"vllm_xargs": seeded, "stop_token_ids": [ids[j]], "ignore_eos": True}
    out = {"stop_token": (stop_id, free)}
    for name, width in (("stop_string_1", 1), ("stop_string_3", 3)):
        for i in range(3, len(ids)):  # a stop string ending with token i's text
            here, before = text[i + 1], text[i]
            stop = here[-width:]
            if not (
                len(here) > len(before)
                and here.startswith(before)
                and stop.strip()
                and "\ufffd" not in stop
                and here.find(stop) == len(here) - width
            ):
                continue  # fmt: skip
            trial = _chat(url, f"try-{next(_ids)}", xargs=seeded, stop=[stop], ignore_eos=True)
            if len(trial["choices"][0]["token_ids"]) == i + 1:  # it stops right there
                out[name] = ({"vllm_xargs": seeded, "stop": [stop], "ignore_eos": True}, free)
                break
    out["length"] = ({"vllm_xargs": seeded, "max_tokens": 12, "ignore_eos": True}, free)
    # A seeded temperature-1 call that ends on each end-of-sequence id. Random weights spread
    # qwen3's draws over 151,936 rows, so an EOS is made likely (about e^-3 of the draws).
    bias = math.log(len(tok)) - 3
    for name, eos in zip(("eos", "second_eos"), mw.eos_token_ids, strict=False):
        fields = {"max_tokens": 64, "logit_bias": {str(eos): bias}}
        for seed in range(200):
            xargs = {"rr_seed": seed, "rr_temperature": 1.0}
            ref = _chat(url, f"eos-{next(_ids)}", xargs=xargs, **fields)["choices"][0]
            if (
                ref["finish_reason"] == "stop"
                and ref["token_ids"][-1] == eos
                and len(ref["token_ids"]) > 1
            ):
                past = _chat(url, f"eosp-{next(_ids)}", xargs=xargs, ignore_eos=True, **fields)
                out[name] = ({"vllm_xargs": xargs, **fields}, past)
                break
    assert set(out) == set(KINDS_OF[mw.name]), out
    refs = {}
    for name, (fields, past) in out.items():
        xargs = fields.get("vllm_xargs")
        rest = {k: v for k, v in fields.items() if k != "vllm_xargs"}
        ref = _chat(url, f"ref-{name}-{next(_ids)}", xargs=xargs, **rest)
        assert ref["choices"][0]["finish_reason"] == ("length" if name == "length" else "stop")
        refs[name] = (xargs, rest, ref, past)
    return refs


@pytest.fixture(scope="module")
def references_of() -> Callable[[ModelWorker], dict[str, tuple]]:
    """A model's references (`_references`), built by its first test in this module."""
    built: dict[str, dict[str, tuple]] = {}

    def get(mw: ModelWorker) -> dict[str, tuple]:
        if mw.name not in built:
            built[mw.name] = _references(mw)
        return built[mw.name]

    return get


KINDS = ("stop_string_1", "stop_string_3", "stop_token", "eos", "length")
# qwen3's generation_config.json lists a second end-of-sequence id, <|endoftext|>, which vLLM
# adds to the stop token ids of every request that does not ignore EOS (stop_reason: the id).
KINDS_OF = {"tiny": KINDS, "qwen3": (*KINDS, "second_eos")}
CASES = [pytest.param(m, k, id=f"{m}-{k}") for m in MODELS for k in KINDS_OF[m]]


@pytest.mark.parametrize(("model", "kind"), CASES)
def test_cut_one_token_before_the_finish_decodes_one_token(worker_of, references_of, model, kind):
    mw = worker_of(model)
    worker, store = mw.worker, mw.store
    xargs, rest, ref, _ = references_of(mw)[kind]
    ids, lps = ref["choices"][0]["token_ids"], _lps(ref)
    rollout = f"before-{kind}-{next(_ids)}"
    cont = _stage(store, rollout, ref, ids[:-1], lps[:-1])
    before = _metrics(worker)
    out = _chat(worker.info.url, rollout, 1, (xargs or {}) | cont, **rest)
    after = _metrics(worker)
    _same(out, ref)
    assert _delta(before, after, "resume.resumed") == 1
    assert _delta(before, after, "resume.decoded_tokens") == 1
    assert _delta(before, after, "resume.finished_without_decoding") == 0


@pytest.mark.parametrize(("model", "kind"), CASES)
def test_cut_exactly_at_the_finish_is_answered_without_decoding(
    worker_of, references_of, model, kind
):
    mw = worker_of(model)
    worker, store = mw.worker, mw.store
    xargs, rest, ref, _ = references_of(mw)[kind]
    rollout = f"exact-{kind}-{next(_ids)}"
    cont = _stage(store, rollout, ref, ref["choices"][0]["token_ids"], _lps(ref))
    before = _metrics(worker)
    out = _chat(worker.info.url, rollout, 1, (xargs or {}) | cont, **rest)
    after = _metrics(worker)
    _same(out, ref)
    assert _delta(before, after, "resume.finished_without_decoding") == 1
    assert _delta(before, after, "resume.decoded_tokens") == 0
    # No captured call owns the earlier attempt's rows: the worker retires them itself.
    worker.drain()
    assert store.list("rollout_staging", f"{rollout}/") == []


@pytest.mark.parametrize(("model", "kind"), CASES)
def test_a_prefix_one_token_past_the_finish_is_refused(worker_of, references_of, model, kind):
    """Such a prefix cannot have come from this call: resuming it would train on tokens the
    uninterrupted call never produced. It is refused and the call is decoded from scratch."""
    mw = worker_of(model)
    worker, store = mw.worker, mw.store
    xargs, rest, ref, past = references_of(mw)[kind]
    n = len(ref["choices"][0]["token_ids"])
    assert past["choices"][0]["token_ids"][:n] == ref["choices"][0]["token_ids"]
    rollout = f"past-{kind}-{next(_ids)}"
    past_ids = past["choices"][0]["token_ids"]
    cont = _stage(store, rollout, ref, past_ids[: n + 1], _lps(past)[: n + 1])
    before = _metrics(worker)
    out = _chat(worker.info.url, rollout, 1, (xargs or {}) | cont, **rest)
    after = _metrics(worker)
    _same(out, ref)
    reason = "prefix_exceeds_limit" if kind == "length" else "prefix_past_stop"
    assert _delta(before, after, f"resume.{reason}") == 1
    assert _delta(before, after, "resume.resumed") == 0


@pytest.mark.parametrize(("model", "kind"), CASES)
def test_a_terminal_completion_cut_resumes_from_its_finish_record(
    worker_of, references_of, model, kind
):
    """Cut after the call finished (its terminal row held back by a fence, as during a
    checkpoint): the receipt is a terminal completion of the whole answer, and a resume from
    it returns that answer without decoding. Afterwards no chunk row of the call is left."""
    mw = worker_of(model)
    worker, store = mw.worker, mw.store
    xargs, rest, ref, _ = references_of(mw)[kind]
    rollout = f"term-{kind}-{next(_ids)}"
    url = worker.info.url
    epoch = _next_epoch(worker)
    worker.begin_fence(epoch, 120)
    try:
        first = _chat(url, rollout, 0, xargs, **rest)
        _same(first, ref)
        inv = {"checkpoint_id": f"t-{rollout}", "calls": [{"rollout_id": rollout,
                                                            "model_call_id": "c0"}]}  # fmt: skip
        [receipt] = worker.cut(inv)["calls"]
        n = len(ref["choices"][0]["token_ids"])
        assert receipt["cut_kind"] == "terminal_completion"
        assert receipt["prefix_token_count"] == n
        assert receipt["finish_reason"] == ref["choices"][0]["finish_reason"]
        cont = {"rr_resume_keys": receipt["staging_keys"],
                "rr_resume_tokens": receipt["prefix_token_count"],
                "rr_resume_digest": receipt["prefix_digest"]}  # fmt: skip
        before = _metrics(worker)
        out = _chat(url, rollout, 1, (xargs or {}) | cont, **rest)
        after = _metrics(worker)
        _same(out, ref)
        assert _delta(before, after, "resume.finished_without_decoding") == 1
        assert _delta(before, after, "resume.decoded_tokens") == 0
    finally:
        worker.end_fence(epoch)
    worker.drain()
    assert store.list("rollout_staging", f"{rollout}/") == []


def test_labels_and_counts_describe_the_same_moment(capture_worker):
    """Cut every 50 ms while calls finish: a terminal_completion receipt always holds the
    whole answer, an active_prefix receipt always less than it (the label and the count are
    read together)."""
    worker, _ = capture_worker
    url = worker.info.url
    rollouts = [f"race-{next(_ids)}" for _ in range(24)]
    epoch = _next_epoch(worker)

    async def scenario():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(limits=limits, timeout=300) as client:
            tasks = [
                asyncio.create_task(client.post(f"{url}/v1/chat/completions",
                                                json=_body(r, max_tokens=8 + 3 * i,
                                                           ignore_eos=True)))
                for i, r in enumerate(rollouts)
            ]  # fmt: skip
            receipts = []
            await worker.abegin_fence(epoch, 120)  # keep chunks of finished calls
            for k in itertools.count():
                inv = {
                    "checkpoint_id": f"race-{epoch}-{k}",
                    "calls": [{"rollout_id": r, "model_call_id": "c0"} for r in rollouts],
                }
                receipts.append(await worker.acut(inv))  # fmt: skip
                if all(t.done() for t in tasks):
                    break
                await asyncio.sleep(0.05)
            outs = [(await t).json() for t in tasks]
            receipts.append(await worker.acut(inv | {"checkpoint_id": f"race-{epoch}-end"}))
            await worker.aend_fence(epoch)
            return receipts, outs

    receipts, outs = asyncio.run(scenario())
    lengths = {r: len(o["choices"][0]["token_ids"]) for r, o in zip(rollouts, outs, strict=True)}
    terminal = active = 0
    for receipt in receipts:
        for c in receipt["calls"]:
            if c["disposition"] != "durable_prefix":
                continue
            n = lengths[c["rollout_id"]]
            if c["cut_kind"] == "terminal_completion":
                terminal += 1
                assert c["prefix_token_count"] == n, c
            else:
                active += 1
                assert c["prefix_token_count"] < n, c
    assert terminal >= len(rollouts) and active > 0
    worker.drain()
