"""TransferQueue 0.1.11 baseline adapter for the rollout-store benchmark.

Times TransferQueue (https://pypi.org/project/TransferQueue/, the data plane used by verl,
ROLL and NeMo RL) on the same rows as our store: ``[rows, T]`` int32 token ids and float32
logprobs, one string key per row.

Only TransferQueue's public API is used:

* start:  ``transfer_queue.init(conf)`` on the already-initialised Ray. It creates one named
  ``TransferQueueController`` actor (namespace ``transfer_queue``) and
  ``num_data_storage_units`` ``SimpleStorageUnit`` actors (the default in-memory, ZMQ-based
  backend), plus a ZMQ client in this process. Both actor classes ask Ray for ``num_cpus=1``,
  so Ray needs ``num_storage_units + 1`` CPUs or ``init`` hangs waiting for resources.
* put:    ``transfer_queue.kv_batch_put(keys, partition_id, fields=TensorDict)``.
* get:    ``transfer_queue.kv_batch_get(keys, partition_id)`` -> ``TensorDict`` whose
  columns come back as jagged nested tensors (storage keeps one tensor per row per field);
  they are repacked here into dense ``[rows, T]`` arrays.
* save:   ``transfer_queue.save_checkpoint(dir)``: the controller pickles its metadata to
  ``controller_state.pkl``, each storage unit pickles its ``{field: {global_index: tensor}}``
  dict to ``storage_units/su_<pos>_<id>.pkl``, plus ``metadata.json``. Written to
  ``<dir>.tmp`` and renamed into place.
* load:   ``transfer_queue.load_checkpoint(dir)`` into a freshly started instance with the
  same number of storage units: ``pickle.load`` in each storage unit and in the controller.
* close:  ``transfer_queue.close()``.

TransferQueue keeps its state in module globals and a single named controller actor, so only
one ``TransferQueueBaseline`` may be open per process (and per Ray cluster) at a time: close
one before starting the next (e.g. before ``load`` into a fresh instance).

Install: ``pip install -e '.[bench]'`` (or ``pip install TransferQueue==0.1.11``).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

PARTITION_ID = "bench"
TOKEN_FIELD = "token_ids"
LOGPROB_FIELD = "logprobs"


def _import_tq() -> Any:
    try:
        import transfer_queue as tq
    except ImportError as e:
        raise ImportError(
            "TransferQueue is not installed; the TransferQueue baseline needs it. "
            "Install the benchmark extras with: pip install -e '.[bench]' "
            "(or: pip install TransferQueue==0.1.11)"
        ) from e
    return tq


def _row_key(i: int) -> str:
    return f"row-{i:08d}"


def _dense(column: Any, rows: int, dtype: np.dtype) -> np.ndarray:
    """Turn a column of TransferQueue's get result into a dense ``[rows, T]`` array."""
    import torch

    if isinstance(column, torch.Tensor):
        if column.is_nested:
            if column.layout == torch.jagged:
                offsets = column.offsets()
                lengths = offsets.diff()
                if bool((lengths == lengths[0]).all()):
                    # One contiguous buffer of all rows: a view, no per-row copy.
                    column = column.values().reshape(rows, int(lengths[0]))
                else:
                    raise ValueError("rows of unequal length; this baseline stores fixed-T rows")
            else:
                column = torch.stack(column.unbind())
        return column.numpy().astype(dtype, copy=False)
    # NonTensorStack or list fallback: one object per row.
    return np.stack([np.asarray(v) for v in column.tolist()]).astype(dtype, copy=False)


class TransferQueueBaseline:
    """Put / get / checkpoint-save / checkpoint-load of fixed-length rows in TransferQueue."""

    def __init__(self, num_storage_units: int = 1, put_chunk_rows: int | None = 1) -> None:
        """Start TransferQueue on the running Ray.

        ``put_chunk_rows``: rows per ``kv_batch_put`` call (``None``: one call for the whole
        batch). It defaults to 1 because SimpleStorage keeps each row as a *view* into the
        batch's received buffer, and its checkpoint pickles every row view with that whole
        buffer: a checkpoint of rows put k at a time is ~k times the payload (1,000 rows of
        32 KiB in one call -> ~32 GB written, past the 200 s storage RPC timeout).
        """
        if put_chunk_rows is not None and put_chunk_rows < 1:
            raise ValueError("put_chunk_rows must be >= 1 or None")
        tq = _import_tq()
        import ray

        if not ray.is_initialized():
            raise RuntimeError("initialise Ray first (e.g. ray.init(address='local', ...))")
        need = num_storage_units + 1  # controller and each storage unit take num_cpus=1
        have = ray.cluster_resources().get("CPU", 0)
        if have < need:
            raise RuntimeError(
                f"TransferQueue with {num_storage_units} storage unit(s) needs {need} Ray CPUs "
                f"(controller and each storage unit reserve num_cpus=1); Ray has {have}"
            )
        self._tq = tq
        self.num_storage_units = num_storage_units
        self.put_chunk_rows = put_chunk_rows
        conf = {
            "controller": {"polling_mode": False},
            "backend": {
                "storage_backend": "SimpleStorage",
                "SimpleStorage": {
                    "num_data_storage_units": num_storage_units,
                    "total_storage_size": None,
                },
            },
        }
        from omegaconf import OmegaConf

        tq.init(OmegaConf.create(conf))
        self._keys: list[str] = []
        self._closed = False

    def put(self, token_ids: np.ndarray, logprobs: np.ndarray) -> None:
        import torch
        from tensordict import TensorDict

        if token_ids.shape != logprobs.shape or token_ids.ndim != 2:
            raise ValueError(f"shapes differ or not 2-D: {token_ids.shape} {logprobs.shape}")
        rows = token_ids.shape[0]
        start = len(self._keys)
        keys = [_row_key(start + i) for i in range(rows)]
        tok = torch.from_numpy(np.ascontiguousarray(token_ids, dtype=np.int32))
        lps = torch.from_numpy(np.ascontiguousarray(logprobs, dtype=np.float32))
        step = rows if self.put_chunk_rows is None else self.put_chunk_rows
        for lo in range(0, rows, max(step, 1)):
            hi = min(lo + step, rows)
            fields = TensorDict(
                {TOKEN_FIELD: tok[lo:hi], LOGPROB_FIELD: lps[lo:hi]}, batch_size=[hi - lo]
            )
            self._tq.kv_batch_put(keys=keys[lo:hi], partition_id=PARTITION_ID, fields=fields)
        self._keys.extend(keys)

    def get(self) -> tuple[np.ndarray, np.ndarray]:
        keys = self._keys
        if not keys:
            return np.empty((0, 0), np.int32), np.empty((0, 0), np.float32)
        td = self._tq.kv_batch_get(
            keys=keys, partition_id=PARTITION_ID, select_fields=[TOKEN_FIELD, LOGPROB_FIELD]
        )
        rows = len(keys)
        return (
            _dense(td[TOKEN_FIELD], rows, np.dtype(np.int32)),
            _dense(td[LOGPROB_FIELD], rows, np.dtype(np.float32)),
        )

    def save(self, path: str) -> int:
        """TransferQueue's own checkpoint (``save_checkpoint``); returns bytes on disk."""
        self._tq.save_checkpoint(path, metadata={"rows": len(self._keys)})
        total = 0
        for root, _dirs, files in os.walk(path):
            for name in files:
                total += os.path.getsize(os.path.join(root, name))
        return total

    def load(self, path: str) -> None:
        """TransferQueue's own ``load_checkpoint`` into this (fresh) instance."""
        self._tq.load_checkpoint(path)
        # The keys live in the restored controller; list them to know what get() fetches.
        listed = self._tq.kv_list(PARTITION_ID).get(PARTITION_ID, {})
        self._keys = sorted(listed)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._tq.close()

    def __enter__(self) -> TransferQueueBaseline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
