"""An episode run by a harness in another process, through the rollout gateway.

The episode function starts the harness command (`environment.settings.command`, default: the
shipped `openai` client harness) with its rollout's base URL and the gateway token in the
standard `OPENAI_BASE_URL` / `OPENAI_API_KEY` variables, the task as JSON in `ROLLOUT_TASK`, and
waits for it. Every model call the harness makes arrives at the gateway as this episode's
`ctx.chat`, so it is journaled like any other. After a restore the function runs again, which
starts the harness again from the top: the calls it already made are answered from the journal
and the one that was in flight continues from its prefix. The harness's last line of output is
its result (JSON); `environment.reward` scores it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

DEFAULT_COMMAND = [sys.executable, "-m", "rollout_recovery.episodes.openai_harness"]


class HarnessFailed(RuntimeError):
    """The harness exited with an error or printed no JSON result."""


async def episode(ctx, task: dict):
    if ctx.base_url is None:
        raise HarnessFailed(
            "the harness episode needs the rollout gateway: set gateway.enabled=true"
        )
    command = list(ctx.settings.get("command") or DEFAULT_COMMAND)
    env = os.environ | {
        "OPENAI_BASE_URL": ctx.base_url,
        "OPENAI_API_KEY": ctx.api_key or "none",
        "ROLLOUT_ID": ctx.rollout_id,
        "ROLLOUT_TASK": json.dumps(task),
        "ROLLOUT_MAX_TURNS": str(ctx.max_turns),
    }
    proc = await asyncio.create_subprocess_exec(
        *command, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await proc.communicate()
    finally:
        if proc.returncode is None:  # cancelled: the harness must not outlive its episode
            proc.kill()
            await proc.wait()
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-3:]
        raise HarnessFailed(f"{ctx.rollout_id}: {command[0]} exited {proc.returncode}: {tail}")
    lines = out.decode().strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise HarnessFailed(f"{ctx.rollout_id}: the harness printed no JSON result") from None
