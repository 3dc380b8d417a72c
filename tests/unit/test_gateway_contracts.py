"""The standalone gateway's documented contracts (docs/gateway.md), on the real backend, runner,
dispatcher and model client, with a scripted vLLM server behind an httpx mock transport and a
snapshot's wire form in place of a crash (the engine path is tests/engine/test_gateway_*.py):

- `GET /rollouts` lists the rollouts a restore brought back, each with its state;
- `POST /replay/ack` of a lease that expired or never existed is 409 `unknown_lease`;
- a call that does not continue the rollout's previous call is refused at that call, by
  reason, and the rollout stays open;
- a rollout started over after `replay_diverged` is opened again as `restored: false`;
- a replayed answer is the first answer byte for byte.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from types import SimpleNamespace

import httpx
import pyarrow as pa
import pytest

from rollout_recovery.config import load_config
from rollout_recovery.data_plane.store import LeaseResult
from rollout_recovery.environment.episode import EpisodeState
from rollout_recovery.environment.gateway_backend import StandaloneGateway
from rollout_recovery.environment.runner import EpisodeRunner
from rollout_recovery.gateway import create_app
from rollout_recovery.generation.pool import WorkerPool
from rollout_recovery.protocol import XARG_CALL, EpisodeRecord
from tests.unit.test_capture_logic import MemoryStore

ROLE = {"system": 1001, "user": 1002, "assistant": 1003, "tool": 1004, "developer": 1005}
EOT = 2  # the end of a turn, and of a generation
HISTORY_MARK = 7  # what the re-rendering template puts in front of an earlier answer
REASON = "x-rollout-recovery-reason"
SOURCE = "x-rollout-recovery-source"
ASK = [{"role": "user", "content": "Count to three."}]
TASK = {"messages": ASK}


def _encode(text: str) -> list[int]:
    return [ord(c) for c in text]


class ScriptedVllm:
    """A chat-completions server: a conversation is rendered as role token, content characters,
    EOT per message, then the assistant's role token; the answer depends on the conversation's
    length. `required_prefix_token_ids` is honoured (the prefix, then the messages after the
    last assistant one). `re_renders_history`: the template renders an earlier answer with a
    mark in front of it, so a conversation rendered again does not hold the generated tokens.
    The body is sent with vLLM's key order and spacing."""

    def __init__(self, re_renders_history: bool = False) -> None:
        self.re_renders_history = re_renders_history
        self.decoded: list[str] = []  # call ids

    def _render(self, messages: list[dict]) -> list[int]:
        ids = []
        for m in messages:
            mark = [HISTORY_MARK] if self.re_renders_history and m["role"] == "assistant" else []
            ids += [ROLE[m["role"]], *mark, *_encode(m.get("content") or ""), EOT]
        return [*ids, ROLE["assistant"]]

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        messages = body["messages"]
        prefix = body.get("required_prefix_token_ids")
        if prefix is not None:
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            prompt = [*prefix, *self._render(messages[last + 1 :])]
        else:
            prompt = self._render(messages)
        self.decoded.append(body["vllm_xargs"][XARG_CALL])
        content = f"réponse {len(messages)}"
        gen = [*_encode(content), EOT]
        entries = [{"token": t, "logprob": -0.25, "bytes": list(t.encode()), "top_logprobs": []}
                   for t in [*content, ""]]  # fmt: skip
        response = {
            "id": f"chatcmpl-{len(self.decoded)}",
            "object": "chat.completion",
            "created": 1760000000,
            "model": "policy",
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": content, "refusal": None,
                            "tool_calls": [], "reasoning_content": None},
                "logprobs": {"content": entries},
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": gen,
            }],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(gen),
                      "total_tokens": len(prompt) + len(gen)},
            "prompt_logprobs": None,
            "prompt_token_ids": prompt,
            "kv_transfer_params": None,
        }  # fmt: skip
        return httpx.Response(200, text=json.dumps(response),
                              headers={"content-type": "application/json"})  # fmt: skip


class Sink:
    """Token entries by id (the data plane's `token_entries`)."""

    def __init__(self) -> None:
        self.entries = {}

    def put(self, entry) -> bool:
        new = entry.entry_id not in self.entries
        self.entries[entry.entry_id] = entry
        return new

    def get(self, entry_id: str):
        return self.entries.get(entry_id)


class ReplayStore(MemoryStore):
    """The StagingStore's async API over a dict, with leases that expire as a shard's do."""

    def __init__(self) -> None:
        super().__init__()
        self.leases: dict[str, tuple[list[str], float]] = {}

    def _expire(self) -> None:
        now = asyncio.get_running_loop().time()
        for lease_id in [k for k, (_, until) in self.leases.items() if until <= now]:
            del self.leases[lease_id]

    async def alist(self, partition: str, prefix: str = "") -> list[str]:
        return sorted(k for p, k in self.rows if p == partition and k.startswith(prefix))

    async def alease(self, partition: str, consumer: str, max_rows: int, ttl_s: float):
        self._expire()
        held = {k for keys, _ in self.leases.values() for k in keys}
        keys = [k for p, k in sorted(self.rows) if p == partition and k not in held][:max_rows]
        lease_id = uuid.uuid4().hex
        if keys:
            self.leases[lease_id] = (keys, asyncio.get_running_loop().time() + ttl_s)
        table = pa.concat_tables([self.rows[(partition, k)] for k in keys]) if keys else None
        return LeaseResult(lease_id, table if table is not None else _empty_replay())

    async def aack(self, lease_id: str) -> int:
        self._expire()
        keys, _ = self.leases.pop(lease_id, ([], 0.0))
        for key in keys:
            del self.rows[("replay", key)]
        return len(keys)


def _empty_replay() -> pa.Table:
    from rollout_recovery.data_plane import replay_rows_to_table

    return replay_rows_to_table([])


def _runner(vllm: ScriptedVllm, store: ReplayStore, sink: Sink, supply: bool) -> EpisodeRunner:
    flag = "true" if supply else "false"
    cfg = load_config(None, [f"token_capture.supply_prefix_token_ids={flag}"])
    info = SimpleNamespace(url="http://worker", served_model_name="policy", eos_token_id=EOT)
    runner = EpisodeRunner(cfg.environment_config(), WorkerPool([SimpleNamespace(info=info)]),
                           store)  # fmt: skip
    runner.reward_fn = None  # the harness's result is the reward
    runner.gateway_url = "http://gateway"
    [client] = runner.dispatch.clients
    client.sink = sink
    client.client = httpx.AsyncClient(transport=httpx.MockTransport(vllm.handle))
    return runner


class Gateway:
    """A standalone gateway over its own runner, served by the real app (in this loop)."""

    def __init__(self, vllm: ScriptedVllm, store: ReplayStore, sink: Sink, supply: bool = True):
        self.vllm, self.store, self.sink = vllm, store, sink
        self.runner = _runner(vllm, store, sink, supply)
        self.backend = StandaloneGateway(self.runner, asyncio.get_running_loop(), 0)
        transport = httpx.ASGITransport(app=create_app(self.backend))
        self.http = httpx.AsyncClient(transport=transport, base_url="http://gateway")

    async def open(self, group: str = "q") -> dict:
        resp = await self.http.post("/rollouts", json={"group_id": group, "task": TASK})
        assert resp.status_code == 200, resp.text
        return resp.json()

    async def chat(self, rid: str, messages: list[dict], **fields) -> httpx.Response:
        body = {"model": "policy", "messages": messages, **fields}
        return await self.http.post(f"/rollouts/{rid}/v1/chat/completions", json=body)

    async def finish(self, rid: str, result=1.0) -> httpx.Response:
        return await self.http.post(f"/rollouts/{rid}/finish", json={"result": result})

    async def listing(self) -> dict:
        return (await self.http.get("/rollouts")).json()

    def counts(self) -> dict[str, int]:
        return self.runner.diagnostics()

    async def crash_and_restore(self) -> Gateway:
        """Checkpoint every open rollout (through a ledger's wire form: sorted keys), lose this
        gateway, and load the snapshot into a fresh one, as `gateway --restore` does."""
        wire = [json.dumps(st.to_record(None).model_dump(mode="json"), sort_keys=True)
                for st in self.runner.episodes.values()]  # fmt: skip
        await self.aclose()
        fresh = Gateway(ScriptedVllm(self.vllm.re_renders_history), self.store, self.sink)
        restored = [EpisodeState.from_record(EpisodeRecord.model_validate_json(w), self.sink.get)
                    for w in wire]  # fmt: skip
        fresh.runner.participant.restore("restore-1")
        await fresh.runner.load("restore-1", restored)
        return fresh

    async def aclose(self) -> None:
        await self.backend.outside.aclose()
        await self.http.aclose()


def _assistant(resp: httpx.Response) -> dict:
    message = resp.json()["choices"][0]["message"]
    return {"role": "assistant", "content": message["content"]}


async def _two_calls(gw: Gateway, rid: str) -> tuple[list[dict], httpx.Response]:
    """The harness's first call, and its second continuing the first."""
    first = await gw.chat(rid, ASK)
    assert first.status_code == 200, first.text
    second_messages = [*ASK, _assistant(first), {"role": "user", "content": "Go on."}]
    return second_messages, first


# ---------------------------------------------------------------- 1 and 4: listing, restored


async def test_the_listing_shows_restored_rollouts_and_a_start_over_is_not_restored():
    store, sink = ReplayStore(), Sink()
    gw = Gateway(ScriptedVllm(), store, sink)
    opened = await gw.open()
    rid = opened["rollout_id"]
    assert (rid, opened["restored"], opened["attempt"]) == ("q-g0", False, 0)
    await gw.chat(rid, ASK)
    assert await gw.listing() == {"rollouts": [rid], "details": [
        {"rollout_id": rid, "state": "running", "attempt": 0, "journaled_steps": 0}]}  # fmt: skip

    gw = await gw.crash_and_restore()
    # Announced by the restore, before any harness opened it again.
    assert await gw.listing() == {"rollouts": [rid], "details": [
        {"rollout_id": rid, "state": "restored", "attempt": 1, "journaled_steps": 1}]}  # fmt: skip
    again = await gw.open()
    assert (again["restored"], again["attempt"], again["journaled_steps"]) == (True, 1, 1)
    assert (await gw.listing())["details"][0]["state"] == "running"

    # The harness asks for another call than it made: the rollout starts over.
    diverged = await gw.chat(rid, [{"role": "user", "content": "Something else."}])
    assert diverged.status_code == 409 and diverged.headers[REASON] == "replay_diverged"
    over = {"rollout_id": rid, "state": "started_over", "attempt": 2, "journaled_steps": 0}
    assert await gw.listing() == {"rollouts": [rid], "details": [over]}
    fresh = await gw.open()
    assert (fresh["restored"], fresh["attempt"], fresh["journaled_steps"]) == (False, 2, 0)
    assert gw.counts()["replay_diverged.step_request"] == 1
    assert gw.counts()["restored_episodes"] == 1  # the start over is not a restored episode
    first = await gw.chat(rid, ASK)
    assert first.headers[SOURCE] == "decoded" and first.headers["x-rollout-recovery-attempt"] == "2"
    assert (await gw.finish(rid)).status_code == 200
    assert await gw.listing() == {"rollouts": [], "details": []}
    await gw.aclose()


# ---------------------------------------------------------------- 5: byte-identical replays


@pytest.mark.parametrize("stream", [False, True])
async def test_a_replayed_answer_is_the_first_answer_byte_for_byte(stream):
    store, sink = ReplayStore(), Sink()
    gw = Gateway(ScriptedVllm(), store, sink)
    rid = (await gw.open())["rollout_id"]
    fields = {"stream": True, "logprobs": True} if stream else {}
    first = await gw.chat(rid, ASK, **fields)
    assert first.status_code == 200 and first.headers[SOURCE] == "decoded"
    gw = await gw.crash_and_restore()
    await gw.open()
    replayed = await gw.chat(rid, ASK, **fields)
    assert replayed.headers[SOURCE] == "journal" and gw.vllm.decoded == []
    assert replayed.content == first.content
    if not stream:  # the worker's key order, not a sorted one
        assert list(replayed.json()["choices"][0]["message"])[:2] == ["role", "content"]
    await gw.aclose()


def test_a_journal_that_kept_the_parsed_response_is_still_answered():
    """A record written before the journal kept the body as text holds the parsed object."""
    from rollout_recovery.environment.context import reply_of
    from tests.unit.episode_helpers import entry

    response = {"choices": [{"message": {"content": "ok", "role": "assistant"}}], "id": "x"}
    result = {"message": {"role": "assistant", "content": "ok"}, "response": response}
    reply = reply_of(entry("c0", [1], [2]), result, "journal")
    assert reply.response == response and reply.response_text is None
    text = json.dumps(response)
    reply = reply_of(entry("c0", [1], [2]), {**result, "response": text}, "journal")
    assert reply.response == response and reply.response_text == text


# ---------------------------------------------------------------- 2: acknowledging leases


async def test_acknowledging_a_lease_that_expired_or_never_existed_is_409():
    store, sink = ReplayStore(), Sink()
    gw = Gateway(ScriptedVllm(), store, sink)

    async def ack(lease_id: str) -> httpx.Response:
        return await gw.http.post("/replay/ack", json={"lease_id": lease_id})

    unknown = await ack("no-such-lease")
    assert unknown.status_code == 409 and unknown.headers[REASON] == "unknown_lease"
    assert unknown.json()["error"]["code"] == "unknown_lease"

    for group in ("a", "b"):
        rid = (await gw.open(group))["rollout_id"]
        await gw.chat(rid, ASK)
        assert (await gw.finish(rid)).status_code == 200
    short = (await gw.http.post("/replay/lease", json={"max_rows": 1, "ttl_s": 0.05})).json()
    assert len(short["rows"]) == 1
    await asyncio.sleep(0.1)
    expired = await ack(short["lease_id"])
    assert expired.status_code == 409 and expired.headers[REASON] == "unknown_lease"

    lease = (await gw.http.post("/replay/lease", json={"max_rows": 4})).json()
    assert len(lease["rows"]) == 2  # the expired lease's row was delivered again
    assert (await ack(lease["lease_id"])).json() == {"acked": 2}
    assert (await ack(lease["lease_id"])).json() == {"acked": 0}  # a second ack, as before
    empty = (await gw.http.post("/replay/lease", json={"max_rows": 4})).json()
    assert empty["rows"] == [] and (await ack(empty["lease_id"])).json() == {"acked": 0}
    await gw.aclose()


# ---------------------------------------------------------------- 3: refused at the call


def _edited(messages: list[dict]) -> list[dict]:
    """The second call's messages with the first answer changed by the harness."""
    out = [dict(m) for m in messages]
    out[1]["content"] += " "
    return out


CASES = {
    # (supply, template re-renders history): how the second call is made -> its reason
    "restarted": (True, False, lambda m, f: [{"role": "user", "content": "Another question."}],
                  "conversation_restarted", "open another rollout"),
    "edited_with_supply": (True, False, lambda m, f: _edited(m), "assistant_turn_changed",
                           "send them back exactly"),
    "edited_without_supply": (False, False, lambda m, f: _edited(m), "assistant_turn_changed",
                              "supply_prefix_token_ids=true"),
    "re_rendered_without_supply": (False, True, lambda m, f: m, "prompt_not_continued",
                                   "here it did not: set it to true"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
async def test_a_call_that_does_not_continue_the_last_is_refused_at_that_call(case):
    supply, re_renders, second, reason, hint = CASES[case]
    gw = Gateway(ScriptedVllm(re_renders), ReplayStore(), Sink(), supply=supply)
    rid = (await gw.open())["rollout_id"]
    messages, first = await _two_calls(gw, rid)
    refused = await gw.chat(rid, second(messages, first))
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == (reason, "messages")
    assert refused.headers[REASON] == reason and refused.headers["x-should-retry"] == "false"
    assert hint in error["message"]
    assert gw.counts()[f"capture.not_continued.{reason}"] == 1
    assert set(gw.sink.entries) == {f"{rid}/c0/a0"}  # nothing of the refused call was kept
    # The rollout stays open: the corrected call is served, and the rollout finishes.
    if not re_renders or supply:
        again = await gw.chat(rid, messages)
        assert again.status_code == 200 and again.headers["x-rollout-recovery-call-id"] == "c1"
        done = await gw.finish(rid)
        assert done.status_code == 200 and done.json()["tokens"] > 0, done.text
    else:  # nothing the harness sends can continue it: it learns so at the call
        assert (await gw.chat(rid, messages)).headers[REASON] == reason
    await gw.aclose()


async def test_a_call_that_continues_an_earlier_call_than_the_last_is_refused_before_decoding():
    gw = Gateway(ScriptedVllm(), ReplayStore(), Sink())
    rid = (await gw.open())["rollout_id"]
    messages, first = await _two_calls(gw, rid)
    second = await gw.chat(rid, messages)
    assert second.status_code == 200
    branch = [*ASK, _assistant(first), {"role": "user", "content": "Go back."}]
    refused = await gw.chat(rid, branch)
    assert refused.status_code == 400 and refused.headers[REASON] == "earlier_call_continued"
    assert gw.vllm.decoded == ["c0", "c1"]  # refused before it reached the worker
    third = [*messages, _assistant(second), {"role": "user", "content": "And on."}]
    assert (await gw.chat(rid, third)).status_code == 200
    assert (await gw.finish(rid)).status_code == 200
    await gw.aclose()


async def test_with_supply_a_re_rendering_template_is_continued_exactly():
    """The same conversation that is refused without supply is one sequence with it."""
    gw = Gateway(ScriptedVllm(re_renders_history=True), ReplayStore(), Sink(), supply=True)
    rid = (await gw.open())["rollout_id"]
    messages, _ = await _two_calls(gw, rid)
    assert (await gw.chat(rid, messages)).status_code == 200
    assert (await gw.finish(rid)).status_code == 200
    assert not any(k.startswith("capture.not_continued") for k in gw.counts())
    await gw.aclose()
