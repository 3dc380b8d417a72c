"""Which snapshot a restart restores: newest, newest after a trainer checkpoint, fallback past
damaged ones with the reason, refusal when none is usable or the level is too coarse, and
refusal of another model. Real store snapshots on real files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout_recovery.controller.selection import LEDGER, check_model, select_snapshot
from rollout_recovery.errors import RestoreError
from rollout_recovery.protocol import LEDGER_FORMAT, EpisodeRecord
from tests.cluster.store_helpers import replay_table

pytestmark = pytest.mark.cluster
MODEL = {"base": {"path": "tiny://default", "sha256": "ab" * 32}, "weight_version": 0,
         "weights_sha256": None}  # fmt: skip


def _snap(store, root, step, reason, continuations=None, level="prefix", episodes=(), fmt=None):
    store.put("replay", replay_table([f"r/{step}-{reason}"]))
    ledger = {"format": fmt or LEDGER_FORMAT, "step": step, "weight_version": step,
              "reason": reason, "continuations": continuations or {}, "level": level,
              "episodes": list(episodes), "model": MODEL}  # fmt: skip
    return store.snapshot(
        root, meta={"trainer_step": str(step), "reason": reason},
        sidecars={LEDGER: json.dumps(ledger).encode()},
    ).uri  # fmt: skip


def test_restore_mode_selection_fallback_and_level_refusal(make_store, tmp_path):
    root = str(tmp_path / "snaps")
    src = make_store(1)
    cont = {"r-g0": {"call_id": "c0", "attempt": 0, "keys": ["k"], "tokens": 3, "digest": "00"}}
    first = _snap(src, root, 1, "trainer_checkpoint")
    second = _snap(src, root, 1, "cadence", cont)
    third = _snap(src, root, 2, "cadence", cont)

    choice = select_snapshot(root, "latest", "prefix")
    assert choice.snapshot == third and choice.ledger.step == 2 and choice.skipped == []
    assert select_snapshot(root, "trainer_checkpoint", "prefix").snapshot == first

    # The newest has a torn data file: fall back to the previous one and say why.
    arrow = next(Path(third).rglob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:-5])
    choice = select_snapshot(root, "latest", "prefix")
    assert choice.snapshot == second and choice.ledger.reason == "cadence"
    [(uri, reason)] = choice.skipped
    assert uri == third and "bytes" in reason

    # Prefix-level state is refused by a coarser configuration, with the setting to use.
    with pytest.raises(RestoreError, match=r"rollout_recovery\.target_level=prefix"):
        select_snapshot(root, "latest", "none")
    assert select_snapshot(str(tmp_path / "empty"), "latest", "prefix") is None


def test_when_no_snapshot_is_usable_the_restore_is_refused_with_every_reason(make_store, tmp_path):
    root = str(tmp_path / "snaps")
    src = make_store(1)
    old = _snap(src, root, 1, "trainer_checkpoint", fmt=2)  # predates the model identity
    new = _snap(src, root, 2, "trainer_checkpoint")
    manifest = Path(new) / "MANIFEST.json"
    manifest.write_bytes(manifest.read_bytes()[:100])  # torn
    with pytest.raises(RestoreError) as info:
        select_snapshot(root, "latest", "prefix")
    msg = str(info.value)
    assert "\n" not in msg and "nothing was deleted" in msg and "checkpoint_dir" in msg
    assert f"{new}: " in msg and "MANIFEST" in msg
    assert f"{old}: " in msg and "format 2" in msg
    assert Path(old).is_dir() and Path(new).is_dir()


def test_turn_level_episodes_are_refused_by_level_none(make_store, tmp_path):
    root = str(tmp_path / "snaps")
    turn = {"entry_id": "r-g0/c0/a0", "payload_sha256": "ab" * 32, "request_messages": 1}
    episode = {"format": 1, "rollout_id": "r-g0", "group_id": "r", "generation_index": 0,
               "seed": 7, "attempt": 0, "messages": [{"role": "user", "content": "go"}],
               "state": None, "turns": [turn], "continuation": None}  # fmt: skip
    _snap(make_store(1), root, 1, "cadence", level="turn", episodes=[episode])
    with pytest.raises(RestoreError, match=r"rollout_recovery\.target_level=turn"):
        select_snapshot(root, "latest", "none")
    choice = select_snapshot(root, "latest", "turn")
    [loaded] = choice.ledger.episodes
    assert loaded == EpisodeRecord.model_validate(episode) and choice.ledger.level == "turn"
    # A format-1 record (before episode functions) loads with its first prompt as the task;
    # the environment refuses the record itself and starts the episode over.
    assert loaded.format == 1 and loaded.task == {"messages": episode["messages"][:1]}


def test_another_model_is_refused(make_store, tmp_path):
    root = str(tmp_path / "snaps")
    uri = _snap(make_store(1), root, 1, "cadence")
    ledger = select_snapshot(root, "latest", "prefix").ledger
    check_model(uri, ledger, {"path": "/elsewhere", "sha256": "ab" * 32})  # same weights: fine
    with pytest.raises(RestoreError, match="in-flight calls would be continued by other weights"):
        check_model(uri, ledger, {"path": "tiny://default", "sha256": "cd" * 32})
