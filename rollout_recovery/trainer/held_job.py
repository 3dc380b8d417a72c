"""The job as the trainer's process holds it: the controller actor, the engines this process
started for it (so they outlive the controller), and the standby controller. Closing it after
a death keeps what the healing table (healing.py) says serves the restore."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

from rollout_recovery.config import RolloutRecoveryConfig
from rollout_recovery.controller.job import Engines
from rollout_recovery.controller_actor import start_controller, start_standby
from rollout_recovery.data_plane.ownership import Owner
from rollout_recovery.errors import ComponentLost
from rollout_recovery.healing import KEEPS_ENGINES, Action, Circumstances, Phase, decide
from rollout_recovery.runtime import ActorProxy


@dataclass
class Kept:
    """What a restore in this process keeps of the job before (`TrainingRun.keep_running`):
    its engines, its controller when that is alive (halted) to build the job again, and the
    standby controller that takes the job after the controller's death."""

    controller: ActorProxy | None
    engines: Engines
    standby: ActorProxy | None = None

    def stop(self) -> None:
        for actor in (self.controller, self.standby):
            if actor is not None:
                with contextlib.suppress(Exception):
                    actor.kill()
        self.engines.stop()


@dataclass
class HeldJob:
    rollouts: ActorProxy  # the controller actor (controller_actor.py)
    engines: Engines | None  # started here for it; None once the controller stopped them
    ray_address: str
    standby: ActorProxy | None = None  # failover.standby_controller

    @classmethod
    def start(
        cls, cfg: RolloutRecoveryConfig, ray_address: str, owner: Owner, kept: Kept | None
    ) -> HeldJob:
        """A new controller (on `kept` engines, by the standby where one is up), or the halted
        controller of `kept`, built again around its engines as `owner`."""
        if kept is None or kept.controller is None:
            engines, standby = (kept.engines, kept.standby) if kept else (None, None)
            rollouts, engines = start_controller(cfg, ray_address, owner, engines, standby)
            return cls(rollouts, engines, ray_address)
        job = cls(kept.controller, kept.engines, ray_address, kept.standby)
        kept.controller.restart(owner)
        return job

    def start_standby(self, cfg: RolloutRecoveryConfig) -> None:
        """Start the standby controller (`failover.standby_controller`), once."""
        if self.standby is None:
            self.standby = start_standby(cfg, self.ray_address)

    def close(
        self, cfg: RolloutRecoveryConfig, preempted: bool, lost: ComponentLost | None,
        restores_left: bool,
    ) -> Kept | None:  # fmt: skip
        """Stop the job; after a death (`lost`), what the healing table keeps for the restore
        is returned instead of stopped. After a preemption nothing the job holds is needed;
        otherwise the controller stops gracefully (and stops the engines), and whatever it did
        not stop is ended here."""
        kept = None
        try:
            kept = self._keep(cfg, lost, restores_left) if lost is not None else None
            if kept is not None:
                self.engines = self.standby = None  # handed on
            elif preempted or lost:
                self.rollouts.kill()
            else:
                try:
                    self.rollouts.close()
                    self.engines = None  # the controller stopped them
                except ComponentLost:  # the controller died under the loop's own error
                    self.rollouts.kill()
        finally:
            if self.standby is not None:
                with contextlib.suppress(Exception):
                    self.standby.kill()
                self.standby = None
            if self.engines is not None:  # however the controller ended
                engines, self.engines = self.engines, None
                engines.stop()
        return kept

    def _keep(
        self, cfg: RolloutRecoveryConfig, lost: ComponentLost, restores_left: bool
    ) -> Kept | None:
        """What of the job serves its restore, as the healing table decides, or None: the
        engines start again (or the run ends). After the controller's death its engines, which
        this process started, are alive: the standby or a new controller resets them. After a
        store shard's or the environment actor's death the controller is alive too: the other
        store shards and environment actors are ended (`halt`), its call still waiting on them
        must end within `failover.settle_s`, and it builds the job again itself (`restart`)."""
        fo, engines = cfg.failover, self.engines
        c = Circumstances(
            failover=fo.enabled,
            keep_engines=fo.keep_engines and engines is not None,
            restores_left=restores_left,
            standby=self.standby is not None,
        )
        action = decide(lost.component, Phase.RUNNING, c)
        if action not in KEEPS_ENGINES:
            return None
        if action is not Action.REBUILD_ON_KEPT_ENGINES:  # the controller died
            self.rollouts.kill()
            engines.drop_store()  # its shards hold their placement; the restore starts anew
            return Kept(None, engines, self.standby)
        try:
            self.rollouts.call_in("control", "halt", timeout=fo.settle_s)
            settled = self.rollouts.settled(fo.settle_s)
        except Exception:  # the controller is gone or stuck: the engines start again
            settled = False
        if decide(lost.component, Phase.RUNNING, replace(c, settled=settled)) in KEEPS_ENGINES:
            engines.drop_store()
            return Kept(self.rollouts, engines, self.standby)
        return None
