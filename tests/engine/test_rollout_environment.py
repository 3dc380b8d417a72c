"""RolloutEnvironment against a real worker: the built-in 3-turn tally episode function
checkpointed mid-episode and restored into a fresh environment, at turn level (the replay
answers turn 1 and its tool effect from the journal, decodes from turn 2) and at prefix level
(the call in flight resumes from its cut)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import ray

from rollout_recovery.config import LivenessConfig
from rollout_recovery.controller.liveness import watch_step
from rollout_recovery.environment.client import EnvironmentClient
from rollout_recovery.environment.participant import ProtocolError
from rollout_recovery.environment.rollout_env import RolloutEnvironment
from rollout_recovery.errors import RunStalled
from rollout_recovery.generation.pool import WorkerPool
from rollout_recovery.protocol import EpisodeRecord, environment_of, replay_key, rollout_id

pytestmark = pytest.mark.engine
MESSAGES = [{"role": "user", "content": "Count the digits: 12 34 56"}]
TASK = {"messages": MESSAGES}


def _cfg(tiny_cfg, level: str, max_tokens: int):
    cfg = tiny_cfg.model_copy(deep=True)
    cfg.environment.max_turns = 3
    cfg.token_capture.enabled = True
    cfg.token_capture.supply_prefix_token_ids = True
    cfg.rollout_recovery.target_level = level
    cfg.checkpointing.save_data_plane = True
    cfg.policy.generation.max_new_tokens = max_tokens
    return cfg


def _episode(env: RolloutEnvironment, store, gid: str, seed: int):
    [(row, _, state)] = env.run_groups([(gid, TASK)], [[seed]], 0)
    store.delete("replay", [row.key])
    return row, state


def _wait(pred, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def _call_in_flight(runner, rid: str) -> str:
    state = runner.calls.get(rid)
    return state.attempt.model_call_id if state is not None and state.in_flight else ""


def _checkpoint_then_crash(env: RolloutEnvironment, gid: str, seed: int, at_call: str, park: bool):
    """Run one episode; checkpoint while `at_call` is in flight (`park`: commit only once the
    episode has parked at the next turn boundary); then drop the environment mid-episode."""
    rid = f"{gid}-g0"
    runner = env.runner
    run = asyncio.run_coroutine_threadsafe(
        runner.run_groups([(gid, TASK)], [[seed]], 0), env._loop.loop
    )
    _wait(lambda: _call_in_flight(runner, rid) == at_call, f"{at_call} in flight")
    if not park:
        time.sleep(0.3)  # let the call decode a prefix
    cuts = env.prepare("ckpt-1", lease_s=60)
    if park:
        _wait(
            lambda: _call_in_flight(runner, rid) == "" and len(runner.episodes[rid].turns) > 0,
            "park",
        )
    records = env.commit("ckpt-1")
    run.cancel()  # the crash: this environment never continues
    env.close()
    return cuts, records


def test_turn_level_restore_resumes_at_turn_2_without_repeating_the_tool(capture_worker, tiny_cfg):
    worker, store = capture_worker
    cfg = _cfg(tiny_cfg, "turn", 48)
    reference = RolloutEnvironment(cfg, WorkerPool([worker]), store)
    ref_row, ref_state = _episode(reference, store, "tref", seed=11)
    assert ref_state["effects"] == [0, 1] and ref_state["tally"] > 0
    with pytest.raises(ProtocolError, match="already served"):
        reference.begin_restore("r0")  # an environment that served calls is not restored into
    reference.close()

    _, records = _checkpoint_then_crash(
        RolloutEnvironment(cfg, WorkerPool([worker]), store), "trec", 11, at_call="c0", park=True
    )
    [rec] = records.episodes
    assert len(rec.turns) == 1 and [s.kind for s in rec.journal] == ["chat", "effect"]
    assert rec.continuation is None  # parked at the turn boundary: nothing in flight

    fresh = RolloutEnvironment(cfg, WorkerPool([worker]), store)
    fresh.begin_restore("r1")
    assert fresh.end_restore("r1", records.episodes) == 1
    row, state = _episode(fresh, store, "trec", seed=11)
    counts = fresh.counters()
    fresh.close()
    # One tool effect (turn 2's) ran in the fresh environment; turn 1's and its call came from
    # the journal.
    assert counts["effects.executed"] == 1 and counts["effects.replayed"] == 1
    assert counts["journal.chat_replayed"] == 1
    assert state == ref_state
    assert counts["restored_episodes"] == 1
    committed = fresh.sink.get(rec.turns[0].entry_id)
    assert counts["restored_turn_tokens"] == len(committed.generated_token_ids) > 0
    np.testing.assert_array_equal(row.token_ids, ref_row.token_ids)
    np.testing.assert_array_equal(row.loss_mask, ref_row.loss_mask)
    np.testing.assert_array_equal(row.logprobs, ref_row.logprobs)
    assert row.reward == ref_row.reward and row.prompt_len == ref_row.prompt_len
    # The resumed turns are attempt 1 of the episode; the committed turn keeps attempt 0.
    entries = set(store.list("token_entries", prefix="trec-g0/"))
    assert {"trec-g0/c0/a0", "trec-g0/c1/a1", "trec-g0/c2/a1"} <= entries
    assert "trec-g0/c1/a0" not in entries


def test_prefix_level_restore_resumes_the_cut_call_of_turn_2(capture_worker, tiny_cfg):
    worker, store = capture_worker
    cfg = _cfg(tiny_cfg, "prefix", 160)
    reference = RolloutEnvironment(cfg, WorkerPool([worker]), store)
    ref_row, ref_state = _episode(reference, store, "pref", seed=5)
    reference.close()
    turn_lengths = np.diff(np.flatnonzero(np.diff(np.r_[0, ref_row.loss_mask, 0]) != 0))[::2]
    assert turn_lengths[1] > 100, "the seed must give turn 2 a long call to cut"

    cuts, records = _checkpoint_then_crash(
        RolloutEnvironment(cfg, WorkerPool([worker]), store), "prec", 5, at_call="c1", park=False
    )
    assert cuts["calls_cut"] == 1
    [rec] = records.episodes
    cont = rec.continuation
    assert len(rec.turns) == 1 and cont.call_id == "c1" and cont.attempt == 0
    assert 0 < cont.tokens < turn_lengths[1] and records.continuations["prec-g0"] == cont

    fresh = RolloutEnvironment(cfg, WorkerPool([worker]), store)
    fresh.begin_restore("r2")
    fresh.end_restore("r2", records.episodes)
    row, state = _episode(fresh, store, "prec", seed=5)
    counts = fresh.counters()
    fresh.close()
    assert counts["restored_calls"] == 1 and counts["restored_prefix_tokens"] == cont.tokens
    assert counts["tail_tokens"] + cont.tokens == turn_lengths[1]
    assert state == ref_state and counts["effects.executed"] == 1
    np.testing.assert_array_equal(row.token_ids, ref_row.token_ids)
    np.testing.assert_array_equal(row.loss_mask, ref_row.loss_mask)
    np.testing.assert_array_equal(row.logprobs, ref_row.logprobs)


def _stray_rows(store, *keys: str) -> None:
    from rollout_recovery.data_plane.digest import chain_digests
    from rollout_recovery.data_plane.schemas import ChunkRow, chunk_rows_to_table

    rows = []
    for key in keys:
        rollout, call, attempt, _ = key.split("/")
        rows.append(
            ChunkRow(key=key, rollout_id=rollout, model_call_id=call, attempt=int(attempt[1:]),
                     chunk_seq=0, token_ids=np.array([5, 6], np.int32),
                     logprobs=np.zeros(2, np.float32) - 1, weight_version=0, prev_len=0,
                     digest=chain_digests([[5, 6]])[0], prompt_token_ids=np.array([1], np.int32))
        )  # fmt: skip
    store.put("rollout_staging", chunk_rows_to_table(rows))


def test_chunk_rows_do_not_outlive_their_calls(capture_worker, tiny_cfg):
    """Rows of calls that finished or died (no resume follows) are gone after the next
    checkpoint, and after a restore only the rows its continuations name are left."""
    worker, store = capture_worker
    cfg = _cfg(tiny_cfg, "prefix", 160)
    env = RolloutEnvironment(cfg, WorkerPool([worker]), store)
    _stray_rows(store, "sweep-a-g0/c0/a0/c000000", "sweep-a-g1/c2/a1/c000003")
    env.prepare("ckpt-sweep", lease_s=60)
    records = env.commit("ckpt-sweep")
    env.reopen("ckpt-sweep")
    env.close()
    assert records.chunk_rows_swept >= 2
    assert store.list("rollout_staging", "sweep-a-") == []

    _stray_rows(store, "sweep-b-g0/c1/a0/c000000", "sweep-b-g0/c1/a0/c000001",
                "sweep-b-g1/c0/a0/c000000")  # fmt: skip
    kept = {"call_id": "c1", "attempt": 0, "tokens": 4, "digest": "00",
            "keys": ["sweep-b-g0/c1/a0/c000000", "sweep-b-g0/c1/a0/c000001"]}  # fmt: skip
    record = {"rollout_id": "sweep-b-g0", "group_id": "sweep-b", "seed": 1,
              "generation_index": 0, "attempt": 0, "task": TASK, "continuation": kept}  # fmt: skip
    fresh = RolloutEnvironment(cfg, WorkerPool([worker]), store)
    fresh.begin_restore("r-sweep")
    fresh.end_restore("r-sweep", [EpisodeRecord.model_validate(record)])
    fresh.close()
    assert store.list("rollout_staging", "sweep-b-") == kept["keys"]
    store.delete("rollout_staging", kept["keys"])


def _owned(gid: str, count: int) -> list[int]:
    """The first generation index of group `gid` each of `count` environments owns."""
    owners = [environment_of(rollout_id(gid, i), count) for i in range(64)]
    return [owners.index(k) for k in range(count)]


def _on_actor(env: EnvironmentClient, k: int, fn):
    """`fn(runner)` inside environment actor `k`, on its loop."""
    ask = env.actors[k].__ray_call__.remote(lambda e: e._loop.call(fn, e.runner))
    return ray.get(ask, timeout=60)


def test_two_environment_actors_split_episodes_and_sweep_only_their_own_rows(
    capture_worker, tiny_cfg
):
    """`placement.environment.actors=2`: each actor runs the episodes of its rollouts and the
    client answers in one environment's order; a restore gives each actor its own records, and
    neither actor's sweep (at the restore, at a commit) deletes the rows the other one keeps."""
    worker, store = capture_worker
    cfg = _cfg(tiny_cfg, "prefix", 24)
    cfg.placement.environment.actors = 2
    env = EnvironmentClient.start(cfg.environment_config(), WorkerPool([worker]), store, count=2)
    try:
        gid = "split"
        outcomes = asyncio.run(env.run_groups([(gid, TASK)], [[3, 4, 5, 6]], 0))
        assert [o.row.key for o in outcomes] == [replay_key(gid, i) for i in range(4)]
        ran = [_on_actor(env, k, lambda r: sorted(r.finished)) for k in range(2)]
        ids = [rollout_id(gid, i) for i in range(4)]
        mine = [sorted(r for r in ids if environment_of(r, 2) == k) for k in range(2)]
        assert ran == mine and all(ran), "each actor ran exactly its own episodes"
        store.delete("replay", [o.row.key for o in outcomes])
    finally:
        env.close()

    gid = "sweep-c"
    rollouts = [rollout_id(gid, i) for i in _owned(gid, 2)]  # one per actor
    kept = {r: [f"{r}/c1/a0/c000000", f"{r}/c1/a0/c000001"] for r in rollouts}
    stray = [f"{r}/c0/a0/c000000" for r in rollouts]  # a finished call's rows: both owners'
    _stray_rows(store, *[k for keys in kept.values() for k in keys], *stray)
    records = []
    for r in rollouts:
        cont = {"call_id": "c1", "attempt": 0, "tokens": 4, "digest": "00", "keys": kept[r]}
        record = {"rollout_id": r, "group_id": gid, "seed": 1, "attempt": 0, "task": TASK,
                  "generation_index": int(r.rsplit("-g", 1)[1]), "continuation": cont}  # fmt: skip
        records.append(EpisodeRecord.model_validate(record))
    env = EnvironmentClient.start(cfg.environment_config(), WorkerPool([worker]), store, count=2)
    try:
        env.begin_restore("r-split")
        assert env.end_restore("r-split", records) == 2
        pending = [_on_actor(env, k, lambda r: sorted(r.pending)) for k in range(2)]
        assert pending == [[rollouts[0]], [rollouts[1]]]
        every = sorted(k for keys in kept.values() for k in keys)
        assert store.list("rollout_staging", f"{gid}-") == every  # strays swept, kept kept

        _stray_rows(store, *stray)  # rows of calls that ended since: the commit sweeps them

        async def checkpoint():
            cuts = await env.prepare("ckpt-split", lease_s=60)
            committed = await env.commit("ckpt-split")
            await env.reopen("ckpt-split")
            return cuts, committed

        cuts, committed = asyncio.run(checkpoint())
        assert cuts == {"calls_cut": 0, "calls_not_cut": {}}
        assert sorted(rec.rollout_id for rec in committed.episodes) == sorted(rollouts)
        assert {r: c.keys for r, c in committed.continuations.items()} == kept
        assert committed.chunk_rows_swept == 2
        assert store.list("rollout_staging", f"{gid}-") == every
    finally:
        env.close()
        store.delete("rollout_staging", store.list("rollout_staging", f"{gid}-"))


def test_episodes_that_wait_on_nothing_stop_the_step_with_no_progress(capture_worker, tiny_cfg):
    """Liveness on the real actors: an environment actor whose two episodes each made one real
    model call and then wait on nothing the run can see. The controller's watch asks the actor
    over Ray and stops the step with `no_progress` (counted and shown in one line by
    `submit_groups`, tests/unit/test_liveness.py), instead of waiting forever."""
    worker, store = capture_worker
    cfg = _cfg(tiny_cfg, "turn", 8)
    cfg.environment.episode = "tests.engine.liveness_episodes:stuck_after_one_call"
    client = EnvironmentClient.start(cfg.environment_config(), WorkerPool([worker]), store)
    watch = LivenessConfig(stall_timeout_s=2.0, check_interval_s=0.2)

    async def step():
        work = client.run_groups([("stall-0", TASK)], [[5, 6]], 0)
        async with asyncio.timeout(60):  # without the watch: a TimeoutError, not RunStalled
            return await watch_step(work, client.progress, watch, 7)

    try:
        t0 = time.monotonic()
        with pytest.raises(RunStalled) as err:
            asyncio.run(step())
        assert err.value.reason == "no_progress" and time.monotonic() - t0 < 30
        assert "step 7 stalled (run_stalled.no_progress" in str(err.value)
        assert "2 episodes unfinished" in str(err.value)
        seen = asyncio.run(client.progress())
        assert (seen.episodes_running, seen.calls_in_flight, seen.effects_running) == (2, 0, 0)
        assert seen.events == 4  # each episode's one call, started and answered
    finally:
        client.close()
