"""The controller as a Ray actor, and a standby one started ahead (failover.standby_controller).

The placement, the store and the workers are started here, in the trainer's process, so that
they outlive the controller (Ray ends an actor with its owner): a restore after its death keeps
them (run.py)."""

from __future__ import annotations

import logging

from rollout_recovery.api import RolloutRecovery
from rollout_recovery.config import RolloutRecoveryConfig
from rollout_recovery.controller.job import Engines, claim_snapshot_root, job_config, start_engines
from rollout_recovery.controller.restore import with_token_log_uri
from rollout_recovery.data_plane.ownership import Owner
from rollout_recovery.errors import ComponentLost
from rollout_recovery.runtime import ActorProxy, init_ray
from rollout_recovery.storage import RunStorage

log = logging.getLogger("rollout_recovery")

# One call at a time, and beside it the `control` group: a preemption's final checkpoint and
# close run while the call its notice interrupted still holds the default group.
CONTROLLER_OPTIONS = {"num_cpus": 0, "max_concurrency": 1, "concurrency_groups": {"control": 1}}


def start_standby(cfg: RolloutRecoveryConfig, ray_address: str = "local") -> ActorProxy:
    """A controller process started ahead and left idle, holding no job and claiming nothing:
    after the controller's death `start_controller` gives it the job, so the restore does not
    wait for a new process to start (`failover.standby_controller`). Returns at once; the
    process starts in the background."""
    return ActorProxy(RolloutRecovery, (cfg, ray_address), **CONTROLLER_OPTIONS)


def start_controller(
    cfg: RolloutRecoveryConfig, ray_address: str = "local", owner: Owner | None = None,
    engines: Engines | None = None, standby: ActorProxy | None = None,
) -> tuple[ActorProxy, Engines]:  # fmt: skip
    """The RolloutRecovery controller as a Ray actor, used through the same calls as the
    in-process object, and the engines it runs on. `owner` is the claim on the run's snapshot
    root (`train` claims before it restores); without one it is claimed here. The placement,
    the store and the workers are started here, in the caller's process, so that they outlive
    the controller (Ray ends an actor with its owner); `engines`: those of a controller that
    died, reset for this one instead (controller/job.py). `standby`: a controller started ahead
    for `cfg` (`start_standby`) takes the job; where it died meanwhile a new one starts."""
    if owner is None:  # claimed here, in the caller: its error is one line
        owner = claim_snapshot_root(RunStorage(cfg.checkpointing.checkpoint_dir))
    init_ray(ray_address, log_to_driver=False)
    if engines is None:
        storage = RunStorage(cfg.checkpointing.checkpoint_dir)
        job_cfg, _ = job_config(with_token_log_uri(cfg), storage, owner)
        engines = start_engines(job_cfg)
    try:
        if standby is not None and _took_over(standby, owner, engines):
            return standby, engines
        proxy = ActorProxy(RolloutRecovery, (cfg, ray_address, owner, engines), start="start",
                           **CONTROLLER_OPTIONS)  # fmt: skip
    except BaseException:
        engines.stop()
        raise
    return proxy, engines


def _took_over(standby: ActorProxy, owner: Owner, engines: Engines) -> bool:
    """Whether `standby` took the job; False where it had died (a new controller starts)."""
    try:
        standby.take_over(owner, engines)
    except ComponentLost as err:
        if err.component != "controller":
            raise
        log.warning("the standby controller had died (%s): starting a new one", err.reason)
        standby.kill()
        return False
    return True
