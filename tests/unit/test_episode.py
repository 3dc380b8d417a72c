"""Episode records, the tally tool's once-per-turn effect, and the training row of a
multi-turn episode (pure logic)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rollout_recovery.config import load_config
from rollout_recovery.environment.episode import (
    Episode,
    RecordError,
    TallyTool,
    ToolEffectRepeated,
    TrajectoryError,
    TurnRecord,
    call_seed,
    replay_row,
)
from rollout_recovery.environment.rollout_env import RolloutEnvironment
from rollout_recovery.environment.token_entry import TokenEntry
from rollout_recovery.environment.token_sink import JsonlTokenSink
from rollout_recovery.generation.pool import WorkerPool
from rollout_recovery.protocol import Continuation, EpisodeRecord


def _entry(call: str, prompt: list[int], gen: list[int]) -> TokenEntry:
    return TokenEntry.build(
        rollout_id="r-g0",
        model_call_id=call,
        attempt=0,
        prompt_token_ids=prompt,
        generated_token_ids=gen,
        generated_logprobs=[-0.5 - i for i in range(len(gen))],
        finish_reason="stop",
    )


def _episode() -> Episode:
    tool = TallyTool()
    ep = Episode("r-g0", "r", 0, 7, [{"role": "user", "content": "go"}], tool.initial_state())
    first = _entry("c0", [1, 2, 3], [10, 11, 2])
    ep.messages.append({"role": "assistant", "content": "a1"})
    ep.turns.append(TurnRecord(first, 1))
    ep.messages.append({"role": "tool", "content": tool.apply(ep.state, 0, "a1")})
    second = _entry("c1", [*first.cumulative_ids(), 4, 5], [12, 2])
    ep.messages.append({"role": "assistant", "content": "7b"})
    ep.turns.append(TurnRecord(second, 3))
    return ep


def test_the_tally_tool_acts_once_per_turn():
    tool = TallyTool()
    state = tool.initial_state()
    assert json.loads(tool.apply(state, 0, "a 12")) == {"tally": 3}
    assert json.loads(tool.apply(state, 1, "none")) == {"tally": 4}
    with pytest.raises(ToolEffectRepeated, match="turn 1"):
        tool.apply(state, 1, "99")
    assert state == {"tally": 4, "effects": [0, 1]} and tool.applications == 2


def test_the_row_masks_every_turns_generated_tokens():
    row = replay_row(_episode(), reward=0.5, weight_version=3)
    assert row.token_ids.tolist() == [1, 2, 3, 10, 11, 2, 4, 5, 12, 2]
    assert row.loss_mask.tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert row.prompt_len == 3 and row.key == "r/000" and row.weight_version_max == 3
    np.testing.assert_array_equal(
        row.logprobs, np.float32([0, 0, 0, -0.5, -1.5, -2.5, 0, 0, -0.5, -1.5])
    )


def test_a_turn_whose_tokens_were_re_rendered_fails_closed():
    ep = _episode()
    drifted = _entry("c1", [1, 2, 3, 10, 99, 2, 4, 5], [12, 2])  # history re-tokenized
    ep.turns[1] = TurnRecord(drifted, 3)
    with pytest.raises(TrajectoryError, match="supply_prefix_token_ids"):
        replay_row(ep, 0.0, 0)


def test_records_round_trip_with_their_entries_from_the_data_plane():
    ep = _episode()
    ep.attempt = 2
    ep.continuation = Continuation(call_id="c2", attempt=2, keys=["k"], tokens=4)
    entries = {t.entry.entry_id: t.entry for t in ep.turns}
    wire = json.loads(json.dumps(ep.to_record().model_dump(mode="json")))
    assert "prompt_token_ids" not in json.dumps(wire)  # tokens stay in the data plane
    record = EpisodeRecord.model_validate(wire)
    back = Episode.from_record(record, entries.get)
    assert back == ep and back.next_call_id == "c2" and back.replies() == ["a1", "7b"]
    with pytest.raises(RecordError, match="record_format"):
        Episode.from_record(EpisodeRecord.model_validate({**wire, "format": 99}), entries.get)
    with pytest.raises(RecordError, match="missing_entry: r-g0/c1/a0"):
        Episode.from_record(record, {"r-g0/c0/a0": ep.turns[0].entry}.get)
    changed = _entry("c0", [1, 2, 3], [10, 11, 12])
    with pytest.raises(RecordError, match="entry_digest_mismatch"):
        Episode.from_record(record, {**entries, "r-g0/c0/a0": changed}.get)


def test_a_record_that_cannot_be_restored_starts_over_in_the_environment(tmp_path):
    env = RolloutEnvironment(load_config(None, []), WorkerPool([]), None)
    try:
        env.runner.sink = JsonlTokenSink(tmp_path / "entries.jsonl")  # holds none of the entries
        env.begin_restore("r1")
        assert env.end_restore("r1", [_episode().to_record()]) == 1
        ep = env.runner.pending["r-g0"]
        assert ep.turns == [] and ep.messages == [{"role": "user", "content": "go"}]
        assert ep.state == TallyTool.initial_state() and ep.continuation is None
        assert env.counters() == {"restore_refused.missing_entry": 1}
    finally:
        env.close()


def test_turn_seeds_are_distinct_and_turn_0_keeps_the_episode_seed():
    seeds = [call_seed(1234, t) for t in range(4)]
    assert seeds[0] == 1234 and len(set(seeds)) == 4
    assert seeds == [call_seed(1234, t) for t in range(4)] and all(0 <= s < 2**56 for s in seeds)


def test_a_record_keeps_the_moment_it_was_taken_while_the_episode_goes_on():
    """The call in flight at a checkpoint finishes and its tool acts while the record is on
    its way into the snapshot: the record must not see that turn's effect."""
    ep = _episode()
    record = ep.to_record()
    TallyTool().apply(ep.state, 1, "42")
    ep.messages.append({"role": "tool", "content": "later"})
    assert record.state == {"tally": 2, "effects": [0]} and len(record.messages) == 4
