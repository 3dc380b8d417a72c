"""Chaos soak: a GRPO run under a seeded stream of faults, at recovery levels none, turn and
prefix side by side; how much of the compute survives (goodput) and whether the run still
trains exactly what a fault-free run trains.

    .venv/bin/python scripts/chaos_soak.py --minutes 30 --json bench_results/soak.json \\
        [--levels none,turn,prefix] [--faults KIND,...] [--seed S] [--out DIR]

One fault-free reference run of the job, then per level one run of the same steps under the
same fault stream (same kinds, same delays; `--seed`). A fault lands a random 0.5-4 s after the
run is ready again (its workers up after the previous fault); one after which the run goes on
from a snapshot then also waits (up to 30 s) for calls in flight at the engine (at prefix
level: and a snapshot that cut them), so that it finds work to recover. The kinds:

- `job_kill`: SIGKILL every process of the run; the soak runs `train --restore`;
- `preemption`: SIGTERM to the driver: a final checkpoint, exit 0; the soak runs
  `train --restore`;
- `worker_kill`: SIGKILL a worker actor's process: healed in place (a replacement, its calls
  move);
- `worker_hang`: SIGSTOP a worker actor and its engine: healed in place once its health times
  out;
- `store_shard_kill`, `environment_kill`, `controller_kill`: SIGKILL that actor's process:
  `train` restores the run in its own process keeping the engines (`restored_keeping_engines`:
  the same worker and engine processes must serve after it, `[engines]`), or with new ones
  where it cannot (`restored_in_process`: after the controller's death, once a worker was
  replaced: the replacement was the controller's and died with it);
- `storage_errors`: every write under the run fails with EIO for 2-5 s
  (rollout_recovery/testing/outage.py): healed in place (a snapshot attempt fails) or, where the
  run ends in one line, by the soak's `train --restore`.

Before each fault the engines are frozen (SIGSTOP) and their per-attempt records read over
the workers' control API, so what the fault destroys is still counted; the records the run
logs itself (`call_attempts/`) add the rest. Goodput, from those records
(rollout_recovery/testing/campaign/goodput.py): tokens trained / tokens the engines decoded.
Lost tokens are charged to the fault that made a call decode them again.

Per level it checks the end state against the reference (crash_points.check_training): every
step's batch and loss, the final trainer checkpoint, every rollout trained once; no temporary
or unverifiable file left; no process of the run left; every run that ended other than by the
soak's own kill or a preemption ended with one line naming what to run next; every trained
token is in an engine record, but a last read gap's before a death (UNREAD_SHARE); at prefix
level every call cut in a snapshot that a restore took was resumed by an engine from that
prefix (or the token log's longer one). Any violation fails
the soak (exit 1). `--fault resume_disabled` breaks resumption on purpose: the soak then fails.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "functional_tests"))

from rollout_recovery.generation.engine_setup import CPU_ENGINE_ENV  # noqa: E402

os.environ.update(CPU_ENGINE_ENV)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import secrets  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

from bench_common import write_result  # noqa: E402
from processes import alive_own, mark_this_check, owned  # noqa: E402
from recovery_check import read_engine_records, snapshot_time  # noqa: E402

from rollout_recovery import crashpoints, faults  # noqa: E402
from rollout_recovery.testing import outage  # noqa: E402
from rollout_recovery.testing.campaign import crash_points as cp  # noqa: E402
from rollout_recovery.testing.campaign import goodput  # noqa: E402
from rollout_recovery.testing.campaign.engine_evidence import committed  # noqa: E402

CONFIG = REPO / "configs" / "prefix_recovery.yaml"
KINDS = ("job_kill", "preemption", "worker_kill", "worker_hang", "store_shard_kill",
         "environment_kill", "controller_kill", "storage_errors")  # fmt: skip
# Faults after which the run continues from a snapshot: each waits for a snapshot that cut
# calls in flight (taken after the delay), so that it tests what recovery is for.
FROM_SNAPSHOT = ("job_kill", "preemption", "store_shard_kill", "environment_kill",
                 "controller_kill")  # fmt: skip
ACTORS = {"store_shard_kill": "StoreShard", "environment_kill": "RolloutEnvironment",
          "controller_kill": "RolloutRecovery"}  # fmt: skip
LEVELS = ("none", "turn", "prefix")
# One group of 4 calls of 160 tokens a step: a step's generation lasts a few seconds, long
# enough for a fault to find calls in flight, and a snapshot every 0.3 s cuts them. 30 failed
# snapshot attempts in a row (9 s at that cadence) stop the run: a 2-5 s outage does not.
# Every snapshot is kept, so that the report can read what each restore took.
JOB = ("grpo.prompts_per_step=1", "grpo.generations_per_prompt=4",
       "policy.generation.max_new_tokens=160",
       "rollout_checkpointing.snapshot_attempt_interval_s=0.3",
       "rollout_checkpointing.keep_latest_k=1000",
       "failover.max_restores=1000", "failover.unhealthy_after_s=4",
       "rollout_checkpointing.max_consecutive_failures=30",
       "preemption.grace_s=20")  # fmt: skip
HEAL_TIMEOUT_S = 240.0
# An outage is over (at most 5 s) and the run's writes have stopped trying again (10 s,
# storage.TRANSIENT_RETRY_S): a run still up then has healed in place.
OUTAGE_SETTLED_S = 17.0
# Trained tokens that no reading shows decoded, as a share of all trained, beyond which the
# soak's evidence is broken (a lost reading) rather than its last READ_EVERY_S gap before a
# death (measured: 13 of 23,680 over a 17-fault run).
UNREAD_SHARE = 0.005
READ_EVERY_S = 0.25  # the engines' records are read this often: a sudden death's unread gap
FAULT_COST_S = 35.0  # a fault's average wall cost here, its wait included: sizes the stream


@dataclass
class Injected:
    kind: str
    at: float
    healed: str = ""  # in_place | restored_in_process | restarted | not_healed
    heal_s: float = 0.0
    note: str = ""


@dataclass
class LevelRun:
    """One level's run under the fault stream: its processes, faults and engine readings."""

    level: str
    run_dir: Path
    token: str
    state_dir: Path
    records: list[dict] = field(default_factory=list)  # readings taken before faults
    faults: list[Injected] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)  # each run's end, when not the soak's kill
    violations: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    runs: int = 0
    fault: str = ""
    engines_frozen: list[int] = field(default_factory=list)
    workers_seen: list[dict] = field(default_factory=list)  # workers.json before the last fault
    polling: threading.Event = field(default_factory=threading.Event)

    # ------------------------------------------------------------------ the run's processes

    def start(self, steps: int) -> None:
        restore = ["--restore"] if self.runs else []
        log = open(self.run_dir.parent / f"{self.run_dir.name}.run{self.runs}.log", "w")  # noqa: SIM115
        cmd = [sys.executable, "-m", "rollout_recovery.cli", "train", *restore, "--config",
               str(CONFIG), *overrides(self.run_dir, steps, self.level, self.token)]  # fmt: skip
        env = os.environ | outage.armed_env(self.state_dir)
        if self.fault:  # a deliberately broken run (faults.py), to see the soak fail
            env |= {faults.ENV: self.fault}
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)  # fmt: skip
        self.started_at = time.time()
        self.runs += 1
        self.log_path = Path(log.name)

    def session(self) -> list[int]:
        return [p for p in crashpoints.session_pids(self.proc.pid) if owned(p)]

    def workers(self) -> list[dict]:
        """This run's workers (`workers.json`), when every one of them is up."""
        try:
            raw = json.loads((self.run_dir / "workers.json").read_text())
        except (OSError, ValueError):
            return []
        workers = raw["workers"]
        mine = set(self.session())
        if not workers or any(w["pid"] not in mine for w in workers):
            return []
        return workers

    def read(self, workers: list[dict]) -> None:
        """The engines' records of `workers`, engines frozen: nothing decoded goes uncounted."""
        engines = [p for w in workers for p in w["engine_pids"]]
        self._signal(engines, signal.SIGSTOP)
        self.engines_frozen = engines
        time.sleep(0.1)
        try:
            self.records += read_engine_records(workers, self.token)
        except Exception as err:
            self.violations.append(f"[evidence] the engines' records could not be read: {err}")
            self.thaw()
            raise

    def thaw(self) -> None:
        self._signal(self.engines_frozen, signal.SIGCONT)
        self.engines_frozen = []

    def poll(self) -> None:
        """Read the live engines' records every READ_EVERY_S until `polling` is cleared: a run
        that a fault ends without warning (a failed write) leaves at most that much of its
        decoding unread."""
        while self.polling.is_set():
            workers = self.workers() if not self.engines_frozen else []
            if workers:
                with contextlib.suppress(Exception):  # a worker going away under the read
                    self.records += read_engine_records(workers, self.token)
            time.sleep(READ_EVERY_S)

    @staticmethod
    def _signal(pids: list[int], sig: int) -> None:
        for pid in pids:
            if owned(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)

    def events(self, name: str) -> int:
        with contextlib.suppress(OSError, FileNotFoundError):
            return len(cp.events(str(self.run_dir), name))
        return 0

    def finished(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def kill_all(self) -> None:
        """SIGKILL the run's session, Ray's agents too (they do not carry the soak's mark)."""
        for _ in range(50):
            left = crashpoints.session_pids(self.proc.pid)
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        self.proc.wait()

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def last_line(self) -> str:
        lines = [x for x in self.log_path.read_text(errors="replace").splitlines() if x.strip()]
        return lines[-1][-300:] if lines else "(no output)"


# The token log is part of what prefix level keeps (a call goes on from its newest row); below
# it a call in flight is decoded again from its start, as a restore at that level promises.
TOKEN_LOG = {"prefix": ["token_capture.log_interval_tokens=8"]}


def overrides(run_dir: Path, steps: int, level: str, token: str) -> list[str]:
    return [f"checkpointing.checkpoint_dir={run_dir}", f"grpo.steps={steps}", *JOB,
            *TOKEN_LOG.get(level, []), f"rollout_recovery.target_level={level}",
            f"token_capture.control_auth_token={token}"]  # fmt: skip


# ---------------------------------------------------------------------- one level


def wait_ready(run: LevelRun, since: float, timeout: float = HEAL_TIMEOUT_S) -> list[dict]:
    """The run's workers once they are up after `since` (workers.json rewritten since then)
    and the run has published a snapshot taken since then: it is open (a notice before that
    ends a run as a plain SIGTERM would) and cutting its calls again."""
    from rollout_recovery.data_plane.snapshot_io import published_uris

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not run.finished():
        workers = run.workers()
        with contextlib.suppress(OSError, ValueError, IndexError):
            if (
                workers
                and (run.run_dir / "workers.json").stat().st_mtime >= since
                and snapshot_time(published_uris(str(run.run_dir / "data_plane"))[-1]) >= since
            ):
                return workers
        time.sleep(0.2)
    return []


def ledger(uri: str) -> dict:
    from rollout_recovery.data_plane import StagingStore

    return json.loads(StagingStore.read_sidecar(uri, "ledger.json"))


def cut_calls(uri: str) -> dict[str, dict]:
    """The calls a snapshot cut with a prefix, whose rollouts it does not also hold finished:
    rollout id -> continuation. A restore from it must resume each from its prefix."""
    book = ledger(uri)
    _, done = committed(book, cp.snapshot_keys(uri, "replay"))
    return {rollout: c for rollout, c in book["continuations"].items()
            if c.get("tokens", 0) > 0 and rollout not in done}  # fmt: skip


def wait_cut(run: LevelRun, since: float, timeout: float = 30.0) -> None:
    """Until an engine has a call in flight that has decoded tokens and, at prefix level, the
    run has published a snapshot taken after `since` that cut calls (or `timeout`)."""
    from rollout_recovery.data_plane.snapshot_io import published_uris

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not run.finished():
        with contextlib.suppress(Exception):  # a worker or snapshot going away under the read
            workers = run.workers()
            busy = any(not r["finished"] and r["decoded_tokens"] > 0
                       for r in read_engine_records(workers, run.token))  # fmt: skip
            if busy and run.level == "prefix":
                uri = published_uris(str(run.run_dir / "data_plane"))[-1]
                busy = snapshot_time(uri) >= since and bool(cut_calls(uri))
            if busy:
                return
        time.sleep(0.1)


def unresumed(run_dir: str, records: list[dict]) -> list[str]:
    """Each call a restore's snapshot cut with a prefix that no engine then resumed from that
    prefix or a longer one (the token log's)."""
    resumed: dict[tuple[str, str], list[int]] = {}
    for r in records:
        if r.get("resume") == "resumed":
            resumed.setdefault((r["rollout_id"], r["model_call_id"]), []).append(r["prefix_tokens"])
    out = []
    for event in cp.events(run_dir, "restore"):
        for rollout, c in cut_calls(event["snapshot"]).items():
            if not any(p >= c["tokens"] for p in resumed.get((rollout, c["call_id"]), [])):
                out.append(f"{rollout}/{c['call_id']} ({c['tokens']} tokens, "
                           f"{cp.snapshot_name(event['snapshot'])})")  # fmt: skip
    return out


def inject(run: LevelRun, kind: str, rng: random.Random, steps: int) -> Injected:
    """One fault; returns once the run healed (or ended)."""
    workers = run.workers_seen = run.workers()
    restored = run.events("restored_in_process")
    if kind == "storage_errors":
        f = Injected(kind, time.time())
        outage.begin(run.state_dir, rng.uniform(2.0, 5.0))
    elif kind == "preemption":
        f = Injected(kind, time.time())
        os.kill(run.proc.pid, signal.SIGTERM)
    else:
        targets = [rng.choice(workers)] if kind in ("worker_kill", "worker_hang") else workers
        run.read(targets)
        f = Injected(kind, time.time())
        if kind == "job_kill":
            run.kill_all()
        elif kind in ("worker_kill", "worker_hang"):
            sig = signal.SIGKILL if kind == "worker_kill" else signal.SIGSTOP
            run._signal([targets[0]["pid"]], sig)
        else:
            pid = (crashpoints.controller_pid(run.run_dir) if kind == "controller_kill"
                   else crashpoints.actor_pid(run.proc.pid, ACTORS[kind]))  # fmt: skip
            if pid is None:
                run.thaw()
                f.note = f"no {ACTORS[kind]} process to kill"
                f.healed = "not_injected"
                return f
            run._signal([pid], signal.SIGKILL)
            run.thaw()  # frozen engines would hang the job's own calls (a weight push)
    heal(run, f, targets if kind != "storage_errors" and kind != "preemption" else [],
         restored, steps)  # fmt: skip
    return f


def heal(run: LevelRun, f: Injected, targets: list[dict], restored: int, steps: int) -> None:
    """Wait until the run is whole again after fault `f`, restarting it where the fault ended
    it; records how (f.healed) and how long it took. The engines of `targets` stay frozen
    until their workers are gone (nothing they decode then would reach a record), then go on
    so that they can exit."""
    old = {w["pid"] for w in targets}
    workers_before = run.workers_seen
    deadline = time.monotonic() + HEAL_TIMEOUT_S
    while time.monotonic() < deadline:
        if targets and not any(alive_own(w["pid"]) for w in targets):
            run.thaw()
        if run.finished():
            break
        if run.events("restored_in_process") > restored and wait_ready(run, f.at, 0.1):
            f.healed = "restored_in_process"
            if cp.events(str(run.run_dir), "restored_in_process")[-1].get("engines_kept"):
                f.healed = "restored_keeping_engines"
                kept_engines(run, f, workers_before)
            break
        now = run.workers()
        if f.kind in ("worker_kill", "worker_hang") and now and not old <= {w["pid"] for w in now}:
            f.healed = "in_place"
            break
        if f.kind == "storage_errors" and time.time() > f.at + OUTAGE_SETTLED_S:
            f.healed = "in_place"
            break
        time.sleep(0.2)
    run.thaw()
    if f.kind == "worker_hang":  # killed for good by the run, or by the soak below
        LevelRun._signal([w["pid"] for w in targets], signal.SIGCONT)
    if not f.healed and run.finished():
        if run.proc.returncode == 0 and all_trained(run, steps) and f.kind != "preemption":
            f.healed = "run_finished"
        else:
            restart(run, f, steps)
    elif not f.healed:
        f.healed = "not_healed"
        run.violations.append(f"[heal] the run did not heal from {f.kind} in {HEAL_TIMEOUT_S} s")
    f.heal_s = time.time() - f.at


def kept_engines(run: LevelRun, f: Injected, before: list[dict]) -> None:
    """A restore that says it kept the engines must have: the same worker processes and
    engine processes serve after it as before the fault."""

    def pids(workers: list[dict]) -> set[int]:
        return {p for w in workers for p in [w["pid"], *w["engine_pids"]]}

    after = run.workers()
    if not before or pids(after) != pids(before) or not all(map(alive_own, pids(after))):
        run.violations.append(
            f"[engines] the restore after {f.kind} says it kept the engines, but their "
            f"processes changed: {sorted(pids(before))} -> {sorted(pids(after))}"
        )


def all_trained(run: LevelRun, steps: int) -> bool:
    return max((r["step"] for r in cp.step_records(str(run.run_dir))), default=0) >= steps


def restart(run: LevelRun, f: Injected, steps: int) -> None:
    """The run ended after fault `f` (at once, or later, as a storage outage may): check how
    it ended, then `train --restore` it, as a user would."""
    code = run.proc.returncode
    if f.kind == "preemption":
        if code != 0 or "preempted (SIGTERM)" not in run.tail():
            run.violations.append(f"[preemption] exit {code}: {run.last_line()}")
    elif f.kind != "job_kill":
        run.ended.append(f"after {f.kind}: exit {code}: {run.last_line()}")
        if "--restore" not in run.last_line():
            run.violations.append(f"[one_line] after {f.kind} the run ended without saying what "
                                  f"to run next: {run.last_line()}")  # fmt: skip
    leftover = run.session()
    if leftover and f.kind != "job_kill":
        run.violations.append(f"[survivors] {len(leftover)} processes outlived the run")
    run.kill_all()
    run.start(steps)
    f.healed = "restarted" if f.healed in ("", "restarted") else f"{f.healed}, then restarted"
    wait_ready(run, time.time() - 1)


def soak_level(run: LevelRun, stream: list[tuple[str, float]], steps: int, seed: int) -> None:
    rng = random.Random(seed)  # the same choices (worker, outage length) at every level
    t0 = time.monotonic()
    run.start(steps)
    run.polling.set()
    poller = threading.Thread(target=run.poll, daemon=True)
    poller.start()
    try:
        faults_then_end(run, stream, steps, rng)
    finally:
        run.polling.clear()
        poller.join()
    run.wall_s = time.monotonic() - t0


def faults_then_end(run: LevelRun, stream: list[tuple[str, float]], steps: int, rng) -> None:
    wait_ready(run, run.started_at - 1)
    for kind, delay in stream:
        time.sleep(delay)
        if kind in FROM_SNAPSHOT:
            wait_cut(run, time.time())
        if run.finished() and not all_trained(run, steps) and run.faults:
            restart(run, run.faults[-1], steps)  # the last fault ended it after it healed
        if run.finished():
            break
        if last_step_running(run, steps):
            break  # no fault in the last step: the run's end is the soak's end state
        f = inject(run, kind, rng, steps)
        run.faults.append(f)
        print(f"[soak {run.level}] {kind}: {f.healed} in {f.heal_s:.1f} s {f.note}", flush=True)
        if f.healed in ("not_healed", "run_finished"):
            break
    for _ in range(3):  # a run the last fault ends after it healed is restarted, as above
        while not run.finished():
            time.sleep(0.5)
        if run.proc.returncode == 0 or all_trained(run, steps) or not run.faults:
            break
        restart(run, run.faults[-1], steps)
    if run.proc.returncode != 0:
        run.violations.append(f"[exit] the last run exited {run.proc.returncode}: "
                              f"{run.last_line()}")  # fmt: skip
    if run.session():
        run.violations.append("[survivors] processes outlived the last run")
        run.kill_all()


def last_step_running(run: LevelRun, steps: int) -> bool:
    done = max((r["step"] for r in cp.step_records(str(run.run_dir))), default=0)
    return done >= steps - 1


# ---------------------------------------------------------------------- accounting


def trained_tokens(run_dir: str) -> dict[str, int]:
    """Generated tokens trained, per rollout (every step's batch)."""
    from rollout_recovery.protocol import rollout_of_replay_key

    out: dict[str, int] = {}
    for step in {r["step"] for r in cp.step_records(run_dir)}:
        table = cp.batch(run_dir, step)
        for key, mask in zip(table.column("key").to_pylist(),
                             table.column("loss_mask").to_pylist(), strict=True):  # fmt: skip
            out[rollout_of_replay_key(key)] = sum(mask)
    return out


def tally(records: list[dict], faults: list[goodput.Fault], run_dir: str) -> tuple[dict, dict]:
    """Goodput and lost tokens; the trained rollouts whose decoding no reading shows."""
    execs, trained = goodput.executions(records), trained_tokens(run_dir)
    counts = goodput.account(execs, faults, sum(trained.values()))
    return counts, goodput.unrecorded(execs, trained)


def level_report(run: LevelRun, ref_dir: str, ref_wall_s: float) -> dict:
    result = cp.CaseResult(case=f"soak-{run.level}", kind="soak", crashes=[], power_loss=False)
    cp.check_training(result, ref_dir, str(run.run_dir))
    cp.check_orphans(result, str(run.run_dir))
    records = run.records + [r for s in cp.session_records(str(run.run_dir)) for r in s]
    (run.run_dir.parent / f"{run.level}.records.json").write_text(json.dumps(records))
    injected = [goodput.Fault(f.at, f.kind) for f in run.faults if f.healed != "not_injected"]
    counts, missing = tally(records, injected, str(run.run_dir))
    unread = sum(missing.values())
    if unread > UNREAD_SHARE * counts["trained"]:
        run.violations.append(f"[evidence] no engine record shows {unread} trained tokens of "
                              f"{len(missing)} rollouts decoded")  # fmt: skip
    # What an engine decoded between the last read and its death, then cut and trained: decoded
    # (once at least), yet in no record.
    counts["unread"] = unread
    counts["decoded"] += unread
    counts["goodput"] = counts["trained"] / counts["decoded"] if counts["decoded"] else 1.0
    resumed = {(r["rollout_id"], r["model_call_id"], r["attempt"]) for r in records
               if r.get("resume") == "resumed"}  # fmt: skip
    missed = unresumed(str(run.run_dir), records) if run.level == "prefix" else []
    if missed:
        # A silent regression that decodes every restored call again would still train the
        # same batches (the sampler is deterministic): only the engines' verdicts show it.
        run.violations.append(f"[resumed] {len(missed)} calls cut in a restored snapshot were "
                              f"not resumed from their prefix: {missed[:5]}")  # fmt: skip
    healed: dict[str, dict[str, int]] = {}
    for f in run.faults:
        healed.setdefault(f.kind, {}).setdefault(f.healed, 0)
        healed[f.kind][f.healed] += 1
    return {
        "level": run.level,
        "faults": len(injected),
        "runs": run.runs,
        "wall_s": run.wall_s,
        "wall_vs_fault_free": run.wall_s / ref_wall_s,
        **counts,
        "healed": healed,
        "resumed_calls": len(resumed),
        "restores": len(cp.events(str(run.run_dir), "restore")),
        "heal_s": {k: [round(f.heal_s, 1) for f in run.faults if f.kind == k] for k in healed},
        "ended": run.ended,
        "violations": run.violations + result.violations,
        "rollouts_lost": result.rollouts_lost,
        "trained_twice": result.trained_twice,
    }


# ---------------------------------------------------------------------- main


def stream_of(seed: int, kinds: list[str], n: int) -> list[tuple[str, float]]:
    """n faults: every kind once (in a seeded order) before any repeats, then at random."""
    rng = random.Random(seed)
    order = rng.sample(kinds, len(kinds))
    picks = (order + [rng.choice(kinds) for _ in range(max(0, n - len(kinds)))])[:n]
    return [(k, rng.uniform(0.5, 4.0)) for k in picks]


def reference(out: Path, steps: int, token: str) -> tuple[str, float, dict]:
    ref_dir, saved = out / "reference", out / "reference.json"
    if saved.exists() and json.loads(saved.read_text())["steps"] == steps:  # --out used again
        ref = json.loads(saved.read_text())
        return str(ref_dir), ref["wall_s"], ref["counts"]
    t0 = time.monotonic()
    with open(out / "reference.log", "w") as log:
        code = subprocess.run(
            [sys.executable, "-m", "rollout_recovery.cli", "train", "--config", str(CONFIG),
             *overrides(ref_dir, steps, "prefix", token)],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
        ).returncode  # fmt: skip
    wall = time.monotonic() - t0
    if code != 0:
        sys.exit(f"FAIL: the fault-free reference run exited {code}; see {out}/reference.log")
    records = [r for s in cp.session_records(str(ref_dir)) for r in s]
    counts, missing = tally(records, [], str(ref_dir))
    if missing or counts["decoded_again"]:
        sys.exit(f"FAIL: the fault-free run's records: {missing} unrecorded, "
                 f"{counts['decoded_again']} tokens decoded twice")  # fmt: skip
    saved.write_text(json.dumps({"steps": steps, "wall_s": wall, "counts": counts}))
    return str(ref_dir), wall, counts


COLUMNS = [("level", "{}"), ("faults", "{}"), ("goodput", "{:.3f}"), ("decoded", "{:,}"),
           ("trained", "{:,}"), ("decoded_again", "{:,}"), ("wall_vs_fault_free", "{:.2f}"),
           ("rollouts_lost", "{}"), ("trained_twice", "{}")]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="the whole soak's rough length")
    ap.add_argument("--levels", default=",".join(LEVELS))
    ap.add_argument("--faults", default=",".join(KINDS), help="the kinds to draw from")
    ap.add_argument("--count", type=int, help="faults per level (default: from --minutes)")
    ap.add_argument("--steps", type=int, help="GRPO steps (default: from the fault count)")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--out", type=Path, help="where the runs go (default: a temporary folder)")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--fault", default="", help="break recovery on purpose (faults.py names)")
    args = ap.parse_args()
    levels, kinds = args.levels.split(","), args.faults.split(",")
    bad = [x for x in levels if x not in LEVELS] + [k for k in kinds if k not in KINDS]
    if bad:
        ap.error(f"unknown level or fault kind {bad}: levels {LEVELS}, kinds {KINDS}")
    mark_this_check()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("chaos_soak: stopped by SIGTERM"))
    seed = secrets.randbelow(2**31) if args.seed is None else args.seed
    count = args.count or max(len(kinds), int(args.minutes * 60 / len(levels) / FAULT_COST_S))
    # A run goes on stepping while some faults heal (an outage's writes tried again): four
    # steps a fault leave every fault of the stream a step to land in.
    steps = args.steps or 4 * count + 3
    stream = stream_of(seed, kinds, count)
    out = (args.out or Path(tempfile.mkdtemp(prefix="chaos-soak-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(16)
    print(f"[soak] seed {seed}: {count} faults a level over {steps} steps: "
          f"{[k for k, _ in stream]}", flush=True)  # fmt: skip
    ref_dir, ref_wall, ref_counts = reference(out, steps, token)
    print(f"[soak] fault-free reference: {ref_wall:.0f} s, goodput "
          f"{ref_counts['goodput']:.3f}", flush=True)  # fmt: skip
    rows = []
    for level in levels:
        run = LevelRun(level, out / level, token, out / f"{level}.outage", fault=args.fault)
        try:
            soak_level(run, stream, steps, seed)
        finally:  # however the soak ends (Ctrl-C, SIGTERM, an error): no run left behind
            if run.proc is not None and run.proc.poll() is None:
                run.kill_all()
        rows.append(level_report(run, ref_dir, ref_wall))
    print("\n| " + " | ".join(k for k, _ in COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for r in rows:
        print("| " + " | ".join(fmt.format(r[k]) for k, fmt in COLUMNS) + " |")
    print("\ntokens lost per fault, by kind (decoded again after it):")
    for r in rows:
        per = {k: round(v["tokens_lost"] / v["faults"], 1) for k, v in r["lost_by_kind"].items()}
        print(f"  {r['level']}: {per}")
        print(f"  {r['level']} healed: {r['healed']}")
    failed = [f"{r['level']}: {v}" for r in rows for v in r["violations"]]
    for v in failed:
        print(f"VIOLATION {v}")
    result = {"seed": seed, "steps": steps, "stream": stream, "reference_wall_s": ref_wall,
              "reference": ref_counts, "levels": rows, "passed": not failed}  # fmt: skip
    if args.json:
        write_result(args.json, result)
    print("PASS" if not failed else f"FAIL: {len(failed)} violations", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
