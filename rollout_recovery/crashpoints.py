"""Named crash points: the places between durable steps where a test can stop the whole job.

Arm one with `ROLLOUT_RECOVERY_CRASH_AT=<name>[@<n>][:<action>]`: the n-th time (default the
first) that one process reaches the point, it acts:

* `kill` (default): SIGKILL every process of the job, as a power cut, an OOM kill of the node
  or a preemption would: no cleanup, no flush, no `finally`;
* `exit`: `os._exit(137)` in this process only (the rest of the job sees it die);
* `freeze`: SIGSTOP every process of the job, for a test that inspects it before killing it;
* `pause`: like `freeze`, at the n-th arrival and at every one after it: the test that watches
  the mark file judges each pause and resumes the job (SIGCONT) or ends it. A check that must
  act at "a snapshot holding cut calls" waits on the job rather than racing it.

"The job" is every process in the session of the process that reached the point: start the
job in its own session (`start_new_session=True`), as the crash campaign does. Ray workers and
vLLM engines run in process groups of their own but stay in that session. Each process counts
its own arrivals, so `@n` means the n-th time in whichever process reaches it n times first.

`ROLLOUT_RECOVERY_CRASH_MARK=<file>` makes the point append one JSON line (point, arrival,
pid, time) to that file, fsynced, before it acts: the campaign's proof of where the job died.
`ROLLOUT_RECOVERY_CRASH_AFTER=<point>[@<n>]` (needs the mark file) counts the armed point's
arrivals only from the moment any process reached that anchor: "the first cut after step 1's
snapshot was published" whatever the timing of the run before it. The anchor process leaves
`<mark file>.anchor` for the others to see.

A point may carry facts (`crash_point("snapshot_taken", step=2, snapshot=...)`): they go into
the mark line, and `ROLLOUT_RECOVERY_CRASH_WHEN=<fact><op><int>[,...]` (ops `>= <= == < >`)
counts only the arrivals whose facts meet every condition (a missing fact meets none): "the
first snapshot of step 2" is `snapshot_taken@1` when `step==2`, whatever the load.

`ROLLOUT_RECOVERY_CRASH_TRACE=<file>` records every arrival at every point (point, arrival,
pid, time) without acting: the campaign reads a reference run's trace to choose, per point,
what the job reaches after its anchor. All these variables reach every actor through its
runtime environment (faults.actor_env_vars).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

ENV = "ROLLOUT_RECOVERY_CRASH_AT"
MARK_ENV = "ROLLOUT_RECOVERY_CRASH_MARK"
TRACE_ENV = "ROLLOUT_RECOVERY_CRASH_TRACE"
AFTER_ENV = "ROLLOUT_RECOVERY_CRASH_AFTER"
WHEN_ENV = "ROLLOUT_RECOVERY_CRASH_WHEN"
ACTIONS = ("kill", "exit", "freeze", "pause")
_OPS = {">=": int.__ge__, "<=": int.__le__, "==": int.__eq__, "<": int.__lt__, ">": int.__gt__}

# Each point sits right after the durable step it names, in the order one training step
# reaches them (docs/crash_consistency.md draws the sequence).
POINTS: dict[str, str] = {
    "fence_held": "controller: every worker's checkpoint fence is held",
    "cut_rows_staged": "worker: one cut's chunk rows are in the store, the cut not yet answered",
    "env_prepared": "controller: admission closed and every in-flight call cut",
    "episodes_committed": "controller: the environment committed its episode records",
    "fences_released": "controller: the store frozen, fences released, admission reopened",
    "snapshot_file_written": "store shard: one snapshot data file written and synced",
    "sidecar_written": "controller: one snapshot sidecar (the ledger) written and synced",
    "manifest_written": "controller: the manifest written under its temporary name, synced",
    "manifest_moved": "controller: the manifest moved into place, its log entry not written",
    "manifest_published": "controller: the ownership-log entry written: the snapshot published",
    "snapshot_taken": "controller: the snapshot written and published",
    "retention_deleted": "controller: retention deleted one old snapshot directory",
    "terminal_row_written": "worker: a finished call's terminal row is in the store",
    "chunk_rows_deleted": "worker: a finished call's superseded chunk rows deleted",
    "replay_row_written": "environment: a finished rollout's replay row is in the store",
    "chunks_swept": "environment: a finished rollout's leftover chunk rows deleted",
    "batch_leased": "trainer: the step's batch leased from the store",
    "batch_acked": "trainer: the trained batch acknowledged (its rows leave the store)",
    "weights_pushed": "trainer: the new weights pushed to every worker",
    "trainer_checkpoint_file": "trainer: one trainer checkpoint file written and synced",
    "after_trainer_checkpoint": "trainer: the trainer checkpoint complete, its snapshot not taken",
    "after_trainer_snapshot": "trainer: the step's snapshot published, the step not yet logged",
    "step_logged": "trainer: the step's line appended to steps.jsonl",
}
_reached: Counter[str] = Counter()
_qualified: Counter[str] = Counter()  # arrivals whose facts met ROLLOUT_RECOVERY_CRASH_WHEN
_since_anchor: Counter[str] = Counter()
_lock = threading.Lock()  # shards write snapshot files from a thread pool
_pause_lock = threading.Lock()


def parse(armed: str) -> tuple[str, int, str]:
    """(point, n, action) of an armed value; ValueError naming the problem otherwise."""
    spec, _, action = armed.partition(":")
    name, _, nth = spec.partition("@")
    action = action or "kill"
    if name not in POINTS:
        raise ValueError(f"{ENV}={armed!r}: unknown crash point {name!r}; known: {list(POINTS)}")
    if action not in ACTIONS:
        raise ValueError(f"{ENV}={armed!r}: unknown action {action!r}; known: {ACTIONS}")
    if nth and (not nth.isdigit() or int(nth) < 1):
        raise ValueError(f"{ENV}={armed!r}: the arrival after @ must be a number >= 1")
    return name, int(nth or 1), action


def parse_when(when: str) -> list[tuple[str, str, int]]:
    """The conditions of a ROLLOUT_RECOVERY_CRASH_WHEN value; ValueError naming the bad one."""
    out = []
    for cond in (c.strip() for c in when.split(",") if c.strip()):
        for op in sorted(_OPS, key=len, reverse=True):
            fact, found, value = cond.partition(op)
            if found and fact.strip().isidentifier() and value.strip().lstrip("-").isdigit():
                out.append((fact.strip(), op, int(value)))
                break
        else:
            raise ValueError(f"{WHEN_ENV}={when!r}: {cond!r} is not <fact><op><int> with an op "
                             f"of {list(_OPS)}")  # fmt: skip
    return out


def _meets(facts: dict[str, object], when: str | None) -> bool:
    if not when:
        return True
    for fact, op, value in parse_when(when):
        have = facts.get(fact)
        if not isinstance(have, int) or not _OPS[op](have, value):
            return False
    return True


def armed() -> bool:
    """Whether any point is armed or traced in this process: a caller skips computing facts
    otherwise (they are never read)."""
    return bool(os.environ.get(ENV) or os.environ.get(TRACE_ENV))


def crash_point(name: str, **facts: object) -> None:
    """Stop the job here if this point is armed and this is its arrival (a no-op otherwise).
    `facts` (JSON values) go into the mark line and are what ROLLOUT_RECOVERY_CRASH_WHEN
    judges."""
    if name not in POINTS:
        raise ValueError(f"unknown crash point {name!r}; known: {list(POINTS)}")
    armed, trace = os.environ.get(ENV), os.environ.get(TRACE_ENV)
    if not armed and not trace:
        return
    with _lock:
        _reached[name] += 1
        arrival = _reached[name]
    if trace:
        _append(trace, {"point": name, "arrival": arrival, "pid": os.getpid(),
                        "time": time.time()}, sync=False)  # fmt: skip
    if not armed:
        return
    target, nth, action = parse(armed)
    mark, after = os.environ.get(MARK_ENV), os.environ.get(AFTER_ENV)
    anchor = f"{mark}.anchor" if mark else None
    fire, counted = False, 0
    if target == name and _meets(facts, os.environ.get(WHEN_ENV)):
        with _lock:
            if not after:
                _qualified[name] += 1
                counted = _qualified[name]
            elif anchor and os.path.exists(anchor):
                _since_anchor[name] += 1
                counted = _since_anchor[name]
        fire = counted >= nth if action == "pause" else counted == nth
    if after and anchor and not fire:
        point, n, _ = parse(after)
        if point == name and arrival == n:
            _append(anchor, {"anchor": after, "pid": os.getpid()}, sync=False)
    if not fire:
        return
    record = {"point": name, "arrival": counted, "action": action, "pid": os.getpid(),
              "time": time.time(), "after": after, "facts": facts}  # fmt: skip
    if action == "pause":
        # One pause at a time per process: a second thread arriving meanwhile marks and stops
        # only once the first pause was resumed, so each mark gets a stop of its own.
        with _pause_lock:
            if mark:
                _append(mark, record, sync=False)
            _signal_session(signal.SIGSTOP)
        return
    if mark:
        _append(mark, record, sync=True)
    if action == "exit":
        os._exit(137)
    _signal_session(signal.SIGKILL if action == "kill" else signal.SIGSTOP)


def _append(path: str, record: dict, sync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def session_pids(sid: int) -> list[int]:
    """Every live process in session `sid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if fields[0] != "Z" and int(fields[3]) == sid:  # fields: state ppid pgrp session
            out.append(int(entry))
    return out


def actor_pid(sid: int, actor_class: str) -> int | None:
    """The process in session `sid` of a Ray actor of class `actor_class` (Ray titles it
    `ray::<class>...`), for a check that kills one actor of the job from outside."""
    for pid in session_pids(sid):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as fh:
            if fh.read().startswith(f"ray::{actor_class}".encode()):
                return pid
    return None


def controller_pid(run_dir: str | Path) -> int | None:
    """The process of the controller serving the run in `run_dir` (its `workers.json`): the
    standby controller (`failover.standby_controller`) is a RolloutRecovery actor too."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        return int(json.loads((Path(run_dir) / "workers.json").read_text())["controller_pid"])
    return None


def _signal_session(sig: int) -> None:
    """Send `sig` to every process of this session, this one last. New processes may be
    forking while it runs, so it sweeps until a pass finds no one else."""
    me, sid = os.getpid(), os.getsid(0)
    signalled: set[int] = set()
    for _ in range(50):
        others = [p for p in session_pids(sid) if p != me and p not in signalled]
        if not others:
            break
        for pid in others:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            signalled.add(pid)
    os.kill(me, sig)


def actor_env_vars() -> dict[str, str]:
    """The armed crash point, its mark file and the trace, for an actor's runtime env."""
    names = (ENV, MARK_ENV, TRACE_ENV, AFTER_ENV, WHEN_ENV)
    return {k: os.environ[k] for k in names if os.environ.get(k)}
