"""Kill a GRPO run with SIGKILL mid-generation, restore it, and compare with a reference run.

    .venv/bin/python functional_tests/recovery_check.py --out DIR [--level prefix|turn]
        [--cuts 4] [--kills 1] [--storage local|s3] [--model DIR|hf://org/name] [--gpu]
        [--seed N] [--min-identical-logprobs F] [--max-logprob-diff F] [config overrides...]
    ... --out DIR2 --from-kill DIR [--fault NAME]   # restore DIR's killed run again
    ... --out DIR --verify-only                      # verify DIR's runs again (local storage)
    ... --train PATH [--config FILE]                 # a training script instead of the CLI

`--train PATH` runs a training loop of one's own (e.g. examples/own_loop/train.py, with the
repo's .venv python and the arguments of `rollout-recovery train`) in every phase instead of
`rollout-recovery train`; its config defaults to the config.yaml beside it.

1. reference: `rollout-recovery train` start to finish;
2. kill k (of --kills): the run (fresh, then `--restore`) in its own process group, held by
   its controller right after each published snapshot of a step in [min_step, kill_before)
   (the crash point `snapshot_taken` armed to pause, functional_tests/pauses.py) until one of
   a later trainer step than the previous kill's holds at least --cuts recoverable cuts
   (prefix level: 0 < prefix < limit) or partly done episodes (turn level: 0 < committed
   turns < max_turns). The run cannot pass a snapshot the check has not judged, so load never
   decides whether the kill comes. The controller then stays held (nothing newer is
   published) while the rest decodes on for a random 0.1-0.9 snapshot intervals (--seed);
   every process but the worker actors is frozen, what each engine decoded per call attempt
   is read over the workers' control API, the whole group is frozen and killed with SIGKILL;
   none of its processes (Ray, engines) may be left. The kill's record names the pause it
   acted on (`held_at`) and every snapshot it judged on the way (`judged`);
3. last phase: `rollout-recovery train --restore` finishes the run;
4. parity: per step the same training batch (keys, token ids, loss masks, rewards, lengths),
   the same loss and reward (exactly), generation logprobs within thresholds, the episodes'
   final tool states (each effect once), every restored episode re-admitted once, the final
   trainer checkpoint byte-identical to the reference's, no superseded chunk keys left; and,
   from the engines' own records (rollout_recovery/testing/campaign/engine_evidence.py): every
   cut call resumed by its worker with exactly length - prefix tokens decoded, no committed
   turn decoded again, no episode record refused. Per kill, the work lost to the crash is
   measured at the run's level and at the coarser ones. Writes DIR/parity.json, prints a
   table, and exits non-zero on any violation; each violation names its property in
   brackets.

`--from-kill DIR` copies DIR's reference and the state its last kill left (kept in
DIR/saved/) and runs only the last phase; with `--fault NAME` (rollout_recovery/faults.py)
that phase runs deliberately broken, which the check must report. `--storage s3` puts every
run's checkpoint_dir on a local S3 server (moto, 127.0.0.1) started by this check.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
CLI = [str(REPO / ".venv" / "bin" / "rollout-recovery"), "train"]
PYTHON = str(REPO / ".venv" / "bin" / "python")

from pauses import Pauses, resume, session  # noqa: E402
from processes import (  # noqa: E402
    MARK_ENV,
    alive_own,
    command,
    descendants,
    mark_this_check,
    owned,
    signal_own,
)

from rollout_recovery.testing.campaign import engine_evidence as evidence  # noqa: E402
from rollout_recovery.testing.campaign.crash_points import (  # noqa: E402
    batch,
    records_by_run,
    restore_events,
    session_records,
    snapshot_keys,
    snapshot_name,
    trainer_checkpoint_digest,
    turn_lengths,
)

# Generation logprobs of a restored run against the reference, on CPU float32 (measured over
# the functional runs, docs/evidence.md): bit-identical where the resumed call's batch shape
# matches the uninterrupted one, ~1e-7 apart where it does not. On a GPU use e.g. 0.5 and 1e-3
# (kernels differ with batch shape more). A step below the share or above the difference fails.
MIN_IDENTICAL_LOGPROBS = 0.5
MAX_LOGPROB_DIFF = 1e-5


def overrides(args, run_dir: str) -> list[str]:
    return [
        f"checkpointing.checkpoint_dir={run_dir}",
        f"grpo.steps={args.steps}",
        "grpo.prompts_per_step=2",
        "grpo.generations_per_prompt=4",
        f"policy.generation.max_new_tokens={args.max_tokens}",
        f"rollout_checkpointing.snapshot_attempt_interval_s={args.interval}",
        "rollout_checkpointing.keep_latest_k=4",
        f"token_capture.control_auth_token={args.token}",
        *env_overrides(args, run_dir),
        *device_overrides(args),
        *args.extra,
    ]


# The environments the check runs: the built-in tally task, the notes agent (an episode
# function whose tool writes files), and an `openai` client harness through the gateway.
ENV_CONFIGS = {"notes": "notes_agent.yaml", "gateway": "gateway_harness.yaml"}


def train_command(args) -> list[str]:
    """What every phase runs, before its `[--restore] --config FILE overrides...`."""
    return [PYTHON, str(args.train)] if args.train else CLI


def config(args) -> str:
    if args.config:
        return str(args.config)
    if args.train:  # a loop of one's own comes with its config
        return str(Path(args.train).resolve().parent / "config.yaml")
    name = ENV_CONFIGS.get(args.env, f"{args.level}_recovery.yaml")
    return str(REPO / "configs" / name)


def env_overrides(args, run_dir: str) -> list[str]:
    """The level of the environment configs (the built-in ones are one per level), and a local
    scratch directory for a run whose checkpoint_dir is remote."""
    per_level = args.env in ENV_CONFIGS or args.train  # not one config per level
    out = [f"rollout_recovery.target_level={args.level}"] if per_level else []
    if "://" in run_dir:
        out.append(f"environment.scratch_dir={scratch_dir(args, run_dir)}")
    return out


def scratch_dir(args, run_dir: str) -> Path:
    """Where a run's episodes keep their scratch directories (the notes agent's stores)."""
    if "://" not in run_dir:
        return Path(run_dir) / "scratch"
    return args.out / "scratch" / run_dir.split("?")[0].rstrip("/").rsplit("/", 1)[-1]


def device_overrides(args) -> list[str]:
    """--model: another checkpoint (a directory or hf://org/name); --gpu: the engine on CUDA,
    still float32 and eager so the recovered run can match the reference token for token."""
    out = [f"policy.model_path={args.model}"] if args.model else []
    if args.gpu:
        out += ["vllm_cfg.device=cuda", "vllm_cfg.kv_cache_memory_bytes=null",
                "vllm_cfg.gpu_memory_utilization=0.5"]  # fmt: skip
    return out


def run(args, cmd: list[str], log: Path, phase: str, run_dir: str, env: dict | None = None):
    """Run a phase to completion (at most --phase-timeout s); its log is kept beside the
    report. A phase that fails or is stuck says what the run was doing."""
    before = len(checkpoint_records(run_dir))
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                start_new_session=True)  # fmt: skip
        STARTED.append(proc)
        code = wait_phase(proc, args.phase_timeout, phase, run_dir, log, before)
    if code != 0:
        sys.exit(f"FAIL: {phase} ({' '.join(cmd[:3])}) exited {code}; "
                 f"{run_state(run_dir, log, before)}")  # fmt: skip


def wait_phase(
    proc: subprocess.Popen, timeout: float, phase: str, run_dir: str, log: Path, before: int = 0
) -> int:
    """The phase's exit status; one still running after `timeout` s is killed and the check
    fails, saying which phase was stuck and what its run was doing."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_run(proc)
        sys.exit(f"FAIL: {phase} stuck: not finished after {timeout:g} s; "
                 f"{run_state(str(run_dir), log, before)}")  # fmt: skip


STARTED: list[subprocess.Popen] = []  # every run this check started


def stop_left_runs() -> None:
    """At exit, however the check ends: SIGKILL every run it started that is still there (a
    check that fails mid-kill must not leave a frozen run behind)."""
    for proc in STARTED:
        if proc.poll() is None:
            stop_run(proc)


def stop_run(proc: subprocess.Popen) -> None:
    """SIGKILL a run this check started (every process under it, and its process group when
    it leads one) and reap it."""
    signal_own(descendants(proc.pid), signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.kill()
    proc.wait()


def checkpoint_records(run_dir: str) -> list[dict]:
    """The run's checkpoint log (`checkpoints.jsonl`), oldest first; empty before it exists."""
    from rollout_recovery.storage import RunStorage

    try:
        return [json.loads(ln) for ln in RunStorage(run_dir).read_lines("checkpoints.jsonl")]
    except Exception:  # not written yet (or unreadable: a report says so below)
        return []


def run_state(run_dir: str, log: Path, records_before: int) -> str:
    """What a run was doing, for a failure message: its last checkpoint record (how many this
    phase wrote: those after the first `records_before`), what it recorded in flight, and the
    run's last output line."""
    records = checkpoint_records(run_dir)
    parts = []
    if records:
        last = records[-1]
        name = snapshot_name(last["checkpoint"]) if last.get("checkpoint") else None
        keys = ("reason", "step", "episodes_recorded", "calls_cut", "calls_not_cut", "failed")
        what = {k: last[k] for k in keys if last.get(k) is not None}
        parts.append(f"{len(records) - records_before} checkpoints in this phase, the last "
                     f"{name} {what}")  # fmt: skip
    else:
        parts.append("no checkpoint record")
    text = log.read_text(errors="replace").replace("\r", "\n") if log.exists() else ""
    tail = [ln for ln in text.splitlines() if ln.strip()][-1:]
    parts.append(f"its last output: {tail[0][-300:]!r}" if tail else "no output")
    return "; ".join(parts)


def recoverable(args, snapshot_uri: str) -> tuple[int, dict]:
    """Prefix level: cut calls with 0 < prefix < limit whose rollout the snapshot does not
    also hold finished (a restore takes those from the replay table and resumes nothing);
    turn level: unfinished episodes with at least one committed turn."""
    from rollout_recovery.data_plane import StagingStore

    ledger = json.loads(StagingStore.read_sidecar(snapshot_uri, "ledger.json"))
    if args.level == "turn":
        n = sum(1 for e in ledger.get("episodes", []) if 0 < len(e["turns"]) < args.max_turns)
    else:
        limit = args.max_tokens
        _, done = evidence.committed(ledger, snapshot_keys(snapshot_uri, "replay"))
        n = sum(
            1
            for rollout, c in ledger["continuations"].items()
            if rollout not in done and 0 < c.get("tokens", 0) < limit
        )
    return n, ledger


class NoKillChance(RuntimeError):
    """A phase finished before a published snapshot held enough recoverable items."""


def retry_dir(run_dir: str) -> str:
    """A fresh location beside `run_dir` (a local path or an object-store URI)."""
    if "://" in run_dir:
        base, _, query = run_dir.partition("?")
        return f"{base.rstrip('/')}-retry?{query}" if query else f"{base.rstrip('/')}-retry"
    return str(Path(run_dir).with_name(Path(run_dir).name + "-retry"))


def kill_phase(args, run_dir: str, k: int, min_step: int, below: int | None = None) -> dict:
    """Run (fresh for k == 1, else --restore) held after each published snapshot of a step in
    [min_step, `below`) (default: the check's kill_before, else --steps; pauses.py) until one
    holds --cuts recoverable items; then, with
    the controller still held (nothing newer is published), let the rest decode for a random
    fraction of a snapshot interval, freeze all but the engines' actors, read what the engines
    decoded, freeze everything, SIGKILL, check no survivors."""
    import httpx

    log_path = args.out / f"phase{k}.log"
    log = open(log_path, "w")  # noqa: SIM115 - open for the child's lifetime
    restore = ["--restore"] if k > 1 else []
    what = f"phase {k} (`train{' --restore' if restore else ''}`)"
    last = below if below is not None else getattr(args, "kill_before", args.steps)
    before = len(checkpoint_records(run_dir))
    pauses = Pauses(args.out / f"phase{k}.pauses.jsonl", "snapshot_taken",
                    f"step>={min_step},step<{last}")  # fmt: skip
    proc = subprocess.Popen(
        [*train_command(args), *restore, "--config", config(args), *overrides(args, run_dir)],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
        env=os.environ | pauses.env(),
    )  # fmt: skip
    STARTED.append(proc)
    deadline = time.monotonic() + args.phase_timeout
    chosen: dict | None = None
    tree: set[int] = set()
    foreign: dict[int, str] = {}  # pids once in the tree, another's process by the signal
    judged: list[dict] = []  # every pause: the snapshot and whether it qualified

    want = f"snapshot of step >= {min_step} with {args.cuts} recoverable items"
    while chosen is None:
        try:
            held = pauses.wait(proc, deadline)
        except TimeoutError:
            stop_run(proc)
            sys.exit(f"FAIL: {what} stuck: no {want} within {args.phase_timeout:g} s; "
                     f"{run_state(run_dir, log_path, before)}")  # fmt: skip
        if held is None:
            raise NoKillChance(f"{what} exited {proc.returncode} before a {want} was published "
                               f"({len(judged)} snapshots judged: {judged[-4:]}); "
                               f"{run_state(run_dir, log_path, before)}")  # fmt: skip
        tree |= descendants(proc.pid) | session(proc.pid)
        ready = held_snapshot(args, run_dir, held, min_step, last)
        judged.append({"snapshot": held["facts"]["snapshot"], "step": held["facts"]["step"],
                       "recoverable": ready["recoverable_cuts"] if ready else None})  # fmt: skip
        if ready is None or ready["recoverable_cuts"] < args.cuts:
            note(foreign, resume(proc.pid))
            continue
        # Held right after a qualifying snapshot. The controller (the pausing process) stays
        # stopped, so nothing newer is published and no step can end; the engines decode on
        # for a random fraction of an interval, so the kill lands at varied token positions.
        delay = args.rng.uniform(0.1, 0.9) * args.interval
        note(foreign, resume(proc.pid, keep={held["pid"]}))
        time.sleep(delay)
        tree |= descendants(proc.pid) | session(proc.pid)
        workers = current_workers(run_dir, tree)
        # Freeze everything but the worker actors (they answer the read below): no token
        # is decoded from here on.
        others = ({proc.pid} | tree) - {w["pid"] for w in workers}
        note(foreign, signal_own(others, signal.SIGSTOP))
        frozen_at = time.time()
        time.sleep(0.1)  # outputs already sent reach the workers' counters
        try:
            engine = read_engine_records(workers, args.token)
        except httpx.HTTPError as err:
            stop_run(proc)
            sys.exit(f"FAIL: {what}: the engines' records could not be read while held after "
                     f"{held['facts']['snapshot']}: {err}")  # fmt: skip
        note(foreign, signal_own(tree, signal.SIGSTOP, pgid=proc.pid))
        new = (descendants(proc.pid) | session(proc.pid)) - tree
        tree |= new
        note(foreign, signal_own(new, signal.SIGSTOP))
        since = frozen_at - snapshot_time(ready["snapshot"])
        chosen = ready | {"engine_before": engine, "kill_delay_s": delay, "after_snapshot_s": since,
                          "chosen_at": time.time(), "held_at": held, "judged": judged}  # fmt: skip
    tree |= descendants(proc.pid)
    note(foreign, signal_own(tree, signal.SIGKILL, pgid=proc.pid))
    proc.wait()
    survivors = set()
    for _ in range(60):
        survivors = {p for p in tree if alive_own(p)}
        if not survivors:
            break
        time.sleep(0.5)
    if survivors:
        sys.exit(f"FAIL: processes survived the SIGKILL of phase {k}: {sorted(survivors)}")
    chosen["processes_killed"] = len(tree) + 1
    chosen["pids"] = sorted(tree | {proc.pid})
    chosen["pids_not_ours"] = foreign  # reused by another's process: left alone
    if late := published_after(child(run_dir, "data_plane"), chosen):
        sys.exit(f"FAIL: published after phase {k}'s kill chose {chosen['snapshot']}: "
                 f"{'; '.join(late)}; not ours: {foreign}")  # fmt: skip
    chosen["finished_keys"] = sorted(snapshot_keys(chosen["snapshot"], "replay"))
    return chosen


def held_snapshot(args, run_dir: str, held: dict, min_step: int, last: int) -> dict | None:
    """The snapshot the run is held after, with its recoverable items (a check's own rule,
    `args.recoverable`), or None when it is not the newest published (a restore would not
    pick it) or not of a step a kill may land in."""
    from rollout_recovery.data_plane.snapshot_io import published_uris

    uris = published_uris(child(run_dir, "data_plane"))
    if not uris or snapshot_name(uris[-1]) != held["facts"]["snapshot"]:
        return None
    n, ledger = getattr(args, "recoverable", recoverable)(args, uris[-1])
    if not restorable(ledger, min_step, last):
        return None
    return {"snapshot": uris[-1], "recoverable_cuts": n, "step": ledger["step"], "ledger": ledger}


def restorable(ledger: dict, min_step: int, last_step: int) -> bool:
    """Whether a kill after the snapshot of `ledger` leaves a restore something to do: of step
    >= min_step, and before the run's last (a restore of the final trainer checkpoint's
    snapshot only says the run already finished its steps, run_plan.py: the run is ending)."""
    return min_step <= ledger["step"] < last_step


def published_after(root: str, chosen: dict) -> list[str]:
    """Snapshots published after the kill's choice (none may be: the run was frozen), each
    with its publish entry's writer and time, for the failure that names them."""
    import pyarrow.fs as pafs

    from rollout_recovery.data_plane import ownership
    from rollout_recovery.data_plane.filesystem import resolve
    from rollout_recovery.data_plane.snapshot_io import published_uris

    names = [snapshot_name(u) for u in published_uris(root)]
    newer = names[names.index(snapshot_name(chosen["snapshot"])) + 1 :]
    if not newer:
        return []
    fs, path = resolve(root)
    found = ownership.read_log(fs, path).publications()
    out = []
    for name in newer:
        slot, entry = found[name]
        [info] = fs.get_file_info([f"{ownership.log_dir(path)}/{ownership.entry_name(slot)}"])
        written = info.mtime.timestamp() if info.type == pafs.FileType.File else float("nan")
        pid = entry.owner.pid
        out.append(f"{name} (entry {slot}, epoch {entry.epoch}, owner pid {pid} "
                   f"{'in' if pid in chosen['pids'] else 'not in'} the killed tree, written "
                   f"{written - chosen['chosen_at']:+.2f} s from the choice)")  # fmt: skip
    return out


def after_each_kill(run_dir: str, kills: list[dict]) -> list[list[dict]]:
    """Per kill, the engine records of the runs after it: the next kill's read, or for the
    last kill every session started after its choice (none when the last phase decoded
    nothing; an earlier session's records are never taken for it). Kills recorded before
    `chosen_at` existed fall back to the newest session."""
    last = kills[-1]
    if "chosen_at" in last:
        tail = records_by_run(run_dir, [0, int(last["chosen_at"] * 1e9)])[1]
    else:
        tail = [[], *session_records(run_dir)][-1]
    return [k["engine_before"] for k in kills[1:]] + [tail]


def note(foreign: dict[int, str], pids: list[int]) -> None:
    """Record what the pids left alone run now (another check's engine, a `pgrep`, ...)."""
    for pid in pids:
        foreign.setdefault(pid, command(pid))


def current_workers(run_dir: str, tree: set[int]) -> list[dict]:
    """The workers of the running phase (`workers.json`, written by its controller at start;
    a previous phase's file names processes that are gone)."""
    from rollout_recovery.storage import RunStorage

    workers = json.loads(RunStorage(run_dir).read_bytes("workers.json"))["workers"]
    if not workers or any(w["pid"] not in tree for w in workers):
        sys.exit("FAIL: workers.json does not name this phase's workers")
    if not all(owned(p) for w in workers for p in (w["pid"], *w["engine_pids"])):
        sys.exit(f"FAIL: this phase's workers do not carry this check's mark ({MARK_ENV}): "
                 "its signals would not reach them")  # fmt: skip
    return workers


def read_engine_records(workers: list[dict], token: str) -> list[dict]:
    """Every call attempt each worker's engine has a record of, over its control API: the
    latest state of each (paging on while calls still change would list one attempt many
    times, and chase a live worker until its calls end)."""
    import httpx

    from rollout_recovery.generation.control import MAX_ATTEMPTS_PAGE

    out = []
    for w in workers:
        latest: dict[tuple, dict] = {}
        since = 0
        while True:
            resp = httpx.get(f"{w['url']}/control/v1/call-attempts", params={"since": since},
                             headers={"Authorization": f"Bearer {token}"}, timeout=30)  # fmt: skip
            resp.raise_for_status()
            page = resp.json()
            if page["dropped"]:
                sys.exit(f"FAIL: worker {w['index']} dropped {page['dropped']} attempt records")
            for r in page["attempts"]:
                key = (r["rollout_id"], r["model_call_id"], r["attempt"])
                if key not in latest or r["seq"] > latest[key]["seq"]:
                    latest[key] = r | {"worker": w["index"]}
            if len(page["attempts"]) < MAX_ATTEMPTS_PAGE:  # the last page of this read
                break
            since = page["next"]
        out += list(latest.values())
    return out


def snapshot_time(uri: str) -> float:
    """When the snapshot was taken (its manifest's `created_at`), as a Unix time."""
    from rollout_recovery.data_plane import StagingStore

    return datetime.fromisoformat(StagingStore.manifest(uri).body.created_at).timestamp()


def child(uri: str, name: str) -> str:
    from rollout_recovery.storage import RunStorage

    return RunStorage(uri).child_uri(name)


def steps(run_dir: str) -> dict[int, dict]:
    from rollout_recovery.storage import RunStorage

    out = {}
    for line in RunStorage(run_dir).read_lines("steps.jsonl"):
        rec = json.loads(line)
        if "event" not in rec:
            out[rec["step"]] = rec  # the last record of a step wins (a restore redoes it)
    return out


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


def final_staging_keys(run_dir: str) -> set[str]:
    from rollout_recovery.data_plane.snapshot_io import published_uris

    return snapshot_keys(published_uris(child(run_dir, "data_plane"))[-1], "rollout_staging")


RESTORE_COUNTERS = ("restored_episodes", "restored_calls", "restored_prefix_tokens",
                    "restored_turn_tokens", "tail_tokens", "regenerated_tokens",
                    "worker_resumes_accepted", "worker_resumes_refused")  # fmt: skip


def check_restored_once(
    args, killed: dict, rec_dir: str, counts: dict, after: list[dict]
) -> list[str]:
    """Every unfinished episode of the restored snapshot was re-admitted once, no episode
    record failed closed, and the engines' records of the restore phase (`after`) show every
    cut call resumed with exactly its tail decoded and no committed turn decoded again.
    `counts`: the restore counters of the step the restore redid."""
    from rollout_recovery.data_plane.schemas import list_rows
    from rollout_recovery.protocol import replay_key

    ledger, finished = killed["ledger"], set(killed["finished_keys"])
    unfinished = [e for e in ledger.get("episodes", [])
                  if replay_key(e["group_id"], e["generation_index"]) not in finished]  # fmt: skip
    out = []
    if counts["restored_episodes"] != len(unfinished):
        out.append(f"{counts['restored_episodes']} episodes re-admitted, the snapshot holds "
                   f"{len(unfinished)} unfinished")  # fmt: skip
    refused = {k: v for k, v in counts.items() if k.startswith("restore_refused.") and v}
    if refused:
        out.append(f"[restore_refused] episode records started over: {refused}")
    table = batch(rec_dir, ledger["step"] + 1)
    masks = dict(zip(table.column("key").to_pylist(), list_rows(table, "loss_mask"), strict=True))
    keys = {e["rollout_id"]: replay_key(e["group_id"], e["generation_index"]) for e in unfinished}

    def length_of(rollout: str, call: str) -> int | None:
        runs = turn_lengths(masks[keys[rollout]]) if keys.get(rollout) in masks else []
        return runs[int(call[1:])] if int(call[1:]) < len(runs) else None

    out += evidence.check_engine_evidence(args.level, ledger, finished, after, length_of)
    if args.level == "prefix" and counts["worker_resumes_refused"]:
        out.append(f"[resumed] the workers refused {counts['worker_resumes_refused']} "
                   "continuations")  # fmt: skip
    return out


def token_log_restores(rec_dir: str) -> list[dict]:
    """Per restore, in order: what each restored call took from the token log
    (`restores.jsonl`, written by the run; empty without the token log)."""
    from rollout_recovery.storage import RunStorage

    return [json.loads(line) for line in RunStorage(rec_dir).read_lines("restores.jsonl")]


def with_token_log(ledger: dict, restore: dict) -> dict:
    """The kill's ledger as the restore used it: continuations the token log extended replace
    the snapshot's, so the engine evidence is checked against what the workers were given.
    Returns what was taken (rollout -> snapshot and token log prefix lengths)."""
    taken = {}
    for ep in ledger.get("episodes", []):
        cont = restore["token_log"].get(ep["rollout_id"])
        if cont is None:
            continue
        taken[ep["rollout_id"]] = {"snapshot_tokens": cont["snapshot_tokens"],
                                   "token_log_tokens": cont["tokens"]}  # fmt: skip
        cont = {k: v for k, v in cont.items() if k != "snapshot_tokens"}
        ep["continuation"] = cont
        ledger.setdefault("continuations", {})[ep["rollout_id"]] = cont
    return taken


def compare_results(ref_dir: str, rec_dir: str, step: int, max_turns: int) -> list[str]:
    """Every episode function's result equals the reference's (the built-in task's: its tally
    and each turn's effect once). Episodes that had finished before the crash report no result
    (their tokens, which show every tool result, are compared with the batch)."""
    from rollout_recovery.storage import RunStorage

    name = f"batches/step-{step:06d}.results.json"
    ref = json.loads(RunStorage(ref_dir).read_bytes(name))
    rec = json.loads(RunStorage(rec_dir).read_bytes(name))
    out = []
    for key, state in rec.items():
        if state is None:
            continue
        if state != ref.get(key):
            want = ref.get(key)
            differ = "the value"
            if isinstance(state, dict) and isinstance(want, dict):
                differ = sorted(k for k in {*state, *want} if state.get(k) != want.get(k))
            out.append(f"step {step}: {key} ended with another result than the reference's "
                       f"({differ}): {str(state)[:200]}")  # fmt: skip
        elif "tally" in state and state["effects"] != list(range(max_turns - 1)):
            out.append(f"step {step}: {key} tool effects {state['effects']} (each turn once)")
    return out


def compare_scratch(ref_root: Path, rec_root: Path) -> dict:
    """The notes agent's stores, written by its tool outside the process: each episode's notes
    and register equal the reference's, and its operation log holds every effect once (an
    effect that ran again on replay was absorbed under its effect id, counted)."""
    from rollout_recovery.episodes.notes import applied_exactly_once, store_summary

    def stores(root: Path) -> dict[str, Path]:
        return {d.name: max(d.glob("start-*")) for d in sorted(root.iterdir())
                if any(d.glob("start-*"))}  # fmt: skip

    ref, rec = stores(ref_root), stores(rec_root)
    out = {"episodes": len(rec), "effects": 0, "absorbed": 0, "violations": []}
    if set(ref) != set(rec):
        out["violations"].append(f"[effects] episodes with a store: {sorted(set(ref) ^ set(rec))}")
    for rid in sorted(set(ref) & set(rec)):
        a, b = store_summary(ref[rid]), store_summary(rec[rid])
        out["effects"] += len(b["ops"])
        out["absorbed"] += b["dedupes"]
        if (a["notes"], a["register"], a["ops"]) != (b["notes"], b["register"], b["ops"]):
            out["violations"].append(f"[effects] {rid}: store {b} differs from the reference's {a}")
        out["violations"] += [f"[effects] {rid}: {v}" for v in applied_exactly_once(rec[rid])]
    return out


COLUMNS = (
    "step",
    "same_batch",
    "loss_abs_diff",
    "same_reward",
    "restored_episodes",
    "restored_calls",
    "restored_turn_tokens",
    "restored_prefix_tokens",
    "generated_tokens",
)


def start_s3() -> tuple[object, str]:
    """A local S3 server (moto) on 127.0.0.1 and the URI prefix of a bucket on it."""
    import logging

    from rollout_recovery.testing.s3_server import S3Server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    # Port 0: the server binds a free port itself (a port probed first could be taken by a
    # check running beside this one before the server binds it).
    server = S3Server(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    _, port = server.get_host_and_port()
    options = f"endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    return (
        server,
        f"s3://testing:testing@rr-functional/{{name}}?{options}&allow_bucket_creation=true",
    )


def kill_steps(args) -> list[int]:
    """The lowest trainer step each kill may land in: different steps, the first at step 1
    with one kill (a trainer checkpoint is restored), else from step 0 (the base weights)."""
    first = 1 if args.kills == 1 else 0
    return [first + k for k in range(args.kills)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--level", choices=["prefix", "turn"], default="prefix")
    ap.add_argument(
        "--cuts", type=int, default=4,
        help="recoverable cuts (prefix) or partly done episodes (turn) before each kill",
    )  # fmt: skip
    ap.add_argument("--kills", type=int, default=1, help="kills, each at a later trainer step")
    ap.add_argument("--env", choices=["tally", *ENV_CONFIGS], default="tally",
                    help="the episodes: the built-in task, the notes agent, or the gateway "
                         "harness")  # fmt: skip
    ap.add_argument("--storage", choices=["local", "s3"], default="local",
                    help="where checkpoint_dir lives (s3: a local moto server)")  # fmt: skip
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="per call (default: by level and environment)")  # fmt: skip
    ap.add_argument("--interval", type=float, default=0.4)
    # One bound for every phase: a killed phase that runs its course without its kill's
    # snapshot ends on its own (and is tried again once); this bound is for a run that hangs.
    # (300 s for a killed phase was too short on a slower machine running three checks at once:
    # the gateway check's steps took 125 s each there.)
    ap.add_argument("--phase-timeout", type=float, default=900,
                    help="s any phase may take (the reference run, a killed phase until its "
                         "kill, the last phase)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=None, help="kill delays (default: random)")
    ap.add_argument("--min-identical-logprobs", type=float, default=MIN_IDENTICAL_LOGPROBS,
                    help="least share of bit-identical generation logprobs per step")  # fmt: skip
    ap.add_argument("--max-logprob-diff", type=float, default=MAX_LOGPROB_DIFF,
                    help="largest |logprob difference| allowed per step")  # fmt: skip
    ap.add_argument("--from-kill", type=Path, help="restore again the killed run kept in DIR")
    ap.add_argument(
        "--fault",
        choices=["resume_disabled", "redecode_committed_turns", "effect_dedupe_disabled"],
        help="break the last phase on purpose (see rollout_recovery/faults.py)",
    )
    ap.add_argument("--verify-only", action="store_true", help="verify --out's runs again")
    ap.add_argument("--model", help="policy.model_path for every run (a dir or hf://org/name)")
    ap.add_argument("--gpu", action="store_true", help="run the engines on CUDA")
    ap.add_argument("--train", type=Path,
                    help="a training script run instead of `rollout-recovery train` (same "
                         "arguments), e.g. examples/own_loop/train.py")  # fmt: skip
    ap.add_argument("--config", type=Path,
                    help="the runs' config (default: by level and environment, or the "
                         "config.yaml beside --train)")  # fmt: skip
    ap.add_argument("extra", nargs="*", help="more config overrides for every run")
    args = ap.parse_args()
    mark_this_check()  # every run it starts carries it: signals reach only those (processes.py)
    atexit.register(stop_left_runs)
    if args.train:  # its config names functions beside it (load_config imports them here too)
        sys.path.insert(0, str(args.train.resolve().parent))
    if args.max_tokens is None:  # three turns of a multi-turn environment fit 1024 tokens
        args.max_tokens = 96 if args.level == "turn" else 384 if args.env == "tally" else 192
    if args.seed is None:
        args.seed = secrets.randbelow(2**31)
    args.rng = random.Random(args.seed)
    args.token = secrets.token_urlsafe(16)
    args.phase1_retries = 0
    if args.verify_only:
        return verify_only(args)
    if kill_steps(args)[-1] >= args.steps:
        sys.exit(f"FAIL: {args.kills} kills need --steps > {kill_steps(args)[-1]}")
    args.out.mkdir(parents=True, exist_ok=True)
    for d in ("reference", "recovered", "recovered-retry", "saved", "scratch"):
        subprocess.run(["rm", "-rf", str(args.out / d)], check=True)
    if args.from_kill:
        return from_kill(args)
    server = None
    if args.storage == "s3":
        server, pattern = start_s3()
        ref_dir, rec_dir = pattern.format(name="reference"), pattern.format(name="recovered")
    else:
        ref_dir, rec_dir = str(args.out / "reference"), str(args.out / "recovered")
    try:
        return check(args, ref_dir, rec_dir)
    finally:
        if server is not None:
            server.stop()


def copy_run(src: str, dst: str) -> None:
    """Copy a run's whole checkpoint_dir (any pyarrow.fs location) to another location."""
    import pyarrow.fs as pafs

    from rollout_recovery.storage import RunStorage

    a, b = RunStorage(src), RunStorage(dst)
    pafs.copy_files(a.path(""), b.path(""), source_filesystem=a.fs, destination_filesystem=b.fs)


def fault_env(args) -> dict | None:
    if not args.fault:
        return None
    from rollout_recovery import faults

    return os.environ | {faults.ENV: args.fault}


def last_phase(args, rec_dir: str, k: int) -> None:
    cmd = [*train_command(args), "--restore", "--config", config(args), *overrides(args, rec_dir)]
    run(
        args,
        cmd,
        args.out / f"phase{k}.log",
        f"phase {k} (`train --restore`, the last)",
        rec_dir,
        env=fault_env(args),
    )


def check(args, ref_dir: str, rec_dir: str) -> int:
    from rollout_recovery.config import load_config

    args.max_turns = load_config(config(args), overrides(args, ref_dir)).environment.max_turns
    t0 = time.monotonic()
    run(
        args,
        [*train_command(args), "--config", config(args), *overrides(args, ref_dir)],
        args.out / "reference.log",
        "the reference run",
        ref_dir,
    )
    args.reference_s = time.monotonic() - t0
    kills = []
    lows = kill_steps(args)
    for k, min_step in enumerate(lows, start=1):
        # Each kill in a step of its own: a kill before the last lands below the next one's.
        below = lows[k] if k < len(lows) else None
        try:
            kills.append(kill_phase(args, rec_dir, k, min_step, below))
        except NoKillChance as err:
            # A timing precondition of the check, not a recovery failure: the first phase ran
            # through before a snapshot qualified (slow snapshots on a loaded machine). Once,
            # a fresh run in a new location tries again; parity and evidence are unchanged.
            if k > 1 or args.phase1_retries:
                sys.exit(f"FAIL: {err}")
            print(f"{err}; running phase 1 again in a fresh location", flush=True)
            args.phase1_retries += 1
            rec_dir = retry_dir(rec_dir)
            kills.append(kill_phase(args, rec_dir, k, min_step, below))
    # Kept for --from-kill: the reference and the state the last kill left, on local disk.
    for run_dir, name in ((ref_dir, "reference"), (rec_dir, "killed")):
        copy_run(run_dir, str(args.out / "saved" / name))
        scratch = scratch_dir(args, run_dir)
        if "://" in run_dir and scratch.exists():  # local even when the checkpoints are not
            shutil.copytree(scratch, args.out / "saved" / name / "scratch")
    (args.out / "saved" / "kills.json").write_text(json.dumps(kills))
    last_phase(args, rec_dir, len(kills) + 1)
    return report(args, ref_dir, rec_dir, kills)


def from_kill(args) -> int:
    """Restore the killed run kept in --from-kill again (in this --out), as its last phase."""
    from rollout_recovery.config import load_config

    saved = args.from_kill / "saved"
    kills = json.loads((saved / "kills.json").read_text())
    ref_dir, rec_dir = str(saved / "reference"), str(args.out / "recovered")
    copy_run(str(saved / "killed"), rec_dir)
    args.storage = "local"
    args.max_turns = load_config(config(args), overrides(args, ref_dir)).environment.max_turns
    args.reference_s = None
    last_phase(args, rec_dir, len(kills) + 1)
    return report(args, ref_dir, rec_dir, kills)


def verify_only(args) -> int:
    """Verify --out's reference and recovered runs again, from their files (local storage)."""
    saved = json.loads((args.out / "parity.json").read_text())
    for key in ("level", "env", "max_turns", "fault", "cuts"):
        setattr(args, key, saved[key])
    args.train, args.config = saved.get("train"), saved.get("config")  # as it ran
    args.storage, args.reference_s = "local", saved["reference_s"]
    kills = json.loads((args.out / "kills.json").read_text())
    return report(args, saved["reference_dir"], saved["recovered_dir"], kills)


def report(args, ref_dir: str, rec_dir: str, kills: list[dict]) -> int:
    (args.out / "kills.json").write_text(json.dumps(kills))
    selected = [e["snapshot"] for e in restore_events(rec_dir)]
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
        rows.append((step, same_batch, loss_diff, same_reward, *(b.get(c, 0) for c in COLUMNS[4:])))
        if not same_batch:
            violations.append(f"step {step}: training batch differs (token ids, keys or rewards)")
        if not same_reward:
            violations.append(f"step {step}: mean reward {b['mean_reward']} != {a['mean_reward']}")
        if loss_diff != 0.0:
            # The trainer's step depends only on tokens, masks and rewards: equal, not close.
            violations.append(f"step {step}: loss differs by {loss_diff:.3g}")
        violations += compare_results(ref_dir, rec_dir, step, args.max_turns)
    effects = {}
    if args.env == "notes":
        effects = compare_scratch(scratch_dir(args, ref_dir), scratch_dir(args, rec_dir))
    violations += effects.pop("violations", [])
    violations += evidence.check_logprobs(
        details, args.min_identical_logprobs, args.max_logprob_diff
    )
    total = {c: sum(rec[s].get(c, 0) for s in rec) for c in RESTORE_COUNTERS}
    token_log = token_log_restores(rec_dir)
    for k, killed in enumerate(kills):
        if k < len(token_log):
            killed["token_log"] = with_token_log(killed["ledger"], token_log[k])
    afters = after_each_kill(rec_dir, kills)
    [reference_records] = session_records(ref_dir)[-1:] or [[]]
    lost = []
    for k, killed in enumerate(kills):
        redone = rec.get(killed["ledger"]["step"] + 1, {})
        after = afters[k]
        counts = {c: v for c, v in redone.items() if c in RESTORE_COUNTERS
                  or c.startswith("restore_refused.")}  # fmt: skip
        violations += check_restored_once(
            args, killed, rec_dir, {c: counts.get(c, 0) for c in RESTORE_COUNTERS} | counts, after
        )
        step = killed["ledger"]["step"]
        lost.append(
            evidence.lost_work(
                evidence.of_step(killed["engine_before"], step),
                evidence.of_step(after, step),
                evidence.of_step(reference_records, step),
                killed["ledger"], killed["finished_keys"], args.level,
            ) | {"after_snapshot_s": killed["after_snapshot_s"]}
        )  # fmt: skip
    final = max(ref)
    ref_ckpt, rec_ckpt = trainer_checkpoint_digest(ref_dir, final), trainer_checkpoint_digest(
        rec_dir, final)  # fmt: skip
    if ref_ckpt != rec_ckpt:
        violations.append(f"the final trainer checkpoint (step {final}) differs from the "
                          f"reference's: {rec_ckpt} != {ref_ckpt}")  # fmt: skip
    old_keys = {k for killed in kills for c in killed["ledger"]["continuations"].values()
                for k in c.get("keys", [])}  # fmt: skip
    lingering = old_keys & final_staging_keys(rec_dir)
    if lingering:
        violations.append(f"{len(lingering)} superseded chunk keys remain in the last snapshot")
    restored = total["restored_calls" if args.level == "prefix" else "restored_episodes"]
    if restored < args.cuts * len(kills):
        what = "calls were resumed from a prefix" if args.level == "prefix" else "episodes resumed"
        violations.append(f"only {restored} {what} (< {args.cuts} per kill)")
    chosen = [snapshot_name(k["snapshot"]) for k in kills]
    if [snapshot_name(u) for u in selected] != chosen:
        violations.append(f"the restores selected {selected}, the kills chose {chosen}")
    result = {
        "level": args.level,
        "env": args.env,
        "train": str(args.train) if args.train else None,
        "config": config(args),
        "extra_overrides": args.extra,
        "storage": args.storage,
        "fault": args.fault,
        "cuts": args.cuts,
        "max_turns": args.max_turns,
        "reference_dir": ref_dir,
        "recovered_dir": rec_dir,
        "reference_s": args.reference_s,
        "phase1_retries": args.phase1_retries,
        "mark": os.environ[MARK_ENV],  # its processes' (functional_tests/processes.py)
        "kills": [
            {k: v for k, v in killed.items() if k not in ("ledger", "engine_before")}
            for killed in kills
        ],
        "selected": selected,
        "steps": [dict(zip(COLUMNS, r, strict=True)) for r in rows],
        "batches": details,
        "logprob_thresholds": {
            "min_identical": args.min_identical_logprobs,
            "max_abs_diff": args.max_logprob_diff,
        },
        **total,
        "lost_work": lost,
        "final_trainer_checkpoint": {"reference": ref_ckpt, "recovered": rec_ckpt},
        "superseded_chunk_keys_left": len(lingering),
        "effects": effects,
        "violations": violations,
    }
    (args.out / "parity.json").write_text(json.dumps(result, indent=2))
    print_report(args, result, rows, details, final)
    if violations:
        print("FAIL:\n  " + "\n  ".join(violations))
        return 1
    print("recovery_check: 1 passed, 0 failed")
    return 0


def print_report(args, result: dict, rows: list, details: dict, final: int) -> None:
    unit = "recoverable cuts" if args.level == "prefix" else "partly done episodes"
    fault = f"; deliberate fault: {args.fault}" if args.fault else ""
    print(f"\n{args.level}-level recovery parity ({args.out / 'parity.json'}; checkpoints on "
          f"{args.storage} storage{fault})")  # fmt: skip
    for k, killed in enumerate(result["kills"], start=1):
        print(f"kill {k}: at trainer step {killed['step']} with {killed['recoverable_cuts']} "
              f"{unit}, {killed['after_snapshot_s']:.2f} s after its snapshot; "
              f"{killed['processes_killed']} processes, none left")  # fmt: skip
    print(f"{'step':>4} {'same batch':>11} {'|loss diff|':>12} {'same reward':>12} {'episodes':>9} "
          f"{'calls':>6} {'turn tok':>9} {'prefix tok':>11} {'generated':>10}")  # fmt: skip
    for r in rows:
        print(f"{r[0]:>4} {r[1]!s:>11} {r[2]:>12.3g} {r[3]!s:>12} {r[4]:>9} {r[5]:>6} "
              f"{r[6]:>9} {r[7]:>11} {r[8]:>10}")  # fmt: skip
    for step, d in sorted(details.items()):
        print(
            f"step {step} generation logprobs: {d['logprobs_bit_identical']:.1%} bit-identical, "
            f"max |diff| {d['logprobs_max_abs_diff']:.3g}, "
            f"Spearman {d['logprobs_spearman']:.6f}"
        )
    ckpt = result["final_trainer_checkpoint"]
    same = "identical to" if ckpt["reference"] == ckpt["recovered"] else "DIFFERENT from"
    # The shipped driver's state file, or a loop's own first file (its format is its own).
    name = "state.safetensors" if "state.safetensors" in ckpt["recovered"] else min(
        ckpt["recovered"], default=None)  # fmt: skip
    digest = f"{name} sha256 {ckpt['recovered'][name][:16]}" if name else "no files"
    print(f"final trainer checkpoint (step {final}): {same} the reference ({digest})")
    for k, lw in enumerate(result["lost_work"], start=1):
        levels = [lv for lv in ("prefix", "turn", "none") if lv in lw]
        vs = " vs ".join(f"{lw[lv]} at level {lv}" for lv in levels[1:])
        print(f"kill {k}: work lost to the crash: {lw[levels[0]]} tokens at level {levels[0]} vs "
              f"{vs} (of {lw['decoded_before_crash']} decoded before the crash; decoded after "
              f"restore: {lw['decoded_after_restore']})")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
