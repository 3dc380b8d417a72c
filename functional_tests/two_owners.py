"""Two owners of one run: a stale trainer that wakes up after a newer one restored its run must
stop without writing a byte there, and the run goes on from the newer one's history.

    .venv/bin/python functional_tests/two_owners.py --out DIR [--steps S] [--fault NAME]
        [--train PATH] [--config FILE] [config overrides...]

1. A: a fresh run of the own loop (examples/own_loop/train.py; --train another script with
   the arguments of `rollout-recovery train`) in its own process group with its own Ray. Its
   controller holds the whole job right after each snapshot of a trainer step in [1, S) it
   publishes (the crash point `snapshot_taken` armed to pause, pauses.py); the first such
   snapshot that holds --cuts cut calls (0 < prefix < limit) while A has not yet leased that
   step's batch is where A stays frozen (every process of it SIGSTOPped), the others are
   resumed. A cannot pass a snapshot the check has not judged; an A that finishes without a
   qualifying one runs once more in a fresh location (`retries` in the report). The report's
   `frozen` names the pause (`held_at`) and every snapshot judged on the way (`judged`).
2. B: `--restore` on the same checkpoint_dir, to the end of grpo.steps=S. It claims the run
   (a newer owner epoch) and must publish at least one snapshot.
3. Every file and directory under checkpoint_dir is recorded (sha256 of each file); A is thawed
   (SIGCONT) and must exit non-zero within --fence-timeout s with exactly one line on stderr,
   saying it no longer owns the run and naming B's claim; then nothing under checkpoint_dir
   may have changed, appeared or disappeared, and none of A's processes may be left.
4. C (unless --no-successor): `--restore` with grpo.steps=S+1 continues B's history: its
   restore selects B's newest snapshot, the step log gets step S+1 after B's lines, and every
   trainer checkpoint of a step <= S it keeps is the bytes B left.

Writes DIR/parity.json: per actor (A before the freeze, B, A after the thaw, C) what it wrote
(files by kind, log lines, snapshots, ownership entries), its claim and when it was fenced,
and a `violations` list; prints the table and exits non-zero on any violation, each naming its
property in brackets. `--fault NAME[,NAME]` arms those faults (rollout_recovery/faults.py) in
every run: with `fencing_disabled` the check must fail (A writes over B's files).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
PYTHON = str(REPO / ".venv" / "bin" / "python")
OWN_LOOP = REPO / "examples" / "own_loop" / "train.py"

from pauses import Pauses, resume, session  # noqa: E402
from processes import (  # noqa: E402
    MARK_ENV,
    descendants,
    mark_this_check,
    pids_marked,
    signal_own,
)

LOGS = ("steps.jsonl", "checkpoints.jsonl", "restores.jsonl")
FENCED = ("no longer owns", "a newer controller owns it")
DIR = "dir"  # a directory's entry in a listing (files have their sha256)
ACTOR_ENV = "TWO_OWNERS_ACTOR"  # which actor a process belongs to (A, B, B-again, C, ...)


class CheckFailed(RuntimeError):
    """The check could not run to its verdict (a run hung, or gave it no chance to freeze)."""


class NoFreezeChance(CheckFailed):
    """A finished before a snapshot it could be frozen after was published (a timing
    precondition on a loaded machine, not a fencing failure)."""


# ---------------------------------------------------------------------- running the actors


def overrides(args, steps: int) -> list[str]:
    return [
        f"checkpointing.checkpoint_dir={args.run_dir}",
        f"grpo.steps={steps}",
        "grpo.prompts_per_step=1",
        "grpo.generations_per_prompt=4",
        f"policy.generation.max_new_tokens={args.max_tokens}",
        f"rollout_checkpointing.snapshot_attempt_interval_s={args.interval}",
        "rollout_checkpointing.keep_latest_k=4",
        # The workers append token log segments under the run: a stale owner's must not.
        "token_capture.log_interval_tokens=8",
        *args.extra,
    ]


def start(
    args, name: str, steps: int, restore: bool, pauses: Pauses | None = None
) -> subprocess.Popen:
    """An actor: the training script in its own session (its own process group and Ray),
    stdout and stderr kept apart under --out (stderr is part of the verdict); `pauses` arms
    its holds after snapshots (A's)."""
    cmd = [PYTHON, str(args.train), *(["--restore"] if restore else []),
           "--config", str(args.config), *overrides(args, steps)]  # fmt: skip
    env = os.environ | {ACTOR_ENV: name} | (pauses.env() if pauses else {})
    env |= {"ROLLOUT_RECOVERY_FAULTS": args.fault} if args.fault else {}
    with open(args.out / f"{name}.out", "w") as out, open(args.out / f"{name}.err", "w") as err:
        return subprocess.Popen(cmd, stdout=out, stderr=err, cwd=REPO, env=env,
                                start_new_session=True)  # fmt: skip


def finish(args, proc: subprocess.Popen, name: str) -> float:
    """Wait for an actor to end (at most --phase-timeout s); returns how long it ran."""
    t0 = time.monotonic()
    try:
        proc.wait(timeout=args.phase_timeout)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"{name} stuck: not finished after {args.phase_timeout:g} s; its last "
                          f"output: {last_line(args, name)!r}") from None  # fmt: skip
    return time.monotonic() - t0


RAY_STARTUP = "The current node timed out during startup"  # ray/_private/node.py, fixed 30 s


def restore_to_end(
    args, name: str, steps: int, started: list[subprocess.Popen]
) -> tuple[subprocess.Popen, float, int]:
    """B or C: `--restore` to the end of `steps`; returns it, how long it ran, and whether it
    ran twice. One whose own Ray failed to start (its raylet not registered within Ray's fixed
    30 s, seen with five checks starting on two cores) runs once more: it had claimed the run
    and stopped, and a restore takes over from a stopped owner like from any other. Its first
    stderr is kept as NAME.err.ray-startup."""

    def once() -> tuple[subprocess.Popen, float]:
        proc = start(args, name, steps, restore=True)
        started.append(proc)
        return proc, finish(args, proc, name)

    proc, ran = once()
    err = args.out / f"{name}.err"
    if proc.returncode == 0 or RAY_STARTUP not in err.read_text(errors="replace"):
        return proc, ran, 0
    err.rename(args.out / f"{name}.err.ray-startup")
    signal_own(actor_pids(name), signal.SIGKILL)  # what its half-started Ray left
    left_behind(name, 30)
    return (*once(), 1)


def last_line(args, name: str) -> str:
    lines = []
    for ext in ("err", "out"):
        path = args.out / f"{name}.{ext}"
        if path.exists():
            lines += [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][-300:] if lines else ""


def stop(proc: subprocess.Popen, tree: set[int]) -> None:
    """SIGKILL an actor this check started (frozen or not) with every process under it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    signal_own(tree | descendants(proc.pid), signal.SIGKILL)
    proc.kill()
    proc.wait()


def held_point(args, held: dict) -> dict | None:
    """The snapshot A is held after (pauses.py): name, step and the calls it holds cut
    mid-generation (0 < prefix < limit); None when it is not the newest published."""
    from rollout_recovery.controller.selection import DATA_PLANE
    from rollout_recovery.data_plane import StagingStore
    from rollout_recovery.data_plane.snapshot_io import published_uris
    from rollout_recovery.storage import RunStorage

    uris = published_uris(RunStorage(str(args.run_dir)).child_uri(DATA_PLANE))
    if not uris or snapshot_name(uris[-1]) != held["facts"]["snapshot"]:
        return None
    ledger = json.loads(StagingStore.read_sidecar(uris[-1], "ledger.json"))
    cut = [c["tokens"] for c in ledger["continuations"].values()
           if 0 < c.get("tokens", 0) < args.max_tokens]  # fmt: skip
    return {"snapshot": snapshot_name(uris[-1]), "step": ledger["step"], "cut_calls": cut}


def freeze_mid_generation(args, proc: subprocess.Popen, pauses: Pauses) -> tuple[dict, set[int]]:
    """A holds itself right after each snapshot of a step in [1, --steps) it publishes
    (pauses.py). It stays frozen at the first that holds --cuts cut calls while A still
    generates that step (it has not leased the step's batch: its batch file, or the temporary
    file of its write, is absent); every other pause is resumed. A cannot pass a snapshot
    this check has not judged, so load never decides whether the freeze comes."""
    deadline = time.monotonic() + args.phase_timeout
    late, judged = [], []
    while True:
        try:
            held = pauses.wait(proc, deadline)
        except TimeoutError:
            raise CheckFailed(f"A: no snapshot of step >= 1 with {args.cuts} cut calls within "
                              f"{args.phase_timeout:g} s") from None  # fmt: skip
        if held is None:
            raise NoFreezeChance(f"A exited {proc.returncode} before a snapshot of step >= 1 "
                                 f"with {args.cuts} cut calls was published while it still "
                                 f"generated (judged: {judged[-4:]}): "
                                 f"{last_line(args, 'A')!r}")  # fmt: skip
        point = held_point(args, held)
        leased = bool(point) and bool(
            list(args.run_dir.glob(f"batches/step-{point['step'] + 1:06d}.arrow*"))
        )
        judged.append({"snapshot": held["facts"]["snapshot"],
                       "cut_calls": len(point["cut_calls"]) if point else None,
                       "leased": leased})  # fmt: skip
        if point and len(point["cut_calls"]) >= args.cuts and not leased:
            tree = session(proc.pid) | descendants(proc.pid)
            return point | {"too_late_before": late, "held_at": held, "judged": judged}, tree
        if leased:
            late.append(point["snapshot"])
        resume(proc.pid)


def actor_pids(name: str) -> list[int]:
    """Every live process of actor `name` (its environment names it, and it carries this
    check's mark): found even after its parent exited and it left the process tree."""
    tag = f"{ACTOR_ENV}={name}".encode()
    out = []
    for pid in pids_marked(os.environ[MARK_ENV]):
        with contextlib.suppress(OSError):
            if tag in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                out.append(pid)
    return sorted(out)


def left_behind(name: str, timeout: float) -> list[int]:
    """Actor `name`'s processes still alive after up to `timeout` s."""
    deadline = time.monotonic() + timeout
    while (left := actor_pids(name)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


# ---------------------------------------------------------------------- reading the location


def listing(run_dir: Path) -> dict[str, str]:
    """Every file (its sha256) and directory under `run_dir`, by relative path."""
    out = {}
    for base, dirs, files in os.walk(run_dir):
        rel = Path(base).relative_to(run_dir)
        for d in dirs:
            out[str(rel / d)] = DIR
        for f in files:
            out[str(rel / f)] = hashlib.sha256((Path(base) / f).read_bytes()).hexdigest()
    return out


def kind(path: str) -> str:
    parts = path.split("/")
    if parts[0] == "data_plane" and len(parts) > 1:
        return "ownership" if parts[1] == "ownership" else "snapshots"
    return parts[0] if len(parts) > 1 or parts[0] in LOGS else "other"


def entries(run_dir: Path, paths: list[str]) -> dict[str, dict]:
    """The ownership entries among `paths`, by path: slot, kind, epoch, snapshot, claiming
    pid. Read when the state is taken: a later owner's retention prunes the log."""
    out = {}
    for rel in sorted(p for p in paths if kind(p) == "ownership" and p.endswith(".json")):
        try:
            body = json.loads((run_dir / rel).read_text())["body"]
        except (OSError, ValueError, KeyError) as err:
            out[rel] = {"entry": rel, "unreadable": str(err)}
            continue
        out[rel] = {"slot": body["slot"], "kind": body["kind"], "epoch": body["epoch"],
                    "snapshot": body.get("snapshot"), "pid": body["owner"]["pid"]}  # fmt: skip
    return out


class State:
    """The location at one moment: the listing, and the logs' text (append-only checks)."""

    def __init__(self, run_dir: Path | None) -> None:
        """The location now (None: before anything was written)."""
        self.run_dir = run_dir
        self.files = listing(run_dir) if run_dir is not None and run_dir.exists() else {}
        self.logs = {n: "" for n in LOGS}
        self.entries: dict[str, dict] = {}
        if run_dir is not None:
            for n in LOGS:
                if (run_dir / n).exists():
                    self.logs[n] = (run_dir / n).read_text()
            self.entries = entries(run_dir, list(self.files))

    def publications(self) -> list[dict]:
        """Publish entries, oldest first."""
        return [e for e in self.entries.values() if e.get("kind") == "publish"]


def wrote(before: State, after: State) -> dict:
    """What happened under the location between two states, by kind: files added and changed
    (snapshots by name), files and directories removed, lines appended to each log, ownership
    entries added."""
    a, b = before.files, after.files
    added = sorted(p for p in b if p not in a and b[p] != DIR)
    changed = sorted(p for p in b if p in a and a[p] != b[p] and p not in LOGS)
    removed = sorted(p for p in a if p not in b)
    new_dirs = sorted(p for p in b if p not in a and b[p] == DIR)
    by_kind: dict[str, list[str]] = {}
    for p in [*added, *changed]:
        k = kind(p)
        if k in LOGS or k == "ownership":
            continue
        item = p.split("/")[1] if k == "snapshots" else p
        if item not in by_kind.setdefault(k, []):
            by_kind[k].append(item)
    lines = {}
    for name in LOGS:
        old, new = before.logs[name], after.logs[name]
        if new != old:
            lines[name] = {"appended": len(new.splitlines()) - len(old.splitlines()),
                           "rewritten": not new.startswith(old)}  # fmt: skip
    ownership = [after.entries[p] for p in added if p in after.entries]
    out = {"files": by_kind, "logs": lines, "ownership": ownership,
           "changed": changed, "removed": removed, "directories_added": new_dirs}  # fmt: skip
    out["touched"] = len(added) + len(changed) + len(removed) + len(new_dirs) + len(lines)
    return out


def snapshot_name(uri: str) -> str:
    return uri.split("?")[0].rstrip("/").rsplit("/", 1)[-1]


def step_lines(text: str) -> list[dict]:
    return [json.loads(ln) for ln in text.splitlines() if ln.strip()]


def claim_of(actor: dict) -> dict | None:
    claims = [e for e in actor["wrote"]["ownership"] if e.get("kind") == "claim"]
    return claims[-1] if claims else None


# ---------------------------------------------------------------------- the check


def check(args) -> dict:
    """Run A, B, A again and C; returns the report (violations listed, not raised)."""
    t0 = time.monotonic()
    started: list[subprocess.Popen] = []
    tree: set[int] = set()  # A's processes
    try:
        pauses = Pauses(args.out / "A.pauses.jsonl", "snapshot_taken",
                        f"step>=1,step<{args.steps}")  # fmt: skip
        a = start(args, "A", args.steps, restore=False, pauses=pauses)
        started.append(a)
        point, tree = freeze_mid_generation(args, a, pauses)
        frozen, frozen_at = State(args.run_dir), time.monotonic() - t0
        err_at_freeze = (args.out / "A.err").stat().st_size  # A writes nothing while frozen
        # In the middle of generating: the step's batch is not leased yet.
        batch = f"batches/step-{point['step'] + 1:06d}.arrow"
        actors = [{"actor": "A before the freeze", "exit": None, "ran_s": frozen_at,
                   "frozen": point | {"at_s": frozen_at, "processes": len(tree) + 1,
                                      "mid_generation": not any(p.startswith(batch)
                                                                for p in frozen.files)},
                   "wrote": wrote(State(None), frozen)}]  # fmt: skip

        b, b_s, b_again = restore_to_end(args, "B", args.steps, started)
        after_b = State(args.run_dir)
        actors.append({"actor": "B", "exit": b.returncode, "ran_s": b_s, "ray_retries": b_again,
                       "wrote": wrote(frozen, after_b)})  # fmt: skip

        signal_own(tree, signal.SIGCONT, pgid=a.pid)
        thawed = time.monotonic()
        try:
            a.wait(timeout=args.fence_timeout)
            stopped: float | None = time.monotonic() - thawed
        except subprocess.TimeoutExpired:
            stopped = None
        left = left_behind("A", 60) if stopped is not None else sorted(tree)
        if stopped is None or left:
            stop(a, tree)
        with open(args.out / "A.err", "rb") as fh:
            fh.seek(err_at_freeze)
            lines = [ln for ln in fh.read().decode(errors="replace").splitlines() if ln.strip()]
        after_a = State(args.run_dir)
        actors.append({"actor": "A after the thaw", "exit": a.returncode,
                       "fenced": {"thawed_at_s": thawed - t0, "exited_after_s": stopped,
                                  "stderr": lines, "processes_left": left},
                       "wrote": wrote(after_b, after_a)})  # fmt: skip

        after_c = None
        if not args.no_successor:
            c, c_s, c_again = restore_to_end(args, "C", args.steps + 1, started)
            after_c = State(args.run_dir)
            actors.append({"actor": "C", "exit": c.returncode, "ran_s": c_s,
                           "ray_retries": c_again, "wrote": wrote(after_a, after_c)})  # fmt: skip
    finally:
        for proc in started:
            if proc.poll() is None:
                stop(proc, tree if proc is started[0] else set())
    states = {"frozen": frozen, "after_b": after_b, "after_a": after_a}
    states |= {"after_c": after_c} if after_c is not None else {}
    violations = verdict(args, actors, states)
    return {"steps": args.steps, "fault": args.fault, "train": str(args.train),
            "config": str(args.config), "checkpoint_dir": str(args.run_dir),
            "total_s": time.monotonic() - t0, "retries": args.retries, "actors": actors,
            "violations": violations}  # fmt: skip


def verdict(args, actors: list[dict], states: dict[str, State]) -> list[str]:
    """Each violation names its property: [fencing] (the stale owner stopped, said so in one
    line and wrote nothing), [claim] (B and C took the run over and published), [history]
    (C continued B's run; not checked with --no-successor), [logs] (the logs only ever grew)."""
    a0, b, a1, *successor = actors
    out = []
    restorers = [(b, "B"), *((c, "C") for c in successor)]
    claims = {x["actor"]: claim_of(x) for x in (a0, b, *successor)}
    claims.setdefault("C", None)
    for x in (a0, b, *successor):
        x["claim"] = claims[x["actor"]]
    # Who took the run over from whom (the claim that fences the one before).
    a0["superseded_by"] = a1["superseded_by"] = claims["B"]
    b["superseded_by"] = claims["C"]
    for c in successor:
        c["superseded_by"] = None
    if not a0["frozen"]["mid_generation"]:
        out.append("[precondition] A had leased the batch of the step it was frozen in")
    for x, name in restorers:
        if x["exit"] != 0:
            out.append(f"[claim] {name} exited {x['exit']}: {last_line(args, name)!r}")
    if claims["B"] is None or claims["A before the freeze"] is None:
        out.append(f"[claim] a claim is missing: A {claims['A before the freeze']}, "
                   f"B {claims['B']}")  # fmt: skip
    elif claims["B"]["epoch"] <= claims["A before the freeze"]["epoch"]:
        out.append(f"[claim] B's epoch {claims['B']['epoch']} does not outrank A's")
    b_epoch = claims["B"]["epoch"] if claims["B"] else None
    b_pubs = [e for e in b["wrote"]["ownership"] if e.get("kind") == "publish"]
    if not b_pubs or any(e["epoch"] != b_epoch for e in b_pubs):
        out.append(f"[claim] B published {len(b_pubs)} snapshots under its epoch: {b_pubs}")

    # A after the thaw: stopped, one line naming B's claim, nothing written.
    fenced = a1["fenced"]
    if fenced["exited_after_s"] is None:
        out.append(f"[fencing] A still running {args.fence_timeout:g} s after the thaw (killed)")
    elif a1["exit"] == 0:
        out.append("[fencing] A exited 0 after the thaw: it went on as the run's owner")
    if fenced["processes_left"]:
        out.append(f"[fencing] A's processes left after it exited: {fenced['processes_left']}")
    lines = fenced["stderr"]
    names = f"epoch {b_epoch} " if b_epoch is not None else "?"
    b_pid = f"pid {claims['B']['pid']}" if claims["B"] else "?"
    if len(lines) != 1 or not all(s in lines[0] for s in (*FENCED, names, b_pid)):
        shown = [ln[:300] for ln in lines[:5]] + ["..."] * (len(lines) > 5)
        out.append(f"[fencing] A's stderr after the thaw is not one line saying it no "
                   f"longer owns the run and naming B's claim ({names.strip()}, {b_pid}): "
                   f"{shown}")  # fmt: skip
    w = a1["wrote"]
    for what in ("changed", "removed", "directories_added"):
        if w[what]:
            out.append(f"[fencing] A after the thaw: {len(w[what])} {what.replace('_', ' ')}: "
                       f"{w[what][:8]}")  # fmt: skip
    added = [p for k, ps in w["files"].items() for p in ps if p not in w["changed"]]
    if added or w["ownership"]:
        new = added + w["ownership"]
        out.append(f"[fencing] A after the thaw wrote {len(added)} new files and "
                   f"{len(w['ownership'])} ownership entries: {new[:8]}")  # fmt: skip
    if w["logs"]:
        out.append(f"[fencing] A after the thaw appended to the logs: {w['logs']}")

    if successor:
        out += history(args, b, b_epoch, states)
    # Every log only grew, from the first state to the last.
    order = list(states.values())
    for old, new_state in itertools.pairwise(order):
        for name in LOGS:
            if not new_state.logs[name].startswith(old.logs[name]):
                out.append(f"[logs] {name} was rewritten, not appended to")
    return out


def history(args, b: dict, b_epoch: int | None, states: dict[str, State]) -> list[str]:
    """[history]: C restored B's newest snapshot and went on from B's steps and checkpoints."""
    out = []
    after_b, after_c = states["after_b"], states["after_c"]
    b_newest = [e["snapshot"] for e in after_b.publications() if e["epoch"] == b_epoch][-1:]
    restores = [r for r in step_lines(after_c.logs["steps.jsonl"]) if r.get("event") == "restore"]
    chose = snapshot_name(restores[-1]["snapshot"]) if restores else None
    if not b_newest or chose != b_newest[0]:
        out.append(f"[history] C restored {chose}, B's newest snapshot is {b_newest}")
    new = after_c.logs["steps.jsonl"][len(states["after_a"].logs["steps.jsonl"]) :]
    c_steps = [r.get("step") for r in step_lines(new) if "event" not in r]
    if c_steps != [args.steps + 1]:
        out.append(f"[history] C logged steps {c_steps}, expected [{args.steps + 1}]")
    b_steps = [r.get("step") for r in step_lines(after_b.logs["steps.jsonl"]) if "event" not in r]
    if not b_steps or b_steps[-1] != args.steps:
        out.append(f"[history] B's step log ends at step {b_steps[-1:]}, not {args.steps}")
    kept = {p: h for p, h in after_c.files.items() if p.startswith("trainer/step-") and h != DIR
            and int(p.split("/")[1][5:]) <= args.steps}  # fmt: skip
    differ = sorted(p for p, h in kept.items() if after_b.files.get(p) != h)
    if differ:
        out.append(f"[history] trainer checkpoint files C kept differ from B's: {differ}")
    newest = f"trainer/step-{args.steps:06d}/meta.json"
    if newest not in kept or newest not in b["wrote"]["files"].get("trainer", []):
        out.append(f"[history] {newest} (B's last checkpoint) is not kept as B wrote it")
    return out


# ---------------------------------------------------------------------- the report


def print_report(report: dict, path: Path) -> None:
    fault = f"; deliberate fault: {report['fault']}" if report["fault"] else ""
    print(f"\ntwo-owner check ({path}; grpo.steps={report['steps']}{fault})")
    print(f"{'actor':<18} {'exit':>5} {'claim':>6} {'trainer':>8} {'batches':>8} {'snapshots':>10} "
          f"{'steps+':>7} {'ckpts+':>7} {'token_log':>10} {'ownership':>10} {'changed':>8} "
          f"{'removed':>8}")  # fmt: skip
    for x in report["actors"]:
        w = x["wrote"]
        files = w["files"]
        claim = x.get("claim")
        print(f"{x['actor']:<18} {x['exit']!s:>5} {claim['epoch'] if claim else '-':>6} "
              f"{len(files.get('trainer', [])):>8} {len(files.get('batches', [])):>8} "
              f"{len(files.get('snapshots', [])):>10} "
              f"{w['logs'].get('steps.jsonl', {}).get('appended', 0):>7} "
              f"{w['logs'].get('checkpoints.jsonl', {}).get('appended', 0):>7} "
              f"{len(files.get('token_log', [])):>10} {len(w['ownership']):>10} "
              f"{len(w['changed']):>8} {len(w['removed']):>8}")  # fmt: skip
    a1 = report["actors"][2]["fenced"]
    after = "did not stop" if a1["exited_after_s"] is None else f"{a1['exited_after_s']:.1f} s"
    print(f"A after the thaw: stopped after {after}; stderr: "
          f"{[ln[:200] for ln in a1['stderr'][:3]]}")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=3, help="grpo.steps of A and B (C: one more)")
    ap.add_argument("--max-tokens", type=int, default=128, help="per call")
    ap.add_argument("--interval", type=float, default=0.4, help="snapshot cadence, s")
    ap.add_argument("--cuts", type=int, default=1, help="cut calls in A's frozen snapshot")
    ap.add_argument("--train", type=Path, default=OWN_LOOP, help="the training script")
    ap.add_argument("--config", type=Path, help="default: the config.yaml beside --train")
    ap.add_argument("--fault", help="NAME[,NAME]: faults armed in every run (faults.py)")
    ap.add_argument("--phase-timeout", type=float, default=600, help="s each run may take")
    ap.add_argument("--fence-timeout", type=float, default=120,
                    help="s A may take to stop after the thaw")  # fmt: skip
    ap.add_argument("--no-successor", action="store_true",
                    help="stop after the thaw: no C (no [history] checks)")  # fmt: skip
    ap.add_argument("extra", nargs="*", help="more config overrides for every run")
    args = ap.parse_args()
    if args.steps < 2:
        sys.exit("FAIL: --steps must be >= 2 (A is frozen in step >= 1 with a step left to B)")
    if args.fault:
        from rollout_recovery import faults

        unknown = set(args.fault.split(",")) - set(faults.FAULTS)
        if unknown:
            sys.exit(f"FAIL: unknown faults {sorted(unknown)}; known: {faults.FAULTS}")
    mark_this_check()  # every run carries it: signals reach only those (processes.py)
    args.train = args.train.resolve()
    args.config = (args.config or args.train.parent / "config.yaml").resolve()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.retries = 0
    for name in ("run", "run-retry"):
        subprocess.run(["rm", "-rf", str(args.out / name)], check=True)
    args.run_dir = args.out / "run"
    try:
        try:
            report = check(args)
        except NoFreezeChance as err:  # once, in a fresh location
            print(f"{err}; running A again in a fresh location", flush=True)
            args.run_dir, args.retries = args.out / "run-retry", 1
            report = check(args)
    except CheckFailed as err:
        sys.exit(f"FAIL: {err}")
    path = args.out / "parity.json"
    path.write_text(json.dumps(report, indent=2))
    print_report(report, path)
    if report["violations"]:
        print("FAIL:\n  " + "\n  ".join(report["violations"]))
        return 1
    print("two_owners: 1 passed, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
