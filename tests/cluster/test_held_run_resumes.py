"""A run held by the `pause` crash action and resumed by a check goes on as before: every
process the pause stopped is started again, Ray's own agents included.

Ray's dashboard and runtime-env agents retitle themselves over their environment, so a check
that resumed only the processes whose environment carries its token left them stopped, and
the first actor the resumed run created (an in-process restore's new environment actor) waited
on the stopped runtime-env agent for good."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "functional_tests"))

import processes  # noqa: E402
from pauses import Pauses, resume, session  # noqa: E402

from rollout_recovery import crashpoints  # noqa: E402

DRIVER = """
import ray
from rollout_recovery import crashpoints

ray.init(address="local", num_cpus=1, include_dashboard=False)

@ray.remote
class Probe:
    def ping(self):
        return "pong"

ray.get(Probe.remote().ping.remote())  # every agent is up and used once
crashpoints.crash_point("snapshot_taken", step=1)  # held here until the check resumes it
fresh = Probe.options(runtime_env={"env_vars": {"PROBE": "after-the-pause"}}).remote()
print(ray.get(fresh.ping.remote(), timeout=60), flush=True)
"""


@pytest.fixture
def check_mark(monkeypatch):
    monkeypatch.delenv(processes.MARK_ENV, raising=False)
    mark = processes.mark_this_check()
    yield mark
    processes.kill_marked(mark)


def test_a_held_run_creates_actors_again_after_the_check_resumes_it(tmp_path, check_mark):
    pauses = Pauses(tmp_path / "pauses.jsonl")
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER], cwd=REPO, stdout=subprocess.PIPE, text=True,
        env=os.environ | pauses.env(), start_new_session=True,
    )  # fmt: skip
    try:
        held = pauses.wait(proc, time.monotonic() + 120)
        assert held is not None, "the run ended before its pause"
        stopped = [p for p in session(proc.pid) if _state(p) in ("T", "t")]
        agents = [p for p in stopped if processes.command(p).startswith("ray::RuntimeEnvAgent")]
        assert agents, "the pause did not stop the runtime-env agent: nothing is tested"
        assert resume(proc.pid) == [], "a process of the held run was taken for another's"
        out = proc.communicate(timeout=90)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    left = [p for p in crashpoints.session_pids(proc.pid) if _state(p) in ("T", "t")]
    assert proc.returncode == 0 and out.strip().endswith("pong"), out
    assert left == []


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return None
