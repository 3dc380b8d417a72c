"""Placement from config (rollout_recovery/placement.py): the `placement` block's rules, the Ray
options each strategy gives each actor index, placement groups reserved on a real local Ray,
a worker slot's options travelling in its WorkerSpec, and which environment owns a rollout."""

from __future__ import annotations

import collections
import hashlib
import pickle

import pytest
import ray
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from rollout_recovery.config import ConfigError, load_config
from rollout_recovery.generation.pool import WorkerSpec, _spawn
from rollout_recovery.placement import PlacementError, bundle, place, place_job
from rollout_recovery.protocol import environment_of, rollout_id

NODE_A, NODE_B = "a" * 56, "b" * 56


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, list(overrides))
    msg = str(info.value)
    assert "\n" not in msg
    return msg


# ---------------------------------------------------------------- config


def test_defaults_place_everything_as_before():
    p = load_config(None, []).placement
    assert (p.store.shards, p.store.num_cpus, p.store.resources, p.store.strategy) == (
        1, 0.0, {}, "default"
    )  # fmt: skip
    assert (p.environment.actors, p.environment.num_cpus, p.environment.strategy) == (
        1, 0.0, "default"
    )  # fmt: skip
    assert p.workers.strategy == "default" and p.workers.node_ids == []
    assert load_config(None, []).rollout_checkpointing.full_snapshot_every == 8


@pytest.mark.parametrize("block", ["store", "environment", "workers"])
def test_node_affinity_needs_node_ids(block):
    msg = _error(f"placement.{block}.strategy=node_affinity")
    assert msg.startswith(f"invalid config: placement.{block}.strategy=node_affinity needs "
                          f"placement.{block}.node_ids")  # fmt: skip
    assert "ray list nodes" in msg


@pytest.mark.parametrize("strategy", ["default", "spread", "placement_group"])
def test_node_ids_with_another_strategy_are_refused(strategy):
    key = "placement.environment"
    msg = _error(f"{key}.strategy={strategy}", f"{key}.num_cpus=1", f"{key}.node_ids=[{NODE_A}]")
    assert f"{key}.node_ids is set but {key}.strategy={strategy}" in msg
    assert "set placement.environment.strategy=node_affinity, or remove" in msg


def test_node_ids_must_be_ray_node_ids():
    msg = _error("placement.store.strategy=node_affinity", "placement.store.node_ids=[node-1]")
    assert "`placement.store.node_ids`: 'node-1' is not a Ray node id (56 hex digits)" in msg


def test_the_gateway_serves_one_environment_actor():
    msg = _error("gateway.enabled=true", "placement.environment.actors=2")
    assert "gateway.enabled=true refuses placement.environment.actors=2" in msg
    assert "serves the episodes of one environment actor" in msg
    assert "set placement.environment.actors=1, or gateway.enabled=false" in msg
    load_config(None, ["gateway.enabled=true", "placement.environment.actors=1"])


@pytest.mark.parametrize("block", ["store", "environment"])
def test_a_placement_group_needs_something_to_reserve(block):
    msg = _error(f"placement.{block}.strategy=placement_group")
    assert f"placement.{block}.strategy=placement_group needs something to reserve" in msg
    assert f"set placement.{block}.num_cpus above 0 or add placement.{block}.resources" in msg
    load_config(None, [f"placement.{block}.strategy=placement_group",
                       f"placement.{block}.resources={{node_a: 0.1}}"])  # fmt: skip


def test_a_worker_placement_group_needs_something_to_reserve():
    msg = _error("placement.workers.strategy=placement_group", "vllm_cfg.worker_num_cpus=0")
    assert "placement.workers.strategy=placement_group needs something to reserve" in msg
    assert "vllm_cfg.worker_num_cpus" in msg
    load_config(None, ["placement.workers.strategy=placement_group"])  # 1 CPU per worker


def test_cpus_are_not_custom_resources():
    msg = _error("placement.store.resources={CPU: 1}")
    assert "`placement.store.resources`: CPU cannot be a custom resource; set num_cpus" in msg


def test_counts_and_strategies_are_checked_by_name():
    assert "`placement.store.shards`: must be >= 1 (got 0)" in _error("placement.store.shards=0")
    assert "`placement.environment.actors`: must be >= 1" in _error(
        "placement.environment.actors=0"
    )
    assert "`placement.workers.strategy`" in _error("placement.workers.strategy=pack")
    assert "`placement.store.placement_group_strategy`" in _error(
        "placement.store.placement_group_strategy=spread"
    )
    assert "did you mean `placement.store.shards`?" in _error("placement.store.shard=2")


# ---------------------------------------------------------------- options per index


def test_bundle_leaves_out_what_is_not_reserved():
    assert bundle(0, {}) == {}
    assert bundle(1, {"node_a": 0.5}, num_gpus=1) == {"CPU": 1.0, "GPU": 1.0, "node_a": 0.5}
    assert bundle(0.5, {"node_a": 0}) == {"CPU": 0.5}


def test_default_and_spread_options():
    cfg = load_config(None, ["placement.store.strategy=spread"])
    assert place(cfg.placement.environment, "placement.environment", 3, {}).options == [{}] * 3
    spread = place(cfg.placement.store, "placement.store", 2, {})
    assert spread.options == [{"scheduling_strategy": "SPREAD"}] * 2 and spread.group is None


def test_node_affinity_cycles_over_the_node_ids():
    cfg = load_config(None, ["placement.workers.strategy=node_affinity",
                             f"placement.workers.node_ids=[{NODE_A}, {NODE_B}]",
                             "placement.workers.soft=true"])  # fmt: skip
    placed = place(cfg.placement.workers, "placement.workers", 3, {"CPU": 1})
    strategies = [o["scheduling_strategy"] for o in placed.options]
    assert all(isinstance(s, NodeAffinitySchedulingStrategy) for s in strategies)
    assert [s.node_id for s in strategies] == [NODE_A, NODE_B, NODE_A]
    assert all(s.soft for s in strategies)


def test_place_job_gives_store_and_environment_their_resources():
    cfg = load_config(None, ["placement.store.shards=2", "placement.store.num_cpus=0.25",
                             "placement.store.resources={node_a: 0.1}",
                             "placement.environment.actors=3"])  # fmt: skip
    placed = place_job(cfg)
    assert placed.store.options == [{"num_cpus": 0.25, "resources": {"node_a": 0.1}}] * 2
    assert placed.environment.options == [{"num_cpus": 0.0, "resources": {}}] * 3
    assert placed.workers.options == [{}]  # a worker's resources are worker_actor_options'
    placed.remove()


@pytest.mark.cluster
def test_placement_group_gives_actor_i_bundle_i(ray_session):
    cfg = load_config(None, ["placement.store.strategy=placement_group",
                             "placement.store.num_cpus=0.25",
                             "placement.store.placement_group_strategy=PACK"])  # fmt: skip
    placed = place(cfg.placement.store, "placement.store", 2, {"CPU": 0.25}, timeout_s=60)
    try:
        group = placed.group
        assert group is not None and group.bundle_specs == [{"CPU": 0.25}] * 2
        for i, opts in enumerate(placed.options):
            strategy = opts["scheduling_strategy"]
            assert isinstance(strategy, PlacementGroupSchedulingStrategy)
            assert strategy.placement_group.id == group.id
            assert strategy.placement_group_bundle_index == i

        @ray.remote(num_cpus=0.25)
        class Probe:
            def group(self) -> str:
                return ray.get_runtime_context().get_placement_group_id()

        probes = [Probe.options(**o).remote() for o in placed.options]
        assert ray.get([p.group.remote() for p in probes], timeout=60) == [group.id.hex()] * 2
        for p in probes:
            ray.kill(p)
    finally:
        placed.remove()
    assert placed.group is None
    placed.remove()  # twice is harmless


@pytest.mark.cluster
def test_a_placement_group_the_cluster_cannot_hold_fails_in_one_line(ray_session):
    key = "placement.environment"
    cfg = load_config(None, [f"{key}.strategy=placement_group", f"{key}.num_cpus=0.1",
                             f"{key}.placement_group_strategy=STRICT_SPREAD"])  # fmt: skip
    before = ray.util.placement_group_table()
    with pytest.raises(PlacementError) as info:
        place(cfg.placement.environment, "placement.environment", 2, {"CPU": 0.1}, timeout_s=2)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith('placement.environment: a placement group of 2 bundles of {"CPU": 0.1} '
                          "(STRICT_SPREAD) could not be reserved within 2 s; the cluster has 1 "
                          "node(s) alive and")  # fmt: skip
    assert '"CPU": ' in msg and "placement.ready_timeout_s" in msg
    # The group that could not be placed was given back.
    pending = [g for k, g in ray.util.placement_group_table().items()
               if k not in before and g["state"] not in ("REMOVED",)]  # fmt: skip
    assert pending == []


@pytest.mark.cluster
def test_a_worker_slot_keeps_its_bundle_in_the_spec(ray_session, tiny_cfg):
    """A replacement for slot i is spawned from the pool's WorkerSpec, which carries slot i's
    options (it crosses into the environment actors and the supervisor pickled)."""
    cfg = tiny_cfg.model_copy(deep=True)
    cfg.vllm_cfg.worker_num_cpus = 0.25
    cfg.vllm_cfg.num_workers = 2
    cfg.placement.workers.strategy = "placement_group"
    cfg.placement.workers.placement_group_strategy = "PACK"
    placed = place_job(cfg)
    try:
        spec = WorkerSpec(cfg.worker_config().model_dump(mode="json"), None, 60.0, None,
                          placed.workers.options)  # fmt: skip
        spec = pickle.loads(pickle.dumps(spec))
        actor = _spawn(spec, 1)  # not started: no engine
        try:
            ask = actor.__ray_call__.remote(
                lambda w: ray.get_runtime_context().get_placement_group_id()
            )
            where = ray.get(ask, timeout=60)
            assert where == placed.workers.group.id.hex()
        finally:
            ray.kill(actor)
    finally:
        placed.remove()


# ---------------------------------------------------------------- episodes over environments


def test_environment_of_is_stable_and_spreads():
    assert environment_of("g0-g1", 1) == 0
    # A hash of the rollout id alone: the same in every process and every run.
    digest = hashlib.sha256(b"step3-p1-g2").digest()
    assert environment_of("step3-p1-g2", 3) == int.from_bytes(digest[:8], "big") % 3
    assert [environment_of(rollout_id("step0-p0", i), 4) for i in range(8)] == [
        0, 0, 2, 1, 0, 0, 1, 3
    ]  # fmt: skip
    spread = collections.Counter(
        environment_of(rollout_id(f"step{s}-p{p}", i), 4)
        for s in range(10) for p in range(8) for i in range(4)
    )  # fmt: skip
    assert set(spread) == {0, 1, 2, 3}
    assert min(spread.values()) > 0.15 * sum(spread.values())


def test_a_groups_generations_do_not_all_land_on_one_environment():
    """crc32's low bits are linear in the input bits: `-g0`..`-g3` of a group would always share
    one of 2 actors. The hash used spreads them like a fair coin (1.875 distinct of 2)."""
    groups = [f"step{s}-p{p}" for s in range(20) for p in range(8)]
    for count, at_least in ((2, 1.75), (4, 2.5)):
        distinct = [len({environment_of(rollout_id(g, i), count) for i in range(4)})
                    for g in groups]  # fmt: skip
        assert sum(distinct) / len(distinct) > at_least, count


def test_a_standalone_gateway_refuses_several_environments_before_starting(tiny_cfg, tmp_path):
    from rollout_recovery.api import RolloutRecovery
    from rollout_recovery.errors import RecoveryError

    cfg = tiny_cfg.model_copy(deep=True)
    cfg.checkpointing.checkpoint_dir = str(tmp_path / "run")
    cfg.placement.environment.actors = 2
    rr = RolloutRecovery(cfg)
    try:
        with pytest.raises(RecoveryError, match=r"placement.environment.actors=2; set placement"):
            rr.start(standalone_gateway=True)
        assert not rr.running()  # nothing was started
    finally:
        rr.close()
