"""GenerationWorker on a real local Ray with the real vLLM CPU engine."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
import ray

from rollout_recovery.generation import WorkerPool
from rollout_recovery.generation.engine_setup import engine_env
from tests.engine.offline_common import run_offline

pytestmark = pytest.mark.engine

HERE = Path(__file__).resolve().parent
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


def _chat(url: str, *, max_tokens: int = 24, messages=MESSAGES, **extra) -> dict:
    body = {
        "model": "policy",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": True,
        "return_token_ids": True,
        **extra,
    }
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _wait_gone(pids: list[int], timeout_s: float = 15.0) -> list[int]:
    """Pids still alive (zombies count as gone) after waiting up to timeout_s."""
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.2)
    return alive


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_workers_report_url_and_health(two_workers):
    urls = {w.info.url for w in two_workers}
    assert len(urls) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls)
    for w in two_workers:
        health = w.health()
        assert health.healthy and health.url == w.info.url
        assert httpx.get(f"{w.info.url}/health", timeout=10).status_code == 200
        models = httpx.get(f"{w.info.url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["policy"]
        assert w.info.engine_pids, "the EngineCore runs as a child process"


def test_engine_determinism_env_is_applied(two_workers, tiny_cfg):
    info = two_workers[0].info
    env = psutil.Process(info.pid).environ()
    for key, value in engine_env(tiny_cfg).items():
        assert env.get(key) == value, key
    engine = [p for p in info.engine_pids if "EngineCore" in " ".join(psutil.Process(p).cmdline())]
    assert engine, "an EngineCore child process"
    assert psutil.Process(engine[0]).environ().get("OMP_NUM_THREADS") == "1"


def test_greedy_chat_equals_offline_generation(two_workers, tiny_cfg, tiny_model_dir):
    from transformers import AutoTokenizer

    n = 32
    out = _chat(two_workers[0].info.url, max_tokens=n, ignore_eos=True)
    choice = out["choices"][0]
    prompt_ids = out["prompt_token_ids"]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert prompt_ids == tok(rendered)["input_ids"]
    http_ids = choice["token_ids"]
    http_lps = [c["logprob"] for c in choice["logprobs"]["content"]]
    assert len(http_ids) == n and len(http_lps) == n

    request = {"model": str(tiny_model_dir), "prompt_token_ids": prompt_ids, "max_tokens": n}
    ref = run_offline("offline_reference.py", request, tiny_cfg)
    assert http_ids == ref["token_ids"]
    # Same weights, same single-request batch shape, one OpenMP thread: bit-identical.
    assert http_lps == ref["logprobs"]
    # vLLM holds back a trailing incomplete UTF-8 character; decode() renders it as U+FFFD.
    text, content = tok.decode(http_ids), choice["message"]["content"]
    assert text.startswith(content) and set(text[len(content) :]) <= {"\ufffd"}


def test_two_workers_serve_at_once_with_identical_greedy_output(two_workers):
    with ThreadPoolExecutor(4) as pool:
        outs = list(
            pool.map(lambda w: _chat(w.info.url, max_tokens=16), [*two_workers, *two_workers])
        )
    ids = [o["choices"][0]["token_ids"] for o in outs]
    assert all(i == ids[0] for i in ids)
    assert len({w.info.pid for w in two_workers}) == 2


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{not json", 400),
        (json.dumps({"model": "policy"}).encode(), 400),
        (json.dumps({"model": "policy", "messages": "hello"}).encode(), 400),
        (json.dumps({"model": "nope", "messages": MESSAGES}).encode(), 404),
        (
            json.dumps({"model": "policy", "messages": MESSAGES, "max_tokens": -3}).encode(),
            400,
        ),
        (
            json.dumps({"model": "policy", "messages": MESSAGES, "max_tokens": 10**6}).encode(),
            400,
        ),
    ],
)
def test_malformed_request_is_rejected_and_next_is_served(two_workers, body, status):
    url = two_workers[1].info.url
    resp = httpx.post(
        f"{url}/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert 400 <= resp.status_code < 500
    assert resp.status_code in (status, 422), resp.text
    assert "error" in resp.json() or "detail" in resp.json()
    assert _chat(url, max_tokens=4)["choices"][0]["token_ids"]
    assert two_workers[1].health().healthy


def test_killed_worker_leaves_no_process(ray_session, tiny_cfg):
    [worker] = WorkerPool.start(tiny_cfg, num_workers=1)
    pids = [worker.info.pid, *worker.info.engine_pids]
    assert all(_alive(p) for p in pids)
    ray.kill(worker.actor)  # no graceful shutdown: Ray and PDEATHSIG must clean up
    assert _wait_gone(pids) == []


def test_graceful_stop_leaves_no_process(ray_session, tiny_cfg):
    pool = WorkerPool.start(tiny_cfg, num_workers=1)
    worker = pool[0]
    pids = [worker.info.pid, *worker.info.engine_pids]
    pool.stop()
    assert _wait_gone(pids) == []


def test_ray_shutdown_leaves_no_process(tiny_model_dir, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(
        "import json, sys, ray\n"
        "from rollout_recovery.config import load_config\n"
        "from rollout_recovery.generation import WorkerPool\n"
        "from rollout_recovery.runtime import init_ray\n"
        "if __name__ == '__main__':\n"
        f"    cfg = load_config(None, ['policy.model_path={tiny_model_dir}'])\n"
        "    init_ray('local', num_cpus=2, log_to_driver=False)\n"
        "    [w] = WorkerPool.start(cfg, num_workers=1)\n"
        "    print('PIDS ' + json.dumps([w.info.pid, *w.info.engine_pids]), flush=True)\n"
        "    ray.shutdown()\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PIDS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    pids = json.loads(lines[0].removeprefix("PIDS "))
    assert len(pids) >= 2
    assert _wait_gone(pids) == []
