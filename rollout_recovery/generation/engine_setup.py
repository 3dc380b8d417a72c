"""How a GenerationWorker's vLLM engine is configured: serve arguments and process environment.

The determinism settings live here, in code, so that a developer's shell cannot change what
the engine computes (docs/design.md §9).
"""

from __future__ import annotations

from rollout_recovery.config import WorkerConfig

# Set in the actor's process environment before torch or vLLM are imported there.
CPU_ENGINE_ENV = {
    # One OpenMP thread: multi-threaded CPU decode stalls here and is not bit-reproducible.
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # Run the model inside the EngineCore instead of an extra Worker process (~600 MB less).
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
}
GPU_ENGINE_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
}


def engine_env(cfg: WorkerConfig) -> dict[str, str]:
    return dict(CPU_ENGINE_ENV if cfg.vllm_cfg.device == "cpu" else GPU_ENGINE_ENV)


def serve_args(cfg: WorkerConfig, model: str, host: str, port: int) -> list[str]:
    """Command-line arguments for vLLM's own `serve` parser (so every vLLM check applies)."""
    v = cfg.vllm_cfg
    args = [
        "--model", model,
        "--served-model-name", cfg.policy.served_model_name,
        "--dtype", v.dtype,
        "--max-model-len", str(v.max_model_len),
        "--seed", "0",
        "--host", host,
        "--port", str(port),
        "--disable-uvicorn-access-log",
        "--uvicorn-log-level", "warning",
        "--max-logprobs", str(max(20, cfg.policy.generation.top_logprobs)),
        "--enable-prefix-caching" if v.enable_prefix_caching else "--no-enable-prefix-caching",
    ]  # fmt: skip
    if v.position_keyed_sampler:
        from rollout_recovery.generation.sampler import SAMPLER_FQCN

        args += ["--logits-processors", SAMPLER_FQCN]
    if v.enforce_eager:
        args.append("--enforce-eager")
    if v.tool_call_parser:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", v.tool_call_parser]
    if v.kv_cache_memory_bytes is not None:
        args += ["--kv-cache-memory-bytes", str(v.kv_cache_memory_bytes)]
    else:
        args += ["--gpu-memory-utilization", str(v.gpu_memory_utilization)]
    return args
