"""The asynchronous producer's dispatch and cursor (producer.py), on a fake run: which groups
start, which finished ones train, stale ones dropped and generated again, and the cursor a
restore goes on from."""

from __future__ import annotations

import numpy as np
import pytest

from rollout_recovery.config import load_config
from rollout_recovery.data_plane import ReplayRow
from rollout_recovery.protocol import GroupResult, group_id, parse_group_id
from rollout_recovery.trainer.producer import Cursor, OpenPrompt, Producer


def _row(gid: str, i: int, oldest: int) -> ReplayRow:
    return ReplayRow(key=f"{gid}/{i:03d}", rollout_id=f"{gid}-g{i}", group_id=gid,
                     generation_index=i, prompt_len=1, token_ids=np.zeros(2, np.int32),
                     loss_mask=np.array([0, 1], np.int8), logprobs=np.zeros(2, np.float32),
                     reward=0.0, weight_version_min=oldest, weight_version_max=oldest)  # fmt: skip


class FakeRun:
    """What the producer uses of a TrainingRun; groups finish when the test says so."""

    def __init__(self, *overrides: str) -> None:
        self.cfg = load_config(None, ["grpo.async_grpo.enabled=true", "grpo.prompts_per_step=2",
                                      "grpo.generations_per_prompt=2", *overrides])  # fmt: skip
        self.weight_version = 0
        self.started: list[tuple[str, dict, list[int]]] = []
        self.done: list[GroupResult] = []
        self.dropped: list[str] = []

    def start_groups(self, groups) -> None:
        self.started += [(g.group_id, g.task, g.seeds) for g in groups]

    def finish(self, gid: str, oldest: int) -> None:
        self.done.append(GroupResult(gid, [_row(gid, i, oldest) for i in range(2)], [0.0, 0.0],
                                     4, [None, None]))  # fmt: skip

    def finished_groups(self, n: int):
        assert len(self.done) >= n, "the test did not finish enough groups"
        out, self.done = self.done[:n], self.done[n:]
        return out

    def drop_groups(self, results, reason: str) -> int:
        assert reason == "stale"
        self.dropped += [r.group_id for r in results]
        return 0


def _seeds(prompt: int, attempt: int, gen: int) -> int:
    return prompt * 100 + attempt * 10 + gen


def test_it_keeps_the_open_groups_topped_up_and_trains_each_prompt_once():
    run = FakeRun()  # 2 prompts a step, so 4 open at most
    p = Producer(run, _seeds)
    assert p.fill() == 4
    assert [g for g, _, _ in run.started] == ["s0000-p000", "s0000-p001", "s0001-p000",
                                              "s0001-p001"]  # fmt: skip
    assert run.started[3][2] == [300, 301]  # prompt 3's seeds
    assert p.fill() == 0  # nothing trained yet: still 4 open
    run.finish("s0001-p000", 0)
    run.finish("s0000-p001", 0)
    taken = p.take(2)  # the first two to finish, in that order
    assert [r.group_id for r in taken] == ["s0001-p000", "s0000-p001"]
    p.trained(taken)
    assert p.cursor.trained == 2 and [o.prompt for o in p.cursor.open] == [0, 3]
    assert p.fill() == 2 and p.cursor.next == 6
    assert [g for g, _, _ in run.started[4:]] == ["s0002-p000", "s0002-p001"]


def test_a_stale_group_is_dropped_and_its_prompt_generated_again():
    run = FakeRun("grpo.async_grpo.max_trajectory_age_steps=1")
    p = Producer(run, _seeds)
    p.fill()
    run.weight_version = 3
    run.finish("s0000-p000", 1)  # age 2: stale
    run.finish("s0000-p001", 2)  # age 1: young enough
    run.finish("s0001-p000", 3)
    taken = p.take(2)
    assert [r.group_id for r in taken] == ["s0000-p001", "s0001-p000"]
    assert run.dropped == ["s0000-p000"] and p.cursor.dropped_stale == 1
    assert run.started[-1] == ("s0000-p000-r1", run.started[0][1], [10, 11])  # other seeds
    assert OpenPrompt(prompt=0, attempt=1) in p.cursor.open
    assert p.age(taken[0]) == 1


def test_a_restore_starts_the_open_prompts_first_at_their_newest_attempt():
    """The checkpoint's cursor had prompts 1 and 2 open; the snapshot after it holds prompt 1's
    second attempt (it went stale after the checkpoint) and prompt 4 (dispatched after it)."""
    run = FakeRun()
    cursor = Cursor(next=4, open=[OpenPrompt(prompt=1), OpenPrompt(prompt=2)], trained=2)
    restored = {"s0000-p001-r1", "s0002-p000", "unrelated"}
    p = Producer(run, _seeds, Cursor.model_validate(cursor.model_dump()), restored)
    assert p.fill() == 4
    assert [g for g, _, _ in run.started] == ["s0000-p001-r1", "s0001-p000", "s0002-p000",
                                              "s0002-p001"]  # fmt: skip
    assert p.cursor.dropped_stale == 1 and p.cursor.next == 6


def test_the_producer_refuses_a_buffer_smaller_than_a_step():
    with pytest.raises(Exception, match="max_groups_in_flight=1 is below"):
        FakeRun("grpo.async_grpo.max_groups_in_flight=1")


@pytest.mark.parametrize("step,prompt,attempt", [(0, 0, 0), (3, 1, 0), (12, 7, 2)])
def test_a_group_id_reads_back_as_its_step_prompt_and_attempt(step, prompt, attempt):
    gid = group_id(step, prompt, attempt)
    assert parse_group_id(gid) == (step, prompt, attempt)
    assert ("-r" in gid) == (attempt > 0)  # a first attempt keeps the synchronous driver's id


def test_ids_of_other_loops_are_not_driver_groups():
    assert parse_group_id("my-group") is None
    assert parse_group_id("s0001-p000-x") is None
