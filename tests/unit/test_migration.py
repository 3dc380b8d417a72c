"""The environment's side of a worker dying under a call, with fake workers (fault injection):
the call moves as the next attempt with its token log as the continuation, a failure that is not
a worker's death is raised as before, and the limits fail the episode with a named reason.
Real workers killed mid-generation are the failover check's (functional_tests/)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pyarrow as pa
import pytest
import ray

from rollout_recovery.config import load_config
from rollout_recovery.data_plane.schemas import chunk_rows_to_table
from rollout_recovery.environment.dispatch import EpisodeFailed
from rollout_recovery.environment.episode import EpisodeState
from rollout_recovery.environment.model_client import ModelCallFailed
from rollout_recovery.environment.runner import EpisodeRunner
from rollout_recovery.generation.pool import WorkerPool
from rollout_recovery.generation.worker import WorkerHealth
from rollout_recovery.protocol import RESUME_KEYS_ARG, RESUME_TOKENS_ARG, CallIdentity
from tests.unit.test_token_log_restore import _chain

STAGING = "rollout_staging"


class Handle:
    def __init__(self, health) -> None:
        self.health = health
        self.info = SimpleNamespace(url="http://w", served_model_name="policy", eos_token_id=2)

    async def ahealth(self) -> WorkerHealth:
        if isinstance(self.health, BaseException):
            raise self.health
        return self.health


class Client:
    """A worker's model-call client whose calls all fail with `error`; records each call."""

    def __init__(self, error: Exception, name: str) -> None:
        self.error, self.name, self.calls = error, name, []

    async def call(self, rollout_id, model_call_id, messages, attempt=0, **fields):
        self.calls.append((self.name, model_call_id, attempt, fields["vllm_xargs"]))
        raise self.error

    async def aclose(self) -> None:
        pass


class Store:
    def __init__(self) -> None:
        self.rows: dict[str, pa.Table] = {}

    async def alist(self, partition: str, prefix: str = "") -> list[str]:
        return sorted(k for k in self.rows if k.startswith(prefix))

    async def aget(self, partition: str, keys):
        found = [self.rows[k] for k in keys if k in self.rows]
        return (pa.concat_tables(found) if found else None), [k for k in keys if k not in self.rows]

    async def adelete(self, partition: str, keys) -> int:
        return sum(self.rows.pop(k, None) is not None for k in keys)


DEAD = ray.exceptions.RayActorError()
GONE = httpx.ConnectError("connection refused")


def _runner(
    healths: list, errors: list, store=None, **failover
) -> tuple[EpisodeRunner, list[Client]]:
    failover = {"replacement_wait_s": 1} | failover  # a broken move fails fast, never hangs
    overrides = [f"failover.{k}={v}" for k, v in failover.items()]
    cfg = load_config(None, ["token_capture.enabled=true", *overrides]).environment_config()
    runner = EpisodeRunner(cfg, WorkerPool([Handle(h) for h in healths]), store or Store())
    runner.dispatch.clients = [Client(e, f"w{i}") for i, e in enumerate(errors)]
    return runner, runner.dispatch.clients


def _journaled(runner: EpisodeRunner, st: EpisodeState, sizes: list[int]) -> list:
    rows = _chain(CallIdentity(st.rollout_id, "c0", st.attempt), sizes)
    for row in rows:
        runner.store.rows[row.key] = chunk_rows_to_table([row])
    return rows


def _call(runner: EpisodeRunner, st: EpisodeState):
    return runner.dispatch.call(st, [{"role": "user", "content": "hi"}], {})


async def test_a_call_moves_to_a_live_worker_from_its_journal_until_max_migrations():
    runner, clients = _runner([DEAD, DEAD], [GONE, GONE], max_migrations=1)
    st = EpisodeState("r-g0", "r", 0, 7, {})
    rows = _journaled(runner, st, [8, 8])
    with pytest.raises(EpisodeFailed, match="max_migrations"):
        await _call(runner, st)
    [(_, _, a0, x0)], [(_, _, a1, x1)] = clients[0].calls, clients[1].calls
    assert (a0, a1) == (0, 1) and RESUME_KEYS_ARG not in x0
    assert x1[RESUME_KEYS_ARG] == [r.key for r in rows] and x1[RESUME_TOKENS_ARG] == 16
    assert runner.counts["migrations.actor_dead"] == 2
    assert runner.counts["migration.resumed"] == 1
    assert runner.counts["migration.token_log_tokens"] == 16
    assert runner.counts["migration_failed.max_migrations"] == 1
    assert runner.workers.lost == {0: "actor_dead", 1: "actor_dead"}


async def test_a_dead_engine_is_a_lost_worker_and_a_refused_journal_starts_the_call_over():
    engine_dead = WorkerHealth(healthy=False, reason="engine_dead", url="u")
    runner, clients = _runner([engine_dead, engine_dead], [GONE, GONE], max_migrations=1)
    st = EpisodeState("r-g0", "r", 0, 7, {})
    rows = _journaled(runner, st, [8, 8])
    del runner.store.rows[rows[0].key]  # the chain has lost its first row
    with pytest.raises(EpisodeFailed):
        await _call(runner, st)
    assert RESUME_KEYS_ARG not in clients[1].calls[0][3]  # decoded from scratch
    assert runner.counts["migrations.engine_dead"] == 2
    assert runner.counts["migration.token_log_refused.chunk_order"] == 1
    assert runner.counts["migration.from_scratch"] == 1


@pytest.mark.parametrize(
    ("health", "error"),
    [
        (DEAD, ModelCallFailed(400, "bad request")),  # the request's own fault
        (WorkerHealth(healthy=True, url="u"), GONE),  # the worker is fine
    ],
)
async def test_a_failure_that_is_not_a_workers_death_is_raised_as_before(health, error):
    runner, _ = _runner([health], [error])
    with pytest.raises(type(error)):
        await _call(runner, EpisodeState("r-g0", "r", 0, 7, {}))
    assert not runner.workers.lost and not any(c.moving for c in runner.calls)
    assert not any(k.startswith("migration") for k in runner.counts)


async def test_with_failover_off_a_dead_worker_fails_the_call():
    runner, _ = _runner([DEAD], [GONE], enabled="false")
    with pytest.raises(httpx.ConnectError):
        await _call(runner, EpisodeState("r-g0", "r", 0, 7, {}))
    assert not runner.workers.lost


async def test_a_call_waits_for_a_replacement_and_fails_named_when_none_comes():
    runner, _ = _runner([DEAD], [GONE], replacement_wait_s=0.2)
    with pytest.raises(EpisodeFailed, match="no_live_worker"):
        await _call(runner, EpisodeState("r-g0", "r", 0, 7, {}))
    assert runner.counts["migration_failed.no_live_worker"] == 1
    runner, _ = _runner([DEAD], [GONE], replacement_wait_s=30, max_migrations=1)
    replacement = Client(GONE, "new")
    runner.dispatch._client = lambda handle: replacement
    call = asyncio.ensure_future(_call(runner, EpisodeState("r-g0", "r", 0, 7, {})))
    await asyncio.sleep(0.1)
    assert not call.done()  # waiting for a live worker
    await runner.dispatch.worker_replaced(0, Handle(DEAD))
    with pytest.raises(EpisodeFailed, match="max_migrations"):
        await call
    assert [c[:3] for c in replacement.calls] == [("new", "c0", 1)]
    assert runner.counts["workers_replaced"] == 1


class HeldStore(Store):
    """Reads of the token log wait until `release` is set (a slow store during a move)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def aget(self, partition: str, keys):
        await self.release.wait()
        return await super().aget(partition, keys)


async def test_a_checkpoint_during_a_move_keeps_the_lost_attempts_journal():
    """Between the failed call and its next attempt (its token log being read) a commit records
    the call as in flight, not cut, and its sweep keeps the lost attempt's rows: without that
    the move found no token log."""
    runner, clients = _runner([DEAD, DEAD], [GONE, GONE], HeldStore(), max_migrations=1)
    st = EpisodeState("r-g0", "r", 0, 7, {})
    runner.episodes[st.rollout_id] = st
    rows = _journaled(runner, st, [8, 8])
    call = asyncio.ensure_future(_call(runner, st))
    await asyncio.sleep(0.05)  # failed, its worker found dead, its token log being read
    call_state = runner.calls.get(st.rollout_id)
    assert not call_state.in_flight and call_state.lost is not None
    await runner.prepare("k1", lease_s=60)
    records = await runner.commit("k1")
    runner.participant.reopen("k1")
    assert records.chunk_rows_swept == 0 and set(runner.store.rows) == {r.key for r in rows}
    [rec] = records.episodes
    assert (rec.continuation.call_id, rec.continuation.attempt, rec.continuation.keys) == (
        "c0", 0, None)  # fmt: skip
    runner.store.release.set()
    with pytest.raises(EpisodeFailed):
        await call
    assert clients[1].calls[0][3][RESUME_KEYS_ARG] == [r.key for r in rows]
