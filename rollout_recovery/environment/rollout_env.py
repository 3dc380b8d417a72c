"""RolloutEnvironment: the environment actor - episodes against the workers' OpenAI endpoints,
and the environment's side of each checkpoint and restore (docs/design.md §2, §4).

The work itself is `EpisodeRunner`'s and its parts', on one private event loop that owns the
HTTP connection pools. The public methods here are synchronous, so Ray hosts this class as a
threaded actor (`max_concurrency`) rather than on one event loop: a checkpoint's `prepare` must
not queue behind a running `run_groups`.

A job may run several of these (`placement.environment.actors`): actor `index` of `count`
runs and records only the episodes whose rollout id is its own (`protocol.environment_of`);
`EnvironmentClient` fans each call out and merges the answers.
"""

from __future__ import annotations

from collections import Counter

from rollout_recovery import faults
from rollout_recovery.config import EnvironmentActorConfig
from rollout_recovery.environment.episode import EpisodeState, RecordError
from rollout_recovery.environment.gateway_backend import EpisodeGateway, StandaloneGateway
from rollout_recovery.environment.runner import EpisodeRunner
from rollout_recovery.gateway import GatewayServer, create_app
from rollout_recovery.generation.pool import WorkerHandle, WorkerPool
from rollout_recovery.protocol import (
    CheckpointRecords,
    EnvironmentProgress,
    EpisodeOutcome,
    EpisodeRecord,
)
from rollout_recovery.runtime import LoopThread


class RolloutEnvironment:
    def __init__(
        self,
        cfg: EnvironmentActorConfig,
        workers: WorkerPool,
        store,
        scratch_root: str | None = None,
        index: int = 0,
        count: int = 1,
    ) -> None:
        self._loop = LoopThread("rollout-environment")
        self.runner = EpisodeRunner(cfg, workers, store, scratch_root, index, count)
        self.refused: Counter[str] = Counter()  # restore_refused.<reason>
        self._gateway: GatewayServer | None = None
        self._backend: EpisodeGateway | None = None

    @property
    def sink(self):
        return self.runner.sink

    def run_groups(
        self, groups: list[tuple[str, dict]], seeds: list[list[int]], weight_version: int
    ) -> list[EpisodeOutcome]:
        """Run `len(seeds[g])` episodes per (group id, task), those of this environment's
        rollouts; one outcome per such episode, in order. Episodes whose row is already in
        `replay` are not run again; restored ones replay their journal."""
        return self._loop.run(self.runner.run_groups(groups, seeds, weight_version))

    def start_gateway(self, token: str, standalone_weight_version: int | None = None) -> str:
        """Serve the rollout gateway (`gateway.host`/`port`); its base URL. Standalone (with
        the weight version its rows record): rollouts are opened and finished over HTTP."""
        g = self.runner.cfg.gateway
        if standalone_weight_version is None:
            backend = EpisodeGateway(self.runner, self._loop.loop)
        else:
            backend = StandaloneGateway(self.runner, self._loop.loop, standalone_weight_version)
        self._gateway, self._backend = GatewayServer(), backend
        url = self._gateway.start(create_app(backend, token), g.host, g.port)
        self._loop.call(self.runner.serve_gateway, url, token)
        return url

    def prepare(self, ckpt: str, lease_s: float) -> dict:
        """Close admission and (prefix level) cut every in-flight call."""
        return self._loop.run(self.runner.prepare(ckpt, lease_s))

    def commit(self, ckpt: str) -> CheckpointRecords:
        return self._loop.run(self.runner.commit(ckpt))

    def reopen(self, ckpt: str) -> None:
        """End of a checkpoint, committed or aborted: reopen admission."""
        self._loop.call(self.runner.participant.reopen, ckpt)

    def begin_restore(self, restore_id: str) -> None:
        """Refused once this environment has served calls (their effects would mix in)."""
        self._loop.call(self.runner.participant.restore, restore_id)

    def end_restore(self, restore_id: str, records: list[EpisodeRecord], step: int = 1) -> int:
        """Load the episode records of a restored snapshot (their token entries come from
        the restored store); returns how many episodes are unfinished. Each goes on as its
        record's attempt + `step` (restore.attempt_step: distinct per restore). A record that
        cannot be restored exactly fails closed: its episode starts over, counted by reason.
        Chunk rows the records do not name belonged to calls that are gone: they are deleted."""
        entries = self.sink.get_many([t.entry_id for rec in records for t in rec.turns])
        episodes = []
        for rec in records:
            if rec.turns and faults.active("redecode_committed_turns"):
                episodes.append(EpisodeState.restart(rec, step))
                continue
            try:
                episodes.append(EpisodeState.from_record(rec, entries.get, step))
            except RecordError as err:
                self.refused[f"restore_refused.{err.reason}"] += 1
                episodes.append(EpisodeState.restart(rec, step))
        return self._loop.run(self.runner.load(restore_id, episodes))

    def worker_lost(self, index: int, cause: str) -> None:
        """The controller found worker `index` dead: new calls avoid it."""
        self._loop.call(self.runner.dispatch.worker_lost, index, cause)

    def worker_replaced(self, index: int, handle: WorkerHandle) -> None:
        """A replacement on the current weights serves slot `index` from now on."""
        self._loop.run(self.runner.dispatch.worker_replaced(index, handle))

    def progress(self) -> EnvironmentProgress:
        """What the episodes are doing now (the controller's liveness watch)."""
        return self._loop.call(self.runner.progress)

    def counters(self) -> dict[str, int]:
        return self._loop.call(self.runner.diagnostics) | dict(self.refused)

    def close(self) -> None:
        if self._gateway is not None:
            self._gateway.stop()
        if self._backend is not None and self._backend.outside is not None:
            self._loop.run(self._backend.outside.aclose())
        self._loop.run(self.runner.aclose())
        self._loop.stop()
