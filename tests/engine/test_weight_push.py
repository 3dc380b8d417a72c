"""Pushing new weights into a running worker: the engine then serves exactly those weights."""

from __future__ import annotations

import re
import shutil

import httpx
import pytest
import ray
import torch
from safetensors.torch import load_file, save_file

from rollout_recovery.data_plane.schemas import table_to_terminal_rows
from tests.engine.offline_common import run_offline

pytestmark = pytest.mark.engine
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


def _chat(url: str, **xargs) -> dict:
    body = {"model": "policy", "messages": MESSAGES, "max_tokens": 16, "temperature": 0.0,
            "ignore_eos": True, "logprobs": True, "return_token_ids": True}  # fmt: skip
    if xargs:
        body["vllm_xargs"] = xargs
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _variant(src, dst, edit) -> str:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def test_push_serves_new_weights_refuses_bad_ones_and_tags_versions(
    capture_worker, tiny_model_dir, tiny_cfg, tmp_path
):
    worker, store = capture_worker
    url = worker.info.url
    before = _chat(url)

    def perturb(t):
        gen = torch.Generator().manual_seed(7)
        t["lm_head.weight"] *= 1.5
        w = t["model.layers.1.mlp.down_proj.weight"]
        w += 0.05 * torch.randn(w.shape, generator=gen)

    new_dir = _variant(tiny_model_dir, tmp_path / "v1", perturb)
    assert worker.push_weights(new_dir, 1) == 1
    after = _chat(url)
    prompt = after["prompt_token_ids"]
    ref = run_offline(
        "offline_reference.py",
        {"model": new_dir, "prompt_token_ids": prompt, "max_tokens": 16},
        tiny_cfg,
    )
    assert after["choices"][0]["token_ids"] == ref["token_ids"]
    lps = [c["logprob"] for c in after["choices"][0]["logprobs"]["content"]]
    assert lps == ref["logprobs"]
    assert after["choices"][0]["token_ids"] != before["choices"][0]["token_ids"]

    # Bad pushes change nothing: a missing tensor, a wrong shape, an old version.
    missing = _variant(tiny_model_dir, tmp_path / "bad1", lambda t: t.pop("lm_head.weight"))
    wrong = _variant(
        tiny_model_dir, tmp_path / "bad2",
        lambda t: t.__setitem__("model.norm.weight", torch.ones(3)),
    )  # fmt: skip
    with pytest.raises(ray.exceptions.RayTaskError, match=re.escape("missing ['lm_head.weight']")):
        worker.push_weights(missing, 2)
    with pytest.raises(ray.exceptions.RayTaskError, match=re.escape("model.norm.weight")):
        worker.push_weights(wrong, 2)
    with pytest.raises(ray.exceptions.RayTaskError, match="must be newer"):
        worker.push_weights(new_dir, 1)
    assert worker.health().healthy
    assert _chat(url)["choices"][0]["token_ids"] == after["choices"][0]["token_ids"]

    # Tokens generated now carry weight version 1.
    _chat(url, rr_rollout_id="wv", rr_model_call_id="c0")
    worker.drain()
    table, missing_keys = store.get("rollout_terminal", ["wv/c0/a0/terminal"])
    assert not missing_keys
    [row] = table_to_terminal_rows(table)
    assert row.weight_versions == [(1, 0, 16)]

    # Pushing the original weights back restores the original answers exactly.
    assert worker.push_weights(str(tiny_model_dir), 2) == 2
    assert _chat(url)["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]


def test_weights_pushed_in_flight_are_recorded_per_token_for_the_caller_and_the_store(
    capture_worker, tiny_model_dir, tmp_path
):
    """A push while a call decodes: the call goes on (paused, its KV recomputed on the new
    weights), and its response header and its terminal row both record which tokens each
    version sampled, split where the push landed (token k). Where k falls is timing; what the
    call then decodes is not: the same call cut at k and resumed from its prefix on the new
    weights decodes the same tokens with the same logprobs, bit for bit. So a schedule of
    weight switches at fixed token counts, run as cuts and resumes, reproduces an in-flight
    update exactly (docs/async_grpo.md)."""
    import threading
    import time

    from rollout_recovery.protocol import WEIGHT_VERSIONS_HEADER, decode_spans
    from tests.engine.test_resume import _body, _stage

    worker, store = capture_worker
    url = worker.info.url
    version = worker.health().weight_version + 1
    body = _body("inflight", max_tokens=400, ignore_eos=True)
    out: dict = {}
    call = threading.Thread(target=lambda: out.update(
        resp=httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)))  # fmt: skip
    call.start()
    deadline = time.monotonic() + 60
    while True:  # the engine's own count: the call has decoded tokens and has not finished
        records = {r["rollout_id"]: r for r in worker.call_attempts(0)["attempts"]}
        rec = records.get("inflight")
        if rec and rec["decoded_tokens"] >= 8:
            break
        assert time.monotonic() < deadline and call.is_alive(), "the call never got going"
        time.sleep(0.005)
    assert not rec["finished"], "the call finished before the push: make it longer"
    pushed = _variant(tiny_model_dir, tmp_path / "inflight", lambda t: t["lm_head.weight"].mul_(2))
    worker.push_weights(pushed, version)
    call.join(120)
    resp = out["resp"]
    assert resp.status_code == 200, resp.text
    spans = decode_spans(resp.headers[WEIGHT_VERSIONS_HEADER])
    [(old, s0, k), (new, k1, n)] = spans
    assert (s0, k1, n, new) == (0, k, 400, version) and old < new and 8 <= k < 400
    worker.drain()
    table, _ = store.get("rollout_terminal", ["inflight/c0/a0/terminal"])
    [row] = table_to_terminal_rows(table)
    assert row.weight_versions == spans

    # The schedule replayed: cut at k (staged as sampled by the old version), resumed on the new.
    answer = resp.json()
    cont = _stage(store, "inflight-replay", answer, k, version=old)
    replay = httpx.post(
        f"{url}/v1/chat/completions",
        timeout=120,
        json=_body("inflight-replay", 1, cont, max_tokens=400, ignore_eos=True),
    )
    assert replay.status_code == 200, replay.text
    got, want = replay.json()["choices"][0], answer["choices"][0]
    assert got["token_ids"] == want["token_ids"]
    logprobs = [[c["logprob"] for c in x["logprobs"]["content"]] for x in (got, want)]
    assert logprobs[0] == logprobs[1]
    assert decode_spans(replay.headers[WEIGHT_VERSIONS_HEADER]) == spans
    assert worker.push_weights(str(tiny_model_dir), version + 1) == version + 1


def test_a_resumed_call_keeps_its_prefix_versions(capture_worker):
    """A call resumed from a prefix two older versions sampled: its response and terminal row
    record those versions for the prefix's tokens and the worker's own for the tail."""
    from rollout_recovery.protocol import WEIGHT_VERSIONS_HEADER, decode_spans
    from tests.engine.test_resume import _body, _stage

    worker, store = capture_worker
    url = worker.info.url
    current = worker.health().weight_version
    assert current >= 2, "runs after the pushes above"
    ref = httpx.post(f"{url}/v1/chat/completions", json=_body("spans-ref", ignore_eos=True),
                     timeout=120).json()  # fmt: skip
    cont = _stage(store, "spans-res", ref, 10, split=4, version=current - 2)
    resp = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                      json=_body("spans-res", 1, cont, ignore_eos=True))  # fmt: skip
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    spans = decode_spans(resp.headers[WEIGHT_VERSIONS_HEADER])
    assert spans == [(current - 2, 0, 4), (current - 1, 4, 10), (current, 10, 48)]
    worker.drain()
    table, _ = store.get("rollout_terminal", ["spans-res/c0/a1/terminal"])
    assert table_to_terminal_rows(table)[0].weight_versions == spans
