"""The training batch of each step, kept under `<checkpoint_dir>/batches/` as the trainer
leased it: the rows in Arrow IPC (sorted by key), what each episode function returned, and a
digest over keys, token ids and rewards that the step log records. Recovery checks compare
them run against run; a restore never reads them."""

from __future__ import annotations

import hashlib
import json

import pyarrow as pa
import pyarrow.compute as pc

from rollout_recovery.data_plane.schemas import list_rows


def batch_rel(step: int, what: str) -> str:
    return f"batches/step-{step:06d}.{what}"


def batch_digest(table: pa.Table) -> str:
    h = hashlib.sha256()
    keys = table.column("key").to_pylist()
    ids = list_rows(table, "token_ids")
    rewards = table.column("reward").to_pylist()
    for i in sorted(range(len(keys)), key=keys.__getitem__):
        h.update(keys[i].encode())
        h.update(ids[i].tobytes())
        h.update(repr(rewards[i]).encode())
    return h.hexdigest()


def batch_bytes(table: pa.Table) -> bytes:
    """The exact training batch of a step, rows sorted by key."""
    table = table.take(pc.sort_indices(table, [("key", "ascending")]))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def results_json(results: list) -> bytes:
    """What each episode function returned, by replay key (None only in rows written before
    results were kept with them)."""
    out = {r.key: s for g in results for r, s in zip(g.rows, g.results, strict=True)}
    return json.dumps(out, sort_keys=True).encode()
