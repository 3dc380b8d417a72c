"""Run by test_two_node_restore.py in its own process: a two-node local Ray cluster with the
GenerationWorker on one node and the StagingStore shards on the other; a call is cut in
flight, the store is snapshotted, loses its rows, is restored, and the call resumes exactly."""

import asyncio
import json
import sys

if __name__ == "__main__":
    import httpx
    import ray
    from ray.cluster_utils import Cluster

    from rollout_recovery.config import load_config
    from rollout_recovery.data_plane import StagingStore
    from rollout_recovery.generation import WorkerPool

    model_dir, snap_root = sys.argv[1], sys.argv[2]
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"store_node": 1}, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=2, resources={"worker_node": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    node_of = lambda actor: ray.get(  # noqa: E731
        actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
    )
    store = StagingStore.create(num_shards=2, actor_options={"resources": {"store_node": 0.1}})
    cfg = load_config(None, [f"policy.model_path={model_dir}", "token_capture.enabled=true",
                             "vllm_cfg.worker_resources={worker_node: 0.1}"])  # fmt: skip
    pool = WorkerPool.start(cfg, 1, store=store)
    worker = pool[0]
    url = worker.info.url
    body = {
        "model": "policy",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 300,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": True,
        "return_token_ids": True,
    }
    ident = {"rr_rollout_id": "two-node", "rr_model_call_id": "c0"}

    async def main():
        async with httpx.AsyncClient(timeout=300) as c:
            ref = (await c.post(f"{url}/v1/chat/completions", json=body)).json()
            task = asyncio.create_task(
                c.post(f"{url}/v1/chat/completions", json=body | {"vllm_xargs": ident})
            )
            await asyncio.sleep(0.3)
            inv = {
                "checkpoint_id": "k",
                "calls": [{"rollout_id": "two-node", "model_call_id": "c0"}],
            }
            receipt = (await worker.acut(inv))["calls"][0]
            task.cancel()
            snap = store.snapshot(snap_root)
            store.delete("rollout_staging", receipt["staging_keys"])  # the crash loses them
            store.restore(StagingStore.latest(snap_root))
            cont = {"rr_resume_keys": receipt["staging_keys"],
                    "rr_resume_tokens": receipt["prefix_token_count"],
                    "rr_resume_digest": receipt["prefix_digest"]}  # fmt: skip
            xargs = ident | {"rr_attempt": 1} | cont
            out = (
                await c.post(f"{url}/v1/chat/completions", json=body | {"vllm_xargs": xargs})
            ).json()
            return ref, receipt, out, snap.uri

    ref, receipt, out, uri = asyncio.run(main())
    result = {
        "worker_node": node_of(worker.actor),
        "store_nodes": [node_of(s) for s in store.shards],
        "prefix": receipt["prefix_token_count"],
        "same_tokens": out["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"],
        "same_logprobs": out["choices"][0]["logprobs"] == ref["choices"][0]["logprobs"],
        "metrics": worker.capture_metrics(),
    }
    pool.stop()
    store.shutdown()
    ray.shutdown()
    cluster.shutdown()
    print("RESULT " + json.dumps(result), flush=True)
