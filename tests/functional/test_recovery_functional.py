"""The recovery functional tests at a small size (reference, SIGKILL, restore, parity), and
proof that the checks fail when recovery breaks: a deliberately broken restore of the same
killed run (resume disabled, committed turns decoded again) and one perturbed logprob.

The user-environment check (functional_tests/env_recovery.sh) runs here as the prefix check
(the notes agent, two kills, local files) and the turn check (the notes agent, on S3); the
gateway check (functional_tests/gateway_recovery.sh) runs an `openai` client harness per
rollout through the gateway; the failover check (functional_tests/worker_failover.sh) kills
one worker's engine, then one worker actor, in the middle of generation; the two-node check
(functional_tests/two_node_recovery.sh) SIGKILLs a driver whose workers, store shards and
environment actors run on both nodes of a local Ray cluster, and restores it there. The own-loop
check (functional_tests/own_loop_recovery.sh) runs the prefix check on a training loop of its own
(examples/own_loop/train.py) instead of `rollout-recovery train`; the two-owner check
(functional_tests/two_owners.sh) freezes that loop mid-generation, restores its run in a second
process, thaws the first and requires it to stop writing. The async check
(functional_tests/async_recovery.sh) kills asynchronous GRPO twice and checks its invariants;
a tampered copy of its records must fail them. The checks and the runs broken on purpose share
two cores through one scheduler (`jobs`). The built-in single-turn task's prefix
recovery is killed at every crash point by tests/functional/test_crash_campaign.py."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "functional_tests"))
import processes  # noqa: E402

CHECK = REPO / "functional_tests" / "recovery_check.py"
FAILOVER = REPO / "functional_tests" / "worker_failover.py"
TWO_NODE = REPO / "functional_tests" / "two_node_recovery.py"
TWO_OWNERS = REPO / "functional_tests" / "two_owners.py"
pytestmark = pytest.mark.engine


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), *args, *SMALL], capture_output=True,
                          text=True, timeout=900, check=False)  # fmt: skip


SMALL = ["grpo.prompts_per_step=1"]  # one GRPO group of 4 per step (a config override)
NOTES = ["--env", "notes", "--cuts", "2"]
# With the token log on: each restore takes a call from the newer of its snapshot cut and its
# token log, and the engine evidence is checked against what it took. A row every 2 tokens, so
# even a kill soon after its snapshot finds token log rows past the cut.
PREFIX = [*NOTES, "--steps", "2", "--level", "prefix", "--max-tokens", "128", "--kills", "2",
          "token_capture.log_interval_tokens=2"]  # fmt: skip
# Three steps of 192-token turns: a kill may land in step 1 or 2, and each step's generation
# outlasts a snapshot on the S3 server even with the four checks sharing two cores (a snapshot
# there took 4-7 s; with 96-token turns a step's generation ended after its first snapshot,
# which held no committed turn, so the kill never came).
TURN = [*NOTES, "--level", "turn", "--max-tokens", "192", "--steps", "3"]
GATEWAY = ["--env", "gateway", "--level", "prefix", "--steps", "3", "--max-tokens", "128",
           "--cuts", "2"]  # fmt: skip
# Two groups of 4 calls a step; three steps, so a kill that missed its chance has another.
FAILOVER_ARGS = ["--steps", "3", "--prompts", "2"]
# Its defaults are the smallest size that still kills mid-generation: two steps of one group of
# 4 calls of 128 tokens over two workers, killed once in step 1 with 3 cut calls published
# (so cut calls on both workers), one restore.
TWO_NODE_ARGS: list[str] = []
# The prefix check on examples/own_loop/train.py: one group of 4 calls of 128 tokens a step,
# killed once in step 1 or 2 (its own checkpoint restored) with 2 cut calls published. Three
# steps: a kill that came too late for step 1 (a slow poll, four checks on two cores) has step
# 2, where with two it found the run stopping its workers.
OWN_LOOP = ["--train", "examples/own_loop/train.py", "--level", "prefix", "--steps", "3",
            "--cuts", "2", "--max-tokens", "128"]  # fmt: skip
# Its defaults are the smallest size: A frozen in step 1 or 2 of 3 (one group of 4 calls of
# 128 tokens; with two steps a freeze that came too late for step 1 had no second chance), B
# finishes step 3. No C (a third owner going on from B's history, `--no-successor`): the prefix
# check's second restore goes on from its first's the same way, and C cost the suite a minute.
TWO_OWNERS_ARGS = ["--no-successor"]
RUNS = {
    # Killed during step 0 (restored onto the base weights) and again during step 1 (onto a
    # trainer checkpoint).
    "prefix": PREFIX,
    # checkpoint_dir on the local S3 server: snapshots, ledgers, trainer checkpoints and logs
    # all through pyarrow.fs.
    "turn": [*TURN, "--storage", "s3"],
    # The harness processes are killed with the job and start again from the top.
    "gateway": GATEWAY,
    # No restart: a dead worker's calls continue on a live one (or its replacement).
    "failover": FAILOVER_ARGS,
    # A local two-node Ray cluster; checkpoints on the local S3 server.
    "two_node": TWO_NODE_ARGS,
    # A training loop of one's own on the TrainingRun API, in its own checkpoint format.
    "own_loop": OWN_LOOP,
    # A stale owner thawed after a restore took its run over.
    "two_owners": TWO_OWNERS_ARGS,
}
SCRIPTS = {"failover": FAILOVER, "two_node": TWO_NODE, "two_owners": TWO_OWNERS}
# The two-owner check with fencing_disabled is not repeated here (a third full run of three
# owners for ~4 min of the suite): tests/unit/test_two_owners_verdict.py holds its verdict to
# failing on a stale owner's writes, and tests/unit/test_fenced_writes.py shows the fault
# letting them land; docs/testing.md gives the command for the whole run.
BROKEN = ("resume_disabled", "redecode_committed_turns", "token_log_rows_corrupted")
MAX_AT_ONCE = 4  # checks running at once on two cores (see `jobs`)


@dataclass
class Job:
    """One check the suite runs: its command from the output folders, and the checks whose
    output it needs first."""

    name: str
    argv: Callable[[dict[str, Path]], list[str]]
    after: tuple[str, ...] = ()
    timeout_s: float = 1500.0
    prepare: Callable[[dict[str, Path]], None] | None = None  # run just before it starts


ASYNC = REPO / "functional_tests" / "async_recovery.py"
# Asynchronous GRPO at prefix level with the token log on: six steps of two groups of 4 calls of
# 128 tokens, killed twice (each kill after a snapshot of a later step holding 2 cut calls).
ASYNC_ARGS = ["--steps", "6", "--kills", "2", "--max-age", "1"]


def _tamper_async(outs: dict[str, Path]) -> None:
    """A copy of the passing async run's records with three invariants broken: one trained
    token's behaviour logprob moved by 1e-3 (step 1's batch), a group of step 1 trained again
    in step 2, and step 3 recorded as trained on weights two versions past its age bound (the
    step log: the last record of a step wins)."""
    saved = json.loads((outs["async"] / "kills.json").read_text())
    run = outs["async_broken"] / Path(saved["run_dir"]).name  # run, or run-retry
    shutil.copytree(saved["run_dir"], run, dirs_exist_ok=True)
    (run.parent / "kills.json").write_text(json.dumps(saved | {"run_dir": str(run)}))
    _perturb_logprob(run / "batches" / "step-000001.arrow")
    log = run / "steps.jsonl"
    last = {r["step"]: r for r in map(json.loads, log.read_text().splitlines()) if "event" not in r}
    again = last[2] | {"groups": [*last[2]["groups"], last[1]["groups"][0]]}
    aged = last[3] | {"weight_version": last[3]["weight_version"] + 2}
    with log.open("a") as f:
        f.write(json.dumps(again) + "\n" + json.dumps(aged) + "\n")


def _perturb_logprob(path: Path) -> None:
    """The first trained token's generation logprob in the batch at `path`, moved by 1e-3."""
    table = pa.ipc.open_file(pa.BufferReader(path.read_bytes())).read_all()
    lps = table.column("logprobs").combine_chunks()
    values = lps.values.to_numpy(zero_copy_only=False).copy()
    mask = table.column("loss_mask").combine_chunks().values.to_numpy(zero_copy_only=False)
    values[int(np.flatnonzero(mask)[0])] += 1e-3
    perturbed = pa.ListArray.from_arrays(lps.offsets, pa.array(values, lps.type.value_type))
    table = table.set_column(table.schema.get_field_index("logprobs"), "logprobs", perturbed)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def _check_job(name: str) -> Job:
    script, small = SCRIPTS.get(name, CHECK), [] if name in SCRIPTS else SMALL
    return Job(name, lambda outs: [str(script), "--out", str(outs[name]), *RUNS[name], *small])


# Longest first among the checks, the deliberately broken runs last: each starts as soon as a
# slot is free and the run it restores again has finished.
JOBS = [
    *(_check_job(name) for name in ("turn", "prefix", "gateway", "own_loop", "two_owners",
                                    "failover", "two_node")),
    Job("resume_disabled", lambda o: [
        str(CHECK), "--out", str(o["resume_disabled"]), "--from-kill", str(o["prefix"]),
        "--fault", "resume_disabled", *PREFIX, *SMALL], ("prefix",), 900),
    Job("redecode_committed_turns", lambda o: [
        str(CHECK), "--out", str(o["redecode_committed_turns"]), *TURN, "--from-kill",
        str(o["turn"]), "--fault", "redecode_committed_turns", *SMALL], ("turn",), 900),
    Job("token_log_rows_corrupted", lambda o: [
        str(FAILOVER), "--out", str(o["token_log_rows_corrupted"]), "--kill", "engine",
        *FAILOVER_ARGS, "--reference", str(o["failover"] / "reference"), "--fault",
        "token_log_rows_corrupted"], ("failover",), 900),
    Job("async", lambda o: [str(ASYNC), "--out", str(o["async"]), *ASYNC_ARGS]),
    Job("async_broken", lambda o: [str(ASYNC), "--out", str(o["async_broken"]), *ASYNC_ARGS,
                                   "--verify-only"], ("async",), 900, _tamper_async),
]  # fmt: skip


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Every check and every broken run, at most MAX_AT_ONCE at a time, each started as soon as
    a slot is free and the runs it needs have finished: independent jobs, each mostly waiting
    on its own processes, take far less together than one after another, and a run that
    finishes early frees its slot for the next instead of waiting for a phase to end. (Five at
    once on two cores made an S3 snapshot outlast a step's generation, so that the turn
    check's kill never came; four was fine.) A job whose run it needs failed is not started."""
    outs = {job.name: tmp_path_factory.mktemp(job.name) for job in JOBS}
    # Each job's own mark: its processes (Ray, engines, actors) inherit it, and it signals only
    # processes carrying it (functional_tests/processes.py).
    marks = {job.name: f"suite-{job.name}-{secrets.token_hex(4)}" for job in JOBS}
    pending, running = list(JOBS), {}
    done: dict[str, tuple[subprocess.CompletedProcess, Path]] = {}

    while pending or running:
        for job in list(pending):
            if len(running) >= MAX_AT_ONCE:
                break
            if any(dep not in done for dep in job.after):
                continue
            pending.remove(job)
            if any(done[dep][0].returncode != 0 for dep in job.after):
                skipped = f"not run: {job.after} failed"
                done[job.name] = (subprocess.CompletedProcess([], -1, skipped, ""), outs[job.name])
                continue
            if job.prepare is not None:
                job.prepare(outs)
            env = os.environ | {processes.MARK_ENV: marks[job.name]}
            proc = subprocess.Popen([sys.executable, *job.argv(outs)], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
            # Read as it goes: a check's output must not fill the pipe and stop it.
            running[job.name] = (job, proc, time.monotonic(), _drain(proc))
        for name, (job, proc, started, reader) in list(running.items()):
            late = proc.poll() is None and time.monotonic() - started >= job.timeout_s
            if proc.poll() is None and not late:
                continue
            if late:  # the check's own timeouts failed to end it
                processes.kill_marked(marks[name])
            proc.wait()
            reader.join()
            text = reader.text + (
                f"\nthe {name} check ran past {job.timeout_s:g} s" if late else ""
            )
            done[name] = (subprocess.CompletedProcess(proc.args, proc.returncode, text, ""),
                          outs[name])  # fmt: skip
            del running[name]
        time.sleep(1)
    deadline = time.monotonic() + 60  # none of a check's processes outlives it for long
    while (left := {n: processes.pids_marked(m) for n, m in marks.items()}) and any(left.values()):
        assert time.monotonic() < deadline, f"processes left by the checks: {left}"
        time.sleep(1)
    return done


class _drain(threading.Thread):
    """A process's output, read to its end on a thread of its own."""

    def __init__(self, proc: subprocess.Popen) -> None:
        super().__init__(daemon=True)
        self.proc, self.text = proc, ""
        self.start()

    def run(self) -> None:
        self.text = self.proc.stdout.read()


def _passed(jobs: dict, name: str) -> Path:
    proc, out = jobs[name]
    if proc.returncode != 0:
        pytest.fail(f"the {name} check failed:\n{proc.stdout[-3000:]}")
    return out


@pytest.fixture(scope="module")
def prefix_run(jobs) -> Path:
    return _passed(jobs, "prefix")


@pytest.fixture(scope="module")
def gateway_run(jobs) -> Path:
    return _passed(jobs, "gateway")


@pytest.fixture(scope="module")
def turn_run(jobs) -> Path:
    return _passed(jobs, "turn")


@pytest.fixture(scope="module")
def failover_run(jobs) -> Path:
    return _passed(jobs, "failover")


@pytest.fixture(scope="module")
def two_node_run(jobs) -> Path:
    return _passed(jobs, "two_node")


@pytest.fixture(scope="module")
def own_loop_run(jobs) -> Path:
    return _passed(jobs, "own_loop")


@pytest.fixture(scope="module")
def two_owners_run(jobs) -> Path:
    return _passed(jobs, "two_owners")


@pytest.fixture(scope="module")
def async_run(jobs) -> Path:
    return _passed(jobs, "async")


def _report(out: Path) -> dict:
    return json.loads((out / "parity.json").read_text())


@pytest.fixture(scope="module")
def broken(jobs) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """The finished checks' kills restored (or the failover run repeated) deliberately broken:
    each check must fail on its own (each test asserts how)."""
    return {name: jobs[name] for name in BROKEN}


def test_prefix_recovery_after_sigkills_at_two_steps_matches_the_reference(prefix_run):
    """The same batches, losses equal, the final trainer checkpoint the same bytes as the
    uninterrupted run's; the engines resumed every cut call; the kill's lost work measured."""
    report = _report(prefix_run)
    assert report["violations"] == [] and report["env"] == "notes"
    assert [k["step"] for k in report["kills"]] == [0, 1]
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
    """The same killed run restored with resume disabled on the workers: every output still
    matches the reference (the sampler is deterministic), only the engine records tell."""
    proc, out = broken["resume_disabled"]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = _report(out)
    assert all(s["same_batch"] and s["loss_abs_diff"] == 0 for s in report["steps"])
    assert report["violations"] and all(v.startswith("[resumed]") for v in report["violations"])
    lost = report["lost_work"][-1]
    assert lost["prefix"] == lost["turn"]  # every call in flight decoded again from its start


def test_the_check_fails_on_one_perturbed_generation_logprob(prefix_run, tmp_path):
    """A copy of the passing run with one generation logprob of the recovered batch moved by
    1e-3, verified again from its files."""
    for name in ("reference", "recovered"):
        shutil.copytree(prefix_run / name, tmp_path / name)
    report = _report(prefix_run) | {"reference_dir": str(tmp_path / "reference"),
                                    "recovered_dir": str(tmp_path / "recovered")}  # fmt: skip
    (tmp_path / "parity.json").write_text(json.dumps(report))
    shutil.copy(prefix_run / "kills.json", tmp_path / "kills.json")
    _perturb_logprob(tmp_path / "recovered" / "batches" / "step-000001.arrow")
    proc = _check("--out", str(tmp_path), "--verify-only")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    violations = _report(tmp_path)["violations"]
    assert [v for v in violations if not v.startswith("[logprobs] step 1")] == []
    assert violations


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
    assert a0["claim"]["epoch"] < b["claim"]["epoch"]
    assert any(e["kind"] == "publish" for e in b["wrote"]["ownership"])
    assert a1["exit"] not in (0, None) and a1["fenced"]["processes_left"] == []
    [line] = a1["fenced"]["stderr"]
    assert "no longer owns" in line and f"epoch {b['claim']['epoch']} " in line
    assert a1["wrote"]["touched"] == 0


def test_asynchronous_grpo_killed_twice_keeps_every_invariant(async_run):
    """Generation never stopped for training and weights changed under calls in flight; two
    SIGKILLs and restores later every prompt was trained once or is still open, no group past
    the age bound was trained, every cut call resumed from its staged prefix with its weight
    versions, every trained token's behaviour logprob is its version's, bit for bit."""
    report = _report(async_run)
    assert report["violations"] == [] and report["level"] == "prefix"
    assert report["journal"] == "on" and report["kills"] == 2
    cursor = report["cursor"]
    assert cursor["trained"] == 2 * report["steps"] == 12
    assert max(a for s in report["ages"].values() for a in s.values()) <= 1
    assert report["prefix"]["resumed"] == report["prefix"]["continuations"] >= 4
    assert report["prefix"]["compared_in_training"] > 0
    versions = report["logprobs"]
    assert len(versions) >= 3  # tokens of several weight versions were trained
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
