"""Generation workers: vLLM engines behind vLLM's OpenAI server, as Ray actors, and the pool
that is their one client."""

from rollout_recovery.generation.pool import WorkerHandle, WorkerPool, worker_actor_options
from rollout_recovery.generation.worker import GenerationWorker, WorkerHealth, WorkerInfo

__all__ = [
    "GenerationWorker",
    "WorkerHandle",
    "WorkerHealth",
    "WorkerInfo",
    "WorkerPool",
    "worker_actor_options",
]
