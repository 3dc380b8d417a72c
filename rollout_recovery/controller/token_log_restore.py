"""A whole-job restore takes, for each call in flight, the newer of its snapshot continuation
and its token log (docs/failover.md, "Whole-job restore").

For each restored episode the call that was in flight is its continuation's (call, attempt),
or, when the episode was between calls at the snapshot, its next call under the record's
attempt (a call that started after the snapshot). Its logged rows (token_log_segments.py) are
merged with the rows the snapshot holds:

- every seq both hold must carry the same digest (`token_log_differs` otherwise);
- the merged chain must run from chunk 0 without a gap, and pass the checks a resume makes
  (order, counts, chained digests, identity, weight versions, the prompt in chunk 0);
- only a chain longer than the snapshot's is used: its rows beyond the snapshot are put into
  the restored staging partition and the record's continuation names the whole chain;
- it ends before the first logged row holding a token of newer weights than the snapshot's
  (`max_version`): with weights pushed into calls in flight, rows logged after the snapshot can
  hold tokens of weights the restore does not bring back, and the call's tail is decoded on the
  restored ones (counted as `token_log_restore.newer_weights`).

Any doubt leaves the snapshot's continuation as it is (counted by reason): a wrong prefix is
worse than tokens decoded again. The worker that resumes the call checks the chain again.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from rollout_recovery.data_plane.chain import ResumeRefused, chain_continuation
from rollout_recovery.data_plane.schemas import ChunkRow, chunk_rows_to_table, table_to_chunk_rows
from rollout_recovery.data_plane.token_log_segments import TokenLogSegments
from rollout_recovery.protocol import CallIdentity, Continuation, EpisodeRecord


@dataclass
class TokenLogExtension:
    """What a restore took from the token log: per rollout, the extended continuation and the
    snapshot's prefix length; counts by outcome."""

    calls: dict[str, dict] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)


def in_flight_call(rec: EpisodeRecord) -> CallIdentity:
    cont = rec.continuation
    if cont is not None:
        return CallIdentity(rec.rollout_id, cont.call_id, cont.attempt)
    return CallIdentity(rec.rollout_id, f"c{len(rec.turns)}", rec.attempt)


def extend_from_token_log(
    records: list[EpisodeRecord], store, partition: str, log_uri: str, max_version: int
) -> TokenLogExtension:
    """Extend the records' continuations in place from the token log, with rows of weight
    versions up to `max_version`; put the rows they now name into `store` (the restored
    StagingStore)."""
    out = TokenLogExtension()
    wanted = {rec.rollout_id: in_flight_call(rec) for rec in records}
    logged, unreadable = TokenLogSegments.read(log_uri, set(wanted.values()))
    if unreadable:
        out.counts["token_log_restore.unreadable_segments"] += unreadable
    for rec in records:
        ident = wanted[rec.rollout_id]
        rows = logged.get(ident)
        if not rows:
            continue
        try:
            new, cont = _extend(rec, ident, rows, store, partition, max_version, out.counts)
        except ResumeRefused as err:
            out.counts[f"token_log_restore.refused.{err.reason}"] += 1
            continue
        if cont is None:
            out.counts["token_log_restore.not_newer"] += 1
            continue
        if new:
            store.put(partition, chunk_rows_to_table(new))
        before = rec.continuation.tokens if rec.continuation and rec.continuation.cut else 0
        rec.continuation = cont
        out.counts["token_log_restore.extended_calls"] += 1
        out.counts["token_log_restore.tokens"] += (cont.tokens or 0) - (before or 0)
        out.calls[rec.rollout_id] = cont.model_dump() | {"snapshot_tokens": before or 0}
    return out


def _extend(
    rec: EpisodeRecord,
    ident: CallIdentity,
    rows: dict[int, ChunkRow | None],
    store,
    partition: str,
    max_version: int,
    counts: Counter[str],
) -> tuple[list[ChunkRow], Continuation | None]:
    """(rows to put, the extended continuation), or (_, None) when the token log adds nothing."""
    cont = rec.continuation
    base: list[ChunkRow] = []
    if cont is not None and cont.cut:
        table, missing = store.get(partition, cont.keys)
        if missing:
            raise ResumeRefused("missing_chunk", f"{len(missing)} snapshot rows are missing")
        by_key = {r.key: r for r in table_to_chunk_rows(table)}
        base = [by_key[k] for k in cont.keys]
    for seq, row in enumerate(base):
        if seq in rows and (rows[seq] is None or rows[seq].digest != row.digest):
            raise ResumeRefused("token_log_differs", f"{row.key} differs from the snapshot's")
    chain, seq = list(base), len(base)
    while rows.get(seq) is not None:
        if max(v for v, _, _ in rows[seq].version_spans()) > max_version:
            counts["token_log_restore.newer_weights"] += 1
            break
        chain.append(rows[seq])
        seq += 1
    if len(chain) == len(base):
        return [], None
    extended = chain_continuation(chain, ident)
    return chain[len(base) :], extended
