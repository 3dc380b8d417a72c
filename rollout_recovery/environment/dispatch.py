"""CallDispatcher: an episode's model calls on the workers, and failover when a worker dies.

`ctx.chat` ends here (the `ModelCalls` side of an episode context). A call waits while a
checkpoint is being taken (admission closed), resumes from the continuation its call is
waiting on (a restore's cut prefix, or a moved call's token log), and goes to the episode's
worker through that worker's `ModelCallClient` (token capture, lineage, exact prefix supply).
A worker that dies under a call does not fail it: the call moves to a live worker as the next
attempt, from the newest verified prefix of its chain (docs/failover.md), at most
`failover.max_migrations` times. Every call's state is one `InflightCall` in `calls`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import Counter

import httpx

from rollout_recovery.config import EnvironmentActorConfig
from rollout_recovery.environment.context import ChatReply
from rollout_recovery.environment.episode import EpisodeState, call_seed
from rollout_recovery.environment.inflight import CallTable
from rollout_recovery.environment.lineage import LineageStore
from rollout_recovery.environment.migration import token_log_continuation
from rollout_recovery.environment.model_client import ModelCallClient, ModelCallFailed
from rollout_recovery.environment.participant import CheckpointParticipant
from rollout_recovery.environment.token_entry import TokenEntry
from rollout_recovery.errors import RecoveryError
from rollout_recovery.generation.pool import WORKER_GONE, WorkerHandle, WorkerPool
from rollout_recovery.protocol import XARG_SEED, XARG_TEMPERATURE, CallIdentity, Continuation

# Request fields the environment sets itself: the position-keyed sampler takes the seed and
# temperature, logprobs are always captured, and one call is one choice.
OWN_FIELDS = ("model", "seed", "logprobs", "n", "messages")


class EpisodeFailed(RecoveryError):
    """An episode's call could not move to a live worker (max_migrations, no_live_worker):
    the step fails in one line, naming the call, the reason and the fix."""


class WorkerLost(Exception):
    """A call's worker died under it (`cause`: actor_dead, engine_dead, ...): the call moves."""

    def __init__(self, worker: int, cause: str, call: CallIdentity) -> None:
        super().__init__(f"worker {worker} lost ({cause}) during {call.key_prefix()}")
        self.worker, self.cause, self.call = worker, cause, call


class CallDispatcher:
    """The model calls of one environment's episodes; every method runs on its loop."""

    def __init__(
        self,
        cfg: EnvironmentActorConfig,
        workers: WorkerPool,
        store,
        sink,
        participant: CheckpointParticipant,
        counts: Counter[str],
        first_worker: int = 0,
    ) -> None:
        self.cfg, self.workers, self.store, self.sink = cfg, workers, store, sink
        self.participant, self.counts = participant, counts
        self.calls = CallTable()
        self.lineage = LineageStore()
        self._finish: dict[tuple[str, str], str | None] = {}  # shared by every client
        self.clients = [self._client(w) for w in workers]
        self._workers_changed = asyncio.Event()
        # Round robin from this environment's own offset, so N environments do not all start
        # on worker 0.
        self._next_worker = itertools.count(first_worker)
        self.events = 0  # calls started and answered (the liveness watch's)

    def adopt(self, st: EpisodeState, entry: TokenEntry, messages: list[dict], message: dict):
        """A call answered from the journal becomes lineage the next call resolves to."""
        self.clients[st.worker].adopt(entry, messages, message)

    async def call(
        self, st: EpisodeState, messages: list[dict], request: dict
    ) -> tuple[ChatReply, TokenEntry]:
        """The episode's next model call on its worker; a lost worker moves it (above)."""
        moves = 0
        while True:
            try:
                return await self._call_once(st, messages, request)
            except WorkerLost as lost:
                moves += 1
                self.counts[f"migrations.{lost.cause}"] += 1
                if moves > self.cfg.failover.max_migrations:
                    self.calls.forget_loss(st.rollout_id)
                    self.counts["migration_failed.max_migrations"] += 1
                    raise EpisodeFailed(
                        f"{lost.call.key_prefix()}: max_migrations - its worker died "
                        f"{moves} times (failover.max_migrations="
                        f"{self.cfg.failover.max_migrations}); raise failover.max_migrations, "
                        "or continue the run from its last snapshot with `train --restore`"
                    ) from lost
                await self._migrate(st, lost)

    async def _call_once(
        self, st: EpisodeState, messages: list[dict], request: dict
    ) -> tuple[ChatReply, TokenEntry]:
        g = self.cfg.policy.generation
        turn, call = len(st.turns), CallIdentity(st.rollout_id, st.next_call_id, st.attempt)
        state = self.calls.get(st.rollout_id)
        cont = state.waiting if state is not None else None
        if cont is not None and cont.call_id != call.model_call_id:
            cont = None
        kind = "migration" if state is not None and state.moved else "restore"
        fields = {k: v for k, v in request.items() if k not in OWN_FIELDS and v is not None}
        max_tokens = fields.pop("max_tokens", None) or g.max_new_tokens
        temperature = fields.pop("temperature", None)
        temperature = g.temperature if temperature is None else temperature
        xargs = {XARG_SEED: call_seed(st.seed, turn), XARG_TEMPERATURE: temperature}
        resumed = cont is not None and cont.cut
        if resumed:
            if kind == "restore":
                self.counts["restored_calls"] += 1
                self.counts["restored_prefix_tokens"] += cont.tokens
            xargs |= cont.to_request_fields(max_tokens)
        # Parked while a checkpoint is being taken; until the call is in flight, a checkpoint
        # records the continuation it waits on, and from then until it ends the sweep keeps
        # the rows the worker resumes it from.
        await self.participant.admitted()
        self.events += 1
        worker = st.worker
        self.calls.start(st.rollout_id, worker, call, cont)
        try:
            res = await self.clients[worker].call(
                st.rollout_id,
                call.model_call_id,
                messages,
                attempt=st.attempt,
                temperature=0.0,  # sampling is the position-keyed sampler's
                max_tokens=max_tokens,
                vllm_xargs=xargs,
                continues=tuple(st.turns),  # the episode's calls are one token sequence
                **fields,
            )
        except (httpx.TransportError, ModelCallFailed) as err:
            if not self.cfg.failover.enabled or (
                isinstance(err, ModelCallFailed) and err.status < 500
            ):
                raise
            # Keep this attempt's rows (and the prefix it resumed from) until the next
            # attempt is in flight: no await before this line.
            self.calls.lose(st.rollout_id)
            cause = await self._lost_cause(worker)
            if cause is None:
                self.calls.forget_loss(st.rollout_id)
                raise
            raise WorkerLost(worker, cause, call) from err
        finally:
            self.calls.ended(st.rollout_id)
            self.events += 1
        n = len(res.entry.generated_token_ids)
        st.decoded += n - (cont.tokens if resumed else 0)
        if resumed and kind == "migration":
            self.counts["migration.tail_tokens"] += n - cont.tokens
        elif resumed:
            self.counts["tail_tokens"] += n - cont.tokens
        elif cont is not None and kind == "restore":  # in flight at the checkpoint, not cut
            self.counts["regenerated_tokens"] += n
        message = res.assistant_message
        source = "resumed" if resumed else "decoded"
        reply = ChatReply(message, message.get("content") or "", res.entry.finish_reason,
                          list(res.entry.generated_token_ids), res.response, source,
                          call.model_call_id, st.attempt, res.response_text)  # fmt: skip
        return reply, res.entry

    def _client(self, w: WorkerHandle) -> ModelCallClient:
        tc = self.cfg.token_capture
        return ModelCallClient(
            w.info.url,
            w.info.served_model_name,
            self.sink,
            self.lineage,
            supply_prefix=tc.supply_prefix_token_ids,
            request_token_ids=tc.request_token_ids,
            turn_end_token_id=w.info.eos_token_id,
            finish=self._finish,
        )

    def assign_worker(self) -> int:
        """Round robin over the live workers (all of them when none is live: the call then
        waits for a replacement when it fails)."""
        live = [i for i, _ in self.workers.live()] or list(range(len(self.clients)))
        return live[next(self._next_worker) % len(live)]

    async def _lost_cause(self, index: int) -> str | None:
        """Why worker `index` is gone, or None when it is alive and well (the failure was the
        call's own). Asks the worker's actor: a dead actor or engine answers at once."""
        if index in self.workers.lost:
            return self.workers.lost[index]
        try:
            async with asyncio.timeout(self.cfg.failover.unhealthy_after_s):
                health = await self.workers[index].ahealth()
        except WORKER_GONE:
            cause = "actor_dead"
        except TimeoutError:
            cause = "health_timeout"
        else:
            if health.healthy:
                return None
            cause = (health.reason or "unhealthy").split(":")[0]
        self.workers.mark_lost(index, cause)
        return self.workers.lost.get(index, cause)

    async def _migrate(self, st: EpisodeState, lost: WorkerLost) -> None:
        """Make the lost call's next attempt: resumed from the newest verified prefix of its
        chain (or from scratch, counted), on a live worker."""
        partition = self.cfg.token_capture.staging_partition
        state = self.calls.get(st.rollout_id)
        resumed_from = state.lost_resumed_from if state is not None else None
        cont, refused = await token_log_continuation(self.store, partition, lost.call,
                                                   resumed_from)  # fmt: skip
        if refused is not None:
            self.counts[f"migration.token_log_refused.{refused}"] += 1
        if cont is None:
            cont = Continuation(call_id=lost.call.model_call_id, attempt=lost.call.attempt)
            self.counts["migration.from_scratch"] += 1
        else:
            self.counts["migration.resumed"] += 1
            self.counts["migration.token_log_tokens"] += cont.tokens or 0
        st.attempt = lost.call.attempt + 1
        # A checkpoint taken meanwhile records it (and keeps its rows).
        self.calls.wait_on(st.rollout_id, cont, moved=True)
        st.worker = await self._live_worker(st)

    async def _live_worker(self, st: EpisodeState) -> int:
        """A live worker for a moving call; waits for a replacement when none is live."""
        deadline = time.monotonic() + self.cfg.failover.replacement_wait_s
        while True:
            live = [i for i, _ in self.workers.live()]
            if live:
                return live[next(self._next_worker) % len(live)]
            self._workers_changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                self.counts["migration_failed.no_live_worker"] += 1
                raise EpisodeFailed(
                    f"{st.rollout_id}: no_live_worker - no worker came back within "
                    f"failover.replacement_wait_s={self.cfg.failover.replacement_wait_s}; "
                    "raise it, or see why no replacement worker started (the run's log), then "
                    "continue the run from its last snapshot with `train --restore`"
                )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._workers_changed.wait()

    def worker_lost(self, index: int, cause: str) -> None:
        """The controller found worker `index` dead: no new call goes there."""
        self.workers.mark_lost(index, cause)

    async def worker_replaced(self, index: int, handle: WorkerHandle) -> None:
        """A started replacement on the current weights takes slot `index`."""
        old = self.clients[index]
        self.workers.workers[index] = handle
        self.workers.lost.pop(index, None)
        self.clients[index] = self._client(handle)
        self.counts["workers_replaced"] += 1
        self._workers_changed.set()
        await old.aclose()

    def diagnostics(self) -> dict[str, int]:
        """The model clients' capture counts and the lineage store's resolutions."""
        capture: Counter[str] = Counter()
        for client in self.clients:
            capture.update({f"capture.{k}": v for k, v in client.diagnostics.snapshot().items()})
        return dict(capture) | {f"lineage.{k}": v for k, v in self.lineage.stats().items()}

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()
