"""A preemption's final checkpoint, as the trainer asks for it: every call held and cut, a
snapshot published within the grace left (less the time to stop), logged, and one line saying
what was saved and what to run next (docs/preemption.md)."""

from __future__ import annotations

import contextlib

from rollout_recovery.config import RolloutRecoveryConfig
from rollout_recovery.errors import ComponentLost, RecoveryError
from rollout_recovery.preemption import NoticeWatch
from rollout_recovery.runtime import ActorProxy
from rollout_recovery.storage import RunStorage
from rollout_recovery.trainer import step_log

CLOSE_S = 5.0  # of a preemption's grace, kept for stopping the job after its checkpoint


def final_checkpoint(
    notices: NoticeWatch, rollouts: ActorProxy | None, storage: RunStorage,
    cfg: RolloutRecoveryConfig, step: int,
) -> None:  # fmt: skip
    """`step`: the trainer step under way (its snapshot's and the engines' records')."""
    notice, grace = notices.notice, cfg.preemption.grace_s
    left = notices.time_left() - min(CLOSE_S, grace / 5)
    if rollouts is None or left <= 0:
        out = {"failed": f"no time left of preemption.grace_s={grace:g}"}
    else:
        try:
            out = rollouts.call_in("control", "preempt", left, step)
        except ComponentLost as err:  # a death while preempting (healing.py): it failed
            out = {"failed": str(err)}
    event = {"event": "preempted", "notice": notice, "step": step} | {
        k: out[k]
        for k in ("held", "checkpoint", "calls_cut", "calls_not_cut", "failed", "save_s")
        if k in out
    }
    with contextlib.suppress(RecoveryError, OSError):  # the line below says it either way
        step_log.append(storage, event)
    if "failed" in out:
        held = "snapshot holds"
        if cfg.token_capture.log_interval_tokens:
            held = "snapshot and the token log hold"
        print(f"preempted ({notice}): the final checkpoint did not finish within "
              f"preemption.grace_s={grace:g} ({out['failed']}); the last published {held} "
              "the run (none published: the run starts again from step 0): continue it "
              "with `train --restore`", flush=True)  # fmt: skip
        return
    print(f"preempted ({notice}): {out.get('held', 0)} calls in flight held, "
          f"{out.get('calls_cut', 0)} cut; snapshot {out['checkpoint']} published in "
          f"{out['save_s']:.1f} s; continue with `train --restore`", flush=True)  # fmt: skip
