"""A preemption (SIGTERM) in the middle of generation, then `train --restore`, checked by the
engines' own records (docs/preemption.md).

    functional_tests/preemption_check.sh --out DIR [--steps 2] [--cuts 2] [--fault NAME]
        [--seed N] [overrides...]

1. `rollout-recovery train` at prefix level; as soon as a snapshot of step >= 1 holding --cuts
   cut calls is seen published (plus a random moment under half the snapshot interval), SIGTERM
   to the driver process alone (as Kubernetes sends it to a container's first process). Should
   the step's calls have ended by then (a slow poll on a loaded machine), the check runs once
   more in a fresh location; the final snapshot must cut --cuts calls (`[cut]`).
2. The run must publish its final snapshot within `preemption.grace_s` of the SIGTERM, exit 0,
   say `preempted (SIGTERM): ...` in one line, log the `preempted` event with its snapshot,
   and leave no process behind. (Its exit after the snapshot may outlast the grace on a loaded
   machine, Ray's own shutdown included: a scheduler's SIGKILL then costs nothing.)
3. `train --restore` to the end; it must take the preemption's snapshot.
4. From the engines' records: every call the final snapshot cut was resumed from exactly its
   cut with exactly its tail decoded, nothing it had finished was decoded again, and the
   tokens decoded before the SIGTERM and decoded again after the restore are counted:
   `[decoded_twice]` unless 0.

Writes DIR/parity.json; exits non-zero on any violation. `--fault preemption_hold_disabled`
(rollout_recovery/faults.py) cuts without holding generation first: the engines decode past
the cuts until they stop, and the check must fail with `[decoded_twice]`.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import recovery_check as rc  # noqa: E402
from processes import alive_own, descendants, mark_this_check  # noqa: E402

from rollout_recovery.testing.campaign import engine_evidence as evidence  # noqa: E402
from rollout_recovery.testing.campaign.crash_points import (  # noqa: E402
    batch,
    restore_events,
    session_records,
    snapshot_keys,
    snapshot_name,
    turn_lengths,
)

PREEMPTED = "preempted (SIGTERM): "


def events(run_dir: str, kind: str) -> list[dict]:
    from rollout_recovery.storage import RunStorage

    lines = RunStorage(run_dir).read_lines("steps.jsonl")
    return [r for r in map(json.loads, lines) if r.get("event") == kind]


def preempt_phase(args, run_dir: str) -> dict:
    """Run fresh until a snapshot of step >= 1 holds --cuts cut calls, SIGTERM the driver at a
    random moment within an interval after it, and wait for its exit."""
    from rollout_recovery.data_plane.snapshot_io import published_uris

    log_path = args.out / "phase1.log"
    cmd = [*rc.train_command(args), "--config", rc.config(args), *rc.overrides(args, run_dir)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=rc.REPO,
                                env=rc.fault_env(args), start_new_session=True)  # fmt: skip
    rc.STARTED.append(proc)
    root, deadline, tree = rc.child(run_dir, "data_plane"), time.monotonic() + 600, set()
    signal_at, seen, next_scan = None, set(), 0.0
    while signal_at is None or time.time() < signal_at:
        if proc.poll() is not None:
            state = rc.run_state(run_dir, log_path, 0)
            sys.exit(f"FAIL: the run exited {proc.returncode} before a snapshot of step >= 1 "
                     f"with {args.cuts} cut calls; {state}")  # fmt: skip
        if time.monotonic() > deadline:
            rc.stop_run(proc)
            sys.exit(f"FAIL: no snapshot to preempt after; {rc.run_state(run_dir, log_path, 0)}")
        if time.monotonic() >= next_scan:  # pgrep per process: not on every poll
            tree |= descendants(proc.pid)
            next_scan = time.monotonic() + 1.0
        uris = published_uris(root) if signal_at is None else []
        if uris and uris[-1] not in seen:
            seen.add(uris[-1])
            n, ledger = rc.recoverable(args, uris[-1])
            if n >= args.cuts and ledger["step"] >= 1:  # as soon as seen: the calls go on
                signal_at = time.time() + args.rng.uniform(0.0, 0.5) * args.interval
        time.sleep(0.05)
    t0, sent_at = time.monotonic(), time.time()
    os.kill(proc.pid, signal.SIGTERM)
    code = rc.wait_phase(proc, args.grace + 60, "the preempted run", run_dir, log_path)
    exit_s = time.monotonic() - t0
    time.sleep(3)  # Ray's processes end with their driver
    left = sorted(p for p in tree | descendants(proc.pid) if alive_own(p))
    lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if PREEMPTED in ln]
    return {"exit_code": code, "exit_s": exit_s, "lines": lines, "processes_left": left,
            "sent_at": sent_at}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--cuts", type=int, default=2, help="cut calls in the snapshot before it")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--interval", type=float, default=0.4)
    ap.add_argument("--grace", type=float, default=25.0, help="preemption.grace_s")
    ap.add_argument("--phase-timeout", type=float, default=900)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--fault", help="a fault armed in the preempted run (faults.py)")
    ap.add_argument("extra", nargs="*", help="more config overrides for every run")
    args = ap.parse_args()
    mark_this_check()
    atexit.register(rc.stop_left_runs)
    args.seed = secrets.randbelow(2**31) if args.seed is None else args.seed
    args.rng, args.token = random.Random(args.seed), secrets.token_urlsafe(16)
    args.env, args.train, args.model, args.gpu, args.level = "tally", None, None, False, "prefix"
    args.config, args.storage, args.max_turns = None, "local", 1
    args.extra = [f"preemption.grace_s={args.grace}", *args.extra]
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.fault_armed = args.fault
    for attempt, name in enumerate(("run", "run-retry")):
        run_dir = str(args.out / name)
        subprocess.run(["rm", "-rf", run_dir], check=True)
        phase = preempt_phase(args, run_dir)
        [event] = events(run_dir, "preempted") or [{}]
        if event.get("calls_cut") or attempt:
            break
        # A slow poll on a loaded machine: the SIGTERM came after the step's calls had ended.
        print(f"the preemption found no call in flight ({event}); once more", flush=True)
    args.fault = None  # the restore runs as shipped
    cmd = [*rc.train_command(args), "--restore", "--config", rc.config(args),
           *rc.overrides(args, run_dir)]  # fmt: skip
    rc.run(args, cmd, args.out / "phase2.log", "the restore", run_dir)
    return report(args, run_dir, phase)


def report(args, run_dir: str, phase: dict) -> int:
    from rollout_recovery.data_plane import StagingStore
    from rollout_recovery.data_plane.schemas import list_rows
    from rollout_recovery.protocol import replay_key

    violations = []
    if phase["exit_code"] != 0:
        violations.append(f"[exit] the preempted run exited {phase['exit_code']}, not 0")
    if len(phase["lines"]) != 1 or "published" not in phase["lines"][0]:
        violations.append(f"[line] expected one line saying what was saved: {phase['lines']}")
    if phase["processes_left"]:
        violations.append(f"[processes] left after the exit: {phase['processes_left']}")
    [event] = events(run_dir, "preempted") or [{}]
    uri = event.get("checkpoint")
    if uri is None:
        sys.exit(f"FAIL: no preemption snapshot was logged ({event}); {violations}")
    phase["published_s"] = rc.snapshot_time(uri) - phase["sent_at"]
    if phase["published_s"] > args.grace:
        violations.append(f"[grace] the final snapshot was published {phase['published_s']:.1f} "
                          f"s after the SIGTERM > grace {args.grace:g} s")  # fmt: skip
    ledger = json.loads(StagingStore.read_sidecar(uri, "ledger.json"))
    finished = snapshot_keys(uri, "replay")
    selected = [snapshot_name(e["snapshot"]) for e in restore_events(run_dir)]
    if selected != [snapshot_name(uri)]:
        violations.append(f"[restore] the restore took {selected}, not {snapshot_name(uri)}")
    sessions = session_records(run_dir)
    before, after = sessions[0], sessions[1] if len(sessions) > 1 else []
    table = batch(run_dir, ledger["step"] + 1)
    masks = dict(zip(table.column("key").to_pylist(), list_rows(table, "loss_mask"), strict=True))
    keys = {e["rollout_id"]: replay_key(e["group_id"], e["generation_index"])
            for e in ledger["episodes"]}  # fmt: skip

    def length_of(rollout: str, call: str) -> int | None:
        runs = turn_lengths(masks[keys[rollout]]) if keys.get(rollout) in masks else []
        return runs[int(call[1:])] if int(call[1:]) < len(runs) else None

    violations += evidence.check_engine_evidence("prefix", ledger, finished, after, length_of)
    lost = evidence.lost_work(before, after, [], ledger, finished, "prefix")
    if lost["prefix"] != 0:
        violations.append(f"[decoded_twice] {lost['prefix']} tokens decoded before the SIGTERM "
                          "were decoded again after the restore")  # fmt: skip
    cut = sum(1 for c in ledger["continuations"].values() if c.get("tokens", 0) > 0)
    if cut < args.cuts:
        violations.append(f"[cut] the final snapshot cut {cut} calls (< {args.cuts})")
    result = {"seed": args.seed, "fault": args.fault_armed, "run_dir": run_dir,
              "preempted": phase | {"event": event}, "snapshot": uri, "calls_cut": cut,
              "calls_held": event.get("held"), "lost_work": lost, "selected": selected,
              "violations": violations}  # fmt: skip
    path = args.out / "parity.json"
    path.write_text(json.dumps(result, indent=2, default=str))
    print(f"\npreemption check ({path})")
    print(f"  SIGTERM to publication      {phase['published_s']:.1f} s")
    print(f"  SIGTERM to exit             {phase['exit_s']:.1f} s (exit {phase['exit_code']})")
    print(
        f"  final snapshot              {snapshot_name(uri)}: {cut} calls cut, "
        f"{event.get('held')} held"
    )
    print(f"  decoded before the SIGTERM  {lost['decoded_before_crash']} tokens")
    print(f"  decoded again               {lost['prefix']} tokens")
    if violations:
        print("FAIL:\n  " + "\n  ".join(violations))
        return 1
    print("preemption_check: 1 passed, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
