"""Asynchronous GRPO killed and restored, checked by invariants (docs/async_grpo.md).

    functional_tests/async_recovery.sh --out DIR [--level prefix|turn|none] [--kills 2]
        [--steps 6] [--journal on|off] [--cuts 2] [--seed N] [overrides...]

An asynchronous run cannot be compared token for token with an uninterrupted one (when a push
lands decides which weights sample which token), so the run is checked by what must hold
however the pushes fell:

1. `rollout-recovery train` with `grpo.async_grpo.enabled`, killed --kills times with SIGKILL
   (each at a random moment after a published snapshot of a later trainer step holding --cuts
   cut calls, as recovery_check.py kills: engines frozen and read first), restored each time
   (`--restore`), to the end. Every trainer checkpoint is kept (the weights of each version).
2. The invariants, each violation naming its property in brackets:
   - [prompts] every dispatched prompt is trained exactly once, or open at the end, and a
     group attempt > 0 of a prompt was counted as dropped;
   - [age] no trained group is older than `max_trajectory_age_steps`;
   - [prefix] every call a restore continued from its cut was resumed by its worker from
     exactly that prefix (the engines' own records), and where it was trained, its trained
     tokens and their weight versions at the prefix are the staged chunk rows' bit for bit;
   - [logprobs] every trained token's behaviour logprob is what its recorded weight version
     computes for it: vLLM scores each trained sequence with each version's weights (from the
     trainer checkpoints), bit-identical share and largest difference per version;
   - [committed] no rollout a snapshot had finished is decoded again after its restore;
   - [level] at levels turn and none (`--level`; the kill then waits for a snapshot holding
     --cuts calls in flight) no call resumes from a prefix: each is generated again;
   - [restore] each restore selected the snapshot its kill chose.
3. Per kill, the work lost: tokens the engines decoded before the crash and decoded again
   after the restore, from their records.

Writes DIR/parity.json and exits non-zero on any violation. `--journal off` runs without the
continuous token log (token_capture.log_interval_tokens unset), `on` with a row every 8 tokens.
`--fault NAME` arms a fault in every phase after the first (rollout_recovery/faults.py).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import secrets
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import recovery_check as rc  # noqa: E402
from processes import mark_this_check  # noqa: E402

from rollout_recovery.testing.campaign import engine_evidence as evidence  # noqa: E402
from rollout_recovery.testing.campaign.crash_points import (  # noqa: E402
    batch,
    restore_events,
    snapshot_name,
)

PROMPTS_PER_STEP = 2  # recovery_check.overrides


def async_overrides(args) -> list[str]:
    out = [
        "grpo.async_grpo.enabled=true",
        f"rollout_recovery.target_level={args.level}",
        f"grpo.async_grpo.max_trajectory_age_steps={args.max_age}",
        # Every trainer checkpoint stays: each version's weights score its tokens.
        "rollout_checkpointing.keep_latest_k=1000",
    ]
    if args.journal == "on":
        out.append("token_capture.log_interval_tokens=8")
    return out


def in_flight(args, snapshot_uri: str) -> tuple[int, dict]:
    """The kill's condition at levels turn and none: episodes in flight in the snapshot (a
    single-turn call has no committed turn to count, and no cut)."""
    from rollout_recovery.data_plane import StagingStore

    ledger = json.loads(StagingStore.read_sidecar(snapshot_uri, "ledger.json"))
    return len(ledger.get("episodes", [])), ledger


def run_phases(args) -> tuple[str, list[dict]]:
    """The killed phases and the last one; returns the run's location and the kills."""
    run_dir = str(args.out / "run")
    kills: list[dict] = []
    min_step = 1
    for k in range(1, args.kills + 1):
        try:
            killed = rc.kill_phase(args, run_dir, k, min_step)
        except rc.NoKillChance as err:
            if k > 1 or args.phase1_retries:
                sys.exit(f"FAIL: {err}")
            print(f"{err}; running phase 1 again in a fresh location", flush=True)
            args.phase1_retries += 1
            run_dir = rc.retry_dir(run_dir)
            killed = rc.kill_phase(args, run_dir, k, min_step)
        kills.append(killed)
        min_step = killed["step"] + 1
    cmd = [
        *rc.train_command(args),
        "--restore",
        "--config",
        rc.config(args),
        *rc.overrides(args, run_dir),
    ]
    env = os.environ | {"ROLLOUT_RECOVERY_FAULTS": args.fault} if args.fault else None
    rc.run(args, cmd, args.out / f"phase{args.kills + 1}.log", "the last phase", run_dir, env)
    return run_dir, kills


def final_steps(run_dir: str) -> dict[int, dict]:
    """Each step's last record (a restore redoes the step it restored into)."""
    return rc.steps(run_dir)


def prompt_of(group: str) -> tuple[int, int]:
    """(prompt, attempt) of a trained group."""
    from rollout_recovery.protocol import parse_group_id

    parsed = parse_group_id(group)
    if parsed is None:
        raise ValueError(f"{group} is not a driver group id")
    return parsed[0] * PROMPTS_PER_STEP + parsed[1], parsed[2]


def check_prompts(run_dir: str, steps: dict[int, dict], cursor: dict) -> list[str]:
    out = []
    trained = [g for s in sorted(steps) for g in steps[s].get("groups", [])]
    prompts = [prompt_of(g) for g in trained]
    seen: dict[int, str] = {}
    for (p, _), g in zip(prompts, trained, strict=True):
        if p in seen:
            out.append(f"[prompts] prompt {p} was trained twice: as {seen[p]} and {g}")
        seen[p] = g
    open_ = {o["prompt"] for o in cursor["open"]}
    missing = sorted(set(range(cursor["next"])) - set(seen) - open_)
    if missing:
        out.append(f"[prompts] prompts {missing[:8]} were dispatched but neither trained nor open")
    if len(seen) != cursor["trained"]:
        out.append(
            f"[prompts] the cursor counts {cursor['trained']} trained, the steps {len(seen)}"
        )
    retries = sum(a for _, a in prompts) + sum(o["attempt"] for o in cursor["open"])
    if retries > cursor["dropped_stale"]:
        out.append(
            f"[prompts] {retries} attempts after a first one, {cursor['dropped_stale']} "
            "drops counted"
        )
    return out


def check_age(run_dir: str, steps: dict[int, dict], max_age: int) -> tuple[list[str], dict]:
    from rollout_recovery.data_plane import table_to_replay_rows

    out, ages = [], {}
    for s, rec in sorted(steps.items()):
        rows = table_to_replay_rows(batch(run_dir, s))
        trained_on = rec["weight_version"] - 1  # pushed after the step
        by_group: dict[str, int] = defaultdict(lambda: 1 << 30)
        for r in rows:
            by_group[r.group_id] = min(by_group[r.group_id], r.weight_version_min)
            if not r.weight_versions:
                out.append(f"[age] step {s}: row {r.key} carries no weight versions")
        ages[s] = {g: trained_on - v for g, v in by_group.items()}
        for g, age in ages[s].items():
            if age > max_age:
                out.append(f"[age] step {s} trained {g} at age {age} > {max_age}")
    return out, ages


def trained_rows(run_dir: str, steps: dict[int, dict]) -> dict[str, object]:
    from rollout_recovery.data_plane import table_to_replay_rows

    return {r.rollout_id: r for s in steps for r in table_to_replay_rows(batch(run_dir, s))}


def staged_rows(snapshot: str) -> dict:
    """The snapshot's own staged chunk rows, by key."""
    from rollout_recovery.data_plane import StagingStore
    from rollout_recovery.data_plane.filesystem import resolve
    from rollout_recovery.data_plane.schemas import table_to_chunk_rows
    from rollout_recovery.data_plane.snapshot_io import read_partitions

    fs, path = resolve(snapshot)
    files = [
        f for f in StagingStore.manifest(snapshot).body.files if f.partition.endswith("staging")
    ]
    tables = [t.select([c for c in t.column_names if not c.startswith("_")])
              for t in read_partitions(fs, path, files).values()]  # fmt: skip
    return {r.key: r for t in tables for r in table_to_chunk_rows(t)}


def staged_prefix(run_dir: str, snapshot: str, ident, keys: list[str]):
    """A continuation's chunk rows, from the snapshot's own files and, for the rows a restore
    took from the token log, its segments: (ids, spans), or None when one is missing."""
    import numpy as np

    from rollout_recovery.controller.restore import TOKEN_LOG_DIR
    from rollout_recovery.data_plane.spans import merged
    from rollout_recovery.data_plane.token_log_segments import TokenLogSegments
    from rollout_recovery.storage import RunStorage

    rows = staged_rows(snapshot)
    logged, _ = TokenLogSegments.read(RunStorage(run_dir).child_uri(TOKEN_LOG_DIR), {ident})
    rows |= {r.key: r for r in logged.get(ident, {}).values() if r is not None}
    chain = [rows[k] for k in keys if k in rows]
    if len(chain) != len(keys):
        return None
    ids = np.concatenate([r.token_ids for r in chain])
    return ids, merged(s for r in chain for s in r.version_spans())


def current_cuts(args, snapshot_uri: str) -> tuple[int, dict]:
    """The kill's condition at level prefix: recoverable cut calls (recovery_check's rule)
    whose every staged token came from the snapshot's own weight version. A restore trains
    their groups at most one version later, within max_trajectory_age_steps >= 1 however long
    the restore takes; a call begun on the weights before would go stale if its group is
    trained a step later than it would have been without the crash, and a kill whose only
    cut calls go stale resumes nothing that is trained (its [prefix] comparison is empty)."""
    n, ledger = rc.recoverable(args, snapshot_uri)
    if not n:
        return 0, ledger
    rows = staged_rows(snapshot_uri)
    _, done = evidence.committed(ledger, rc.snapshot_keys(snapshot_uri, "replay"))
    current = 0
    for rollout, c in ledger["continuations"].items():
        if rollout in done or not 0 < c.get("tokens", 0) < args.max_tokens:
            continue
        first = rows.get((c.get("keys") or [None])[0])
        spans = first.version_spans() if first is not None else []
        if spans and min(v for v, *_ in spans) >= ledger["weight_version"]:
            current += 1
    return current, ledger


def check_prefixes(args, run_dir: str, kills: list[dict], rows: dict) -> tuple[list[str], dict]:
    """[prefix]: every cut continuation resumed from exactly its prefix, by the engines' own
    records, and its trained tokens and versions at the prefix equal the staged rows."""
    from rollout_recovery.data_plane.spans import clipped, shifted
    from rollout_recovery.protocol import CallIdentity

    out, counts = (
        [],
        {
            "continuations": 0,
            "resumed": 0,
            "finished_in_snapshot": 0,
            "compared_in_training": 0,
            "taken_from_token_log": 0,
        },
    )
    afters = rc.after_each_kill(run_dir, kills)
    token_log = rc.token_log_restores(run_dir)
    for k, killed in enumerate(kills):
        if k < len(token_log):  # the continuations as the restore gave them to the workers
            counts["taken_from_token_log"] += len(rc.with_token_log(killed["ledger"], token_log[k]))
        after = afters[k]
        by_call = defaultdict(list)
        for r in after:
            by_call[(r["rollout_id"], r["model_call_id"])].append(r)
        _, done = evidence.committed(killed["ledger"], killed["finished_keys"])
        for ep in killed["ledger"].get("episodes", []):
            cont = ep.get("continuation") or {}
            if not cont.get("keys") or cont.get("tokens", 0) <= 0:
                continue
            if ep["rollout_id"] in done:  # the snapshot also holds it finished: not resumed
                counts["finished_in_snapshot"] += 1
                continue
            counts["continuations"] += 1
            name = f"{ep['rollout_id']}/{cont['call_id']}"
            later = [
                r
                for r in by_call[(ep["rollout_id"], cont["call_id"])]
                if r["attempt"] > cont["attempt"]
            ]
            if not later:
                continue  # its group went stale and was generated again, or not reached yet
            first = min(later, key=lambda r: r["attempt"])
            if first["resume"] != "resumed" or first["prefix_tokens"] != cont["tokens"]:
                out.append(
                    f"[prefix] {name} cut at {cont['tokens']} tokens: its next attempt "
                    f"was {first['resume']} from {first['prefix_tokens']} tokens "
                    f"({first['refused_reason']})"
                )
                continue
            counts["resumed"] += 1
            row = rows.get(ep["rollout_id"])
            if row is None or cont["call_id"] != "c0":
                continue  # not trained (stale), or a later turn (not at a fixed place)
            ident = CallIdentity(ep["rollout_id"], cont["call_id"], cont["attempt"])
            staged = staged_prefix(run_dir, killed["snapshot"], ident, cont["keys"])
            if staged is None:
                out.append(
                    f"[prefix] {name}: neither the snapshot nor the token log holds its rows"
                )
                continue
            ids, spans = staged
            at = row.prompt_len
            n = len(ids)
            trained = row.token_ids[at : at + n]
            trained_spans = shifted(clipped(row.weight_versions or [], at, at + n), -at)
            counts["compared_in_training"] += 1
            if trained.tolist() != ids.tolist():
                out.append(f"[prefix] {name}: the trained tokens differ from the staged prefix")
            elif trained_spans != spans:
                out.append(
                    f"[prefix] {name}: trained versions {trained_spans} at the prefix, "
                    f"staged {spans}"
                )
    return out, counts


def check_restores(args, run_dir: str, kills: list[dict]) -> tuple[list[str], dict]:
    """[committed]: no rollout a snapshot had finished (in the buffer) is decoded again after
    its restore; [level]: below prefix level no call resumes from a prefix, and the calls in
    flight at the kill are decoded again from their first token (counted)."""
    afters = rc.after_each_kill(run_dir, kills)
    out, counts = [], {"in_flight": 0, "generated_again": 0, "not_decoded_again": 0}
    for k, killed in enumerate(kills):
        after = afters[k]
        _, done = evidence.committed(killed["ledger"], killed["finished_keys"])
        for r in after:
            if r["rollout_id"] in done and r["decoded_tokens"]:
                out.append(
                    f"[committed] {r['rollout_id']} was finished in snapshot "
                    f"{snapshot_name(killed['snapshot'])}, yet attempt {r['attempt']} decoded "
                    f"{r['decoded_tokens']} tokens of it after the restore"
                )
        if args.level == "prefix":
            continue
        firsts: dict[tuple[str, str], dict] = {}
        for r in sorted(after, key=lambda r: r["attempt"]):
            firsts.setdefault((r["rollout_id"], r["model_call_id"]), r)
        for ep in killed["ledger"].get("episodes", []):
            counts["in_flight"] += 1
            first = firsts.get((ep["rollout_id"], "c0"))
            if first is None:  # finished at its engine before the snapshot (its answer in
                counts["not_decoded_again"] += 1  # the snapshot), or its group went stale
                continue
            if first["resume"] == "resumed" or first["prefix_tokens"]:
                out.append(
                    f"[level] {ep['rollout_id']} resumed from {first['prefix_tokens']} tokens "
                    f"at level {args.level} (only prefix level cuts calls)"
                )
            else:
                counts["generated_again"] += 1
    return out, counts


def version_weights(run_dir: str, versions: set[int], tmp: Path) -> dict[str, str | None]:
    """Each version's weights as a directory vLLM loads: version v is the model of the trainer
    checkpoint of step v (its last one: a restore redoes steps), version 0 the base model."""
    from safetensors.torch import load, save_file

    from rollout_recovery.storage import RunStorage
    from rollout_recovery.trainer import trainer_checkpoints

    storage = RunStorage(run_dir)
    out: dict[str, str | None] = {}
    for v in sorted(versions):
        if v == 0:
            out["0"] = None
            continue
        files = trainer_checkpoints.read(storage, v).files
        tensors = load(files["state.safetensors"])
        model = {k.removeprefix("model."): t for k, t in tensors.items() if k.startswith("model.")}
        d = tmp / f"v{v}"
        d.mkdir()
        save_file(model, str(d / "model.safetensors"), metadata={"format": "pt"})
        out[str(v)] = str(d)
    return out


def check_logprobs(args, run_dir: str, rows: dict) -> tuple[list[str], dict]:
    """[logprobs]: each trained token's behaviour logprob against its version's recomputation."""
    import numpy as np

    from rollout_recovery.config import load_config
    from rollout_recovery.data_plane.spans import per_token
    from rollout_recovery.generation.engine_setup import engine_env
    from rollout_recovery.model_identity import resolve_model_path

    cfg = load_config(rc.config(args), rc.overrides(args, run_dir))
    base = resolve_model_path(cfg.policy.model_path)
    seqs, versions = [], set()
    for rid, r in rows.items():
        v = per_token(r.weight_versions or [], len(r.token_ids))
        positions: dict[str, list[int]] = defaultdict(list)
        for i in np.flatnonzero(r.loss_mask):
            positions[str(int(v[i]))].append(int(i))
        versions |= {int(x) for x in positions}
        seqs.append({"id": rid, "token_ids": r.token_ids.tolist(), "positions": positions})
    if any(v < 0 for v in versions):
        return ["[logprobs] a trained token carries no weight version"], {}
    with tempfile.TemporaryDirectory() as tmp:
        request = {
            "model": base,
            "kv_bytes": cfg.vllm_cfg.kv_cache_memory_bytes,
            "max_model_len": cfg.vllm_cfg.max_model_len,
            "versions": version_weights(run_dir, versions, Path(tmp)),
            "sequences": seqs,
        }
        proc = subprocess.run(
            [rc.PYTHON, str(HERE / "recompute_logprobs.py")],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            env=os.environ | engine_env(cfg),
            timeout=900,
            check=False,
        )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"FAIL: recomputing logprobs failed: {proc.stderr[-2000:]}")
    scored = json.loads(lines[-1].removeprefix("RESULT "))
    per_version: dict[int, list[float]] = defaultdict(list)
    for rid, r in rows.items():
        v = per_token(r.weight_versions or [], len(r.token_ids))
        for i, lp in scored.get(rid, {}).items():
            per_version[int(v[int(i)])].append(abs(float(r.logprobs[int(i)]) - lp))
    figures = {
        str(v): {
            "tokens": len(d),
            "bit_identical": sum(x == 0.0 for x in d) / len(d),
            "max_abs_diff": max(d),
        }
        for v, d in sorted(per_version.items())
    }
    out = []
    for v, f in figures.items():
        if (
            f["bit_identical"] < args.min_identical_logprobs
            or f["max_abs_diff"] > args.max_logprob_diff
        ):
            out.append(
                f"[logprobs] version {v}: {f['bit_identical']:.2%} of {f['tokens']} tokens "
                f"bit-identical, max |diff| {f['max_abs_diff']:.3g}"
            )
    return out, figures


def lost_work(run_dir: str, kills: list[dict], level: str) -> list[dict]:
    """Per kill: what the engines decoded before it, and of that what they decoded again."""
    afters = rc.after_each_kill(run_dir, kills)
    out = []
    for k, killed in enumerate(kills):
        after = afters[k]
        w = evidence.lost_work(
            killed["engine_before"], after, [], killed["ledger"], killed["finished_keys"], level
        )
        out.append(
            {
                "step": killed["step"],
                "lost": w[level],
                "decoded_before_crash": w["decoded_before_crash"],
                "after_snapshot_s": killed["after_snapshot_s"],
            }
        )
    return out


def report(args, run_dir: str, kills: list[dict]) -> int:
    from rollout_recovery.storage import RunStorage
    from rollout_recovery.trainer import trainer_checkpoints
    from rollout_recovery.trainer.producer import CURSOR_KEY

    steps = final_steps(run_dir)
    last = trainer_checkpoints.read(RunStorage(run_dir), max(steps))
    cursor = last.extra[CURSOR_KEY]
    violations = check_prompts(run_dir, steps, cursor)
    aged, ages = check_age(run_dir, steps, args.max_age)
    violations += aged
    rows = trained_rows(run_dir, steps)
    prefixed, prefix_counts = check_prefixes(args, run_dir, kills, rows)
    violations += prefixed
    restored, restore_counts = check_restores(args, run_dir, kills)
    violations += restored
    scored, logprobs = check_logprobs(args, run_dir, rows)
    violations += scored
    selected = [snapshot_name(e["snapshot"]) for e in restore_events(run_dir)]
    chosen = [snapshot_name(k["snapshot"]) for k in kills]
    if selected != chosen:
        violations.append(f"[restore] the restores selected {selected}, the kills chose {chosen}")
    if prefix_counts["resumed"] < args.cuts * len(kills) and args.level == "prefix":
        violations.append(
            f"[prefix] only {prefix_counts['resumed']} calls resumed from a prefix "
            f"(< {args.cuts} per kill)"
        )
    if (
        args.level == "prefix"
        and prefix_counts["resumed"]
        and not prefix_counts["compared_in_training"]
    ):
        violations.append(
            "[prefix] no call a restore resumed was trained (their groups went stale or were "
            "never reached): the kill left nothing to compare"
        )
    lost = lost_work(run_dir, kills, args.level)
    result = {
        "level": args.level,
        "journal": args.journal,
        "kills": len(kills),
        "steps": len(steps),
        "fault": args.fault,
        "seed": args.seed,
        "run_dir": run_dir,
        "cursor": cursor,
        "ages": ages,
        "prefix": prefix_counts,
        "restored": restore_counts,
        "logprobs": logprobs,
        "lost_work": lost,
        "selected": selected,
        "dropped_stale": sum(s.get("async.groups_dropped_stale", 0) for s in steps.values()),
        "kill_points": [
            {k: v for k, v in x.items() if k not in ("ledger", "engine_before")} for x in kills
        ],
        "violations": violations,
    }
    path = args.out / "parity.json"
    path.write_text(json.dumps(result, indent=2, default=str))
    print_report(result, path)
    if violations:
        print("FAIL:\n  " + "\n  ".join(violations))
        return 1
    print("async_recovery: 1 passed, 0 failed")
    return 0


def print_report(r: dict, path: Path) -> None:
    print(
        f"\nasync recovery check ({path}; level {r['level']}, token log {r['journal']}, "
        f"{r['kills']} kills, {r['steps']} steps)"
    )
    c = r["cursor"]
    rows = [
        (
            "prompts trained once",
            f"{c['trained']} trained, {len(c['open'])} open, "
            f"{c['dropped_stale']} attempts dropped stale",
        ),
        ("oldest group trained", f"age {max(a for s in r['ages'].values() for a in s.values())}"),
    ]
    if r["level"] == "prefix":
        rows.append((
            "calls resumed from a cut",
            f"{r['prefix']['resumed']} of {r['prefix']['continuations']}"
            f" (compared in training: {r['prefix']['compared_in_training']}; finished in the"
            f" snapshot, not resumed: {r['prefix']['finished_in_snapshot']})",
        ))  # fmt: skip
    else:
        rows.append((
            "calls in flight at the kills",
            f"{r['restored']['in_flight']}: {r['restored']['generated_again']} generated again "
            f"from their first token, {r['restored']['not_decoded_again']} not decoded again",
        ))  # fmt: skip
    for v, f in r["logprobs"].items():
        rows.append(
            (
                f"logprobs of version {v}",
                f"{f['tokens']} tokens, {f['bit_identical']:.1%}"
                f" bit-identical, max |diff| {f['max_abs_diff']:.2g}",
            )
        )
    for k, w in enumerate(r["lost_work"], start=1):
        rows.append(
            (
                f"kill {k} (step {w['step']})",
                f"{w['lost']} tokens decoded again of {w['decoded_before_crash']} decoded before",
            )
        )
    for name, value in rows:
        print(f"  {name:<28} {value}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--level", choices=["prefix", "turn", "none"], default="prefix")
    ap.add_argument("--kills", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--cuts", type=int, default=2, help="cut calls in each kill's snapshot")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-age", type=int, default=1, help="max_trajectory_age_steps")
    ap.add_argument("--journal", choices=["on", "off"], default="on")
    ap.add_argument("--interval", type=float, default=0.4)
    ap.add_argument("--phase-timeout", type=float, default=900)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--min-identical-logprobs", type=float, default=rc.MIN_IDENTICAL_LOGPROBS)
    ap.add_argument("--max-logprob-diff", type=float, default=rc.MAX_LOGPROB_DIFF)
    ap.add_argument("--fault", help="a fault armed after the first phase (faults.py)")
    ap.add_argument("--verify-only", action="store_true", help="check --out's run again")
    ap.add_argument("extra", nargs="*", help="more config overrides for every run")
    args = ap.parse_args()
    # A snapshot of step s holds the calls of the groups that step s + 2 trains (generation
    # runs a step ahead), so a kill after one of the last two steps' snapshots leaves the
    # restore nothing to resume: its calls are never needed (and the last phase decodes
    # nothing). Kills come after snapshots of steps 1 .. steps - 2.
    args.kill_before = args.steps - 1
    if args.kills >= args.kill_before:
        sys.exit(f"FAIL: {args.kills} kills need --steps > {args.kills + 1}")
    mark_this_check()
    atexit.register(rc.stop_left_runs)
    args.seed = secrets.randbelow(2**31) if args.seed is None else args.seed
    args.rng, args.token = random.Random(args.seed), secrets.token_urlsafe(16)
    args.env, args.train, args.model, args.gpu = "tally", None, None, False
    args.config = rc.REPO / "configs" / "prefix_recovery.yaml"  # its level set by override
    args.recoverable = in_flight if args.level != "prefix" else current_cuts
    args.max_turns, args.phase1_retries, args.storage = 1, 0, "local"
    args.extra = [*async_overrides(args), *args.extra]
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    for d in ("run", "run-retry") if not args.verify_only else ():
        subprocess.run(["rm", "-rf", str(args.out / d)], check=True)
    if args.verify_only:  # the finished run in --out, checked again
        saved = json.loads((args.out / "kills.json").read_text())
        return report(args, saved["run_dir"], saved["kills"])
    t0 = time.monotonic()
    run_dir, kills = run_phases(args)
    print(f"runs took {time.monotonic() - t0:.0f} s", flush=True)
    (args.out / "kills.json").write_text(json.dumps({"run_dir": run_dir, "kills": kills}))
    return report(args, run_dir, kills)


if __name__ == "__main__":
    sys.exit(main())
