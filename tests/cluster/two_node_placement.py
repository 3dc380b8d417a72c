"""Run by test_placement.py in its own process (a process has one Ray): a two-node local Ray
cluster, and the store shards and environment actors placed on it from `placement` config by
each strategy. Prints one `RESULT {json}` line with the node each actor ran on."""

import json
import sys

if __name__ == "__main__":
    import ray
    from ray.cluster_utils import Cluster
    from ray.util import placement_group_table

    from rollout_recovery.config import load_config
    from rollout_recovery.data_plane import StagingStore
    from rollout_recovery.environment.client import EnvironmentClient
    from rollout_recovery.generation.pool import WorkerPool
    from rollout_recovery.placement import place_job
    from rollout_recovery.testing.campaign.snapshot_files import replay_rows

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"node_a": 1}, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=2, resources={"node_b": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    by_resource = {
        name: n["NodeID"]
        for n in ray.nodes()
        if n["Alive"]
        for name in ("node_a", "node_b")
        if name in n["Resources"]
    }
    node_a, node_b = by_resource["node_a"], by_resource["node_b"]

    def node_of(actor) -> str:
        ask = actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
        return ray.get(ask, timeout=60)

    def store_for(*overrides: str):
        cfg = load_config(None, list(overrides))
        placed = place_job(cfg)
        p = cfg.placement.store
        store = StagingStore.create(
            num_shards=p.shards, num_cpus=p.num_cpus, shard_options=placed.store.options
        )
        rows = [f"k{i}" for i in range(8)]  # over both shards: the store works as placed
        store.put("replay", replay_rows(rows, 8))
        assert sorted(store.list("replay")) == rows
        return cfg, placed, store

    result = {"node_a": node_a, "node_b": node_b}

    # node_affinity: shard i on node_ids[i % 2]; environment actors likewise, reversed.
    cfg, placed, store = store_for(
        "placement.store.shards=3", "placement.store.strategy=node_affinity",
        f"placement.store.node_ids=[{node_a}, {node_b}]",
        "placement.environment.actors=2", "placement.environment.strategy=node_affinity",
        f"placement.environment.node_ids=[{node_b}, {node_a}]",
    )  # fmt: skip
    result["affinity_shards"] = [node_of(s) for s in store.shards]
    env = EnvironmentClient.start(cfg.environment_config(), WorkerPool([]), store, count=2,
                                  actor_options=placed.environment.options)  # fmt: skip
    result["affinity_environments"] = [node_of(a) for a in env.actors]
    env.close()
    store.shutdown()
    placed.remove()

    # placement_group STRICT_SPREAD: one shard per node, shard i in bundle i.
    cfg, placed, store = store_for(
        "placement.store.shards=2", "placement.store.num_cpus=0.5",
        "placement.store.strategy=placement_group",
        "placement.store.placement_group_strategy=STRICT_SPREAD",
    )  # fmt: skip
    table = placement_group_table(placed.store.group)
    result["group_shards"] = [node_of(s) for s in store.shards]
    result["group_bundles"] = [table["bundles_to_node_id"][i] for i in range(2)]
    store.shutdown()
    group = placed.store.group
    placed.remove()
    result["group_state"] = placement_group_table(group)["state"]

    # spread: runs; custom resources pin the environment actors to node_b.
    cfg, placed, store = store_for(
        "placement.store.shards=2", "placement.store.strategy=spread",
        "placement.environment.actors=2", "placement.environment.resources={node_b: 0.1}",
    )  # fmt: skip
    result["spread_shards"] = [node_of(s) for s in store.shards]
    env = EnvironmentClient.start(cfg.environment_config(), WorkerPool([]), store, count=2,
                                  actor_options=placed.environment.options)  # fmt: skip
    result["resource_environments"] = [node_of(a) for a in env.actors]
    result["counters"] = env.counters()
    env.close()
    store.shutdown()
    placed.remove()

    ray.shutdown()
    cluster.shutdown()
    print("RESULT " + json.dumps(result), flush=True)
    sys.exit(0)
