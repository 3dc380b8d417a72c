"""Cutting in-flight calls into durable chunk rows, and staging terminal rows.

A cut reads every listed call's progress (its token count) under the capture lock once; the
tokens past what was already staged, and their logprobs, are copied after the lock is released
(vLLM only appends to those containers, so the counted prefix is stable). New tokens become
one chunk per call, chained on the call's previous chunk, and are put into the StagingStore in
bounded batches before the receipt says `durable_prefix`.
A cut never fails as a whole: each call is either durable or a `durable_failure` with a named
reason, and a call not reached by the deadline is `control_deadline` with nothing left behind.

A call that had already finished when its progress was read is cut as `terminal_completion`:
its last chunk carries the finish record (finish reason, stop reason), sealed into the chained
digest, so a resume answers it without decoding. The label, the token count and the finish
record are all read in the same locked moment.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from rollout_recovery import faults
from rollout_recovery.crashpoints import crash_point
from rollout_recovery.data_plane.digest import chain_digest, finish_digest, token_digest
from rollout_recovery.data_plane.schemas import (
    ChunkRow,
    TerminalRow,
    chunk_rows_to_table,
    terminal_rows_to_table,
)
from rollout_recovery.data_plane.spans import clipped
from rollout_recovery.generation.capture import CapturedCall, TokenCapture
from rollout_recovery.generation.fence import Fence
from rollout_recovery.generation.metrics import WorkerMetrics
from rollout_recovery.protocol import CallReceipt, CallRef, CutInventory, CutReceipt


class InventoryTooLarge(ValueError):
    pass


def _failure(ref: CallRef, reason: str) -> CallReceipt:
    return CallReceipt(**ref.model_dump(), disposition="durable_failure", reason=reason)


def _success(ref: CallRef, call: CapturedCall, finish: tuple[str, str | None] | None):
    """The receipt of a durable cut; `finish` is what the cut read with its token count."""
    return CallReceipt(
        **ref.model_dump(),
        disposition="durable_prefix",
        cut_kind="terminal_completion" if finish is not None else "active_prefix",
        staging_keys=list(call.chunk_keys),
        prefix_token_count=call.staged_tokens,
        prefix_digest=call.chain_digest.hex(),
        effective_output_limit=call.max_tokens,
        finish_reason=finish[0] if finish is not None else None,
    )


@dataclass
class _Plan:
    """One call of a cut, as read under the capture lock: its token count, the generated-ids
    list (its first `count` entries never change) and, if it had finished, its finish record."""

    index: int
    ref: CallRef
    call: CapturedCall
    count: int
    ids: Sequence[int]
    finish: tuple[str, str | None] | None


class CutService:
    def __init__(
        self,
        capture: TokenCapture,
        store,
        partition: str,
        terminal_partition: str,
        timeout_s: float,
        max_calls: int = 4096,
        batch_rows: int = 256,
        batch_tokens: int = 1 << 20,
        segments=None,
    ) -> None:
        self.capture, self.store = capture, store
        self.partition, self.terminal_partition = partition, terminal_partition
        self.timeout_s, self.max_calls = timeout_s, max_calls
        self.batch_rows, self.batch_tokens = batch_rows, batch_tokens
        self.segments = segments  # a TokenLogSegments: staged rows also go to storage
        self.metrics = WorkerMetrics()
        self.fence = Fence(on_release=self.metrics.fence_seconds)
        self._cut_lock = asyncio.Lock()
        self._receipts: dict[tuple[str, str], CutReceipt] = {}
        self._background: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ cut

    async def cut(self, inventory: CutInventory) -> CutReceipt:
        if len(inventory.calls) > self.max_calls:
            raise InventoryTooLarge(
                f"inventory lists {len(inventory.calls)} calls; the limit is {self.max_calls} "
                "(token_capture.max_inventory_calls): split it"
            )
        key = (inventory.checkpoint_id, inventory.digest())
        if key in self._receipts:
            return self._receipts[key]
        async with self._cut_lock:
            if key in self._receipts:
                return self._receipts[key]
            receipt = await self._cut(inventory, key[1])
            self._receipts[key] = receipt
            while len(self._receipts) > 64:
                self._receipts.pop(next(iter(self._receipts)))
            return receipt

    async def _cut(self, inventory: CutInventory, digest: str) -> CutReceipt:
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        results: dict[int, CallReceipt] = {}
        plans: list[_Plan] = []
        w0 = time.perf_counter()
        with self.capture.lock:
            w1 = time.perf_counter()
            for i, ref in enumerate(inventory.calls):
                call = self.capture.calls.get(ref.identity())
                if call is None:
                    done = ref.identity() in self.capture.completed
                    results[i] = _failure(ref, "already_terminal" if done else "unknown_call")
                elif call.uncuttable:
                    results[i] = _failure(ref, call.uncuttable)
                elif call.terminal_staged:
                    results[i] = _failure(ref, "already_terminal")
                else:
                    n, ids = call.progress()
                    plans.append(_Plan(i, ref, call, n, ids, call.finish_record()))
            w2 = time.perf_counter()
        hold_us = (w2 - w1) * 1e6
        self.metrics.lock((w1 - w0) * 1e6, hold_us)
        await self._await_cleanups(plans, deadline)

        rows: list[tuple[_Plan, ChunkRow]] = []
        for p in plans:
            call = p.call
            if call.cleanup is not None and not call.cleanup.done():
                results[p.index] = _failure(p.ref, "cleanup_pending")
            elif p.count == 0:
                results[p.index] = _failure(p.ref, "zero_generated_tokens")
            elif p.count == call.staged_tokens and (p.finish is None or call.finish_staged):
                results[p.index] = _success(p.ref, call, p.finish)  # nothing new: same keys
            else:
                rows.append((p, self._chunk(call, p)))

        staged_rows = staged_tokens = 0
        for p, row, reason in await self._stage(rows, deadline):
            if reason is not None:
                results[p.index] = _failure(p.ref, reason)
                continue
            results[p.index] = _success(p.ref, p.call, p.finish)
            staged_rows += 1
            staged_tokens += row.delta_len
        if staged_rows:
            crash_point("cut_rows_staged")
        receipts = [results[i] for i in range(len(inventory.calls))]
        for r in receipts:
            self.metrics.cut(r.disposition, r.reason)
        return CutReceipt(
            checkpoint_id=inventory.checkpoint_id,
            inventory_digest=digest,
            calls=receipts,
            staged_rows=staged_rows,
            staged_tokens=staged_tokens,
            lock_hold_us=hold_us,
            elapsed_s=time.monotonic() - t0,
        )

    async def _stage(
        self, rows: list[tuple[_Plan, ChunkRow]], deadline: float
    ) -> list[tuple[_Plan, ChunkRow, str | None]]:
        """Put chunk rows into the store in bounded batches before `deadline`; each staged
        row extends its call's chain. Per row: None when durable, else the failure reason."""
        out: list[tuple[_Plan, ChunkRow, str | None]] = []
        for batch in self._batches(rows):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                out += [(p, r, "control_deadline") for p, r in batch]
                continue
            table = chunk_rows_to_table([r for _, r in batch])
            put = asyncio.ensure_future(self.store.aput(self.partition, table))
            try:
                async with asyncio.timeout(remaining):
                    await asyncio.shield(put)
            except TimeoutError:
                # The put may still land: once it settles, remove what it wrote. Until then
                # these calls are not staged again (the next row would reuse the keys).
                cleanup = self._spawn(self._discard([r.key for _, r in batch], after=put))
                for p, r in batch:
                    p.call.cleanup = cleanup
                    out.append((p, r, "control_deadline"))
                continue
            except Exception as err:
                out += [(p, r, f"staging_error: {type(err).__name__}") for p, r in batch]
                continue
            if self.segments is not None:
                self._spawn(self._append_segment(table))
            for p, row in batch:
                call = p.call
                call.staged_tokens = row.cum_len
                call.chain_digest = row.digest
                call.chunk_keys.append(row.key)
                call.finish_staged = row.finish_reason is not None
                call.staged_at = time.monotonic()
                out.append((p, row, None))
        return out

    async def _append_segment(self, table) -> None:
        """The staged rows' durable copy (token_log_segments.py), off the loop: decoding and the
        next cut do not wait for storage."""
        t0 = time.monotonic()
        try:
            await asyncio.to_thread(self.segments.append, table)
        except Exception as err:
            self.metrics.tally[f"token_log_failure.segment_{type(err).__name__}"] += 1
            return
        self.metrics.count("token_log.segments")
        seconds = time.monotonic() - t0
        self.metrics.tally["token_log.segment_s_max"] = max(
            self.metrics.tally["token_log.segment_s_max"], seconds
        )

    # ------------------------------------------------------------------ token log

    def sample_log_lag(self) -> None:
        """Record each in-flight call's lag: tokens decoded and in no staged row yet."""
        with self.capture.lock:
            for call in self.capture.calls.values():
                if not (call.finished or call.uncuttable or call.terminal_staged):
                    self.metrics.log_lag(call.not_durable(call.num_generated()))

    async def log_calls(self, due: Callable[[CapturedCall, int, float], bool]) -> int:
        """Stage the new tokens of every in-flight call for which `due(call, new_tokens,
        now)` holds, as the next row of its chain (the chain a cut extends too), without a
        fence and without the environment. Returns the tokens made durable."""
        async with self._cut_lock:
            now = time.monotonic()
            plans: list[_Plan] = []
            with self.capture.lock:
                for call in self.capture.calls.values():
                    if call.finished or call.uncuttable or call.terminal_staged:
                        continue
                    n, ids = call.progress()
                    new = call.not_durable(n)
                    if new > 0 and due(call, new, now):
                        ref = CallRef(**call.identity._asdict())
                        plans.append(_Plan(len(plans), ref, call, n, ids, None))
            ready = [p for p in plans if p.call.cleanup is None or p.call.cleanup.done()]
            rows = [(p, self._chunk(p.call, p)) for p in ready]
            if faults.active("token_log_rows_corrupted"):  # deliberate (faults.py)
                for _, row in rows:
                    row.token_ids = row.token_ids.copy()
                    row.token_ids[0] += 1
            staged = 0
            for _, row, reason in await self._stage(rows, now + self.timeout_s):
                if reason is None:
                    staged += row.delta_len
                    self.metrics.count("token_log.rows")
                else:
                    self.metrics.tally[f"token_log_failure.{reason.split(':')[0]}"] += 1
            if staged:
                self.metrics.count("token_log.tokens", staged)
            return staged

    def _chunk(self, call: CapturedCall, p: _Plan) -> ChunkRow:
        """The next chained chunk of a call: its tokens past what is staged (copied outside
        the lock: a stable prefix), sealed with the finish record when the call had finished."""
        start, seq = call.staged_tokens, len(call.chunk_keys)
        ids = call.generated_ids(start, p.count, p.ids)
        digest = chain_digest(call.chain_digest, ids)
        reason, stop = p.finish if p.finish is not None else (None, None)
        if reason is not None:
            digest = finish_digest(digest, reason, stop)
        spans = clipped(call.spans(p.count), start, p.count)
        return ChunkRow(
            key=call.identity.chunk_key(seq),
            rollout_id=call.identity.rollout_id,
            model_call_id=call.identity.model_call_id,
            attempt=call.identity.attempt,
            chunk_seq=seq,
            token_ids=ids,
            logprobs=call.sampled_logprobs(start, p.count),
            weight_version=spans[-1][0] if spans else call.weight_version,
            weight_versions=spans,
            prev_len=start,
            digest=digest,
            prompt_token_ids=call.prompt_token_ids if seq == 0 else None,
            finish_reason=reason,
            stop_reason_json=stop,
        )

    async def _await_cleanups(self, plans: list[_Plan], deadline: float) -> None:
        """Let the deletion of a late, timed-out put finish before its keys are reused."""
        pending = {p.call.cleanup for p in plans if p.call.cleanup is not None}
        pending = {f for f in pending if not f.done()}
        if pending:
            await asyncio.wait(pending, timeout=max(0.0, deadline - time.monotonic()))

    def _batches(self, rows: list[tuple[_Plan, ChunkRow]]):
        batch: list = []
        tokens = 0
        for item in rows:
            n = item[1].delta_len
            if batch and (len(batch) >= self.batch_rows or tokens + n > self.batch_tokens):
                yield batch
                batch, tokens = [], 0
            batch.append(item)
            tokens += n
        if batch:
            yield batch

    async def _discard(self, keys: list[str], after: asyncio.Future | None = None) -> None:
        if after is not None:
            await asyncio.gather(after, return_exceptions=True)
        try:
            await self.store.adelete(self.partition, keys)
        except Exception:
            self.metrics.tally["discard_errors"] += 1

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def retire(self, keys: list[str]) -> None:
        """Delete an earlier attempt's chunk rows once a resume has answered the call without
        decoding (no captured call owns them). Like every chunk delete, it waits for the fence."""
        if keys:
            self._spawn(self._retire(list(keys)))

    async def _retire(self, keys: list[str]) -> None:
        while True:
            await self.fence.wait_released()
            async with self._cut_lock:
                if self.fence.held:
                    continue
                await self._discard(keys)
                self.metrics.count("retired_chunk_rows", len(keys))
                return

    # ------------------------------------------------------------------ terminal rows

    def on_finished(self, call: CapturedCall) -> None:
        """Called under the capture lock when a call finishes; staging runs in the background."""
        self._spawn(self._stage_terminal(call))

    async def _stage_terminal(self, call: CapturedCall) -> None:
        n = call.num_generated()
        ids = call.generated_ids(0, n)
        row = TerminalRow(
            key=call.identity.terminal_key(),
            rollout_id=call.identity.rollout_id,
            model_call_id=call.identity.model_call_id,
            attempt=call.identity.attempt,
            prompt_token_ids=call.prompt_token_ids,
            token_ids=ids,
            logprobs=call.sampled_logprobs(0, n),
            loss_mask=np.ones(n, np.int8),
            finish_reason=call.finish_reason or "unknown",
            weight_versions=call.spans(n),
            digest=token_digest(ids),
        )
        deferred = self.fence.held
        await self.fence.wait_released()
        try:
            await self.store.aput(self.terminal_partition, terminal_rows_to_table([row]))
        except Exception:
            self.metrics.tally["terminal_errors"] += 1
            return
        crash_point("terminal_row_written")
        self.metrics.count("terminal_rows")
        stale = [*call.chunk_keys, *call.superseded_keys]
        if stale and (deferred or self.fence.held):
            self.metrics.count("deferred_deletes")
        while True:
            await self.fence.wait_released()
            async with self._cut_lock:  # a cut never sees a half-deleted call
                if self.fence.held:
                    continue
                call.terminal_staged = True
                stale = [*call.chunk_keys, *call.superseded_keys]
                if stale:
                    await self._discard(stale)
                    crash_point("chunk_rows_deleted")
                break
        self.capture.forget(call)

    async def rebind(self, store, segments) -> None:
        """Serve a restored job (a restore that keeps this engine): background writes of the
        job before are cancelled, not finished (their rows belong to the store that is gone,
        and must never reach the restored one), and the fence starts over with the new
        controller's epochs."""
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.store, self.segments = store, segments
        self.fence = Fence(on_release=self.metrics.fence_seconds)
        self._receipts.clear()

    async def drain(self) -> None:
        """Wait for background terminal writes (tests and shutdown)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
