"""A run's location is always continuable, and a restore refuses a change of the settings its
records depend on before it touches anything (issue: restore contracts).

No Ray, no engine: locations are written the way a run writes them (test_restore_set_aside's
`Run`: trainer checkpoints, ledgers, manifests, publish entries), then opened by the restore's
own planning and claiming code. The functional walk through every failure and refusal on a
real engine is tests/engine/test_continuable.py."""

from __future__ import annotations

import json

import pytest

from rollout_recovery.config import load_config
from rollout_recovery.controller import run_settings
from rollout_recovery.controller.selection import DATA_PLANE
from rollout_recovery.data_plane import StagingStore, ownership
from rollout_recovery.data_plane.filesystem import resolve
from rollout_recovery.data_plane.snapshot_io import new_snapshot_dir
from rollout_recovery.errors import RestoreError, RunExistsError
from rollout_recovery.storage import RunStorage
from rollout_recovery.trainer import run_plan, step_log
from tests.unit.test_restore_set_aside import Run, config, tree


def _epochs(uri: str) -> list[int]:
    fs, root = resolve(RunStorage(uri).child_uri(DATA_PLANE))
    return sorted(b.epoch for b in ownership.read_log(fs, root).entries.values()
                  if b.kind == "claim")  # fmt: skip


def _no_work_location(tmp_path):
    """What a run left when it died before anything was published: its claim, a step log
    line (an in-process restore's), weights, and a snapshot directory never published."""
    uri = str(tmp_path / "run")
    storage = RunStorage(uri)
    StagingStore.claim(storage.child_uri(DATA_PLANE), first=True)
    step_log.append(storage, {"event": "restored_in_process", "component": "environment actor",
                              "step": 0})  # fmt: skip
    fs, root = resolve(storage.child_uri(DATA_PLANE))
    new_snapshot_dir(fs, root)
    return uri, storage


def test_a_location_with_no_snapshot_and_no_trainer_checkpoint_is_continued_from_step_0(
    tmp_path, capsys
):
    """Item 1 and 2: it holds no work, so `train --restore` starts it again from step 0 as the
    next owner epoch, its history kept; `train` still refuses, naming `train --restore`."""
    uri, storage = _no_work_location(tmp_path)
    with pytest.raises(RunExistsError, match="continue it with `train --restore`"):
        run_plan.claim_fresh(storage)
    plan, owner = run_plan.claim_restore(config(uri), storage)
    assert plan is None and owner.epoch == 2 and _epochs(uri) == [1, 2]
    run_plan.started_again(storage, owner, ["steps.jsonl"])
    assert "starts again from step 0 as owner epoch 2, its history kept" in capsys.readouterr().out
    lines = [json.loads(x) for x in storage.read_lines("steps.jsonl")]
    assert [x["event"] for x in lines] == ["restored_in_process", "started_again"]
    # And again: a second death before the first snapshot is continued the same way.
    plan, owner = run_plan.claim_restore(config(uri), storage)
    assert plan is None and owner.epoch == 3


def test_trainer_checkpoints_without_a_snapshot_are_refused_naming_a_command_that_works(tmp_path):
    uri, storage = _no_work_location(tmp_path)
    storage.write_bytes("trainer/step-000001/meta.json", b"{}")
    before = tree(tmp_path)
    with pytest.raises(RestoreError) as err:
        run_plan.claim_restore(config(uri), storage)
    assert "holds trainer checkpoints but no published snapshot" in str(err.value)
    assert (
        "start a new run on purpose in another checkpointing.checkpoint_dir"
        in str(err.value).lower()
    )
    assert tree(tmp_path) == before  # nothing claimed


def _run_of_two_steps(uri: str) -> Run:
    run = Run(uri)
    run.settings = run_settings.of(config(uri))
    owner = StagingStore.claim(run.storage.child_uri(DATA_PLANE))
    for step in (1, 2):
        run.step(step, owner, "old")
    return run


@pytest.mark.parametrize(
    ("overrides", "keys"),
    [
        (["grpo.prompts_per_step=3"], ["grpo.prompts_per_step"]),
        (["grpo.async_grpo.enabled=true", "grpo.async_grpo.max_groups_in_flight=4"],
         ["grpo.async_grpo.enabled"]),
        (["grpo.generations_per_prompt=2"], ["grpo.generations_per_prompt"]),
        (["grpo.seed=7", "policy.generation.max_new_tokens=8"],
         ["grpo.seed", "policy.generation.max_new_tokens"]),
    ],
)  # fmt: skip
def test_a_restore_with_changed_settings_is_refused_naming_them_before_it_claims(
    tmp_path, overrides, keys
):
    """Items 3-5: whatever the snapshot's unfinished episodes happen to be, a changed size,
    async on/off, seed or budget is refused in one line naming each key, with nothing claimed,
    set aside or deleted."""
    uri = str(tmp_path / "run")
    _run_of_two_steps(uri)
    before = tree(tmp_path)
    changed = load_config(None, [f"checkpointing.checkpoint_dir={uri}",
                                 "policy.model_path=hf://org/tiny", "grpo.steps=10",
                                 "rollout_checkpointing.keep_latest_k=2", *overrides])  # fmt: skip
    with pytest.raises(RestoreError) as err:
        run_plan.claim_restore(changed, RunStorage(uri))
    line = str(err.value)
    assert "\n" not in line and "nothing was claimed, set aside or deleted" in line
    named = [k for k in run_settings.KEYS if f"{k}=" in line.split("this restore sets")[1]]
    assert named == keys
    assert tree(tmp_path) == before and _epochs(uri) == [1]


def test_the_same_settings_and_a_safe_change_restore(tmp_path):
    """grpo.steps, the learning rate and the cadence are not part of the records."""
    uri = str(tmp_path / "run")
    _run_of_two_steps(uri)
    same = load_config(None, [f"checkpointing.checkpoint_dir={uri}",
                              "policy.model_path=hf://org/tiny", "grpo.steps=12",
                              "grpo.learning_rate=0.5",
                              "rollout_checkpointing.snapshot_attempt_interval_s=9",
                              "rollout_checkpointing.keep_latest_k=2"])  # fmt: skip
    plan, owner = run_plan.claim_restore(same, RunStorage(uri))
    assert plan is not None and plan.step == 2 and owner.epoch == 2


def test_a_ledger_from_before_settings_were_recorded_is_not_compared(tmp_path):
    uri = str(tmp_path / "run")
    run = Run(uri)
    owner = StagingStore.claim(run.storage.child_uri(DATA_PLANE))
    run.step(1, owner, "old")  # settings {}
    assert run_settings.changed({}, config(uri)) == {}
    plan, _ = run_plan.claim_restore(config(uri), RunStorage(uri))
    assert plan is not None and plan.step == 1


def test_the_refusal_shows_values_as_a_config_file_writes_them():
    line = run_settings.refusal("/r", "snapshot-1", {"grpo.async_grpo.enabled": (True, False)})
    assert "grpo.async_grpo.enabled=true (snapshot snapshot-1)" in line
    assert "sets grpo.async_grpo.enabled=false" in line


def test_each_restore_of_one_snapshot_gives_its_episodes_attempts_of_their_own(tmp_path):
    """Item 7: two restores of the same snapshot (two claims) move the restored attempts by
    the epochs since its publisher, so the engines never merge two restores' tries into one
    record; a restore of a snapshot its own epoch's predecessor published moves by 1."""
    from rollout_recovery.controller.restore import attempt_step
    from rollout_recovery.environment.episode import EpisodeState
    from rollout_recovery.protocol import EpisodeRecord

    uri = str(tmp_path / "run")
    run = _run_of_two_steps(uri)  # published under epoch 1
    root = run.storage.child_uri(DATA_PLANE)
    name = run.last[0]
    steps = []
    for _ in range(3):
        owner = StagingStore.claim(root)  # each restore claims the next epoch
        steps.append(attempt_step(root, f"{root}/{name}", owner))
    assert steps == [1, 2, 3]
    rec = EpisodeRecord(rollout_id="s0001-p000-g0", group_id="s0001-p000", generation_index=0,
                        seed=1, attempt=0, task={})  # fmt: skip
    attempts = [EpisodeState.from_record(rec, lambda _: None, s).attempt for s in steps]
    assert attempts == [1, 2, 3] and len(set(attempts)) == 3
    assert [EpisodeState.restart(rec, s).attempt for s in steps] == [1, 2, 3]
    # Without an owner (a loop on RolloutRecovery with no claim) or an unknown snapshot: 1.
    assert attempt_step(root, f"{root}/snapshot-9999999999-x", owner) == 1
    assert attempt_step(root, f"{root}/{name}", None) == 1


def test_an_episodes_result_is_kept_with_its_row_and_read_back_after_a_restore():
    """Item 8: the row keeps what the episode returned (JSON), so a restored run's results for
    episodes finished before its snapshot equal the uninterrupted run's; rows written before
    results were kept read back as None."""
    import numpy as np

    from rollout_recovery.data_plane.schemas import (
        REPLAY_ROW_SCHEMA,
        VERSION_KEY,
        ReplayRow,
        conform,
        replay_rows_to_table,
        table_to_replay_rows,
    )

    row = ReplayRow(key="k", rollout_id="r", group_id="g", generation_index=0, prompt_len=1,
                    token_ids=np.arange(3, dtype=np.int32), loss_mask=np.ones(3, np.int8),
                    logprobs=np.zeros(3, np.float32), reward=1.0, weight_version_min=0,
                    weight_version_max=0, result_json='{"tally": 3, "text": "12"}')  # fmt: skip
    [back] = table_to_replay_rows(replay_rows_to_table([row]))
    assert back.result == {"tally": 3, "text": "12"}
    old = replay_rows_to_table([row]).drop_columns(["result_json"])
    old = old.replace_schema_metadata(REPLAY_ROW_SCHEMA.metadata | {VERSION_KEY: b"3"})
    [legacy] = table_to_replay_rows(conform(old, REPLAY_ROW_SCHEMA, "test"))
    assert legacy.result_json is None and legacy.result is None


def test_a_result_json_cannot_hold_names_the_episode_function():
    from rollout_recovery.config import load_config
    from rollout_recovery.environment.episode import EpisodeState
    from rollout_recovery.environment.failures import result_json
    from rollout_recovery.errors import UserCodeError

    cfg = load_config(None, []).environment_config()
    st = EpisodeState("s0-p0-g0", "s0-p0", 0, 1, {})
    assert result_json(cfg, st, print, True, {"a": [1, 2.5, None]}) == '{"a": [1, 2.5, null]}'
    with pytest.raises(UserCodeError) as err:
        result_json(cfg, st, print, True, {"a": object()})
    assert "environment.episode=" in str(err.value) and "return JSON values" in str(err.value)


def test_a_restore_below_prefix_level_takes_nothing_from_the_token_log():
    """Item 6: at levels turn and none a restore regenerates the calls in flight from their
    first token, as the level table says, even where the token log holds rows of them."""
    from types import SimpleNamespace

    from rollout_recovery.controller import restore
    from rollout_recovery.protocol import Continuation, EpisodeRecord

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"the restore read the token log's store ({name})")

    rec = EpisodeRecord(rollout_id="s0001-p000-g0", group_id="s0001-p000", generation_index=0,
                        seed=1, attempt=0, task={},
                        continuation=Continuation(call_id="c0", attempt=0))  # fmt: skip
    for level in ("turn", "none"):
        cfg = load_config(None, ["token_capture.enabled=true", "checkpointing.save_data_plane=true",
                                 "token_capture.log_interval_tokens=8",
                                 f"rollout_recovery.target_level={level}"])  # fmt: skip
        cfg.token_capture.log_uri = "/nonexistent/token_log"
        rr = SimpleNamespace(cfg=cfg, store=Untouchable(), metrics=Untouchable(),
                             storage=Untouchable())  # fmt: skip
        assert restore._extend_and_log(rr, "restore-1", "snap", [rec], 1) == {}
