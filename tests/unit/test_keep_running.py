"""`TrainingRun.keep_running`: a dead actor of the job (`ComponentLost`) is restored from in the
same process, `failover.max_restores` times, each logged; one death more ends the run in one
line saying what to run next. The run itself is a stand-in here (no Ray); the real job, killed
under a stream of faults, restores in process with exact parity in the chaos soak
(tests/functional, scripts/chaos_soak.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from rollout_recovery.config import load_config
from rollout_recovery.errors import ComponentLost
from rollout_recovery.run import TrainingRun
from rollout_recovery.storage import RunStorage
from rollout_recovery.trainer.held_job import HeldJob, Kept


class _OpenedRun:
    def __init__(self, storage: RunStorage, start_step: int) -> None:
        self.storage, self.start_step, self.closed_with = storage, start_step, None
        self.kept = None
        self.opened = {"plan_s": 0.1, "start_s": 20.0, "restore_s": 0.5, "opened_at": 1e9}

    def __enter__(self) -> _OpenedRun:
        return self

    def __exit__(self, kind, err, tb) -> None:
        self.closed_with = kind


@pytest.fixture
def opened(monkeypatch, tmp_path):
    """Replaces `TrainingRun.open`: records each call's `restore` and hands out stand-ins."""
    storage = RunStorage(str(tmp_path / "run"))
    calls: list[tuple[bool, _OpenedRun]] = []

    def fake_open(cls, cfg, restore=False, ray_address="local", kept=None):
        run = _OpenedRun(storage, 2 if restore else 0)
        run.given = kept
        calls.append((restore, run))
        return run

    monkeypatch.setattr(TrainingRun, "open", classmethod(fake_open))
    return storage, calls


def _cfg(tmp_path, max_restores: int):
    return load_config(None, [f"checkpointing.checkpoint_dir={tmp_path / 'run'}",
                              f"failover.max_restores={max_restores}"])  # fmt: skip


def _events(storage: RunStorage) -> list[dict]:
    return [json.loads(x) for x in storage.read_bytes("steps.jsonl").decode().splitlines()]


def test_each_death_restores_in_process_until_the_loop_finishes(opened, tmp_path, capsys):
    storage, calls = opened
    deaths = [ComponentLost("store shard", "it was killed"), ComponentLost("controller", "oom")]

    def loop(run) -> str:
        if deaths:
            raise deaths.pop(0)
        return f"done from step {run.start_step}"

    assert TrainingRun.keep_running(_cfg(tmp_path, 2), loop) == "done from step 2"
    assert [restore for restore, _ in calls] == [False, True, True]
    assert all(run.closed_with in (ComponentLost, None) for _, run in calls)
    events = _events(storage)
    assert [(e["event"], e["component"], e["restores"]) for e in events] == [
        ("restored_in_process", "store shard", 1),
        ("restored_in_process", "controller", 2),
    ]
    out = capsys.readouterr().out
    assert "the store shard died (it was killed): restoring the run in this process" in out
    assert "(2 of failover.max_restores=2)" in out


def test_one_death_more_than_max_restores_ends_in_one_line_naming_what_to_run(opened, tmp_path):
    _, calls = opened

    def loop(run) -> None:
        raise ComponentLost("environment actor", "its worker process has died")

    with pytest.raises(ComponentLost) as info:
        TrainingRun.keep_running(_cfg(tmp_path, 1), loop)
    assert len(calls) == 2 and info.value.component == "environment actor"
    assert str(info.value) == (
        "the environment actor died (its worker process has died); failover.max_restores=1 "
        "restores in this process were used: continue the run with `train --restore`"
    )
    assert "\n" not in str(info.value)


def test_max_restores_zero_ends_at_the_first_death_and_other_errors_are_not_restored(
    opened, tmp_path
):
    _, calls = opened

    def dies(run) -> None:
        raise ComponentLost("controller", "it was killed by `ray.kill`")

    with pytest.raises(ComponentLost, match=r"failover\.max_restores=0"):
        TrainingRun.keep_running(_cfg(tmp_path, 0), dies)
    assert len(calls) == 1

    def fails(run) -> None:
        raise ValueError("the loop's own bug")

    with pytest.raises(ValueError, match="the loop's own bug"):
        TrainingRun.keep_running(_cfg(tmp_path, 2), fails)
    assert len(calls) == 2  # not restored: only a dead actor is


def test_what_was_kept_is_handed_to_the_next_open_and_stopped_when_restores_run_out(
    opened, tmp_path
):
    _, calls = opened
    engines = _Engines()
    kept = Kept(_Proxy(), engines)

    def loop(run) -> None:
        run.kept = kept  # as close() does when the engines can serve the restore
        raise ComponentLost("store shard", "its worker process has died")

    with pytest.raises(ComponentLost):
        TrainingRun.keep_running(_cfg(tmp_path, 1), loop)
    assert [run.given for _, run in calls] == [None, kept]
    assert kept.controller.calls == ["kill"] and engines.calls == ["stop"]  # the last one


class _Proxy:
    """The controller's ActorProxy as `TrainingRun.close` uses it."""

    def __init__(self, settles: bool = True, halt_fails: bool = False) -> None:
        self.settles, self.halt_fails, self.calls = settles, halt_fails, []

    def call_in(self, group: str, name: str, *args, timeout=None) -> None:
        self.calls.append(f"{group}:{name}")
        if self.halt_fails:
            raise ComponentLost("controller", "its worker process has died")

    def settled(self, timeout_s: float) -> bool:
        self.calls.append("settled")
        return self.settles

    def kill(self) -> None:
        self.calls.append("kill")


class _Engines:
    """controller.job.Engines as the trainer's process holds them."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def drop_store(self) -> None:
        self.calls.append("drop_store")

    def stop(self) -> None:
        self.calls.append("stop")


class _Notices:
    def stop(self) -> None:
        pass


class _Weights:
    def cleanup(self) -> None:
        pass


def _closed(tmp_path, proxy: _Proxy, engines: _Engines, lost: ComponentLost, keep: bool,
            standby: _Proxy | None = None, restores_left: bool = True):  # fmt: skip
    run = TrainingRun.__new__(TrainingRun)
    run.cfg = load_config(None, [f"checkpointing.checkpoint_dir={tmp_path / 'run'}",
                                 f"failover.keep_engines={str(keep).lower()}"])  # fmt: skip
    run.job, run.kept = HeldJob(proxy, engines, "local", standby), None
    run.restores_left = restores_left
    run._notices, run.weights = _Notices(), _Weights()
    run.close(lost=lost)
    return run


@pytest.mark.parametrize(
    ("component", "proxy", "keep", "expect"),
    [
        ("store shard", _Proxy(), True, "halted"),
        ("environment actor", _Proxy(), True, "halted"),
        ("controller", _Proxy(), True, "engines"),  # a new controller resets them
        ("store shard", _Proxy(), False, None),  # failover.keep_engines=false
        ("store shard", _Proxy(halt_fails=True), True, None),  # the controller died meanwhile
        ("store shard", _Proxy(settles=False), True, None),  # its call never ended
        ("worker", _Proxy(), True, None),
    ],
)
def test_the_engines_are_kept_where_they_can_serve_the_restore(
    tmp_path, component, proxy, keep, expect
):
    engines = _Engines()
    lost = ComponentLost(component, "its worker process has died")
    run = _closed(tmp_path, proxy, engines, lost, keep)
    assert run.job is None
    if expect is None:  # everything stopped: the restore starts new engines
        assert run.kept is None and "kill" in proxy.calls and engines.calls[-1] == "stop"
        return
    assert run.kept.engines is engines and engines.calls == ["drop_store"]
    if expect == "halted":
        assert run.kept.controller is proxy and proxy.calls == ["control:halt", "settled"]
    else:
        assert run.kept.controller is None and proxy.calls == ["kill"]


def test_a_pool_with_a_lost_worker_is_not_kept():
    """A lost worker cannot serve the restored job: the reset refuses before touching any
    engine, and the job start falls back to new engines (controller.job.build_job)."""
    from rollout_recovery.generation.pool import WorkerPool, WorkerSpec

    pool = WorkerPool([], WorkerSpec({}, None, 1.0, None))
    pool.lost[0] = "actor_dead"
    with pytest.raises(RuntimeError, match=r"cannot keep the engines: workers lost \[0\]"):
        pool.reset(load_config(None, []), store=None)


def test_what_was_kept_is_stopped_when_the_next_open_fails(monkeypatch, tmp_path):
    kept = Kept(_Proxy(), _Engines())
    opens = []

    def fake_open(cls, cfg, restore=False, ray_address="local", given=None):
        opens.append(given)
        if given is not None:
            raise OSError("the run's location is gone")
        run = _OpenedRun(RunStorage(str(tmp_path / "run")), 0)
        run.kept = kept
        return run

    monkeypatch.setattr(TrainingRun, "open", classmethod(fake_open))

    def loop(run) -> None:
        raise ComponentLost("environment actor", "its worker process has died")

    with pytest.raises(OSError, match="location is gone"):
        TrainingRun.keep_running(_cfg(tmp_path, 2), loop)
    assert opens == [None, kept]
    assert kept.controller.calls == ["kill"] and kept.engines.calls == ["stop"]


@pytest.mark.parametrize(
    ("component", "keep"),
    [("controller", True), ("store shard", True), ("controller", False), ("worker", True)],
)
def test_the_standby_controller_is_handed_on_with_the_engines_or_ended(tmp_path, component, keep):
    standby = _Proxy()
    lost = ComponentLost(component, "its worker process has died")
    run = _closed(tmp_path, _Proxy(), _Engines(), lost, keep, standby)
    assert run.job is None
    if run.kept is not None:
        assert run.kept.standby is standby and standby.calls == []
    else:
        assert standby.calls == ["kill"]
    if component != "worker" and keep:
        run.kept.stop()  # restores ran out: everything kept ends, the standby too
        assert standby.calls == ["kill"]


class _Checked:
    def check(self) -> None:
        pass


class _Stepping:
    def set_step(self, step: int) -> None:
        pass

    def counters(self) -> dict:
        return {}


class _Standby:
    def __init__(self, dies_of: str | None = None) -> None:
        self.dies_of, self.calls = dies_of, []

    def take_over(self, owner, engines) -> None:
        self.calls.append("take_over")
        if self.dies_of is not None:
            raise ComponentLost(self.dies_of, "its worker process has died")

    def kill(self) -> None:
        self.calls.append("kill")


def test_start_controller_gives_the_job_to_the_standby_or_starts_a_new_one(monkeypatch, tmp_path):
    import rollout_recovery.controller_actor as api

    made: list[tuple] = []
    monkeypatch.setattr(api, "init_ray", lambda *a, **k: None)
    monkeypatch.setattr(api, "ActorProxy", lambda *a, **k: made.append(a) or "new controller")
    cfg, engines = _cfg(tmp_path, 2), _Engines()
    live = _Standby()
    assert api.start_controller(cfg, owner="o", engines=engines, standby=live) == (live, engines)
    assert live.calls == ["take_over"] and made == [] and engines.calls == []
    dead = _Standby(dies_of="controller")  # it died while idle: a new controller starts
    got = api.start_controller(cfg, owner="o", engines=engines, standby=dead)
    assert got == ("new controller", engines) and dead.calls == ["take_over", "kill"]
    assert len(made) == 1 and engines.calls == []
    failed = _Standby(dies_of="store shard")  # its start failed: as a new controller's would
    with pytest.raises(ComponentLost, match="store shard"):
        api.start_controller(cfg, owner="o", engines=engines, standby=failed)
    assert engines.calls == ["stop"]


@pytest.mark.parametrize(
    ("overrides", "wants", "step", "started"),
    [
        ([], True, 3, True),
        ([], True, 2, True),  # not at the first step after a start at step 2, at the next
        ([], False, 3, False),  # outside keep_running, or no restore left
        (["failover.standby_controller=false"], True, 3, False),
        (["failover.keep_engines=false"], True, 3, False),
    ],
)
def test_the_standby_starts_after_a_step_where_a_restore_could_use_it(
    monkeypatch, tmp_path, overrides, wants, step, started
):
    import rollout_recovery.trainer.held_job as held_job

    made: list[tuple] = []
    monkeypatch.setattr(held_job, "start_standby", lambda *a: made.append(a) or _Standby())
    run = TrainingRun.__new__(TrainingRun)
    run.cfg = load_config(None, [f"checkpointing.checkpoint_dir={tmp_path / 'run'}", *overrides])
    run._plan, run.restores_left = SimpleNamespace(step=2, checkpoint=None), wants
    run.job = HeldJob(_Stepping(), None, "local")
    run._notices, run.weights = _Checked(), SimpleNamespace(due=False)
    run.begin_step(step)
    if step == run.start_step:  # the first step after a start never starts it
        assert made == [] and run.job.standby is None
    run.begin_step(step + 1)  # one standby per run (the later step starts one where wanted)
    assert len(made) == (1 if started else 0)
    assert (run.job.standby is not None) == started
