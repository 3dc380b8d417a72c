"""The suite's functional checks as jobs, and the scheduler that runs them.

Each job is a subprocess: a check (functional_tests/), a deliberately broken run of one, or the
reduced crash-point campaign. They start with the session (tests/conftest.py), one at a time:
the campaign beside the cluster tests, then the longest checks beside the engine tests (which
left one of the two cores mostly idle for about 11 minutes). When the session reaches
test_recovery_functional.py it runs up to four at once, each as soon as a slot is free and the
runs it needs have finished. (Five at once made an S3 snapshot outlast a step's generation, so
that the turn check's kill never came; four beside the engine tests overloaded the machine
until Ray's nodes timed out starting.) A job whose run it needs failed is not started."""

from __future__ import annotations

import json
import os
import pickle
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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "functional_tests"))
import processes  # noqa: E402

CHECK = REPO / "functional_tests" / "recovery_check.py"
FAILOVER = REPO / "functional_tests" / "worker_failover.py"
TWO_NODE = REPO / "functional_tests" / "two_node_recovery.py"
TWO_OWNERS = REPO / "functional_tests" / "two_owners.py"
SMALL = ["grpo.prompts_per_step=1"]  # one GRPO group of 4 per step (a config override)
NOTES = ["--env", "notes", "--cuts", "2"]
# With the token log on: each restore takes a call from the newer of its snapshot cut and its
# token log, and the engine evidence is checked against what it took. A row every 2 tokens, so
# even a kill soon after its snapshot finds token log rows past the cut.
PREFIX = [*NOTES, "--steps", "2", "--level", "prefix", "--max-tokens", "128", "--kills", "2",
          "token_capture.log_interval_tokens=2"]  # fmt: skip
# The notes prefix check and the gateway check run on tiny://qwen3 (Qwen's real 151,936-token
# vocabulary, its special tokens, the hermes tool parser, tied embeddings; docs/models.md), the
# other checks on the tiny Llama: both models in the suite's checks, each check once.
QWEN3 = "policy.model_path=tiny://qwen3"
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
    "prefix": [*PREFIX, QWEN3],
    # checkpoint_dir on the local S3 server: snapshots, ledgers, trainer checkpoints and logs
    # all through pyarrow.fs.
    "turn": [*TURN, "--storage", "s3"],
    # The harness processes are killed with the job and start again from the top.
    "gateway": [*GATEWAY, QWEN3],
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


@dataclass
class Job:
    """One check the suite runs: its command from the output folders, and the checks whose
    output it needs first."""

    name: str
    argv: Callable[[dict[str, Path]], list[str]]
    after: tuple[str, ...] = ()
    timeout_s: float = 1500.0
    prepare: Callable[[dict[str, Path]], None] | None = None  # run just before it starts


SOAK = REPO / "scripts" / "chaos_soak.py"
# The chaos soak at prefix level, small: four faults over one run (seed 31: a store shard, then
# the controller, both restored keeping the engines, a preemption, then a worker, whose in-place
# heal needs no step after it), against its own fault-free run of the same steps. 18 steps: a
# fault that comes when the run is in its last step is not injected, and under the suite's
# load 15 left none for the fourth.
SOAK_ARGS = ["--levels", "prefix", "--faults",
             "store_shard_kill,controller_kill,worker_kill,preemption", "--count", "4",
             "--seed", "31", "--steps", "18"]  # fmt: skip
ASYNC = REPO / "functional_tests" / "async_recovery.py"
# One location walked through two deaths before any snapshot, a changed setting, a SIGTERM with
# no grace, a Ctrl-C and a SIGTERM during start-up, each continued by the command the last
# message named (functional_tests/continuable.py).
CONTINUABLE = REPO / "functional_tests" / "continuable.py"
# Asynchronous GRPO at prefix level with the token log on: four steps of two groups of 4 calls of
# 128 tokens, killed once after a snapshot of step >= 1 holding 2 cut calls (the run killed
# twice is docs/async_grpo.md's command; one kill here keeps a restore phase off the suite).
ASYNC_ARGS = ["--steps", "4", "--kills", "1", "--max-age", "1"]


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


def _prefix_logprob_perturbed(outs: dict[str, Path]) -> None:
    """A copy of the passing prefix check's runs with one generation logprob of the recovered
    batch of step 1 moved by 1e-3, to be verified again from its files."""
    src, dst = outs["prefix"], outs["prefix_logprob_perturbed"]
    for name in ("reference", "recovered"):
        shutil.copytree(src / name, dst / name)
    report = json.loads((src / "parity.json").read_text())
    report |= {"reference_dir": str(dst / "reference"), "recovered_dir": str(dst / "recovered")}
    (dst / "parity.json").write_text(json.dumps(report))
    shutil.copy(src / "kills.json", dst / "kills.json")
    _perturb_logprob(dst / "recovered" / "batches" / "step-000001.arrow")


# The reduced crash-point campaign: one 3-step run killed three times in a row under power loss
# and restored to the end, the uninterrupted reference run beside it; its result pickled for
# the `crash_chain` fixture (tests/conftest.py).
CRASH_CHAIN = """
import pickle, sys
from pathlib import Path
from rollout_recovery.testing.campaign import crash_points as c
work = Path(sys.argv[1])
result = c.run_crash_campaign(work, points=[], power_loss=True, chains=[c.CHAINS[0]],
                              reference_alongside=True)
(work / "result.pickle").write_bytes(pickle.dumps(result))
"""


def crash_chain_result(out: Path):
    """The campaign's result as the crash_chain job left it."""
    return pickle.loads((out / "result.pickle").read_bytes())


# In the order they start, each as soon as a slot is free and the run it needs has finished:
# the crash chain first (engine tests wait for it), then the two checks on tiny://qwen3 and the
# soak (beside the engine tests), then the longest chains first, each deliberately broken run
# right after the run it restores again, so that it starts as soon as that one has finished
# (listed last, they waited for every check and the suite ended on a lone soak).
JOBS = [
    Job("crash_chain", lambda o: ["-c", CRASH_CHAIN, str(o["crash_chain"])]),
    _check_job("prefix"),
    _check_job("gateway"),
    Job("prefix_logprob_perturbed", lambda o: [
        str(CHECK), "--out", str(o["prefix_logprob_perturbed"]), "--verify-only", *SMALL,
        QWEN3],
        ("prefix",), 900, _prefix_logprob_perturbed),
    Job("soak", lambda o: [str(SOAK), "--out", str(o["soak"]), "--json",
                           str(o["soak"] / "soak.json"), *SOAK_ARGS]),
    _check_job("own_loop"),
    # The own-loop check's kill (tiny Llama) restored again: the prefix check's on tiny://qwen3
    # would cost the suite a qwen3 restore, for the same proof.
    Job("resume_disabled", lambda o: [
        str(CHECK), "--out", str(o["resume_disabled"]), "--from-kill", str(o["own_loop"]),
        "--fault", "resume_disabled", *OWN_LOOP, *SMALL], ("own_loop",), 900),
    _check_job("failover"),
    Job("token_log_rows_corrupted", lambda o: [
        str(FAILOVER), "--out", str(o["token_log_rows_corrupted"]), "--kill", "engine",
        *FAILOVER_ARGS, "--reference", str(o["failover"] / "reference"), "--fault",
        "token_log_rows_corrupted"], ("failover",), 900),
    _check_job("turn"),
    Job("redecode_committed_turns", lambda o: [
        str(CHECK), "--out", str(o["redecode_committed_turns"]), *TURN, "--from-kill",
        str(o["turn"]), "--fault", "redecode_committed_turns", *SMALL], ("turn",), 900),
    Job("async", lambda o: [str(ASYNC), "--out", str(o["async"]), *ASYNC_ARGS]),
    Job("async_broken", lambda o: [str(ASYNC), "--out", str(o["async_broken"]), *ASYNC_ARGS,
                                   "--verify-only"], ("async",), 900, _tamper_async),
    _check_job("two_owners"),
    _check_job("two_node"),
    Job("continuable", lambda o: [str(CONTINUABLE), "--out", str(o["continuable"])]),
]  # fmt: skip

Done = tuple[subprocess.CompletedProcess, Path]


class Checks:
    """`jobs` run in the background from `start()`, at most `limit` at once; `wait(name)` for
    one, `wait_all()` for all."""

    def __init__(self, jobs: list[Job], root: Path, limit: int = 4) -> None:
        self.jobs, self.limit = jobs, limit
        self.outs = {job.name: root / job.name for job in jobs}
        for out in self.outs.values():
            out.mkdir(parents=True, exist_ok=True)
        # Each job's own mark: its processes (Ray, engines, actors) inherit it, and it signals
        # only processes carrying it (functional_tests/processes.py).
        self.marks = {job.name: f"suite-{job.name}-{secrets.token_hex(4)}" for job in jobs}
        self.done: dict[str, Done] = {}
        self.left: dict[str, list[int]] = {}  # processes a job left, if any outlived it
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="functional-checks", daemon=True)

    def start(self) -> Checks:
        self._thread.start()
        return self

    def widen(self, limit: int) -> Checks:
        """Run up to `limit` jobs at once from now on."""
        self.limit = limit
        return self

    def wait(self, name: str) -> Done:
        with self._changed:
            self._changed.wait_for(lambda: name in self.done or not self._thread.is_alive())
        if name not in self.done:
            raise RuntimeError(f"the functional checks' scheduler ended before {name} ran")
        return self.done[name]

    def wait_all(self) -> dict[str, Done]:
        self._thread.join()
        missing = [job.name for job in self.jobs if job.name not in self.done]
        if missing:
            raise RuntimeError(f"the functional checks' scheduler ended before {missing} ran")
        return self.done

    def stop(self) -> None:
        """End the jobs still running (the session ended early) and wait for the scheduler."""
        self._stop.set()
        self._thread.join()

    def _finish(self, name: str, done: Done) -> None:
        with self._changed:
            self.done[name] = done
            self._changed.notify_all()

    def _run(self) -> None:
        pending, running = list(self.jobs), {}
        while (pending or running) and not self._stop.is_set():
            self._start_ready(pending, running)
            self._reap(running)
            time.sleep(1)
        for name in running:  # stopped early
            processes.kill_marked(self.marks[name])

    def _start_ready(self, pending: list[Job], running: dict) -> None:
        """Start the pending jobs whose runs they need have finished, while slots are free."""
        for job in list(pending):
            if len(running) >= self.limit:
                return
            if any(dep not in self.done for dep in job.after):
                continue
            pending.remove(job)
            if any(self.done[dep][0].returncode != 0 for dep in job.after):
                skipped = f"not run: {job.after} failed"
                self._finish(job.name, (subprocess.CompletedProcess([], -1, skipped, ""),
                                        self.outs[job.name]))  # fmt: skip
                continue
            if job.prepare is not None:
                job.prepare(self.outs)
            env = os.environ | {processes.MARK_ENV: self.marks[job.name]}
            proc = subprocess.Popen([sys.executable, *job.argv(self.outs)], cwd=REPO,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env=env)  # fmt: skip
            # Read as it goes: a check's output must not fill the pipe and stop it.
            running[job.name] = (job, proc, time.monotonic(), _Drain(proc))

    def _reap(self, running: dict) -> None:
        """Record the jobs that ended; end those past their time (their own timeouts failed)."""
        for name, (job, proc, started, reader) in list(running.items()):
            late = proc.poll() is None and time.monotonic() - started >= job.timeout_s
            if proc.poll() is None and not late:
                continue
            if late:
                processes.kill_marked(self.marks[name])
            proc.wait()
            reader.join()
            text = reader.text + (f"\nthe {name} job ran past {job.timeout_s:g} s" * late)
            self._gone(name)
            del running[name]
            done = subprocess.CompletedProcess(proc.args, proc.returncode, text, "")
            self._finish(name, (done, self.outs[name]))

    def _gone(self, name: str, wait_s: float = 60.0) -> None:
        """None of a job's processes outlives it for long; any that do are recorded."""
        deadline = time.monotonic() + wait_s
        while (left := processes.pids_marked(self.marks[name])) and time.monotonic() < deadline:
            time.sleep(1)
        if left:
            self.left[name] = sorted(left)


class _Drain(threading.Thread):
    """A process's output, read to its end on a thread of its own."""

    def __init__(self, proc: subprocess.Popen) -> None:
        super().__init__(daemon=True)
        self.proc, self.text = proc, ""
        self.start()

    def run(self) -> None:
        self.text = self.proc.stdout.read()
