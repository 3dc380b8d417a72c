"""Kill and restore a GRPO run on a two-node local Ray cluster, checkpoints on S3.

    .venv/bin/python functional_tests/two_node_recovery.py --out DIR [--cuts 3] [--steps 2]
        [--kill-step 1] [--max-tokens 128] [--reference DIR] [--fault NAME] [overrides...]

This process starts a local S3 server (moto, 127.0.0.1) and a `ray.cluster_utils.Cluster` of
two nodes (A, the head, and B; two CPUs each). Every run is `rollout-recovery train
--ray-address <the cluster>` of the same prefix-level job: two generation workers, two store
shards and two environment actors, each kind placed with `strategy=node_affinity` over
[A, B], so actor i runs on node i; checkpoint_dir on the S3 server.

1. reference: the job start to finish (or `--reference DIR`: an earlier reference of the
   same job shape on local disk, e.g. the `reference/` this check leaves in its --out);
2. kill: the job, in its own process group, polled until a published snapshot of trainer
   step >= --kill-step holds at least --cuts recoverable cuts (0 < prefix < limit; with
   --cuts >= 3, cut calls on both workers); then the driver (the `train` process group) is
   SIGKILLed. The job's actors are not in its process tree: Ray kills the actors of a dead
   driver itself, and the check waits until the cluster lists every actor of the job dead
   and their processes (the vLLM engines too) are gone, and reports how long that took;
3. restore: `train --restore` on the same cluster finishes the run (with `--fault NAME`,
   rollout_recovery/faults.py, deliberately broken: the check must then fail).

Checks; each violation starts with its property in brackets:
- [parity]: per step the same training batch as the reference (keys, token ids, loss masks,
  rewards), the same loss and reward, the same episode results, the final trainer checkpoint
  byte-identical; [logprobs]: generation logprobs within recovery_check's thresholds;
- [selected]: the restore chose the newest snapshot published when the killed job's actors
  were gone (what the check verified the evidence against);
- [resumed] / [decoded_tail]: every call cut in that snapshot was resumed by a worker with
  exactly length - prefix tokens decoded (the engines' own call-attempt records of the
  restore), at least one; [restore_refused]: no episode record refused; [restored_once]: every
  unfinished episode re-admitted once; [superseded_chunks]: no cut's chunk rows left;
- [placement]: in every run, the GenerationWorker, StoreShard and RolloutEnvironment actors
  ran on both nodes (the cluster's actor table: node id per actor, by job);
- [actors_gone] / [cleanup]: after the SIGKILL, Ray ended every actor of the killed job and
  no process of it (actors, engines) is left.

Writes DIR/parity.json, prints a table, exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import recovery_check as rc
from processes import alive_own, descendants, mark_this_check, signal_own

from rollout_recovery.testing.campaign import engine_evidence as evidence
from rollout_recovery.testing.campaign.crash_points import (
    restore_events,
    session_records,
    snapshot_keys,
    snapshot_name,
    trainer_checkpoint_digest,
)

REPO = rc.REPO
CONFIG = REPO / "configs" / "prefix_recovery.yaml"
# The actor classes placed by the `placement` block, by the config block that places them.
CLASSES = {"workers": "GenerationWorker", "store": "StoreShard",
           "environment": "RolloutEnvironment"}  # fmt: skip
NODES = ("A", "B")


def start_cluster() -> tuple[object, dict[str, str]]:
    """A local two-node Ray cluster (head A, node B; each with a custom resource naming it),
    joined by this process; returns it and the node ids by label."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"node_a": 1}, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=2, resources={"node_b": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    ids = {}
    for node in ray.nodes():
        for label in NODES:
            if node["Alive"] and node["Resources"].get(f"node_{label.lower()}"):
                ids[label] = node["NodeID"]
    if set(ids) != set(NODES):
        sys.exit(f"FAIL: the cluster did not come up with two nodes: {ray.nodes()}")
    return cluster, ids


def overrides(args, run_dir: str) -> list[str]:
    nodes = json.dumps([args.nodes[label] for label in NODES])  # quoted: YAML strings
    placed = []
    for block in CLASSES:
        placed += [f"placement.{block}.strategy=node_affinity",
                   f"placement.{block}.node_ids={nodes}"]  # fmt: skip
    return [
        f"checkpointing.checkpoint_dir={run_dir}",
        "vllm_cfg.num_workers=2",
        "placement.store.shards=2",
        "placement.environment.actors=2",
        *placed,
        f"grpo.steps={args.steps}",
        f"grpo.prompts_per_step={args.prompts}",
        "grpo.generations_per_prompt=4",
        f"policy.generation.max_new_tokens={args.max_tokens}",
        f"rollout_checkpointing.snapshot_attempt_interval_s={args.interval}",
        "rollout_checkpointing.keep_latest_k=4",
        *args.extra,
    ]


def train_cmd(args, run_dir: str, restore: bool = False) -> list[str]:
    return [*rc.CLI, *(["--restore"] if restore else []), "--ray-address", args.address,
            "--config", str(CONFIG), *overrides(args, run_dir)]  # fmt: skip


def run_to_end(args, cmd: list[str], name: str, run_dir: str, env: dict | None = None) -> dict:
    """Run a phase to completion (its log beside the report); its pid and wall time."""
    t0 = time.monotonic()
    log = args.out / f"{name}.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        code = rc.wait_phase(proc, 2 * args.timeout, f"the {name} run", run_dir, log)
    if code != 0:
        sys.exit(f"FAIL: the {name} run exited {code}; {rc.run_state(run_dir, log, 0)}")
    return {"pid": proc.pid, "wall_s": time.monotonic() - t0}


# --- the cluster's actor table -------------------------------------------------------------


def job_of(pid: int) -> str | None:
    """The Ray job whose driver is process `pid` (the newest, should the pid recur)."""
    import ray._private.state as state

    jobs = [j for j in state.jobs() if j.get("DriverPid") == pid]
    return max(jobs, key=lambda j: j.get("StartTime", 0))["JobID"] if jobs else None


def actors_of(job: str) -> list[dict]:
    """Every actor of `job` the cluster knows, dead ones included (the GCS keeps them): class,
    name, state, node id, pid. (ray.util.state would need the dashboard, which this cluster
    runs without.)"""
    import ray._private.state as state

    return [
        {"class": a["ActorClassName"], "name": a.get("Name") or "", "state": a["State"],
         "node": a["Address"]["NodeID"], "pid": a.get("Pid")}
        for a in state.actors().values() if a["JobID"] == job
    ]  # fmt: skip


def placement_of(args, job: str | None) -> dict:
    """Per placed actor class: how many actors the job started and the nodes they ran on."""
    actors = actors_of(job) if job else []
    out = {}
    for cls in CLASSES.values():
        mine = [a for a in actors if a["class"] == cls]
        nodes = sorted({a["node"] for a in mine if a["node"]})
        out[cls] = {"actors": len(mine), "nodes": nodes,
                    "labels": sorted(label_of(args, n) for n in nodes)}  # fmt: skip
    return out


def label_of(args, node: str) -> str:
    return next((label for label, nid in args.nodes.items() if nid == node), node[:12])


def placement_violations(phase: str, placement: dict) -> list[str]:
    out = []
    for cls, p in placement.items():
        if sorted(p["labels"]) != list(NODES):
            out.append(f"[placement] {phase}: the {p['actors']} {cls} actors ran on "
                       f"{p['labels'] or 'no node'}, not on both nodes {list(NODES)}")  # fmt: skip
    return out


# --- the kill --------------------------------------------------------------------------------


def phase_workers(run_dir: str, started_ns: int) -> list[dict] | None:
    """The workers this phase's controller wrote to workers.json (None before it did)."""
    from rollout_recovery.storage import RunStorage

    try:
        body = json.loads(RunStorage(run_dir).read_bytes("workers.json"))
    except (OSError, ValueError):
        return None
    if int(body["session"].split("-")[1]) < started_ns:  # a previous phase's
        return None
    return body["workers"]


def kill_phase(args, run_dir: str) -> dict:
    """Run the job until a published snapshot of trainer step >= --kill-step holds --cuts
    recoverable cuts; SIGKILL its driver's process group; wait until Ray has ended the job's
    actors and their processes are gone."""
    from rollout_recovery.data_plane.snapshot_io import published_uris

    started_ns = time.time_ns()
    t0 = time.monotonic()
    log = open(args.out / "killed.log", "w")  # noqa: SIM115 - open for the child's lifetime
    proc = subprocess.Popen(train_cmd(args, run_dir), stdout=log, stderr=subprocess.STDOUT,
                            cwd=REPO, start_new_session=True)  # fmt: skip
    root = rc.child(run_dir, "data_plane")
    deadline = time.monotonic() + args.timeout
    ready, workers = None, None
    try:
        while ready is None:
            if proc.poll() is not None:
                raise rc.NoKillChance(
                    f"the killed run finished before {args.cuts} recoverable cuts of step >= "
                    f"{args.kill_step} were published"
                )
            if time.monotonic() > deadline:
                sys.exit(f"FAIL: the killed run published no snapshot with {args.cuts} cuts of "
                         f"step >= {args.kill_step} in {args.timeout:g} s; "
                         f"{rc.run_state(run_dir, args.out / 'killed.log', 0)}")  # fmt: skip
            workers = workers or phase_workers(run_dir, started_ns)
            try:
                uris = published_uris(root)
                n, ledger = rc.recoverable(args, uris[-1]) if uris else (0, {})
            except Exception:  # a listing or ledger read racing a publish: try again
                n, ledger = 0, {}
            if n >= args.cuts and ledger["step"] >= args.kill_step:
                ready = {"snapshot": uris[-1], "recoverable_cuts": n, "step": ledger["step"]}
            else:
                time.sleep(0.1)
        job = job_of(proc.pid)
        tree = descendants(proc.pid)
        killed_at, killed_wall = time.monotonic(), time.time()
        os.killpg(proc.pid, signal.SIGKILL)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:
        proc.wait()
        log.close()
    ready["after_snapshot_s"] = killed_wall - rc.snapshot_time(ready["snapshot"])
    # Ray notices the driver is gone and ends its actors: the controller, and with it (their
    # owner) the workers, store shards and environment actors.
    live = actors_of(job) if job else []
    while any(a["state"] != "DEAD" for a in live) and time.monotonic() - killed_at < 120:
        time.sleep(0.1)
        live = actors_of(job)
    gone_s = time.monotonic() - killed_at
    left_actors = [f"{a['class']} {a['name']}".strip() for a in live if a["state"] != "DEAD"]
    pids = {a["pid"] for a in live if a["pid"]} | tree
    for w in workers or phase_workers(run_dir, started_ns) or []:
        pids |= {w["pid"], *w["engine_pids"]}
    while any(alive_own(p) for p in pids) and time.monotonic() - killed_at < 120:
        time.sleep(0.1)
    left = sorted(p for p in pids if alive_own(p))
    signal_own(left, signal.SIGKILL)  # reported below; not left running
    return ready | {
        "job": job,
        "run_s": killed_at - t0,
        "actors": len(live),
        "actors_gone_s": None if left_actors else round(gone_s, 3),
        "actors_left": left_actors,
        "processes_gone_s": None if left else round(time.monotonic() - killed_at, 3),
        "processes_left": left,
        "processes_watched": len(pids),
    }


def restorable(args, run_dir: str) -> dict:
    """What a restore picks now: the newest published snapshot, with its ledger and the
    finished episodes' keys (read before the restore's retention may delete it)."""
    from rollout_recovery.data_plane.snapshot_io import published_uris

    uri = published_uris(rc.child(run_dir, "data_plane"))[-1]
    n, ledger = rc.recoverable(args, uri)
    return {"snapshot": uri, "recoverable_cuts": n, "step": ledger["step"], "ledger": ledger,
            "finished_keys": sorted(snapshot_keys(uri, "replay"))}  # fmt: skip


# --- parity ----------------------------------------------------------------------------------


def compare_steps(args, ref_dir: str, rec_dir: str) -> tuple[list[dict], dict, list[str]]:
    ref, rec = rc.steps(ref_dir), rc.steps(rec_dir)
    rows, details, out = [], {}, []
    for step in sorted(ref):
        a, b = ref[step], rec.get(step)
        if b is None:
            out.append(f"[parity] step {step} missing after the restore")
            continue
        d = rc.compare_batches(rc.batch(ref_dir, step), rc.batch(rec_dir, step))
        details[step] = d
        exact = ("same_keys", "same_token_ids", "same_loss_mask", "same_rewards")
        same = a["batch_digest"] == b["batch_digest"] and all(d[k] for k in exact)
        loss_diff = abs(a["loss"] - b["loss"])
        rows.append({"step": step, "same_batch": same, "loss_abs_diff": loss_diff,
                     "same_reward": a["mean_reward"] == b["mean_reward"],
                     "restored_calls": b.get("restored_calls", 0),
                     "restored_prefix_tokens": b.get("restored_prefix_tokens", 0),
                     "generated_tokens": b.get("generated_tokens", 0),
                     "logprobs_bit_identical": d["logprobs_bit_identical"]})  # fmt: skip
        if not same:
            out.append(f"[parity] step {step}: training batch differs ({d})")
        if loss_diff != 0.0:
            out.append(f"[parity] step {step}: loss differs by {loss_diff:.3g}")
        if a["mean_reward"] != b["mean_reward"]:
            out.append(f"[parity] step {step}: mean reward {b['mean_reward']} != "
                       f"{a['mean_reward']}")  # fmt: skip
        out += [f"[parity] {v}" for v in rc.compare_results(ref_dir, rec_dir, step, 1)]
    out += evidence.check_logprobs(details, args.min_identical_logprobs, args.max_logprob_diff)
    final = max(ref)
    a, b = trainer_checkpoint_digest(ref_dir, final), trainer_checkpoint_digest(rec_dir, final)
    if a != b:
        out.append(f"[parity] the final trainer checkpoint (step {final}) differs from the "
                   f"reference's: {b} != {a}")  # fmt: skip
    return rows, details, out


def check_restore(args, restored: dict, rec_dir: str, restore_job: str | None) -> tuple:
    """The engines' evidence of the restore against the snapshot it restored; the cut calls
    resumed, per node of the worker that resumed them."""
    from rollout_recovery.storage import RunStorage

    out = []
    selected = [e["snapshot"] for e in restore_events(rec_dir)]
    if [snapshot_name(u) for u in selected] != [snapshot_name(restored["snapshot"])]:
        out.append(f"[selected] the restore selected {selected}, the newest published snapshot "
                   f"after the kill was {restored['snapshot']}")  # fmt: skip
    token_log = rc.token_log_restores(rec_dir)
    if token_log:
        restored["token_log"] = rc.with_token_log(restored["ledger"], token_log[0])
    after = session_records(rec_dir)[-1]
    redone = rc.steps(rec_dir).get(restored["ledger"]["step"] + 1, {})
    counts = {c: redone.get(c, 0) for c in rc.RESTORE_COUNTERS}
    counts |= {c: v for c, v in redone.items() if c.startswith("restore_refused.")}
    found = rc.check_restored_once(args, restored, rec_dir, counts, after)
    out += [v if v.startswith("[") else f"[restored_once] {v}" for v in found]
    cut = {(e["rollout_id"], e["continuation"]["call_id"], e["continuation"]["attempt"])
           for e in restored["ledger"].get("episodes", [])
           if (e.get("continuation") or {}).get("keys")}  # fmt: skip
    # Which node each resumed call ran on: worker index -> actor name (workers.json) -> node.
    workers = json.loads(RunStorage(rec_dir).read_bytes("workers.json"))["workers"]
    node_of = {a["name"]: a["node"] for a in (actors_of(restore_job) if restore_job else [])}
    by_index = {w["index"]: label_of(args, node_of.get(w["actor_name"], "?")) for w in workers}
    resumed: dict[str, int] = {}
    for r in after:
        if r["resume"] == "resumed" and any(
            (r["rollout_id"], r["model_call_id"]) == c[:2] and r["attempt"] > c[2] for c in cut
        ):
            node = by_index.get(r["worker"], "?")
            resumed[node] = resumed.get(node, 0) + 1
    if not sum(resumed.values()):
        out.append(f"[resumed] no call was resumed from a prefix ({len(cut)} cut in the "
                   "restored snapshot)")  # fmt: skip
    lingering = {k for c in restored["ledger"]["continuations"].values()
                 for k in c.get("keys", [])} & rc.final_staging_keys(rec_dir)  # fmt: skip
    if lingering:
        out.append(f"[superseded_chunks] {len(lingering)} chunk keys of the restored cuts "
                   "remain in the last snapshot")  # fmt: skip
    return selected, counts, resumed, out


def report(args, result: dict, rows: list[dict]) -> None:
    fault = f"; deliberate fault: {args.fault}" if args.fault else ""
    print(f"\ntwo-node prefix-level recovery parity ({args.out / 'parity.json'}; checkpoints "
          f"on S3{fault})")  # fmt: skip
    for label, nid in result["nodes"].items():
        print(f"node {label}: {nid}")
    k, r = result["kill"], result["restored"]
    print(f"kill: SIGKILL of the driver at trainer step {k['step']}, {k['recoverable_cuts']} "
          f"recoverable cuts published {k['after_snapshot_s']:.2f} s before; Ray ended the "
          f"job's {k['actors']} actors in {k['actors_gone_s']} s, their "
          f"{k['processes_watched']} processes gone in {k['processes_gone_s']} s")  # fmt: skip
    print(f"restored {r['snapshot']} (step {r['step']}, {r['recoverable_cuts']} "
          f"recoverable cuts); calls resumed by node: {result['resumed_by_node']}")  # fmt: skip
    print(f"{'phase':<10} " + " ".join(f"{c:>20}" for c in CLASSES.values()))
    for phase, placed in result["placement"].items():
        cells = [f"{p['actors']} on {','.join(p['labels']) or '-'}" for p in placed.values()]
        print(f"{phase:<10} " + " ".join(f"{c:>20}" for c in cells))
    print(
        f"{'step':>4} {'same batch':>11} {'|loss diff|':>12} {'same reward':>12} "
        f"{'lp identical':>13} {'restored calls':>15} {'prefix tok':>11} {'generated':>10}"
    )
    for s in rows:
        print(f"{s['step']:>4} {s['same_batch']!s:>11} {s['loss_abs_diff']:>12.3g} "
              f"{s['same_reward']!s:>12} {s['logprobs_bit_identical']:>13.1%} "
              f"{s['restored_calls']:>15} {s['restored_prefix_tokens']:>11} "
              f"{s['generated_tokens']:>10}")  # fmt: skip
    t = result["timings_s"]
    print("timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in t.items() if v is not None))


def public(uri: str) -> str:
    """`uri` without the test server's credentials (`s3://key:secret@bucket/...`)."""
    scheme, sep, rest = uri.partition("://")
    return f"{scheme}{sep}{rest.split('@', 1)[-1]}" if sep else uri


def check(args, pattern: str) -> int:
    t0 = time.monotonic()
    timings: dict[str, float | None] = {"reference": None}
    placement, violations = {}, []
    if args.reference:
        ref_dir = str(args.reference.resolve())
    else:
        ref_uri = pattern.format(name="reference")
        ref = run_to_end(args, train_cmd(args, ref_uri), "reference", ref_uri)
        timings["reference"] = ref["wall_s"]
        placement["reference"] = placement_of(args, job_of(ref["pid"]))
        ref_dir = str(args.out / "reference")  # kept on local disk for --reference
        rc.copy_run(pattern.format(name="reference"), ref_dir)
    rec_dir = pattern.format(name="recovered")
    try:
        killed = kill_phase(args, rec_dir)
    except rc.NoKillChance as err:
        # A timing precondition, not a recovery failure: the run ended its steps before a
        # snapshot qualified (slow snapshots on a loaded machine). Once, in a fresh location.
        print(f"{err}; running the kill phase again in a fresh location", flush=True)
        args.kill_retries += 1
        rec_dir = rc.retry_dir(rec_dir)
        killed = kill_phase(args, rec_dir)
    timings["killed_run"] = killed["run_s"]
    timings["actors_gone"] = killed["actors_gone_s"]
    placement["killed"] = placement_of(args, killed["job"])
    if killed["actors_left"]:
        violations.append(f"[actors_gone] 120 s after the driver's SIGKILL the cluster still "
                          f"lists live actors of its job: {killed['actors_left']}")  # fmt: skip
    if killed["processes_left"]:
        violations.append(f"[cleanup] processes of the killed run left 120 s after its SIGKILL "
                          f"(killed by the check): {killed['processes_left']}")  # fmt: skip
    restored = restorable(args, rec_dir)
    cmd = train_cmd(args, rec_dir, restore=True)
    done = run_to_end(args, cmd, "restore", rec_dir, env=rc.fault_env(args))
    timings["restore"] = done["wall_s"]
    restore_job = job_of(done["pid"])
    placement["restore"] = placement_of(args, restore_job)
    for phase, placed in placement.items():
        violations += placement_violations(phase, placed)
    rows, details, found = compare_steps(args, ref_dir, rec_dir)
    violations += found
    selected, counts, resumed, found = check_restore(args, restored, rec_dir, restore_job)
    violations += found
    rc.copy_run(rec_dir, str(args.out / "recovered"))  # kept for a look after the check
    timings["total"] = time.monotonic() - t0
    result = {
        "level": "prefix",
        "storage": "s3",
        "checkpoint_dir": public(rec_dir),
        "reference_dir": public(ref_dir),
        "fault": args.fault,
        "cuts": args.cuts,
        "nodes": args.nodes,
        "kill_retries": args.kill_retries,
        "kill": killed | {"snapshot": snapshot_name(killed["snapshot"])},
        "restored": {k: v for k, v in restored.items() if k != "ledger"}
        | {"snapshot": snapshot_name(restored["snapshot"])},
        "selected": [snapshot_name(u) for u in selected],
        "placement": placement,
        "restore_counts": counts,
        "resumed_by_node": resumed,
        "resumed_calls": sum(resumed.values()),
        "steps": rows,
        "batches": details,
        "timings_s": timings,
        "violations": violations,
    }
    (args.out / "parity.json").write_text(json.dumps(result, indent=2))
    report(args, result, rows)
    if violations:
        print("FAIL:\n  " + "\n  ".join(violations))
        return 1
    print("two_node_recovery: 1 passed, 0 failed")
    return 0


def main() -> int:
    import ray

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cuts", type=int, default=3,
                    help="recoverable cuts in a published snapshot before the kill (>= 3: on "
                         "both workers)")  # fmt: skip
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--kill-step", type=int, default=1,
                    help="the lowest trainer step the kill may land in (1: a trainer "
                         "checkpoint and pushed weights are restored)")  # fmt: skip
    ap.add_argument("--prompts", type=int, default=1, help="GRPO groups of 4 per step")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--interval", type=float, default=0.4, help="snapshot cadence (s)")
    ap.add_argument("--timeout", type=float, default=900, help="kill condition bound (s)")
    ap.add_argument("--min-identical-logprobs", type=float, default=rc.MIN_IDENTICAL_LOGPROBS)
    ap.add_argument("--max-logprob-diff", type=float, default=rc.MAX_LOGPROB_DIFF)
    ap.add_argument(
        "--reference",
        type=Path,
        help="an earlier reference run of the same job shape (local directory)",
    )
    ap.add_argument("--fault", choices=["resume_disabled"],
                    help="break the restore on purpose (rollout_recovery/faults.py): the check "
                         "must then fail")  # fmt: skip
    ap.add_argument("extra", nargs="*", help="more config overrides for every run")
    args = ap.parse_args()
    mark_this_check()  # before the cluster starts: its processes carry it (processes.py)
    if args.kill_step >= args.steps:
        sys.exit(f"FAIL: --kill-step {args.kill_step} needs --steps > {args.kill_step}")
    args.level, args.kill_retries = "prefix", 0  # what recovery_check's helpers read
    args.out.mkdir(parents=True, exist_ok=True)
    for d in ("reference", "recovered"):
        if not (args.reference and (args.out / d).resolve() == args.reference.resolve()):
            subprocess.run(["rm", "-rf", str(args.out / d)], check=True)
    server, pattern = rc.start_s3()
    cluster = None
    try:
        cluster, args.nodes = start_cluster()
        args.address = cluster.address
        return check(args, pattern)
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
