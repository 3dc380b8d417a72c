"""The rollout gateway against a real worker: an unmodified `openai` client harness in its own
process (rollout_recovery/episodes/openai_harness.py: plain and streamed calls, a calculator
tool offered with tool_choice="auto") runs a 3-turn episode through its rollout's base URL;
checkpointed after its first call and restored into a fresh environment, the restarted harness
makes the same calls and the first one is answered from the journal, not decoded. Both tests
run on both tiny models (tests/engine/two_models.py)."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest

from rollout_recovery.environment.rollout_env import RolloutEnvironment
from rollout_recovery.generation.pool import WorkerPool
from tests.engine.test_rollout_environment import _call_in_flight, _wait
from tests.engine.two_models import MODELS

pytestmark = pytest.mark.engine
TASK = {"messages": [{"role": "user", "content": "Add the numbers 12 34 56"}]}
TOKEN = "gateway-test-token"


def _cfg(base):
    cfg = base.model_copy(deep=True)
    cfg.environment.max_turns = 3
    cfg.environment.episode = "rollout_recovery.episodes.harness:episode"
    cfg.token_capture.enabled = True
    cfg.token_capture.supply_prefix_token_ids = True
    cfg.rollout_recovery.target_level = "turn"
    cfg.checkpointing.save_data_plane = True
    cfg.policy.generation.max_new_tokens = 48
    return cfg


def _env(cfg, worker, store) -> tuple[RolloutEnvironment, str]:
    env = RolloutEnvironment(cfg, WorkerPool([worker]), store)
    return env, env.start_gateway(TOKEN)


def _post(url: str, rollout: str, token: str = TOKEN) -> httpx.Response:
    body = {"model": "policy", "messages": TASK["messages"]}
    return httpx.post(f"{url}/rollouts/{rollout}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {token}"}, timeout=30)  # fmt: skip


@pytest.mark.parametrize("model", MODELS)
def test_a_restarted_harness_gets_its_committed_call_from_the_journal(worker_of, model):
    mw = worker_of(model)
    worker, store = mw.worker, mw.store
    cfg = _cfg(mw.cfg)
    reference, url = _env(cfg, worker, store)
    [(ref_row, _, ref_result)] = reference.run_groups([("gref", TASK)], [[3]], 0)
    store.delete("replay", [ref_row.key])
    assert ref_result["turns"] == 3 and reference.counters()["capture.calls.total"] == 3
    finished, unknown, unauthorized = (_post(url, "gref-g0"), _post(url, "nobody"),
                                       _post(url, "gref-g0", "wrong"))  # fmt: skip
    assert finished.status_code == 409 and finished.json()["error"]["code"] == "rollout_finished"
    assert unknown.status_code == 404 and unknown.headers["x-rollout-recovery-reason"] == (
        "unknown_rollout")  # fmt: skip
    assert unauthorized.status_code == 401
    reference.close()

    crashed, _ = _env(cfg, worker, store)
    runner = crashed.runner
    run = asyncio.run_coroutine_threadsafe(
        runner.run_groups([("grec", TASK)], [[3]], 0), crashed._loop.loop
    )
    _wait(lambda: _call_in_flight(runner, "grec-g0") == "c1", "c1 in flight")
    crashed.prepare("ckpt-g", lease_s=60)
    records = crashed.commit("ckpt-g")
    run.cancel()  # the crash: the harness is killed with its episode
    crashed.close()
    [rec] = records.episodes
    assert [s.kind for s in rec.journal] == ["chat"] and rec.journal[0].result["response"]
    assert rec.continuation is not None and rec.continuation.call_id == "c1"

    fresh, _ = _env(cfg, worker, store)
    fresh.begin_restore("rg")
    assert fresh.end_restore("rg", records.episodes) == 1
    [(row, decoded, result)] = fresh.run_groups([("grec", TASK)], [[3]], 0)
    counts = fresh.counters()
    fresh.close()
    # The restarted harness made three calls: the first answered from the journal (the same
    # response), the other two decoded by the engine as attempt 1.
    assert counts["journal.chat_replayed"] == 1 and counts["capture.calls.total"] == 2
    committed = fresh.sink.get(rec.turns[0].entry_id)
    assert counts["restored_turn_tokens"] == len(committed.generated_token_ids)
    assert decoded == int(row.loss_mask.sum()) - len(committed.generated_token_ids)
    assert json.dumps(result, sort_keys=True) == json.dumps(ref_result, sort_keys=True)
    np.testing.assert_array_equal(row.token_ids, ref_row.token_ids)
    np.testing.assert_array_equal(row.loss_mask, ref_row.loss_mask)
    np.testing.assert_array_equal(row.logprobs, ref_row.logprobs)
    assert row.reward == ref_row.reward
    entries = set(store.list("token_entries", prefix="grec-g0/"))
    assert {"grec-g0/c0/a0", "grec-g0/c1/a1", "grec-g0/c2/a1"} <= entries


def _harness_outside(url: str, group: str, crash_after_first: bool = False):
    """A harness the job did not start: it opens its rollout, makes two calls with the
    official client, and finishes it with its result."""
    import openai

    auth = {"Authorization": f"Bearer {TOKEN}"}
    opened = httpx.post(f"{url}/rollouts", headers=auth, timeout=30,
                        json={"group_id": group, "task": TASK, "seed": 17}).json()  # fmt: skip
    client = openai.OpenAI(base_url=opened["base_url"], api_key=TOKEN, max_retries=0)
    messages = [dict(m) for m in TASK["messages"]]
    raw = client.chat.completions.with_raw_response.create(model="policy", messages=messages)
    first = raw.parse().choices[0].message.content
    if crash_after_first:
        return opened, raw.headers["x-rollout-recovery-source"], None
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "again"}]
    second = client.chat.completions.create(model="policy", messages=messages, stream=True)
    text = first + "".join(c.choices[0].delta.content or "" for c in second if c.choices)
    done = httpx.post(f"{url}/rollouts/{opened['rollout_id']}/finish", headers=auth, timeout=30,
                      json={"result": {"text": text}})  # fmt: skip
    return opened, raw.headers["x-rollout-recovery-source"], done.json()


@pytest.mark.parametrize("model", MODELS)
def test_a_standalone_gateway_serves_outside_harnesses_across_a_restore(worker_of, model):
    """Rollouts opened, served, finished and leased over HTTP; a harness whose job died after
    its first call opens its rollout again after the restore and gets that call from the
    journal (same answer, not decoded), then finishes with the uninterrupted run's row."""
    mw = worker_of(model)
    worker, store = mw.worker, mw.store
    cfg = _cfg(mw.cfg)
    cfg.environment.reward = "rollout_recovery.episodes.tally:reward"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    reference = RolloutEnvironment(cfg, WorkerPool([worker]), store)
    url = reference.start_gateway(TOKEN, standalone_weight_version=0)
    opened, source, done = _harness_outside(url, "xref")
    assert opened["restored"] is False and source == "decoded" and done["tokens"] > 0
    lease = httpx.post(f"{url}/replay/lease", headers=auth, json={"max_rows": 64}, timeout=30)
    [row] = [r for r in lease.json()["rows"] if r["key"] == done["replay_key"]]
    assert row["reward"] == done["reward"] and sum(row["loss_mask"]) > 0
    ack = httpx.post(f"{url}/replay/ack", headers=auth, json={"lease_id": lease.json()["lease_id"]})
    assert ack.json()["acked"] >= 1
    again = httpx.post(f"{url}/rollouts/{done['rollout_id']}/finish", headers=auth, json={})
    assert again.status_code == 409
    reference.close()

    crashed = RolloutEnvironment(cfg, WorkerPool([worker]), store)
    url = crashed.start_gateway(TOKEN, standalone_weight_version=0)
    _harness_outside(url, "xrec", crash_after_first=True)
    crashed.prepare("ckpt-x", lease_s=60)
    records = crashed.commit("ckpt-x")
    crashed.close()  # the job dies; the harness with it
    [rec] = records.episodes
    assert [s.kind for s in rec.journal] == ["chat"] and rec.continuation is None

    fresh = RolloutEnvironment(cfg, WorkerPool([worker]), store)
    fresh.begin_restore("rx")
    assert fresh.end_restore("rx", records.episodes) == 1
    url = fresh.start_gateway(TOKEN, standalone_weight_version=0)
    opened, source, done2 = _harness_outside(url, "xrec")
    counts = fresh.counters()
    fresh.close()
    assert opened["restored"] is True and opened["journaled_steps"] == 1
    assert source == "journal" and counts["journal.chat_replayed"] == 1
    assert counts["capture.calls.total"] == 1  # only the second call was decoded
    assert (done2["reward"], done2["tokens"]) == (done["reward"], done["tokens"])
    recovered = store.get("replay", [done2["replay_key"]])[0]
    assert recovered.column("token_ids").to_pylist() == [row["token_ids"]]
    assert recovered.column("logprobs").to_pylist() == [row["logprobs"]]
