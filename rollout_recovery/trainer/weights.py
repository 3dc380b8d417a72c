"""The weights a loop hands to the workers: a directory of this owner's own that the loop writes
into, and the rule of their versions (the first push after a restore re-establishes the
snapshot's version and refuses other weights than its calls were decoded with)."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from rollout_recovery.data_plane.ownership import Owner
from rollout_recovery.protocol import Ledger
from rollout_recovery.runtime import ActorProxy
from rollout_recovery.storage import RunStorage

WEIGHTS_DIR = "weights"


class RunWeights:
    def __init__(
        self, storage: RunStorage, owner: Owner, restored: Ledger | None, due: bool
    ) -> None:
        self._scratch: tempfile.TemporaryDirectory | None = None
        self.dir = self._own_dir(storage, owner)
        # The restored snapshot's ledger, while its trainer checkpoint's weights are still to
        # be pushed (before any step).
        self.restored = restored if due else None
        self.version = restored.weight_version if restored is not None else 0
        self.push_s = 0.0  # how long the last push took

    @property
    def due(self) -> bool:
        return self.restored is not None

    def _own_dir(self, storage: RunStorage, owner: Owner) -> Path:
        """A directory of this owner's own (a stale owner never writes into the newer one's);
        older owners' are removed. On an object store, a local temporary directory (the
        workers load from local files)."""
        here = storage.local_path(WEIGHTS_DIR)
        if here is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="rollout-recovery-weights-")
            return Path(self._scratch.name)
        mine = here / f"epoch-{owner.epoch:06d}"
        for old in here.glob("epoch-*") if here.is_dir() else []:
            if old != mine:
                shutil.rmtree(old, ignore_errors=True)
        mine.mkdir(parents=True, exist_ok=True)
        return mine

    def push(self, rollouts: ActorProxy, in_flight: bool) -> int:
        """Push what the loop wrote into `dir` to every worker; returns the weight version."""
        t0 = time.monotonic()
        if self.restored is not None:
            ledger = self.restored
            self.version = rollouts.push_weights(str(self.dir), ledger.weight_version,
                                                 ledger.model.weights_sha256)  # fmt: skip
            self.restored = None
        else:
            self.version = rollouts.push_weights(str(self.dir), None, None, in_flight)
        self.push_s = time.monotonic() - t0
        return self.version

    def cleanup(self) -> None:
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None
