"""One location walked through every failure and refusal a user meets, each run with the
command the previous one's last message named: the location must always be continuable.

    .venv/bin/python functional_tests/continuable.py --out DIR

Every fault lands at an event the run reaches, never at a moment: each phase is armed to hold
itself after every finished call (the crash point `terminal_row_written` with the `pause`
action, pauses.py), and the check acts on the held job.

1. `train` (fresh): at the first held call the environment actor is SIGKILLed, before any
   snapshot (the cadence is an hour): the run heals in its own process from step 0. At the
   first held call after that restore the controller is SIGKILLed: the run heals from step 0
   again (restore 2 of failover.max_restores) and finishes its --steps.
2. `train --restore` with grpo.prompts_per_step changed: refused in one line naming the key,
   nothing under the location changed.
3. `train --restore` with more steps and preemption.grace_s=0.001, SIGTERMed at the first
   held call: exit 0, one line saying what holds the run and naming the next command.
4. that command again, interrupted by Ctrl-C (SIGINT to its process group): exit 130 and one
   line naming the next command.
5. that command again, SIGTERMed as soon as its Ray is up (before the engines): exit 0, one
   line naming the next command.
6. that command again, to the end of the steps: exit 0.

Writes DIR/parity.json (per phase: the command, exit code, last line, the command it names,
what it was meant to show) and exits non-zero on any violation, each naming its property in
brackets.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pauses import Pauses, resume, session  # noqa: E402
from processes import mark_this_check, signal_own  # noqa: E402

from rollout_recovery import crashpoints  # noqa: E402

CLI = [str(REPO / ".venv" / "bin" / "python"), "-m", "rollout_recovery.cli"]
CONFIG = REPO / "configs" / "prefix_recovery.yaml"
NEXT = re.compile(r"`(train(?: --restore)?)`")


def settings(args, steps: int) -> list[str]:
    return [f"checkpointing.checkpoint_dir={args.run_dir}", f"grpo.steps={steps}",
            "grpo.prompts_per_step=1", "grpo.generations_per_prompt=2",
            "policy.generation.max_new_tokens=48",
            "rollout_checkpointing.snapshot_attempt_interval_s=3600",
            "failover.max_restores=4"]  # fmt: skip


def _as_in_a_terminal() -> None:
    """Ctrl-C's default, as a terminal's foreground job has it (in the child, before exec):
    a suite started in the background by a non-interactive shell inherits SIGINT ignored, and
    phase 4's Ctrl-C then never reached the run."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Phase:
    """One run of `train`, in its own session, held after every finished call."""

    def __init__(self, args, name: str, command: str, extra: list[str], steps: int) -> None:
        self.args, self.name = args, name
        self.pauses = Pauses(args.out / f"{name}.pauses.jsonl", "terminal_row_written")
        argv = [*CLI, *command.split(), "--config", str(CONFIG), *settings(args, steps), *extra]
        self.log = open(args.out / f"{name}.log", "w")  # noqa: SIM115 - for the child's life
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env=os.environ | self.pauses.env(),
                                     start_new_session=True,
                                     preexec_fn=_as_in_a_terminal)  # fmt: skip
        self.deadline = time.monotonic() + args.phase_timeout
        self.record = {"phase": name, "command": command, "extra": extra}

    def held(self) -> dict | None:
        return self.pauses.wait(self.proc, self.deadline)

    def resume(self, keep: set[int] | frozenset[int] = frozenset()) -> None:
        resume(self.proc.pid, keep)

    def finish(self) -> dict:
        """Resume every later pause until the run ends; its exit code, last line and the
        command that line names."""
        while self.held() is not None:
            self.resume()
        self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        self.log.close()
        lines = [ln for ln in (self.args.out / f"{self.name}.log").read_text(errors="replace")
                 .replace("\r", "\n").splitlines() if ln.strip()]  # fmt: skip
        said = [ln for ln in lines if NEXT.search(ln) or ln.startswith("rollout-recovery:")]
        last = said[-1] if said else (lines[-1] if lines else "")
        named = NEXT.search(last)
        return self.record | {"exit": self.proc.returncode, "last_line": last,
                              "names": named.group(1) if named else None}  # fmt: skip

    def stop(self) -> None:
        if self.proc.poll() is None:
            signal_own(session(self.proc.pid), signal.SIGKILL)
            self.proc.kill()
            self.proc.wait()


def steps_log(args) -> list[dict]:
    path = args.run_dir / "steps.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def events(args, name: str) -> list[dict]:
    return [r for r in steps_log(args) if r.get("event") == name]


def listing(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip


def two_deaths(args) -> dict:
    """Phase 1: the environment actor, then the controller, each killed at a held call
    before any snapshot; the run heals from step 0 both times and finishes."""
    ph = Phase(args, "1-two-deaths", "train", [], args.steps)
    killed = []
    try:
        for actor, before in (("RolloutEnvironment", 0), ("RolloutRecovery", 1)):
            while True:
                held = ph.held()
                if held is None:
                    break
                healed = len(events(args, "restored_in_process"))
                pid = (
                    crashpoints.actor_pid(ph.proc.pid, actor)
                    if actor == "RolloutEnvironment"
                    else crashpoints.controller_pid(args.run_dir)
                )  # not the standby's
                if (
                    healed == before
                    and pid is not None
                    and not list((args.run_dir / "data_plane").glob("snapshot-*/MANIFEST.json"))
                ):
                    os.kill(pid, signal.SIGKILL)
                    killed.append({"actor": actor, "pid": pid, "restores_before": healed})
                    ph.resume(keep={pid})
                    break
                ph.resume()
        out = ph.finish()
    finally:
        ph.stop()
    return out | {"killed": killed, "restores": events(args, "restored_in_process"),
                  "started_again": events(args, "started_again")}  # fmt: skip


def signalled(args, name: str, command: str, extra: list[str], sig: int, at: str) -> dict:
    """A phase that gets `sig` at the first held call (`at="call"`: to its process group, as
    a terminal's Ctrl-C, or to the driver for SIGTERM) or as soon as its Ray is up."""
    ph = Phase(args, name, command, extra, args.steps + 2)
    try:
        if at == "ray":
            while ph.proc.poll() is None and not any(
                b"gcs_server" in _cmdline(p) for p in session(ph.proc.pid)
            ):
                time.sleep(0.05)
            os.kill(ph.proc.pid, sig)
        else:
            held = ph.held()
            if held is not None:
                if sig == signal.SIGINT:
                    os.killpg(ph.proc.pid, sig)
                else:
                    os.kill(ph.proc.pid, sig)
                ph.resume()
        out = ph.finish()
    finally:
        ph.stop()
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def check(args) -> dict:
    phases, violations = [], []
    first = two_deaths(args)
    phases.append(first)
    if [k["actor"] for k in first["killed"]] != ["RolloutEnvironment", "RolloutRecovery"]:
        violations.append(f"[faults] not both deaths landed: {first['killed']}")
    if [r.get("step") for r in first["restores"]] != [0, 0] or not first["started_again"]:
        violations.append(f"[continuable] the two in-process restores did not both start from "
                          f"step 0: {first['restores']}, {first['started_again']}")  # fmt: skip
    if first["exit"] != 0:
        violations.append(f"[continuable] phase 1 exited {first['exit']}: {first['last_line']!r}")

    before = listing(args.run_dir)
    ph = Phase(args, "2-changed-settings", "train --restore", ["grpo.prompts_per_step=2"],
               args.steps + 2)  # fmt: skip
    refused = ph.finish()
    phases.append(refused)
    if refused["exit"] != 1 or "grpo.prompts_per_step" not in refused["last_line"]:
        violations.append(f"[settings] a changed grpo.prompts_per_step was not refused naming "
                          f"it: exit {refused['exit']}, {refused['last_line']!r}")  # fmt: skip
    if listing(args.run_dir) != before:
        violations.append("[settings] the refused restore changed the location")

    plan = [
        ("3-sigterm-no-grace", ["preemption.grace_s=0.001"], signal.SIGTERM, "call", 0),
        ("4-ctrl-c", [], signal.SIGINT, "call", 130),
        ("5-sigterm-at-start", [], signal.SIGTERM, "ray", 0),
    ]
    command = "train --restore"
    for name, extra, sig, at, code in plan:
        out = signalled(args, name, command, extra, sig, at)
        phases.append(out)
        if out["exit"] != code:
            violations.append(f"[{name}] exited {out['exit']} (expected {code}): "
                              f"{out['last_line']!r}")  # fmt: skip
        if out["names"] is None:
            violations.append(f"[{name}] its last line names no next command: "
                              f"{out['last_line']!r}")  # fmt: skip
            break
        command = out["names"]
    last = Phase(args, "6-to-the-end", command, [], args.steps + 2)
    try:
        end = last.finish()
    finally:
        last.stop()
    phases.append(end)
    done = [r.get("step") for r in steps_log(args) if "event" not in r]
    if end["exit"] != 0 or args.steps + 1 not in done:
        violations.append(f"[continuable] the last phase ({command}) exited {end['exit']} "
                          f"with steps {done}: {end['last_line']!r}")  # fmt: skip
    return {"run_dir": str(args.run_dir), "phases": phases, "violations": violations}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=2, help="grpo.steps of the first phase")
    ap.add_argument("--phase-timeout", type=float, default=600)
    args = ap.parse_args()
    mark_this_check()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.run_dir = args.out / "run"
    subprocess.run(["rm", "-rf", str(args.run_dir)], check=True)
    report = check(args)
    path = args.out / "parity.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"\ncontinuable check ({path})")
    for p in report["phases"]:
        print(f"  {p['phase']:<22} exit {p['exit']!s:>4}  names {p['names']!s:<16} "
              f"{p['last_line'][:110]}")  # fmt: skip
    if report["violations"]:
        print("FAIL:\n  " + "\n  ".join(report["violations"]))
        return 1
    print("continuable: 1 passed, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
