"""Benchmark environment-side token capture.

    .venv/bin/python scripts/bench_capture.py --json bench_results/capture.json

(1) Per-turn latency of 5-turn conversations against a real GenerationWorker (tiny model),
    taking tokens inline from the response (`return_token_ids`) vs the `/tokenize` fallback,
    interleaved in one run. (2) LineageStore.resolve cost per call with 10k cached rollouts.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_common import write_result  # noqa: E402

from rollout_recovery.environment.lineage import LineageStore  # noqa: E402
from rollout_recovery.environment.model_client import ModelCallClient  # noqa: E402
from rollout_recovery.environment.token_sink import JsonlTokenSink  # noqa: E402

EOS = 2
TURN = {"temperature": 0.0, "max_tokens": 24, "min_tokens": 12, "logit_bias": {str(EOS): 100}}


async def conversation(mc: ModelCallClient, rollout: str, turns: int) -> list[float]:
    msgs = [{"role": "user", "content": "Use the add tool for 2 + 3, then report."}]
    lat = []
    for t in range(turns):
        t0 = time.perf_counter()
        r = await mc.call(rollout, f"t{t}", msgs, **TURN)
        lat.append(time.perf_counter() - t0)
        msgs = [
            *msgs,
            r.assistant_message,
            {"role": "tool", "content": str(t), "tool_call_id": "x"},
        ]
    return lat


def bench_turns(url: str, conversations: int, turns: int, workdir: Path) -> dict:
    modes = {
        "inline": ModelCallClient(url, "policy", JsonlTokenSink(workdir / "inline.jsonl"),
                                  LineageStore(), request_token_ids=True),
        "tokenize": ModelCallClient(url, "policy", JsonlTokenSink(workdir / "tok.jsonl"),
                                    LineageStore(), request_token_ids=False),
    }  # fmt: skip
    samples: dict[str, list[float]] = {m: [] for m in modes}

    async def run():
        for mode, mc in modes.items():  # warm-up
            await conversation(mc, f"warm-{mode}", 2)
        for i in range(conversations):
            order = list(modes) if i % 2 == 0 else list(reversed(modes))
            for mode in order:
                samples[mode] += await conversation(modes[mode], f"{mode}-{i}", turns)
        for mc in modes.values():
            await mc.aclose()

    asyncio.run(run())
    med = {m: statistics.median(v) * 1e3 for m, v in samples.items()}
    return {
        "turn_ms_median": med,
        "turn_ms_p95": {m: sorted(v)[int(0.95 * (len(v) - 1))] * 1e3 for m, v in samples.items()},
        "tokenize_over_inline": med["tokenize"] / med["inline"],
        "samples_ms": {m: [x * 1e3 for x in v] for m, v in samples.items()},
    }


def bench_resolver(rollouts: int, calls: int, tokens: int) -> dict:
    rng = random.Random(0)
    store = LineageStore(max_rollouts=rollouts + 1)
    convs = {}
    t0 = time.perf_counter()
    for r in range(rollouts):
        msgs = [{"role": "user", "content": f"task {r}"}]
        cum: list[int] = []
        for c in range(calls):
            answer = {"role": "assistant", "content": f"answer {r}.{c}"}
            cum = [*cum, *(rng.randrange(500) for _ in range(tokens // calls))]
            store.record(f"r{r}", f"c{c}", msgs, answer, cum)
            msgs = [*msgs, answer, {"role": "tool", "content": str(c), "tool_call_id": "x"}]
        convs[f"r{r}"] = msgs
    record_s = time.perf_counter() - t0
    keys = list(convs)
    times = []
    for _ in range(2000):
        rid = rng.choice(keys)
        t = time.perf_counter()
        res = store.resolve(rid, convs[rid])
        times.append(time.perf_counter() - t)
        assert res.parent_call_id == f"c{calls - 1}", res
    return {
        "cached_rollouts": rollouts,
        "calls_per_rollout": calls,
        "tokens_per_rollout": tokens,
        "record_us_mean": record_s / (rollouts * calls) * 1e6,
        "resolve_us_median": statistics.median(times) * 1e6,
        "resolve_us_p95": sorted(times)[int(0.95 * (len(times) - 1))] * 1e6,
        "messages_per_resolve": len(next(iter(convs.values()))),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--rollouts", type=int, default=10_000)
    args = ap.parse_args()

    import ray

    from rollout_recovery.config import load_config
    from rollout_recovery.generation import WorkerPool

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    workers = WorkerPool.start(load_config(REPO / "configs" / "grpo_tiny_cpu.yaml"), 1)
    try:
        with tempfile.TemporaryDirectory() as d:
            turns = bench_turns(workers[0].info.url, args.conversations, args.turns, Path(d))
    finally:
        workers.stop()
        ray.shutdown()
    resolver = bench_resolver(args.rollouts, calls=4, tokens=512)

    m = turns["turn_ms_median"]
    print(f"\nPer-turn latency, {args.conversations} x {args.turns}-turn conversations per mode "
          f"(tiny model, {TURN['min_tokens']}-{TURN['max_tokens']} tokens per turn)")  # fmt: skip
    print(f"{'token source':<26}{'median ms':>10}{'p95 ms':>10}")
    for mode in ("inline", "tokenize"):
        print(f"{mode:<26}{m[mode]:>10.2f}{turns['turn_ms_p95'][mode]:>10.2f}")
    print(f"/tokenize fallback over inline: {turns['tokenize_over_inline']:.2f}x")
    print(f"\nLineageStore.resolve with {resolver['cached_rollouts']:,} cached rollouts "
          f"({resolver['calls_per_rollout']} calls, {resolver['tokens_per_rollout']} tokens each, "
          f"{resolver['messages_per_resolve']}-message conversations)")  # fmt: skip
    print(f"resolve median {resolver['resolve_us_median']:.1f} us, "
          f"p95 {resolver['resolve_us_p95']:.1f} us; record mean "
          f"{resolver['record_us_mean']:.1f} us")  # fmt: skip
    out = {"args": vars(args), "turns": turns, "resolver": resolver}
    write_result(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
