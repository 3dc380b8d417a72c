"""Time to recover: an actor of the job is SIGKILLed mid-step and `train` restores the run in
its own process (`TrainingRun.keep_running`); how long each part of the recovery took, as the
job grows.

    .venv/bin/python scripts/bench_recover.py --json bench_results/recover.json \\
        [--components store_shard,environment,controller] [--calls 2,8] [--max-tokens 384]

Per (component, calls in flight): a 2-step `train` run at prefix level with the token log
(configs/prefix_recovery.yaml; `--calls` episodes of one group per step), killed 1 s into step
2's generation, when the cadence has cut its calls. The parts, on one wall clock:

- `noticed`: from the SIGKILL to the trainer's `ComponentLost` (the `restored_in_process`
  event's `noticed_at`);
- `stopped`: the rest of the job stopped (`stopped_s`);
- `planned`: the restore chosen and verified from files, the location claimed (`plan_s`);
- `job started`: controller, store, workers and environment (`start_s`), of which the
  workers' engines (`workers.json` `startup_s`; 0 where the restore kept them: after a store
  shard's or the environment actor's death `start_s` is the job built again around the same
  engines, each reset to the model's own weights);
- `restored`: the store restored from the snapshot and the token log, the episodes taken back
  (`restore_s`);
- `first resumed token`: from the end of the restore to the first token an engine sampled for
  a resumed call (the call-attempt records' `first_token_at`).

`total` is the SIGKILL to that first token; `beyond engines` is `total` less the engines' start,
the restore's own overhead. `standby`: after the controller's death, whether the standby
controller (`failover.standby_controller`, started with step 2) took the job. Also reported:
the calls the restore resumed and the chosen snapshot's bytes as written (`checkpoints.jsonl`;
an incremental snapshot writes only what changed).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_common import Target, check_targets, write_result  # noqa: E402

from rollout_recovery.generation.engine_setup import CPU_ENGINE_ENV  # noqa: E402

os.environ.update(CPU_ENGINE_ENV)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from rollout_recovery import crashpoints  # noqa: E402

CONFIG = REPO / "configs" / "prefix_recovery.yaml"
ACTORS = {"store_shard": "StoreShard", "environment": "RolloutEnvironment",
          "controller": "RolloutRecovery"}  # fmt: skip
TARGETS = [Target("beyond_engines_s_max", "<=", 2.0,
                  "restore overhead beyond the engines' start (s, worst case)")]  # fmt: skip


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def measure(component: str, calls: int, max_tokens: int, out: Path) -> dict:
    """One killed run; its parts of the time to recover (see the module docstring)."""
    run_dir = out / f"{component}-{calls}"
    cmd = [sys.executable, "-m", "rollout_recovery.cli", "train", "--config", str(CONFIG),
           f"checkpointing.checkpoint_dir={run_dir}", "grpo.steps=2", "grpo.prompts_per_step=1",
           f"grpo.generations_per_prompt={calls}", f"policy.generation.max_new_tokens={max_tokens}",
           "rollout_checkpointing.snapshot_attempt_interval_s=0.3",
           "failover.max_restores=1"]  # fmt: skip
    log = open(out / f"{component}-{calls}.log", "w")  # noqa: SIM115 (open for the run)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    steps = run_dir / "steps.jsonl"
    try:
        while proc.poll() is None and not any("event" not in x for x in _lines(steps)):
            time.sleep(0.1)
        time.sleep(1.0)
        pid = (crashpoints.controller_pid(run_dir) if component == "controller"
               else crashpoints.actor_pid(proc.pid, ACTORS[component]))  # fmt: skip
        if pid is None or proc.poll() is not None:
            raise SystemExit(f"{component}-{calls}: no {ACTORS[component]} to kill; see {log.name}")
        ready = set(crashpoints.session_pids(proc.pid)) - {pid}  # a standby is among them
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=900)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    if proc.returncode != 0:
        raise SystemExit(f"{component}-{calls}: train exited {proc.returncode}; see {log.name}")
    [event] = [x for x in _lines(steps) if x.get("event") == "restored_in_process"]
    restore = [x for x in _lines(steps) if x.get("event") == "restore"][-1]
    kept = bool(event.get("engines_kept"))  # a store shard's or the environment's death
    engines = 0.0 if kept else json.loads((run_dir / "workers.json").read_text())["startup_s"]
    attempts = [r for f in sorted((run_dir / "call_attempts").glob("*.jsonl"))
                for r in _lines(f)]  # fmt: skip
    resumed = [r for r in attempts if r["resume"] == "resumed" and r["first_token_at"]
               and r["first_token_at"] >= event["opened_at"]]  # fmt: skip
    first = min((r["first_token_at"] for r in resumed), default=None)
    after = crashpoints.controller_pid(run_dir)
    row = {
        "component": component,
        "calls": calls,
        "engines_kept": kept,
        "standby": component == "controller" and after in ready,
        "noticed_s": event["noticed_at"] - killed_at,
        "stopped_s": event["stopped_s"],
        "planned_s": event["plan_s"],
        "job_started_s": event["start_s"],
        "engines_s": engines,
        "restored_s": event["restore_s"],
        "first_token_s": first - event["opened_at"] if first else None,
        "resumed_calls": len(resumed),
        "snapshot_bytes": next(
            x["snapshot_bytes"]
            for x in _lines(run_dir / "checkpoints.jsonl")
            if x["checkpoint"] == restore["snapshot"]
        ),
    }
    end = first or event["opened_at"]
    row["total_s"] = end - killed_at
    row["beyond_engines_s"] = row["total_s"] - engines
    return row


COLUMNS = [("component", "{}"), ("calls", "{}"), ("engines_kept", "{}"), ("standby", "{}"),
           ("resumed_calls", "{}"),
           ("snapshot_bytes", "{:,}"), ("noticed_s", "{:.2f}"), ("stopped_s", "{:.2f}"),
           ("planned_s", "{:.2f}"), ("job_started_s", "{:.1f}"), ("engines_s", "{:.1f}"),
           ("restored_s", "{:.2f}"), ("first_token_s", "{:.2f}"), ("total_s", "{:.1f}"),
           ("beyond_engines_s", "{:.1f}")]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--components", default="store_shard,environment,controller")
    ap.add_argument("--calls", default="2,8", help="calls in flight per run, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--out", type=Path, help="where the runs go (default: a temporary folder)")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-recover-"))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for component in args.components.split(","):
        for calls in map(int, args.calls.split(",")):
            t0 = time.monotonic()
            rows.append(measure(component, calls, args.max_tokens, out))
            print(f"[bench_recover] {component} x{calls}: {time.monotonic() - t0:.0f} s",
                  flush=True)  # fmt: skip
    print("\n| " + " | ".join(k for k, _ in COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for r in rows:
        cells = ["-" if r[k] is None else fmt.format(r[k]) for k, fmt in COLUMNS]
        print("| " + " | ".join(cells) + " |")
    summary = {"beyond_engines_s_max": max(r["beyond_engines_s"] for r in rows)}
    verdicts = check_targets(TARGETS, summary)
    for v in verdicts:
        print(f"{v['label']}: {v['measured']:.2f} (target {v['target']}): {v['verdict']}")
    if args.json:
        write_result(args.json, {"rows": rows, "summary": summary, "targets": verdicts,
                                 "max_tokens": args.max_tokens})  # fmt: skip


if __name__ == "__main__":
    main()
