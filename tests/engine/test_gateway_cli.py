"""`rollout-recovery gateway` end to end: a standalone gateway serves a harness it did not
start; SIGTERM ends it with a checkpoint holding the open rollout; `--restore` brings the
rollout back, and the harness opening it again gets its call from the journal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.engine
REPO = Path(__file__).resolve().parents[2]
TOKEN = "cli-gateway-token"
TASK = {"messages": [{"role": "user", "content": "hi"}]}


def _start(run_dir: Path, log: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    config = REPO / "configs" / "gateway_harness.yaml"
    cmd = [sys.executable, "-m", "rollout_recovery.cli", "gateway", *extra, "--config", str(config),
           f"checkpointing.checkpoint_dir={run_dir}",
           "rollout_checkpointing.snapshot_attempt_interval_s=60"]  # fmt: skip
    env = os.environ | {"ROLLOUT_RECOVERY_GATEWAY_TOKEN": TOKEN}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("rollout gateway at "):
                assert f"(token {TOKEN})" in line
                return proc, line.split()[3]
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.5)
    proc.kill()
    raise AssertionError("the gateway did not start: " + log.read_text()[-3000:])


def _stop(proc: subprocess.Popen, log: Path) -> str:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    return log.read_text()


def _call(url: str) -> tuple[dict, str, str]:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    opened = httpx.post(f"{url}/rollouts", headers=auth, timeout=60,
                        json={"group_id": "cli", "task": TASK, "seed": 5}).json()  # fmt: skip
    client = openai.OpenAI(base_url=opened["base_url"], api_key=TOKEN, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="policy", messages=TASK["messages"], max_tokens=8
    )
    return opened, raw.headers["x-rollout-recovery-source"], raw.parse().choices[0].message.content


def test_the_gateway_command_keeps_an_open_rollout_across_a_restart(tmp_path):
    run_dir = tmp_path / "run"
    proc, url = _start(run_dir, tmp_path / "first.log")
    opened, source, content = _call(url)
    assert opened["restored"] is False and source == "decoded"
    out = _stop(proc, tmp_path / "first.log")
    assert "open rollouts were checkpointed in" in out

    proc, url = _start(run_dir, tmp_path / "second.log", "--restore")
    try:
        again, source2, content2 = _call(url)
        assert again["restored"] is True and again["journaled_steps"] == 1
        assert (source2, content2) == ("journal", content)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        done = httpx.post(f"{url}/rollouts/cli-g0/finish", headers=auth, timeout=60,
                          json={"result": {"text": content}}).json()  # fmt: skip
        assert done["decoded_tokens"] == 0 and done["replay_key"] == "cli/000"
    finally:
        _stop(proc, tmp_path / "second.log")
