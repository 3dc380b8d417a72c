"""The recovery functional tests at a small size (reference, SIGKILL, restore, parity), and
proof that the checks fail when recovery breaks: a deliberately broken restore of a killed run
(resume disabled, committed turns decoded again) and one perturbed logprob.

The user-environment check (functional_tests/env_recovery.sh) runs here as the prefix check
(the notes agent, two kills, local files) and the turn check (the notes agent, on S3); the
gateway check (functional_tests/gateway_recovery.sh) runs an `openai` client harness per
rollout through the gateway. Those two run on tiny://qwen3 (Qwen's vocabulary), the rest on
the tiny Llama. The failover check (functional_tests/worker_failover.sh) kills one worker's
engine, then one worker actor, in the middle of generation; the two-node check
(functional_tests/two_node_recovery.sh) SIGKILLs a driver whose workers, store shards and
environment actors run on both nodes of a local Ray cluster, and restores it there. The own-loop
check (functional_tests/own_loop_recovery.sh) runs the prefix check on a training loop of its own
(examples/own_loop/train.py) instead of `rollout-recovery train`; the two-owner check
(functional_tests/two_owners.sh) freezes that loop mid-generation, restores its run in a second
process, thaws the first and requires it to stop writing. The async check
(functional_tests/async_recovery.sh) kills asynchronous GRPO twice and checks its invariants;
a tampered copy of its records must fail them. The checks and the runs broken on purpose run
as jobs (tests/functional/checks.py), one at a time from the session's start, at most four at
once from here on.
The built-in single-turn task's prefix recovery is killed at every crash point by
tests/functional/test_crash_campaign.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.functional.checks import BROKEN, Checks, Done

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def suite_checks(functional_checks: Checks) -> Checks:
    """Every check and broken run (tests/functional/checks.py), started one at a time with
    the session (tests/conftest.py), from now on four at once while the session waits."""
    return functional_checks.widen(4)


@pytest.fixture(scope="module")
def jobs(suite_checks: Checks) -> dict[str, Done]:
    return suite_checks.wait_all()


def _passed(jobs: dict, name: str) -> Path:
    proc, out = jobs[name]
    if proc.returncode != 0:
        pytest.fail(f"the {name} check failed:\n{proc.stdout[-3000:]}")
    return out


def _check_run(name: str):
    """A fixture: the output folder of check `name`, which must have passed."""

    @pytest.fixture(scope="module", name=f"{name}_run")
    def run(jobs) -> Path:
        return _passed(jobs, name)

    return run


prefix_run = _check_run("prefix")
gateway_run = _check_run("gateway")
turn_run = _check_run("turn")
failover_run = _check_run("failover")
two_node_run = _check_run("two_node")
own_loop_run = _check_run("own_loop")
two_owners_run = _check_run("two_owners")
async_run = _check_run("async")
continuable_run = _check_run("continuable")


def _report(out: Path) -> dict:
    return json.loads((out / "parity.json").read_text())


def _name(snapshot_uri: str) -> str:
    return snapshot_uri.split("?")[0].rstrip("/").rsplit("/", 1)[-1]


def _decoded_on_qwen3(report: dict) -> bool:
    """Whether the recovered run's trained tokens came from Qwen's vocabulary: ids past the
    tiny Llama's 512 (the run's own batches, not the check's arguments)."""
    import pyarrow as pa

    from rollout_recovery.data_plane.schemas import list_column

    batches = sorted(Path(report["recovered_dir"], "batches").glob("step-*.arrow"))
    tables = [pa.ipc.open_file(pa.BufferReader(b.read_bytes())).read_all() for b in batches]
    return bool(tables) and max(int(list_column(t, "token_ids")[1].max()) for t in tables) >= 512


@pytest.fixture(scope="module")
def broken(jobs) -> dict[str, Done]:
    """The finished checks' kills restored (or the failover run repeated) deliberately broken:
    each check must fail on its own (each test asserts how)."""
    return {name: jobs[name] for name in BROKEN}


def test_prefix_recovery_after_sigkills_at_two_steps_matches_the_reference(prefix_run):
    """The same batches, losses equal, the final trainer checkpoint the same bytes as the
    uninterrupted run's; the engines resumed every cut call; the kill's lost work measured."""
    report = _report(prefix_run)
    assert report["violations"] == [] and report["env"] == "notes"
    assert _decoded_on_qwen3(report)
    assert [k["step"] for k in report["kills"]] == [0, 1]
    # Each kill acted on the pause at the snapshot it chose (its run held itself there).
    assert [k["held_at"]["facts"]["snapshot"] for k in report["kills"]] == [
        _name(k["snapshot"]) for k in report["kills"]
    ]
    # Calls the token log had taken past their snapshot cut resumed from the token log's prefix
    # (the evidence check above held them to it).
    taken = [c for k in report["kills"] for c in k.get("token_log", {}).values()]
    assert taken and all(c["token_log_tokens"] > c["snapshot_tokens"] for c in taken)
    # Every note-store effect of every episode logged once, the stores equal the reference's.
    assert report["effects"]["episodes"] == 8 and report["effects"]["effects"] == 16
    assert report["restored_calls"] >= 4 and report["restored_prefix_tokens"] > 0
    assert all(s["same_batch"] and s["same_reward"] and s["loss_abs_diff"] == 0
               for s in report["steps"])  # fmt: skip
    ckpt = report["final_trainer_checkpoint"]
    assert ckpt["reference"] == ckpt["recovered"]
    assert report["selected"] == [k["snapshot"] for k in report["kills"]]
    # It signalled its own processes only (a pid it had seen that was another's by then is
    # listed, not signalled); the checks that ran beside it had marks of their own.
    assert report["mark"].startswith("suite-prefix-")
    assert all(k["processes_killed"] > 1 and "pids_not_ours" in k for k in report["kills"])
    for lost, kill in zip(report["lost_work"], report["kills"], strict=True):
        assert 0 <= lost["prefix"] <= lost["turn"] <= lost["none"]
        assert lost["none"] == lost["decoded_before_crash"] > lost["prefix"]
        assert kill["after_snapshot_s"] > 0


def test_the_check_fails_when_workers_silently_ignore_continuations(broken):
    """The own-loop check's killed run restored with resume disabled on the workers: every
    output still matches the reference (the sampler is deterministic), only the engine records
    tell."""
    proc, out = broken["resume_disabled"]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = _report(out)
    assert all(s["same_batch"] and s["loss_abs_diff"] == 0 for s in report["steps"])
    assert report["violations"] and all(v.startswith("[resumed]") for v in report["violations"])
    lost = report["lost_work"][-1]
    assert lost["prefix"] == lost["turn"]  # every call in flight decoded again from its start


def test_the_check_fails_on_one_perturbed_generation_logprob(jobs):
    """A copy of the passing prefix run with one generation logprob of the recovered batch moved
    by 1e-3 (`_prefix_logprob_perturbed`), verified again from its files."""
    proc, out = jobs["prefix_logprob_perturbed"]
    assert proc.returncode == 1, proc.stdout[-3000:]
    violations = _report(out)["violations"]
    assert [v for v in violations if not v.startswith("[logprobs] step 1")] == []
    assert violations


def test_no_check_left_a_process_behind(jobs, suite_checks: Checks):
    """Within a minute of each job's end none of its processes (Ray, engines, actors, harnesses:
    all carry its mark) is still alive."""
    assert suite_checks.left == {}


def test_turn_recovery_with_checkpoints_on_s3_matches_the_reference(turn_run):
    report = _report(turn_run)
    assert report["violations"] == [] and report["level"] == "turn"
    # 4 episodes a step, 2 note effects each, 3 steps.
    assert report["env"] == "notes" and report["effects"]["effects"] == 24
    assert report["storage"] == "s3" and not (turn_run / "recovered").exists()
    assert report["restored_episodes"] >= 2 and report["restored_turn_tokens"] > 0
    assert all(s["same_batch"] and s["same_reward"] for s in report["steps"])
    [lost] = report["lost_work"]
    assert lost["turn"] < lost["none"]  # committed turns were not decoded again


def test_the_check_fails_when_committed_turns_are_decoded_again(broken):
    """The same killed run restored with every episode started over: tokens, rewards and the
    notes still match; the engine records show the repeat (and the effects carry the ids of
    a fresh start)."""
    proc, out = broken["redecode_committed_turns"]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = _report(out)
    assert all(s["same_batch"] and s["same_reward"] for s in report["steps"])
    assert any(v.startswith("[committed_turn_decoded_again]") for v in report["violations"])
    expected = ("[committed_turn_decoded_again]", "[effects]", "episodes re-admitted",
                "another result than the reference's (['effects'])")  # fmt: skip
    assert all(any(e in v for e in expected) for v in report["violations"])


def test_an_openai_harness_through_the_gateway_recovers_with_parity(gateway_run):
    """Killed with its harnesses mid-run; the restarted harnesses made the same calls: those
    already made were answered from the journal, the cut ones resumed, and the engines' own
    records show no committed call decoded again (a violation otherwise)."""
    report = _report(gateway_run)
    assert report["violations"] == [] and report["env"] == "gateway"
    assert _decoded_on_qwen3(report)
    assert report["restored_calls"] >= 2 and report["restored_prefix_tokens"] > 0
    assert all(s["same_batch"] and s["same_reward"] and s["loss_abs_diff"] == 0
               for s in report["steps"])  # fmt: skip
    ckpt = report["final_trainer_checkpoint"]
    assert ckpt["reference"] == ckpt["recovered"]
    [lost] = report["lost_work"]
    assert lost["prefix"] < lost["turn"] <= lost["none"]


def test_a_dead_workers_calls_continue_from_their_token_log_without_a_restart(failover_run):
    """Worker 1's engine SIGKILLed (two workers), then the only worker's actor ray.killed after
    a weight push: each run finished by itself with every batch equal to the reference's,
    every call the dead worker held resumed from its token log on a live worker (the replacement,
    on the pushed weights, in the one-worker run), at most K tokens decoded again per call."""
    report = json.loads((failover_run / "failover.json").read_text())
    assert report["problems"] == []
    rows = {r["kind"]: r for r in report["runs"]}
    assert set(rows) == {"engine", "actor"}
    for row in rows.values():
        assert row["same_batches"] and row["logprobs_bit_identical_min"] == 1.0
        assert row["calls_on_dead_worker"] >= 4
        assert row["resumed_from_token_log"] == row["calls_on_dead_worker"]
        assert 0 <= row["redecoded_tokens_max"] <= row["token_log_tokens_k"]
        assert sum(row["migrations"].values()) >= row["calls_on_dead_worker"]
    assert rows["engine"]["migrations"].get("migrations.engine_dead")
    assert rows["actor"]["migrations"].get("migrations.actor_dead")
    assert rows["actor"]["workers_replaced"] >= 1


def test_the_failover_check_fails_when_a_token_log_is_corrupted(broken):
    """Token log rows staged with a changed token: the moved calls refuse the chain and are
    decoded from scratch (counted), so the batches still match, and the check fails on them."""
    proc, tmp_path = broken["token_log_rows_corrupted"]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "not resumed from its token log" in proc.stdout
    [row] = json.loads((tmp_path / "failover.json").read_text())["runs"]
    assert row["same_batches"] and row["resumed_from_token_log"] == 0
    lines = (tmp_path / "engine" / "steps.jsonl").read_text().splitlines()
    refused = sum(
        json.loads(r).get("migration.token_log_refused.digest_mismatch", 0) for r in lines
    )
    assert refused == row["calls_on_dead_worker"] > 0


def test_a_run_killed_on_a_two_node_cluster_restores_there_with_parity(two_node_run):
    """Workers, store shards and environment actors on both nodes of a local Ray cluster,
    checkpoints on S3; the driver SIGKILLed mid-generation, Ray ended its actors, and the restore
    on the same cluster trained on the reference's batches, every cut call resumed from its
    prefix with exactly its tail decoded (it replaced tests/cluster/test_two_node_restore.py)."""
    report = _report(two_node_run)
    assert report["violations"] == [] and report["fault"] is None
    assert report["storage"] == "s3" and report["checkpoint_dir"].startswith("s3://")
    nodes = set(report["nodes"].values())
    assert len(nodes) == 2
    assert set(report["placement"]) == {"reference", "killed", "restore"}
    for phase, placed in report["placement"].items():
        assert set(placed) == {"GenerationWorker", "StoreShard", "RolloutEnvironment"}, phase
        for cls, p in placed.items():
            assert set(p["nodes"]) == nodes and p["actors"] >= 2, (phase, cls, p)
    kill, restored = report["kill"], report["restored"]
    assert kill["step"] >= 1 and kill["recoverable_cuts"] >= 3
    assert kill["actors_gone_s"] is not None and kill["actors_left"] == []
    assert kill["processes_left"] == []
    assert report["selected"] == [restored["snapshot"]] and restored["recoverable_cuts"] > 0
    assert report["resumed_calls"] > 0 and report["restore_counts"]["restored_calls"] > 0
    assert report["restore_counts"]["worker_resumes_refused"] == 0
    # The resumed calls' logprobs too, bit for bit (as tests/cluster's two-node test asserted).
    assert all(s["same_batch"] and s["same_reward"] and s["loss_abs_diff"] == 0
               and s["logprobs_bit_identical"] == 1.0 for s in report["steps"])  # fmt: skip


def test_a_training_loop_of_its_own_recovers_with_parity(own_loop_run):
    """examples/own_loop/train.py (plain PyTorch: its own model wrapper, SGD with momentum, a
    warmup schedule, its own reward and checkpoint format, on TrainingRun) SIGKILLed in the
    middle of step 1 or 2 and restored from its own checkpoint: the same batches and losses as the
    uninterrupted run, every cut call resumed, its final checkpoint the same bytes."""
    report = _report(own_loop_run)
    assert report["violations"] == [] and report["train"] == "examples/own_loop/train.py"
    [kill] = report["kills"]
    assert kill["step"] >= 1 and kill["recoverable_cuts"] >= 2
    assert report["restored_calls"] >= 2 and report["restored_prefix_tokens"] > 0
    assert all(s["same_batch"] and s["same_reward"] and s["loss_abs_diff"] == 0
               for s in report["steps"])  # fmt: skip
    ckpt = report["final_trainer_checkpoint"]
    assert ckpt["reference"] == ckpt["recovered"]
    assert set(ckpt["recovered"]) == {"model.safetensors", "trainer.pt", "meta.json"}


def test_a_stale_owner_thawed_after_a_restore_stops_and_writes_nothing(two_owners_run):
    """A frozen mid-generation in step 1, B restored and finished the run, A thawed: A stopped
    with one line naming B's claim and changed nothing under the run."""
    report = _report(two_owners_run)
    assert report["violations"] == [] and report["fault"] is None
    a0, b, a1 = report["actors"]
    assert a0["frozen"]["step"] >= 1 and a0["frozen"]["mid_generation"]
    # A held itself at the snapshot it was frozen after (an event, not a poll's moment).
    held = a0["frozen"]["held_at"]
    assert held["point"] == "snapshot_taken" and held["action"] == "pause"
    assert held["facts"]["snapshot"] == a0["frozen"]["snapshot"]
    assert held["facts"]["step"] == a0["frozen"]["step"] and held["facts"]["cut_calls"] >= 1
    assert a0["frozen"]["judged"][-1] == {"snapshot": a0["frozen"]["snapshot"],
                                          "cut_calls": len(a0["frozen"]["cut_calls"]),
                                          "leased": False}  # fmt: skip
    assert a0["claim"]["epoch"] < b["claim"]["epoch"]
    assert any(e["kind"] == "publish" for e in b["wrote"]["ownership"])
    assert a1["exit"] not in (0, None) and a1["fenced"]["processes_left"] == []
    [line] = a1["fenced"]["stderr"]
    assert "no longer owns" in line and f"epoch {b['claim']['epoch']} " in line
    assert a1["wrote"]["touched"] == 0


def test_asynchronous_grpo_killed_and_restored_keeps_every_invariant(async_run):
    """Generation never stopped for training and weights changed under calls in flight; after
    a SIGKILL and a restore every prompt was trained once or is still open, no group past the
    age bound was trained, every cut call resumed from its staged prefix with its weight
    versions, every trained token's behaviour logprob is its version's, bit for bit."""
    report = _report(async_run)
    assert report["violations"] == [] and report["level"] == "prefix"
    assert report["journal"] == "on" and report["kills"] == 1
    cursor = report["cursor"]
    assert cursor["trained"] == 2 * report["steps"] == 8
    assert max(a for s in report["ages"].values() for a in s.values()) <= 1
    assert report["prefix"]["resumed"] == report["prefix"]["continuations"] >= 2
    assert report["prefix"]["compared_in_training"] > 0
    # The kill landed where it meant to: held right after the snapshot it chose, of a step
    # from 1 to steps - 2, whose cut calls were all of the snapshot's own weight version.
    [kill] = report["kill_points"]
    assert kill["held_at"]["facts"]["snapshot"] == _name(kill["snapshot"])
    assert 1 <= kill["held_at"]["facts"]["step"] == kill["step"] <= report["steps"] - 2
    assert kill["recoverable_cuts"] >= 2 and kill["judged"][-1]["recoverable"] >= 2
    versions = report["logprobs"]
    assert len(versions) >= 2  # tokens of several weight versions were trained
    assert all(v["bit_identical"] == 1.0 for v in versions.values())
    for lost in report["lost_work"]:
        assert 0 <= lost["lost"] < lost["decoded_before_crash"]


def test_the_async_check_fails_on_each_broken_invariant(jobs):
    """The passing async run's records with a logprob moved, a prompt trained twice and a step
    past its age bound (`_tamper_async`): verified again, each is named, and nothing else."""
    proc, out = jobs["async_broken"]
    assert proc.returncode == 1, proc.stdout[-3000:]
    violations = _report(out)["violations"]
    assert {v.split(" ")[0] for v in violations} == {"[prompts]", "[age]", "[logprobs]"}
    assert any("trained twice" in v for v in violations)
    assert any(v.startswith("[logprobs] version 0") for v in violations)


def test_a_run_under_a_stream_of_faults_trains_what_a_fault_free_run_trains(jobs):
    """The chaos soak at prefix level (scripts/chaos_soak.py): a store shard, the controller, a
    preemption and a worker, one after another in one run. The store shard's and the
    controller's deaths are restored in `train`'s own process keeping the engines (the same
    processes serve after each), the worker heals in place, the
    preemption exits 0 and the soak restores it; every step's batch and loss and the final
    trainer checkpoint equal the fault-free run's, every rollout trained once, the trained
    tokens are in the engines' records, and calls resumed from their prefixes."""
    proc, out = jobs["soak"]
    assert proc.returncode == 0, proc.stdout[-3000:]
    result = json.loads((out / "soak.json").read_text())
    [level] = result["levels"]
    assert level["violations"] == [] and result["passed"]
    assert result["reference"]["goodput"] == 1.0 and result["reference"]["decoded_again"] == 0
    assert level["faults"] == 4 and level["rollouts_lost"] == level["trained_twice"] == 0
    assert level["healed"] == {
        "store_shard_kill": {"restored_keeping_engines": 1},
        "controller_kill": {"restored_keeping_engines": 1},
        "worker_kill": {"in_place": 1},
        "preemption": {"restarted": 1},
    }
    # Each restore took a snapshot with cut calls; every one was resumed from its prefix.
    assert level["restores"] == 3 and level["resumed_calls"] > 0
    # A preemption holds the engines before its final cut: nothing is decoded twice.
    assert level["lost_by_kind"]["preemption"]["tokens_lost"] == 0
    assert level["trained"] == result["reference"]["trained"]
    assert 0 < level["goodput"] <= 1.0
    assert (
        level["decoded"] == level["trained"] + level["decoded_again"] + level["decoded_not_trained"]
    )


def test_a_location_is_continued_by_the_command_each_failure_names(continuable_run):
    """Two deaths before any snapshot healed from step 0, a changed setting refused in one line
    with nothing changed, a SIGTERM with no grace, a Ctrl-C and a SIGTERM during start-up each
    ended in one line naming `train --restore`, and that command finished the run."""
    report = _report(continuable_run)
    assert report["violations"] == []
    phases = {p["phase"]: p for p in report["phases"]}
    first = phases["1-two-deaths"]
    assert [k["actor"] for k in first["killed"]] == ["RolloutEnvironment", "RolloutRecovery"]
    assert [r["step"] for r in first["restores"]] == [0, 0] and first["exit"] == 0
    refused = phases["2-changed-settings"]
    assert refused["exit"] == 1 and "grpo.prompts_per_step=2" in refused["last_line"]
    assert refused["names"] == "train --restore"
    assert [(phases[n]["exit"], phases[n]["names"]) for n in
            ("3-sigterm-no-grace", "4-ctrl-c", "5-sigterm-at-start")] == [
        (0, "train --restore"), (130, "train --restore"), (0, "train --restore")]  # fmt: skip
    assert phases["6-to-the-end"]["exit"] == 0
