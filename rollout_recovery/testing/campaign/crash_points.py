"""The crash-point campaign: kill a small prefix-level GRPO job at every named crash point
(crashpoints.py), with and without a simulated power loss, restore it, let it finish, and
check what recovery promised.

One traced reference run (`ROLLOUT_RECOVERY_CRASH_TRACE`) is the parity reference and tells
which points the job reaches after step 1's trainer-checkpoint snapshot was published. A
case's first crash is armed at the first arrival after that anchor
(`ROLLOUT_RECOVERY_CRASH_AFTER`), whatever the timing before it, so it always has a snapshot
to fall back on and a step left to redo. A case is a list of crashes: the first run (fresh)
dies at the first one, each restore at the next, and a last restore finishes the job. Every
run is a real `rollout-recovery train` in its own session; a crash SIGKILLs the whole session
at the point and leaves a fsynced mark naming it. Under power loss every local path the run
writes goes through the fault-injecting filesystem (testing/faultfs.py) and, after the kill,
everything not yet durable is forgotten.

After the last restore the case checks, each violation tagged with its property:

- `[crash_point]`: every run died where it was armed (the mark names the point), none hung;
- `[restore]`: each restore chose a snapshot that was published before it started, and the
  job finished;
- `[parity]`: every step's training batch (keys, token ids, rewards) and loss equal the
  reference's, and the final trainer checkpoint is the same bytes;
- `[lost]` / `[trained_twice]`: every reference rollout is trained, each in exactly one step,
  and each step is logged once;
- `[committed_turn_decoded_again]`, `[resumed]`, `[decoded_tail]`, `[restore_refused]`: from
  the engines' own call-attempt records of each restore (engine_evidence.py): every cut call
  resumed from its prefix with exactly its tail decoded, nothing committed decoded again;
- `[orphans]`: after the last retention pass no temporary file, no unpublished or
  unverifiable snapshot directory and no incomplete trainer checkpoint is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rollout_recovery import crashpoints
from rollout_recovery.testing.campaign import engine_evidence

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "configs" / "prefix_recovery.yaml"
# Small and quick, yet every point is reached in every step: generation outlasts several
# cadence attempts, and keep_latest_k=2 makes retention delete. The first crash of a case
# lands in step 2 (after the anchor), so a restore always has a step left to run. With one
# core busy beside the suite a cadence attempt took 1.4 s, and 128-token calls ended before
# the second one of step 2 (the first found them with no token yet): the chain's cut then
# came in step 3 and its last crash after the final step. 384 tokens keep two attempts and
# more inside each step's generation there.
JOB = (
    "grpo.steps=3",
    "grpo.prompts_per_step=1",
    "grpo.generations_per_prompt=2",
    "policy.generation.max_new_tokens=384",
    "rollout_checkpointing.snapshot_attempt_interval_s=0.3",
    "rollout_checkpointing.keep_latest_k=2",
)
# A point that an uninterrupted job reaches only by a race, and a restore reaches for sure
# once an earlier crash left work behind: its case crashes there first. The environment's
# sweep deletes chunk rows a finished call left when a crash fell between its terminal row
# and its own chunk delete.
NEEDS_CRASH = {"chunks_swept": "terminal_row_written"}
ANCHOR = "after_trainer_snapshot@1"  # a first crash counts from here: a snapshot exists
RUN_TIMEOUT_S = 600
# Three crashes in a row, each in another component: a worker's cut, the controller's
# manifest, the trainer between its step's snapshot and its log line (the reduced campaign,
# also in CI). The full campaign adds a finished call's rows, the environment's sweep of
# leftover chunk rows, and a trainer checkpoint file.
CHAINS = (
    ["cut_rows_staged", "manifest_written", "after_trainer_snapshot"],
    ["terminal_row_written", "chunks_swept", "trainer_checkpoint_file"],
)


@dataclass(frozen=True)
class Crash:
    point: str
    arrival: int = 1
    anchored: bool = False  # count arrivals from the ANCHOR on (a fresh run's crash)

    def armed(self) -> str:
        return f"{self.point}@{self.arrival}"

    def env(self, mark: Path) -> dict[str, str]:
        env = {crashpoints.ENV: self.armed(), crashpoints.MARK_ENV: str(mark)}
        return env | ({crashpoints.AFTER_ENV: ANCHOR} if self.anchored else {})


@dataclass
class Case:
    name: str
    crashes: list[Crash]
    power_loss: bool = False

    @property
    def kind(self) -> str:
        if self.name.startswith("in_a_row+"):
            return "crashes_in_a_row"
        return "kill_power_loss" if self.power_loss else "kill"


@dataclass
class CaseResult:
    case: str
    kind: str
    crashes: list[str]
    power_loss: bool
    outcome: str = "recovered_exact"  # or not_reached / violation
    marks: list[dict] = field(default_factory=list)
    selected: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    rollouts_lost: int = 0
    trained_twice: int = 0
    committed_decoded_again: int = 0
    resumed_calls: int = 0
    restored_prefix_tokens: int = 0
    orphans: list[str] = field(default_factory=list)
    seconds: float = 0.0


# ---------------------------------------------------------------------- reading a run


def _storage(run_dir: str):
    from rollout_recovery.storage import RunStorage

    return RunStorage(run_dir)


def step_records(run_dir: str) -> list[dict]:
    """steps.jsonl's step lines (restore events left out), in order."""
    lines = _storage(run_dir).read_lines("steps.jsonl")
    return [r for r in map(json.loads, lines) if "event" not in r]


def events(run_dir: str, name: str) -> list[dict]:
    """steps.jsonl's events called `name` (restore, restored_in_process, preempted), in order."""
    lines = _storage(run_dir).read_lines("steps.jsonl")
    return [r for r in map(json.loads, lines) if r.get("event") == name]


def restore_events(run_dir: str) -> list[dict]:
    return events(run_dir, "restore")


def batch(run_dir: str, step: int):
    import pyarrow as pa

    data = _storage(run_dir).read_bytes(f"batches/step-{step:06d}.arrow")
    return pa.ipc.open_file(pa.BufferReader(data)).read_all()


def session_records(run_dir: str) -> list[list[dict]]:
    """Each run's engine records (`call_attempts/<session>.jsonl`, oldest run first), the
    last record of each call attempt."""
    return [records for _, records in _sessions(run_dir)]


def _sessions(run_dir: str) -> list[tuple[int, list[dict]]]:
    """(start time in ns, records) per session that recorded anything, oldest first."""
    storage = _storage(run_dir)
    out = []
    for name in sorted(storage.list_dir("call_attempts")):
        latest = {}
        for line in storage.read_lines(f"call_attempts/{name}"):
            r = json.loads(line)
            latest[(r["rollout_id"], r["model_call_id"], r["attempt"])] = r
        out.append((int(name.split("-", 1)[1].split(".")[0]), list(latest.values())))
    return out


def records_by_run(run_dir: str, starts_ns: list[int]) -> list[list[dict]]:
    """The engine records of each run started at `starts_ns` (a run killed before it
    recorded anything has none)."""
    out: list[list[dict]] = [[] for _ in starts_ns]
    for ts, records in _sessions(run_dir):
        i = max((k for k, s in enumerate(starts_ns) if s <= ts), default=None)
        if i is not None:
            out[i] += records
    return out


def snapshot_keys(snapshot_uri: str, partition: str) -> set[str]:
    """The keys of one partition in a published snapshot (verified on read)."""
    from rollout_recovery.data_plane import StagingStore
    from rollout_recovery.data_plane.filesystem import resolve
    from rollout_recovery.data_plane.snapshot_io import read_partitions

    fs, path = resolve(snapshot_uri)
    files = [f for f in StagingStore.manifest(snapshot_uri).body.files if f.partition == partition]
    table = read_partitions(fs, path, files).get(partition)
    return set() if table is None else set(table.column("key").to_pylist())


def turn_lengths(loss_mask) -> list[int]:
    """Generated tokens per turn: the lengths of the loss mask's runs of ones."""
    import numpy as np

    edges = np.flatnonzero(np.diff(np.r_[0, loss_mask, 0]) != 0)
    return (edges[1::2] - edges[::2]).tolist()


def snapshot_name(uri: str) -> str:
    return uri.split("?")[0].rstrip("/").rsplit("/", 1)[-1]


def published_states(run_dir: str) -> dict[str, dict]:
    """Every published snapshot's ledger and finished rollouts, by directory name: what a
    restore may choose from, read before it runs (retention may delete them later)."""
    from rollout_recovery.controller.selection import DATA_PLANE, SnapshotUnusable, read_ledger
    from rollout_recovery.data_plane.snapshot_io import published_uris

    out = {}
    for uri in published_uris(_storage(run_dir).child_uri(DATA_PLANE)):
        try:
            ledger = read_ledger(uri).model_dump(mode="json")
            out[snapshot_name(uri)] = {
                "ledger": ledger,
                "finished": sorted(snapshot_keys(uri, "replay")),
            }
        except (SnapshotUnusable, OSError) as err:
            out[snapshot_name(uri)] = {"unusable": str(err)}
    return out


def trainer_checkpoint_digest(run_dir: str, step: int) -> dict[str, str]:
    """sha256 of every file of a trainer checkpoint but its log record (timings) and a
    write's leftover temporary file (an orphan, reported as one)."""
    import hashlib

    from rollout_recovery.storage import TMP_MARK
    from rollout_recovery.trainer.trainer_checkpoints import STEP_RECORD, trainer_dir

    storage = _storage(run_dir)
    where = trainer_dir(step)
    return {
        name: hashlib.sha256(storage.read_bytes(f"{where}/{name}")).hexdigest()
        for name in storage.list_dir(where)
        if name != STEP_RECORD and TMP_MARK not in name
    }


# ---------------------------------------------------------------------- running the job


def train_command(run_dir: str, restore: bool, extra: Iterable[str] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "rollout_recovery.cli", "train"]
    if restore:
        cmd.append("--restore")
    return [*cmd, "--config", str(CONFIG), f"checkpointing.checkpoint_dir={run_dir}", *JOB, *extra]


def run_job(
    run_dir: str, restore: bool, env: dict[str, str], log: Path, extra: Iterable[str] = ()
) -> tuple[int, bool]:
    """Run `train` in its own session to its end (or its crash); returns (exit status, hung).
    Whatever of its session is still alive afterwards is killed."""
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            train_command(run_dir, restore, extra),
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=os.environ | env,
            start_new_session=True,
        )
        hung = False
        try:
            proc.wait(RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            hung = True
        _kill_session(proc.pid)
        proc.wait()
    return proc.returncode, hung


def _kill_session(sid: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = crashpoints.session_pids(sid)
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        time.sleep(0.2)


def trace_reference(workdir: Path) -> tuple[str, dict[str, list[dict]]]:
    """The uninterrupted reference run, traced: (its directory, arrivals by point)."""
    ref_dir = str(workdir / "reference")
    trace = workdir / "reference.trace.jsonl"
    code, hung = run_job(
        ref_dir, False, {crashpoints.TRACE_ENV: str(trace)}, workdir / "reference.log"
    )
    if code != 0 or hung:
        raise RuntimeError(f"the reference run failed (exit {code}); see {workdir}/reference.log")
    arrivals: dict[str, list[dict]] = defaultdict(list)
    for line in trace.read_text().splitlines():
        rec = json.loads(line)
        arrivals[rec["point"]].append(rec)
    return ref_dir, dict(arrivals)


def reached_after_anchor(arrivals: dict[str, list[dict]], point: str) -> int:
    """How often the reference reached `point` after its anchor."""
    name, n, _ = crashpoints.parse(ANCHOR)
    anchor = [a for a in arrivals.get(name, []) if a["arrival"] == n]
    if not anchor:
        raise RuntimeError(f"the reference never reached its anchor {ANCHOR}")
    return sum(a["time"] > anchor[0]["time"] for a in arrivals.get(point, []))


# ---------------------------------------------------------------------- one case


def run_case(case: Case, reference: str | Future, workdir: Path) -> CaseResult:
    """Run one case; `reference` is the reference run's directory, or a future of
    trace_reference's result when the reference runs alongside (waited for before the
    checks)."""
    t0 = time.monotonic()
    out = CaseResult(case.name, case.kind, [c.armed() for c in case.crashes], case.power_loss)
    where = workdir / case.name
    where.mkdir(parents=True, exist_ok=True)
    run_dir = str(where / "run")
    states: list[dict[str, dict]] = []  # per restore: what it could choose from
    starts: list[int] = []  # per run: when it started (ns), to tell its engine records
    for i, crash in enumerate(case.crashes):
        mark = where / f"mark-{i}.jsonl"
        env = crash.env(mark)
        if case.power_loss:
            from rollout_recovery.testing.faultfs import armed_env

            env |= armed_env(where / f"faultfs-{i}")
        starts.append(time.time_ns())
        code, hung = run_job(run_dir, i > 0, env, where / f"run-{i}.log")
        marks = [json.loads(x) for x in mark.read_text().splitlines()] if mark.exists() else []
        out.marks += marks
        if hung:
            out.violations.append(f"[crash_point] run {i} armed at {crash.armed()} hung")
        elif not marks and code == 0:
            out.outcome = "not_reached"
            out.violations.append(
                f"[crash_point] run {i} finished without reaching {crash.armed()}"
            )
        elif [m["point"] for m in marks] != [crash.point] or code != -signal.SIGKILL:
            out.violations.append(
                f"[crash_point] run {i} armed at {crash.armed()} ended with "
                f"exit {code} and marks {marks}; see {where}/run-{i}.log"
            )
        if out.violations:
            break
        if case.power_loss:
            from pyarrow.fs import LocalFileSystem

            from rollout_recovery.testing.faultfs import fault_filesystem

            fault_filesystem(LocalFileSystem(), where / f"faultfs-{i}").handler.power_loss()
        states.append(published_states(run_dir))
    if not out.violations:
        starts.append(time.time_ns())
        code, hung = run_job(run_dir, True, {}, where / "restore.log")
        if code != 0 or hung:
            out.violations.append(
                f"[restore] the last restore exited {code}; see {where}/restore.log"
            )
        else:
            (where / "case.json").write_text(json.dumps({"states": states, "starts": starts}))
            ref_dir = reference.result()[0] if isinstance(reference, Future) else reference
            check_recovered(out, ref_dir, run_dir, states, starts)
    if out.violations and out.outcome != "not_reached":
        out.outcome = "violation"
    out.seconds = time.monotonic() - t0
    return out


def recheck(case_dir: Path, ref_dir: str, run_dir: str | None = None) -> CaseResult:
    """The checks of a finished case again, from its files (`run_dir`: a copy to judge
    instead of the case's own run, e.g. one damaged on purpose)."""
    saved = json.loads((case_dir / "case.json").read_text())
    out = CaseResult(case_dir.name, "recheck", [], False)
    check_recovered(out, ref_dir, run_dir or str(case_dir / "run"), saved["states"],
                    saved["starts"])  # fmt: skip
    out.outcome = "violation" if out.violations else "recovered_exact"
    return out


def check_recovered(
    out: CaseResult, ref_dir: str, run_dir: str, states: list[dict], starts_ns: list[int]
) -> None:
    """Every check of the module docstring on a finished, restored run."""
    _check_restores(out, run_dir, states)
    check_training(out, ref_dir, run_dir)
    _check_engines(out, run_dir, states, starts_ns)
    check_orphans(out, run_dir)


def _check_restores(out: CaseResult, run_dir: str, states: list[dict]) -> None:
    events = restore_events(run_dir)
    out.selected = [snapshot_name(e["snapshot"]) for e in events]
    if len(events) != len(states):
        out.violations.append(f"[restore] {len(events)} restore events for {len(states)} crashes")
        return
    for i, (name, offered) in enumerate(zip(out.selected, states, strict=True)):
        if "ledger" not in offered.get(name, {}):
            out.violations.append(
                f"[restore] restore {i} chose {name}, which was not a "
                f"usable published snapshot before it: {sorted(offered)}"
            )
        newest = max(offered) if offered else None
        if name != newest:
            out.violations.append(
                f"[restore] restore {i} chose {name}, the newest published snapshot was {newest}"
            )


def check_training(out: CaseResult, ref_dir: str, run_dir: str) -> None:
    """Every reference rollout trained once, in its step, with the reference's batches, losses
    and final trainer checkpoint; violations and counts go to `out`."""
    ref, rec = step_records(ref_dir), step_records(run_dir)
    logged = Counter(r["step"] for r in rec)
    for step, n in sorted(logged.items()):
        if n > 1:
            out.trained_twice += 1
            out.violations.append(f"[trained_twice] step {step} is logged {n} times")
    by_step = {r["step"]: r for r in rec}
    keys_in: dict[str, list[int]] = defaultdict(list)
    for r in ref:
        step = r["step"]
        mine = by_step.get(step)
        ref_keys = set(batch(ref_dir, step).column("key").to_pylist())
        if mine is None:
            out.rollouts_lost += len(ref_keys)
            out.violations.append(f"[lost] step {step} was never trained after the restore")
            continue
        rec_keys = batch(run_dir, step).column("key").to_pylist()
        for key in rec_keys:
            keys_in[key].append(step)
        lost = ref_keys - set(rec_keys)
        if lost:
            out.rollouts_lost += len(lost)
            out.violations.append(f"[lost] step {step} did not train {sorted(lost)}")
        if mine["batch_digest"] != r["batch_digest"] or mine["loss"] != r["loss"]:
            out.violations.append(
                f"[parity] step {step}: batch or loss differs from the "
                f"reference (loss {mine['loss']} vs {r['loss']})"
            )
    twice = {k: s for k, s in keys_in.items() if len(s) > 1}
    if twice:
        out.trained_twice += len(twice)
        out.violations.append(f"[trained_twice] rollouts trained in several steps: {twice}")
    final = max(r["step"] for r in ref)
    if final in by_step and trainer_checkpoint_digest(ref_dir, final) != trainer_checkpoint_digest(
        run_dir, final
    ):
        out.violations.append(
            f"[parity] the final trainer checkpoint (step {final}) differs from the reference's"
        )
    out.resumed_calls = sum(r.get("restored_calls", 0) for r in rec)
    out.restored_prefix_tokens = sum(r.get("restored_prefix_tokens", 0) for r in rec)
    refused = {
        k: v
        for r in rec
        for k, v in r.items()
        if (k.startswith("restore_refused.") or k == "worker_resumes_refused") and v
    }
    if refused:
        out.violations.append(f"[restore_refused] {refused}")


def _check_engines(out: CaseResult, run_dir: str, states: list[dict], starts_ns: list[int]) -> None:
    """Each restore's engine records against the ledger it restored. A restore that was
    itself killed before it recorded the step it redid is judged by the next one."""
    sessions = records_by_run(run_dir, starts_ns)
    for i, name in enumerate(out.selected):
        chosen = states[i].get(name, {})
        if "ledger" not in chosen:
            continue
        ledger = chosen["ledger"]
        step = ledger["step"]
        after = engine_evidence.of_step(sessions[i + 1], step)
        if not after:
            continue
        table = batch(run_dir, step + 1)
        from rollout_recovery.data_plane.schemas import list_rows
        from rollout_recovery.protocol import replay_key

        masks = dict(
            zip(table.column("key").to_pylist(), list_rows(table, "loss_mask"), strict=True)
        )
        keys = {
            e["rollout_id"]: replay_key(e["group_id"], e["generation_index"])
            for e in ledger.get("episodes", [])
        }
        length_of = _length_of(masks, keys)
        found = engine_evidence.check_engine_evidence(
            "prefix", ledger, chosen["finished"], after, length_of
        )
        out.committed_decoded_again += sum(
            v.startswith("[committed_turn_decoded_again]") for v in found
        )
        out.violations += [f"{v} (restore {i})" for v in found]


def _length_of(masks: dict, keys: dict) -> Callable[[str, str], int | None]:
    def length_of(rollout: str, call: str) -> int | None:
        key = keys.get(rollout)
        runs = turn_lengths(masks[key]) if key in masks else []
        turn = int(call[1:])
        return runs[turn] if turn < len(runs) else None

    return length_of


def check_orphans(out: CaseResult, run_dir: str) -> None:
    """No temporary file, unpublished or unverifiable snapshot, or incomplete trainer
    checkpoint left under the run."""
    from rollout_recovery.controller.selection import DATA_PLANE
    from rollout_recovery.data_plane.snapshot_io import (
        SNAPSHOT_DIR_RE,
        published_uris,
        verify_snapshot,
    )
    from rollout_recovery.trainer.trainer_checkpoints import TrainerCheckpointError, read_meta

    storage = _storage(run_dir)
    orphans = [f"temporary file {t}" for t in storage.leftover_temporaries()]
    published = {snapshot_name(u) for u in published_uris(storage.child_uri(DATA_PLANE))}
    for name in storage.list_dir(DATA_PLANE):
        if not SNAPSHOT_DIR_RE.match(name):
            continue
        if name not in published:
            orphans.append(f"unpublished snapshot {name}")
            continue
        try:
            verify_snapshot(storage.fs, storage.path(f"{DATA_PLANE}/{name}"), use_cache=False)
        except OSError as err:
            orphans.append(f"snapshot {name} does not verify: {err}")
    for name in storage.list_dir("trainer"):
        try:
            read_meta(storage, int(name.rsplit("-", 1)[-1]))
        except (TrainerCheckpointError, ValueError) as err:
            orphans.append(f"incomplete trainer checkpoint {name}: {err}")
    out.orphans = orphans
    out.violations += [f"[orphans] {o}" for o in orphans]


# ---------------------------------------------------------------------- the campaign


def plan_cases(
    arrivals: dict[str, list[dict]] | None,
    points: Iterable[str],
    power_loss: bool,
    chains: Iterable[list[str]] = (),
) -> tuple[list[Case], list[str]]:
    """The cases for `points` (each alone; with power_loss also each under power loss) and,
    per chain, one case crashing at every point of it in a row under power loss; plus the
    points the job never reaches after its anchor (None: the reference is not traced yet,
    every point is planned and an unreached one ends `not_reached`)."""
    cases, unreached = [], []
    for point in points:
        first = NEEDS_CRASH.get(point, point)
        if arrivals is not None and not reached_after_anchor(arrivals, first):
            unreached.append(point)
            continue
        crashes = [Crash(first, anchored=True)] + ([Crash(point)] if first != point else [])
        cases.append(Case(point, crashes))
        if power_loss:
            cases.append(Case(f"{point}+power_loss", crashes, power_loss=True))
    for chain in chains:
        if arrivals is not None and not reached_after_anchor(arrivals, chain[0]):
            raise RuntimeError(f"a chain's first point {chain[0]} is never reached")
        # A restore always has a snapshot to return to: later crashes count from its start.
        crashes = [Crash(chain[0], anchored=True)] + [Crash(p) for p in chain[1:]]
        cases.append(Case("in_a_row+" + "+".join(chain), crashes, power_loss=True))
    return cases, unreached


@dataclass
class CrashCampaignResult:
    cases: list[CaseResult]
    unreached: list[str]
    reference_arrivals: dict[str, int]
    seconds: float

    def summary(self) -> dict:
        by_kind = Counter(c.kind for c in self.cases)
        return {
            "cases": len(self.cases),
            "by_kind": dict(by_kind),
            "recovered_exact": sum(c.outcome == "recovered_exact" for c in self.cases),
            "not_reached": sum(c.outcome == "not_reached" for c in self.cases),
            "violations": sum(c.outcome == "violation" for c in self.cases),
            "silent_corruption": sum(
                any(v.startswith(("[parity]", "[lost]", "[trained_twice]")) for v in c.violations)
                for c in self.cases
            ),
            "rollouts_lost": sum(c.rollouts_lost for c in self.cases),
            "trained_twice": sum(c.trained_twice for c in self.cases),
            "committed_decoded_again": sum(c.committed_decoded_again for c in self.cases),
            "resumed_calls": sum(c.resumed_calls for c in self.cases),
            "orphans": sum(len(c.orphans) for c in self.cases),
            "points_unreached": self.unreached,
            "seconds": round(self.seconds, 1),
        }

    def table(self) -> str:
        head = (
            f"{'case':44} {'outcome':16} {'selected':>8} {'resumed':>7} {'lost':>4} "
            f"{'twice':>5} {'redec':>5} {'secs':>5}"
        )
        rows = [head, "-" * len(head)]
        for c in self.cases:
            rows.append(
                f"{c.case[:44]:44} {c.outcome:16} {len(c.selected):>8} "
                f"{c.resumed_calls:>7} {c.rollouts_lost:>4} {c.trained_twice:>5} "
                f"{c.committed_decoded_again:>5} {c.seconds:>5.0f}"
            )
        return "\n".join(rows)

    def to_json(self) -> dict:
        return {
            "summary": self.summary(),
            "reference_arrivals": self.reference_arrivals,
            "cases": [asdict(c) for c in self.cases],
        }


def run_crash_campaign(
    workdir: Path,
    points: Iterable[str] = tuple(crashpoints.POINTS),
    power_loss: bool = True,
    chains: Iterable[list[str]] = (),
    parallel: int = 1,
    progress: Callable[[CaseResult], None] | None = None,
    reference_alongside: bool = False,
) -> CrashCampaignResult:
    """The reference, then every planned case, `parallel` at a time (each is a few runs
    that are busy on one core mostly, so two share two cores well). `reference_alongside`
    runs the reference beside the cases instead of first: the cases need it only for their
    checks (anchored crashes count arrivals from the anchor, not from the trace), but points
    the job never reaches are then found by running them."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, parallel) + reference_alongside) as pool:
        if reference_alongside:
            reference: str | Future = pool.submit(trace_reference, workdir)
            cases, unreached = plan_cases(None, points, power_loss, chains)
        else:
            reference, arrivals = trace_reference(workdir)
            cases, unreached = plan_cases(arrivals, points, power_loss, chains)

        def one(case: Case) -> CaseResult:
            result = run_case(case, reference, workdir)
            if progress is not None:
                progress(result)
            return result

        results = list(pool.map(one, cases))
        if isinstance(reference, Future):
            arrivals = reference.result()[1]
    counts = {p: len(arrivals.get(p, [])) for p in crashpoints.POINTS}
    return CrashCampaignResult(results, unreached, counts, time.monotonic() - t0)
