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
- `token_log_rows_corrupted`: each token log row is staged with its first token changed after its
  digest was sealed (a store that flipped a value): a call moved off a dead worker must refuse
  the chain and be decoded from scratch;
- `fencing_disabled`: writes under the run's location no longer check the ownership log first
  (snapshot publication still does), so a stale owner writes over the newer owner's files;
- `pairing_disabled`: a restore takes the trainer checkpoint of the snapshot's step without
  comparing its digest with the one the snapshot's ledger recorded.
- `preemption_hold_disabled`: a preemption's final checkpoint cuts the calls without holding
  generation first, so the engines go on decoding past the cuts until they stop, and a restore
  decodes those tokens again.

`ROLLOUT_RECOVERY_FAULTFS=<state dir>` puts every local path the run resolves (snapshots,
trainer checkpoints, logs) behind a fault-injecting filesystem sharing that state directory,
in every process of the run; the crash campaign then simulates a power loss after a crash.
Production code only offers the seam (`local_filesystem`): the wrapper is the function that
`ROLLOUT_RECOVERY_FAULTFS_HOOK=<module>:<function>` names, called as `hook(fs, state_dir)`,
and the testing wing arms both variables together (testing/faultfs.py, `armed_env`), so
nothing here imports test machinery. Crash points (crashpoints.py) travel the same way.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from functools import lru_cache

import pyarrow.fs as pafs

ENV = "ROLLOUT_RECOVERY_FAULTS"
FAULTFS_ENV = "ROLLOUT_RECOVERY_FAULTFS"
FAULTFS_HOOK_ENV = "ROLLOUT_RECOVERY_FAULTFS_HOOK"
FAULTS = (
    "resume_disabled",
    "redecode_committed_turns",
    "effect_dedupe_disabled",
    "token_log_rows_corrupted",
    "fencing_disabled",
    "pairing_disabled",
    "preemption_hold_disabled",
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

    keys = (ENV, FAULTFS_ENV, FAULTFS_HOOK_ENV)
    out = {k: os.environ[k] for k in keys if os.environ.get(k)}
    return out | crashpoints.actor_env_vars()


def local_filesystem(fs: pafs.FileSystem) -> pafs.FileSystem:
    """The local filesystem `fs`, behind the fault-injecting one when the run arms it."""
    state = os.environ.get(FAULTFS_ENV)
    if not state:
        return fs
    return _hook(os.environ.get(FAULTFS_HOOK_ENV, ""))(fs, state)


@lru_cache(maxsize=4)
def _hook(spec: str) -> Callable[[pafs.FileSystem, str], pafs.FileSystem]:
    """The wrapper `<module>:<function>` names; an armed fault filesystem without one, or
    with one that does not load, stops the run rather than letting it write unfaulted."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(
            f"{FAULTFS_ENV} is set but {FAULTFS_HOOK_ENV}={spec!r} names no <module>:<function>"
        )
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{FAULTFS_HOOK_ENV}={spec!r} does not load: {err}") from None
