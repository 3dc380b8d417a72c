"""Row factories for data-plane tests: content is a pure function of the key, so any row can
be checked for tearing by recomputing it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from rollout_recovery.data_plane.digest import token_digest
from rollout_recovery.data_plane.schemas import (
    list_rows,
)
from rollout_recovery.testing.campaign.snapshot_files import chunk_rows, key_tokens, replay_rows


def chunk_table(keys: list[str], tokens: int = 64) -> pa.Table:
    return chunk_rows(keys, tokens)


def replay_table(keys: list[str], tokens: int = 64) -> pa.Table:
    return replay_rows(keys, tokens)


def assert_rows_intact(table: pa.Table) -> None:
    """Every row's tokens equal what its key generates, and its digest matches."""
    keys = table.column("key").to_pylist()
    toks = list_rows(table, "token_ids")
    digests = table.column("digest").to_pylist() if "digest" in table.column_names else None
    for i, k in enumerate(keys):
        ids, _ = key_tokens(k, len(toks[i]))
        np.testing.assert_array_equal(toks[i], ids, err_msg=f"torn row {k}")
        if digests is not None:
            assert digests[i] == token_digest(toks[i]), k


def by_key(table: pa.Table) -> pa.Table:
    import pyarrow.compute as pc

    return table.take(pc.sort_indices(table, [("key", "ascending")]))


@contextlib.contextmanager
def local_s3(bucket: str, prefix: str) -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 for the block; yields `s3://bucket/prefix` with the
    credentials and endpoint options pyarrow needs (the bucket is created on first write)."""
    import logging

    from rollout_recovery.testing.s3_server import S3Server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = S3Server(ip_address="127.0.0.1", port=0, verbose=False)  # binds a free port
    server.start()
    _, port = server.get_host_and_port()
    try:
        yield (f"s3://testing:testing@{bucket}/{prefix}?endpoint_override=127.0.0.1:{port}"
               "&scheme=http&region=us-east-1&allow_bucket_creation=true")  # fmt: skip
    finally:
        server.stop()


@contextlib.contextmanager
def coordinator_without_engines(store, run_dir, *overrides: str):
    """A real CheckpointCoordinator over `store`, a real environment actor and no workers,
    owning `run_dir`'s snapshot root; yields (coordinator, environment client, run storage)."""
    from rollout_recovery.config import load_config
    from rollout_recovery.controller.coordinator import CheckpointCoordinator, RunState
    from rollout_recovery.controller.metrics import RunMetrics
    from rollout_recovery.controller.selection import DATA_PLANE
    from rollout_recovery.data_plane import StagingStore
    from rollout_recovery.environment.client import EnvironmentClient
    from rollout_recovery.generation.pool import WorkerPool
    from rollout_recovery.storage import RunStorage

    cfg = load_config(None, [f"checkpointing.checkpoint_dir={run_dir}", *overrides])
    storage = RunStorage(cfg.checkpointing.checkpoint_dir)
    env = EnvironmentClient.start(cfg.environment_config(), WorkerPool([]), store)
    try:
        owner = StagingStore.claim(storage.child_uri(DATA_PLANE))
        coordinator = CheckpointCoordinator(
            cfg.checkpoint_config(), RunState({"path": "tiny://default"}), store,
            WorkerPool([]), env, storage, RunMetrics(), owner,
        )  # fmt: skip
        yield coordinator, env, storage
    finally:
        env.close()
