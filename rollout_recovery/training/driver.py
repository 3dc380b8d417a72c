"""The shipped GRPO driver: a small, real loop built only on the `RolloutRecovery` API.

Per step: sample `generations_per_prompt` rollouts per prompt at temperature 1 with a distinct
seed per generation (position-keyed sampler: reproducible and resumable), score them with the
toy reward, lease the batch, take one clipped policy-gradient step with AdamW on generated
tokens only, ack the lease, push the new weights, write a trainer checkpoint, then a
data-plane snapshot, then the step's line in `<checkpoint_dir>/steps.jsonl`.

The old logprobs of the policy-gradient ratio are the trainer's own (one deterministic forward
pass, detached), not the ones the workers sampled with: those differ by float noise with the
batch shape a worker happened to decode in, so a restored run would train on slightly other
numbers than the uninterrupted one. With one optimizer step per batch the ratio is then 1 and
the step depends only on the tokens, masks and rewards, which recovery reproduces exactly; the
final trainer checkpoint is the same bytes however often the run was killed. The generation
logprobs are still required (a row without them is refused) and their gap to the trainer's is
logged: a large gap means the workers served other weights than the trainer holds.

Restore (`restore=True`) is decided from files before anything starts (restore.py): the newest
usable snapshot, its trainer checkpoint verified and of the same weights, the same base model.
A refusal is a `RecoveryError` with one line; nothing is deleted. A snapshot holding
unfinished episodes that the first restored step would not run (other grpo settings) is
refused too: they would wait for a step that never comes. Then the driver claims the
run's snapshot root (data_plane/ownership.py: a new owner epoch, so an older controller still
running can no longer publish or delete snapshots) and, if a snapshot was published between
the choice and the claim, chooses again; the chosen snapshot is restored after the claim. Each
newer snapshot the choice skipped is set aside under `<checkpoint_dir>/set_aside/`, with the
old run's trainer checkpoints and batches of the steps after the restored one, before anything
starts (controller/set_aside.py): the restored run's retention would delete them and its steps
overwrite them. A fresh run claims the root right after checking that the location holds no run.
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from tqdm import tqdm

from rollout_recovery.api import SingleController
from rollout_recovery.config import RolloutRecoveryConfig
from rollout_recovery.controller.selection import (
    DATA_PLANE,
    SnapshotChoice,
    SnapshotUnusable,
    check_model,
    read_ledger,
    run_has_state,
    select_snapshot,
)
from rollout_recovery.controller.set_aside import (
    RECORD,
    SetAside,
    restore_id,
    set_aside_skipped,
    snapshot_name,
)
from rollout_recovery.crashpoints import crash_point
from rollout_recovery.data_plane import SnapshotError, StagingStore
from rollout_recovery.data_plane.errors import OwnershipConflict
from rollout_recovery.data_plane.ownership import Owner
from rollout_recovery.data_plane.schemas import list_rows
from rollout_recovery.data_plane.snapshot_io import published_uris
from rollout_recovery.errors import (
    CheckpointWriteError,
    RecoveryError,
    RestoreError,
    RunExistsError,
    RunStalled,
    UserCodeError,
    short_repr,
    user_code_error,
)
from rollout_recovery.imports import load_callable
from rollout_recovery.model_identity import base_model_identity, resolve_model_path
from rollout_recovery.protocol import Ledger, group_id
from rollout_recovery.storage import RunStorage, StorageError
from rollout_recovery.training.checkpoint import (
    TrainerCheckpointError,
    check_paired_checkpoint,
    load_trainer_checkpoint,
    read_step_record,
    save_trainer_checkpoint,
    trainer_dir,
    trainer_steps,
)
from rollout_recovery.training.grpo import clipped_pg_loss, group_advantages
from rollout_recovery.training.policy import export_weights, load_policy, token_logprobs

STEPS_LOG = "steps.jsonl"


class TrainingDataError(RecoveryError):
    """A training batch cannot be trained on as it is."""


def _batch_tensors(table):
    """Pad the leased rows, grouped as generated (group id, then generation index). Every row
    must carry its generation logprobs."""
    order = sorted(
        range(table.num_rows),
        key=lambda i: (table.column("group_id")[i].as_py(),
                       table.column("generation_index")[i].as_py()),
    )  # fmt: skip
    missing = table.column("logprobs").is_null().to_pylist()
    if any(missing):
        key = table.column("key")[missing.index(True)].as_py()
        raise TrainingDataError(
            f"replay row {key} has no generation logprobs; a training row must carry the "
            "logprobs its tokens were sampled with (token capture records them with each call)"
        )
    ids, masks, lps = (list_rows(table, c) for c in ("token_ids", "loss_mask", "logprobs"))
    rewards = table.column("reward").to_numpy()
    width = max(len(ids[i]) for i in order)
    out_ids = torch.zeros(len(order), width, dtype=torch.long)
    attn = torch.zeros(len(order), width, dtype=torch.long)
    mask = torch.zeros(len(order), width)
    gen = torch.zeros(len(order), width)
    for row, i in enumerate(order):
        n = len(ids[i])
        out_ids[row, :n] = torch.from_numpy(ids[i].astype(np.int64))
        attn[row, :n] = 1
        mask[row, :n] = torch.from_numpy(masks[i].astype(np.float32))
        gen[row, :n] = torch.from_numpy(lps[i].astype(np.float32))
    # token_logprobs predicts position t from t-1: align masks and logprobs to [:, 1:].
    return out_ids, attn, mask[:, 1:], gen[:, 1:], torch.tensor(rewards[order], dtype=torch.float32)


def grpo_step(model, opt, table, group_size: int) -> tuple[float, float, float]:
    """One policy-gradient step on a leased batch; returns (loss, mean reward, the mean
    absolute gap between generation and trainer logprobs on generated tokens)."""
    ids, attn, mask, gen, rewards = _batch_tensors(table)
    adv = group_advantages(rewards, group_size)
    new = token_logprobs(model, ids, attn)
    old = new.detach()  # the trainer's own: the step is independent of the batch shape served
    loss = clipped_pg_loss(new, old, adv, mask)
    opt.zero_grad()
    loss.backward()
    opt.step()
    gap = ((old - gen).abs() * mask).sum() / mask.sum().clamp_min(1.0)
    return loss.item(), float(rewards.mean()), float(gap)


def _batch_digest(table) -> str:
    h = hashlib.sha256()
    keys = table.column("key").to_pylist()
    ids = list_rows(table, "token_ids")
    rewards = table.column("reward").to_pylist()
    for i in sorted(range(len(keys)), key=keys.__getitem__):
        h.update(keys[i].encode())
        h.update(ids[i].tobytes())
        h.update(repr(rewards[i]).encode())
    return h.hexdigest()


def _batch_bytes(table) -> bytes:
    """The exact training batch of a step (for parity checks), rows sorted by key."""
    import pyarrow.compute as pc

    table = table.take(pc.sort_indices(table, [("key", "ascending")]))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _results_json(results) -> bytes:
    """What each episode function returned, by replay key (None: finished before a restore)."""
    out = {r.key: s for g in results for r, s in zip(g.rows, g.results, strict=True)}
    return json.dumps(out, sort_keys=True).encode()


def _step_line(r: dict) -> str:
    ckpt = "n/a" if r.get("checkpoint_s") is None else f"{r['checkpoint_s']:.2f}s"
    line = (
        f"step {r['step']}: loss {r['loss']:+.4f}  mean reward {r['mean_reward']:.3f}  "
        f"{r['tokens_per_s']:.0f} tok/s  checkpoint {ckpt}  "
        f"rollout checkpoints {r['checkpoints']:.0f} (fence {r['fence_hold_s']:.2f}s"
        + (f", {r['checkpoint_failures']:.0f} failed)" if r["checkpoint_failures"] else ")")
    )
    if r["restored_episodes"]:
        line += (
            f"  restored {r['restored_episodes']} episodes / {r['restored_calls']} calls: kept "
            f"{r['restored_turn_tokens']} turn + {r['restored_prefix_tokens']} prefix tokens, "
            f"decoded {r['tail_tokens']} tail + {r['regenerated_tokens']} regenerated"
        )
    return line


@dataclass
class RestorePlan:
    choice: SnapshotChoice
    step: int
    meta: dict | None  # the paired trainer checkpoint (None at step 0: the base weights)
    state: bytes | None
    set_aside: SetAside | None = None  # where the skipped snapshots went (begin_restore)


def plan_restore(cfg: RolloutRecoveryConfig, storage: RunStorage) -> RestorePlan | None:
    """Choose the snapshot to restore and verify everything it needs, from files only: None
    when the location holds no run at all; RestoreError when it holds one that cannot be
    restored (the reasons listed, nothing deleted)."""
    identity = base_model_identity(cfg.policy.model_path, resolve_model_path(cfg.policy.model_path))

    def accept(uri: str, ledger: Ledger) -> dict:
        check_model(uri, ledger, identity)  # another model: refused outright
        try:
            paired = check_paired_checkpoint(storage, ledger.step, ledger.model.weights_sha256)
        except TrainerCheckpointError as err:
            raise SnapshotUnusable(f"its trainer checkpoint: {err}") from None
        return {} if paired is None else {"meta": paired[0], "state": paired[1]}

    rc = cfg.rollout_checkpointing
    root = storage.child_uri(DATA_PLANE)
    choice = select_snapshot(root, rc.restore_mode, cfg.rollout_recovery.target_level, accept)
    if choice is None:
        found = run_has_state(storage)
        if found:
            raise RestoreError(
                f"{storage.display()} holds a run ({', '.join(found)}) but no published "
                "snapshot to restore (checkpointing.save_data_plane=true keeps them); nothing "
                "was deleted. Start a new run on purpose in another checkpointing.checkpoint_dir"
            )
        return None
    step = choice.ledger.step
    if step >= cfg.grpo.steps:
        repaired = _complete_step_log(storage, step)
        raise RestoreError(
            f"the run in {storage.display()} already finished its {step} steps "
            f"(grpo.steps={cfg.grpo.steps}); raise grpo.steps to train it further, or start a "
            "new run in another checkpointing.checkpoint_dir"
            + (f" (step {step}'s log line, lost to a crash, was written from its trainer "
               "checkpoint)" if repaired else "")
        )  # fmt: skip
    _check_claimed(cfg, choice, step)
    return RestorePlan(choice, step, choice.extra.get("meta"), choice.extra.get("state"))


def _check_claimed(cfg: RolloutRecoveryConfig, choice: SnapshotChoice, step: int) -> None:
    """Every unfinished episode of the snapshot belongs to a group the first restored step
    submits: one it does not would wait for a step that never comes (a restore that hands
    episodes to no one), so the restore is refused before anything starts."""
    g = cfg.grpo
    groups = {group_id(step, i) for i in range(g.prompts_per_step)}
    n = g.generations_per_prompt
    orphans = [
        e for e in choice.ledger.episodes if e.group_id not in groups or e.generation_index >= n
    ]
    if orphans:
        e, many = orphans[0], "s" if len(orphans) > 1 else ""
        raise RestoreError(
            f"snapshot {choice.snapshot} holds {len(orphans)} unfinished episode{many} that "
            f"step {step} would not run (e.g. {e.rollout_id}: generation {e.generation_index} "
            f"of group {e.group_id}, with grpo.prompts_per_step={g.prompts_per_step} and "
            f"grpo.generations_per_prompt={g.generations_per_prompt}); restore with the grpo "
            "settings the run was started with (nothing was deleted)"
        )


def _prune_trainer_checkpoints(storage: RunStorage, keep_latest_k: int) -> None:
    """Delete trainer checkpoints no kept snapshot pairs with (never the newest)."""
    steps = trainer_steps(storage)
    paired = []
    try:
        for uri in published_uris(storage.child_uri(DATA_PLANE)):
            try:
                paired.append(read_ledger(uri).step)
            except SnapshotUnusable:
                continue
    except SnapshotError:
        return
    # Without snapshots (save_data_plane=false) nothing pairs: keep the newest k + 1.
    keep = {s for s in steps if s >= min(paired)} if paired else set(steps[-keep_latest_k - 1 :])
    for step in steps[:-1]:
        if step not in keep:
            storage.delete_dir(trainer_dir(step))


def _complete_step_log(storage: RunStorage, step: int) -> bool:
    """A crash between a step's trainer checkpoint and its log line loses the line: write it
    from the record the trainer checkpoint kept (True when it did)."""
    records = [json.loads(ln) for ln in storage.read_lines(STEPS_LOG)]
    logged = {r.get("step") for r in records if "event" not in r}
    if step > 0 and step not in logged:
        record = read_step_record(storage, step)
        if record is not None:
            record |= {"logged_from": "trainer_checkpoint"}
            storage.append_line(STEPS_LOG, json.dumps(record))
            return True
    return False


def _announce(storage: RunStorage, plan: RestorePlan) -> None:
    """Say what the restore chose and skipped, and where the skipped went, on the terminal and
    in the step log."""
    aside = plan.set_aside
    went = aside.snapshots if aside is not None else {}
    skipped = []

    def shown(uri: str) -> str:  # as messages show a location: without credentials
        return storage.display(f"{DATA_PLANE}/{snapshot_name(uri)}")

    for uri, reason in plan.choice.skipped:
        line = f"Snapshot {shown(uri)} is unusable ({reason}); falling back to the previous one"
        if uri in went:
            line += f"; set aside to {went[uri]}"
        print(line, flush=True)
        skipped.append({"snapshot": uri, "reason": reason}
                       | ({"set_aside": went[uri]} if uri in went else {}))  # fmt: skip
    if aside is not None and aside.files:
        steps = sorted({int(m.group(1)) for f in aside.files if (m := _STEP_RE.search(f))})
        print(f"Also set aside to {aside.shown}: the old run's trainer checkpoints and batches "
              f"of step{'s' * (len(steps) > 1)} {', '.join(map(str, steps))}, which the restored "
              f"run would overwrite ({RECORD} lists every file)", flush=True)  # fmt: skip
    print(f"Selected rollout recovery snapshot: {shown(plan.choice.snapshot)}", flush=True)
    event = {"event": "restore", "snapshot": plan.choice.snapshot, "step": plan.step,
             "skipped": skipped}  # fmt: skip
    if aside is not None:
        event["set_aside"] = {"where": aside.shown, "files": aside.files}
    storage.append_line(STEPS_LOG, json.dumps(event))


_STEP_RE = re.compile(r"(?:^|/)step-(\d+)")  # trainer/step-NNNNNN/..., batches/step-NNNNNN.*


def _after_step(storage: RunStorage, step: int) -> list[str]:
    """The trainer checkpoints and batches of steps after `step`, relative to the location:
    the restored run writes them again."""
    found = [f"{d}/{n}" for d in ("trainer", "batches") for n in storage.list_dir(d)]
    return [rel for rel in found if (m := _STEP_RE.search(rel)) and int(m.group(1)) > step]


def begin_restore(
    cfg: RolloutRecoveryConfig, storage: RunStorage
) -> tuple[RestorePlan | None, Owner]:
    """Choose what to restore (files only: a refusal changes nothing), claim the run's
    snapshot root (an older controller can no longer publish or delete), choose again if a
    snapshot was published meanwhile, and set aside each newer snapshot the choice skipped,
    with the old run's trainer checkpoints and batches of the steps after the restored one
    (controller/set_aside.py): the restored run would delete or overwrite them. A failed move
    refuses the restore (RestoreError), deleting nothing."""
    root = storage.child_uri(DATA_PLANE)
    seen = _published(root)
    plan = plan_restore(cfg, storage)  # files only: a refusal changes nothing
    owner = StagingStore.claim(root)  # from here on an older controller cannot publish
    if seen is None or _published(root) != seen:
        plan = plan_restore(cfg, storage)  # its last publication landed meanwhile
    if plan is not None and plan.choice.skipped:
        also = _after_step(storage, plan.step)
        plan.set_aside = set_aside_skipped(storage, plan.choice, also, restore_id(owner.epoch))
    return plan, owner


def _published(root: str) -> list[str] | None:
    """The published snapshots under root (None when they cannot be listed)."""
    try:
        return published_uris(root)
    except SnapshotError:
        return None


def train(
    cfg: RolloutRecoveryConfig, ray_address: str = "local", restore: bool = False
) -> list[dict]:
    """Run (or, with restore, continue) GRPO. A fresh run refuses a location that already
    holds a run; restore continues the run from its newest usable snapshot and the trainer
    checkpoint of the same step."""
    g = cfg.grpo
    torch.manual_seed(g.seed)
    storage = RunStorage(cfg.checkpointing.checkpoint_dir)
    storage.check_writable()
    plan = None
    root = storage.child_uri(DATA_PLANE)
    if restore:
        plan, owner = begin_restore(cfg, storage)
        if plan is None:
            print(f"Nothing to restore under {storage.display()}: starting from step 0", flush=True)
    else:
        found = run_has_state(storage)
        if found:
            raise RunExistsError(
                f"checkpointing.checkpoint_dir={storage.display()} already holds a run "
                f"({', '.join(found)}); continue it with `train --restore`, or choose another "
                "checkpointing.checkpoint_dir (nothing was deleted)"
            )
        try:  # only as the location's first owner: another run may own it or be starting
            owner = StagingStore.claim(root, first=True)
        except OwnershipConflict as err:
            raise RunExistsError(
                f"checkpointing.checkpoint_dir={storage.display()}: {err}; continue that run with "
                "`train --restore` once it has stopped, or choose another "
                "checkpointing.checkpoint_dir (nothing was deleted)"
            ) from None
    weights_dir = storage.local_path("weights")
    scratch = None
    if weights_dir is None:  # the workers reload weights from a local directory
        scratch = tempfile.TemporaryDirectory(prefix="rollout-recovery-weights-")
        weights_dir = Path(scratch.name)
    model = load_policy(resolve_model_path(cfg.policy.model_path))
    opt = torch.optim.AdamW(model.parameters(), lr=g.learning_rate)
    start = 0
    if plan is not None:
        _announce(storage, plan)
        start = plan.step
        if plan.meta is not None:
            load_trainer_checkpoint(plan.state, plan.meta, model, opt)
        _complete_step_log(storage, start)
        for rel in storage.leftover_temporaries():  # writes the crash cut short
            storage.delete_file(rel)
    rr = SingleController(cfg, ray_address, owner=owner)
    history = []
    try:
        if plan is not None:
            rr.restore(plan.choice.snapshot)
            if plan.meta is not None:
                rr.push_weights(str(_export(model, weights_dir)),
                                plan.choice.ledger.weight_version,
                                plan.choice.ledger.model.weights_sha256)  # fmt: skip
        bar = tqdm(range(start, g.steps), desc="grpo", unit="step", initial=start, total=g.steps)
        for step in bar:
            try:
                record = _train_step(cfg, rr, storage, model, opt, step, weights_dir)
            except RunStalled as err:  # the run stops; the step log says why
                event = {"event": "stalled", "step": step, "reason": err.reason,
                         "error": str(err)}  # fmt: skip
                storage.append_line(STEPS_LOG, json.dumps(event))
                raise
            history.append(record)
            bar.write(_step_line(record))
    finally:
        rr.close()
        if scratch is not None:
            scratch.cleanup()
    return history


def _export(model, weights_dir: Path) -> Path:
    """The weights the workers reload, as a local safetensors directory."""
    try:
        return export_weights(model, weights_dir)
    except OSError as err:
        raise CheckpointWriteError(
            f"cannot write the weights to push to {weights_dir}: {err.strerror or err}; free "
            "space or fix permissions there, then continue with `train --restore`"
        ) from None


def _tasks_problem(tasks: object, n: int) -> str | None:
    """What is wrong with a task function's result for a step of `n` groups, or None."""
    if not isinstance(tasks, list | tuple):
        return f"{short_repr(tasks)} ({type(tasks).__name__})"
    if len(tasks) != n:
        return f"{len(tasks)} tasks"
    for i, task in enumerate(tasks):
        if not isinstance(task, dict):
            return f"task {i} = {short_repr(task)} ({type(task).__name__})"
        try:
            json.dumps(task)
        except (TypeError, ValueError) as err:
            return f"task {i}, which is not a JSON value ({err})"
    return None


def _make_tasks(cfg: RolloutRecoveryConfig, step: int) -> list[dict]:
    """Step `step`'s tasks, `environment.tasks(n, seed)`: one JSON object per group. An error
    in the function, or a result of another shape, fails the step naming the function."""
    n, seed = cfg.grpo.prompts_per_step, cfg.grpo.seed * 1_000_003 + step
    what = f"environment.tasks={cfg.environment.tasks}"
    where = f"at step {step} (called as tasks(n={n}, seed={seed}))"
    then = "then continue the run with `train --restore` (nothing was deleted)"
    make = load_callable(cfg.environment.tasks)
    try:
        tasks = make(n, seed)
    except Exception as err:
        raise user_code_error(what, err, where, f"fix the tasks function, {then}", make) from err
    problem = _tasks_problem(tasks, n)
    if problem is not None:
        raise UserCodeError(
            f"{what} returned {problem} {where}; it must return a list of n={n} tasks "
            f"(grpo.prompts_per_step), each a JSON object, {then}"
        )
    return list(tasks)


def _train_step(cfg, rr, storage: RunStorage, model, opt, step: int, weights_dir: Path) -> dict:
    g = cfg.grpo
    rr.set_step(step)
    before = rr.counters()
    t0 = time.monotonic()
    tasks = _make_tasks(cfg, step)
    groups = [(group_id(step, i), task) for i, task in enumerate(tasks)]

    def seeds(gi: int, gen: int, step: int = step) -> int:
        return ((g.seed * 1_000_003 + step) * 10_007 + gi) * 101 + gen

    results = rr.submit_groups(groups, seeds)
    gen_s = time.monotonic() - t0
    rr.record_call_attempts(step + 1)
    tokens = sum(r.generated_tokens for r in results)
    lease = rr.take_batch(len(groups) * g.generations_per_prompt)
    crash_point("batch_leased")
    storage.write_bytes(f"batches/step-{step + 1:06d}.arrow", _batch_bytes(lease.rows))
    storage.write_bytes(f"batches/step-{step + 1:06d}.results.json", _results_json(results))
    loss, reward, gap = grpo_step(model, opt, lease.rows, g.generations_per_prompt)
    rr.ack(lease)
    crash_point("batch_acked")
    version = rr.push_weights(str(_export(model, weights_dir)))
    crash_point("weights_pushed")
    c0 = time.monotonic()
    record = {
        "step": step + 1,
        "loss": loss,
        "mean_reward": reward,
        "rollout_logprob_gap": gap,
        "generated_tokens": tokens,
        "tokens_per_s": tokens / gen_s if gen_s else 0.0,
        "weight_version": version,
        "batch_digest": _batch_digest(lease.rows),
        **{k: v - before.get(k, 0) for k, v in rr.counters().items()},
    }
    try:
        save_trainer_checkpoint(
            storage, step + 1, model, opt, {"step": step + 1, "data_cursor": step + 1},
            log_record=record | {"checkpoint_s": None, "snapshot_s": None},
        )  # fmt: skip
    except StorageError as err:
        raise CheckpointWriteError(
            f"cannot write the trainer checkpoint of step {step + 1}: {err}; free space or fix "
            "permissions under checkpointing.checkpoint_dir, then continue with "
            "`train --restore` (nothing was deleted)"
        ) from None
    crash_point("after_trainer_checkpoint")
    snap = rr.notify_trainer_checkpoint(step + 1)
    if "failed" in snap:
        print(f"rollout snapshot after trainer step {step + 1} failed ({snap['failed']} in a "
              "row; see checkpoints.jsonl); the run goes on", flush=True)  # fmt: skip
    crash_point("after_trainer_snapshot")
    _prune_trainer_checkpoints(storage, cfg.rollout_checkpointing.keep_latest_k)
    record |= {"checkpoint_s": time.monotonic() - c0, "snapshot_s": snap["snapshot_s"]}
    storage.append_line(STEPS_LOG, json.dumps(record))
    crash_point("step_logged")
    return record
