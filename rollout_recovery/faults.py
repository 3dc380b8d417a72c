"""Deliberate recovery faults, for proving that the recovery checks fail when recovery breaks.

A deterministic sampler makes a broken recovery produce the same tokens as a working one, so
a check is only trusted once it has been seen to fail. `ROLLOUT_RECOVERY_FAULTS=name[,name]`
in a run's environment turns faults on; the workers and the environment actor receive it
through their Ray runtime environment. Nothing sets it outside tests.

- `resume_disabled`: workers silently drop every continuation and decode restored calls from
  scratch, counting no refusal (what a silent regression would look like);
- `redecode_committed_turns`: a restore re-admits every episode from its first prompt, so
  its committed turns are decoded again (no refusal counted either);
- `effect_dedupe_disabled`: the notes episode's store applies an operation again even when its
  effect id is already logged, so a re-executed effect is applied twice;
- `journal_rows_corrupted`: each journal row is staged with its first token changed after its
  digest was sealed (a store that flipped a value): a call moved off a dead worker must refuse
  the chain and be decoded from scratch.

`ROLLOUT_RECOVERY_FAULTFS=<state dir>` puts every local path the run resolves (snapshots,
trainer checkpoints, logs) behind the fault-injecting filesystem (faultfs.py) sharing that
state directory, in every process of the run; the crash campaign then simulates a power loss
after a crash. Crash points (crashpoints.py) travel the same way.
"""

from __future__ import annotations

import os

import pyarrow.fs as pafs

ENV = "ROLLOUT_RECOVERY_FAULTS"
FAULTFS_ENV = "ROLLOUT_RECOVERY_FAULTFS"
FAULTS = (
    "resume_disabled",
    "redecode_committed_turns",
    "effect_dedupe_disabled",
    "journal_rows_corrupted",
)


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
    """Every armed test fault, fault filesystem and crash point, for a Ray actor's runtime
    environment (empty when none is armed)."""
    from rollout_recovery import crashpoints

    out = {k: os.environ[k] for k in (ENV, FAULTFS_ENV) if os.environ.get(k)}
    return out | crashpoints.actor_env_vars()


def local_filesystem(fs: pafs.FileSystem) -> pafs.FileSystem:
    """The local filesystem `fs`, behind the fault-injecting one when the run arms it."""
    state = os.environ.get(FAULTFS_ENV)
    if not state:
        return fs
    from rollout_recovery.faultfs import fault_filesystem

    return fault_filesystem(fs, state, object_store=False)
