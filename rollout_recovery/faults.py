"""Deliberate recovery faults, for proving that the recovery checks fail when recovery breaks.

A deterministic sampler makes a broken recovery produce the same tokens as a working one, so
a check is only trusted once it has been seen to fail. `ROLLOUT_RECOVERY_FAULTS=name[,name]`
in a run's environment turns faults on; the workers and the environment actor receive it
through their Ray runtime environment. Nothing sets it outside tests.

- `resume_disabled`: workers silently drop every continuation and decode restored calls from
  scratch, counting no refusal (what a silent regression would look like);
- `redecode_committed_turns`: a restore re-admits every episode from its first prompt, so
  its committed turns are decoded again (no refusal counted either).
"""

from __future__ import annotations

import os

ENV = "ROLLOUT_RECOVERY_FAULTS"
FAULTS = ("resume_disabled", "redecode_committed_turns")


def armed() -> set[str]:
    names = {n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip()}
    unknown = names - set(FAULTS)
    if unknown:
        raise ValueError(f"{ENV} names unknown faults {sorted(unknown)}; known: {FAULTS}")
    return names


def active(name: str) -> bool:
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; known: {FAULTS}")
    return name in armed()


def actor_env_vars() -> dict[str, str]:
    """The fault setting for a Ray actor's runtime environment (empty when none is armed)."""
    value = os.environ.get(ENV)
    return {ENV: value} if value else {}
