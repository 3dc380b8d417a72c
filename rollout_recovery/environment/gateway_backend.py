"""The rollout gateway's backend: an HTTP call on `/rollouts/{id}/v1` becomes `ctx.chat` of
that rollout's running episode, on the environment's loop.

So a harness in another process gets everything an episode function gets: capture, lineage,
the parent's exact prefix, parking during checkpoints, cuts, and after a restore the calls it
already made answered from the journal (with the response it got the first time) and the call
in flight continued from its prefix. A rollout exists while its episode runs; calls to one
that finished get 409, to one never seen 404. One rollout serves one call at a time, since
its journal is one sequence; a call that does not continue the rollout's previous call is
refused at once (400, the rollout stays open), since its calls become one token sequence. A
journaled call is answered with the worker's response body as the journal keeps it (text), so
a replay answers byte for byte as the first time.

A standalone gateway (`rollout-recovery gateway`) also opens and finishes rollouts from outside:
`OutsideRollouts` runs each one's episode with a function that waits for the harness's result.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

from rollout_recovery.data_plane import table_to_replay_rows
from rollout_recovery.environment.context import EpisodeContext, JournalDiverged
from rollout_recovery.environment.episode import EpisodeState
from rollout_recovery.environment.model_client import CallNotContinued, ModelCallFailed
from rollout_recovery.environment.runner import EpisodeRunner
from rollout_recovery.gateway.wire import (
    CallRefused,
    GatewayError,
    GatewayReply,
    RolloutFinished,
    UnknownRollout,
)
from rollout_recovery.protocol import EpisodeOutcome, replay_key, rollout_id

SOURCE_HEADER = "x-rollout-recovery-source"
CALL_HEADER = "x-rollout-recovery-call-id"
ATTEMPT_HEADER = "x-rollout-recovery-attempt"
# Fields of the worker's response the gateway asked for itself (capture), not the harness.
CAPTURE_FIELDS = ("prompt_token_ids", "prompt_logprobs", "kv_transfer_params")


class RolloutRefused(RuntimeError):
    """An outside rollout-control call this environment cannot honour; `reason` names why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class OutsideRollouts:
    """Rollouts opened and finished from outside: each one's episode runs with a function that
    waits for the harness's result. Every method runs on the environment's loop."""

    def __init__(self, runner: EpisodeRunner) -> None:
        self.runner = runner
        self._results: dict[str, asyncio.Future] = {}  # the harness's result, per rollout
        self._open: dict[str, asyncio.Future] = {}  # each open rollout's episode

    def __contains__(self, rid: object) -> bool:
        return rid in self._results

    async def open(
        self, group_id: str, index: int, seed: int, task: dict, weight_version: int
    ) -> tuple[EpisodeState, bool]:
        """Open a rollout. One a restore brought back replays its journal to the harness
        that makes its calls again."""
        runner = self.runner
        rid, key = rollout_id(group_id, index), replay_key(group_id, index)
        if rid in runner.finished or key in await runner.store.alist("replay", key):
            raise RolloutRefused("rollout_finished", f"rollout {rid} has finished")
        if rid in self._results:
            raise RolloutRefused("rollout_open", f"rollout {rid} is open; finish it first")
        restored = runner.pending.get(rid)
        if restored is not None and restored.task != task:
            raise RolloutRefused("task_differs", f"rollout {rid} was restored with another task; "
                                 "open it with the task it had")  # fmt: skip
        st, was_restored = runner.admit(rid, group_id, index, seed, task)
        self._results[rid] = asyncio.get_running_loop().create_future()
        self._open[rid] = asyncio.ensure_future(
            runner.run_episode(st, weight_version, was_restored, self._harness_result)
        )
        return st, was_restored

    async def _harness_result(self, ctx: EpisodeContext, task: dict) -> Any:
        return await asyncio.shield(self._results[ctx.rollout_id])

    async def finish(self, rid: str, result: Any) -> EpisodeOutcome:
        """The harness's result: the episode ends, its row is written to `replay`."""
        future = self._results.get(rid)
        if future is None:
            if rid in self.runner.finished:
                raise RolloutRefused("rollout_finished", f"rollout {rid} has finished")
            raise RolloutRefused("unknown_rollout", f"no rollout {rid} is open")
        if future.done():
            raise RolloutRefused("rollout_finishing", f"rollout {rid} is being finished")
        future.set_result(result)
        try:
            return await self._open[rid]
        finally:
            self._open.pop(rid, None)
            self._results.pop(rid, None)

    async def abandon(self, rid: str, reason: str) -> None:
        """A rollout whose harness diverged from its journal: it is closed, and opening it
        again starts it over as a fresh attempt (counted by reason)."""
        task = self._open.pop(rid, None)
        self._results.pop(rid, None)
        await self.runner.start_over(rid, reason, task)

    async def aclose(self) -> None:
        """Rollouts still open end here (a checkpoint holds what they did)."""
        for task in self._open.values():
            task.cancel()
        await asyncio.gather(*self._open.values(), return_exceptions=True)


class EpisodeGateway:
    """`GatewayBackend` over an `EpisodeRunner`; every episode step runs on `loop`."""

    def __init__(self, runner: EpisodeRunner, loop: asyncio.AbstractEventLoop) -> None:
        self.runner, self.loop = runner, loop
        self._busy: set[str] = set()
        self.outside: OutsideRollouts | None = None  # a standalone gateway's

    def rollouts(self) -> list[str]:
        """The rollouts whose episode runs (calls are served)."""
        return sorted(self.runner.contexts)

    async def listing(self) -> list[dict[str, Any]]:
        """`GET /rollouts`: every open rollout with its state - `running` (its episode runs),
        `restored` (a restore brought it back; it waits to be opened, or for its step), or
        `started_over` (its replay diverged; opened again, it starts over)."""
        return await self._on_loop(self._listing())

    async def _listing(self) -> list[dict[str, Any]]:
        runner, out = self.runner, []
        for st in runner.episodes.values():
            out.append(_listed(st, "running"))
        for st in runner.pending.values():
            out.append(_listed(st, "started_over" if st.started_over else "restored"))
        return sorted(out, key=lambda entry: entry["rollout_id"])

    async def _on_loop(self, coro) -> Any:
        """Run `coro` on the environment's loop (the server has its own) and await it here."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def chat(self, rollout_id: str, body: dict) -> GatewayReply:
        return await self._on_loop(self._chat(rollout_id, body))

    async def _chat(self, rollout_id: str, body: dict) -> GatewayReply:
        ctx = self.runner.contexts.get(rollout_id)
        if ctx is None:
            if rollout_id in self.runner.finished:
                raise RolloutFinished(f"rollout {rollout_id} has finished; start another rollout")
            raise UnknownRollout(f"no episode {rollout_id} is running in this environment")
        if rollout_id in self._busy:
            raise CallRefused(
                f"rollout {rollout_id} is serving a call; one rollout makes one call at a time",
                reason="call_in_progress",
            )
        fields = dict(body)
        messages = fields.pop("messages")
        want_logprobs = bool(fields.pop("logprobs", False))
        top = fields.pop("top_logprobs", None)
        if want_logprobs and top:
            fields["top_logprobs"] = top
        max_tokens = fields.pop("max_completion_tokens", None) or fields.pop("max_tokens", None)
        for name in ("model", "seed", "n", "user", "metadata", "frequency_penalty",
                     "presence_penalty"):  # fmt: skip
            fields.pop(name, None)  # the environment's own, or no effect on the tokens
        self._busy.add(rollout_id)
        try:
            reply = await ctx.chat(messages, max_tokens=max_tokens, keep_response=True, **fields)
        except ModelCallFailed as err:
            if err.status >= 500:
                raise
            raise GatewayError(f"the worker refused the call: {err.text[:500]}",
                               reason="worker_rejected", status=400) from None  # fmt: skip
        except CallNotContinued as err:  # nothing recorded: the rollout takes the call again
            refused = GatewayError(str(err), reason=err.reason, status=400)
            refused.param = "messages"
            raise refused from None
        except JournalDiverged as err:
            if self.outside is not None and rollout_id in self.outside:  # opened again
                await self.outside.abandon(rollout_id, err.reason)
                again = "; open the rollout again to start it over"
            else:
                again = "; the episode starts over"
            raise CallRefused(
                f"rollout {rollout_id} asked for another call than it made before the restore "
                f"({err}){again}",
                reason="replay_diverged",
            ) from None
        finally:
            self._busy.discard(rollout_id)
        if reply.response is None:
            raise CallRefused(f"{rollout_id}/{reply.call_id} has no recorded response",
                              reason="no_recorded_response")  # fmt: skip
        # From the body as the worker returned it (its keys in its order), the same way for a
        # decoded call and its replay: the answer is the same bytes both times.
        worker = json.loads(reply.response_text) if reply.response_text else reply.response
        response = _as_asked(worker, want_logprobs)
        headers = {SOURCE_HEADER: reply.source, CALL_HEADER: reply.call_id,
                   ATTEMPT_HEADER: str(reply.attempt)}  # fmt: skip
        return GatewayReply(response, headers)


def _listed(st: EpisodeState, state: str) -> dict[str, Any]:
    return {"rollout_id": st.rollout_id, "state": state, "attempt": st.attempt,
            "journaled_steps": len(st.replay)}  # fmt: skip


def _as_asked(response: dict[str, Any], logprobs: bool) -> dict[str, Any]:
    """The worker's response without what the environment asked for on its own behalf."""
    out = copy.deepcopy(response)
    for name in CAPTURE_FIELDS:
        out.pop(name, None)
    for choice in out.get("choices", []):
        choice.pop("token_ids", None)
        if not logprobs:
            choice["logprobs"] = None
    return out


class StandaloneGateway(EpisodeGateway):
    """A gateway whose rollouts are opened and finished from outside, and whose finished
    rollouts are leased for training over HTTP (`rollout-recovery gateway`)."""

    def __init__(
        self, runner: EpisodeRunner, loop: asyncio.AbstractEventLoop, weight_version: int
    ) -> None:
        super().__init__(runner, loop)
        self.weight_version = weight_version
        self.outside = OutsideRollouts(runner)
        self._leases: dict[str, _Lease] = {}  # the leases this gateway gave, until they expire

    async def open_rollout(self, body) -> dict:
        seed = body.seed
        if seed is None:  # stable per rollout, so a reopened rollout samples the same
            digest = hashlib.sha256(f"{body.group_id}/{body.generation_index}".encode()).digest()
            seed = int.from_bytes(digest[:7], "little")
        opened = self.outside.open(body.group_id, body.generation_index, seed,
                                          body.task, self.weight_version)  # fmt: skip
        try:
            st, restored = await self._on_loop(opened)
        except RolloutRefused as err:
            raise _refusal(err) from None
        base = f"{self.runner.gateway_url}/rollouts/{st.rollout_id}/v1"
        return {"rollout_id": st.rollout_id, "base_url": base, "attempt": st.attempt,
                "restored": restored, "journaled_steps": len(st.replay)}  # fmt: skip

    async def finish_rollout(self, rollout_id: str, result: Any) -> dict:
        try:
            outcome = await self._on_loop(self.outside.finish(rollout_id, result))
        except RolloutRefused as err:
            raise _refusal(err) from None
        except Exception as err:  # the episode failed: its result or trajectory was unusable
            raise CallRefused(f"rollout {rollout_id} failed: {err}", reason="rollout_failed",
                              status=422) from None  # fmt: skip
        row = outcome.row
        return {"rollout_id": rollout_id, "replay_key": row.key, "reward": row.reward,
                "tokens": len(row.token_ids), "decoded_tokens": outcome.decoded_tokens}  # fmt: skip

    async def lease(self, body) -> dict:
        store = self.runner.store
        # Taken before the store's own clock starts: this deadline is never after the store's.
        deadline = time.monotonic() + body.ttl_s
        leased = await self._on_loop(store.alease("replay", "gateway", body.max_rows, body.ttl_s))
        self._forget_expired()
        self._leases[leased.lease_id] = _Lease(leased.rows.num_rows, deadline)
        rows = [_row_json(r) for r in table_to_replay_rows(leased.rows)]
        return {"lease_id": leased.lease_id, "rows": rows}

    async def ack(self, lease_id: str) -> dict:
        """Consume a lease this gateway gave. One that expired (its rows are delivered again)
        or never existed is 409 `unknown_lease`: the store's ack answers 0 for both, which
        would read as success. A second ack of the same lease, before it would have expired,
        answers 0 as before."""
        self._forget_expired()
        held = self._leases.get(lease_id)
        if held is None:
            raise _unknown_lease(lease_id, "no such lease: it expired (its rows are delivered "
                                 "again) or never existed")  # fmt: skip
        if held.acked:
            return {"acked": 0}
        try:
            acked = await self._on_loop(self.runner.store.aack(lease_id))
        except Exception as err:  # an unknown or expired lease
            raise _unknown_lease(lease_id, str(err)) from None
        if acked == 0 and held.rows and time.monotonic() >= held.deadline:
            del self._leases[lease_id]
            raise _unknown_lease(lease_id, f"it expired (ttl_s passed): its {held.rows} rows "
                                 "are delivered again")  # fmt: skip
        held.acked = True
        return {"acked": acked}

    def _forget_expired(self) -> None:
        now = time.monotonic()
        for lease_id in [k for k, held in self._leases.items() if held.deadline <= now]:
            del self._leases[lease_id]


@dataclass
class _Lease:
    rows: int
    deadline: float  # time.monotonic()
    acked: bool = False


def _unknown_lease(lease_id: str, why: str) -> GatewayError:
    return GatewayError(f"cannot acknowledge lease {lease_id}: {why}", reason="unknown_lease",
                        status=409)  # fmt: skip


def _refusal(err: RolloutRefused) -> GatewayError:
    if err.reason == "unknown_rollout":
        return UnknownRollout(str(err))
    return CallRefused(str(err), reason=err.reason)


def _row_json(row) -> dict[str, Any]:
    return {
        "key": row.key,
        "rollout_id": row.rollout_id,
        "group_id": row.group_id,
        "generation_index": row.generation_index,
        "prompt_len": row.prompt_len,
        "token_ids": row.token_ids.tolist(),
        "loss_mask": row.loss_mask.tolist(),
        "logprobs": None if row.logprobs is None else row.logprobs.tolist(),
        "reward": row.reward,
        "weight_version": row.weight_version_max,
    }
