"""Benchmark continuous token logging: decode throughput per token log interval K vs off.

    .venv/bin/python scripts/bench_token_log.py --json bench_results/token_log.json

One live GenerationWorker (WorkerPool.start, token capture on, a real StagingStore) is started
once; between rounds its token log is switched (`TokenLog.configure(K)` run inside the actor)
between `off` and every K of `--k` (default 8, 16, 64, 128 tokens), and K = `--disk-k` (16)
with the durable copy on (`K=16+disk`: every staged batch also written as a segment file to a
local directory, fsynced, as a whole-job restore needs; data_plane/token_log_segments.py). A round
is `--calls` (64) identified greedy chat completions over HTTP, each decoding exactly
`--tokens` (192) tokens (`ignore_eos`, `logprobs: true`, its own rollout id, so every call is
logged when the token log is on). Throughput = the responses' `usage.completion_tokens`
summed / wall seconds from the first send to the last response.

The modes are interleaved: `--rounds` cycles over all of them, each cycle in a rotated order
(so a slow drift of the machine hits every mode alike), after one uncounted warm-up round at
the smallest K. Per mode: the median tokens/s; the ratio to `off` (median over cycles of the
mode's tokens/s over the same cycle's `off` round); token log rows and tokens staged per round
(the worker's `token_log.rows` / `token_log.tokens` tallies before and after each round); and the
token log lag (tokens decoded but not yet in the store, sampled every 0.1 s per in-flight call,
token log on or off) p50 / p99, exact percentiles of the worker's own samples of that mode's
rounds; for `+disk`, segments written per round and the slowest segment write.

After each round the worker's background terminal writes are drained and the staging
partition must be empty again (a finished call's chunk rows are deleted with its terminal row):
"rows left" > 0 in any round makes the run fail (exit 1).

`--model qwen3`: the worker serves tiny://qwen3 (Qwen's 151k vocabulary) instead of the tiny
Llama. `--quick`: one cycle, 96 tokens per call (a smoke run).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

# Before torch or vLLM are imported (engine_setup itself imports neither).
from bench_common import identified_chat, percentile, write_result  # noqa: E402

from rollout_recovery.generation.engine_setup import CPU_ENGINE_ENV  # noqa: E402

os.environ.update(CPU_ENGINE_ENV)
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # logging only: keeps the table readable

import argparse  # noqa: E402
import asyncio  # noqa: E402
import gc  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

OFF = "off"
Mode = tuple[int | None, bool]  # (K or None for off, durable copy on)


def mode_name(mode: Mode) -> str:
    k, disk = mode
    return OFF if k is None else f"K={k}" + ("+disk" if disk else "")


async def _decode(url: str, tag: str, calls: int, tokens: int) -> tuple[int, float]:
    """`calls` identified completions at once; (completion tokens, wall s first send to last
    response)."""
    import httpx

    limits = httpx.Limits(max_connections=calls + 8)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:

        async def one(rollout: str) -> int:
            resp = await client.post(
                f"{url}/v1/chat/completions", json=identified_chat(rollout, tokens)
            )
            resp.raise_for_status()
            return resp.json()["usage"]["completion_tokens"]

        t = time.perf_counter()
        counts = await asyncio.gather(*(one(f"{tag}-{i}") for i in range(calls)))
        dt = time.perf_counter() - t
    return sum(counts), dt


def _configure(worker, mode: Mode, disk_dir: str) -> None:
    from rollout_recovery.data_plane.token_log_segments import TokenLogSegments

    k, disk = mode
    worker._token_log.configure(k)
    worker._service.segments = TokenLogSegments(disk_dir, "bench") if disk else None


def _clear_lags(worker) -> None:
    worker._service.metrics.log_lags.clear()


def _lags(worker) -> list[int]:
    return list(worker._service.metrics.log_lags)


def _rows_left(pool, store, partition: str, wait_s: float) -> int:
    """Staging rows still there once background writes are drained (polled up to `wait_s`)."""
    pool[0].drain(timeout=60)
    deadline = time.monotonic() + wait_s
    while True:
        left = store.list(partition)
        if not left or time.monotonic() >= deadline:
            return len(left)
        time.sleep(0.1)
        pool[0].drain(timeout=60)


def run_round(pool, store, args, mode: Mode, tag: str, partition: str) -> dict:
    w = pool[0]
    w.run_inside(_configure, mode, args.disk_dir)
    w.run_inside(_clear_lags)
    before = w.capture_metrics()
    gc.collect()
    tokens, dt = asyncio.run(_decode(w.info.url, tag, args.calls, args.tokens))
    left = _rows_left(pool, store, partition, args.settle_s)
    after = w.capture_metrics()
    lags = w.run_inside(_lags)
    assert tokens == args.calls * args.tokens, (tokens, args.calls * args.tokens)
    failures = {
        key: after.get(key, 0) - before.get(key, 0)
        for key in after
        if key.startswith("token_log_failure.") and after.get(key, 0) != before.get(key, 0)
    }
    return {
        "mode": mode_name(mode),
        "k": mode[0],
        "disk": mode[1],
        "segments": after.get("token_log.segments", 0) - before.get("token_log.segments", 0),
        # The worker's tally is a maximum since it started: meaningful where segments were
        # written, and only the durable-copy modes write any.
        "segment_s_max": after.get("token_log.segment_s_max") if mode[1] else None,
        "tag": tag,
        "seconds": dt,
        "tokens": tokens,
        "tok_s": tokens / dt,
        "token_log_rows": after.get("token_log.rows", 0) - before.get("token_log.rows", 0),
        "token_log_tokens": after.get("token_log.tokens", 0) - before.get("token_log.tokens", 0),
        "token_log_failures": failures,
        "lag_samples": lags,
        "lags_truncated": len(lags) >= 100_000,
        "rows_left": left,
    }


def summarize(modes: list[Mode], rounds: list[dict]) -> list[dict]:
    by_cycle: dict[int, dict[str, dict]] = {}
    for r in rounds:
        by_cycle.setdefault(r["cycle"], {})[r["mode"]] = r
    out = []
    for mode in modes:
        name = mode_name(mode)
        mine = [r for r in rounds if r["mode"] == name]
        ratios = [c[name]["tok_s"] / c[OFF]["tok_s"] for c in by_cycle.values() if OFF in c]
        lags = [x for r in mine for x in r["lag_samples"]]
        out.append(
            {
                "mode": name,
                "k": mode[0],
                "disk": mode[1],
                "segments_per_round": statistics.mean(r["segments"] for r in mine),
                "segment_s_max": max((r["segment_s_max"] or 0 for r in mine), default=0) or None,
                "tok_s_median": statistics.median(r["tok_s"] for r in mine),
                "tok_s": [r["tok_s"] for r in mine],
                "ratio_vs_off": statistics.median(ratios) if ratios else None,
                "ratios_vs_off": ratios,
                "token_log_rows_per_round": statistics.mean(r["token_log_rows"] for r in mine),
                "token_log_tokens_per_round": statistics.mean(r["token_log_tokens"] for r in mine),
                "lag_samples": len(lags),
                "lag_p50": percentile(lags, 50) if lags else None,
                "lag_p99": percentile(lags, 99) if lags else None,
                "rows_left_max": max(r["rows_left"] for r in mine),
                "token_log_failures": sum(sum(r["token_log_failures"].values()) for r in mine),
            }
        )
    return out


def print_table(summary: list[dict]) -> None:
    def num(x, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    cols = ["mode", "tokens/s", "vs off", "rows/round", "tokens/round", "lag p50", "lag p99",
            "segments", "seg max s", "rows left"]  # fmt: skip
    print("".join(f"{c:>13}" for c in cols))
    for s in summary:
        cells = [
            s["mode"],
            num(s["tok_s_median"], ",.0f"),
            num(s["ratio_vs_off"], ".3f"),
            num(s["token_log_rows_per_round"], ",.0f"),
            num(s["token_log_tokens_per_round"], ",.0f"),
            num(s["lag_p50"], ".0f"),
            num(s["lag_p99"], ".0f"),
            num(s["segments_per_round"], ",.0f"),
            num(s["segment_s_max"], ".3f"),
            str(s["rows_left_max"]),
        ]
        print("".join(f"{c:>13}" for c in cells))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="where to write the results")
    ap.add_argument(
        "--model",
        default="default",
        choices=["default", "qwen3"],
        help="the tiny model the worker serves: tiny://default or tiny://qwen3",
    )
    ap.add_argument("--k", default="8,16,64,128", help="token log intervals (tokens) to compare")
    ap.add_argument("--disk-k", type=int, default=16,
                    help="K of the extra mode with the durable copy on (0: none)")  # fmt: skip
    ap.add_argument("--calls", type=int, default=64, help="concurrent calls per round")
    ap.add_argument("--tokens", type=int, default=192, help="tokens decoded per call")
    ap.add_argument("--rounds", type=int, default=3, help="cycles over all modes")
    ap.add_argument(
        "--settle-s",
        type=float,
        default=10.0,
        help="how long to wait for the staging partition to empty after a round",
    )
    ap.add_argument("--quick", action="store_true", help="one cycle, 96 tokens per call")
    args = ap.parse_args()
    if args.quick:  # new defaults: options given explicitly still win
        ap.set_defaults(rounds=1, tokens=96)
        args = ap.parse_args()
    ks = sorted({int(x) for x in args.k.split(",") if x.strip()})
    modes: list[Mode] = [(None, False), *((k, False) for k in ks)]
    if args.disk_k:
        modes.append((args.disk_k, True))
    import tempfile

    disk = tempfile.TemporaryDirectory(prefix="bench-token-log-")
    args.disk_dir = disk.name

    import ray

    from rollout_recovery.config import load_config
    from rollout_recovery.data_plane import StagingStore
    from rollout_recovery.generation import WorkerPool
    from rollout_recovery.runtime import init_ray
    from rollout_recovery.tiny_model import ensure_tiny_model, tiny_spec

    cfg = load_config(
        REPO / "configs" / "grpo_tiny_cpu.yaml",
        [
            f"policy.model_path={ensure_tiny_model(spec=tiny_spec(args.model))}",
            "token_capture.enabled=true",
        ],
    )
    partition = cfg.token_capture.staging_partition
    init_ray("local", num_cpus=4, log_to_driver=False)
    store = StagingStore.create(num_shards=1)
    rounds: list[dict] = []
    try:
        t = time.perf_counter()
        pool = WorkerPool.start(cfg, num_workers=1, store=store)
        startup_s = time.perf_counter() - t
        print(f"model: tiny://{args.model}; worker started in {startup_s:.1f} s", flush=True)
        try:
            warmup = run_round(pool, store, args, modes[1 % len(modes)], "warmup", partition)
            for cycle in range(args.rounds):
                shift = cycle % len(modes)
                for mode in modes[shift:] + modes[:shift]:
                    tag = f"c{cycle}-{mode_name(mode).replace('=', '').replace('+', '-')}"
                    r = run_round(pool, store, args, mode, tag, partition)
                    r["cycle"] = cycle
                    rounds.append(r)
                    line = f"{r['tok_s']:,.0f} tok/s, {r['token_log_rows']} rows"
                    print(f"  cycle {cycle} {r['mode']:>6}: {line}, {r['rows_left']} left",
                          flush=True)  # fmt: skip
            pool[0].run_inside(_configure, (None, False), args.disk_dir)
        finally:
            pool.stop()
    finally:
        store.shutdown()
        ray.shutdown()
        disk.cleanup()

    summary = summarize(modes, rounds)
    left = sum(r["rows_left"] for r in [warmup, *rounds])
    print(
        f"\none GenerationWorker (tiny model, token capture on, StagingStore), {args.calls} "
        f"identified greedy chat completions x {args.tokens} tokens per round over HTTP, "
        f"{args.rounds} interleaved cycle(s) of {len(modes)} modes + 1 warm-up round "
        f"(startup {startup_s:.0f} s); tokens/s: median; vs off: median of per-cycle ratios; "
        "lag: tokens not yet in the store per in-flight call, sampled every 0.1 s\n"
    )
    print_table(summary)
    for s in summary:
        print(f"  {s['mode']:>6} per cycle: " + ", ".join(f"{x:,.0f}" for x in s["tok_s"]))
    failures = sum(s["token_log_failures"] for s in summary)
    if failures:
        print(f"token log failures during measured rounds: {failures}")
    if left:
        print(f"FAIL: {left} staging row(s) left after rounds (finished calls' rows not deleted)")

    if args.json:
        for r in [warmup, *rounds]:
            r["lag_samples_count"] = len(r.pop("lag_samples"))
        write_result(
            args.json,
            {
                "args": vars(args),
                "startup_s": startup_s,
                "summary": summary,
                "warmup": warmup,
                "rounds": rounds,
                "rows_left_total": left,
            },
        )
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
