"""What a trainer step asks of a running job (controller/job.py): run or start its groups, lease
and acknowledge their rows, push weights, checkpoint after a trainer checkpoint, and the
preemption's final checkpoint. The facade (api.py) forwards each call here."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from rollout_recovery import faults, model_identity
from rollout_recovery.controller.job import Job
from rollout_recovery.controller.liveness import watch_step
from rollout_recovery.controller.stream import StartedGroup
from rollout_recovery.data_plane import LeaseResult
from rollout_recovery.data_plane.errors import BadInputError
from rollout_recovery.errors import RecoveryError, RestoreError, RunStalled, one_line
from rollout_recovery.protocol import GroupResult


def submit_groups(
    job: Job, groups: list[tuple[str, dict]], seeds: Callable[[int, int], int]
) -> list[GroupResult]:
    """Every generation of every group, run in the environment with the cadence alongside and
    the liveness watch on the step (a stall is counted as `run_stalled.<reason>`)."""
    n = job.cfg.grpo.generations_per_prompt
    table = [[seeds(gi, i) for i in range(n)] for gi in range(len(groups))]
    work = job.env.run_groups(groups, table, job.state.weight_version)
    watched = watch_step(work, job.env.progress, job.cfg.liveness, job.state.step)
    try:
        out = job.loop.run(job.coordinator.alongside(watched))
    except RunStalled as err:
        job.metrics.add(f"run_stalled.{err.reason}")
        raise
    return [GroupResult.of(gid, out[gi * n : (gi + 1) * n])
            for gi, (gid, _) in enumerate(groups)]  # fmt: skip


def start_groups(job: Job, groups: list[StartedGroup]) -> dict[str, int]:
    stream = job.open_stream(GroupResult.of)
    job.loop.call(stream.start, groups)
    return job.loop.call(stream.counts)


def finished_groups(job: Job, n: int, timeout_s: float | None) -> list[GroupResult]:
    if job.stream is None:
        raise BadInputError("no group was started: call start_groups first")
    return job.loop.run(job.stream.take(n, timeout_s))


def take_groups(job: Job, results: list[GroupResult], ttl_s: float) -> LeaseResult:
    """A lease on exactly these groups' rows; a row another consumer holds, or that is not in
    the store, stops the run."""
    keys = [row.key for r in results for row in r.rows]
    lease = job.store.lease_keys("replay", "trainer", keys, ttl_s)
    got = set(lease.rows.column("key").to_pylist())
    if got != set(keys):
        missing = sorted(set(keys) - got)
        raise RecoveryError(
            f"{len(missing)} rows of the finished groups could not be leased (e.g. "
            f"{missing[0]}): leased by another consumer, or not in the store; the run "
            "stops (continue it with `train --restore`)"
        )
    return lease


def drop_groups(job: Job, results: list[GroupResult], reason: str) -> int:
    lease = take_groups(job, results, ttl_s=60.0)
    job.metrics.add(f"async.groups_dropped_{reason}", len(results))
    return job.store.ack(lease.lease_id)


def ack(job: Job, lease: LeaseResult) -> int:
    """With groups generating meanwhile, the cadence takes no snapshot from the ack until the
    trainer checkpoint (CheckpointCoordinator.ack_held): one would pair the older checkpoint
    with a buffer that lacks these rows."""
    if job.stream is None:
        return job.store.ack(lease.lease_id)
    return job.loop.run(job.coordinator.ack_held(lambda: job.store.aack(lease.lease_id)))


def push_weights(
    job: Job, weights_dir: str | Path, version: int | None, expect_sha256: str | None,
    in_flight: bool,
) -> int:  # fmt: skip
    """Weights whose digest is not `expect_sha256` (when given) are refused before any push."""
    digest = model_identity.directory_weights_digest(weights_dir)
    if expect_sha256 is not None and digest != expect_sha256:
        raise RestoreError(
            f"the weights in {weights_dir} have digest {digest[:12]}, the snapshot expects "
            f"{expect_sha256[:12]}; refusing to push them"
        )
    version = job.state.weight_version + 1 if version is None else version
    job.workers.push_weights(str(weights_dir), version, in_flight)
    job.state.served(version, digest)
    return version


def record_call_attempts(job: Job, step: int) -> int:
    return job.evidence.record_call_attempts(step) if job.cfg.token_capture.enabled else 0


def preempt(job: Job, timeout_s: float, step: int) -> dict:
    """Hold generation on every worker, then one checkpoint attempt (`preemption`) within
    `timeout_s`; then the engines' records go to the evidence log. Its metrics and `held`, or
    `failed` saying why: the run is ending either way."""
    t0 = time.monotonic()
    out: dict = {}
    try:
        if not faults.active("preemption_hold_disabled"):
            out["held"] = job.loop.run(job.workers.ahold_generation(), timeout_s)
        left = timeout_s - (time.monotonic() - t0)
        metrics = job.loop.run(job.coordinator.counted("preemption", left), left + 5.0)
    except Exception as err:  # reported: the run is ending either way
        return out | {"failed": one_line(err) or type(err).__name__}
    if metrics is None:
        return out | {"failed": "its checkpoint attempt failed (checkpoints.jsonl says why)"}
    record_call_attempts(job, step)
    return out | metrics


def notify_trainer_checkpoint(job: Job, step: int, digest: str | None) -> dict:
    """A failed attempt counts like any other (returns `failed`); too many in a row raise."""
    job.state.checkpointed(step, digest)
    if not job.cfg.checkpointing.save_data_plane:
        job.coordinator.release_hold()
        return {"snapshot_s": 0.0}
    metrics = job.loop.run(job.coordinator.counted("trainer_checkpoint"))
    if metrics is None:
        return {"snapshot_s": None, "failed": job.coordinator.failures_in_a_row}
    return {"snapshot_s": metrics["snapshot_s"], "snapshot": metrics["checkpoint"]}
