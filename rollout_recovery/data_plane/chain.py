"""The staged-chain check: whether a call's chunk rows form one trustworthy prefix.

The one safety rule every resume rests on, in one place: the worker runs it before the engine
sees a continuation (generation/resume.py), the environment before moving a dead worker's call
(environment/migration.py), and the controller before extending a restored call from its
token log (controller/token_log_restore.py). It needs no engine: rows, digests and identities only.
A chain is refused, with a named reason, when a chunk is missing, out of order, of another call
or a later attempt, miscounted, fails its chained digest, has weight-version spans that do not
cover its tokens or decrease in version, ends early, or was staged for another prompt; a
refused call is generated from scratch. A checked prefix keeps its tokens' weight versions.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_recovery.data_plane.digest import CHAIN_ROOT, chain_digest, finish_digest
from rollout_recovery.data_plane.spans import Span, SpanError, check_spans, merged
from rollout_recovery.protocol import CallIdentity, Continuation


class ResumeRefused(Exception):
    """The continuation cannot be trusted; `reason` is counted and the call regenerates."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


FINISH_REASONS = ("stop", "length")


@dataclass
class Prefix:
    """A checked chain as the worker resumes it: the prompt, the prefix's tokens and
    logprobs, and what the worker's plan adds (its keys, the finish it answers with)."""

    prompt_ids: list[int]
    ids: np.ndarray
    logprobs: np.ndarray | None  # None when a chunk was staged without logprobs
    weight_version: int  # the newest of weight_versions
    weight_versions: list[Span] = field(default_factory=list)  # of the prefix's tokens
    keys: list[str] = field(default_factory=list)  # the earlier attempt's chunk rows
    finish: tuple[str, Any] | None = None  # (finish_reason, stop_reason) recorded at the cut
    done: tuple[str, Any] | None = None  # the prefix already ended the call: answer it
    logit_bias: dict[int, float] | None = None  # the frequency penalty's emulation
    identity: CallIdentity | None = None  # the attempt resuming from this prefix


def validate_chunks(
    rows,
    identity: CallIdentity,
    keys: list[str],
    prompt_ids: list[int],
    expected_tokens: int,
    expected_digest: str,
) -> Prefix:
    """Check every staged chunk of a continuation; raises ResumeRefused on any mismatch."""
    if not rows:
        raise ResumeRefused("missing_chunk", "no staged rows")
    if [r.key for r in rows] != keys:
        raise ResumeRefused("missing_chunk", "not every staging key was found")
    prev, digest, spans = 0, CHAIN_ROOT, []
    for seq, row in enumerate(rows):
        if (row.rollout_id, row.model_call_id) != identity[:2] or row.attempt >= identity.attempt:
            raise ResumeRefused("foreign_chunk", f"{row.key} belongs to another call or attempt")
        if row.chunk_seq != seq:
            raise ResumeRefused("chunk_order", f"{row.key} has chunk_seq {row.chunk_seq}")
        lp_count = row.delta_len if row.logprobs is None else len(row.logprobs)
        if row.prev_len != prev or lp_count != row.delta_len:
            raise ResumeRefused("chunk_counts", f"{row.key} does not continue at {prev}")
        digest = chain_digest(digest, row.token_ids)
        if row.finish_reason is not None:
            if seq != len(rows) - 1:
                raise ResumeRefused("chunk_order", f"{row.key} ends the call but is not last")
            digest = finish_digest(digest, row.finish_reason, row.stop_reason_json)
        if digest != row.digest:
            raise ResumeRefused("digest_mismatch", f"{row.key} fails its chained digest")
        try:
            check_spans(row.version_spans(), prev, prev + row.delta_len)
        except SpanError as err:
            raise ResumeRefused("weight_version_spans", f"{row.key}: {err}") from None
        if row.weight_versions and row.weight_version != row.weight_versions[-1][0]:
            raise ResumeRefused("weight_version_spans", f"{row.key}: its version is not its newest")
        prev += row.delta_len
        spans += row.version_spans()
    if any(b[0] < a[0] for a, b in itertools.pairwise(spans)):
        raise ResumeRefused("weight_version_order", "weight versions decrease")
    if prev != expected_tokens:
        raise ResumeRefused("prefix_length_mismatch", f"{prev} staged, {expected_tokens} expected")
    if digest.hex() != expected_digest:
        raise ResumeRefused("digest_mismatch", "final digest differs from the continuation's")
    if rows[0].prompt_token_ids is None or rows[0].prompt_token_ids.tolist() != list(prompt_ids):
        raise ResumeRefused("prompt_mismatch", "the request's prompt is not the staged prompt")
    last = rows[-1]
    finish = None
    if last.finish_reason is not None:
        if last.finish_reason not in FINISH_REASONS:
            raise ResumeRefused("finish_record", f"unknown finish reason {last.finish_reason!r}")
        try:
            stop = None if last.stop_reason_json is None else json.loads(last.stop_reason_json)
        except ValueError:
            raise ResumeRefused("finish_record", "unreadable stop reason") from None
        finish = (last.finish_reason, stop)
    lps = [r.logprobs for r in rows]
    return Prefix(
        prompt_ids=list(prompt_ids),
        ids=np.concatenate([r.token_ids for r in rows]),
        logprobs=None if any(lp is None for lp in lps) else np.concatenate(lps),
        weight_version=rows[-1].weight_version,
        weight_versions=merged(spans),
        finish=finish,
    )


def chain_continuation(rows, attempt: CallIdentity) -> Continuation:
    """The continuation of call attempt `attempt`'s staged chain `rows` (chunk 0 first) for
    its next attempt, after every check a resume makes; ResumeRefused when one fails."""
    if not rows:
        raise ResumeRefused("missing_chunk", "no staged rows")
    last, prompt = rows[-1], rows[0].prompt_token_ids
    validate_chunks(rows, attempt._replace(attempt=attempt.attempt + 1), [r.key for r in rows],
                    [] if prompt is None else prompt.tolist(), last.cum_len,
                    last.digest.hex())  # fmt: skip
    return Continuation(
        call_id=attempt.model_call_id,
        attempt=attempt.attempt,
        keys=[r.key for r in rows],
        tokens=last.cum_len,
        digest=last.digest.hex(),
        cut_kind="terminal_completion" if last.finish_reason else "active_prefix",
    )
