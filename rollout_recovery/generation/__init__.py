"""Generation workers: vLLM engines behind vLLM's OpenAI server, as Ray actors."""

from rollout_recovery.generation.worker import (
    GenerationWorker,
    WorkerHandle,
    WorkerHealth,
    WorkerInfo,
    start_workers,
    stop_workers,
)

__all__ = [
    "GenerationWorker",
    "WorkerHandle",
    "WorkerHealth",
    "WorkerInfo",
    "start_workers",
    "stop_workers",
]
