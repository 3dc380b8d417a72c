"""rollout_recovery: crash-safe LLM RL rollouts on Ray and vLLM."""

__version__ = "0.1.0"
