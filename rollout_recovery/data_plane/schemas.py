"""Versioned Arrow schemas of the rows the data plane holds, and columnar builders/readers.

Token arrays are `list<int32>` / `list<float32>` columns. Rows are built from numpy arrays by
concatenation and read back as numpy views over the column buffers, so no path creates a
Python object per token. Every schema carries its row kind and `schema_version` in its
metadata; a reader refuses rows newer than it understands, and upgrades older rows by adding
the nullable columns later versions introduced (as nulls).

Logprobs columns are nullable: a row whose call had no sampled logprobs carries null, never
zeros that a trainer would take for real values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from rollout_recovery.data_plane.errors import SchemaMismatchError, SchemaVersionError
from rollout_recovery.data_plane.spans import Span

KIND_KEY = b"rollout_recovery.row_kind"
VERSION_KEY = b"rollout_recovery.schema_version"

_TOKENS = pa.list_(pa.int32())
_LOGPROBS = pa.list_(pa.float32())
_MASK = pa.list_(pa.int8())
_DIGEST = pa.binary(32)
_SPANS = pa.list_(pa.struct([("version", pa.int64()), ("start", pa.int32()), ("end", pa.int32())]))


def _schema(kind: str, version: int, fields: list[pa.Field]) -> pa.Schema:
    meta = {KIND_KEY: kind.encode(), VERSION_KEY: str(version).encode()}
    return pa.schema([pa.field("key", pa.string(), nullable=False), *fields], metadata=meta)


# v2: nullable logprobs; finish_reason / stop_reason_json on the chunk that ends a finished
# call (its digest seals them, see digest.finish_digest). v3: weight_versions, the spans of the
# chunk's own tokens (data_plane/spans.py); weight_version is the newest of them.
CHUNK_ROW_SCHEMA = _schema(
    "chunk_row",
    3,
    [
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("model_call_id", pa.string(), nullable=False),
        pa.field("attempt", pa.int32(), nullable=False),
        pa.field("chunk_seq", pa.int32(), nullable=False),
        pa.field("prompt_token_ids", _TOKENS),  # only in chunk 0
        pa.field("token_ids", _TOKENS, nullable=False),
        pa.field("logprobs", _LOGPROBS),  # null: the call had no sampled logprobs
        pa.field("weight_version", pa.int64(), nullable=False),
        pa.field("prev_len", pa.int32(), nullable=False),
        pa.field("delta_len", pa.int32(), nullable=False),
        pa.field("cum_len", pa.int32(), nullable=False),
        pa.field("digest", _DIGEST, nullable=False),
        pa.field("finish_reason", pa.string()),  # set only on a finished call's last chunk
        pa.field("stop_reason_json", pa.string()),  # vLLM's stop_reason (token id or string)
        pa.field("weight_versions", _SPANS),  # null in v2 rows: weight_version for every token
    ],
)

# v2: nullable logprobs.
TERMINAL_ROW_SCHEMA = _schema(
    "terminal_row",
    2,
    [
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("model_call_id", pa.string(), nullable=False),
        pa.field("attempt", pa.int32(), nullable=False),
        pa.field("prompt_token_ids", _TOKENS, nullable=False),
        pa.field("token_ids", _TOKENS, nullable=False),
        pa.field("logprobs", _LOGPROBS),
        pa.field("loss_mask", _MASK, nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("weight_versions", _SPANS, nullable=False),
        pa.field("digest", _DIGEST, nullable=False),
    ],
)

# v2: nullable logprobs (training refuses a row without them). v3: weight_versions, the spans
# of the generated tokens at their positions in token_ids (null: the worker reported none, and
# weight_version_min/max are the version the episode was started on). v4: result_json, what
# the episode function returned (JSON; null in rows written before v4).
REPLAY_ROW_SCHEMA = _schema(
    "replay_row",
    4,
    [
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("generation_index", pa.int32(), nullable=False),
        pa.field("prompt_len", pa.int32(), nullable=False),
        pa.field("token_ids", _TOKENS, nullable=False),
        pa.field("loss_mask", _MASK, nullable=False),
        pa.field("logprobs", _LOGPROBS),
        pa.field("reward", pa.float64(), nullable=False),
        pa.field("weight_version_min", pa.int64(), nullable=False),
        pa.field("weight_version_max", pa.int64(), nullable=False),
        pa.field("weight_versions", _SPANS),
        pa.field("result_json", pa.string()),
    ],
)

# The environment's TokenEntry records: token arrays as columns, the other fields as canonical
# JSON (the record has its own versioning, see environment/token_entry.py).
TOKEN_ENTRY_ROW_SCHEMA = _schema(
    "token_entry_row",
    1,
    [
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("model_call_id", pa.string(), nullable=False),
        pa.field("incomplete", pa.bool_(), nullable=False),
        pa.field("prompt_token_ids", _TOKENS, nullable=False),
        pa.field("generated_token_ids", _TOKENS, nullable=False),
        pa.field("generated_logprobs", _LOGPROBS, nullable=False),
        pa.field("record_json", pa.string(), nullable=False),
        pa.field("payload_sha256", pa.string(), nullable=False),
    ],
)

SCHEMAS: dict[str, pa.Schema] = {
    "chunk_row": CHUNK_ROW_SCHEMA,
    "terminal_row": TERMINAL_ROW_SCHEMA,
    "replay_row": REPLAY_ROW_SCHEMA,
    "token_entry_row": TOKEN_ENTRY_ROW_SCHEMA,
}


def row_kind(schema: pa.Schema) -> str | None:
    meta = schema.metadata or {}
    return meta[KIND_KEY].decode() if KIND_KEY in meta else None


def schema_version(schema: pa.Schema) -> int | None:
    meta = schema.metadata or {}
    return int(meta[VERSION_KEY]) if VERSION_KEY in meta else None


def check_version(kind: str, version: int | None, where: str) -> None:
    """Refuse rows written by a newer schema than this reader knows."""
    known = schema_version(SCHEMAS[kind])
    if version is not None and known is not None and version > known:
        raise SchemaVersionError(
            f"{where}: {kind} rows are schema v{version}, this reader knows up to v{known}; "
            "upgrade rollout_recovery to read them"
        )


# Columns added after version 1, per row kind: rows of an older version get them as nulls.
ADDED_COLUMNS: dict[str, dict[str, int]] = {
    "chunk_row": {"finish_reason": 2, "stop_reason_json": 2, "weight_versions": 3},
    "replay_row": {"weight_versions": 3, "result_json": 4},
}


def _upgrade(table: pa.Table, expected: pa.Schema, kind: str | None) -> pa.Table:
    """Add the nullable columns introduced after the table's schema version, as nulls."""
    version = schema_version(table.schema)
    added = ADDED_COLUMNS.get(kind or "", {})
    if version is None or not added:
        return table
    for name, since in added.items():
        field = expected.field(name)
        if version < since and table.schema.get_field_index(name) < 0 and field.nullable:
            table = table.append_column(field, pa.nulls(table.num_rows, field.type))
    return table


def conform(table: pa.Table | pa.RecordBatch, expected: pa.Schema, where: str) -> pa.Table:
    """Check a batch against a partition's schema; returns it with the canonical schema.

    Names and types must match exactly (no silent casts that could change token values); rows
    of an older schema version are upgraded with nulls for the columns added since.
    """
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    if not isinstance(table, pa.Table):
        raise SchemaMismatchError(f"{where}: expected a pyarrow Table, got {type(table).__name__}")
    kind = row_kind(expected)
    got_kind = row_kind(table.schema)
    if got_kind is not None and got_kind != kind:
        raise SchemaMismatchError(f"{where}: rows are {got_kind}, this partition holds {kind}")
    if kind is not None:
        check_version(kind, schema_version(table.schema), where)
        table = _upgrade(table, expected, kind)
    got = {f.name: f for f in table.schema}
    missing = [f.name for f in expected if f.name not in got]
    extra = [n for n in got if expected.get_field_index(n) < 0]
    if missing or extra:
        raise SchemaMismatchError(
            f"{where}: columns do not match the {kind or 'partition'} schema"
            + (f"; missing {missing}" if missing else "")
            + (f"; unexpected {extra}" if extra else "")
        )
    for f in expected:
        if not got[f.name].type.equals(f.type):
            raise SchemaMismatchError(
                f"{where}: column `{f.name}` has type {got[f.name].type}, expected {f.type}"
            )
        if not f.nullable and table.column(f.name).null_count:
            raise SchemaMismatchError(f"{where}: column `{f.name}` has nulls")
    table = table.select([f.name for f in expected])
    if table.schema.equals(expected, check_metadata=True):
        return table
    # Same names and types: relabel (zero-copy) with the canonical nullability and metadata.
    return pa.Table.from_arrays(table.columns, schema=expected)


# ---------------------------------------------------------------- numpy views and builders


def list_column(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values) of a list column as numpy views; a copy only if it is chunked."""
    col = table.column(name)
    arr = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    if isinstance(arr, pa.ChunkedArray):  # empty table
        arr = pa.array([], type=col.type)
    offsets = arr.offsets.to_numpy(zero_copy_only=False)
    values = arr.values.to_numpy(zero_copy_only=False)
    return offsets, values


def list_rows(table: pa.Table, name: str) -> list[np.ndarray]:
    """One numpy view per row of a list column (no per-token objects)."""
    offsets, values = list_column(table, name)
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]


def list_array(rows: list, dtype: str, nullable_rows: bool = False) -> pa.Array:
    """Build list<dtype> from per-row numpy arrays by one concatenation."""
    pa_type = pa.from_numpy_dtype(np.dtype(dtype))
    present = [r for r in rows if r is not None]
    lengths = np.fromiter((len(r) for r in present), dtype=np.int64, count=len(present))
    values = (
        np.concatenate([np.asarray(r, dtype=dtype) for r in present])
        if present
        else np.empty(0, dtype=dtype)
    )
    if not nullable_rows or len(present) == len(rows):
        offsets = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa_type))
    all_lengths = np.array([0 if r is None else len(r) for r in rows], dtype=np.int64)
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(all_lengths, out=offsets[1:])
    mask = pa.array([r is None for r in rows])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa_type), mask=mask)


@dataclass
class ChunkRow:
    """One staged piece of a call's prefix (chunk 0 also holds the prompt ids)."""

    key: str
    rollout_id: str
    model_call_id: str
    attempt: int
    chunk_seq: int
    token_ids: np.ndarray
    logprobs: np.ndarray | None  # None: the call had no sampled logprobs
    weight_version: int
    prev_len: int
    digest: bytes
    prompt_token_ids: np.ndarray | None = None
    finish_reason: str | None = None  # the call finished with this chunk (a terminal cut)
    stop_reason_json: str | None = None
    weight_versions: list[Span] | None = None  # None (a v2 row): weight_version throughout

    @property
    def delta_len(self) -> int:
        return len(self.token_ids)

    def version_spans(self) -> list[Span]:
        """The spans of this chunk's tokens, [prev_len, cum_len)."""
        if self.weight_versions is not None:
            return list(self.weight_versions)
        return [(self.weight_version, self.prev_len, self.cum_len)] if self.delta_len else []

    @property
    def cum_len(self) -> int:
        return self.prev_len + len(self.token_ids)


@dataclass
class TerminalRow:
    """The canonical row of a finished call; it replaces the call's chunk rows."""

    key: str
    rollout_id: str
    model_call_id: str
    attempt: int
    prompt_token_ids: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray | None
    loss_mask: np.ndarray
    finish_reason: str
    weight_versions: list[tuple[int, int, int]]
    digest: bytes


@dataclass
class ReplayRow:
    """A finished rollout ready for training."""

    key: str
    rollout_id: str
    group_id: str
    generation_index: int
    prompt_len: int
    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray | None  # None: no generation logprobs (training refuses the row)
    reward: float
    weight_version_min: int
    weight_version_max: int
    weight_versions: list[Span] | None = None  # of the generated tokens, at their positions
    # What the episode function returned, as JSON: kept with the row, so a run restored after
    # the episode finished reports the same result as one that never crashed (None: a row
    # written before results were kept).
    result_json: str | None = None

    @property
    def result(self) -> Any:
        return None if self.result_json is None else json.loads(self.result_json)


def chunk_rows_to_table(rows: list[ChunkRow]) -> pa.Table:
    return pa.Table.from_arrays(
        [
            pa.array([r.key for r in rows], pa.string()),
            pa.array([r.rollout_id for r in rows], pa.string()),
            pa.array([r.model_call_id for r in rows], pa.string()),
            pa.array([r.attempt for r in rows], pa.int32()),
            pa.array([r.chunk_seq for r in rows], pa.int32()),
            list_array([r.prompt_token_ids for r in rows], "int32", nullable_rows=True),
            list_array([r.token_ids for r in rows], "int32"),
            list_array([r.logprobs for r in rows], "float32", nullable_rows=True),
            pa.array([r.weight_version for r in rows], pa.int64()),
            pa.array([r.prev_len for r in rows], pa.int32()),
            pa.array([r.delta_len for r in rows], pa.int32()),
            pa.array([r.cum_len for r in rows], pa.int32()),
            pa.array([r.digest for r in rows], _DIGEST),
            pa.array([r.finish_reason for r in rows], pa.string()),
            pa.array([r.stop_reason_json for r in rows], pa.string()),
            spans_array([r.weight_versions for r in rows]),
        ],
        schema=CHUNK_ROW_SCHEMA,
    )


def table_to_chunk_rows(table: pa.Table) -> list[ChunkRow]:
    table = conform(table, CHUNK_ROW_SCHEMA, "chunk rows")
    cols = {n: table.column(n).to_pylist() for n in _SCALARS_CHUNK}
    prompts = _nullable_list_rows(table, "prompt_token_ids")
    toks, lps = list_rows(table, "token_ids"), _nullable_list_rows(table, "logprobs")
    spans = spans_rows(table)
    return [
        ChunkRow(
            key=cols["key"][i],
            rollout_id=cols["rollout_id"][i],
            model_call_id=cols["model_call_id"][i],
            attempt=cols["attempt"][i],
            chunk_seq=cols["chunk_seq"][i],
            token_ids=toks[i],
            logprobs=lps[i],
            weight_version=cols["weight_version"][i],
            prev_len=cols["prev_len"][i],
            digest=cols["digest"][i],
            prompt_token_ids=prompts[i],
            finish_reason=cols["finish_reason"][i],
            stop_reason_json=cols["stop_reason_json"][i],
            weight_versions=spans[i],
        )
        for i in range(table.num_rows)
    ]


_SCALARS_CHUNK = (
    "key",
    "rollout_id",
    "model_call_id",
    "attempt",
    "chunk_seq",
    "weight_version",
    "prev_len",
    "digest",
    "finish_reason",
    "stop_reason_json",
)


def spans_array(rows: list[list[Span] | None]) -> pa.Array:
    """A weight_versions column (a null row: no spans recorded)."""
    return pa.array(
        [None if r is None else [{"version": v, "start": s, "end": e} for v, s, e in r]
         for r in rows],
        _SPANS,
    )  # fmt: skip


def spans_rows(table: pa.Table) -> list[list[Span] | None]:
    return [
        None if r is None else [(s["version"], s["start"], s["end"]) for s in r]
        for r in table.column("weight_versions").to_pylist()
    ]


def _nullable_list_rows(table: pa.Table, name: str) -> list[np.ndarray | None]:
    valid = table.column(name).is_valid().to_numpy(zero_copy_only=False)
    rows = list_rows(table, name)
    return [rows[i] if valid[i] else None for i in range(len(rows))]


def terminal_rows_to_table(rows: list[TerminalRow]) -> pa.Table:
    return pa.Table.from_arrays(
        [
            pa.array([r.key for r in rows], pa.string()),
            pa.array([r.rollout_id for r in rows], pa.string()),
            pa.array([r.model_call_id for r in rows], pa.string()),
            pa.array([r.attempt for r in rows], pa.int32()),
            list_array([r.prompt_token_ids for r in rows], "int32"),
            list_array([r.token_ids for r in rows], "int32"),
            list_array([r.logprobs for r in rows], "float32", nullable_rows=True),
            list_array([r.loss_mask for r in rows], "int8"),
            pa.array([r.finish_reason for r in rows], pa.string()),
            spans_array([r.weight_versions for r in rows]),
            pa.array([r.digest for r in rows], _DIGEST),
        ],
        schema=TERMINAL_ROW_SCHEMA,
    )


def table_to_terminal_rows(table: pa.Table) -> list[TerminalRow]:
    table = conform(table, TERMINAL_ROW_SCHEMA, "terminal rows")
    sc = {
        n: table.column(n).to_pylist()
        for n in ("key", "rollout_id", "model_call_id", "attempt", "finish_reason", "digest")
    }
    spans = spans_rows(table)
    lists = {n: list_rows(table, n) for n in ("prompt_token_ids", "token_ids", "loss_mask")}
    lists["logprobs"] = _nullable_list_rows(table, "logprobs")
    return [
        TerminalRow(
            key=sc["key"][i],
            rollout_id=sc["rollout_id"][i],
            model_call_id=sc["model_call_id"][i],
            attempt=sc["attempt"][i],
            prompt_token_ids=lists["prompt_token_ids"][i],
            token_ids=lists["token_ids"][i],
            logprobs=lists["logprobs"][i],
            loss_mask=lists["loss_mask"][i],
            finish_reason=sc["finish_reason"][i],
            weight_versions=spans[i],
            digest=sc["digest"][i],
        )
        for i in range(table.num_rows)
    ]


_REPLAY_SCALARS = (
    "key",
    "rollout_id",
    "group_id",
    "generation_index",
    "prompt_len",
    "reward",
    "weight_version_min",
    "weight_version_max",
)


def replay_rows_to_table(rows: list[ReplayRow]) -> pa.Table:
    types = {f.name: f.type for f in REPLAY_ROW_SCHEMA}
    arrays = []
    for f in REPLAY_ROW_SCHEMA:
        if f.name in ("token_ids", "loss_mask", "logprobs"):
            dtype = {"token_ids": "int32", "loss_mask": "int8", "logprobs": "float32"}[f.name]
            values = [getattr(r, f.name) for r in rows]
            arrays.append(list_array(values, dtype, nullable_rows=f.name == "logprobs"))
        elif f.name == "weight_versions":
            arrays.append(spans_array([r.weight_versions for r in rows]))
        elif f.name == "result_json":
            arrays.append(pa.array([r.result_json for r in rows], pa.string()))
        else:
            arrays.append(pa.array([getattr(r, f.name) for r in rows], types[f.name]))
    return pa.Table.from_arrays(arrays, schema=REPLAY_ROW_SCHEMA)


def table_to_replay_rows(table: pa.Table) -> list[ReplayRow]:
    table = conform(table, REPLAY_ROW_SCHEMA, "replay rows")
    sc = {n: table.column(n).to_pylist() for n in _REPLAY_SCALARS}
    lists = {n: list_rows(table, n) for n in ("token_ids", "loss_mask")}
    lists["logprobs"] = _nullable_list_rows(table, "logprobs")
    spans = spans_rows(table)
    results = table.column("result_json").to_pylist()
    return [
        ReplayRow(
            **{n: sc[n][i] for n in _REPLAY_SCALARS},
            **{n: lists[n][i] for n in lists},
            weight_versions=spans[i],
            result_json=results[i],
        )
        for i in range(table.num_rows)
    ]
