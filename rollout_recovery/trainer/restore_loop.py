"""`TrainingRun.keep_running`'s loop: a death of an actor the job cannot do without
(`ComponentLost`) is restored from in the same process, up to `failover.max_restores` times, as
the healing table (healing.py) decides; each restore is said on the terminal and logged."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from rollout_recovery.config import RolloutRecoveryConfig
from rollout_recovery.errors import ComponentLost
from rollout_recovery.healing import Action, Circumstances, Phase, decide
from rollout_recovery.trainer import step_log

if TYPE_CHECKING:  # run.py imports this module
    from rollout_recovery.run import TrainingRun

T = TypeVar("T")


def restore_in_process(
    open_run: Callable[..., TrainingRun], cfg: RolloutRecoveryConfig,
    loop: Callable[[TrainingRun], T], restore: bool, ray_address: str,
) -> T:  # fmt: skip
    """`loop(run)` in a run `open_run` opened, opened again (keeping what the run kept of its
    job) after each death the table restores from; the ComponentLost of one death more ends
    it, its line saying to continue with `train --restore`."""
    restores, lost, stopped_at, kept = 0, None, 0.0, None
    while True:
        run = None
        try:
            with open_run(cfg, restore, ray_address, kept) as run:
                run.restores_left = restores < cfg.failover.max_restores
                if kept is not None and not run.opened.get("engines_kept"):
                    print("the engines could not be kept (a worker was lost or replaced): "
                          "they started again", flush=True)  # fmt: skip
                if lost is not None:  # with the time to recover, by part
                    step_log.append(run.storage, {
                        "event": "restored_in_process", "component": lost.component,
                        "reason": lost.reason, "restores": restores,
                        "step": run.start_step, "noticed_at": lost.at,
                        "stopped_s": stopped_at - lost.at, **run.opened})  # fmt: skip
                return loop(run)
        except BaseException as err:
            if run is None and kept is not None:  # `open` failed before it took them
                kept.stop()
                kept = None
            if not isinstance(err, ComponentLost):
                raise
            stopped_at = time.time()  # the rest of the job was stopped on the way out
            kept = run.kept if run is not None else None
            allowed = cfg.failover.max_restores
            left = Circumstances(restores_left=restores < allowed)
            phase = Phase.STARTING if run is None else Phase.RUNNING
            if decide(err.component, phase, left) is Action.END_RUN:
                used = (f"{err}; failover.max_restores={allowed} restores in this process "
                        "were used: continue the run with `train --restore`")  # fmt: skip
                if kept is not None:
                    kept.stop()
                raise ComponentLost(err.component, err.reason, used) from None
            restores, lost, restore = restores + 1, err, True
            engines = "starting the engines again" if kept is None else "keeping the engines"
            print(f"{err}: restoring the run in this process from its newest snapshot, "
                  f"{engines} ({restores} of failover.max_restores={allowed})",
                  flush=True)  # fmt: skip
