"""Worker failover check: one worker dies in the middle of generation, the run goes on.

Runs, on one Ray instance this process starts (the runs join it with --ray-address):

1. reference: a GRPO run with two workers, uninterrupted;
2. one run per `--kill`: the same job; once the target worker holds at least --min-calls calls
   in flight, each with more than twice the token log interval decoded, its engine is frozen
   (SIGSTOP: no token is decoded from here on), its engine records are read once they stop
   changing (what each call attempt decoded: the engine core runs ahead of the worker's
   output processing, whose backlog drains first; when that finished the calls, the engine is
   thawed and the next step tried), and then
   - `engine`: two workers; worker 1's engine core process is SIGKILLed during step 1 (the
     actor lives on, its engine is dead): its calls move to worker 0 at once;
   - `actor`: one worker; during step 2 (after a weight push) the worker actor is `ray.kill`ed
     (the frozen engine it leaves is then SIGKILLed: a stopped process cannot notice its
     parent is gone): its calls wait for the replacement, which must be on the pushed weights
     for the batch to match.

Each killed run must finish by itself (exit 0, no restore, one process), and:
- [parity] every step's training batch equals the reference's (token ids, masks, rewards,
  lengths; generation logprobs bit-identical for at least --min-identical-logprobs);
- [migrated] every call the dead worker held was answered by a next attempt on another
  worker, resumed (verdict `resumed`) from its token log, with at most K tokens decoded again
  (K = --token-log-tokens: the dead attempt's prefix + decoded tokens minus the prefix the next
  attempt resumed from);
- [replaced] the run counted the worker failure by cause; in the one-worker run a
  replacement joined (the run could not have finished otherwise).

Writes DIR/failover.json (the table) and prints it. Exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import recovery_check as rc
from processes import mark_this_check, signal_own

REPO = rc.REPO
CONFIG = REPO / "configs" / "prefix_recovery.yaml"


# kind -> (workers, the worker killed, the lowest trainer step the kill lands in)
RUNS = {"engine": (2, 1, 0), "actor": (1, 0, 1)}


def overrides(args, run_dir: Path, workers: int = 2) -> list[str]:
    return [
        f"checkpointing.checkpoint_dir={run_dir}",
        f"vllm_cfg.num_workers={workers}",
        f"grpo.steps={args.steps}",
        f"grpo.prompts_per_step={args.prompts}",
        "grpo.generations_per_prompt=4",
        f"policy.generation.max_new_tokens={args.max_tokens}",
        f"token_capture.log_interval_tokens={args.token_log_tokens}",
        f"token_capture.control_auth_token={args.token}",
        "failover.health_interval_s=0.5",
        *args.extra,
    ]


def train(
    args, run_dir: Path, log: Path, workers: int = 2, env: dict | None = None
) -> subprocess.Popen:
    cmd = [*rc.CLI, "--ray-address", args.address, "--config", str(CONFIG),
           *overrides(args, run_dir, workers)]  # fmt: skip
    with open(log, "w") as out:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)


def workers_file(run_dir: Path, started_after: float) -> list[dict] | None:
    path = run_dir / "workers.json"
    if not path.exists() or path.stat().st_mtime < started_after:
        return None
    try:
        return json.loads(path.read_text())["workers"]
    except (ValueError, KeyError):
        return None


def drained(target: dict, args) -> list[dict]:
    """The frozen engine's worker records once they stop changing: outputs the engine core
    had already sent are processed (it runs ahead of the worker's output processing), and
    token log passes they started are done."""
    last, stable_since = None, time.monotonic()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        records = rc.read_engine_records([target], args.token)
        now = [(r["rollout_id"], r["decoded_tokens"], r["finished"]) for r in records]
        if now != last:
            last, stable_since = now, time.monotonic()
        elif time.monotonic() - stable_since >= args.settle:
            return records
        time.sleep(0.05)
    return records


def in_flight(records: list[dict]) -> list[dict]:
    return [r for r in records if not r["finished"]]


def kill_run(args, kind: str) -> dict:
    """A run in which worker 1 dies (`kind`) mid-generation; what was killed and when."""
    import ray

    run_dir = args.out / kind
    n_workers, index, min_step = RUNS[kind]
    t0 = time.time()
    log = args.out / f"{kind}.log"
    proc = train(args, run_dir, log, n_workers, rc.fault_env(args))
    deadline = time.monotonic() + args.timeout
    target, before = None, None
    while before is None:
        if proc.poll() is not None:
            sys.exit(f"FAIL: the {kind} run finished before worker {index} held "
                     f"{args.min_calls} calls with > {2 * args.token_log_tokens} tokens in step "
                     f">= {min_step}")  # fmt: skip
        if time.monotonic() > deadline:
            rc.stop_run(proc)
            sys.exit(f"FAIL: the {kind} run never reached the kill condition in "
                     f"{args.timeout:g} s; {rc.run_state(str(run_dir), log, 0)}")  # fmt: skip
        workers = workers_file(run_dir, t0)
        done = len(rc.steps(str(run_dir))) if (run_dir / "steps.jsonl").exists() else 0
        if workers is not None and len(workers) == n_workers and done >= min_step:
            target = workers[index]
            try:
                records = rc.read_engine_records([target], args.token)
            except Exception:
                records = []
            floor = 2 * args.token_log_tokens
            busy = [r for r in in_flight(records)
                    if r["prefix_tokens"] + r["decoded_tokens"] > floor]  # fmt: skip
            if len(busy) >= args.min_calls:
                signal_own(target["engine_pids"], signal.SIGSTOP)
                frozen = in_flight(drained(target, args))
                if len(frozen) >= args.min_calls:
                    before = frozen
                    break
                # The engine core had run ahead of the worker's output processing: the calls
                # finished from outputs already sent. Thaw it and wait for the next chance.
                signal_own(target["engine_pids"], signal.SIGCONT)
        time.sleep(0.05)
    killed_at = time.time()
    if kind == "engine":
        signal_own(target["engine_pids"], signal.SIGKILL)
    else:
        ray.kill(ray.get_actor(target["actor_name"], namespace="rollout_recovery"))
        time.sleep(0.5)
        signal_own(target["engine_pids"], signal.SIGKILL)  # stopped: it cannot see its parent die
    code = rc.wait_phase(proc, args.timeout, f"the {kind} run after its worker's kill",
                         str(run_dir), log)  # fmt: skip
    return {"kind": kind, "exit_code": code, "killed_at": killed_at, "in_flight": before,
            "dir": str(run_dir)}  # fmt: skip


def session_records(run_dir: Path) -> list[dict]:
    out = []
    for path in sorted((run_dir / "call_attempts").glob("*.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines() if line]
    return out


def verify(args, ref_dir: Path, killed: dict) -> tuple[dict, list[str]]:
    """The killed run against the reference; the row of the table and the violations."""
    run_dir = Path(killed["dir"])
    problems = []
    if killed["exit_code"] != 0:
        problems.append(f"[finished] the run exited {killed['exit_code']}")
        return {"kind": killed["kind"]}, problems
    ref_steps, rec_steps = rc.steps(str(ref_dir)), rc.steps(str(run_dir))
    same, identical = True, []
    for step in sorted(ref_steps):
        cmp = rc.compare_batches(rc.batch(str(ref_dir), step), rc.batch(str(run_dir), step))
        ok = all(cmp[k] for k in ("same_keys", "same_token_ids", "same_loss_mask",
                                  "same_rewards"))  # fmt: skip
        identical.append(cmp["logprobs_bit_identical"])
        if not ok:
            same = False
            problems.append(f"[parity] step {step}: batch differs from the reference ({cmp})")
        if cmp["logprobs_bit_identical"] < args.min_identical_logprobs:
            problems.append(f"[parity] step {step}: {cmp['logprobs_bit_identical']:.1%} of "
                            "generation logprobs bit-identical")  # fmt: skip
    counts: dict[str, float] = {}
    for rec in rec_steps.values():
        for k, v in rec.items():
            if isinstance(v, int | float) and ("migration" in k or "worker" in k):
                counts[k] = counts.get(k, 0) + v
    records = session_records(run_dir)
    by_attempt = {(r["rollout_id"], r["model_call_id"], r["attempt"]): r for r in records}
    redecoded, resumed, worst = [], 0, 0
    for dead in killed["in_flight"]:
        nxt = by_attempt.get((dead["rollout_id"], dead["model_call_id"], dead["attempt"] + 1))
        name = f"{dead['rollout_id']}/{dead['model_call_id']}/a{dead['attempt']}"
        if nxt is None:
            problems.append(f"[migrated] {name}: no next attempt in the engine records")
            continue
        if nxt["worker"] == dead["worker"] and not counts.get("workers_replaced"):
            problems.append(f"[migrated] {name}: the next attempt ran on the dead worker's slot")
        if nxt["resume"] != "resumed":
            why = nxt.get("refused_reason")
            problems.append(f"[migrated] {name}: next attempt {nxt['resume']} ({why}), not "
                            "resumed from its token log")  # fmt: skip
            continue
        resumed += 1
        lost = dead["prefix_tokens"] + dead["decoded_tokens"] - nxt["prefix_tokens"]
        redecoded.append(lost)
        worst = max(worst, lost)
        if lost < 0 or lost > args.token_log_tokens:
            problems.append(f"[migrated] {name}: {lost} tokens decoded again (K = "
                            f"{args.token_log_tokens})")  # fmt: skip
    cause = "engine_dead" if killed["kind"] == "engine" else "actor_dead"
    migrations = sum(v for k, v in counts.items() if k.startswith("migrations."))
    if migrations < len(killed["in_flight"]):
        problems.append(f"[migrated] {migrations} migrations counted for "
                        f"{len(killed['in_flight'])} calls in flight")  # fmt: skip
    if not counts.get(f"worker_failures.{cause}"):
        problems.append(f"[replaced] no worker failure counted as {cause}: {counts}")
    if RUNS[killed["kind"]][0] == 1 and not counts.get("workers_replaced"):
        problems.append("[replaced] no replacement worker joined")
    row = {
        "kind": killed["kind"],
        "same_batches": same,
        "logprobs_bit_identical_min": min(identical) if identical else 0.0,
        "calls_on_dead_worker": len(killed["in_flight"]),
        "resumed_from_token_log": resumed,
        "redecoded_tokens_total": sum(redecoded),
        "redecoded_tokens_max": worst,
        "token_log_tokens_k": args.token_log_tokens,
        "migrations": {k: v for k, v in counts.items() if k.startswith("migrations.")},
        "expected_cause": cause,
        "workers_replaced": counts.get("workers_replaced", 0),
    }
    return row, problems


def main() -> int:
    import ray

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kill", choices=["engine", "actor", "both"], default="both")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4, help="GRPO groups of 4 per step")
    ap.add_argument("--max-tokens", type=int, default=320,
                    help="per call: long enough to outlast the engine core running ahead of "
                    "the worker's output processing")  # fmt: skip
    ap.add_argument("--token-log-tokens", type=int, default=16, help="K")
    ap.add_argument("--min-calls", type=int, default=4)
    ap.add_argument("--settle", type=float, default=0.5)
    ap.add_argument("--timeout", type=float, default=900, help="per-run bound (s)")
    ap.add_argument("--min-identical-logprobs", type=float, default=rc.MIN_IDENTICAL_LOGPROBS)
    ap.add_argument("--reference", type=Path, help="an earlier reference run to compare with")
    ap.add_argument("--fault", help="a deliberate fault (rollout_recovery/faults.py) in the "
                    "killed runs: the check must then fail")  # fmt: skip
    ap.add_argument("extra", nargs="*", help="more config overrides for every run")
    args = ap.parse_args()
    mark_this_check()  # the runs it starts carry it: signals reach only those (processes.py)
    args.out.mkdir(parents=True, exist_ok=True)
    args.token = os.urandom(12).hex()
    # A private instance: another check's Ray on this machine must not be joined by accident
    # ("Found multiple active Ray instances").
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    args.address = ray.get_runtime_context().gcs_address
    ref_dir = args.reference or args.out / "reference"
    if args.reference is None:
        log = args.out / "reference.log"
        ref = train(args, ref_dir, log)
        if rc.wait_phase(ref, 2 * args.timeout, "the reference run", str(ref_dir), log) != 0:
            sys.exit(f"FAIL: the reference run exited {ref.returncode}; "
                     f"{rc.run_state(str(ref_dir), log, 0)}")  # fmt: skip
    kinds = ["engine", "actor"] if args.kill == "both" else [args.kill]
    rows, problems = [], []
    for kind in kinds:
        row, bad = verify(args, ref_dir, kill_run(args, kind))
        rows.append(row)
        problems += [f"{kind}: {p}" for p in bad]
    (args.out / "failover.json").write_text(json.dumps({"runs": rows, "problems": problems},
                                                       indent=1))  # fmt: skip
    cols = ("kind", "same_batches", "logprobs_bit_identical_min", "calls_on_dead_worker",
            "resumed_from_token_log", "redecoded_tokens_max", "redecoded_tokens_total",
            "workers_replaced")  # fmt: skip
    print(f"worker failover parity ({args.out}/failover.json; K = {args.token_log_tokens})")
    print("  ".join(cols))
    for row in rows:
        print("  ".join(str(row.get(c)) for c in cols))
    for p in problems:
        print(f"FAIL {p}")
    print(f"worker_failover: {len(rows) - len({p.split(':')[0] for p in problems})} passed, "
          f"{len({p.split(':')[0] for p in problems})} failed")  # fmt: skip
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
