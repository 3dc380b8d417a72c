"""Episode functions replayed from their journal, episode records, and the training row of a
multi-turn episode (pure logic: a scripted model stands in for the workers; the real engine
path is tests/engine/test_rollout_environment.py)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import numpy as np
import pytest

from rollout_recovery.config import load_config
from rollout_recovery.environment.context import (
    EpisodeContext,
    JournalDiverged,
    NotJsonError,
)
from rollout_recovery.environment.episode import (
    EpisodeState,
    RecordError,
    TrajectoryError,
    call_seed,
    replay_row,
)
from rollout_recovery.environment.rollout_env import RolloutEnvironment
from rollout_recovery.environment.token_sink import JsonlTokenSink
from rollout_recovery.episodes import tally
from rollout_recovery.generation.pool import WorkerPool
from rollout_recovery.protocol import Continuation, EpisodeRecord
from tests.unit.episode_helpers import ScriptedModel as ScriptedModelBase
from tests.unit.episode_helpers import entry, new_state, restored, run_episode

TASK = {"messages": [{"role": "user", "content": "go"}]}
REPLIES = ["a1", "7b", "42"]


_entry = entry


def ScriptedModel() -> ScriptedModelBase:
    return ScriptedModelBase(REPLIES)


def _run(st: EpisodeState, model, counts: Counter, fn=tally.episode, turns=3):
    return run_episode(fn, st, model, turns, None, counts)


def _state() -> EpisodeState:
    return new_state(TASK)


def _finished() -> tuple[EpisodeState, dict]:
    st = _state()
    result = _run(st, ScriptedModel(), Counter())
    return st, result


_restored = restored


def test_an_episode_journals_each_call_and_effect_in_order():
    st, counts = _state(), Counter()
    model = ScriptedModel()
    result = _run(st, model, counts)
    assert [(s.kind, s.name) for s in st.journal] == [
        ("chat", "c0"), ("effect", "tally"), ("chat", "c1"), ("effect", "tally"), ("chat", "c2")
    ]  # fmt: skip
    assert result == {"text": "a17b42", "tally": 2 + 2, "effects": [0, 1]}
    assert model.decoded == ["c0", "c1", "c2"] and counts["effects.executed"] == 2


@pytest.mark.parametrize("steps", [1, 2, 3, 4])
def test_a_replay_answers_the_journal_and_decodes_only_what_follows(steps):
    """No committed call is decoded again and no journaled effect runs again; the result is
    the uninterrupted one. Replaying with the journal ignored decodes everything: the counts
    tell the two apart although the results are the same."""
    st, reference = _finished()
    back, counts, model = _restored(st, steps), Counter(), ScriptedModel()
    assert back.attempt == 1
    assert _run(back, model, counts) == reference
    committed = sum(1 for s in st.journal[:steps] if s.kind == "chat")
    assert model.adopted == [f"c{i}" for i in range(committed)]
    assert model.decoded == [f"c{i}" for i in range(committed, 3)]
    effects = sum(1 for s in st.journal[:steps] if s.kind == "effect")
    assert counts["effects.replayed"] == effects and counts["effects.executed"] == 2 - effects
    ignored, model = _restored(st, steps), ScriptedModel()
    ignored.replay = []
    assert _run(ignored, model, Counter()) == reference and len(model.decoded) == 3


def test_a_replay_that_asks_for_other_steps_diverges_with_a_named_reason():
    st, _ = _finished()

    async def other_prompt(ctx, task):
        await ctx.chat([{"role": "user", "content": "something else"}])

    async def effect_first(ctx, task):
        await ctx.effect("tally", tally.add_to_tally, 0, 0, "")

    async def other_effect(ctx, task):
        reply = await ctx.chat(list(task["messages"]), ignore_eos=False)
        await ctx.effect("notes", tally.add_to_tally, 0, 0, reply.content)

    for fn, reason in ((other_prompt, "step_request"), (effect_first, "step_kind"),
                       (other_effect, "step_name")):  # fmt: skip
        with pytest.raises(JournalDiverged) as err:
            _run(_restored(st, 2), ScriptedModel(), Counter(), fn)
        assert err.value.reason == reason


def test_effects_need_json_arguments_and_results_and_keep_their_id_on_replay():
    ids: list[str | None] = []

    async def episode(ctx, task):
        await ctx.effect("a", lambda: ids.append(ctx.effect_id) or 1)
        await ctx.chat(list(task["messages"]))
        await ctx.effect("b", lambda: ids.append(ctx.effect_id) or 2)
        return ctx.random()

    st = _state()
    value = _run(st, ScriptedModel(), Counter(), episode)
    back = _restored(st, 2)  # effect a and the call are journaled; effect b runs again
    assert _run(back, ScriptedModel(), Counter(), episode) == value
    assert ids == ["r-g0/start-0/step-0", "r-g0/start-0/step-2", "r-g0/start-0/step-2"]

    async def bad_args(ctx, task):
        await ctx.effect("x", print, object())

    async def bad_result(ctx, task):
        await ctx.effect("x", object)

    for fn in (bad_args, bad_result):
        with pytest.raises(NotJsonError):
            _run(_state(), ScriptedModel(), Counter(), fn)


def test_the_row_masks_every_turns_generated_tokens():
    st, _ = _finished()
    row = replay_row(st, reward=0.5, weight_version=3)
    assert row.token_ids.tolist() == [1, 2, 3, 10, 2, 4, 11, 2, 5, 12, 2]
    assert row.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 1, 1, 0, 1, 1]
    assert row.prompt_len == 3 and row.key == "r/000" and row.weight_version_max == 3
    np.testing.assert_array_equal(row.logprobs[3:5], np.float32([-0.5, -1.5]))


def test_the_row_records_each_generated_tokens_weight_version_at_its_place():
    """Three turns of two tokens at positions 3, 6 and 9; weights switched in the second turn.
    One call without spans (a worker that reported none) leaves the row without spans, on
    the version the episode started on."""
    st, _ = _finished()
    spans = [[(1, 0, 2)], [(1, 0, 1), (2, 1, 2)], [(2, 0, 2)]]
    st.turns = [e.model_copy(update={"generated_weight_versions": s})
                for e, s in zip(st.turns, spans, strict=True)]  # fmt: skip
    row = replay_row(st, reward=0.5, weight_version=1)
    assert row.weight_versions == [(1, 3, 5), (1, 6, 7), (2, 7, 8), (2, 9, 11)]
    assert (row.weight_version_min, row.weight_version_max) == (1, 2)
    st.turns[1] = st.turns[1].model_copy(update={"generated_weight_versions": None})
    row = replay_row(st, reward=0.5, weight_version=1)
    assert row.weight_versions is None
    assert (row.weight_version_min, row.weight_version_max) == (1, 1)


def test_a_turn_whose_tokens_were_re_rendered_fails_closed():
    st, _ = _finished()
    st.turns[1] = _entry("c1", [1, 2, 3, 10, 99, 2, 4], [11, 2])  # history re-tokenized
    with pytest.raises(TrajectoryError, match="supply_prefix_token_ids"):
        replay_row(st, 0.0, 0)
    with pytest.raises(TrajectoryError, match="no model call"):
        replay_row(_state(), 0.0, 0)


def test_records_round_trip_with_their_entries_from_the_data_plane():
    st, _ = _finished()
    cont = Continuation(call_id="c3", attempt=0, keys=["k"], tokens=4)
    entries = {e.entry_id: e for e in st.turns}
    wire = json.loads(json.dumps(st.to_record(cont).model_dump(mode="json")))
    assert "prompt_token_ids" not in json.dumps(wire)  # tokens stay in the data plane
    record = EpisodeRecord.model_validate(wire)
    back = EpisodeState.from_record(record, entries.get)
    assert back.replay == st.journal and back.replay_turns == st.turns
    assert back.continuation == cont and back.attempt == 1 and back.journal == []
    with pytest.raises(RecordError, match="record_format"):
        EpisodeState.from_record(EpisodeRecord.model_validate({**wire, "format": 1}), entries.get)
    with pytest.raises(RecordError, match="missing_entry: r-g0/c1/a0"):
        EpisodeState.from_record(record, {"r-g0/c0/a0": st.turns[0]}.get)
    changed = _entry("c0", [1, 2, 3], [10, 11, 12])
    with pytest.raises(RecordError, match="entry_digest_mismatch"):
        EpisodeState.from_record(record, {**entries, "r-g0/c0/a0": changed}.get)


def test_a_record_that_cannot_be_restored_starts_over_in_the_environment(tmp_path):
    env = RolloutEnvironment(load_config(None, []).environment_config(), WorkerPool([]), None,
                             None)  # fmt: skip
    try:
        env.runner.sink = JsonlTokenSink(tmp_path / "entries.jsonl")  # holds none of the entries
        env.begin_restore("r1")
        st, _ = _finished()
        assert env.end_restore("r1", [st.to_record(None)]) == 1
        back = env.runner.pending["r-g0"]
        assert back.replay == [] and back.restarts == 1 and back.attempt == 1
        assert env.counters() == {"restore_refused.missing_entry": 1}
    finally:
        env.close()


def test_turn_seeds_are_distinct_and_turn_0_keeps_the_episode_seed():
    seeds = [call_seed(1234, t) for t in range(4)]
    assert seeds[0] == 1234 and len(set(seeds)) == 4
    assert seeds == [call_seed(1234, t) for t in range(4)] and all(0 <= s < 2**56 for s in seeds)


def test_a_record_keeps_the_moment_it_was_taken_while_the_episode_goes_on():
    """The call in flight at a checkpoint finishes and its effect runs while the record is on
    its way into the snapshot: the record must not see that step."""
    st, _ = _finished()
    st.journal, st.turns = st.journal[:2], st.turns[:1]
    record = st.to_record(None)
    st.journal.append(st.journal[0])
    st.journal[1].result["tally"] = 99
    assert len(record.journal) == 2 and record.journal[1].result["tally"] == 2


def test_the_readme_environment_runs_and_replays_with_each_note_once(tmp_path):
    """The complete environment the README shows, run as written: its notes are saved once
    per turn, and a replay from a checkpoint after the first note runs the second note's
    effect again, which its effect id absorbs."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    source = readme.split("```python\n# my_env.py")[1].split("```")[0]
    assert len(source.splitlines()) < 40
    env: dict = {}
    exec(compile("# my_env.py" + source, "my_env.py", "exec"), env)
    [task] = env["tasks"](1, seed=5)
    st, counts = EpisodeState("r-g0", "r", 0, 7, task), Counter()
    result = asyncio.run(env["episode"](EpisodeContext(st, ScriptedModel(), 3, tmp_path, counts),
                                        task))  # fmt: skip
    assert result == {"notes": ["a1", "7b"]} and counts["effects.executed"] == 2
    assert 0 < env["reward"](task, result) < 1
    back, model = _restored(st, 2), ScriptedModel()
    again = asyncio.run(env["episode"](EpisodeContext(back, model, 3, tmp_path, Counter()), task))
    assert again == result and model.decoded == ["c1", "c2"]
    stored = json.loads((tmp_path / "r-g0" / "start-0" / "notes.json").read_text())
    assert list(stored.values()) == ["a1", "7b"]


def test_a_restored_call_not_made_again_yet_keeps_its_continuation_at_a_checkpoint():
    """A restored episode whose in-flight call has not been made again (its harness is still
    starting, or it is replaying its journal) is checkpointed with that call's continuation,
    so the commit's sweep keeps its chunk rows. Dropping it lost the rows: the worker then
    refused the resume (missing_chunk), which only the engine records showed."""
    env = RolloutEnvironment(load_config(None, []).environment_config(), WorkerPool([]), None)
    try:
        st, _ = _finished()
        cont = Continuation(call_id="c1", attempt=0, keys=["r-g0/c1/a0/c000000"], tokens=4)
        back = EpisodeState.from_record(st.to_record(cont), {e.entry_id: e for e in st.turns}.get)
        back.replay = back.replay[:2]  # replayed up to its call, which is not made yet
        back.journal = list(back.replay)
        env.begin_restore("r1")
        env._loop.run(env.runner.load("r1", [back]))  # the call waits on its continuation
        env.runner.episodes[back.rollout_id] = env.runner.pending.pop(back.rollout_id)
        assert env.runner.calls.continuation(back.rollout_id) == cont
        env.prepare("k1", lease_s=60)
        [record] = env.commit("k1").episodes
        assert record.continuation == cont
    finally:
        env.close()


class _Staging:
    """The store's staging partition as the environment's sweep sees it."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = list(keys)

    async def alist(self, partition: str) -> list[str]:
        return list(self.keys)

    async def adelete(self, partition: str, keys: list[str]) -> None:
        self.keys = [k for k in self.keys if k not in keys]


class _HeldClient:
    """A worker call that stays in flight until released."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def call(self, *args, **kwargs):
        await self.release.wait()
        raise RuntimeError("released")


def test_the_rows_a_restored_call_resumes_from_survive_checkpoints_until_it_ends():
    """A restored call parked by a checkpoint (admission closed) and then in flight: every
    commit in between keeps the chunk rows its continuation names. Popping the continuation
    before parking let the sweep delete them (the worker refused: missing_chunk)."""
    from rollout_recovery.environment.runner import EpisodeRunner

    key = "r-g0/c1/a0/c000000"
    cfg = load_config(
        None, ["rollout_recovery.target_level=turn", "checkpointing.save_data_plane=true"]
    ).environment_config()

    st, _ = _finished()

    async def scenario() -> list[list[str]]:
        staging = _Staging([key, "r-g9/c0/a0/c000000"])  # the second: a dead call's row
        runner = EpisodeRunner(cfg, WorkerPool([]), staging)
        runner.dispatch.clients = [_HeldClient()]
        st.journal, st.turns = st.journal[:2], st.turns[:1]
        st.attempt = 1
        cont = Continuation(call_id="c1", attempt=0, keys=[key], tokens=4, digest="00")
        runner.calls.wait_on(st.rollout_id, cont, moved=False)
        runner.episodes[st.rollout_id] = st
        seen = []
        await runner.prepare("k1", lease_s=60)  # admission closed
        call = asyncio.create_task(runner.dispatch.call(st, [{"role": "user", "content": "x"}], {}))
        await asyncio.sleep(0.05)  # parked
        records = await runner.commit("k1")
        seen.append(list(staging.keys))
        assert records.continuations[st.rollout_id].keys == [key]
        runner.participant.reopen("k1")
        await asyncio.sleep(0.05)  # now in flight, resuming from the rows
        assert runner.calls.get(st.rollout_id).in_flight
        await runner.prepare("k2", lease_s=60)
        await runner.commit("k2")
        seen.append(list(staging.keys))
        runner.participant.reopen("k2")
        runner.dispatch.clients[0].release.set()
        with pytest.raises(RuntimeError, match="released"):
            await call
        await runner.prepare("k3", lease_s=60)
        await runner.commit("k3")  # the call ended: its rows may go
        seen.append(list(staging.keys))
        return seen

    assert asyncio.run(scenario()) == [[key], [key], []]
