"""Environment-side token capture against a real worker: lineage, exact prefix supply, proof.
Every test runs on both tiny models' chat templates (tests/engine/two_models.py)."""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass

import httpx
import pytest
from transformers import PreTrainedTokenizerBase

from rollout_recovery.environment.lineage import LineageStore
from rollout_recovery.environment.model_client import ModelCallClient, PrefixNotSuppliedError
from rollout_recovery.environment.token_entry import ParentResolution
from rollout_recovery.environment.token_sink import JsonlTokenSink
from rollout_recovery.generation.pool import WorkerHandle
from tests.engine.two_models import MODELS, end_of_sequence_ids, tokenizer

pytestmark = pytest.mark.engine


@dataclass(frozen=True)
class Served:
    """The worker a test calls and the model's end-of-turn token (<|im_end|> in both)."""

    worker: WorkerHandle
    tokenizer: PreTrainedTokenizerBase
    eos: int
    eos_ids: list[int]  # every id that ends a generation, `eos` first

    @property
    def url(self) -> str:
        return self.worker.info.url


def _turn(eos: int) -> dict:
    """Greedy, and the turn ends after a few tokens with `eos`."""
    return {"temperature": 0.0, "max_tokens": 16, "min_tokens": 6, "logit_bias": {str(eos): 100}}


@pytest.fixture(params=MODELS)
def served(request) -> Served:
    """tiny: the first of `two_workers` (token capture off); qwen3: its capture worker (prefix
    supply is the outermost layer, ahead of capture and resume), not two engines more."""
    if request.param == "tiny":
        worker = request.getfixturevalue("two_workers")[0]
        model_dir = request.getfixturevalue("tiny_model_dir")
    else:
        worker = request.getfixturevalue("qwen3_capture_worker")[0]
        model_dir = request.getfixturevalue("qwen3_model_dir")
    tok = tokenizer(model_dir)
    return Served(worker, tok, tok.eos_token_id, end_of_sequence_ids(model_dir))


def _client(url: str, tmp_path, **kw) -> ModelCallClient:
    return ModelCallClient(
        url, "policy", JsonlTokenSink(tmp_path / "entries.jsonl"), LineageStore(), **kw
    )


def _tool(result: str) -> dict:
    return {"role": "tool", "content": result, "tool_call_id": "call0"}


def test_three_turn_tool_conversation_has_no_drift(served, tmp_path):
    mc = _client(served.url, tmp_path, supply_prefix=True)
    turn, eos = _turn(served.eos), served.eos

    async def conversation():
        msgs = [{"role": "user", "content": "Use the add tool for 2 + 3, then report."}]
        results = []
        for i in range(3):
            r = await mc.call("conv", f"t{i}", msgs, **turn)
            results.append(r)
            msgs = [*msgs, r.assistant_message, _tool(str(5 + i))]
        return results

    results = asyncio.run(conversation())
    assert results[0].entry.parent_resolution == ParentResolution.ROOT
    for parent, child in itertools.pairwise(results):
        e = child.entry
        assert e.parent_resolution == ParentResolution.RESOLVED
        assert e.parent_call_id == parent.entry.model_call_id
        assert e.prefix_requested and e.prefix_supplied
        cum = parent.entry.cumulative_ids()
        assert e.prompt_token_ids[: len(cum)] == cum  # exactly the parent's tokens: no drift
        assert parent.entry.generated_token_ids[-1] == eos
    # The entries are durable in the sink and re-readable.
    sink = JsonlTokenSink(tmp_path / "entries.jsonl")
    assert sink.get("conv/t2/a0") == results[2].entry
    diag = mc.diagnostics.snapshot()
    assert diag["supply.supplied"] == 2 and diag["supply.eligible"] == 2
    assert diag["calls.total"] == 3 and diag["resolve.ROOT"] == 1


def test_a_turn_cut_by_the_length_limit_is_closed_and_continued_exactly(served, tmp_path):
    worker, eos = served.worker.info, served.eos
    assert worker.eos_token_id == eos
    mc = _client(worker.url, tmp_path, supply_prefix=True, turn_end_token_id=worker.eos_token_id)
    capped = {"temperature": 0.0, "max_tokens": 5, "logit_bias": {str(eos): -100}}

    async def conversation():
        msgs = [{"role": "user", "content": "Say something long."}]
        first = await mc.call("cap", "t0", msgs, **capped)
        msgs = [*msgs, first.assistant_message, _tool("ok")]
        second = await mc.call("cap", "t1", msgs, **_turn(eos))
        return first, second

    first, second = asyncio.run(conversation())
    assert first.entry.finish_reason == "length" and eos not in first.entry.generated_token_ids
    closed = [*first.entry.cumulative_ids(), eos]  # what the chat template closes it with
    assert second.entry.prefix_supplied and second.entry.prompt_token_ids[: len(closed)] == closed


def test_a_turn_stopped_short_of_its_end_is_closed_and_continued_exactly(served, tmp_path):
    """qwen3's generation config ends a generation on <|endoftext|> as well as on <|im_end|>,
    and a request may stop on a stop token of its own; the chat template closes every
    assistant turn with <|im_end|>. A parent stopped on another id than that is continued with
    its exact tokens and the closing token, as one cut by the length limit is."""
    worker, tok, end = served.worker.info, served.tokenizer, served.eos
    mc = _client(worker.url, tmp_path, supply_prefix=True, turn_end_token_id=worker.eos_token_id)
    word = tok.encode(" ok", add_special_tokens=False)[0]
    stops = [({}, eos) for eos in served.eos_ids] + [({"stop_token_ids": [word]}, word)]

    async def conversation(fields: dict, stop: int):
        msgs = [{"role": "user", "content": f"Stop on {stop}."}]
        first = await mc.call(f"stop{stop}", "t0", msgs, **_turn(stop), **fields)
        msgs = [*msgs, first.assistant_message, _tool("ok")]
        return stop, first, await mc.call(f"stop{stop}", "t1", msgs, **_turn(end))

    async def each():
        return [await conversation(fields, stop) for fields, stop in stops]

    for stop, first, second in asyncio.run(each()):
        assert first.entry.finish_reason == "stop"
        assert first.entry.generated_token_ids[-1] == stop
        closed = first.entry.cumulative_ids() + ([] if stop == end else [end])
        assert second.entry.prefix_supplied
        assert second.entry.prompt_token_ids[: len(closed)] == closed


def test_fork_gets_the_parents_prefix_and_ambiguity_is_not_supplied(served, tmp_path):
    mc = _client(served.url, tmp_path, supply_prefix=True)
    turn, eos = _turn(served.eos), served.eos
    user = {"role": "user", "content": "Pick a tool."}

    async def scenario():
        root = await mc.call("fork", "root", [user], **turn)
        base = [user, root.assistant_message]
        a = await mc.call("fork", "a", [*base, _tool("left")], **turn)
        b = await mc.call("fork", "b", [*base, _tool("right")], **turn)
        # Two recorded calls with the same text but different tokens: ambiguous.
        cum = root.entry.cumulative_ids()
        mc.lineage.record("amb", "x1", [user], root.assistant_message, cum)
        mc.lineage.record("amb", "x2", [user], root.assistant_message, [*cum[:-2], 7, eos])
        c = await mc.call("amb", "c", [*base, _tool("?")], **turn)
        return root, a, b, c

    root, a, b, c = asyncio.run(scenario())
    cum = root.entry.cumulative_ids()
    for child in (a, b):
        assert child.entry.parent_call_id == "root" and child.entry.prefix_supplied
        assert child.entry.prompt_token_ids[: len(cum)] == cum
    # Siblings do not see each other's turns.
    assert a.entry.prompt_token_ids[len(cum) :] != b.entry.prompt_token_ids[len(cum) :]
    assert c.resolution.reason == "ambiguous"
    assert not c.entry.prefix_requested and not c.entry.prefix_supplied
    assert c.entry.parent_call_id is None


def test_a_worker_that_ignores_the_prefix_is_caught(served, tmp_path):
    url, tok, eos = served.url, served.tokenizer, served.eos
    # The parent emits special tokens, which its text (skip_special_tokens) does not carry:
    # re-rendering that text cannot reproduce its tokens.
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    special = {**_turn(eos), "allowed_token_ids": [im_start, eos]}

    class DropPrefix(httpx.AsyncBaseTransport):
        """A worker front end that silently drops the required prefix."""

        def __init__(self) -> None:
            self.inner = httpx.AsyncHTTPTransport()

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if request.url.path.endswith("/chat/completions"):
                body = json.loads(request.content)
                body.pop("required_prefix_token_ids", None)
                request = httpx.Request(request.method, request.url, json=body)
            return await self.inner.handle_async_request(request)

    client = httpx.AsyncClient(transport=DropPrefix(), timeout=300)
    mc = _client(url, tmp_path, supply_prefix=True, client=client)
    user = {"role": "user", "content": "Use the add tool for 2 + 3, then report."}

    async def scenario():
        root = await mc.call("ign", "t0", [user], **special)
        text = root.assistant_message["content"]
        retok = tok(text, add_special_tokens=False)["input_ids"]
        assert retok != root.entry.generated_token_ids[:-1], "precondition: the text drifts"
        with pytest.raises(PrefixNotSuppliedError, match="supply_prefix_token_ids=false"):
            await mc.call("ign", "t1", [user, root.assistant_message, _tool("5")], **_turn(eos))

    asyncio.run(scenario())
    assert mc.diagnostics.snapshot()["supply.not_honoured"] == 1
    assert mc.sink.get("ign/t1/a0") is None  # nothing recorded for the failed call


def test_tokenize_with_the_prefix_matches_generation(served, tmp_path):
    url = served.url
    mc = _client(url, tmp_path, supply_prefix=True)
    turn = _turn(served.eos)
    user = {"role": "user", "content": "Use the add tool for 2 + 3, then report."}

    async def scenario():
        root = await mc.call("tok", "t0", [user], **turn)
        msgs = [user, root.assistant_message, _tool("5")]
        child = await mc.call("tok", "t1", msgs, **turn)
        body = {
            "model": "policy",
            "messages": msgs,
            "add_generation_prompt": True,
            "required_prefix_token_ids": root.entry.cumulative_ids(),
        }
        async with httpx.AsyncClient() as c:
            tok = (await c.post(f"{url}/tokenize", json=body)).json()
            plain_body = {k: v for k, v in body.items() if k != "required_prefix_token_ids"}
            plain = (await c.post(f"{url}/tokenize", json=plain_body)).json()
            bad = await c.post(
                f"{url}/v1/chat/completions",
                json={
                    "model": "policy",
                    "messages": msgs,
                    "max_tokens": 2,
                    "required_prefix_token_ids": [1, 2, 3, 99],
                },
            )
            comp = await c.post(
                f"{url}/v1/completions",
                json={"model": "policy", "prompt": "hi", "required_prefix_token_ids": [1, 2]},
            )
        return child, tok, plain, bad, comp

    child, tok, plain, bad, comp = asyncio.run(scenario())
    assert tok["tokens"] == child.entry.prompt_token_ids  # fallback sees the generation prompt
    assert plain["tokens"][-3:] == tok["tokens"][-3:]  # same new turns after the prefix
    assert bad.status_code == 400 and "end-of-turn" in bad.text
    assert comp.status_code == 400 and "completions" in comp.text
