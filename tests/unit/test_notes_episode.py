"""The notes example episode, against a fake context: exactly-once effects under replay."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rollout_recovery import faults
from rollout_recovery.episodes import notes

REPLIES = ["12 apples 7", "no digits here at all", "40 40 x", "9", "final 3"]


@dataclass
class Reply:
    message: dict
    content: str
    finish_reason: str | None = "stop"
    token_ids: list[int] = field(default_factory=list)


class FakeContext:
    """Scripted replies and an in-memory journal. Entries of `journal` (a restored prefix)
    are answered from it in order; after it, chat calls use the script and effects run again
    under the same ids, as on replay after a crash."""

    def __init__(self, scratch: Path, replies: list[str], journal: list | None = None) -> None:
        self.rollout_id, self.seed, self.max_turns = "g0-r1", 0, len(replies)
        self.scratch_dir, self.replies = scratch, replies
        self.effect_id: str | None = None
        self.journal, self.record, self.ran = list(journal or []), [], []
        self.n_chats = self.n_effects = 0

    def _replayed(self, kind: str, key: Any) -> tuple[bool, Any]:
        if len(self.record) < len(self.journal):
            entry = self.journal[len(self.record)]
            assert entry[:2] == (kind, key), f"replay diverged: {entry[:2]} != {(kind, key)}"
            return True, entry[2]
        return False, None

    async def chat(self, messages: list[dict], **_: Any) -> Reply:
        i, self.n_chats = self.n_chats, self.n_chats + 1
        hit, text = self._replayed("chat", i)
        text = text if hit else self.replies[i]
        self.record.append(("chat", i, text))
        return Reply({"role": "assistant", "content": text}, text)

    async def effect(self, name: str, fn: Any, *args: Any) -> Any:
        eid = f"{self.rollout_id}/e{self.n_effects}"
        self.n_effects += 1
        key = (name, json.dumps(args))
        hit, value = self._replayed("effect", key)
        if not hit:
            self.effect_id = eid
            try:
                value = fn(*args)
                if inspect.isawaitable(value):
                    value = await value
            finally:
                self.effect_id = None
            value = json.loads(json.dumps(value))
            self.ran.append(eid)
        self.record.append(("effect", key, value))
        return value


def run(ctx: FakeContext, task: dict) -> dict:
    return asyncio.run(notes.episode(ctx, task))


def crash_and_replay(tmp_path: Path) -> tuple[FakeContext, dict, dict]:
    """A reference run, then a run whose crash came after effect e1 ran but before a
    checkpoint recorded it: the restored journal ends at the chat before e1."""
    task = notes.tasks(1, 0)[0]
    ref_dir, crash_dir = tmp_path / "ref", tmp_path / "crash"
    ref_dir.mkdir(), crash_dir.mkdir()
    reference = run(FakeContext(ref_dir, REPLIES), task)
    first = FakeContext(crash_dir, REPLIES)
    run(first, task)  # ran every effect, then "crashed"
    checkpoint = first.record[:3]  # chat0, effect e0, chat1 (e1 ran after the checkpoint)
    replay = FakeContext(crash_dir, REPLIES, journal=checkpoint)
    result = run(replay, task)
    assert result == reference
    return replay, notes.store_summary(ref_dir), notes.store_summary(crash_dir)


def test_full_episode(tmp_path: Path) -> None:
    task = notes.tasks(1, 3)[0]
    ctx = FakeContext(tmp_path, REPLIES)
    result = run(ctx, task)
    assert result["notes"] == ["127", "nodigitshereatall", "4040", "9"]
    assert result["register"] == 10 + 0 + 8 + 9
    assert result["effects"] == [f"g0-r1/e{i}" for i in range(4)]
    assert result["text"] == "\n".join(REPLIES)
    assert json.loads(json.dumps(result)) == result
    assert 0.0 <= notes.reward(task, result) <= 1.0
    assert notes.applied_exactly_once(tmp_path) == []
    summary = notes.store_summary(tmp_path)
    assert summary == {
        "notes": result["notes"],
        "register": 27,
        "dedupes": 0,
        "ops": result["effects"],
    }


def test_replay_after_crash_absorbs_reexecuted_effect(tmp_path: Path) -> None:
    replay, ref, recovered = crash_and_replay(tmp_path)
    assert replay.ran == ["g0-r1/e1", "g0-r1/e2", "g0-r1/e3"]  # e0 came from the journal
    assert recovered["dedupes"] == 3 and ref["dedupes"] == 0
    assert {k: v for k, v in recovered.items() if k != "dedupes"} == {
        k: v for k, v in ref.items() if k != "dedupes"
    }
    assert notes.applied_exactly_once(tmp_path / "crash") == []


def test_dedupe_disabled_fault_is_caught(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(faults.ENV, "effect_dedupe_disabled")
    task = notes.tasks(1, 0)[0]
    first = FakeContext(tmp_path, REPLIES)
    run(first, task)
    run(FakeContext(tmp_path, REPLIES, journal=first.record[:3]), task)
    violations = notes.applied_exactly_once(tmp_path)
    assert any("applied more than once" in v for v in violations), violations
    assert notes.store_summary(tmp_path)["dedupes"] == 0


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
        d = tmp_path / str(i)
        d.mkdir()
        rewards.append(notes.reward(task, run(FakeContext(d, replies), task)))
    assert all(0.0 <= r <= 1.0 for r in rewards)
    assert len(set(rewards)) == len(rewards), rewards
    assert rewards[-1] == pytest.approx(1.0)
