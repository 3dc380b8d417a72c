"""TokenEntry records, JSONL sink, and request-time lineage (pure logic)."""

from __future__ import annotations

import json

import pytest

from rollout_recovery.data_plane.digest import token_digest
from rollout_recovery.environment.lineage import (
    LineageStore,
    assistant_fingerprint,
    conversation_digest,
)
from rollout_recovery.environment.token_entry import (
    ParentResolution,
    TokenEntry,
    TokenEntryVersionError,
    read_token_entry,
)
from rollout_recovery.environment.token_sink import ConflictingEntryError, JsonlTokenSink

USER = {"role": "user", "content": "What is 2 + 3?"}
ANSWER = {"role": "assistant", "content": "The answer is 5."}
TOOL_CALL = {
    "role": "assistant",
    "content": "hi",
    "tool_calls": [
        {
            "id": "x",
            "type": "function",
            "function": {"name": "add", "arguments": '{"b": 2, "a": 1}'},
        }
    ],
}


def _entry(**kw) -> TokenEntry:
    base = dict(
        rollout_id="r1",
        model_call_id="c0",
        prompt_token_ids=[1, 2, 3],
        generated_token_ids=[7, 8],
        generated_logprobs=[-0.5, -1.25],
        parent_resolution=ParentResolution.ROOT,
    )
    return TokenEntry.build(**(base | kw))


def test_golden_fingerprints_and_digests():
    assert assistant_fingerprint(TOOL_CALL) == (
        "f26eab04a719e1414e0c25f48a9d46fd15adcaf58643b01e243775a3bafbafe1"
    )
    assert assistant_fingerprint(ANSWER) == (
        "8c4cd8dd158d51d15e628dc58d102b893428c6475a5eb8553cb100862785073d"
    )
    assert conversation_digest([USER, ANSWER]) == (
        "7bf649a5e32d32e3c2cc75434275e3733a41f3b4b9921ba01511a2622fae995a"
    )
    assert (
        conversation_digest(
            [
                {"role": "system", "content": None},
                {"role": "tool", "content": "3", "tool_call_id": "x"},
            ]
        )
        == "2d01c44675e947a99f8952cce5ea8a33eaa1948eaf51ce5969cfdcd470de8a88"
    )
    # Argument order and tool-call ids do not change the fingerprint; content does.
    reordered = json.loads(json.dumps(TOOL_CALL))
    reordered["tool_calls"][0]["function"]["arguments"] = '{"a": 1, "b": 2}'
    reordered["tool_calls"][0]["id"] = "other"
    assert assistant_fingerprint(reordered) == assistant_fingerprint(TOOL_CALL)
    assert assistant_fingerprint(ANSWER | {"content": "The answer is 6."}) != (
        assistant_fingerprint(ANSWER)
    )


def test_entry_validators():
    e = _entry()
    assert e.cumulative_len == 5 and e.cumulative_digest == token_digest([1, 2, 3, 7, 8]).hex()
    with pytest.raises(ValueError, match="equal length"):
        _entry(generated_logprobs=[-0.5])
    with pytest.raises(ValueError, match="needs parent_call_id"):
        _entry(parent_resolution=ParentResolution.RESOLVED)
    with pytest.raises(ValueError, match="must not name a parent"):
        _entry(parent_call_id="c9")
    with pytest.raises(ValueError, match="must not name a parent"):
        _entry(parent_resolution=ParentResolution.UNRESOLVED, parent_call_id="c9")
    with pytest.raises(ValueError, match="cumulative_digest"):
        TokenEntry(**(_entry().model_dump() | {"cumulative_digest": "00" * 32}))
    with pytest.raises(ValueError, match="prefix_supplied requires"):
        _entry(prefix_supplied=True)
    with pytest.raises(ValueError):
        _entry(rollout_id="bad id")
    ok = _entry(
        parent_resolution=ParentResolution.RESOLVED, parent_call_id="c9", prefix_requested=True
    )
    assert ok.parent_call_id == "c9" and not ok.prefix_supplied


def test_old_records_load_and_newer_are_refused():
    v1 = {"schema_version": 1, "rollout_id": "r", "model_call_id": "c", "prompt_token_ids": [1],
          "generated_token_ids": [2], "generated_logprobs": [-1.0]}  # fmt: skip
    e1 = read_token_entry(v1)
    assert e1.parent_resolution == ParentResolution.UNRESOLVED and not e1.prefix_requested
    v2 = v1 | {"schema_version": 2, "parent_call_id": "c0", "cumulative_len": 2,
               "cumulative_digest": token_digest([1, 2]).hex()}  # fmt: skip
    e2 = read_token_entry(json.dumps(v2))
    assert e2.parent_resolution == ParentResolution.RESOLVED and e2.parent_call_id == "c0"
    v3 = v1 | {"schema_version": 3, "parent_resolution": "ROOT"}
    assert read_token_entry(v3).parent_resolution == ParentResolution.ROOT
    v4 = v1 | {"schema_version": 4, "prefix_requested": True}
    assert read_token_entry(v4).generated_weight_versions is None
    v5 = v1 | {"schema_version": 5, "generated_weight_versions": [[2, 0, 1]]}
    assert read_token_entry(v5).generated_weight_versions == [(2, 0, 1)]
    with pytest.raises(ValueError, match=r"does not continue at 0"):
        read_token_entry(v5 | {"generated_weight_versions": [[2, 1, 2]]})
    with pytest.raises(TokenEntryVersionError, match="upgrade the reader"):
        read_token_entry(v1 | {"schema_version": 6})
    with pytest.raises(TokenEntryVersionError, match="below this reader's floor"):
        read_token_entry(v1 | {"schema_version": 0})


def test_jsonl_sink_is_durable_idempotent_and_refuses_conflicts(tmp_path):
    path = tmp_path / "entries.jsonl"
    sink = JsonlTokenSink(path)
    e = _entry()
    assert sink.put(e) is True
    assert sink.put(_entry()) is False  # identical bytes: no-op
    with pytest.raises(ConflictingEntryError, match="r1/c0/a0"):
        sink.put(_entry(generated_logprobs=[-0.5, -1.0]))
    sink.mark_incomplete("r2", "c1", "worker_lost")
    sink.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 2  # one entry, one incomplete marker; the refused put wrote nothing
    # A crash mid-append leaves a torn last line: reopening drops it and keeps the rest.
    with open(path, "ab") as fh:
        fh.write(b'{"kind": "entry", "entr')
    again = JsonlTokenSink(path)
    assert again.torn_tail and again.get("r1/c0/a0") == e
    assert again.incomplete() == [("r2", "c1", "worker_lost")]
    assert again.put(_entry(model_call_id="c1")) is True
    again.close()
    assert len(path.read_text().splitlines()) == 3


def test_lineage_root_resolved_unresolved_and_retries():
    store = LineageStore()
    assert store.resolve("r1", [USER]).outcome == ParentResolution.ROOT
    assert store.resolve("r1", [USER, ANSWER, USER]).reason == "no_match"
    store.record("r1", "c0", [USER], ANSWER, [1, 2, 3, 4])
    res = store.resolve("r1", [USER, ANSWER, {"role": "user", "content": "and 4?"}])
    assert res.outcome == ParentResolution.RESOLVED
    assert res.parent_call_id == "c0" and res.parent_tokens == (1, 2, 3, 4)
    # Another rollout never sees this one's calls.
    assert store.resolve("r2", [USER, ANSWER]).reason == "no_match"
    # An identical retry (same tokens) collapses to the first call.
    store.record("r1", "c0-retry", [USER], ANSWER, [1, 2, 3, 4])
    assert store.resolve("r1", [USER, ANSWER]).parent_call_id == "c0"
    # Same text, different tokens: ambiguous, never guessed.
    store.record("r1", "c0-other", [USER], ANSWER, [1, 2, 3, 9])
    assert store.resolve("r1", [USER, ANSWER]).reason == "ambiguous"
    # The conversation digest matters, not only the assistant turn.
    other_user = {"role": "user", "content": "What is 1 + 4?"}
    assert store.resolve("r1", [other_user, ANSWER]).reason == "no_match"
    stats = store.stats()
    assert stats["resolve.ROOT"] == 1 and stats["resolve.ambiguous"] == 1


def test_lineage_bad_input_and_lookup_errors():
    store = LineageStore()
    with pytest.raises(ValueError, match="malformed message"):
        store.resolve("r1", [{"content": "no role"}])
    with pytest.raises(ValueError, match="non-empty list"):
        store.resolve("r1", [])
    bad_args = json.loads(json.dumps(TOOL_CALL))
    bad_args["tool_calls"][0]["function"]["arguments"] = "{not json"
    with pytest.raises(ValueError, match="JSON object string"):
        store.resolve("r1", [USER, bad_args])

    class Broken(LineageStore):
        def _resolve(self, rollout_id, messages):
            raise RuntimeError("index corrupted")

    res = Broken().resolve("r1", [USER, ANSWER])
    assert res.outcome == ParentResolution.UNRESOLVED and res.reason == "lookup_error"


def test_lineage_memory_is_bounded():
    store = LineageStore(max_rollouts=3, max_tokens=1000)
    for i in range(5):
        store.record(f"r{i}", "c0", [USER], ANSWER, list(range(100)))
    assert store.stats()["rollouts"] == 3 and store.evicted_rollouts == 2
    assert store.resolve("r0", [USER, ANSWER]).reason == "no_match"  # evicted
    assert store.resolve("r4", [USER, ANSWER]).outcome == ParentResolution.RESOLVED
    store.record("big", "c0", [USER], ANSWER, list(range(950)))
    assert store.stats()["tokens"] <= 1000
