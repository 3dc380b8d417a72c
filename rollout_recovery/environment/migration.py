"""Where a call that lost its worker goes on from: the newest verified prefix of its chain.

A dead worker's call attempt left chunk rows in the staging store (its token log, and the rows
of any checkpoint cut). They are read back and checked as a restore would check them (one
chain from chunk 0: order, counts, chained digests, identity, weight versions); a chain that
fails any check is not used (fail closed: the call is decoded from scratch, the reason
counted). The call continues from whichever is longer: that chain, or the continuation the
attempt was itself resumed from (its rows are still staged). The worker that takes the call
validates the continuation again before it splices anything in.
"""

from __future__ import annotations

from rollout_recovery.data_plane.chain import ResumeRefused, chain_continuation
from rollout_recovery.data_plane.schemas import table_to_chunk_rows
from rollout_recovery.protocol import CallIdentity, Continuation


async def token_log_continuation(
    store, partition: str, lost: CallIdentity, resumed_from: Continuation | None
) -> tuple[Continuation | None, str | None]:
    """The continuation of call attempt `lost` for its next attempt, and the reason its own
    chain was refused (None when it was usable or absent). None: nothing to resume from."""
    keys = sorted(await store.alist(partition, f"{lost.key_prefix()}/c"))
    token_log, refused = None, None
    if keys:
        table, missing = await store.aget(partition, keys)
        rows = sorted(table_to_chunk_rows(table), key=lambda r: r.chunk_seq) if table else []
        try:
            if missing:
                raise ResumeRefused("missing_chunk", f"{len(missing)} rows vanished")
            token_log = chain_continuation(rows, lost)
        except ResumeRefused as err:
            refused = err.reason
    older = resumed_from if resumed_from is not None and resumed_from.cut else None
    if token_log is None:
        return older, refused
    if older is not None and (older.tokens or 0) > (token_log.tokens or 0):
        return older, refused
    return token_log, refused
