"""Benchmark how checkpointing scales: calls in flight, store size, shards, cadence, restart.

    .venv/bin/python scripts/bench_scale.py --json bench_results/scale.json [--quick]

Every section is one table measured in this one run; figures compared side by side share
their units.

1. Checkpoint cost vs concurrent calls. One RolloutRecovery (api.py: store, workers,
   environment, coordinator, tiny model on CPU, level prefix, token capture on) per worker
   count (`--workers`, 1, 2, 4); in it, for each call count (`--calls`, 8 to 1,024), that many
   single-call tally episodes are submitted (`env.run_groups`, every call decoding
   `--call-tokens` tokens, so it stays in flight) and, once the engines hold their share,
   `coordinator.attempt` runs `--attempts` times (after one uncounted warm-up attempt),
   `--gap` s apart. Per attempt the coordinator's own metrics: fence hold (fences taken to
   released), cut (the environment's prepare: every in-flight call cut), commit, freeze
   (the shards' atomic freeze), snapshot (freeze + files + publish) and the whole attempt,
   in ms, medians over the attempts that saw at least 90% of the calls in flight (fence also
   p99 and max; with a handful of attempts p99 is close to the max). A key the coordinator
   does not report yet is shown as `-`. "in flight" is what the checkpoint found (calls cut
   plus calls not cut), "at engines" the requests the engines held before the attempts.
   Two limits decide how many calls reach an engine: the environment's HTTP client opens at
   most 100 connections per worker (httpx's default), and vLLM's CPU scheduler runs at most
   128 sequences (its OpenAI-server default; `vllm_cfg` does not expose max_num_seqs). A call
   still waiting for a connection is in flight for the checkpoint but unknown to its worker:
   it is not cut (`unknown_call`) and would be decoded again after a restore; a call the
   engine queued with no token yet is not cut either (`zero_generated_tokens`). The round
   then ends by restarting the environment actor (its connections close, the engines abort
   the calls), the staged rows are swept by one more attempt and the store is emptied, so
   every configuration starts from an empty store. A worker count whose workers would not
   fit this machine's memory (`--worker-gb` + the KV cache each), or that fails to start, is
   reported with the reason.
2. Snapshot seconds and bytes vs store size (`--store-sizes`), full vs incremental: a
   StagingStore (`--snap-shards`) filled with chunk rows of the real schema
   (`--row-tokens` tokens each), then per repeat: C rows changed (C/2 existing rows replaced,
   C/2 new rows put, C/2 rows deleted: the size stays), an incremental snapshot
   (`full_every` large: only what changed since the previous snapshot in this root) and a
   full one (`full_every=1`) of the same state, in that order (a full snapshot forgets the
   change log the incremental one needs); the full one is the next repeat's parent. Bytes
   are what the snapshot wrote (its own directory on disk: files, sidecars, manifest).
   C = `--changed-rows` (1,000) at every size, then C = `--changed` at the largest size.
   A restore of the last incremental snapshot (its chain: the parent's files plus its own)
   and of the full one into a fresh store is timed once per size.
3. Store put/get scaling over 1, 2, 4 shards: `--store-rows` rows in batches of
   `--batch-rows`, `--clients` batches at once through the async API (aput / aget) from
   this process, every shard count holding the same rows; rows/s, median of `--store-repeats`
   repeats with the shard counts interleaved in a rotating order, ratios vs 1 shard. The
   store is emptied (untimed) after each repeat.
4. Decode throughput vs checkpoint interval (`--intervals`, off = no cadence): one
   RolloutRecovery, 1 worker; per round `--s4-calls` tally episodes x `--s4-tokens` tokens
   (same tasks and seeds every round) run through `coordinator.alongside` with
   `snapshot_attempt_interval_s` set to the interval (the cadence restarts with each
   submission: an interval longer than the round never fires). Rounds cycle over all
   intervals `--s4-rounds` times, each cycle in a rotated order, after one uncounted
   warm-up round; tokens/s = decoded tokens / round seconds; "vs off" = median over cycles of
   the ratio to the same cycle's off round. Each published snapshot's time (its manifest's
   `created_at`) gives the timeline; expected tokens lost per crash = decode rate x mean age
   of the newest published snapshot at a crash uniformly at random in the round (before the
   first one the age counts from the round's start).
5. Restart to first resumed token after a whole-job kill: `rollout-recovery train` with
   configs/prefix_recovery.yaml in its own process group, polled until a published snapshot
   holds `--s5-cuts` calls cut with 0 < prefix < limit, then SIGKILLed (every process), then
   `train --restore` launched; from its launch to the first call attempt whose worker
   reports `resume: resumed` with decoded_tokens > 0 (the workers' control API, polled every
   `--poll` s: that is the resolution). Beside it, the same for the killed run's own start
   (launch to any call's first token). The breakdown comes from the same polls and the run's
   output: Ray started, snapshot selected, workers.json of the new session (store, workers,
   environment up), first resumed request at a worker.

`--quick`: 1 and 2 workers x 8, 64, 256 calls, 3 attempts; 10k and 100k rows; 50k rows for
the shards; intervals off, 5, 1, 0.5 s, one cycle of 256 tokens; about 5 minutes here.
`--sections 1,2` runs a subset (the others' targets are `skipped`). Exit status 1 when a
target is missed or not measured.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "functional_tests"))

# Before torch or vLLM are imported (engine_setup itself imports neither).
from bench_common import (  # noqa: E402
    Target,
    check_targets,
    percentile,
    print_targets,
    targets_ok,
    write_result,
)
from processes import alive_own, descendants, mark_this_check, signal_own  # noqa: E402

from rollout_recovery.generation.engine_setup import CPU_ENGINE_ENV  # noqa: E402

os.environ.update(CPU_ENGINE_ENV)
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # logging only: keeps the table readable

import argparse  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from datetime import datetime  # noqa: E402

import numpy as np  # noqa: E402

PARTITION = "rollout_staging"
GB = 1 << 30
MB = 1e6
ATTEMPT_KEYS = ("fence_hold_s", "cut_s", "commit_s", "freeze_s", "snapshot_s", "save_s")
IN_FLIGHT_SHARE = 0.9  # an attempt counts when it found at least this share of the calls
ENGINE_MAX_SEQS = 128  # vLLM's CPU default max_num_seqs for the OpenAI server

TARGETS = [
    Target("fence_ms_256_w1", "<=", 50.0, "256 calls, 1 worker: fence hold median ms"),
    Target("fence_ms_256_w2", "<=", 50.0, "256 calls, 2 workers: fence hold median ms"),
    Target("fence_ms_256_w4", "<=", 50.0, "256 calls, 4 workers: fence hold median ms"),
    Target("incr_size_ratio", "<=", 2.0,
           "incremental snapshot s, largest / smallest store, same rows changed"),
    Target("decode_ratio_1s", ">=", 0.98, "1 s interval: decode tokens/s / off"),
]  # fmt: skip
SECTION_OF_TARGET = {"fence_ms_256_w1": 1, "fence_ms_256_w2": 1, "fence_ms_256_w4": 1,
                     "incr_size_ratio": 2, "decode_ratio_1s": 4}  # fmt: skip


# ---------------------------------------------------------------------- pure helpers


def mean_durable_age(start: float, end: float, publishes: Sequence[float]) -> float:
    """Mean age of the newest durable state over [start, end], for a crash at a uniformly
    random moment: at time t the age is t minus the newest publish time <= t, or t - start
    before the first one (what a crash then loses counts from the round's start). Publish
    times outside the window are ignored; NaN for an empty window."""
    if end <= start:
        return math.nan
    area, last = 0.0, start
    for p in sorted(x for x in publishes if start < x < end):
        area += (p - last) ** 2 / 2  # the age rises linearly from 0 (at `last`) until p
        last = p
    area += (end - last) ** 2 / 2
    return area / (end - start)


def expected_tokens_lost(
    rate: float, start: float, end: float, publishes: Sequence[float]
) -> float:
    """Tokens a whole-job crash at a uniformly random moment of [start, end] loses on average,
    when `rate` tokens/s are decoded throughout and everything decoded before the newest
    published snapshot survives: rate x the mean age of that snapshot."""
    return rate * mean_durable_age(start, end, publishes)


def in_flight(metrics: dict) -> int:
    """Calls an attempt found in flight: those cut plus those not cut, by any reason."""
    return int(metrics.get("calls_cut", 0)) + sum((metrics.get("calls_not_cut") or {}).values())


def change_plan(live: int, changed: int) -> tuple[int, int, int]:
    """(replaced, new, deleted) rows for `changed` rows changed in a store of `live` rows:
    half of them replace existing rows, half are new, and as many as are new are deleted,
    so the store keeps its size; never more existing rows than there are."""
    replaced = min(changed // 2, live)
    new = changed - replaced
    deleted = min(new, live - replaced)
    return replaced, new, deleted


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def med(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def cell(x, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def print_rows(headers: Sequence[str], rows: Sequence[Sequence[str]], first: int = 0) -> None:
    """A plain table: the first column left-aligned (width `first` or its widest), the rest
    right-aligned."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) + 2 for i in range(len(headers))]
    widths[0] = max(widths[0], first)
    print("".join(f"{h:<{widths[0]}}" if i == 0 else f"{h:>{widths[i]}}"
                  for i, h in enumerate(headers)))  # fmt: skip
    for r in rows:
        print("".join(f"{c:<{widths[0]}}" if i == 0 else f"{c:>{widths[i]}}"
                      for i, c in enumerate(r)))  # fmt: skip


def mem_available_gb() -> float:
    """MemAvailable from /proc/meminfo, in GiB (inf where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GB
    except OSError:
        pass
    return math.inf


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ---------------------------------------------------------------------- live stack (1, 4)


def _engine_requests(worker) -> int:
    """Requests the worker's engine holds (running or queued); runs inside the actor."""
    return worker._engine.get_num_unfinished_requests()


def engine_requests(rr) -> int:
    return sum(w.run_inside(_engine_requests) for w in rr.job.workers)


def tally_work(n: int, tag: str, group_size: int = 8):
    """`n` tally episodes as (groups, seeds) for run_groups: the same tasks and seeds for the
    same n (the tag only names the rollouts)."""
    from rollout_recovery.episodes.tally import tasks

    n_groups = -(-n // group_size)
    groups = [(f"{tag}-g{j}", task) for j, task in enumerate(tasks(n_groups, seed=0))]
    seeds = [[1000 * j + i for i in range(group_size)] for j in range(n_groups)]
    return groups, seeds


def restart_env(rr, cfg) -> None:
    """Close the environment actor (its HTTP connections close, so the engines abort every
    call it had in flight) and start a fresh one with `cfg`'s environment blocks."""
    rr.job.renew_environment(cfg)


def clear_store(store) -> int:
    """Delete every row of every partition (between rounds: nothing in them is needed)."""
    n = 0
    for part in store.partitions:
        keys = store.list(part)
        for i in range(0, len(keys), 50_000):
            n += store.delete(part, keys[i : i + 50_000])
    return n


def wait_engines_idle(rr, timeout_s: float = 120.0) -> float:
    t = time.monotonic()
    while engine_requests(rr) and time.monotonic() - t < timeout_s:
        time.sleep(0.2)
    return time.monotonic() - t


def start_rr(args, workers: int, ckdir: Path, max_tokens: int):
    from rollout_recovery.api import RolloutRecovery
    from rollout_recovery.config import load_config

    cfg = load_config(
        REPO / "configs" / "prefix_recovery.yaml",
        [
            f"checkpointing.checkpoint_dir={ckdir}",
            f"vllm_cfg.num_workers={workers}",
            f"vllm_cfg.kv_cache_memory_bytes={args.kv_mb << 20}",
            "vllm_cfg.max_model_len=2048",
            f"policy.generation.max_new_tokens={max_tokens}",
            "grpo.generations_per_prompt=8",
            "rollout_checkpointing.keep_latest_k=2",
            "rollout_checkpointing.attempt_timeout_s=120",
            "rollout_checkpointing.max_consecutive_failures=1000",
        ],
    )
    t = time.perf_counter()
    rr = RolloutRecovery(cfg)
    try:
        rr.start()
    except BaseException:
        with contextlib.suppress(Exception):
            rr.close()
        raise
    return rr, cfg, time.perf_counter() - t


def attempt_figures(metrics: dict) -> dict:
    out = {k: metrics.get(k) for k in ATTEMPT_KEYS}
    out |= {"calls_cut": metrics.get("calls_cut", 0),
            "calls_not_cut": dict(metrics.get("calls_not_cut") or {}),
            "in_flight": in_flight(metrics), "episodes_recorded": metrics.get("episodes_recorded"),
            "chunk_rows_swept": metrics.get("chunk_rows_swept")}  # fmt: skip
    return out


def run_calls(rr, cfg, args, workers: int, n: int) -> dict:
    """`n` calls in flight, then the measured checkpoint attempts; then the calls aborted."""
    groups, seeds = tally_work(n, f"w{workers}n{n}")
    expect_engine = n  # the environment holds no call back (no connection cap)
    work = asyncio.run_coroutine_threadsafe(
        rr.job.env.run_groups(groups, seeds, 0), rr.job.loop.loop
    )
    row: dict = {"workers": workers, "calls": n, "status": "ok"}
    try:
        t, at_engine = time.monotonic(), 0
        while time.monotonic() - t < args.settle_s and not work.done():
            at_engine = engine_requests(rr)
            if at_engine >= 0.95 * expect_engine:
                break
            time.sleep(0.2)
        row["at_engines"] = at_engine
        row["settle_s"] = time.monotonic() - t
        attempts = []
        for k in range(args.attempts + 1):  # the first is the warm-up
            if work.done():
                break
            metrics = rr.job.loop.run(rr.job.coordinator.attempt("bench-scale"))
            if k:
                attempts.append(attempt_figures(metrics))
            time.sleep(args.gap)
        row["work_finished_early"] = work.done()
    finally:
        restart_env(rr, cfg)
        with contextlib.suppress(Exception):
            work.result(120)  # ends with the closed environment's error
        row["abort_drain_s"] = wait_engines_idle(rr)
        rr.job.loop.run(
            rr.job.coordinator.attempt("bench-scale-sweep")
        )  # staged rows of aborted calls
        clear_store(rr.job.store)
    counted = [a for a in attempts if a["in_flight"] >= IN_FLIGHT_SHARE * n]
    row["attempts"] = attempts
    row["attempts_counted"] = len(counted)
    if not counted:
        row["status"] = (f"no attempt saw {IN_FLIGHT_SHARE:.0%} of the calls in flight "
                         f"({len(attempts)} attempts)")  # fmt: skip
        return row
    for key in ATTEMPT_KEYS:
        xs = [a[key] for a in counted if a[key] is not None]
        row[f"{key}_median"] = med(xs)
    fences = [a["fence_hold_s"] for a in counted]
    row["fence_hold_s_p99"] = percentile(fences, 99)
    row["fence_hold_s_max"] = max(fences)
    row["in_flight_median"] = med([a["in_flight"] for a in counted])
    row["calls_cut_median"] = med([a["calls_cut"] for a in counted])
    reasons: dict[str, list[int]] = {}
    for a in counted:
        for reason, c in a["calls_not_cut"].items():
            reasons.setdefault(reason, []).append(c)
    row["calls_not_cut_median"] = {r: med(cs + [0] * (len(counted) - len(cs)))
                                   for r, cs in reasons.items()}  # fmt: skip
    return row


def s4_round(rr, args, interval: float | None, tag: str) -> dict:
    """One decode round: the same episodes, with the cadence at `interval` (None: none)."""
    from rollout_recovery.data_plane import StagingStore

    coord = rr.job.coordinator
    groups, seeds = tally_work(args.s4_calls, tag)
    published: list[float] = []
    attempts: list[dict] = []
    failed = [0]
    counted = type(coord).counted.__get__(coord)

    async def recorded(reason: str) -> dict | None:
        metrics = await counted(reason)
        if metrics is None:
            failed[0] += 1
            return None
        try:
            made = StagingStore.manifest(metrics["checkpoint"]).body.created_at
            published.append(datetime.fromisoformat(made).timestamp())
        except Exception:  # the snapshot went already (retention): its return time then
            published.append(time.time())
        attempts.append(attempt_figures(metrics))
        return metrics

    gc.collect()
    coord.counted = recorded
    try:
        if interval is not None:
            coord.cfg.rollout_checkpointing.snapshot_attempt_interval_s = interval
        t0 = time.time()
        work = rr.job.env.run_groups(groups, seeds, 0)
        out = rr.job.loop.run(work if interval is None else coord.alongside(work))
        t1 = time.time()
    finally:
        del coord.counted
    clear_store(rr.job.store)
    tokens = sum(o.decoded_tokens for o in out)
    rate = tokens / (t1 - t0)
    return {
        "interval_s": interval,
        "tag": tag,
        "seconds": t1 - t0,
        "tokens": tokens,
        "tok_s": rate,
        "snapshots": len(published),
        "failed_attempts": failed[0],
        "publish_s": [p - t0 for p in published],  # the timeline, from the round's start
        "mean_age_s": mean_durable_age(t0, t1, published),
        "expected_tokens_lost": expected_tokens_lost(rate, t0, t1, published),
        "fence_hold_s": [a["fence_hold_s"] for a in attempts],
        "save_s": [a["save_s"] for a in attempts],
    }


def interval_name(x: float | None) -> str:
    return "off" if x is None else f"{x:g} s"


def bench_decode_vs_interval(rr, cfg, args) -> dict:
    cfg4 = cfg.model_copy(deep=True)
    cfg4.policy.generation.max_new_tokens = args.s4_tokens
    restart_env(rr, cfg4)
    wait_engines_idle(rr)
    clear_store(rr.job.store)
    intervals = args.interval_list
    warmup = s4_round(rr, args, intervals[-1], "s4-warmup")
    rounds = []
    for cycle in range(args.s4_rounds):
        shift = cycle % len(intervals)
        for x in intervals[shift:] + intervals[:shift]:
            r = s4_round(rr, args, x, f"s4-c{cycle}-{interval_name(x).replace(' ', '')}")
            r["cycle"] = cycle
            rounds.append(r)
            print(f"  [4] cycle {cycle} {interval_name(x):>6}: {r['tok_s']:,.0f} tok/s, "
                  f"{r['snapshots']} snapshots, {r['seconds']:.1f} s", flush=True)  # fmt: skip
    restart_env(rr, cfg)
    by_cycle: dict[int, dict] = {}
    for r in rounds:
        by_cycle.setdefault(r["cycle"], {})[r["interval_s"]] = r
    summary = []
    for x in intervals:
        mine = [r for r in rounds if r["interval_s"] == x]
        ratios = [c[x]["tok_s"] / c[None]["tok_s"] for c in by_cycle.values()
                  if None in c and x in c]  # fmt: skip
        fences = [f for r in mine for f in r["fence_hold_s"]]
        summary.append({
            "interval": interval_name(x),
            "interval_s": x,
            "tok_s_median": med([r["tok_s"] for r in mine]),
            "tok_s": [r["tok_s"] for r in mine],
            "ratio_vs_off": med(ratios),
            "ratios_vs_off": ratios,
            "snapshots_per_round": statistics.mean(r["snapshots"] for r in mine),
            "round_s_median": med([r["seconds"] for r in mine]),
            "mean_age_s_median": med([r["mean_age_s"] for r in mine]),
            "expected_tokens_lost_median": med([r["expected_tokens_lost"] for r in mine]),
            "fence_hold_ms_median": ms(med(fences)),
            "failed_attempts": sum(r["failed_attempts"] for r in mine),
        })  # fmt: skip
    return {"calls": args.s4_calls, "tokens_per_call": args.s4_tokens, "warmup": warmup,
            "rounds": rounds, "summary": summary}  # fmt: skip


def bench_live(args, workdir: Path, errors: dict) -> tuple[list[dict], dict | None]:
    """Sections 1 and 4: one RolloutRecovery per worker count (section 4 in the 1-worker one)."""
    rows: list[dict] = []
    decode = None
    for w in args.worker_list:
        need = w * (args.worker_gb + args.kv_mb / 1024)
        have = mem_available_gb()
        if need > have - 1.0:
            why = f"does not fit: {w} workers need ~{need:.1f} GiB, {have:.1f} GiB available"
            rows += [{"workers": w, "calls": n, "status": why} for n in args.call_list]
            print(f"  [1] {w} worker(s): {why}", flush=True)
            continue
        print(f"  [1] starting {w} worker(s) ...", flush=True)
        try:
            rr, cfg, startup_s = start_rr(args, w, workdir / f"live-w{w}", args.call_tokens)
        except Exception as err:
            why = f"did not start: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
            rows += [{"workers": w, "calls": n, "status": why} for n in args.call_list]
            print(f"  [1] {w} worker(s): {why}", flush=True)
            continue
        try:
            print(f"  [1] {w} worker(s) started in {startup_s:.0f} s", flush=True)
            for n in args.call_list:
                try:
                    row = run_calls(rr, cfg, args, w, n)
                except Exception as err:
                    row = {"workers": w, "calls": n,
                           "status": f"failed: {type(err).__name__}: {str(err)[:160]}"}  # fmt: skip
                row["startup_s"] = startup_s
                rows.append(row)
                fence = ms(row.get("fence_hold_s_median"))
                print(f"  [1] {w} worker(s), {n} calls: {row['status']}, in flight "
                      f"{row.get('in_flight_median')}, fence {cell(fence, '.0f')} ms",
                      flush=True)  # fmt: skip
            if w == 1 and 4 in args.sections:
                try:
                    decode = bench_decode_vs_interval(rr, cfg, args)
                except Exception as err:
                    errors["4"] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
                    print(f"  [4] failed: {errors['4']}", flush=True)
        finally:
            rr.close()
            gc.collect()
    return rows, decode


# ---------------------------------------------------------------------- store (2, 3)


def chunk_table(start: int, n: int, tokens: int, rng: np.random.Generator, tag: str = "r"):
    """`n` chunk rows of the real schema, keys `<tag><i>/c0/a0/c000000` for i in
    [start, start + n), built column by column (digests are random bytes: the store does
    not check them)."""
    import pyarrow as pa

    from rollout_recovery.data_plane.schemas import CHUNK_ROW_SCHEMA

    ids = [f"{tag}{i:08d}" for i in range(start, start + n)]
    offsets = pa.array(np.arange(0, (n + 1) * tokens, tokens, dtype=np.int32))
    cols = {
        "key": pa.array([f"{r}/c0/a0/c000000" for r in ids], pa.string()),
        "rollout_id": pa.array(ids, pa.string()),
        "model_call_id": pa.array(["c0"] * n, pa.string()),
        "attempt": pa.array(np.zeros(n, np.int32)),
        "chunk_seq": pa.array(np.zeros(n, np.int32)),
        "prompt_token_ids": pa.nulls(n, pa.list_(pa.int32())),
        "token_ids": pa.ListArray.from_arrays(
            offsets, pa.array(rng.integers(0, 150_000, n * tokens, dtype=np.int32))
        ),
        "logprobs": pa.ListArray.from_arrays(
            offsets, pa.array(-rng.random(n * tokens, dtype=np.float32) * 5)
        ),
        "weight_version": pa.array(np.zeros(n, np.int64)),
        "prev_len": pa.array(np.zeros(n, np.int32)),
        "delta_len": pa.array(np.full(n, tokens, np.int32)),
        "cum_len": pa.array(np.full(n, tokens, np.int32)),
        "digest": pa.array([bytes(32)] * n, pa.binary(32)),
        "finish_reason": pa.nulls(n, pa.string()),
        "stop_reason_json": pa.nulls(n, pa.string()),
    }
    return pa.Table.from_arrays([cols[f.name] for f in CHUNK_ROW_SCHEMA], schema=CHUNK_ROW_SCHEMA)


def key_of(i: int, tag: str = "r") -> str:
    return f"{tag}{i:08d}/c0/a0/c000000"


class Filler:
    """Keeps a store at a known set of live chunk rows (by index) and changes it."""

    def __init__(self, store, tokens: int, seed: int = 0) -> None:
        self.store, self.tokens = store, tokens
        self.rng = np.random.default_rng(seed)
        self.live: list[int] = []
        self.next = 0

    def put_new(self, n: int, batch: int = 50_000) -> None:
        for s in range(0, n, batch):
            k = min(batch, n - s)
            self.store.put(PARTITION, chunk_table(self.next, k, self.tokens, self.rng))
            self.live.extend(range(self.next, self.next + k))
            self.next += k

    def change(self, changed: int, batch: int = 50_000) -> dict:
        replaced, new, deleted = change_plan(len(self.live), changed)
        pick = self.rng.choice(len(self.live), replaced + deleted, replace=False)
        old = [self.live[i] for i in pick]
        for s in range(0, replaced, batch):  # same keys, new content
            self.store.put(PARTITION, self._rows(old[s : min(s + batch, replaced)]))
        gone = old[replaced:]
        for s in range(0, len(gone), batch):
            self.store.delete(PARTITION, [key_of(i) for i in gone[s : s + batch]])
        gone_set = set(gone)
        self.live = [i for i in self.live if i not in gone_set]
        self.put_new(new, batch)
        return {"replaced": replaced, "new": new, "deleted": deleted}

    def _rows(self, idx: list[int]):
        """Rows for arbitrary indices (new content under existing keys)."""
        import pyarrow as pa

        table = chunk_table(0, len(idx), self.tokens, self.rng)
        ids = [f"r{i:08d}" for i in idx]
        table = table.set_column(0, "key", pa.array([f"{r}/c0/a0/c000000" for r in ids]))
        return table.set_column(1, "rollout_id", pa.array(ids, pa.string()))


def snap_once(store, root: str, full_every: int) -> dict:
    t = time.perf_counter()
    res = store.snapshot(root, full_every=full_every)
    secs = time.perf_counter() - t
    body = res.manifest.body
    own = [f for f in body.files if getattr(f, "snapshot", None) is None]
    path = Path(res.uri.removeprefix("file://"))
    return {
        "uri": res.uri,
        "seconds": secs,
        "bytes": dir_bytes(path) if path.exists() else None,
        "files_written": len(own),
        "rows_written": sum(f.rows for f in own),
        "manifest_bytes_written": sum(f.bytes for f in own),
        "files_listed": len(body.files),
        "base": getattr(body, "base", None),
    }


def drop_snapshots(root: Path, keep: Sequence[str]) -> None:
    """Delete the snapshot directories under `root` but those named in `keep` (untimed)."""
    names = {Path(u.removeprefix("file://")).name for u in keep}
    for d in root.iterdir():
        if d.is_dir() and d.name.startswith("snap") and d.name not in names:
            shutil.rmtree(d, ignore_errors=True)


def measure_changes(store, filler: Filler, root: Path, changed: int, repeats: int) -> dict:
    """Per repeat: change `changed` rows, then an incremental and a full snapshot of that
    state (the full one is the next repeat's parent)."""
    root.mkdir(parents=True, exist_ok=True)
    uri = str(root)
    parent = snap_once(store, uri, 1)  # the first parent (full)
    reps = []
    for _ in range(repeats):
        plan = filler.change(changed)
        incr = snap_once(store, uri, 1_000_000)
        full = snap_once(store, uri, 1)
        reps.append({"change": plan, "incremental": incr, "full": full,
                     "incremental_parent": parent["uri"]})  # fmt: skip
        drop_snapshots(root, [parent["uri"], incr["uri"], full["uri"]])
        parent = full
    last = reps[-1]
    incr_is_incremental = all(r["incremental"]["base"] is not None for r in reps)
    return {
        "live_rows": len(filler.live),
        "changed": changed,
        "repeats": reps,
        "incremental_was_incremental": incr_is_incremental,
        "full_s": med([r["full"]["seconds"] for r in reps]),
        "incr_s": med([r["incremental"]["seconds"] for r in reps]),
        "full_bytes": med([r["full"]["bytes"] for r in reps]),
        "incr_bytes": med([r["incremental"]["bytes"] for r in reps]),
        "incr_rows_written": med([r["incremental"]["rows_written"] for r in reps]),
        "last": {"incremental": last["incremental"]["uri"], "full": last["full"]["uri"]},
    }


def time_restore(uri: str, shards: int, expect_rows: int) -> dict:
    from rollout_recovery.data_plane import StagingStore

    fresh = StagingStore.create(num_shards=shards)
    try:
        t = time.perf_counter()
        fresh.restore(uri)
        secs = time.perf_counter() - t
        rows = fresh.stats().get(PARTITION, {}).get("rows")
    finally:
        fresh.shutdown()
    return {"seconds": secs, "rows": rows, "rows_ok": rows == expect_rows}


def bench_snapshots(args, workdir: Path) -> dict:
    from rollout_recovery.data_plane import StagingStore

    store = StagingStore.create(num_shards=args.snap_shards)
    filler = Filler(store, args.row_tokens)
    sizes, out = [], []
    try:
        for size in args.size_list:
            t = time.perf_counter()
            filler.put_new(size - len(filler.live))
            fill_s = time.perf_counter() - t
            r = measure_changes(store, filler, workdir / f"snap-{size}", args.changed_rows,
                                args.snap_repeats)  # fmt: skip
            r |= {"store_rows": size, "fill_s": fill_s}
            r["restore_incremental"] = time_restore(r["last"]["incremental"], args.snap_shards,
                                                    r["live_rows"])  # fmt: skip
            r["restore_full"] = time_restore(r["last"]["full"], args.snap_shards, r["live_rows"])
            sizes.append(r)
            print(f"  [2] {size:,} rows: full {r['full_s']:.3f} s, incremental "
                  f"{r['incr_s']:.3f} s", flush=True)  # fmt: skip
            shutil.rmtree(workdir / f"snap-{size}", ignore_errors=True)
            gc.collect()
        biggest = args.size_list[-1]
        for c in args.changed_list:
            if c == args.changed_rows:
                r = dict(next(s for s in sizes if s["store_rows"] == biggest))
            else:
                r = measure_changes(store, filler, workdir / f"snap-c{c}", c, args.snap_repeats)
                r["store_rows"] = biggest
                shutil.rmtree(workdir / f"snap-c{c}", ignore_errors=True)
            out.append(r)
            print(f"  [2] {c:,} changed at {biggest:,}: full {r['full_s']:.3f} s, incremental "
                  f"{r['incr_s']:.3f} s", flush=True)  # fmt: skip
    finally:
        store.shutdown()
    return {"shards": args.snap_shards, "row_tokens": args.row_tokens, "by_size": sizes,
            "by_changed": out}  # fmt: skip


async def _batches(fn, items: list, clients: int) -> float:
    """Run fn(item) for every item, `clients` at a time; seconds from first to last."""
    sem = asyncio.Semaphore(clients)

    async def one(item):
        async with sem:
            await fn(item)

    t = time.perf_counter()
    await asyncio.gather(*(one(i) for i in items))
    return time.perf_counter() - t


def bench_shards(args) -> dict:
    from rollout_recovery.data_plane import StagingStore

    rng = np.random.default_rng(1)
    n_batches = -(-args.store_rows // args.batch_rows)
    tables = [chunk_table(b * args.batch_rows, args.batch_rows, args.row_tokens, rng, "p")
              for b in range(n_batches)]  # fmt: skip
    keys = [t.column("key").to_pylist() for t in tables]
    rows = n_batches * args.batch_rows
    stores = {k: StagingStore.create(num_shards=k) for k in args.shard_list}
    times: dict[int, dict[str, list[float]]] = {k: {"put": [], "get": []} for k in stores}
    try:
        for rep in range(args.store_repeats + 1):  # the first is a warm-up
            order = list(stores)
            order = order[rep % len(order) :] + order[: rep % len(order)]
            for k in order:
                store = stores[k]

                async def put(t, store=store):
                    await store.aput(PARTITION, t)

                async def get(ks, store=store):
                    table, missing = await store.aget(PARTITION, ks)
                    assert not missing and table.num_rows == len(ks)

                put_s = asyncio.run(_batches(put, tables, args.clients))
                get_s = asyncio.run(_batches(get, keys, args.clients))
                clear_store(store)
                if rep:
                    times[k]["put"].append(put_s)
                    times[k]["get"].append(get_s)
            if rep:
                line = ", ".join(
                    f"{k} shard(s) put {rows / times[k]['put'][-1]:,.0f} get "
                    f"{rows / times[k]['get'][-1]:,.0f} rows/s"
                    for k in stores
                )
                print(f"  [3] repeat {rep}: {line}", flush=True)
    finally:
        for s in stores.values():
            s.shutdown()
    out = []
    base = None
    for k in args.shard_list:
        put_rs = rows / med(times[k]["put"])
        get_rs = rows / med(times[k]["get"])
        if base is None:
            base = (put_rs, get_rs)
        out.append({"shards": k, "put_rows_s": put_rs, "get_rows_s": get_rs,
                    "put_vs_1": put_rs / base[0], "get_vs_1": get_rs / base[1],
                    "put_s": times[k]["put"], "get_s": times[k]["get"]})  # fmt: skip
    return {"rows": rows, "batch_rows": args.batch_rows, "clients": args.clients,
            "row_tokens": args.row_tokens, "by_shards": out}  # fmt: skip


# ---------------------------------------------------------------------- restart (5)


class Job:
    """`rollout-recovery train` in its own process group; its output lines are timestamped
    as they arrive."""

    def __init__(self, cmd: list[str], log: Path) -> None:
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     text=True, bufsize=1)  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self.log = log
        self.tree: set[int] = set()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with open(self.log, "w") as fh:
            for line in self.proc.stdout:
                self.lines.append((time.monotonic() - self.t0, line.rstrip()))
                fh.write(line)

    def first_line(self, text: str) -> float | None:
        return next((t for t, line in list(self.lines) if text in line), None)

    def scan(self) -> None:
        self.tree |= descendants(self.proc.pid)

    def kill(self) -> int:
        """SIGKILL the whole group; then any descendant left, by its pid. Returns how many
        processes were alive to kill."""
        self.scan()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for _ in range(60):
            left = {p for p in self.tree if alive_own(p)}
            if not left:
                break
            signal_own(left, signal.SIGKILL)
            time.sleep(0.5)
        self._reader.join(timeout=5)
        return len(self.tree) + 1


def read_workers(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "workers.json").read_text())
    except (OSError, ValueError):
        return None


def attempt_records(client, workers: list[dict], token: str) -> list[dict]:
    """The call attempts the workers' engines have a record of (their control API), one page
    per worker: a few calls here, far below a page (paging on would chase the live records)."""
    from rollout_recovery.generation.control import MAX_ATTEMPTS_PAGE

    out = []
    for w in workers:
        resp = client.get(f"{w['url']}/control/v1/call-attempts",
                          params={"since": 0, "limit": MAX_ATTEMPTS_PAGE},
                          headers={"Authorization": f"Bearer {token}"})  # fmt: skip
        resp.raise_for_status()
        out += resp.json()["attempts"]
    return out


def watch_first_token(job: Job, run_dir: Path, token: str, old_session: str | None,
                      resumed: bool, poll: float, timeout: float) -> dict:  # fmt: skip
    """Poll until a call attempt of this job's workers has decoded a token (`resumed`: one
    its worker resumed from a prefix). Times are seconds since the job's launch; a milestone
    is timed at the end of the poll that saw it, and `*_after_s` is the start of the poll
    before (it happened between the two)."""
    import httpx

    out: dict = {"workers_json_s": None, "first_request_s": None, "first_token_s": None}
    deadline = time.monotonic() + timeout
    workers, polls, prev_start = None, [], None
    with httpx.Client(timeout=10) as client:
        while time.monotonic() < deadline and job.proc.poll() is None:
            start = time.monotonic() - job.t0
            if workers is None:
                info = read_workers(run_dir)
                if info and info.get("session") != old_session:
                    workers = info["workers"]
                    seen = time.monotonic() - job.t0
                    out |= {"workers_json_s": seen, "workers_json_after_s": prev_start,
                            "session": info["session"]}  # fmt: skip
            else:
                try:
                    recs = attempt_records(client, workers, token)
                except Exception:
                    recs = []
                end = time.monotonic() - job.t0
                polls.append(end - start)
                mine = [r for r in recs if r["resume"] == "resumed"] if resumed else recs
                if mine and out["first_request_s"] is None:
                    out |= {"first_request_s": end, "first_request_after_s": prev_start}
                hit = [r for r in mine if r["decoded_tokens"] > 0]
                if hit:
                    out |= {"first_token_s": end, "first_token_after_s": prev_start,
                            "record": hit[0]}  # fmt: skip
                    break
            prev_start = start
            time.sleep(poll)
    if polls:
        out["poll_read_s_median"] = med(polls)
        out["polls"] = len(polls)
    return out


def recoverable_cuts(snapshot_uri: str, limit: int) -> int:
    from rollout_recovery.data_plane import StagingStore

    ledger = json.loads(StagingStore.read_sidecar(snapshot_uri, "ledger.json"))
    return sum(1 for c in ledger["continuations"].values() if 0 < c.get("tokens", 0) < limit)


def bench_restart(args, workdir: Path) -> dict:
    import secrets

    from rollout_recovery.data_plane import StagingStore
    from rollout_recovery.data_plane.snapshot_io import published_uris

    run_dir = workdir / "restart-run"
    token = secrets.token_urlsafe(16)
    cli = [str(REPO / ".venv" / "bin" / "rollout-recovery"), "train"]
    cfg = ["--config", str(REPO / "configs" / "prefix_recovery.yaml"),
           f"checkpointing.checkpoint_dir={run_dir}", "grpo.steps=2",
           "grpo.prompts_per_step=2", "grpo.generations_per_prompt=4",
           f"policy.generation.max_new_tokens={args.s5_tokens}",
           f"rollout_checkpointing.snapshot_attempt_interval_s={args.s5_interval}",
           "rollout_checkpointing.keep_latest_k=4",
           f"token_capture.control_auth_token={token}"]  # fmt: skip
    out: dict = {"tokens_per_call": args.s5_tokens, "interval_s": args.s5_interval,
                 "poll_s": args.poll}  # fmt: skip
    first = Job([*cli, *cfg], workdir / "restart-phase1.log")
    try:
        cold = watch_first_token(first, run_dir, token, None, False, args.poll, args.s5_timeout)
        out["fresh"] = cold | {"ray_started_s": first.first_line("Started a local Ray")}
        deadline = time.monotonic() + args.s5_timeout
        chosen = None
        while chosen is None and time.monotonic() < deadline and first.proc.poll() is None:
            first.scan()
            with contextlib.suppress(Exception):
                uris = published_uris(str(run_dir / "data_plane"))
                if uris and recoverable_cuts(uris[-1], args.s5_tokens) >= args.s5_cuts:
                    chosen = uris[-1]
            time.sleep(0.1)
        if chosen is None:
            out["error"] = "no snapshot with enough recoverable cuts before the run ended"
            return out
        first.proc.send_signal(signal.SIGSTOP)  # nothing newer gets published meanwhile
        os.killpg(first.proc.pid, signal.SIGSTOP)
        newest = published_uris(str(run_dir / "data_plane"))[-1]
        made = StagingStore.manifest(newest).body.created_at
        out["killed"] = {"snapshot": newest,
                         "recoverable_cuts": recoverable_cuts(newest, args.s5_tokens),
                         "snapshot_age_at_kill_s":
                             time.time() - datetime.fromisoformat(made).timestamp(),
                         "run_s": time.monotonic() - first.t0}  # fmt: skip
    finally:
        out["processes_killed"] = first.kill()
    session = (read_workers(run_dir) or {}).get("session")
    second = Job([*cli, "--restore", *cfg], workdir / "restart-phase2.log")
    try:
        res = watch_first_token(second, run_dir, token, session, True, args.poll,
                                args.s5_timeout)  # fmt: skip
        res["ray_started_s"] = second.first_line("Started a local Ray")
        res["snapshot_selected_s"] = second.first_line("Selected rollout recovery snapshot")
        res["exit_code"] = second.proc.poll()
        out["restore"] = res
    finally:
        second.kill()
    return out


# ---------------------------------------------------------------------- report


def print_live(rows: list[dict], args) -> None:
    print(f"\n(1) checkpoint cost vs calls in flight: tiny model on CPU, level prefix, each call "
          f"{args.call_tokens} tokens; ms, median of the attempts with >= "
          f"{IN_FLIGHT_SHARE:.0%} of the calls in flight ({args.attempts} per configuration, "
          f"{args.gap} s apart, after a warm-up one); `at engines`: requests the engines "
          "hold (running or queued)")  # fmt: skip
    headers = [
        "workers",
        "calls",
        "in flight",
        "at engines",
        "cut",
        "not cut",
        "n",
        "fence p50",
        "p99",
        "max",
        "cut",
        "commit",
        "freeze",
        "snapshot",
        "total",
    ]
    table, notes = [], []
    for r in rows:
        if "fence_hold_s_median" not in r:
            notes.append(f"  {r['workers']} worker(s), {r['calls']} calls: {r['status']}")
            table.append([str(r["workers"]), str(r["calls"]), *["-"] * 13])
            continue
        not_cut = ", ".join(f"{k} {v:g}" for k, v in sorted(r["calls_not_cut_median"].items())
                            if v)  # fmt: skip
        table.append([
            str(r["workers"]), str(r["calls"]), cell(r["in_flight_median"], ".0f"),
            str(r.get("at_engines", "-")), cell(r["calls_cut_median"], ".0f"), not_cut or "0",
            str(r["attempts_counted"]),
            *(cell(ms(r.get(k)), ".1f") for k in ("fence_hold_s_median", "fence_hold_s_p99",
                                                  "fence_hold_s_max", "cut_s_median",
                                                  "commit_s_median", "freeze_s_median",
                                                  "snapshot_s_median", "save_s_median")),
        ])  # fmt: skip
    print_rows(headers, table)
    for n in notes:
        print(n)
    print(f"  each engine's scheduler runs at most {ENGINE_MAX_SEQS} sequences (vLLM's CPU "
          "default; vllm_cfg has no max_num_seqs): a call it queued is in flight with 0 tokens "
          f"and not cut (zero_generated_tokens); {args.attempts} attempts: p99 ~ max")  # fmt: skip


def print_snapshots(s: dict) -> None:
    print(f"\n(2) snapshot vs store size, full vs incremental: chunk rows of {s['row_tokens']} "
          f"tokens, {s['shards']} shard(s); medians of the repeats; MB written = the "
          "snapshot's own directory (files, sidecars, manifest); restore = the last "
          "incremental (its whole chain) or full snapshot into a fresh store")  # fmt: skip
    headers = ["store rows", "changed", "full s", "full MB", "incr s", "incr MB", "incr rows",
               "incr/full s", "restore full s", "restore incr s"]  # fmt: skip

    def line(r: dict, restore: bool) -> list[str]:
        return [f"{r['store_rows']:,}", f"{r['changed']:,}", cell(r["full_s"], ".3f"),
                cell(r["full_bytes"] / MB, ".1f"), cell(r["incr_s"], ".3f"),
                cell(r["incr_bytes"] / MB, ".2f"), cell(r["incr_rows_written"], ",.0f"),
                cell(ratio(r["incr_s"], r["full_s"]), ".3f"),
                cell(r["restore_full"]["seconds"], ".3f") if restore else "",
                cell(r["restore_incremental"]["seconds"], ".3f") if restore else ""]  # fmt: skip

    print_rows(headers, [line(r, True) for r in s["by_size"]]
               + [line(r, False) for r in s["by_changed"] if r["changed"] != s["by_size"][0]
                  ["changed"]])  # fmt: skip
    bad = [r for r in s["by_size"] + s["by_changed"] if not r["incremental_was_incremental"]]
    for r in bad:
        print(f"  note: at {r['store_rows']:,} rows / {r['changed']:,} changed an 'incremental' "
              "snapshot came out full (no base)")  # fmt: skip
    for r in s["by_size"]:
        for kind in ("restore_full", "restore_incremental"):
            if not r[kind]["rows_ok"]:
                print(f"  FAIL: {kind} at {r['store_rows']:,} rows restored {r[kind]['rows']} "
                      f"rows, expected {r['live_rows']}")  # fmt: skip


def print_shards(s: dict) -> None:
    print(f"\n(3) store put/get over shards: {s['rows']:,} rows x {s['row_tokens']} tokens in "
          f"{s['batch_rows']:,}-row batches, {s['clients']} at once (async API, one client "
          "process); rows/s, median of the repeats")  # fmt: skip
    print_rows(
        ["shards", "put rows/s", "put vs 1", "get rows/s", "get vs 1"],
        [
            [
                str(r["shards"]),
                f"{r['put_rows_s']:,.0f}",
                f"{r['put_vs_1']:.2f}",
                f"{r['get_rows_s']:,.0f}",
                f"{r['get_vs_1']:.2f}",
            ]
            for r in s["by_shards"]
        ],
    )


def print_decode(s: dict) -> None:
    print(f"\n(4) decode throughput vs checkpoint interval: 1 worker, {s['calls']} tally "
          f"episodes x {s['tokens_per_call']} tokens per round; tokens/s median; vs off: "
          "median of per-cycle ratios; expected loss per crash = rate x mean age of the "
          "newest published snapshot over the round")  # fmt: skip
    print_rows(["interval", "tokens/s", "vs off", "snapshots/round", "round s", "mean age s",
                "exp. tokens lost", "fence ms"],
               [[r["interval"], cell(r["tok_s_median"], ",.0f"), cell(r["ratio_vs_off"], ".3f"),
                 cell(r["snapshots_per_round"], ".1f"), cell(r["round_s_median"], ".1f"),
                 cell(r["mean_age_s_median"], ".2f"),
                 cell(r["expected_tokens_lost_median"], ",.0f"),
                 cell(r["fence_hold_ms_median"], ".1f")] for r in s["summary"]])  # fmt: skip


def print_restart(s: dict) -> None:
    print(f"\n(5) restart to first resumed token after a whole-job kill (prefix_recovery.yaml, "
          f"{s['tokens_per_call']} tokens per call, snapshot every {s['interval_s']:g} s); "
          f"seconds from launch, polled every {s['poll_s']:g} s")  # fmt: skip
    if "error" in s:
        print(f"  {s['error']}")
    k = s.get("killed")
    if k:
        print(f"  killed {s['processes_killed']} processes {k['run_s']:.1f} s after launch, "
              f"newest snapshot {k['snapshot_age_at_kill_s']:.2f} s old with "
              f"{k['recoverable_cuts']} recoverable cuts")  # fmt: skip
    fresh, rest = s.get("fresh", {}), s.get("restore", {})
    rows = [
        ("snapshot chosen (files only, before Ray)", None, rest.get("snapshot_selected_s")),
        ("Ray started", fresh.get("ray_started_s"), rest.get("ray_started_s")),
        ("workers.json (store, workers, environment up)", fresh.get("workers_json_s"),
         rest.get("workers_json_s")),
        ("first (resumed) request at a worker", fresh.get("first_request_s"),
         rest.get("first_request_s")),
        ("first (resumed) token", fresh.get("first_token_s"), rest.get("first_token_s")),
    ]  # fmt: skip
    print_rows(
        ["milestone", "fresh start s", "restore s"],
        [[m, cell(a, ".1f"), cell(b, ".1f")] for m, a, b in rows],
    )
    for name, r in (("fresh start", fresh), ("restore", rest)):
        if r.get("first_token_s") is not None:
            print(f"  {name}: first token between {cell(r.get('first_token_after_s'), '.2f')} "
                  f"and {r['first_token_s']:.2f} s ({r.get('polls')} polls, median read "
                  f"{cell(ms(r.get('poll_read_s_median')), '.0f')} ms, then "
                  f"{s['poll_s']:g} s sleep)")  # fmt: skip
    rec = rest.get("record")
    if rec:
        print(f"  first resumed attempt: {rec['rollout_id']}/{rec['model_call_id']} attempt "
              f"{rec['attempt']}, prefix {rec['prefix_tokens']} tokens spliced, "
              f"{rec['decoded_tokens']} decoded when seen")  # fmt: skip


def summarize(live, snaps, shards, decode, restart) -> dict:
    s: dict = {}
    for r in live or []:
        if r["calls"] == 256 and r.get("fence_hold_s_median") is not None:
            s[f"fence_ms_256_w{r['workers']}"] = ms(r["fence_hold_s_median"])
    if snaps:
        by = snaps["by_size"]
        s["incr_size_ratio"] = ratio(by[-1]["incr_s"], by[0]["incr_s"])
        s["full_size_ratio"] = ratio(by[-1]["full_s"], by[0]["full_s"])
        bc = sorted(snaps["by_changed"], key=lambda r: r["changed"])
        s["incr_changed_ratio"] = ratio(bc[-1]["incr_s"], bc[0]["incr_s"])
        s["full_changed_ratio"] = ratio(bc[-1]["full_s"], bc[0]["full_s"])
    if shards:
        for r in shards["by_shards"]:
            s[f"put_vs_1_shards{r['shards']}"] = r["put_vs_1"]
            s[f"get_vs_1_shards{r['shards']}"] = r["get_vs_1"]
    if decode:
        for r in decode["summary"]:
            if r["interval_s"] == 1.0:
                s["decode_ratio_1s"] = r["ratio_vs_off"]
    if restart and restart.get("restore"):
        s["restart_to_first_resumed_token_s"] = restart["restore"].get("first_token_s")
        s["fresh_to_first_token_s"] = restart.get("fresh", {}).get("first_token_s")
    return s


# ---------------------------------------------------------------------- main


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _intervals(text: str) -> list[float | None]:
    out: list[float | None] = []
    for x in text.split(","):
        x = x.strip()
        if x:
            out.append(None if x == "off" else float(x))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--sections", default="1,2,3,4,5", help="which sections to run")
    ap.add_argument("--dir", default=None, help="scratch directory (snapshots, runs)")
    ap.add_argument("--workers", default="1,2,4", help="(1) worker counts")
    ap.add_argument("--calls", default="8,64,256,1024", help="(1) calls in flight")
    ap.add_argument("--attempts", type=int, default=6, help="(1) measured attempts each")
    ap.add_argument("--gap", type=float, default=0.5, help="(1) s between attempts")
    ap.add_argument("--call-tokens", type=int, default=1900, help="(1) tokens per call")
    ap.add_argument("--settle-s", type=float, default=60.0,
                    help="(1) most s to wait for the engines to hold their calls")  # fmt: skip
    ap.add_argument("--kv-mb", type=int, default=512, help="(1, 4) KV cache MiB per worker")
    ap.add_argument("--worker-gb", type=float, default=2.5,
                    help="(1) memory one worker takes besides its KV cache, GiB")  # fmt: skip
    ap.add_argument("--store-sizes", default="10000,100000,1000000", help="(2) store rows")
    ap.add_argument("--changed-rows", type=int, default=1000, help="(2) rows changed per size")
    ap.add_argument("--changed", default="1000,10000,100000",
                    help="(2) rows changed at the largest size")  # fmt: skip
    ap.add_argument("--row-tokens", type=int, default=32, help="(2, 3) tokens per chunk row")
    ap.add_argument("--snap-shards", type=int, default=1, help="(2) store shards")
    ap.add_argument("--snap-repeats", type=int, default=3, help="(2) repeats per row")
    ap.add_argument("--shards", default="1,2,4", help="(3) shard counts")
    ap.add_argument("--store-rows", type=int, default=200_000, help="(3) rows put and got")
    ap.add_argument("--batch-rows", type=int, default=1000, help="(3) rows per batch")
    ap.add_argument("--clients", type=int, default=8, help="(3) batches in flight at once")
    ap.add_argument("--store-repeats", type=int, default=3, help="(3) repeats")
    ap.add_argument("--intervals", default="off,30,10,5,2,1,0.5", help="(4) intervals, s")
    ap.add_argument("--s4-calls", type=int, default=64, help="(4) episodes per round")
    ap.add_argument("--s4-tokens", type=int, default=512, help="(4) tokens per call")
    ap.add_argument("--s4-rounds", type=int, default=3, help="(4) cycles over the intervals")
    ap.add_argument("--s5-tokens", type=int, default=600, help="(5) tokens per call")
    ap.add_argument("--s5-interval", type=float, default=2.0, help="(5) snapshot interval s")
    ap.add_argument("--s5-cuts", type=int, default=4, help="(5) recoverable cuts to wait for")
    ap.add_argument("--s5-timeout", type=float, default=300.0, help="(5) most s per phase")
    ap.add_argument("--poll", type=float, default=0.1, help="(5) polling period s")
    ap.add_argument("--quick", action="store_true",
                    help="1-2 workers x 8-256 calls, 10k/100k rows, fewer intervals and "
                         "rounds (about 5 minutes here)")  # fmt: skip
    args = ap.parse_args()
    if args.quick:  # new defaults: options given explicitly still win
        ap.set_defaults(
            workers="1,2",
            calls="8,64,256",
            attempts=3,
            store_sizes="10000,100000",
            changed="1000,10000",
            snap_repeats=2,
            store_rows=50_000,
            store_repeats=2,
            intervals="off,5,1,0.5",
            s4_rounds=1,
            s4_tokens=256,
        )
        args = ap.parse_args()
    mark_this_check()  # the runs it kills carry it (functional_tests/processes.py)
    t0 = time.perf_counter()
    load_start = os.getloadavg()
    args.sections = set(_ints(args.sections))
    args.worker_list, args.call_list = _ints(args.workers), _ints(args.calls)
    args.size_list, args.changed_list = sorted(_ints(args.store_sizes)), _ints(args.changed)
    args.shard_list, args.interval_list = _ints(args.shards), _intervals(args.intervals)
    if 4 in args.sections and 1 not in args.worker_list:
        args.worker_list = [1, *args.worker_list]  # section 4 runs in the 1-worker stack
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")

    import ray

    from rollout_recovery.runtime import init_ray

    workdir = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=args.dir))
    live = snaps = shards = decode = restart = None
    errors: dict[str, str] = {}

    def guarded(section: str, fn, *fn_args):
        """A section's result; one that raises is reported (and the others still run)."""
        try:
            return fn(*fn_args)
        except Exception as err:
            errors[section] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            print(f"  [{section}] failed: {errors[section]}", flush=True)
            return None

    try:
        if args.sections & {1, 2, 3, 4}:
            init_ray("local", num_cpus=max(8, 2 * max(args.worker_list)), log_to_driver=False)
        if args.sections & {1, 4}:
            if 1 not in args.sections:
                args.call_list, args.worker_list = [], [1]
            live, decode = guarded("1", bench_live, args, workdir, errors) or (None, None)
            if 1 not in args.sections:
                live = None
        if 2 in args.sections:
            snaps = guarded("2", bench_snapshots, args, workdir)
        if 3 in args.sections:
            shards = guarded("3", bench_shards, args)
        if ray.is_initialized():
            ray.shutdown()
        if 5 in args.sections:
            restart = guarded("5", bench_restart, args, workdir)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        logs = {p.name: p.read_text()[-4000:] for p in workdir.glob("*.log")}
        shutil.rmtree(workdir, ignore_errors=True)

    if live:
        print_live(live, args)
    if snaps:
        print_snapshots(snaps)
    if shards:
        print_shards(shards)
    if decode:
        print_decode(decode)
    if restart:
        print_restart(restart)
    for section, why in sorted(errors.items()):
        print(f"\n({section}) FAILED: {why}")
    summary = summarize(live, snaps, shards, decode, restart)
    if snaps:
        print(f"\nincremental s, largest / smallest store (same {args.changed_rows:,} rows "
              f"changed): {cell(summary['incr_size_ratio'], '.2f')}; full: "
              f"{cell(summary['full_size_ratio'], '.2f')}; incremental s, most / fewest rows "
              f"changed (at {args.size_list[-1]:,}): {cell(summary['incr_changed_ratio'], '.2f')}"
              f"; full: {cell(summary['full_changed_ratio'], '.2f')}")  # fmt: skip
    skipped = frozenset(k for k, sec in SECTION_OF_TARGET.items() if sec not in args.sections)
    skipped |= frozenset(f"fence_ms_256_w{w}" for w in (1, 2, 4)
                         if w not in args.worker_list or 256 not in args.call_list)  # fmt: skip
    verdicts = check_targets(TARGETS, summary, skipped)
    print_targets(verdicts)
    ok = targets_ok(verdicts)
    print("all targets met" if ok else "a target was missed or not measured: exit status 1")
    wall_s = time.perf_counter() - t0
    load_end = os.getloadavg()
    print(f"ran in {wall_s:.0f} s; load average (1, 5, 15 min) at start "
          f"{', '.join(f'{x:.1f}' for x in load_start)}, at the end "
          f"{', '.join(f'{x:.1f}' for x in load_end)} (2 cores, shared)")  # fmt: skip
    args_out = {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()}
    write_result(args.json, {
        "args": args_out,
        "summary": summary,
        "targets": verdicts,
        "targets_met": ok,
        "checkpoint_vs_calls": live,
        "snapshot_vs_store_size": snaps,
        "store_shards": shards,
        "decode_vs_interval": decode,
        "restart": restart,
        "errors": errors,
        "restart_logs_tail": logs,
        "wall_s": wall_s,
        "load_average": {"start": load_start, "end": load_end},
    })  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
