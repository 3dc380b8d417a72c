"""Resuming restored calls from staged prefixes: the response equals the uninterrupted one.

The tests where the vocabulary matters (characters split across tokens, stop strings, special
tokens, embedding rows past the tokenizer, tool-call tags) run on both tiny models
(tests/engine/two_models.py)."""

from __future__ import annotations

import asyncio
import itertools
import json
import math

import httpx
import numpy as np
import pytest

from rollout_recovery.data_plane.digest import chain_digests
from rollout_recovery.data_plane.schemas import ChunkRow, chunk_rows_to_table, table_to_chunk_rows
from tests.engine.evidence import assert_from_scratch, assert_resumed, attempt_record
from tests.engine.two_models import MODELS, split_character, split_sampling, splits_inside

pytestmark = pytest.mark.engine
_ids = itertools.count()

PROMPTS = {
    "ascii": "What is 2 + 3?",
    "accents": "Café, naïve, façade: é è ê",
    "symbols": "Price: 5 € or 🦖 dinosaurs",
}


def _body(rollout: str, attempt: int = 0, xargs: dict | None = None, **kw) -> dict:
    return {
        "model": "policy",
        "messages": [{"role": "user", "content": kw.pop("content", PROMPTS["ascii"])}],
        "max_tokens": kw.pop("max_tokens", 48),
        "temperature": 0.0,
        "logprobs": True,
        "return_token_ids": True,
        "vllm_xargs": {"rr_rollout_id": rollout, "rr_model_call_id": "c0", "rr_attempt": attempt}
        | (xargs or {}),
        **kw,
    }


def _chat(url: str, rollout: str, attempt: int = 0, xargs: dict | None = None, **kw) -> dict:
    body = _body(rollout, attempt, xargs, **kw)
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _stage(
    store, rollout: str, out: dict, k: int, split: int | None = None, version: int = 0
) -> dict:
    """Stage the first k tokens of a reference answer as chunk rows of attempt 0 (with
    `split`, the first chunk sampled by weight version `version`, the second by the next)."""
    choice = out["choices"][0]
    ids = np.array(choice["token_ids"][:k], np.int32)
    lps = np.array([c["logprob"] for c in choice["logprobs"]["content"][:k]], np.float32)
    cuts = [0, split, k] if split and 0 < split < k else [0, k]
    deltas = [ids[a:b] for a, b in itertools.pairwise(cuts)]
    digests = chain_digests(deltas)
    rows = [
        ChunkRow(
            key=f"{rollout}/c0/a0/c{seq:06d}",
            rollout_id=rollout,
            model_call_id="c0",
            attempt=0,
            chunk_seq=seq,
            token_ids=deltas[seq],
            logprobs=lps[a:b],
            weight_version=version + seq,
            weight_versions=[(version + seq, a, b)],
            prev_len=a,
            digest=digests[seq],
            prompt_token_ids=np.array(out["prompt_token_ids"], np.int32) if seq == 0 else None,
        )
        for seq, (a, b) in enumerate(itertools.pairwise(cuts))
    ]
    store.put("rollout_staging", chunk_rows_to_table(rows))
    return {
        "rr_resume_keys": [r.key for r in rows],
        "rr_resume_tokens": k,
        "rr_resume_digest": digests[-1].hex(),
    }


def _same(resumed: dict, reference: dict) -> None:
    a, b = resumed["choices"][0], reference["choices"][0]
    assert a["token_ids"] == b["token_ids"]
    assert a["message"]["content"] == b["message"]["content"]
    assert a["finish_reason"] == b["finish_reason"]
    assert resumed["prompt_token_ids"] == reference["prompt_token_ids"]
    assert resumed["usage"] == reference["usage"]
    la = [c["logprob"] for c in a["logprobs"]["content"]]
    lb = [c["logprob"] for c in b["logprobs"]["content"]]
    assert la == lb  # bit-identical: same single-request batch shape
    assert [c["token"] for c in a["logprobs"]["content"]] == [
        c["token"] for c in b["logprobs"]["content"]
    ]


def _metrics(worker) -> dict:
    return worker.capture_metrics()


@pytest.mark.parametrize("prompt", list(PROMPTS))
@pytest.mark.parametrize("model", MODELS)
def test_resume_at_first_middle_and_inside_a_character(worker_of, model, prompt):
    mw = worker_of(model)
    worker, store, tok, url = mw.worker, mw.store, mw.tokenizer, mw.url
    ref = _chat(url, f"ref-{prompt}-{next(_ids)}", content=PROMPTS[prompt], ignore_eos=True)
    ids = ref["choices"][0]["token_ids"]
    inside = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")]
    points = {1, len(ids) // 2, *inside[:1]}
    for k in sorted(points):
        rollout = f"res-{prompt}-{k}-{next(_ids)}"
        cont = _stage(store, rollout, ref, k, split=k // 2)
        out = _chat(url, rollout, attempt=1, xargs=cont, content=PROMPTS[prompt], ignore_eos=True)
        _same(out, ref)
        assert_resumed(worker, rollout, 1, k, len(ids))
    assert any(tok.decode(ids[:k]).endswith("\ufffd") for k in points) or not inside


@pytest.mark.parametrize("skip_special", [True, False])
@pytest.mark.parametrize("model", MODELS)
def test_resume_between_the_pieces_of_a_split_character(worker_of, model, skip_special):
    """Greedy answers of these random models repeat whole tokens, and qwen3's vocabulary holds
    most characters whole: a seeded call drawn toward the pieces of a character the tokenizer
    splits (and a special token) puts cuts between the pieces of one character, after pieces
    no character completes, and next to a special token with such bytes pending. Resumed
    there, the call gives the uninterrupted tokens, text and logprobs and decodes only its
    tail, with special tokens dropped from the text or kept."""
    mw = worker_of(model)
    worker, store, tok, url = mw.worker, mw.store, mw.tokenizer, mw.url
    char, pieces = split_character(tok)
    xargs, fields = split_sampling(tok, seed=3)
    fields |= {"ignore_eos": True, "skip_special_tokens": skip_special}
    ref = _chat(url, f"split-ref-{next(_ids)}", xargs=xargs, **fields)
    ids = ref["choices"][0]["token_ids"]
    assert char in ref["choices"][0]["message"]["content"]
    splits = splits_inside(ids, pieces)
    text = [tok.decode(ids[:k], skip_special_tokens=True) for k in range(len(ids))]
    pending = [k for k in range(1, len(ids)) if text[k].endswith("\ufffd")]  # bytes held back
    others = sorted(set(pending) - set(splits))
    special = tok.convert_tokens_to_ids("<|im_start|>")
    beside = [k for k in pending if special in ids[k - 1 : k + 1]]  # last or next token
    assert splits and others and beside, (splits, others, beside)
    for k in sorted({splits[0], splits[-1], *others[:2], *beside[:2]}):
        rollout = f"split-res-{k}-{next(_ids)}"
        cont = _stage(store, rollout, ref, k, split=k // 2)
        _same(_chat(url, rollout, 1, xargs | cont, **fields), ref)
        assert_resumed(worker, rollout, 1, k, len(ids))


@pytest.mark.parametrize("model", MODELS)
def test_resume_with_a_stop_string_split_inside_a_character(worker_of, model):
    """The stop string is a whole character whose pieces the cut separates: the prefix's text
    does not hold it yet, the tail's first piece completes it, and the call stops there."""
    mw = worker_of(model)
    worker, store, tok, url = mw.worker, mw.store, mw.tokenizer, mw.url
    char, pieces = split_character(tok)
    xargs, fields = split_sampling(tok, seed=3)
    ref = _chat(url, f"cstop-ref-{next(_ids)}", xargs=xargs, stop=[char], **fields)
    ids = ref["choices"][0]["token_ids"]
    assert (ref["choices"][0]["finish_reason"], ref["choices"][0]["stop_reason"]) == ("stop", char)
    assert ids[-len(pieces) :] == pieces  # the character's last piece stopped it
    for k in range(len(ids) - len(pieces) + 1, len(ids)):
        rollout = f"cstop-res-{k}-{next(_ids)}"
        cont = _stage(store, rollout, ref, k)
        _same(_chat(url, rollout, 1, xargs | cont, stop=[char], **fields), ref)
        assert_resumed(worker, rollout, 1, k, len(ids))


@pytest.mark.parametrize("model", MODELS)
def test_resume_with_a_stop_string_spanning_the_cut(worker_of, model):
    mw = worker_of(model)
    worker, store, tok, url = mw.worker, mw.store, mw.tokenizer, mw.url
    base = _chat(url, f"stop-base-{next(_ids)}", ignore_eos=True, max_tokens=48)
    ids = base["choices"][0]["token_ids"]
    texts = [tok.decode(ids[:i]) for i in range(len(ids) + 1)]
    found = None
    for j, left, right in itertools.product(range(2, len(ids) - 1), (1, 2, 3), (1, 2)):
        before, here, after = texts[j - 1], texts[j], texts[j + 1]
        stable = after.startswith(here) and here.startswith(before)
        if not stable or len(here) - len(before) < left or len(after) - len(here) < right:
            continue
        stop = here[-left:] + after[len(here) : len(here) + right]
        if stop.strip() and "\ufffd" not in stop and after.find(stop) == len(here) - left:
            found = (j, stop)
            break
    if found is None:
        pytest.fail("no token boundary to place a stop string on")
    j, stop = found
    ref = _chat(url, f"stop-ref-{next(_ids)}", stop=[stop], max_tokens=48)
    assert ref["choices"][0]["finish_reason"] == "stop"
    assert len(ref["choices"][0]["token_ids"]) == j + 1
    rollout = f"stop-res-{next(_ids)}"
    cont = _stage(store, rollout, ref, j)  # the cut falls inside the stop string
    _same(_chat(url, rollout, attempt=1, xargs=cont, stop=[stop], max_tokens=48), ref)
    assert_resumed(worker, rollout, 1, j, j + 1)


@pytest.mark.parametrize("model", MODELS)
def test_resume_honours_min_tokens_and_a_finished_prefix(worker_of, model):
    mw = worker_of(model)
    worker, store, url = mw.worker, mw.store, mw.url
    ref = _chat(url, f"min-ref-{next(_ids)}", min_tokens=20, max_tokens=32)
    rollout = f"min-res-{next(_ids)}"
    cont = _stage(store, rollout, ref, 5)
    _same(_chat(url, rollout, attempt=1, xargs=cont, min_tokens=20, max_tokens=32), ref)
    assert_resumed(worker, rollout, 1, 5, len(ref["choices"][0]["token_ids"]))
    # A prefix that already reached the limit is answered without decoding.
    before = _metrics(worker).get("resume.finished_without_decoding", 0)
    full = f"full-res-{next(_ids)}"
    cont = _stage(store, full, ref, len(ref["choices"][0]["token_ids"]))
    _same(_chat(url, full, attempt=1, xargs=cont, min_tokens=20, max_tokens=32), ref)
    assert _metrics(worker)["resume.finished_without_decoding"] == before + 1
    n = len(ref["choices"][0]["token_ids"])
    assert assert_resumed(worker, full, 1, n, n)["finish_reason"] == "length"


@pytest.mark.parametrize("model", MODELS)
def test_frequency_penalty_is_emulated_exactly(worker_of, model):
    mw = worker_of(model)
    worker, store, url = mw.worker, mw.store, mw.url
    ref = _chat(url, f"fp-ref-{next(_ids)}", ignore_eos=True, frequency_penalty=0.7)
    plain = _chat(url, f"fp-plain-{next(_ids)}", ignore_eos=True)
    assert ref["choices"][0]["token_ids"] != plain["choices"][0]["token_ids"]  # it matters
    for k in (5, 20):
        rollout = f"fp-res-{k}-{next(_ids)}"
        cont = _stage(store, rollout, ref, k)
        out = _chat(url, rollout, attempt=1, xargs=cont, ignore_eos=True, frequency_penalty=0.7)
        _same(out, ref)
        assert_resumed(worker, rollout, 1, k, len(ref["choices"][0]["token_ids"]))


@pytest.mark.parametrize("model", MODELS)
def test_seeded_temperature_one_sampling_resumes_exactly(worker_of, model):
    """The sampler draws over every embedding row; qwen3 has rows past its tokenizer (decoded
    to ''), one of which is made likely here and must survive a cut right after it."""
    mw = worker_of(model)
    worker, store, url = mw.worker, mw.store, mw.url
    seeded = {"rr_seed": 1234, "rr_temperature": 1.0}
    past = mw.ids_past_tokenizer[-1:]  # qwen3: [151935]; tiny: none
    bias = {"logit_bias": {str(i): math.log(len(mw.tokenizer)) for i in past}}
    ref = _chat(url, f"pk-ref-{next(_ids)}", xargs=seeded, ignore_eos=True, **bias)
    other = _chat(url, f"pk-other-{next(_ids)}", xargs={"rr_seed": 99}, ignore_eos=True, **bias)
    ids = ref["choices"][0]["token_ids"]
    assert other["choices"][0]["token_ids"] != ids
    assert all(i in ids for i in past)
    for k in sorted({1, 17, *(ids.index(i) + 1 for i in past)}):
        rollout = f"pk-res-{k}-{next(_ids)}"
        cont = _stage(store, rollout, ref, k)
        _same(_chat(url, rollout, attempt=1, xargs=seeded | cont, ignore_eos=True, **bias), ref)
        assert_resumed(worker, rollout, 1, k, len(ids))


@pytest.mark.parametrize("model", MODELS)
def test_a_real_cut_survives_the_caller_going_away(worker_of, model):
    """Cut a call in flight, drop the caller (as a crash would), resume from the receipt."""
    mw = worker_of(model)
    worker, store, url = mw.worker, mw.store, mw.url
    ref = _chat(url, f"live-ref-{next(_ids)}", ignore_eos=True, max_tokens=400)
    rollout = f"live-{next(_ids)}"

    async def crash_mid_flight():
        body = {
            "model": "policy",
            "messages": [{"role": "user", "content": PROMPTS["ascii"]}],
            "max_tokens": 400,
            "temperature": 0.0,
            "ignore_eos": True,
            "logprobs": True,
            "return_token_ids": True,
            "vllm_xargs": {"rr_rollout_id": rollout, "rr_model_call_id": "c0", "rr_attempt": 0},
        }
        async with httpx.AsyncClient() as client:
            task = asyncio.create_task(client.post(f"{url}/v1/chat/completions", json=body))
            await asyncio.sleep(0.4)
            inv = {
                "checkpoint_id": "live",
                "calls": [{"rollout_id": rollout, "model_call_id": "c0"}],
            }
            receipt = await worker.acut(inv)
            task.cancel()
            return receipt["calls"][0]

    call = asyncio.run(crash_mid_flight())
    assert call["disposition"] == "durable_prefix" and 0 < call["prefix_token_count"] < 400
    cont = {
        "rr_resume_keys": call["staging_keys"],
        "rr_resume_tokens": call["prefix_token_count"],
        "rr_resume_digest": call["prefix_digest"],
        "rr_resume_limit": call["effective_output_limit"],
    }
    out = _chat(url, rollout, attempt=1, xargs=cont, ignore_eos=True, max_tokens=400)
    _same(out, ref)
    assert_resumed(worker, rollout, 1, call["prefix_token_count"], 400)
    first = attempt_record(worker, rollout, 0)  # the attempt the "crash" interrupted
    assert first["resume"] == "none" and first["decoded_tokens"] >= call["prefix_token_count"]
    # Once the resumed call's terminal row is staged, the old attempt's chunks are deleted.
    worker.drain()
    _, missing = store.get("rollout_staging", call["staging_keys"])
    assert missing == call["staging_keys"]
    assert not store.get("rollout_terminal", [f"{rollout}/c0/a1/terminal"])[1]


def test_bad_continuations_fail_closed_and_regenerate(capture_worker):
    worker, store = capture_worker
    url = worker.info.url
    ref = _chat(url, f"bad-ref-{next(_ids)}", ignore_eos=True)
    k = 10

    def resume(rollout: str, cont: dict, attempt: int = 1) -> dict:
        return _chat(url, rollout, attempt=attempt, xargs=cont, ignore_eos=True)

    cases = {}
    # A tampered chunk: one token changed after staging.
    r = f"tamper-{next(_ids)}"
    cont = _stage(store, r, ref, k)
    table, _ = store.get("rollout_staging", cont["rr_resume_keys"])
    rows = table_to_chunk_rows(table)
    rows[0].token_ids = rows[0].token_ids.copy()
    rows[0].token_ids[3] += 1
    store.put("rollout_staging", chunk_rows_to_table(rows))
    cases["digest_mismatch"] = (r, cont, 1)
    r = f"missing-{next(_ids)}"
    absent = {"rr_resume_keys": [f"{r}/c0/a0/c000009"]}
    cases["missing_chunk"] = (r, _stage(store, r, ref, k) | absent, 1)
    r = f"count-{next(_ids)}"
    cases["prefix_length_mismatch"] = (r, _stage(store, r, ref, k) | {"rr_resume_tokens": k + 1}, 1)
    r = f"foreign-{next(_ids)}"
    cases["foreign_chunk"] = (r, _stage(store, r, ref, k), 0)  # attempt 0 cannot resume attempt 0
    before = _metrics(worker)
    for reason, (rollout, cont, attempt) in cases.items():
        out = resume(rollout, cont, attempt)
        _same(out, ref)  # regenerated from scratch: greedy gives the same answer
        after = _metrics(worker)
        assert after.get(f"resume.{reason}", 0) == before.get(f"resume.{reason}", 0) + 1, reason
        assert_from_scratch(worker, rollout, attempt, reason, len(ref["choices"][0]["token_ids"]))
    assert worker.health().healthy


@pytest.mark.parametrize("model", MODELS)
def test_a_streamed_resume_delivers_the_whole_completion(worker_of, model):
    """The caller of a resumed call never saw the prefix: the stream must carry all of it,
    here with the cut between two pieces of one character (the prefix's text ends short of
    it, and the tail's first delta completes it)."""
    mw = worker_of(model)
    worker, store, url = mw.worker, mw.store, mw.url
    xargs, fields = split_sampling(mw.tokenizer, seed=5)
    fields |= {"content": PROMPTS["symbols"], "ignore_eos": True}
    ref = _chat(url, f"stream-ref-{next(_ids)}", xargs=xargs, **fields)
    rollout = f"stream-res-{next(_ids)}"
    k = splits_inside(ref["choices"][0]["token_ids"], split_character(mw.tokenizer)[1])[0]
    cont = _stage(store, rollout, ref, k, split=k // 2)
    body = _body(rollout, 1, xargs | cont, stream=True, **fields)
    ids, text, lps = [], "", []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            for choice in chunk.get("choices", []):
                ids += choice.get("token_ids") or []
                text += (choice.get("delta") or {}).get("content") or ""
                lps += [c["logprob"] for c in (choice.get("logprobs") or {}).get("content", [])]
    choice = ref["choices"][0]
    assert ids == choice["token_ids"]
    assert text == choice["message"]["content"]
    assert lps == [c["logprob"] for c in choice["logprobs"]["content"]]
    assert_resumed(worker, rollout, 1, k, len(choice["token_ids"]))


def test_a_refused_frequency_penalty_emulation_regenerates(capture_worker):
    """A prefix whose emulating logit bias vLLM would clamp cannot be resumed exactly: the
    call is decoded from scratch (not failed), counted as refused and not as resumed."""
    worker, store = capture_worker
    url = worker.info.url
    ref = _chat(url, f"fpx-ref-{next(_ids)}", ignore_eos=True, frequency_penalty=-2.0,
                max_tokens=80)  # fmt: skip
    ids = ref["choices"][0]["token_ids"]
    k = 60
    assert max(ids[:k].count(t) for t in set(ids[:k])) * 2.0 > 100  # the bias would clamp
    rollout = f"fpx-res-{next(_ids)}"
    cont = _stage(store, rollout, ref, k)
    before = _metrics(worker)
    out = _chat(url, rollout, attempt=1, xargs=cont, ignore_eos=True, frequency_penalty=-2.0,
                max_tokens=80)  # fmt: skip
    after = _metrics(worker)
    _same(out, ref)
    assert after.get("resume.frequency_penalty", 0) == before.get("resume.frequency_penalty", 0) + 1
    assert_from_scratch(worker, rollout, 1, "frequency_penalty", len(ids))
    assert after.get("resume.resumed", 0) == before.get("resume.resumed", 0)


def test_a_prefix_without_logprobs_is_refused_and_regenerated(capture_worker):
    """Chunks staged without sampled logprobs carry none (not zeros); a resume cannot give the
    caller the uninterrupted logprobs from them, so it fails closed."""
    worker, store = capture_worker
    url = worker.info.url
    ref = _chat(url, f"nolp-ref-{next(_ids)}", ignore_eos=True)
    rollout = f"nolp-res-{next(_ids)}"
    cont = _stage(store, rollout, ref, 12)
    table, _ = store.get("rollout_staging", cont["rr_resume_keys"])
    rows = table_to_chunk_rows(table)
    rows[0].logprobs = None
    store.put("rollout_staging", chunk_rows_to_table(rows))
    before = _metrics(worker)
    _same(_chat(url, rollout, attempt=1, xargs=cont, ignore_eos=True), ref)
    after = _metrics(worker)
    name = "resume.prefix_without_logprobs"
    assert after.get(name, 0) == before.get(name, 0) + 1
    n = len(ref["choices"][0]["token_ids"])
    assert_from_scratch(worker, rollout, 1, "prefix_without_logprobs", n)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


def _streamed(url: str, body: dict) -> tuple[list[int], dict, str | None]:
    """(token ids, the tool call its deltas assemble to, the finish reason) of a stream."""
    ids, call, finish = [], {"name": "", "arguments": ""}, None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line.removeprefix("data: ")).get("choices", []):
                ids += choice.get("token_ids") or []
                for delta in (choice.get("delta") or {}).get("tool_calls") or []:
                    for key in call:
                        call[key] += (delta.get("function") or {}).get(key) or ""
                finish = choice.get("finish_reason") or finish
    return ids, call, finish


@pytest.mark.parametrize("model", MODELS)
def test_a_prefix_that_ended_on_a_tool_call_is_answered_with_it(worker_of, model):
    """A call that finished on a tool call, cut before its caller had the answer: resumed from
    its tokens (EOS last) it decodes nothing and returns the tool call the hermes parser reads
    from the prefix's text, plain and streamed. In qwen3's vocabulary <tool_call> is one added
    token that is not special (it stays in the text) and <|im_end|> a special one (left out);
    in tiny's both are plain bytes but the EOS. Random weights never write a tool call, and a
    grammar would make the call uncuttable, so the tokens are staged as the model's."""
    mw = worker_of(model)
    worker, store, tok, url = mw.worker, mw.store, mw.tokenizer, mw.url
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    ids = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
    fields = {"tools": TOOLS, "tool_choice": "auto", "max_tokens": len(ids) + 16}
    prompt = _chat(url, f"tool-prompt-{next(_ids)}", **(fields | {"max_tokens": 1}))
    lps = [-0.5 - i / 64 for i in range(len(ids))]
    entries = [{"logprob": lp} for lp in lps]
    done = {"choices": [{"token_ids": ids, "logprobs": {"content": entries}}],
            "prompt_token_ids": prompt["prompt_token_ids"]}  # fmt: skip
    for stream in (False, True):
        rollout = f"tool-res-{stream}-{next(_ids)}"
        cont = _stage(store, rollout, done, len(ids), split=len(ids) // 2)
        before = _metrics(worker)
        if stream:
            got_ids, call, finish = _streamed(url, _body(rollout, 1, cont, stream=True, **fields))
        else:
            choice = _chat(url, rollout, 1, cont, **fields)["choices"][0]
            [tool_call] = choice["message"]["tool_calls"]
            assert not choice["message"]["content"]
            assert [c["logprob"] for c in choice["logprobs"]["content"]] == pytest.approx(lps)
            got_ids, call = choice["token_ids"], tool_call["function"]
            finish = choice["finish_reason"]
        assert (got_ids, finish) == (ids, "tool_calls")
        assert (call["name"], json.loads(call["arguments"])) == ("add", {"a": 2, "b": 3})
        name = "resume.finished_without_decoding"
        assert _metrics(worker)[name] == before.get(name, 0) + 1
        assert_resumed(worker, rollout, 1, len(ids), len(ids))


def test_booleans_are_not_numbers_in_call_identities_and_continuations(capture_worker):
    """vLLM's request model would turn `true` into 1; the worker refuses it before that."""
    worker, store = capture_worker
    url = worker.info.url
    identity = {"rr_rollout_id": f"bool-{next(_ids)}", "rr_model_call_id": "c0"}
    body = _body("unused") | {"vllm_xargs": identity | {"rr_attempt": True}}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "rr_attempt" in r.text
    ref = _chat(url, f"boolc-ref-{next(_ids)}", ignore_eos=True)
    rollout = f"boolc-{next(_ids)}"
    cont = _stage(store, rollout, ref, 1)
    for field in ("rr_resume_tokens", "rr_resume_limit"):
        body = _body(rollout, 1, cont | {field: True}, ignore_eos=True)
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and field in r.text, r.text
    body = _body(rollout, 1, cont | {"rr_resume_keys": ["not a chunk key"]}, ignore_eos=True)
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "rr_resume_keys" in r.text, r.text
    assert worker.health().healthy
