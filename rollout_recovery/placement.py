"""Where Ray starts the job's actors: one `placement.*` block made into Ray options per actor.

`place(block, what, count, bundle)` turns a placement block (`placement.store`,
`placement.environment`, `placement.workers`), the number of actors and what each actor
reserves into one dict of Ray actor options per actor index, to be merged into that actor's
options (its resources stay the caller's):

| strategy          | actor i gets                                                          |
|-------------------|-----------------------------------------------------------------------|
| `default`         | nothing: Ray places it wherever its resources fit                     |
| `spread`          | `scheduling_strategy="SPREAD"`                                        |
| `node_affinity`   | `NodeAffinitySchedulingStrategy(node_ids[i % len(node_ids)], soft)`    |
| `placement_group` | bundle i of one placement group of `count` bundles, reserved up front  |

A placement group is reserved before any actor starts, within `placement.ready_timeout_s`, or
the start fails with a `PlacementError` naming the block and what the cluster has free.
`Placement.remove` gives it back once its actors are gone. Options per index are plain
picklable values, so a worker's slot options travel in its `WorkerSpec` and a replacement for
worker i is placed like worker i was.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from rollout_recovery.config import PlacementConfig, RolloutRecoveryConfig
from rollout_recovery.errors import RecoveryError


class PlacementError(RecoveryError):
    """A block's actors cannot be placed on this cluster; the message names the block, what it
    asked for, what the cluster has free and how to fix it."""


def bundle(
    num_cpus: float, resources: Mapping[str, float] | None = None, num_gpus: float = 0
) -> dict[str, float]:
    """What one actor reserves, as a placement-group bundle (resources of 0 left out)."""
    every = {"CPU": num_cpus, "GPU": num_gpus, **dict(resources or {})}
    return {name: float(amount) for name, amount in every.items() if amount > 0}


@dataclass
class Placement:
    """Where `len(options)` actors of one block go: Ray options per actor index, and the
    placement group reserved for them (strategy=placement_group only)."""

    what: str  # the config block, e.g. `placement.store`
    options: list[dict[str, Any]]
    group: PlacementGroup | None = field(default=None)

    def remove(self) -> None:
        """Give the placement group back (its actors, if any are left, die with it)."""
        if self.group is not None:
            with contextlib.suppress(Exception):  # already gone, or Ray is shutting down
                remove_placement_group(self.group)
            self.group = None


def place(
    block, what: str, count: int, per_actor: Mapping[str, float], timeout_s: float = 120.0
) -> Placement:
    """Ray options for `count` actors placed by `block` (a `placement.*` block); `per_actor`
    is the bundle each reserves (`bundle(...)`), used by strategy=placement_group."""
    if count < 1:
        raise ValueError(f"{what}: count must be >= 1")
    strategy = block.strategy
    if strategy == "default":
        return Placement(what, [{} for _ in range(count)])
    if strategy == "spread":
        return Placement(what, [{"scheduling_strategy": "SPREAD"} for _ in range(count)])
    if strategy == "node_affinity":
        nodes = list(block.node_ids)
        return Placement(what, [
            {"scheduling_strategy": NodeAffinitySchedulingStrategy(nodes[i % len(nodes)],
                                                                   soft=block.soft)}
            for i in range(count)
        ])  # fmt: skip
    if strategy == "placement_group":
        group = _reserve(what, count, dict(per_actor), block.placement_group_strategy, timeout_s)
        options = [
            {"scheduling_strategy": PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=i)}
            for i in range(count)
        ]  # fmt: skip
        return Placement(what, options, group)
    raise ValueError(f"{what}.strategy={strategy!r} is not a placement strategy")


def _reserve(
    what: str, count: int, per_actor: dict[str, float], strategy: str, timeout_s: float
) -> PlacementGroup:
    if not per_actor:
        raise PlacementError(
            f"{what}.strategy=placement_group has nothing to reserve per actor (a bundle "
            "cannot be empty); give its actors CPUs or resources"
        )
    group = placement_group([dict(per_actor) for _ in range(count)], strategy=strategy,
                            name=f"rollout-recovery-{what.replace('.', '-')}")  # fmt: skip
    if group.wait(timeout_s):
        return group
    remove_placement_group(group)
    raise PlacementError(
        f"{what}: a placement group of {count} bundles of {json.dumps(per_actor)} "
        f"({strategy}) could not be reserved within {timeout_s:g} s; the cluster has "
        f"{_alive_nodes()} node(s) alive and {json.dumps(_free())} free. Add nodes or "
        f"resources, reserve less per actor, or use another {what}.placement_group_strategy "
        f"or {what}.strategy (placement.ready_timeout_s sets the wait)"
    )


def _free() -> dict[str, float]:
    """What the cluster has free now (memory and per-node bookkeeping left out)."""
    free = ray.available_resources()
    skip = ("memory", "object_store_memory")
    return {k: round(v, 3) for k, v in sorted(free.items())
            if k not in skip and not k.startswith("node:")}  # fmt: skip


def _alive_nodes() -> int:
    return sum(1 for n in ray.nodes() if n.get("Alive"))


@dataclass
class JobPlacement:
    """The placements of a job's three kinds of actors; `remove` gives back their groups."""

    store: Placement
    environment: Placement
    workers: Placement

    def remove(self) -> None:
        for p in (self.workers, self.environment, self.store):
            p.remove()


def place_job(cfg: RolloutRecoveryConfig) -> JobPlacement:
    """Reserve and compute the placement of the store shards, the environment actors and the
    workers (`cfg.placement`); a block that cannot be placed gives back what was reserved.
    The store's and the environment's options also carry what each actor reserves (its
    `num_cpus` and `resources`); a worker's come from `worker_actor_options`."""
    p: PlacementConfig = cfg.placement
    vllm = cfg.vllm_cfg
    made: list[Placement] = []
    try:
        for block, what, count, per_actor in (
            (p.store, "placement.store", p.store.shards,
             bundle(p.store.num_cpus, p.store.resources)),
            (p.environment, "placement.environment", p.environment.actors,
             bundle(p.environment.num_cpus, p.environment.resources)),
            (p.workers, "placement.workers", vllm.num_workers,
             bundle(vllm.worker_num_cpus, vllm.worker_resources,
                    1 if vllm.device == "cuda" else 0)),
        ):  # fmt: skip
            made.append(place(block, what, count, per_actor, p.ready_timeout_s))
    except BaseException:
        remove_all(made)
        raise
    store, environment, workers = made
    for placement, block in ((store, p.store), (environment, p.environment)):
        reserve = {"num_cpus": block.num_cpus, "resources": dict(block.resources)}
        placement.options = [reserve | o for o in placement.options]
    return JobPlacement(store, environment, workers)


def remove_all(placements: Iterable[Placement]) -> None:
    for placement in placements:
        placement.remove()
