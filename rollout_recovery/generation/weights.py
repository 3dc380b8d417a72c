"""Pushing new policy weights into a running engine.

The push pauses generation with in-flight requests kept but their KV cleared (they are
recomputed under the new weights on resume; stale KV would silently mix two policies),
reloads through vLLM's own `reload_weights` (vllm_compat), resets the prefix cache, and
resumes. Not in flight (`in_flight=False`), the pause waits for the requests in flight to
end instead, and requests that arrive meanwhile wait for the new weights: each call then has
one weight version. A reload that fails half-way kills vLLM's engine, so the file is checked
first: the same tensor names, shapes and dtypes as the served checkpoint, or nothing happens.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from rollout_recovery.generation.vllm_compat import reload_weights


class WeightPushError(ValueError):
    pass


def safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} from a safetensors file's header, without loading it."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items()}


def checkpoint_header(model_dir: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise WeightPushError(f"no *.safetensors in {model_dir}")
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in files:
        out |= safetensors_header(f)
    return out


def check_compatible(reference_dir: str | Path, new_dir: str | Path) -> None:
    ref, new = checkpoint_header(reference_dir), checkpoint_header(new_dir)
    missing, extra = sorted(set(ref) - set(new)), sorted(set(new) - set(ref))
    if missing or extra:
        raise WeightPushError(
            f"weights in {new_dir} do not match the served model: missing {missing[:5]}, "
            f"unexpected {extra[:5]}"
        )
    bad = [n for n in ref if ref[n] != new[n]]
    if bad:
        n = bad[0]
        raise WeightPushError(
            f"tensor {n} is {new[n][0]}{list(new[n][1])}, the served model has "
            f"{ref[n][0]}{list(ref[n][1])} ({len(bad)} mismatched)"
        )


async def push_weights(
    engine, reference_dir: str, weights_dir: str, version: int, in_flight: bool = True
) -> None:
    check_compatible(reference_dir, weights_dir)
    await engine.pause_generation(mode="keep" if in_flight else "wait", clear_cache=True)
    try:
        await reload_weights(engine, weights_dir)
        await engine.reset_prefix_cache()
        # vLLM labels every output token with the engine's weight version (spans per request).
        await engine.update_weight_version(str(version))
    finally:
        await engine.resume_generation()
