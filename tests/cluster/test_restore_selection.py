"""Which snapshot a restart restores: newest, newest after a trainer checkpoint, fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout_recovery.api import LEDGER, restore_snapshot
from tests.cluster.store_helpers import replay_table

pytestmark = pytest.mark.cluster


def _snap(store, root, step, reason, continuations=None, level="prefix", episodes=()):
    store.put("replay", replay_table([f"r/{step}-{reason}"]))
    ledger = {"format": 2, "step": step, "weight_version": step, "reason": reason,
              "continuations": continuations or {}, "level": level,
              "episodes": list(episodes)}  # fmt: skip
    return store.snapshot(
        root, meta={"trainer_step": str(step), "reason": reason},
        sidecars={LEDGER: json.dumps(ledger).encode()},
    ).uri  # fmt: skip


def test_restore_mode_selection_fallback_and_level_refusal(make_store, tmp_path, capsys):
    root = str(tmp_path / "snaps")
    src = make_store(1)
    cont = {"r-g0": {"attempt": 0, "keys": ["k"], "tokens": 3, "digest": "00"}}
    first = _snap(src, root, 1, "trainer_checkpoint")
    second = _snap(src, root, 1, "cadence", cont)
    third = _snap(src, root, 2, "cadence", cont)

    target = make_store(1)
    uri, ledger = restore_snapshot(target, root, "latest", "prefix")
    assert uri == third and ledger["step"] == 2
    uri, _ = restore_snapshot(target, root, "trainer_checkpoint", "prefix")
    assert uri == first
    assert target.list("replay") == ["r/1-trainer_checkpoint"]

    # The newest is corrupt: fall back to the previous one, and say so.
    arrow = next(Path(third).rglob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:-5])
    uri, ledger = restore_snapshot(target, root, "latest", "prefix")
    assert uri == second and ledger["reason"] == "cadence"
    out = capsys.readouterr().out
    assert f"Snapshot {third} is unusable" in out and "falling back" in out

    # Prefix-level state is refused by a coarser configuration, with the setting to use.
    with pytest.raises(RuntimeError, match=r"rollout_recovery\.target_level=prefix"):
        restore_snapshot(target, root, "latest", "none")
    assert restore_snapshot(make_store(1), str(tmp_path / "empty"), "latest", "prefix") is None


def test_turn_level_episodes_are_refused_by_level_none(make_store, tmp_path):
    root = str(tmp_path / "snaps")
    episode = {"rollout_id": "r-g0", "turns": [{}], "continuation": None}
    _snap(make_store(1), root, 1, "cadence", level="turn", episodes=[episode])
    with pytest.raises(RuntimeError, match=r"rollout_recovery\.target_level=turn"):
        restore_snapshot(make_store(1), root, "latest", "none")
    uri, ledger = restore_snapshot(make_store(1), root, "latest", "turn")
    assert ledger["episodes"] == [episode] and ledger["level"] == "turn" and Path(uri).is_dir()
