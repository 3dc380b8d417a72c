"""Kill a GRPO run with SIGKILL mid-generation, restore it, and compare with a reference run.

    .venv/bin/python functional_tests/recovery_check.py --out DIR [--level prefix] [--cuts 4]

1. reference: `rollout-recovery train` start to finish;
2. phase 1: the same run in its own process group, polled until a published snapshot holds at
   least --cuts recoverable cuts (0 < prefix < limit) after the first trainer step; then
   SIGKILL of the whole group and a check that none of its processes (Ray, engines) is left;
3. phase 2: `rollout-recovery train --restore` finishes the run;
4. parity: per step the same training batch (keys, token ids, rewards), loss and reward;
   restored calls and the tokens recovery saved. Writes DIR/parity.json, prints a table, and
   exits non-zero on any violation.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CLI = [str(REPO / ".venv" / "bin" / "rollout-recovery"), "train"]


def overrides(args, run_dir: Path) -> list[str]:
    return [
        f"checkpointing.checkpoint_dir={run_dir}",
        f"grpo.steps={args.steps}",
        "grpo.prompts_per_step=2",
        "grpo.generations_per_prompt=4",
        f"policy.generation.max_new_tokens={args.max_tokens}",
        f"rollout_checkpointing.snapshot_attempt_interval_s={args.interval}",
        "rollout_checkpointing.keep_latest_k=4",
        *args.extra,
    ]


def config(args) -> str:
    return str(REPO / "configs" / f"{args.level}_recovery.yaml")


def run(cmd: list[str], log: Path) -> None:
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, check=False)
    if proc.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd[:3])} exited {proc.returncode}; see {log}")


def descendants(pid: int) -> set[int]:
    out, frontier = set(), [pid]
    while frontier:
        p = frontier.pop()
        kids = subprocess.run(["pgrep", "-P", str(p)], capture_output=True, text=True).stdout
        for k in map(int, kids.split()):
            if k not in out:
                out.add(k)
                frontier.append(k)
    return out


def recoverable(snapshot_uri: str, limit: int) -> tuple[int, dict]:
    from rollout_recovery.data_plane import StagingStore

    ledger = json.loads(StagingStore.read_sidecar(snapshot_uri, "ledger.json"))
    n = sum(1 for c in ledger["continuations"].values() if 0 < c.get("tokens", 0) < limit)
    return n, ledger


def phase1(args, run_dir: Path) -> dict:
    from rollout_recovery.data_plane.snapshot_io import published_uris

    log = open(args.out / "phase1.log", "w")  # noqa: SIM115 - open for the child's lifetime
    proc = subprocess.Popen(
        [*CLI, "--config", config(args), *overrides(args, run_dir)],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
    )  # fmt: skip
    root = str(run_dir / "data_plane")
    deadline = time.monotonic() + args.timeout
    chosen = None
    tree: set[int] = set()
    while chosen is None:
        if proc.poll() is not None:
            sys.exit(f"FAIL: phase 1 finished before {args.cuts} recoverable cuts were published")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            sys.exit("FAIL: no snapshot with enough recoverable cuts in time")
        tree |= descendants(proc.pid)
        for uri in reversed(published_uris(root) if Path(root).exists() else []):
            try:
                n, ledger = recoverable(uri, args.max_tokens)
            except Exception:
                continue
            if n >= args.cuts and ledger["step"] >= 1:
                chosen = {"snapshot": uri, "recoverable_cuts": n, "step": ledger["step"],
                          "ledger": ledger}  # fmt: skip
                break
        time.sleep(0.05)
    tree |= descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    survivors = set()
    for _ in range(60):
        survivors = {p for p in tree if Path(f"/proc/{p}").exists() and not _zombie(p)}
        if not survivors:
            break
        time.sleep(0.5)
    if survivors:
        sys.exit(f"FAIL: processes survived the SIGKILL of phase 1: {sorted(survivors)}")
    chosen["processes_killed"] = len(tree) + 1
    return chosen


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return False


def steps(run_dir: Path) -> dict[int, dict]:
    out = {}
    for line in (run_dir / "steps.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec  # the last record of a step wins (phase 2 redoes it)
    return out


def batch(run_dir: Path, step: int):
    import pyarrow as pa

    with pa.memory_map(str(run_dir / "batches" / f"step-{step:06d}.arrow")) as src:
        return pa.ipc.open_file(src).read_all()


def _ranks(x):
    import numpy as np

    r = np.empty(len(x))
    r[np.argsort(x, kind="stable")] = np.arange(len(x))
    return r


def compare_batches(a, b) -> dict:
    """Exact ids, masks, rewards and lengths; logprob agreement statistics."""
    import numpy as np

    from rollout_recovery.data_plane.schemas import list_column

    out = {"same_keys": a.column("key").to_pylist() == b.column("key").to_pylist()}
    for col in ("token_ids", "loss_mask"):
        (oa, va), (ob, vb) = list_column(a, col), list_column(b, col)
        out[f"same_{col}"] = bool(np.array_equal(oa, ob) and np.array_equal(va, vb))
    out["same_rewards"] = a.column("reward").to_pylist() == b.column("reward").to_pylist()
    out["same_lengths"] = out["same_token_ids"]
    (_, la), (_, lb) = list_column(a, "logprobs"), list_column(b, "logprobs")
    _, mask = list_column(a, "loss_mask")
    gen = mask.astype(bool) if len(la) == len(lb) else np.zeros(0, bool)
    la, lb = la[gen], lb[gen]
    out["logprobs_bit_identical"] = float(np.mean(la == lb)) if len(la) else 0.0
    out["logprobs_max_abs_diff"] = float(np.max(np.abs(la - lb))) if len(la) else float("nan")
    ra, rb = _ranks(la), _ranks(lb)
    out["logprobs_spearman"] = float(np.corrcoef(ra, rb)[0, 1]) if len(la) > 1 else 1.0
    return out


def final_staging_keys(run_dir: Path) -> set[str]:
    import pyarrow as pa

    from rollout_recovery.data_plane.snapshot_io import published_uris

    latest = published_uris(str(run_dir / "data_plane"))[-1]
    keys: set[str] = set()
    for f in Path(latest).glob("shard-*/rollout_staging.*.arrow"):
        with pa.memory_map(str(f)) as src:
            keys |= set(pa.ipc.open_file(src).read_all().column("key").to_pylist())
    return keys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--level", choices=["prefix", "turn"], default="prefix")
    ap.add_argument("--cuts", type=int, default=4, help="recoverable cuts before the kill")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--interval", type=float, default=0.4)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("extra", nargs="*", help="more config overrides for every run")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ref_dir, rec_dir = args.out / "reference", args.out / "recovered"
    for d in (ref_dir, rec_dir):
        subprocess.run(["rm", "-rf", str(d)], check=True)

    t0 = time.monotonic()
    run([*CLI, "--config", config(args), *overrides(args, ref_dir)], args.out / "reference.log")
    t_ref = time.monotonic() - t0
    killed = phase1(args, rec_dir)
    run([*CLI, "--restore", "--config", config(args), *overrides(args, rec_dir)],
        args.out / "phase2.log")  # fmt: skip
    selected = [
        ln for ln in (args.out / "phase2.log").read_text().splitlines()
        if ln.startswith("Selected rollout recovery snapshot:")
    ]  # fmt: skip

    ref, rec = steps(ref_dir), steps(rec_dir)
    violations = []
    rows = []
    details: dict[int, dict] = {}
    for step in sorted(ref):
        a, b = ref[step], rec.get(step)
        if b is None:
            violations.append(f"step {step} missing after recovery")
            continue
        detail = compare_batches(batch(ref_dir, step), batch(rec_dir, step))
        exact = ("same_keys", "same_token_ids", "same_loss_mask", "same_rewards")
        same_batch = a["batch_digest"] == b["batch_digest"] and all(detail[k] for k in exact)
        details[step] = detail
        loss_diff = abs(a["loss"] - b["loss"])
        same_reward = a["mean_reward"] == b["mean_reward"]
        rows.append((step, same_batch, loss_diff, same_reward, b["restored_calls"],
                     b["restored_prefix_tokens"], b["generated_tokens"]))  # fmt: skip
        if not same_batch:
            violations.append(f"step {step}: training batch differs (token ids, keys or rewards)")
        if not same_reward:
            violations.append(f"step {step}: mean reward {b['mean_reward']} != {a['mean_reward']}")
        if loss_diff > args_loss_tol():
            violations.append(f"step {step}: loss differs by {loss_diff:.3g}")
    restored = sum(r[4] for r in rows)
    saved = sum(r[5] for r in rows)
    kill_ledger = killed["ledger"]  # read before phase 2 could garbage-collect the snapshot
    old_keys = {k for c in kill_ledger["continuations"].values() for k in c.get("keys", [])}
    lingering = old_keys & final_staging_keys(rec_dir)
    if lingering:
        violations.append(f"{len(lingering)} superseded chunk keys remain in the last snapshot")
    # The calls in flight at the crash: level none decodes all their tokens again; prefix
    # recovery decodes only the tails (and calls that were not cut from scratch).
    tails = sum(rec[s].get("tail_tokens", 0) for s in rec)
    scratch = sum(rec[s].get("regenerated_tokens", 0) for s in rec)
    regenerated = tails + scratch
    none_level = saved + tails + scratch
    if args.level == "prefix" and restored < args.cuts:
        violations.append(f"only {restored} calls were resumed from a prefix (< {args.cuts})")
    if not selected:
        violations.append("phase 2 did not log the selected snapshot")
    report = {
        "level": args.level,
        "reference_s": t_ref,
        "kill": killed,
        "selected": selected[-1] if selected else None,
        "steps": [
            dict(
                zip(
                    [
                        "step",
                        "same_batch",
                        "loss_abs_diff",
                        "same_reward",
                        "restored_calls",
                        "restored_prefix_tokens",
                        "generated_tokens",
                    ],
                    r,
                    strict=True,
                )
            )
            for r in rows
        ],
        "batches": details,
        "restored_calls": restored,
        "prefix_tokens_saved": saved,
        "superseded_chunk_keys_left": len(lingering),
        "interrupted_calls_tokens_level_none": none_level,
        "interrupted_calls_tokens_decoded": regenerated,
        "violations": violations,
    }
    (args.out / "parity.json").write_text(json.dumps(report, indent=2))
    print(f"\n{args.level}-level recovery parity ({args.out / 'parity.json'})")
    print(f"killed at trainer step {killed['step']} with {killed['recoverable_cuts']} recoverable "
          f"cuts; {killed['processes_killed']} processes, none left")  # fmt: skip
    print(f"{'step':>4} {'same batch':>11} {'|loss diff|':>12} {'same reward':>12} "
          f"{'restored':>9} {'prefix tok':>11} {'generated':>10}")  # fmt: skip
    for r in rows:
        print(f"{r[0]:>4} {r[1]!s:>11} {r[2]:>12.3g} {r[3]!s:>12} {r[4]:>9} {r[5]:>11} {r[6]:>10}")
    for step, d in sorted(details.items()):
        print(
            f"step {step} generation logprobs: {d['logprobs_bit_identical']:.1%} bit-identical, "
            f"max |diff| {d['logprobs_max_abs_diff']:.3g}, "
            f"Spearman {d['logprobs_spearman']:.6f}"
        )
    print(f"recovery savings: {restored} in-flight calls resumed from {saved} staged tokens; "
          f"the interrupted calls cost {regenerated} decoded tokens instead of {none_level} at "
          f"level none ({1 - regenerated / max(none_level, 1):.0%} saved)")  # fmt: skip
    if violations:
        print("FAIL:\n  " + "\n  ".join(violations))
        return 1
    print("recovery_check: 1 passed, 0 failed")
    return 0


def args_loss_tol() -> float:
    # Resumed tails are decoded in a different batch than the reference, so logprobs (and the
    # loss computed from them) can differ by float noise; token ids and rewards must be exact.
    return 1e-5


if __name__ == "__main__":
    sys.exit(main())
