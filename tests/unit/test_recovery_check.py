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
ev = rc.evidence


def _killed(tokens: int = 3) -> dict:
    def ep(i, cont):
        return {"rollout_id": f"s0001-p000-g{i}", "group_id": "s0001-p000",
                "generation_index": i, "turns": [{}], "continuation": cont}  # fmt: skip

    cont = {"call_id": "c1", "attempt": 0, "keys": ["k"], "tokens": tokens}
    episodes = [ep(0, cont), ep(1, None), ep(2, None)]
    return {"ledger": {"step": 1, "episodes": episodes}, "finished_keys": ["s0001-p000/002"]}


def _rec(rollout: str, call: str, attempt: int, decoded: int, prefix: int = 0, **kw) -> dict:
    return {"rollout_id": rollout, "model_call_id": call, "attempt": attempt,
            "decoded_tokens": decoded, "prefix_tokens": prefix,
            "resume": "resumed" if prefix else "none", "refused_reason": None} | kw  # fmt: skip


# The restore phase of _killed(): c1 of g0 resumed from 3 tokens and decoded its 2-token tail;
# g1 went on with its next call c1 (its c0 was committed).
GOOD_AFTER = [_rec("s0001-p000-g0", "c1", 1, 2, prefix=3), _rec("s0001-p000-g1", "c1", 1, 4)]


def _batch(run_dir: Path, mask: list[int]) -> None:
    masks = pa.array([mask], pa.list_(pa.int8()))
    table = pa.table({"key": ["s0001-p000/000"], "loss_mask": masks})
    path = run_dir / "batches" / "step-000002.arrow"
    path.parent.mkdir(parents=True)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def test_turn_lengths_are_the_runs_of_the_loss_mask():
    assert rc.turn_lengths(np.int8([0, 1, 1, 0, 0, 1, 1, 1, 0, 1])) == [2, 3, 1]


def _check(tmp_path, counts=TOTAL, after=GOOD_AFTER, level="prefix") -> list[str]:
    args = SimpleNamespace(level=level)
    return rc.check_restored_once(args, _killed(), str(tmp_path), counts, after)


def test_every_guarantee_read_from_the_engine_records(tmp_path):
    _batch(tmp_path, [0, 0, 1, 1, 0, 1, 1, 1, 1, 1])  # turn c1 is 5 tokens = 3 + 2
    assert _check(tmp_path) == []
    assert _check(tmp_path, TOTAL | {"restored_episodes": 3}) == [
        "3 episodes re-admitted, the snapshot holds 2 unfinished"
    ]
    # Resume disabled: the worker decoded the cut call from scratch (a silent regeneration
    # returns the same tokens; only the engine record tells).
    silent = [_rec("s0001-p000-g0", "c1", 1, 5), GOOD_AFTER[1]]
    [msg] = _check(tmp_path, after=silent)
    assert msg.startswith("[resumed] s0001-p000-g0/c1 was cut with 3 tokens")
    refused = [_rec("s0001-p000-g0", "c1", 1, 5, resume="refused", refused_reason="x")]
    assert _check(tmp_path, after=refused + GOOD_AFTER[1:])[0].startswith("[resumed]")
    # The engine decoded more than the tail (e.g. the prefix again).
    extra = [_rec("s0001-p000-g0", "c1", 1, 4, prefix=3), GOOD_AFTER[1]]
    assert _check(tmp_path, after=extra)[0].startswith("[decoded_tail] s0001-p000-g0/c1")
    # A committed turn (g1's c0) or a call of a finished episode (g2) decoded again.
    again = [*GOOD_AFTER, _rec("s0001-p000-g1", "c0", 1, 4), _rec("s0001-p000-g2", "c0", 1, 6)]
    msgs = _check(tmp_path, after=again)
    assert [m.split("]")[0] for m in msgs] == ["[committed_turn_decoded_again"] * 2
    assert _check(tmp_path, after=again, level="turn")[0].startswith("[committed_turn")
    # A record that failed closed, and a worker-side refusal.
    bad = TOTAL | {"restore_refused.missing_entry": 1}
    assert _check(tmp_path, bad) == ["[restore_refused] episode records started over: "
                                     "{'restore_refused.missing_entry': 1}"]  # fmt: skip
    fell_back = TOTAL | {"worker_resumes_refused": 1}
    assert _check(tmp_path, fell_back)[0].startswith("[resumed] the workers refused 1")


def test_lost_work_counts_tokens_decoded_on_both_sides_of_the_crash():
    killed = _killed()
    # Before the crash: g0/c1 had decoded 7 tokens (3 of them cut), g1/c0 (committed) 4,
    # g1/c1 2 (not cut), g2/c0 (finished) 6.
    before = [_rec("s0001-p000-g0", "c1", 0, 7), _rec("s0001-p000-g1", "c0", 0, 4),
              _rec("s0001-p000-g1", "c1", 0, 2), _rec("s0001-p000-g2", "c0", 0, 6)]  # fmt: skip
    after = [_rec("s0001-p000-g0", "c1", 1, 5, prefix=3), _rec("s0001-p000-g1", "c1", 1, 4)]
    reference = [_rec("s0001-p000-g0", "c1", 0, 8), _rec("s0001-p000-g1", "c0", 0, 4),
                 _rec("s0001-p000-g1", "c1", 0, 4), _rec("s0001-p000-g2", "c0", 0, 6)]  # fmt: skip
    lw = ev.lost_work(before, after, reference, killed["ledger"], killed["finished_keys"], "prefix")
    # prefix: g0/c1 positions 3..7 again (4), g1/c1 0..2 again (2)
    assert (lw["prefix"], lw["turn"], lw["none"]) == (6, 9, 19)
    assert lw["decoded_before_crash"] == 19 and lw["decoded_after_restore"] == 9


def test_intervals_overlap_by_positions():
    assert ev.overlap([(0, 5), (3, 8)], [(6, 10)]) == 2
    assert ev.overlap([(0, 4)], [(4, 9)]) == 0


def test_logprob_thresholds_fail_a_perturbed_step():
    ok = {1: {"logprobs_bit_identical": 1.0, "logprobs_max_abs_diff": 0.0}}
    assert ev.check_logprobs(ok, 0.5, 1e-5) == []
    drift = {1: {"logprobs_bit_identical": 0.99, "logprobs_max_abs_diff": 0.01}}
    [msg] = ev.check_logprobs(drift, 0.5, 1e-5)
    assert msg.startswith("[logprobs] step 1")
    assert ev.check_logprobs({1: {"logprobs_bit_identical": 0.2,
                                  "logprobs_max_abs_diff": 0.0}}, 0.5, 1e-5)  # fmt: skip


def test_tool_states_must_match_and_apply_each_effect_once(tmp_path):
    ref, rec = tmp_path / "ref", tmp_path / "rec"
    for d, states in (
        (ref, {"a": {"tally": 5, "effects": [0, 1]}, "b": {"tally": 2, "effects": [0, 1]}}),
        (rec, {"a": {"tally": 5, "effects": [0, 1]}, "b": {"tally": 4, "effects": [0, 1]}}),
    ):
        (d / "batches").mkdir(parents=True)
        (d / "batches" / "step-000001.results.json").write_text(json.dumps(states))
    [msg] = rc.compare_results(str(ref), str(rec), 1, max_turns=3)
    assert msg.startswith("step 1: b ended with another result than the reference's (['tally'])")


def test_a_check_signals_only_processes_that_carry_its_mark(monkeypatch):
    """Checks run at once and pids get reused: a pid from a check's process tree that now
    belongs to another check's process is left alone (functional_tests/processes.py)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    sys.path.insert(0, str(REPO / "functional_tests"))
    import processes

    monkeypatch.setenv(processes.MARK_ENV, "check-under-test")
    ours = subprocess.Popen(["sleep", "30"])
    env = {k: v for k, v in os.environ.items() if k != processes.MARK_ENV}
    theirs = subprocess.Popen(["sleep", "30"], env=env | {processes.MARK_ENV: "another-check"})
    try:
        time.sleep(0.2)
        assert processes.owned(ours.pid) and not processes.owned(theirs.pid)
        assert processes.signal_own({ours.pid, theirs.pid}, signal.SIGKILL) == [theirs.pid]
        assert ours.wait(timeout=10) == -signal.SIGKILL
        assert theirs.poll() is None and processes.alive_own(theirs.pid) is False
    finally:
        for proc in (ours, theirs):
            proc.kill()
            proc.wait()


def test_a_process_whose_environment_reads_as_no_checks_is_its_parents():
    """Ray's agents retitle themselves over their environment, so no token can be read there:
    a process with no token at all is the check's when its parent is, and another check's
    when its parent is another check's. Without this a held run's agents stayed stopped and
    every actor created after the resume waited on them."""
    import os
    import subprocess
    import sys
    import time

    sys.path.insert(0, str(REPO / "functional_tests"))
    import processes

    env = {k: v for k, v in os.environ.items() if k != processes.MARK_ENV}
    tree = "env -i sleep 30 & wait"
    ours = subprocess.Popen(["sh", "-c", tree], env=env | {processes.MARK_ENV: "this-check"})
    theirs = subprocess.Popen(["sh", "-c", tree], env=env | {processes.MARK_ENV: "another"})
    try:
        deadline = time.monotonic() + 10
        while not (processes.descendants(ours.pid) and processes.descendants(theirs.pid)):
            assert time.monotonic() < deadline, "the shells started no child"
            time.sleep(0.05)
        [our_child] = processes.descendants(ours.pid)
        [their_child] = processes.descendants(theirs.pid)
        assert b"this-check" not in Path(f"/proc/{our_child}/environ").read_bytes()
        assert processes.owned(our_child, "this-check")
        assert not processes.owned(their_child, "this-check")
        assert processes.owned(their_child, "another")
    finally:
        for proc in (ours, theirs):
            for pid in processes.descendants(proc.pid):
                os.kill(pid, 9)
            proc.kill()
            proc.wait()


def test_a_training_script_replaces_the_cli_in_every_phase():
    """`--train PATH`: the script with the repo's python, its config beside it by default."""
    script = REPO / "examples" / "own_loop" / "train.py"
    args = SimpleNamespace(train=script, config=None, env="tally", level="prefix")
    assert rc.train_command(args) == [rc.PYTHON, str(script)]
    assert rc.config(args) == str(script.parent / "config.yaml")
    assert rc.env_overrides(args, "/tmp/run") == ["rollout_recovery.target_level=prefix"]
    cli = SimpleNamespace(train=None, config=None, env="tally", level="turn")
    assert rc.train_command(cli) == rc.CLI
    assert rc.config(cli) == str(REPO / "configs" / "turn_recovery.yaml")


def test_the_own_loop_needs_fewer_than_40_lines_of_recovery_glue():
    """Every line of examples/own_loop/train.py whose code names the run (TrainingRun, `run`,
    the lease, the group ids the API requires, its errors) is marked `# recovery glue`; the
    rest is the loop's own PyTorch."""
    import io
    import tokenize

    path = REPO / "examples" / "own_loop" / "train.py"
    text = path.read_text()
    names = {"TrainingRun", "run", "lease", "group_id", "RecoveryError", "StorageError"}
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    glue = {t.start[0] for t in tokens
            if t.type == tokenize.COMMENT and t.string.startswith("# recovery glue")}  # fmt: skip
    touching = {t.start[0] for t in tokens if t.type == tokenize.NAME and t.string in names}
    assert sorted(touching - glue) == []
    assert 10 <= len(glue) < 40, len(glue)


def _two_owners():
    spec = importlib.util.spec_from_file_location(
        "two_owners", REPO / "functional_tests" / "two_owners.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_two_owner_check_sees_every_write_under_the_run(tmp_path):
    """Between two states of the location: a file added, one changed, one removed, a new
    directory, a log line appended and a log rewritten are each reported (by kind), and a
    location left alone reports nothing."""
    to = _two_owners()
    run = tmp_path / "run"
    (run / "trainer" / "step-000001").mkdir(parents=True)
    (run / "trainer" / "step-000001" / "meta.json").write_text("{}")
    (run / "batches").mkdir()
    (run / "batches" / "step-000001.arrow").write_bytes(b"a")
    (run / "steps.jsonl").write_text('{"step": 1}\n')
    (run / "checkpoints.jsonl").write_text('{"a": 1}\n')
    before = to.State(run)
    assert to.wrote(before, to.State(run))["touched"] == 0
    (run / "trainer" / "step-000001" / "meta.json").write_text('{"x": 1}')
    (run / "batches" / "step-000001.arrow").unlink()
    (run / "token_log" / "w0").mkdir(parents=True)
    (run / "token_log" / "w0" / "000.arrow").write_bytes(b"t")
    (run / "steps.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (run / "checkpoints.jsonl").write_text('{"b": 1}\n')
    w = to.wrote(before, to.State(run))
    assert w["changed"] == ["trainer/step-000001/meta.json"]
    assert w["removed"] == ["batches/step-000001.arrow"]
    assert w["directories_added"] == ["token_log", "token_log/w0"]
    assert w["files"] == {"trainer": ["trainer/step-000001/meta.json"],
                          "token_log": ["token_log/w0/000.arrow"]}  # fmt: skip
    assert w["logs"] == {"steps.jsonl": {"appended": 1, "rewritten": False},
                         "checkpoints.jsonl": {"appended": 0, "rewritten": True}}  # fmt: skip


def test_a_kill_is_never_chosen_after_the_runs_final_trainer_checkpoint():
    """A kill after the final trainer checkpoint leaves nothing to restore (the restore says
    the run finished its steps and exits 1): it is the run ending, not a kill chance."""
    assert rc.restorable({"step": 3, "reason": "cadence"}, 1, 4)
    assert rc.restorable({"step": 3, "reason": "trainer_checkpoint"}, 1, 4)
    assert not rc.restorable({"step": 4, "reason": "trainer_checkpoint"}, 1, 4)
    assert not rc.restorable({"step": 0, "reason": "cadence"}, 1, 4)


def test_a_last_phase_that_decoded_nothing_has_no_records_after_the_kill(tmp_path):
    """The records after the last kill are those of sessions started after its choice: when
    the last phase decoded nothing (no session file of its own), the killed phase's records
    must not stand in for it (they made the async check report committed calls decoded again
    after a restore that decoded none)."""
    attempts = tmp_path / "call_attempts"
    attempts.mkdir()
    before = _rec("s0003-p000-g0", "c0", 0, 128)
    (attempts / "session-1000000000.jsonl").write_text(json.dumps(before) + "\n")
    kills = [{"engine_before": [before], "chosen_at": 2.0}]
    assert rc.after_each_kill(str(tmp_path), kills) == [[]]
    after = _rec("s0004-p000-g0", "c0", 0, 82, prefix=46)
    (attempts / "session-3000000000.jsonl").write_text(json.dumps(after) + "\n")
    assert rc.after_each_kill(str(tmp_path), kills) == [[after]]
    second = [{"engine_before": [before], "chosen_at": 2.0}, {"engine_before": [after]}]
    assert rc.after_each_kill(str(tmp_path), second)[0] == [after]
