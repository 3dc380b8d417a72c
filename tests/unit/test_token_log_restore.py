"""The token log's durable copy (segments in checkpoint storage) and a whole-job restore that
takes, per call in flight, the newer of its snapshot cut and its verified token log.

Real files under tmp_path; the restored staging store is an in-memory stand-in with the
StagingStore's synchronous get/put. The end-to-end figure (work lost with the token log on and
off after a whole-job SIGKILL) is the recovery check's (docs/failover.md).
"""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pytest

from rollout_recovery.controller.token_log_restore import extend_from_token_log
from rollout_recovery.data_plane.digest import chain_digests
from rollout_recovery.data_plane.schemas import ChunkRow, chunk_rows_to_table, table_to_chunk_rows
from rollout_recovery.data_plane.token_log_segments import TokenLogSegments
from rollout_recovery.protocol import CallIdentity, Continuation, EpisodeRecord, TurnRef

STAGING = "rollout_staging"
PROMPT = np.array([5, 6, 7], np.int32)


def _chain(ident: CallIdentity, sizes: list[int]) -> list[ChunkRow]:
    starts = [0, *itertools.accumulate(sizes)]
    deltas = [np.arange(a, b, dtype=np.int32) + 100 for a, b in itertools.pairwise(starts)]
    digests = chain_digests(deltas)
    rows = []
    for seq, delta in enumerate(deltas):
        rows.append(ChunkRow(
            key=ident.chunk_key(seq), rollout_id=ident.rollout_id,
            model_call_id=ident.model_call_id, attempt=ident.attempt, chunk_seq=seq,
            token_ids=delta, logprobs=np.full(len(delta), -0.5, np.float32), weight_version=0,
            prev_len=starts[seq], digest=digests[seq],
            prompt_token_ids=PROMPT if seq == 0 else None,
        ))  # fmt: skip
    return rows


class SyncStore:
    def __init__(self) -> None:
        self.rows: dict[str, pa.Table] = {}

    def put(self, partition: str, table: pa.Table) -> int:
        for i, key in enumerate(table.column("key").to_pylist()):
            self.rows[key] = table.slice(i, 1)
        return table.num_rows

    def get(self, partition: str, keys):
        found = [self.rows[k] for k in keys if k in self.rows]
        return (pa.concat_tables(found) if found else None), [k for k in keys if k not in self.rows]


def _record(rid: str, cont: Continuation | None, turns: int = 0) -> EpisodeRecord:
    refs = [TurnRef(entry_id=f"{rid}/c{i}/a0", payload_sha256="0" * 64) for i in range(turns)]
    return EpisodeRecord(rollout_id=rid, group_id="g", generation_index=0, seed=1, attempt=0,
                         task={}, turns=refs, continuation=cont)  # fmt: skip


def _cut(rows: list[ChunkRow]) -> Continuation:
    return Continuation(call_id=rows[0].model_call_id, attempt=rows[0].attempt,
                        keys=[r.key for r in rows], tokens=rows[-1].cum_len,
                        digest=rows[-1].digest.hex(), cut_kind="active_prefix")  # fmt: skip


def test_segments_round_trip_and_old_ones_are_deleted(tmp_path):
    ident = CallIdentity("r1", "c0", 0)
    rows = _chain(ident, [4, 4, 4])
    log = TokenLogSegments(str(tmp_path), "w0")
    first = log.append(chunk_rows_to_table(rows[:2]))
    log.append(chunk_rows_to_table(rows[2:]))
    other = CallIdentity("r2", "c0", 0)
    TokenLogSegments(str(tmp_path), "w1").append(chunk_rows_to_table(_chain(other, [3])))
    found, unreadable = TokenLogSegments.read(str(tmp_path), {ident})
    assert unreadable == 0 and set(found) == {ident}
    assert [found[ident][s].key for s in range(3)] == [r.key for r in rows]
    (tmp_path / "w0" / "99999999999999999999-000000.arrow").write_bytes(b"torn")
    assert TokenLogSegments.read(str(tmp_path), {ident})[1] == 1  # skipped, counted
    stamp = int(first.split("/")[1].split("-")[0])
    assert TokenLogSegments.gc(str(tmp_path), stamp + 1) == 1
    assert first not in [r for _, r in TokenLogSegments.segments(str(tmp_path))]


def test_a_cut_call_goes_on_from_its_longer_journal(tmp_path):
    ident = CallIdentity("r1", "c1", 0)
    rows = _chain(ident, [5, 3, 4])
    store = SyncStore()
    store.put(STAGING, chunk_rows_to_table(rows[:1]))  # what the snapshot holds: chunk 0
    TokenLogSegments(str(tmp_path), "w0").append(chunk_rows_to_table(rows))
    rec = _record("r1", _cut(rows[:1]), turns=1)
    ext = extend_from_token_log([rec], store, STAGING, str(tmp_path), 0)
    assert rec.continuation == _cut(rows)
    assert ext.calls["r1"]["tokens"] == 12 and ext.calls["r1"]["snapshot_tokens"] == 5
    assert ext.counts == {"token_log_restore.extended_calls": 1, "token_log_restore.tokens": 7}
    restored = table_to_chunk_rows(store.get(STAGING, rec.continuation.keys)[0])
    assert [r.digest for r in restored] == [r.digest for r in rows]


def test_the_journal_stops_before_tokens_of_weights_the_restore_does_not_bring_back(tmp_path):
    """Weights pushed into the call in flight after the snapshot (version 1): the restore brings
    back version 0, so the chain ends before the first row holding a version-1 token."""
    ident = CallIdentity("r1", "c1", 0)
    rows = _chain(ident, [5, 3, 4])
    rows[2].weight_version, rows[2].weight_versions = 1, [(0, 8, 10), (1, 10, 12)]
    store = SyncStore()
    store.put(STAGING, chunk_rows_to_table(rows[:1]))
    TokenLogSegments(str(tmp_path), "w0").append(chunk_rows_to_table(rows))
    rec = _record("r1", _cut(rows[:1]), turns=1)
    ext = extend_from_token_log([rec], store, STAGING, str(tmp_path), 0)
    assert rec.continuation == _cut(rows[:2])
    assert ext.counts["token_log_restore.newer_weights"] == 1
    rec = _record("r1", _cut(rows[:1]), turns=1)
    extend_from_token_log([rec], store, STAGING, str(tmp_path), 1)  # restored onto version 1
    assert rec.continuation == _cut(rows)


def test_a_call_that_started_after_the_snapshot_goes_on_from_its_journal(tmp_path):
    ident = CallIdentity("r1", "c2", 0)  # the record committed two calls, none in flight
    rows = _chain(ident, [6])
    TokenLogSegments(str(tmp_path), "w0").append(chunk_rows_to_table(rows))
    rec = _record("r1", None, turns=2)
    extend_from_token_log([rec], SyncStore(), STAGING, str(tmp_path), 0)
    assert rec.continuation == _cut(rows)


def _flip(row: ChunkRow) -> ChunkRow:
    row.token_ids = row.token_ids + np.int32(1)
    return row


@pytest.mark.parametrize(
    ("logged", "reason"),
    [
        # The token log's chunk 0 is not the snapshot's.
        (lambda rows, other: [other[0], *rows[1:]], "token_log_differs"),
        # A changed token: the chained digest breaks.
        (lambda rows, other: [rows[0], _flip(rows[1]), rows[2]], "digest_mismatch"),
    ],
)
def test_a_journal_in_doubt_leaves_the_snapshot_continuation(tmp_path, logged, reason):
    ident = CallIdentity("r1", "c0", 0)
    rows, other = _chain(ident, [5, 3, 4]), _chain(ident, [2, 3])
    store = SyncStore()
    store.put(STAGING, chunk_rows_to_table(rows[:1]))
    TokenLogSegments(str(tmp_path), "w0").append(chunk_rows_to_table(logged(rows, other)))
    rec = _record("r1", _cut(rows[:1]))
    ext = extend_from_token_log([rec], store, STAGING, str(tmp_path), 0)
    assert rec.continuation == _cut(rows[:1]) and not ext.calls
    assert ext.counts == {f"token_log_restore.refused.{reason}": 1}


def test_a_gap_ends_the_chain_and_a_shorter_journal_adds_nothing(tmp_path):
    ident = CallIdentity("r1", "c0", 0)
    rows = _chain(ident, [5, 3, 4])
    TokenLogSegments(str(tmp_path), "w0").append(chunk_rows_to_table([rows[0], rows[2]]))
    rec = _record("r1", Continuation(call_id="c0", attempt=0))  # in flight, not cut
    extend_from_token_log([rec], SyncStore(), STAGING, str(tmp_path), 0)
    assert rec.continuation == _cut(rows[:1])  # chunk 2 cannot follow without chunk 1
    store = SyncStore()
    store.put(STAGING, chunk_rows_to_table(rows))
    cut = _record("r1", _cut(rows))
    ext = extend_from_token_log([cut], store, STAGING, str(tmp_path), 0)
    assert cut.continuation == _cut(rows) and ext.counts == {"token_log_restore.not_newer": 1}
