"""Every private vLLM attribute the seam touches exists on the live engine.

One test, one message: after a vLLM upgrade, this lists everything vllm_compat.py must be
ported for (`vllm_compat.PRIVATE_SURFACE`), instead of a scatter of failures across the suite.
It runs inside the session worker's process, on its engine, while vLLM holds the state of an
identified call (most of that state exists only per request).
"""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.engine


def _on_worker_loop(worker, fn, *args, timeout_s: float = 120):
    """Run coroutine function `fn(worker_instance, *args)` on the worker's event loop."""

    def run(self, *a):
        return asyncio.run_coroutine_threadsafe(fn(self, *a), self._host.loop).result(timeout_s)

    return worker.run_inside(run, *args)


async def _probe(self, rollout: str) -> dict:
    """Start an identified call through the worker's engine and, at its first output, check
    the seam's table against the live engine and the call's live request state."""
    import vllm
    from vllm import SamplingParams

    from rollout_recovery.generation import vllm_compat
    from rollout_recovery.protocol import CallIdentity

    identity = CallIdentity(rollout, "c0", 0)
    params = SamplingParams(
        max_tokens=48, temperature=0.0, ignore_eos=True, extra_args=identity.to_xargs()
    )
    found = None
    async for _ in self._engine.generate({"prompt_token_ids": [1, 2, 3, 4]}, params, rollout):
        if found is None:
            reader = self._service.capture.calls[identity].reader
            found = {
                "missing": vllm_compat.missing_attributes(self._engine, reader),
                "checked": len(vllm_compat.PRIVATE_SURFACE),
                "live": reader.num_generated() < 48,
                "version": vllm.__version__,
            }
    return found


def test_every_private_attribute_the_seam_touches_exists(capture_worker):
    worker, _store = capture_worker
    found = _on_worker_loop(worker, _probe, "compat-probe")
    assert found["live"], "the probe read a request vLLM had already finished"
    assert found["checked"] > 30
    assert found["missing"] == [], (
        f"vLLM {found['version']} lacks what rollout_recovery/generation/vllm_compat.py "
        "touches:\n  " + "\n  ".join(found["missing"])
    )
    assert found["version"] == worker.info.vllm_version
