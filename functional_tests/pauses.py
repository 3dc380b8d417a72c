"""A check's run held at an event it reaches, not at a moment the check picks.

Whether a kill is useful (a snapshot holding cut calls, of a step a restore still trains) used
to depend on how fast the check's poll saw the snapshot: on a loaded machine the run could
finish its steps, or lease the batch, before the poll came round. Here the run holds itself:
the check arms the crash point `snapshot_taken` with the `pause` action
(rollout_recovery/crashpoints.py) and a condition on its facts, so the controller stops the
whole job right after each qualifying snapshot is published and waits. The check judges that
snapshot with its own rule and either acts on the held job (freeze, read, kill) or resumes it.
The run cannot move past a snapshot the check has not judged, however slow the check is."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from processes import signal_own

from rollout_recovery import crashpoints


class Pauses:
    """One run's pauses: the environment that arms them, and each held job in turn."""

    def __init__(self, mark: Path, point: str = "snapshot_taken", when: str = "") -> None:
        self.mark, self.point, self.when = mark, point, when
        self.seen = 0
        mark.unlink(missing_ok=True)

    def env(self) -> dict[str, str]:
        """The variables that arm the pause in every process of the run."""
        out = {crashpoints.ENV: f"{self.point}:pause", crashpoints.MARK_ENV: str(self.mark)}
        return out | ({crashpoints.WHEN_ENV: self.when} if self.when else {})

    def records(self) -> list[dict]:
        """The complete mark lines so far (a line being appended ends with its newline)."""
        if not self.mark.exists():
            return []
        return [json.loads(ln) for ln in self.mark.read_text().split("\n")[:-1]]

    def wait(self, proc, deadline: float) -> dict | None:
        """The next pause's mark line (point, arrival, pid, facts) once the job is held, or
        None when the run ended first; TimeoutError past `deadline` (time.monotonic)."""
        while True:
            found = self.records()
            if len(found) > self.seen:
                held = found[self.seen]
                self.seen += 1
                held["held_s"] = wait_stopped(held["pid"], deadline)
                return held
            if proc.poll() is not None:
                if len(self.records()) > self.seen:
                    continue
                return None
            if time.monotonic() > deadline:
                raise TimeoutError(f"no pause at {self.point} ({self.when}) before the deadline")
            time.sleep(0.01)


def wait_stopped(pid: int, deadline: float) -> float:
    """Wait until the pausing process has stopped itself (it signals the rest of its session
    first, itself last): resuming before that would leave it stopped for good. Returns the
    seconds waited."""
    t0 = time.monotonic()
    while (state := process_state(pid)) not in (None, "T", "t", "Z"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} marked a pause but is still {state!r}")
        time.sleep(0.002)
    return time.monotonic() - t0


def process_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return None


def session(sid: int) -> set[int]:
    """Every live process of the run started as session `sid` (its Ray and engines too)."""
    return set(crashpoints.session_pids(sid))


def resume(sid: int, keep: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """SIGCONT the held run's processes but `keep` (this check's own only); returns the pids
    left alone because they are another's by now."""
    return signal_own(session(sid) - set(keep), signal.SIGCONT)
