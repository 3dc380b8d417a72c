"""The processes of one check's runs, and signals that reach only them.

Checks run at once (tests/functional): each kills, freezes and thaws its own runs' processes by
pid, and with 32768 pids a pid seen minutes ago may by now be another check's engine or Ray
worker. So every check marks its own process tree: `mark_this_check()` puts a token of its own
in its environment, every run it starts (and Ray's processes, engines and actors under it)
inherits it, and `signal_own` signals a pid only while that process is still the check's: it
carries the token (read from /proc/<pid>/environ) or, where its environment reads as no
check's at all, its parent is the check's. A pid that is not is left alone and reported."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
from pathlib import Path

MARK_ENV = "ROLLOUT_RECOVERY_CHECK_RUN"


def mark_this_check() -> str:
    """This check's token, set in its own environment (inherited by whatever it starts)."""
    os.environ.setdefault(MARK_ENV, f"check-{os.getpid()}-{secrets.token_hex(6)}")
    return os.environ[MARK_ENV]


def owned(pid: int, mark: str | None = None) -> bool:
    """Whether process `pid` is alive and this check's: the nearest of it and its ancestors
    that carries any check's token carries this one. Ray's agents retitle themselves over
    their environment (setproctitle), so their own token cannot be read: they are the check's
    because the raylet that started them is."""
    mark = mark or os.environ.get(MARK_ENV)
    if not mark:
        raise RuntimeError(f"{MARK_ENV} is not set: call mark_this_check() first")
    seen: set[int] = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        token = next((e for e in env if e.startswith(f"{MARK_ENV}=".encode())), None)
        if token is not None:
            return token == f"{MARK_ENV}={mark}".encode()
        pid = ppid
    return False


def signal_own(pids: set[int] | list[int], sig: int, pgid: int | None = None) -> list[int]:
    """Send `sig` to the process group `pgid` (a run this check started and has not reaped: its
    id cannot be reused) and to every pid in `pids` that is still this check's; returns the
    pids left alone because a process of someone else's has them now (pids that are gone are
    skipped without a word)."""
    if pgid is not None:
        os.killpg(pgid, sig)
    foreign = []
    for pid in pids:
        if not owned(pid):
            if Path(f"/proc/{pid}").exists():
                foreign.append(pid)
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return foreign


def descendants(pid: int) -> set[int]:
    """Every process under `pid` now (children, their children, ...)."""
    out, frontier = set(), [pid]
    while frontier:
        p = frontier.pop()
        kids = subprocess.run(["pgrep", "-P", str(p)], capture_output=True, text=True).stdout
        for k in map(int, kids.split()):
            if k not in out:
                out.add(k)
                frontier.append(k)
    return out


def zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return False


def alive_own(pid: int) -> bool:
    """A live process of this check's (a pid reused by someone else's is not)."""
    return owned(pid) and not zombie(pid)


def pids_marked(mark: str) -> list[int]:
    """Every live process carrying `mark` (a scan of /proc)."""
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and owned(int(e), mark)
            and not zombie(int(e))]  # fmt: skip


def kill_marked(mark: str) -> int:
    """SIGKILL every process carrying `mark` (a check that ran past its time, with whatever
    it started); returns how many there were."""
    pids = pids_marked(mark)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(pids)


def command(pid: int) -> str:
    """What process `pid` runs now (its command line, shortened), for reports."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "(gone)"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:80]
