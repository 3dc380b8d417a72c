"""The worker's control routes and request gate against hostile or malformed input."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from rollout_recovery.generation.control import MAX_CONTROL_BODY_BYTES as LIMIT
from rollout_recovery.generation.fence import MAX_EPOCH_ADVANCE
from tests.engine.test_resume import _body

pytestmark = pytest.mark.engine
MiB = 2**20


def _control(worker, route: str) -> str:
    return f"{worker.info.url}/control/v1/{route}"


def _auth(worker) -> dict[str, str]:
    return {"Authorization": f"Bearer {worker.control_token}"}


def _inventory_bytes(n: int) -> Iterator[bytes]:
    """A valid cut inventory of `n` unknown calls, in pieces (httpx sends it chunked)."""
    yield b'{"checkpoint_id": "chunked", "calls": ['
    for i in range(n):
        call = f'{{"rollout_id": "nobody-{i}", "model_call_id": "c"}}'
        yield (b"," if i else b"") + call.encode()
    yield b"]}"


def test_unauthenticated_bodies_are_refused_before_they_are_read(capture_worker):
    worker, _ = capture_worker
    proc = psutil.Process(worker.info.pid)
    call = b'{"rollout_id": "r", "model_call_id": "c"},'
    valid = b'{"checkpoint_id": "x", "calls": [' + call * (50 * MiB // len(call)) + b"{}]}"
    malformed = b'{"checkpoint_id": "' + b"x" * (50 * MiB)
    json_type = {"content-type": "application/json"}
    no_token, bad_token = json_type, json_type | {"Authorization": "Bearer wrong"}
    attempts = [(malformed, no_token), (valid, bad_token), (valid, no_token)] * 2
    attempts.append((malformed, bad_token))
    before = proc.memory_info().rss
    results = []
    with httpx.Client(timeout=120) as client:
        for body, headers in attempts:
            t0 = time.monotonic()
            r = client.post(_control(worker, "generation-cut"), content=body, headers=headers)
            results.append((r.status_code, round(time.monotonic() - t0, 2), r.text[:120]))
    grown = proc.memory_info().rss - before
    print(f"worker RSS {before / MiB:.0f} MiB -> {(before + grown) / MiB:.0f} MiB; {results}")
    assert [status for status, _, _ in results] == [401] * 7, results
    assert all("bearer token" in text for _, _, text in results), results
    assert all(elapsed < 15 for _, elapsed, _ in results), results
    assert grown < 100 * MiB, f"worker RSS grew by {grown / MiB:.0f} MiB"
    r = httpx.post(_control(worker, "no-such-route"), content=b"{}", timeout=30)
    assert r.status_code == 401, "the token is checked before routing"


def test_authenticated_bodies_over_the_limit_get_413(capture_worker):
    worker, _ = capture_worker
    auth = _auth(worker)
    route = _control(worker, "generation-cut")
    r = httpx.post(route, content=b" " * (LIMIT + 1), headers=auth, timeout=60)
    assert r.status_code == 413, (r.status_code, r.text[:300])
    assert str(LIMIT) in r.json()["error"]["message"]

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit is enforced while reading
        for _ in range(4 * LIMIT // (64 * 1024)):
            yield b" " * (64 * 1024)

    r = httpx.post(route, content=chunked(), headers=auth, timeout=60)
    assert r.status_code == 413, (r.status_code, r.text[:300])
    # Normal authenticated requests, chunked or not, still work.
    json_auth = auth | {"content-type": "application/json"}
    r = httpx.post(route, content=_inventory_bytes(3), headers=json_auth, timeout=60)
    assert r.status_code == 200, r.text[:300]
    assert [c["reason"] for c in r.json()["calls"]] == ["unknown_call"] * 3
    r = httpx.get(_control(worker, "metrics"), headers=auth, timeout=30)
    assert r.status_code == 200, r.text[:300]


def test_a_huge_epoch_is_refused_and_normal_fences_keep_working(capture_worker):
    worker, _ = capture_worker
    auth = _auth(worker)
    begin, end = _control(worker, "fence/begin"), _control(worker, "fence/end")
    for epoch in (10**30, 2**62, 2**53, -1):
        r = httpx.post(begin, json={"epoch": epoch, "lease_s": 1}, headers=auth, timeout=30)
        assert r.status_code in (400, 422), (epoch, r.status_code, r.text[:300])
        assert "epoch" in r.text
    metrics = httpx.get(_control(worker, "metrics"), headers=auth, timeout=30).json()
    highest = int(metrics["fence_highest_epoch"])
    too_far = highest + MAX_EPOCH_ADVANCE + 1
    r = httpx.post(begin, json={"epoch": too_far, "lease_s": 1}, headers=auth, timeout=30)
    assert r.status_code == 409, (r.status_code, r.text[:300])
    assert f"at most {highest + MAX_EPOCH_ADVANCE}" in r.json()["error"]["message"]
    # The refusals moved nothing: the highest epoch seen still opens a fence, and ends it.
    r = httpx.post(begin, json={"epoch": highest, "lease_s": 30}, headers=auth, timeout=30)
    assert r.status_code == 200 and r.json()["held"] and r.json()["epoch"] == highest, r.text
    r = httpx.post(end, json={"epoch": highest}, headers=auth, timeout=30)
    assert r.status_code == 200 and r.json()["released"], r.text


def test_booleans_and_strings_are_not_numbers_on_fence_routes(capture_worker):
    worker, _ = capture_worker
    auth = _auth(worker)
    begin, end = _control(worker, "fence/begin"), _control(worker, "fence/end")
    for body in [
        {"epoch": True, "lease_s": 1},
        {"epoch": False, "lease_s": 1},
        {"epoch": 0, "lease_s": True},
        {"epoch": "1", "lease_s": 1},
        {"epoch": 1.0, "lease_s": 1},
    ]:
        r = httpx.post(begin, json=body, headers=auth, timeout=30)
        assert r.status_code in (400, 422), (body, r.status_code, r.text[:300])
    r = httpx.post(end, json={"epoch": True}, headers=auth, timeout=30)
    assert r.status_code in (400, 422), (r.status_code, r.text[:300])


def test_deeply_nested_json_is_a_4xx_and_the_worker_stays_healthy(capture_worker):
    worker, _ = capture_worker
    url = worker.info.url
    n = 100_000
    deep_list, deep_dict = "[" * n + "]" * n, '{"a": ' * n + "1" + "}" * n
    chat = '{"model": "policy", "max_tokens": 2, "messages": [{"role": "user", "content": %s}]%s}'
    xargs = ', "vllm_xargs": {"rr_rollout_id": "deep", "rr_model_call_id": "c0", "x": %s}'
    cases = {
        "top level": ("/v1/chat/completions", deep_list),
        "in messages": ("/v1/chat/completions", chat % (deep_dict, "")),
        "in vllm_xargs": ("/v1/chat/completions", chat % ('"hi"', xargs % deep_list)),
        "tokenize": ("/tokenize", f'{{"model": "policy", "prompt": "hi", "x": {deep_dict}}}'),
    }
    headers = {"content-type": "application/json"}
    for name, (path, body) in cases.items():
        r = httpx.post(f"{url}{path}", content=body, headers=headers, timeout=60)
        assert 400 <= r.status_code < 500, (name, r.status_code, r.text[:300])
        assert "nested" in r.text, (name, r.text[:300])
    assert worker.health().healthy
    ok = chat % ('"hi"', "")
    r = httpx.post(f"{url}/v1/chat/completions", content=ok, headers=headers, timeout=120)
    assert r.status_code == 200, r.text[:300]


def test_call_attempt_evidence_is_read_in_pages_with_the_token(capture_worker):
    """The per-attempt engine records over HTTP: refused without the token, paged by the
    cursor, and equal to what the actor returns; a bad cursor is a 400 naming it."""
    worker, _ = capture_worker
    rollout = f"evidence-{time.time_ns()}"
    body = _body(rollout, 0, content="Count to five.", max_tokens=7, ignore_eos=True)
    r = httpx.post(f"{worker.info.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    route = _control(worker, "call-attempts")
    assert httpx.get(route, timeout=30).status_code == 401
    assert httpx.get(route, headers={"Authorization": "Bearer x"}, timeout=30).status_code == 401
    for bad in ({"since": -1}, {"since": "x"}, {"limit": 0}, {"limit": 10**6}):
        r = httpx.get(route, params=bad, headers=_auth(worker), timeout=30)
        assert r.status_code == 400 and next(iter(bad)) in r.text, r.text
    pages, since = [], 0
    while True:
        page = httpx.get(route, params={"since": since, "limit": 2}, headers=_auth(worker),
                         timeout=30).json()  # fmt: skip
        if not page["attempts"]:
            break
        pages.append(page)
        since = page["next"]
    records = [r for p in pages for r in p["attempts"]]
    mine = [r for r in records if r["rollout_id"] == rollout]
    keys = {(r["rollout_id"], r["model_call_id"], r["attempt"]) for r in records}
    assert len(mine) == 1 and len(keys) == len(records)  # each attempt once across pages
    rec = mine[0]
    assert (rec["resume"], rec["decoded_tokens"], rec["finish_reason"]) == ("none", 7, "length")
    via_actor = worker.call_attempts(0)["attempts"]
    assert [r for r in via_actor if r["rollout_id"] == rollout] == mine
