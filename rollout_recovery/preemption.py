"""Preemption notices for a training run (docs/preemption.md): SIGTERM, or a notice file
appearing, becomes `Preempted` at a point where the run can take its final checkpoint.

Where the loop waits on generation (`submit_groups`, `finished_groups`) a notice interrupts the
wait at once: the handler raises KeyboardInterrupt, the only exception Ray's waits end with,
and `interruptible` turns it into `Preempted`. Anywhere else the notice is only noted and
`check` raises at the next safe point (the start of a step, the end of its trainer
checkpoint): between an ack and its trainer checkpoint the buffer no longer holds the rows
just trained on, so a snapshot there would pair them with the older checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator

from rollout_recovery.config import PreemptionConfig
from rollout_recovery.errors import Preempted

log = logging.getLogger(__name__)
POLL_S = 1.0  # how often the notice file is looked for


class NoticeWatch:
    """Watches for a preemption notice on behalf of one TrainingRun."""

    def __init__(self, cfg: PreemptionConfig) -> None:
        self.cfg = cfg
        self.notice: str | None = None  # the first notice, e.g. "SIGTERM"
        self.noticed_at: float | None = None  # time.monotonic() of it
        self._may_interrupt = False
        self._previous = None  # the SIGTERM handler before ours
        self._stop = threading.Event()

    def start(self) -> bool:
        """Handle SIGTERM (and poll `notice_file`) from now on; False where it cannot (off, or
        not on the main thread, the only one that receives signals)."""
        if not self.cfg.enabled:
            return False
        if threading.current_thread() is not threading.main_thread():
            log.warning("preemption notices are not watched: the run was opened off the main "
                        "thread, which alone receives signals")  # fmt: skip
            return False
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        if self.cfg.notice_file:
            threading.Thread(target=self._poll, name="preemption-notice", daemon=True).start()
        return True

    def stop(self) -> None:
        """Stop watching and give SIGTERM back to its earlier handler."""
        self._stop.set()
        if self._previous is not None:
            with contextlib.suppress(ValueError):  # off the main thread at interpreter exit
                signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def time_left(self) -> float:
        """Seconds of `grace_s` left since the notice."""
        if self.noticed_at is None:
            return self.cfg.grace_s
        return self.cfg.grace_s - (time.monotonic() - self.noticed_at)

    def check(self) -> None:
        """At a safe point: raise `Preempted` if a notice came."""
        if self.notice is not None:
            raise Preempted(self.notice)

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A wait a notice may end at once (see the module docstring)."""
        self._may_interrupt = True
        try:
            self.check()
            yield
        except KeyboardInterrupt:
            if self.notice is None:  # Ctrl-C, not a preemption
                raise
            raise Preempted(self.notice) from None
        finally:
            self._may_interrupt = False

    def _note(self, what: str) -> None:
        if self.notice is None:
            self.notice, self.noticed_at = what, time.monotonic()

    def _on_signal(self, signum: int, frame: object) -> None:
        self._note(signal.Signals(signum).name)
        if self._may_interrupt:
            raise KeyboardInterrupt

    def _poll(self) -> None:
        path = self.cfg.notice_file
        while not self._stop.wait(POLL_S):
            if os.path.exists(path):
                self._note(f"notice file {path}")
                # A real signal to the main thread (it also ends a blocking call there).
                signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
                return
