"""Token capture, cuts, fences and terminal rows on a real engine with a real StagingStore."""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import pytest

from rollout_recovery.data_plane.digest import chain_digests, finish_digest, token_digest
from rollout_recovery.data_plane.schemas import table_to_chunk_rows, table_to_terminal_rows

pytestmark = pytest.mark.engine
MESSAGES = [{"role": "user", "content": "Count the letters in the word rollout."}]


def _body(rollout: str, call: str = "c0", attempt: int = 0, **extra) -> dict:
    return {
        "model": "policy",
        "messages": MESSAGES,
        "max_tokens": 64,
        "temperature": 0.0,
        "logprobs": True,
        "return_token_ids": True,
        "vllm_xargs": {"rr_rollout_id": rollout, "rr_model_call_id": call, "rr_attempt": attempt},
        **extra,
    }


def _inventory(ckpt: str, rollouts: list[str], call: str = "c0") -> dict:
    return {
        "checkpoint_id": ckpt,
        "calls": [{"rollout_id": r, "model_call_id": call, "attempt": 0} for r in rollouts],
    }


async def _post(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    resp = await client.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


async def _decoding(worker, rollouts: list[str], timeout_s: float = 120.0) -> None:
    """Until the engine has decoded a token of each of these calls (its own records): on a
    loaded machine a call may reach the engine later than a fixed sleep allows."""
    deadline = time.monotonic() + timeout_s
    while True:
        page = await worker.acall_attempts(0)
        started = {r["rollout_id"] for r in page["attempts"] if r["decoded_tokens"] > 0}
        if started >= set(rollouts):
            return
        assert time.monotonic() < deadline, f"calls never decoded: {set(rollouts) - started}"
        await asyncio.sleep(0.02)


def test_cuts_stage_exactly_the_generated_prefix(capture_worker):
    worker, store = capture_worker
    url = worker.info.url
    rollouts = [f"cut-{i}" for i in range(8)]

    async def scenario():
        async with httpx.AsyncClient() as client:
            tasks = [
                asyncio.create_task(
                    _post(client, url, _body(r, max_tokens=300 + 10 * i, ignore_eos=True))
                )
                for i, r in enumerate(rollouts)
            ]
            receipts = []
            await _decoding(worker, rollouts)
            for k in range(3):
                await asyncio.sleep(0.15)
                receipts.append(await worker.acut(_inventory(f"ckpt-{k}", rollouts)))
            again = await worker.acut(_inventory("ckpt-2", rollouts))
            outs = await asyncio.gather(*tasks)
            return receipts, again, outs

    receipts, again, outs = asyncio.run(scenario())
    assert again == receipts[-1]  # idempotent per (checkpoint_id, inventory)
    worker.drain()
    for i in range(len(rollouts)):
        final_ids = outs[i]["choices"][0]["token_ids"]
        final_lps = [c["logprob"] for c in outs[i]["choices"][0]["logprobs"]["content"]]
        staged = [rc.calls[i] if hasattr(rc, "calls") else rc["calls"][i] for rc in receipts]
        counts = [c["prefix_token_count"] for c in staged]
        assert all(c["disposition"] == "durable_prefix" for c in staged), staged
        assert counts == sorted(counts) and counts[0] > 0
        assert counts[-1] < len(final_ids), "cut while the call was still decoding"
        assert staged[0]["cut_kind"] == "active_prefix"
        assert staged[-1]["effective_output_limit"] == 300 + 10 * i
    # Once finished, each call's chunks were replaced by its terminal row.
    assert store.list("rollout_staging", "cut-") == []
    keys = [f"{r}/c0/a0/terminal" for r in rollouts]
    table, missing = store.get("rollout_terminal", keys)
    assert not missing
    for i, row in enumerate(table_to_terminal_rows(table)):
        choice = outs[i]["choices"][0]
        assert row.token_ids.tolist() == choice["token_ids"]
        assert row.prompt_token_ids.tolist() == outs[i]["prompt_token_ids"]
        np.testing.assert_array_equal(
            row.logprobs,
            np.array([c["logprob"] for c in choice["logprobs"]["content"]], np.float32),
        )
        assert row.finish_reason == "length" and row.digest == token_digest(row.token_ids)
    assert final_ids and final_lps


def test_repeated_cuts_put_every_token_in_one_chunk(capture_worker):
    """While 32 calls decode, repeated cuts stage disjoint, chained chunks covering a prefix."""
    worker, store = capture_worker
    url = worker.info.url
    rollouts = [f"many-{i}" for i in range(32)]
    worker.begin_fence(1, 60)  # keep chunks (terminal writes wait)

    async def scenario():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
            tasks = [
                asyncio.create_task(_post(client, url, _body(r, max_tokens=120, ignore_eos=True)))
                for r in rollouts
            ]
            receipts = []
            for k in range(4):
                await asyncio.sleep(0.1)
                receipts.append(await worker.acut(_inventory(f"many-{k}", rollouts)))
            outs = await asyncio.gather(*tasks)
            receipts.append(await worker.acut(_inventory("many-final", rollouts)))
            return receipts, outs

    try:
        receipts, outs = asyncio.run(scenario())
        for i in range(len(rollouts)):
            last = receipts[-1]["calls"][i]
            assert last["disposition"] == "durable_prefix"
            assert last["cut_kind"] == "terminal_completion"
            table, missing = store.get("rollout_staging", last["staging_keys"])
            assert not missing
            chunks = table_to_chunk_rows(table)
            assert [c.chunk_seq for c in chunks] == list(range(len(chunks)))
            deltas = [c.token_ids for c in chunks]
            assert [c.prev_len for c in chunks] == list(
                np.cumsum([0] + [len(d) for d in deltas])[:-1]
            )
            chained = chain_digests(deltas)
            assert [c.digest for c in chunks[:-1]] == chained[:-1]
            # The last chunk ends the finished call: its digest seals the finish record.
            assert chunks[-1].finish_reason == "length"
            assert chunks[-1].digest == finish_digest(chained[-1], "length", None)
            assert last["prefix_digest"] == chunks[-1].digest.hex()
            final = outs[i]["choices"][0]["token_ids"]
            assert np.concatenate(deltas).tolist() == final  # every token exactly once
            assert chunks[0].prompt_token_ids.tolist() == outs[i]["prompt_token_ids"]
        assert store.list("rollout_terminal", "many-") == []  # held by the fence
    finally:
        assert worker.end_fence(1)
    assert not worker.end_fence(1)  # a late end is a no-op
    worker.drain()
    assert len(store.list("rollout_terminal", "many-")) == 32
    assert store.list("rollout_staging", "many-") == []
    metrics = worker.capture_metrics()
    assert metrics["terminal_rows"] >= 32 and metrics["deferred_deletes"] >= 32
    assert metrics["fence_hold_s"] > 0


def test_uncuttable_calls_have_named_reasons(capture_worker):
    worker, _ = capture_worker
    url = worker.info.url
    cases = {
        "pp": {"presence_penalty": 0.5},
        "fp": {"frequency_penalty": 0.5, "repetition_penalty": 1.2},
        "seed": {"seed": 7, "temperature": 1.0},
        "json": {"response_format": {"type": "json_object"}},
        "bw": {"bad_words": ["result answered"]},
        "pk": {"vllm_xargs": {"rr_rollout_id": "u-pk", "rr_model_call_id": "c0", "rr_seed": 11}},
        "lp": {"vllm_xargs": {"rr_rollout_id": "u-lp", "rr_model_call_id": "c0", "my_proc": 1}},
        "n2": {"n": 2, "temperature": 1.0},
        "topk": {"top_logprobs": 3},
    }
    expected = {
        "pp": "presence_penalty",
        "fp": "frequency_penalty",
        "seed": "per_request_seed",
        "json": "structured_output",
        "bw": "multi_token_bad_words",
        "lp": "unknown_logits_processor",
        "n2": "n_greater_than_1",
        "topk": "top_logprobs",
    }

    async def scenario():
        async with httpx.AsyncClient() as client:
            bodies = {
                k: _body(f"u-{k}", max_tokens=200, ignore_eos=True) | v for k, v in cases.items()
            }
            tasks = {k: asyncio.create_task(_post(client, url, b)) for k, b in bodies.items()}
            await _decoding(worker, [f"u-{k}" for k in cases])
            inv = _inventory("uncut", [f"u-{k}" for k in cases] + ["u-missing"])
            receipt = await worker.acut(inv)
            await asyncio.gather(*tasks.values())
            return receipt

    receipt = asyncio.run(scenario())
    reasons = {c["rollout_id"]: c["reason"] for c in receipt["calls"]}
    for k, reason in expected.items():
        assert reasons[f"u-{k}"] == reason
    assert reasons["u-missing"] == "unknown_call"
    # Seeded sampling through the position-keyed sampler is resumable, so it is cut.
    assert reasons["u-pk"] is None
    assert [c["rollout_id"] for c in receipt["calls"] if c["disposition"] == "durable_prefix"] == [
        "u-pk"
    ]
    metrics = worker.capture_metrics()
    assert metrics["cut_failure.presence_penalty"] >= 1


def test_control_routes_auth_and_bad_input(capture_worker):
    worker, _ = capture_worker
    url, token = worker.info.url, worker.control_token
    route = f"{url}/control/v1/generation-cut"
    good = _inventory("http-1", ["nobody"])
    assert httpx.post(route, json=good, timeout=30).status_code == 401
    bad_auth = {"Authorization": "Bearer wrong"}
    assert httpx.post(route, json=good, headers=bad_auth, timeout=30).status_code == 401
    auth = {"Authorization": f"Bearer {token}"}
    resp = httpx.post(route, json=good, headers=auth, timeout=30)
    assert resp.status_code == 200
    assert resp.json()["calls"][0]["reason"] == "unknown_call"
    for body in [
        {"checkpoint_id": "x"},
        {"checkpoint_id": "../x", "calls": []},
        {"checkpoint_id": "x", "calls": [{"rollout_id": "a b", "model_call_id": "c"}]},
        {"checkpoint_id": "x", "calls": [], "extra": 1},
    ]:
        r = httpx.post(route, json=body, headers=auth, timeout=30)
        assert 400 <= r.status_code < 500, (body, r.status_code)
    big = _inventory("big", [f"r{i}" for i in range(65)])
    r = httpx.post(route, json=big, headers=auth, timeout=30)
    assert r.status_code == 413 and "max_inventory_calls" in r.text
    fence = httpx.post(f"{url}/control/v1/fence/begin", json={"epoch": 5, "lease_s": 0.3},
                       headers=auth, timeout=30)  # fmt: skip
    assert fence.status_code == 200 and fence.json()["held"]
    time.sleep(0.5)  # the lease expires by itself
    end = httpx.post(f"{url}/control/v1/fence/end", json={"epoch": 5}, headers=auth, timeout=30)
    assert end.status_code == 200 and end.json() == {
        "epoch": None,
        "held": False,
        "expires_in_s": None,
        "released": False,
    }
    # Capture metrics are on vLLM's own Prometheus endpoint.
    prom = httpx.get(f"{url}/metrics", timeout=30).text
    assert "rollout_recovery_cut_calls_total" in prom
    assert 'reason="unknown_call"' in prom
    # A malformed identity is a 4xx, and the worker keeps serving.
    bad = _body("bad id with spaces")
    r = httpx.post(f"{url}/v1/chat/completions", json=bad, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    assert worker.health().healthy
