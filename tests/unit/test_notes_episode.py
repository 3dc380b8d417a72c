"""The notes example episode on the real episode context (a scripted model stands in for
the workers): exactly-once effects on the store across a crash and a replay."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from rollout_recovery import faults
from rollout_recovery.episodes import notes
from tests.unit.episode_helpers import ScriptedModel, new_state, restored, run_episode

REPLIES = ["12 apples 7", "no digits here at all", "40 40 x", "9", "final 3"]
TURNS = len(REPLIES)
EFFECT_IDS = [f"r-g0/start-0/step-{i}" for i in (1, 3, 5, 7)]  # after each call but the last


def run(st, root: Path, counts: Counter | None = None, model=None) -> dict:
    return run_episode(notes.episode, st, model or ScriptedModel(REPLIES), TURNS, root, counts)


def crash_and_replay(tmp_path: Path) -> tuple[ScriptedModel, Counter, dict, dict]:
    """A reference run, then a run whose crash came after the second effect ran but before a
    checkpoint recorded it: the restored journal ends at the call before that effect."""
    task = notes.tasks(1, 0)[0]
    reference = run(new_state(task), tmp_path / "ref")
    first = new_state(task)
    run(first, tmp_path / "crash")  # ran every effect, then "crashed"
    back, model, counts = restored(first, 3), ScriptedModel(REPLIES), Counter()
    assert run(back, tmp_path / "crash", counts, model) == reference
    store = tmp_path / "crash" / "r-g0" / "start-0"
    ref = notes.store_summary(tmp_path / "ref" / "r-g0" / "start-0")
    return model, counts, ref, notes.store_summary(store)


def test_full_episode(tmp_path: Path) -> None:
    task = notes.tasks(1, 3)[0]
    result = run(new_state(task), tmp_path)
    assert result["notes"] == ["127", "nodigitshereatall", "4040", "9"]
    assert result["register"] == 10 + 0 + 8 + 9
    assert result["effects"] == EFFECT_IDS
    assert result["text"] == "\n".join(REPLIES)
    assert json.loads(json.dumps(result)) == result
    assert 0.0 <= notes.reward(task, result) <= 1.0
    store = tmp_path / "r-g0" / "start-0"
    assert notes.applied_exactly_once(store) == []
    summary = notes.store_summary(store)
    assert summary == {"notes": result["notes"], "register": 27, "dedupes": 0,
                       "ops": result["effects"]}  # fmt: skip


def test_replay_after_crash_absorbs_reexecuted_effect(tmp_path: Path) -> None:
    model, counts, ref, recovered = crash_and_replay(tmp_path)
    # The first effect and two calls came from the journal; the other three effects ran
    # again under their ids and the store absorbed them.
    assert model.adopted == ["c0", "c1"] and model.decoded == ["c2", "c3", "c4"]
    assert counts["effects.replayed"] == 1 and counts["effects.executed"] == 3
    assert recovered["dedupes"] == 3 and ref["dedupes"] == 0
    assert {k: v for k, v in recovered.items() if k != "dedupes"} == {
        k: v for k, v in ref.items() if k != "dedupes"
    }
    assert notes.applied_exactly_once(tmp_path / "crash" / "r-g0" / "start-0") == []


def test_dedupe_disabled_fault_is_caught(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(faults.ENV, "effect_dedupe_disabled")
    first = new_state(notes.tasks(1, 0)[0])
    run(first, tmp_path)
    run(restored(first, 3), tmp_path)
    store = tmp_path / "r-g0" / "start-0"
    violations = notes.applied_exactly_once(store)
    assert any("applied more than once" in v for v in violations), violations
    assert notes.store_summary(store)["dedupes"] == 0


def test_failed_write_leaves_old_state_and_no_temp_file(tmp_path: Path, monkeypatch) -> None:
    store = notes.NoteStore(tmp_path)
    store.append("r/e0", "12")
    before = (tmp_path / notes.STORE_FILE).read_bytes()

    def boom(*_: Any) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk gone"):
        store.append("r/e1", "34")
    assert (tmp_path / notes.STORE_FILE).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [notes.STORE_FILE]
    monkeypatch.undo()
    assert notes.applied_exactly_once(tmp_path) == []
    assert store.append("r/e1", "34")["register"] == 10


def test_a_write_cut_short_by_a_crash_leaves_nothing_once_its_effect_runs_again(tmp_path):
    """A SIGKILL between the temporary file and the rename leaves the temporary file; the
    effect never finished, so it runs again on replay, and that write removes it."""
    store = notes.NoteStore(tmp_path)
    store.append("r/e0", "12")
    (tmp_path / ".notes-killed.tmp").write_text('{"torn')
    assert notes.applied_exactly_once(tmp_path) != []
    store.append("r/e1", "34")
    assert notes.applied_exactly_once(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [notes.STORE_FILE]


def test_effect_needs_an_effect_id(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        notes.append_note(str(tmp_path), None, "1")


def test_tasks_deterministic_per_seed() -> None:
    assert notes.tasks(4, 1) == notes.tasks(4, 1)
    assert notes.tasks(4, 1) != notes.tasks(4, 2)
    assert len({t["messages"][0]["content"] for t in notes.tasks(8, 5)}) > 1
    for t in notes.tasks(3, 9):
        assert t["messages"][0]["role"] == "user"
        assert all(str(x) in t["messages"][0]["content"] for x in t["numbers"])
        assert json.loads(json.dumps(t)) == t


def test_reward_varies_and_stays_in_range(tmp_path: Path) -> None:
    task = notes.tasks(1, 0)[0]
    texts = [["abc def", "xyz"], ["a1b2", "q"], ["12 34", "56"], ["7 of ten", "z"]]
    numbers = " ".join(map(str, task["numbers"]))
    texts.append([numbers, numbers])
    rewards = []
    for i, replies in enumerate(texts):
        result = run_episode(notes.episode, new_state(task), ScriptedModel(replies), 2,
                             tmp_path / str(i))  # fmt: skip
        rewards.append(notes.reward(task, result))
    assert all(0.0 <= r <= 1.0 for r in rewards)
    assert len(set(rewards)) == len(rewards), rewards
    assert rewards[-1] == pytest.approx(1.0)
