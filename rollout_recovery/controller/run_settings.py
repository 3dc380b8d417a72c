"""The settings a run's records depend on, recorded in every snapshot's ledger and compared by
a restore before it claims, sets aside, deletes or starts anything.

A restore continues the episodes, groups and prompts its snapshot names. Their ids, the async
producer's cursor (prompt numbers per step), the sampler seeds and each call's token budget
all follow from the settings below: continued under other values, a restore would re-dispatch
trained prompts, skip others, or put a call's resumed tail under another budget, and the
location would mix two runs. So any change is refused, naming the keys. Settings a run may
change between restores (`grpo.steps`, the learning rate, the checkpoint cadence, failover,
`max_groups_in_flight`, the age bound) are not here: the continuation does not depend on them.
`rollout_recovery.target_level` has its own rule (selection.py): a restore at a coarser level
than its snapshot holds is refused, a finer one goes on.
"""

from __future__ import annotations

import json
from typing import Any

from rollout_recovery.config import RolloutRecoveryConfig

KEYS = (
    "grpo.prompts_per_step",  # group ids, the cursor's prompt numbers, the tasks of a step
    "grpo.generations_per_prompt",  # the episodes of a group
    "grpo.async_grpo.enabled",  # the cursor, and which step trains a group
    "grpo.seed",  # every call's sampler seed and the tasks
    "policy.generation.max_new_tokens",  # a resumed call's budget
    "policy.generation.temperature",  # the tail a resumed call samples
    "environment.episode",  # what an episode record continues
    "environment.tasks",
    "environment.max_turns",
)


def of(cfg: RolloutRecoveryConfig) -> dict[str, Any]:
    """The values of KEYS in `cfg`, by dotted key."""
    out = {}
    for key in KEYS:
        value: Any = cfg
        for part in key.split("."):
            value = getattr(value, part)
        out[key] = value
    return out


def changed(recorded: dict[str, Any], cfg: RolloutRecoveryConfig) -> dict[str, tuple[Any, Any]]:
    """The recorded settings `cfg` sets otherwise: key -> (recorded, now). A key the record
    lacks (written before it was recorded) is not compared."""
    now = of(cfg)
    return {k: (v, now[k]) for k, v in recorded.items() if k in now and now[k] != v}


def refusal(location: str, snapshot: str, diff: dict[str, tuple[Any, Any]]) -> str:
    """The one line that refuses a restore with changed settings."""
    was = ", ".join(f"{k}={_shown(v[0])}" for k, v in diff.items())
    now = ", ".join(f"{k}={_shown(v[1])}" for k, v in diff.items())
    return (
        f"the run in {location} was started with {was} (snapshot {snapshot}) and this restore "
        f"sets {now}: its records name episodes, groups and prompts under the settings it was "
        "started with, so it continues only with them (nothing was claimed, set aside or "
        f"deleted): continue it with `train --restore` and {was}, or start a new run in "
        "another checkpointing.checkpoint_dir"
    )


def _shown(value: Any) -> str:
    """A value as the config file and overrides write it."""
    return json.dumps(value) if isinstance(value, bool) or value is None else str(value)
