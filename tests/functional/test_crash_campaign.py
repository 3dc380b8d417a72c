"""The crash-point campaign, reduced (issue 13): a small prefix-level job killed three times in
a row, each time at another named crash point (a worker's cut, the controller's manifest, the
trainer between a step's snapshot and its log line) and each followed by a simulated power
loss, then restored to the end and checked against an uninterrupted reference (the
session's `crash_chain`, tests/conftest.py). Then the campaign's checks are shown failing on
damaged copies of the finished run, so a pass means something."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rollout_recovery import protocol
from rollout_recovery.testing.campaign import crash_points as campaign
from rollout_recovery.testing.campaign import engine_evidence

pytestmark = pytest.mark.engine
CHAIN = campaign.CHAINS[0]


@pytest.fixture(scope="module")
def finished(crash_chain) -> tuple[Path, campaign.CrashCampaignResult]:
    return crash_chain


def test_three_crashes_in_a_row_under_power_loss_recover_exactly(finished):
    _, result = finished
    [case] = result.cases
    assert case.violations == [], case.violations
    assert case.outcome == "recovered_exact" and case.kind == "crashes_in_a_row"
    assert [m["point"] for m in case.marks] == CHAIN  # each run died where it was armed
    assert case.marks[0]["after"] == campaign.ANCHOR
    assert len(case.selected) == 3 and case.orphans == []
    summary = result.summary()
    assert summary["rollouts_lost"] == summary["trained_twice"] == 0
    assert summary["silent_corruption"] == summary["committed_decoded_again"] == 0
    assert result.reference_arrivals["fence_held"] > 0 and result.unreached == []


def _copy(work: Path, tmp_path: Path) -> tuple[Path, Path, str]:
    [case_dir] = [p for p in work.iterdir() if p.name.startswith("in_a_row+")]
    run = tmp_path / "run"
    shutil.copytree(case_dir / "run", run)
    return case_dir, run, str(work / "reference")


def _tags(result: campaign.CaseResult) -> set[str]:
    return {v.split("]")[0] + "]" for v in result.violations}


def test_the_recheck_of_the_untouched_copy_passes(finished, tmp_path):
    case_dir, run, ref = _copy(finished[0], tmp_path)
    assert campaign.recheck(case_dir, ref, str(run)).violations == []


def test_a_left_temporary_file_is_an_orphan(finished, tmp_path):
    case_dir, run, ref = _copy(finished[0], tmp_path)
    (run / "trainer" / "step-000003" / "state.safetensors.tmp-0badc0de").write_bytes(b"half")
    assert _tags(campaign.recheck(case_dir, ref, str(run))) == {"[orphans]"}


def test_a_step_trained_again_is_counted_twice(finished, tmp_path):
    case_dir, run, ref = _copy(finished[0], tmp_path)
    lines = (run / "steps.jsonl").read_text().splitlines()
    last = [ln for ln in lines if '"event"' not in ln][-1]
    (run / "steps.jsonl").write_text("\n".join([*lines, last]) + "\n")
    result = campaign.recheck(case_dir, ref, str(run))
    assert _tags(result) == {"[trained_twice]"} and result.trained_twice == 1


def test_a_batch_of_other_rollouts_is_lost_and_duplicated_work(finished, tmp_path):
    case_dir, run, ref = _copy(finished[0], tmp_path)
    shutil.copy(run / "batches" / "step-000001.arrow", run / "batches" / "step-000002.arrow")
    result = campaign.recheck(case_dir, ref, str(run))
    assert {"[lost]", "[trained_twice]"} <= _tags(result)
    assert result.rollouts_lost == result.trained_twice == 2


def test_another_final_trainer_checkpoint_breaks_parity(finished, tmp_path):
    case_dir, run, ref = _copy(finished[0], tmp_path)
    state = run / "trainer" / "step-000003" / "state.safetensors"
    data = bytearray(state.read_bytes())
    data[-1] ^= 1
    state.write_bytes(bytes(data))
    assert "[parity]" in _tags(campaign.recheck(case_dir, ref, str(run)))


def test_a_committed_rollout_decoded_again_is_caught_from_the_engine_records(finished, tmp_path):
    """The last restore's engines decoded rollout R. Had its snapshot held R finished, that
    decode would be a finished rollout decoded again: declare R finished in the saved
    snapshot state, and the check must name it from the engine records."""
    case_dir, run, ref = _copy(finished[0], tmp_path)
    saved = json.loads((case_dir / "case.json").read_text())
    k = len(saved["states"]) - 1
    name = campaign.snapshot_name(campaign.restore_events(str(run))[k]["snapshot"])
    chosen = saved["states"][k][name]
    records = campaign.records_by_run(str(run), saved["starts"])[k + 1]
    decoded = [r for r in engine_evidence.of_step(records, chosen["ledger"]["step"])
               if r["decoded_tokens"] > 0]  # fmt: skip
    assert decoded, "the last restore decoded nothing of the step it redid"
    group, index = decoded[0]["rollout_id"].rsplit("-g", 1)
    chosen["finished"].append(protocol.replay_key(group, int(index)))
    (tmp_path / "case").mkdir()
    (tmp_path / "case" / "case.json").write_text(json.dumps(saved))
    result = campaign.recheck(tmp_path / "case", ref, str(run))
    assert "[committed_turn_decoded_again]" in _tags(result)
    assert result.committed_decoded_again >= 1
