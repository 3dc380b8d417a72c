"""What the workers' engines did, kept next to the run: `workers.json` (where each worker
serves) and `call_attempts/<session>.jsonl` (each call attempt's resume verdict, prefix
spliced in, tokens decoded and finish), the evidence a recovery check compares across a
crash. Both are reports: a failed write is a warning, never a failed run."""

from __future__ import annotations

import json
import logging
import os
import time

from rollout_recovery.errors import one_line
from rollout_recovery.generation.pool import WorkerPool
from rollout_recovery.storage import RunStorage

log = logging.getLogger("rollout_recovery")
WORKERS_FILE = "workers.json"
CALL_ATTEMPTS_DIR = "call_attempts"


class EvidenceLog:
    def __init__(self, storage: RunStorage, workers: WorkerPool) -> None:
        self.storage, self.workers = storage, workers
        self.session = f"session-{time.time_ns()}"  # names this process's call-attempt log
        self._cursors: dict[str, int] = {}  # per worker actor: its call-attempt log read so far
        self._dropped: dict[str, int] = {}
        self._metrics_url: str | None = None

    def carry_on(self, before: EvidenceLog) -> None:
        """Go on with `before`'s log, for a restore that kept the workers (api.py `restart`):
        their records continue, so the same session's file and cursors (no record twice)."""
        self.session = before.session
        self._cursors, self._dropped = before._cursors, before._dropped
        self.write_workers(self._metrics_url)

    def write_workers(self, metrics_url: str | None) -> None:
        """Where this session's workers serve (URL, pids), the controller's metrics and its
        process, so an operator or a check can read them (the control token is not written).
        A check that kills the controller reads its pid here: the standby controller is a
        RolloutRecovery process too."""
        self._metrics_url = metrics_url
        body = {"session": self.session, "workers": self.workers.describe(),
                "metrics_url": metrics_url, "startup_s": self.workers.startup_s,
                "controller_pid": os.getpid()}  # fmt: skip
        try:
            self.storage.write_bytes(WORKERS_FILE, json.dumps(body, indent=1).encode())
        except OSError as err:
            log.warning("cannot write %s: %s", WORKERS_FILE, one_line(err))

    def record_call_attempts(self, step: int) -> int:
        """Append the call-attempt records changed since the last call, each tagged with
        `step` and the worker index; returns the number of lines. A failed write is retried
        with the next step (the cursors do not move)."""
        pages = self.workers.call_attempts(self._cursors)
        lines = []
        for i, (name, page) in sorted(pages.items()):
            lines += [json.dumps({"step": step, "worker": i} | rec) for rec in page["attempts"]]
            if page["dropped"] > self._dropped.get(name, 0):
                log.warning("worker %d dropped %d call-attempt records (token_capture."
                            "max_attempt_records)", i, page["dropped"])  # fmt: skip
                self._dropped[name] = page["dropped"]
        if lines:
            try:
                rel = f"{CALL_ATTEMPTS_DIR}/{self.session}.jsonl"
                self.storage.append_line(rel, "\n".join(lines))
            except OSError as err:
                log.warning("cannot write %s: %s", CALL_ATTEMPTS_DIR, one_line(err))
                return 0
        self._cursors |= {name: page["next"] for name, page in pages.values()}
        return len(lines)
