"""The position-keyed sampler inside the real vLLM CPU engine: determinism, resume, logprobs.

All engine work happens in one subprocess (tests/engine/sampler_offline.py, one engine start)
so the determinism environment is set before torch is imported; the tests check its output.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.offline_common import run_offline

pytestmark = pytest.mark.engine

HERE = Path(__file__).resolve().parent
N = 32
CUTS = [1, 7, 20]
SEEDS = [1234, 99, 2**64 - 5]
PROMPTS = [[5, 17, 42, 99, 256, 300, 7], [11, 12, 13]]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tiny_cfg) -> dict:
    request = {
        "model": str(tiny_model_dir),
        "prompts": PROMPTS,
        "max_tokens": N,
        "seeds": SEEDS,
        "cuts": CUTS,
    }
    return run_offline("sampler_offline.py", request, tiny_cfg)


def test_invalid_request_is_rejected_by_the_engine(runs):
    assert "VLLMValidationError" in runs["rejected"] and "temperature=0" in runs["rejected"]


def test_same_seed_same_tokens_in_any_batch(runs):
    alone, batch = runs["alone"], runs["batch"]
    assert len(alone["token_ids"]) == N
    assert runs["alone_again"] == alone
    assert batch[0] == alone  # bit-identical logprobs too
    assert batch[3]["token_ids"] == runs["greedy_alone"]["token_ids"]  # unseeded row untouched


def test_different_seeds_differ(runs):
    a, b, greedy = (r["token_ids"] for r in (runs["alone"], runs["batch"][1], runs["greedy_alone"]))
    assert a != b and greedy not in (a, b)


@pytest.mark.parametrize("cut", CUTS)
def test_resumed_tail_equals_uninterrupted_run(runs, cut):
    resumed = runs["resumed"][CUTS.index(cut)]
    full = runs["alone"]
    assert resumed["token_ids"] == full["token_ids"][cut:]
    assert resumed["logprobs"] == full["logprobs"][cut:]


@pytest.mark.parametrize(("run", "ref"), [("alone", 0), ("batch", 1)])
def test_logprobs_and_choices_match_transformers(runs, run, ref):
    got = runs[run] if run == "alone" else runs[run][2]
    reference = runs["reference"][ref]
    assert got["logprobs"] == pytest.approx(reference["logprobs"], abs=1e-4)
    # A trainer holding the model's logits reproduces the worker's choices.
    assert reference["token_ids"] == got["token_ids"]
