"""The functional parity checker's verdicts on synthetic runs: it must be able to fail."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "recovery_check", REPO / "functional_tests" / "recovery_check.py"
)
rc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rc)

TOTAL = {"restored_episodes": 2, "restored_calls": 1, "restored_prefix_tokens": 3,
         "tail_tokens": 2, "worker_resumes_accepted": 1, "worker_resumes_refused": 0}  # fmt: skip


def _killed(tokens: int = 3) -> dict:
    def ep(i, cont):
        return {"group_id": "s0001-p000", "generation_index": i, "turns": [{}],
                "continuation": cont}  # fmt: skip

    cont = {"call_id": "c1", "attempt": 0, "keys": ["k"], "tokens": tokens}
    episodes = [ep(0, cont), ep(1, None), ep(2, None)]
    return {"ledger": {"step": 1, "episodes": episodes}, "finished_keys": ["s0001-p000/002"]}


def _batch(run_dir: Path, mask: list[int]) -> None:
    masks = pa.array([mask], pa.list_(pa.int8()))
    table = pa.table({"key": ["s0001-p000/000"], "loss_mask": masks})
    path = run_dir / "batches" / "step-000002.arrow"
    path.parent.mkdir(parents=True)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def test_turn_lengths_are_the_runs_of_the_loss_mask():
    assert rc.turn_lengths(np.int8([0, 1, 1, 0, 0, 1, 1, 1, 0, 1])) == [2, 3, 1]


def test_exactly_once_and_prefix_plus_tail(tmp_path):
    _batch(tmp_path, [0, 0, 1, 1, 0, 1, 1, 1, 1, 1])  # turn c1 is 5 tokens = 3 + 2
    args = SimpleNamespace(level="prefix")
    assert rc.check_restored_once(args, _killed(), str(tmp_path), TOTAL) == []
    wrong = rc.check_restored_once(args, _killed(), str(tmp_path), TOTAL | {"restored_episodes": 3})
    assert wrong == ["3 episodes re-admitted, the snapshot holds 2 unfinished"]
    short = rc.check_restored_once(args, _killed(), str(tmp_path), TOTAL | {"tail_tokens": 1})
    assert short == ["resumed calls are 5 tokens long, but prefix 3 + tail 1 = 4"]
    fell_back = {"worker_resumes_accepted": 0, "worker_resumes_refused": 1}
    refused = rc.check_restored_once(args, _killed(), str(tmp_path), TOTAL | fell_back)
    assert refused[0].startswith("the workers resumed 0 calls and refused 1")


def test_tool_states_must_match_and_apply_each_effect_once(tmp_path):
    ref, rec = tmp_path / "ref", tmp_path / "rec"
    for d, states in (
        (ref, {"a": {"tally": 5, "effects": [0, 1]}, "b": {"tally": 2, "effects": [0, 1]}}),
        (rec, {"a": {"tally": 5, "effects": [0, 1]}, "b": {"tally": 4, "effects": [0, 1]}}),
    ):
        (d / "batches").mkdir(parents=True)
        (d / "batches" / "step-000001.states.json").write_text(json.dumps(states))
    [msg] = rc.compare_states(str(ref), str(rec), 1, max_turns=3)
    assert msg.startswith("step 1: b ended with tool state {'tally': 4")
