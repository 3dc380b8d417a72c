from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from rollout_recovery.data_plane.digest import chain_digests, token_digest
from rollout_recovery.data_plane.errors import SchemaMismatchError, SchemaVersionError
from rollout_recovery.data_plane.schemas import (
    CHUNK_ROW_SCHEMA,
    REPLAY_ROW_SCHEMA,
    SCHEMAS,
    TERMINAL_ROW_SCHEMA,
    ChunkRow,
    ReplayRow,
    TerminalRow,
    chunk_rows_to_table,
    conform,
    list_column,
    replay_rows_to_table,
    schema_version,
    table_to_chunk_rows,
    table_to_replay_rows,
    table_to_terminal_rows,
    terminal_rows_to_table,
)


def _chunks() -> list[ChunkRow]:
    deltas = [np.array([5, 6, 7], np.int32), np.array([8], np.int32)]
    digests = chain_digests(deltas)
    return [
        ChunkRow(
            key="ro1/call0/a0/c0",
            rollout_id="ro1",
            model_call_id="call0",
            attempt=0,
            chunk_seq=0,
            token_ids=deltas[0],
            logprobs=np.array([-0.5, -1.25, -3.0], np.float32),
            weight_version=3,
            prev_len=0,
            digest=digests[0],
            prompt_token_ids=np.array([1, 2], np.int32),
        ),
        ChunkRow(
            key="ro1/call0/a0/c1",
            rollout_id="ro1",
            model_call_id="call0",
            attempt=0,
            chunk_seq=1,
            token_ids=deltas[1],
            logprobs=np.array([-0.125], np.float32),
            weight_version=4,
            prev_len=3,
            digest=digests[1],
        ),
    ]


def test_chunk_rows_round_trip():
    rows = _chunks()
    table = chunk_rows_to_table(rows)
    assert table.schema.equals(CHUNK_ROW_SCHEMA, check_metadata=True)
    assert table.column("delta_len").to_pylist() == [3, 1]
    assert table.column("cum_len").to_pylist() == [3, 4]
    assert table.column("prompt_token_ids").null_count == 1
    back = table_to_chunk_rows(table)
    for a, b in zip(rows, back, strict=True):
        assert a.key == b.key and a.digest == b.digest and a.weight_version == b.weight_version
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        assert b.logprobs.dtype == np.float32 and b.token_ids.dtype == np.int32
    np.testing.assert_array_equal(back[0].prompt_token_ids, [1, 2])
    assert back[1].prompt_token_ids is None


def test_terminal_and_replay_rows_round_trip():
    t = TerminalRow(
        key="ro1/call0/a0/terminal",
        rollout_id="ro1",
        model_call_id="call0",
        attempt=0,
        prompt_token_ids=np.array([1, 2], np.int32),
        token_ids=np.array([5, 6, 7, 8], np.int32),
        logprobs=np.array([-0.5, -1.0, -2.0, -0.25], np.float32),
        loss_mask=np.array([1, 1, 1, 1], np.int8),
        finish_reason="stop",
        weight_versions=[(3, 0, 3), (4, 3, 4)],
        digest=token_digest([5, 6, 7, 8]),
    )
    [back] = table_to_terminal_rows(terminal_rows_to_table([t]))
    assert back.weight_versions == t.weight_versions and back.finish_reason == "stop"
    np.testing.assert_array_equal(back.loss_mask, t.loss_mask)
    r = ReplayRow(
        key="g0/0",
        rollout_id="ro1",
        group_id="g0",
        generation_index=0,
        prompt_len=2,
        token_ids=np.arange(6, dtype=np.int32),
        loss_mask=np.array([0, 0, 1, 1, 1, 1], np.int8),
        logprobs=np.zeros(6, np.float32),
        reward=0.75,
        weight_version_min=3,
        weight_version_max=4,
    )
    table = replay_rows_to_table([r])
    assert table.schema.equals(REPLAY_ROW_SCHEMA, check_metadata=True)
    [rb] = table_to_replay_rows(table)
    assert rb.reward == 0.75 and rb.weight_version_max == 4 and rb.weight_versions is None
    np.testing.assert_array_equal(rb.token_ids, r.token_ids)
    r.weight_versions = [(3, 2, 5), (4, 5, 6)]
    [rb] = table_to_replay_rows(replay_rows_to_table([r]))
    assert rb.weight_versions == [(3, 2, 5), (4, 5, 6)]


def test_rows_of_an_older_version_read_with_their_versions_as_spans():
    """A v2 chunk row (before spans) reads with its one version over all its tokens; a v2
    replay row with no spans."""
    rows = _chunks()
    rows[0].weight_versions = [(2, 0, 1), (3, 1, 3)]
    table = chunk_rows_to_table(rows)
    assert [r.version_spans() for r in table_to_chunk_rows(table)] == [
        [(2, 0, 1), (3, 1, 3)],
        [(4, 3, 4)],
    ]
    v2 = table.drop_columns(["weight_versions"])
    meta = dict(table.schema.metadata) | {b"rollout_recovery.schema_version": b"2"}
    v2 = v2.replace_schema_metadata(meta)
    old = table_to_chunk_rows(v2)
    assert [r.weight_versions for r in old] == [None, None]
    assert [r.version_spans() for r in old] == [[(3, 0, 3)], [(4, 3, 4)]]


def test_token_columns_are_read_as_numpy_views():
    table = chunk_rows_to_table(_chunks())
    offsets, values = list_column(table, "token_ids")
    buf = table.column("token_ids").chunk(0).values.buffers()[1]
    assert values.ctypes.data == buf.address  # a view over the Arrow buffer, not a copy
    np.testing.assert_array_equal(values[offsets[1] : offsets[2]], [8])


def test_every_schema_is_versioned():
    versions = {kind: schema_version(schema) for kind, schema in SCHEMAS.items()}
    assert versions == {"chunk_row": 3, "terminal_row": 2, "replay_row": 4, "token_entry_row": 1}
    assert TERMINAL_ROW_SCHEMA.field("token_ids").type == pa.list_(pa.int32())
    assert TERMINAL_ROW_SCHEMA.field("logprobs").type == pa.list_(pa.float32())


def test_conform_refuses_wrong_types_missing_columns_and_nulls():
    table = chunk_rows_to_table(_chunks())
    bad = table.set_column(
        table.schema.get_field_index("token_ids"),
        "token_ids",
        table.column("token_ids").cast(pa.list_(pa.int64())),
    )
    with pytest.raises(SchemaMismatchError, match=r"column `token_ids` has type list<item: int64>"):
        conform(bad, CHUNK_ROW_SCHEMA, "put")
    with pytest.raises(SchemaMismatchError, match=r"missing \['digest'\]"):
        conform(table.drop_columns(["digest"]), CHUNK_ROW_SCHEMA, "put")
    with pytest.raises(SchemaMismatchError, match="unexpected"):
        conform(table.append_column("extra", pa.array([1, 2])), CHUNK_ROW_SCHEMA, "put")
    nulls = table.set_column(
        table.schema.get_field_index("rollout_id"), "rollout_id", pa.array([None, "x"], pa.string())
    )
    with pytest.raises(SchemaMismatchError, match="has nulls"):
        conform(nulls, CHUNK_ROW_SCHEMA, "put")
    with pytest.raises(SchemaMismatchError, match="this partition holds chunk_row"):
        conform(replay_rows_to_table([]), CHUNK_ROW_SCHEMA, "put")


def test_newer_rows_are_refused_with_upgrade_hint():
    table = chunk_rows_to_table(_chunks())
    meta = dict(table.schema.metadata)
    meta[b"rollout_recovery.schema_version"] = b"4"
    newer = table.replace_schema_metadata(meta)
    with pytest.raises(SchemaVersionError, match="upgrade rollout_recovery"):
        conform(newer, CHUNK_ROW_SCHEMA, "put")


def test_conform_accepts_plain_tables_with_the_right_columns():
    table = chunk_rows_to_table(_chunks())
    plain = pa.Table.from_arrays(table.columns, names=table.column_names)  # no metadata
    out = conform(plain, CHUNK_ROW_SCHEMA, "put")
    assert out.schema.equals(CHUNK_ROW_SCHEMA, check_metadata=True)


def test_v1_chunk_rows_are_upgraded_with_null_finish_columns():
    table = chunk_rows_to_table(_chunks())
    v1 = table.drop_columns(["finish_reason", "stop_reason_json"])
    meta = dict(v1.schema.metadata) | {b"rollout_recovery.schema_version": b"1"}
    v1 = v1.replace_schema_metadata(meta)
    out = conform(v1, CHUNK_ROW_SCHEMA, "snapshot")
    assert out.schema.equals(CHUNK_ROW_SCHEMA, check_metadata=True)
    assert out.column("finish_reason").null_count == out.num_rows
    # A current-version table missing the columns is still refused (no silent fill).
    with pytest.raises(SchemaMismatchError, match="missing"):
        conform(table.drop_columns(["finish_reason"]), CHUNK_ROW_SCHEMA, "put")


def test_absent_logprobs_stay_absent_not_zeros():
    rows = _chunks()
    rows[1].logprobs = None
    back = table_to_chunk_rows(chunk_rows_to_table(rows))
    assert back[1].logprobs is None and back[0].logprobs is not None
    replay = ReplayRow(
        key="g/0", rollout_id="r", group_id="g", generation_index=0, prompt_len=1,
        token_ids=np.array([1, 2], np.int32), loss_mask=np.array([0, 1], np.int8),
        logprobs=None, reward=1.0, weight_version_min=0, weight_version_max=0,
    )  # fmt: skip
    [rb] = table_to_replay_rows(replay_rows_to_table([replay]))
    assert rb.logprobs is None


def test_finish_record_round_trips_and_seals_the_digest():
    from rollout_recovery.data_plane.digest import chain_digest, finish_digest

    rows = _chunks()
    rows[-1].finish_reason, rows[-1].stop_reason_json = "stop", "362"
    back = table_to_chunk_rows(chunk_rows_to_table(rows))
    assert (back[-1].finish_reason, back[-1].stop_reason_json) == ("stop", "362")
    assert back[0].finish_reason is None
    chain = chain_digest(bytes(32), [1, 2])
    sealed = {
        finish_digest(chain, r, j)
        for r, j in [
            ("stop", "362"),
            ("stop", "361"),
            ("stop", None),
            ("length", None),
            ("stop", '"x"'),
        ]
    }
    assert len(sealed) == 5 and chain not in sealed  # fmt: skip
