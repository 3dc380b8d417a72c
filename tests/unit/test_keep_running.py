"""`TrainingRun.keep_running`: a dead actor of the job (`ComponentLost`) is restored from in the
same process, `failover.max_restores` times, each logged; one death more ends the run in one
line saying what to run next. The run itself is a stand-in here (no Ray); the real job, killed
under a stream of faults, restores in process with exact parity in the chaos soak
(tests/functional, scripts/chaos_soak.py)."""

from __future__ import annotations

import json

import pytest

from rollout_recovery.config import load_config
from rollout_recovery.errors import ComponentLost
from rollout_recovery.run import TrainingRun
from rollout_recovery.storage import RunStorage


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


def test_a_halted_controller_is_handed_to_the_next_open_and_killed_when_restores_run_out(
    opened, tmp_path
):
    _, calls = opened
    halted = _Proxy()

    def loop(run) -> None:
        run.kept = halted  # as close() does when the engines can serve the restore
        raise ComponentLost("store shard", "its worker process has died")

    with pytest.raises(ComponentLost):
        TrainingRun.keep_running(_cfg(tmp_path, 1), loop)
    assert [run.given for _, run in calls] == [None, halted]
    assert halted.calls == ["kill"]  # the last one, not restored from, is ended


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


class _Notices:
    def stop(self) -> None:
        pass


def _closed(tmp_path, proxy: _Proxy, lost: ComponentLost, keep: bool = True) -> TrainingRun:
    run = TrainingRun.__new__(TrainingRun)
    run.cfg = load_config(None, [f"checkpointing.checkpoint_dir={tmp_path / 'run'}",
                                 f"failover.keep_engines={str(keep).lower()}"])  # fmt: skip
    run.rollouts, run.kept, run._notices, run._scratch = proxy, None, _Notices(), None
    run.close(lost=lost)
    return run


@pytest.mark.parametrize(
    ("component", "proxy", "keep", "kept"),
    [
        ("store shard", _Proxy(), True, True),
        ("environment actor", _Proxy(), True, True),
        ("controller", _Proxy(), True, False),  # the engines died with their owner
        ("store shard", _Proxy(), False, False),  # failover.keep_engines=false
        ("store shard", _Proxy(halt_fails=True), True, False),  # the controller died meanwhile
        ("store shard", _Proxy(settles=False), True, False),  # its call never ended
    ],
)
def test_the_engines_are_kept_only_when_the_controller_lives_and_its_call_ended(
    tmp_path, component, proxy, keep, kept
):
    run = _closed(tmp_path, proxy, ComponentLost(component, "its worker process has died"), keep)
    assert (run.kept is proxy) is kept
    assert ("kill" in proxy.calls) is not kept
    if kept:
        assert proxy.calls == ["control:halt", "settled"]
