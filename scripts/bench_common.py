"""Shared by the benchmark scripts: writing results and checking them against targets."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

MET, MISSED, NOT_MEASURED, SKIPPED = "met", "missed", "not measured", "skipped"


def identified_chat(rollout: str, max_tokens: int) -> dict:
    """An identified chat completion (its own rollout id) that decodes exactly `max_tokens`
    tokens: what the live-worker benchmarks send."""
    from rollout_recovery.protocol import XARG_ATTEMPT, XARG_CALL, XARG_ROLLOUT

    return {
        "model": "policy",
        "messages": [{"role": "user", "content": f"Count the letters in {rollout}."}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": True,
        "vllm_xargs": {XARG_ROLLOUT: rollout, XARG_CALL: "c0", XARG_ATTEMPT: 0},
    }


def write_result(path: str, result: dict) -> None:
    """Write a benchmark's JSON result (creating the folder) and say where."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {path}")


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (linear interpolation, numpy's default) of a non-empty sample."""
    return float(np.percentile(xs, q))


@dataclass(frozen=True)
class Target:
    """A bound on one summary value: the figure a change must not fall below (or above)."""

    key: str
    op: Literal[">=", "<="]
    bound: float
    label: str

    def verdict(self, value: float | None, skipped: bool = False) -> str:
        """`met` / `missed`; `skipped` when the run left it out on purpose, `not measured`
        when the value is missing (a NaN too: it cannot meet any bound)."""
        if skipped:
            return SKIPPED
        if value is None or math.isnan(value):
            return NOT_MEASURED
        ok = value >= self.bound if self.op == ">=" else value <= self.bound
        return MET if ok else MISSED


def check_targets(
    targets: list[Target], summary: dict[str, float], skipped: frozenset[str] = frozenset()
) -> list[dict]:
    """One row per target: label, measured value, bound and verdict (keys in `skipped` were
    left out of this run on purpose, e.g. a baseline the caller chose not to run)."""
    return [
        {
            "key": t.key,
            "label": t.label,
            "measured": summary.get(t.key),
            "target": f"{t.op} {t.bound:g}",
            "verdict": t.verdict(summary.get(t.key), t.key in skipped),
        }
        for t in targets
    ]


def targets_ok(rows: list[dict]) -> bool:
    """True when no target was missed or left unmeasured without being skipped on purpose."""
    return all(r["verdict"] in (MET, SKIPPED) for r in rows)


def print_targets(rows: list[dict]) -> None:
    """The target table: measured value, bound and verdict per target."""
    w = max(len(r["label"]) for r in rows) + 2
    print(f"\n{'target':<{w}}{'measured':>12}{'bound':>12}   verdict")
    for r in rows:
        m = "-" if r["measured"] is None else f"{r['measured']:.3g}"
        print(f"{r['label']:<{w}}{m:>12}{r['target']:>12}   {r['verdict']}")
