"""Position-keyed sampler: hash exactness, batch independence, distribution, validation."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate

from rollout_recovery.generation.sampler import (
    SAMPLER_FQCN,
    PositionKeyedSampler,
    as_int64_seed,
    gumbel_noise,
    murmur3_hash32,
    sample_positions,
)

M32 = 0xFFFFFFFF


def _ref_mix(h: int, key: int) -> int:
    """Scalar murmur3 mix step, transcribed from MRV2's `_murmur3_mix`."""
    rotl = lambda v, r: ((v << r) | (v >> (32 - r))) & M32  # noqa: E731
    key = rotl((key * 0xCC9E2D51) & M32, 15)
    h ^= (key * 0x1B873593) & M32
    return (rotl(h, 13) * 5 + 0xE6546B64) & M32


def ref_hash(seed: int, pos: int, offset: int) -> int:
    """Scalar `murmur3_hash32(seed, pos, offset)` (vllm/v1/worker/gpu/sample/gumbel.py)."""
    seed &= (1 << 64) - 1
    h = 0
    for key in (seed & M32, seed >> 32, pos & M32, offset):
        h = _ref_mix(h, key)
    h ^= 16
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def ref_noise(seed: int, pos: int, offset: int) -> float:
    h = ref_hash(seed, pos, offset)
    hi, lo = np.float32(h >> 16), np.float32(h & 0xFFFF)
    u = float(hi * np.float32(2.0**-16) + (lo + np.float32(0.5)) * np.float32(2.0**-32))
    return -math.inf if u == 1.0 else -math.log(-math.log1p(-u))


SEEDS = [0, 1, -1, 12345, -(2**63), 2**63 - 1, 2**63, 2**64 - 1, 0xDEADBEEFCAFEF00D]
POSITIONS = [0, 1, 17, 2**31 + 5, 2**40 + 3]


def test_hash_integers_match_scalar_reference():
    vocab = 1000
    seeds = [s for s in SEEDS for _ in POSITIONS]
    pos = POSITIONS * len(SEEDS)
    got = murmur3_hash32(torch.tensor([as_int64_seed(s) for s in seeds]), torch.tensor(pos), vocab)
    ref = torch.tensor(
        [[ref_hash(s, p, v) for v in range(vocab)] for s, p in zip(seeds, pos, strict=True)]
    )
    assert torch.equal(got, ref)


def test_the_cpu_uint32_lanes_equal_the_int64_lanes_at_a_qwen_vocabulary():
    """The CPU hash (numpy uint32, wrapping multiplies) and the int64 one a GPU runs agree on
    every value, at Qwen's 151,936-row vocabulary."""
    from rollout_recovery.generation.sampler import _hash_int64, _row_state

    seeds = torch.tensor([as_int64_seed(s) for s in SEEDS for _ in POSITIONS])
    pos = torch.tensor(POSITIONS * len(SEEDS))
    cpu = murmur3_hash32(seeds, pos, 151_936)
    assert cpu.dtype == torch.int64 and int(cpu.min()) >= 0 and int(cpu.max()) < 2**32
    assert torch.equal(cpu, _hash_int64(_row_state(seeds, pos), 151_936))


def test_the_cpu_uniform_from_uint32_lanes_is_bit_identical_to_the_int64_path():
    """The CPU builds uniform32 from the uint32 lanes in numpy; a GPU from int64 lanes in
    torch. Same fp32 bits for every value at Qwen's vocabulary, u == 1 (g = -inf) included."""
    from rollout_recovery.generation.sampler import (
        _hash_int64,
        _row_state,
        _uniform_from_int64,
        _uniform_from_uint32,
        _uniform_into,
    )

    seeds = torch.tensor([as_int64_seed(s) for s in SEEDS for _ in POSITIONS])
    pos = torch.tensor(POSITIONS * len(SEEDS))
    cpu = torch.empty(len(seeds), 151_936)
    _uniform_into(cpu, seeds, pos)
    lanes = torch.empty_like(cpu)
    _uniform_from_int64(lanes, _hash_int64(_row_state(seeds, pos), 151_936))
    assert torch.equal(cpu.view(torch.int32), lanes.view(torch.int32))
    extremes = [0xFFFFFFFF, 0xFFFFFFFE, 0xFFFF0000, 0x0000FFFF, 1, 0]
    from_u32 = np.empty((1, len(extremes)), np.float32)
    _uniform_from_uint32(from_u32, np.array([extremes], np.uint32))
    from_i64 = torch.empty(1, len(extremes))
    _uniform_from_int64(from_i64, torch.tensor([extremes]))
    assert torch.equal(torch.from_numpy(from_u32).view(torch.int32), from_i64.view(torch.int32))
    assert from_u32[0, 0] == 1.0 and 0.0 < from_u32[0, -1] < 2**-32


def test_noise_matches_scalar_reference():
    offsets = [0, 1, 2, 150, 298, 299]
    seeds = [s for s in SEEDS for _ in POSITIONS]
    pos = POSITIONS * len(SEEDS)
    got = gumbel_noise(torch.tensor([as_int64_seed(s) for s in seeds]), torch.tensor(pos), 300)
    for row, (s, p) in enumerate(zip(seeds, pos, strict=True)):
        for v in offsets:
            assert got[row, v].item() == pytest.approx(ref_noise(s, p, v), rel=1e-6, abs=1e-6)


def test_as_int64_seed_masks_to_64_bits():
    assert as_int64_seed(2**64 - 1) == -1
    assert as_int64_seed(2**63) == -(2**63)
    assert as_int64_seed(-5) == -5 and as_int64_seed(5) == 5


def test_independent_of_row_order_and_batch():
    torch.manual_seed(0)
    logits = torch.randn(16, 777)
    seeds = torch.randint(-(2**62), 2**62, (16,))
    pos = torch.randint(0, 5000, (16,))
    tok, lp = sample_positions(logits, seeds, pos, 0.8)
    perm = torch.randperm(16)
    tok_p, lp_p = sample_positions(logits[perm], seeds[perm], pos[perm], 0.8)
    assert torch.equal(tok_p, tok[perm]) and torch.equal(lp_p, lp[perm])
    for i in (0, 5, 15):
        t1, l1 = sample_positions(logits[i : i + 1], seeds[i : i + 1], pos[i : i + 1], 0.8)
        assert t1.item() == tok[i].item() and l1.item() == lp[i].item()


def test_chunking_does_not_change_noise(monkeypatch):
    import rollout_recovery.generation.sampler as sampler

    seeds, pos = torch.arange(9) * 1000003 - 4, torch.arange(9) * 11
    full = gumbel_noise(seeds, pos, 1000)
    monkeypatch.setattr(sampler, "_CHUNK_ELEMS", 2500)
    assert torch.equal(gumbel_noise(seeds, pos, 1000), full)


def test_logprob_is_log_softmax_at_temperature():
    torch.manual_seed(1)
    logits = torch.randn(4, 50) * 3
    temps = torch.tensor([1.0, 0.7, 1.5, 0.3])
    tok, lp = sample_positions(logits, torch.arange(4), torch.arange(4), temps)
    ref = torch.log_softmax(logits / temps[:, None], dim=1).gather(1, tok[:, None])[:, 0]
    torch.testing.assert_close(lp, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("axis", ["seed", "position"])
def test_distribution_matches_softmax(temperature, axis):
    vocab, draws = 40, 20_000
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(vocab, generator=gen) * 1.5
    p = torch.softmax(z / temperature, 0).double()
    keys = torch.arange(draws)
    seeds, pos = (keys, torch.full_like(keys, 9)) if axis == "seed" else (keys * 0 + 77, keys)
    tok, _ = sample_positions(z.expand(draws, vocab), seeds, pos, temperature)
    freq = torch.bincount(tok, minlength=vocab).double() / draws
    tv = 0.5 * (freq - p).abs().sum().item()
    expected_tv = 0.5 * torch.sqrt(2 * p * (1 - p) / (math.pi * draws)).sum().item()
    assert tv < 2 * expected_tv, (tv, expected_tv)
    big = p * draws >= 5  # chi-square on well-populated cells
    chi2 = (((freq - p) * draws) ** 2 / (p * draws))[big].sum().item()
    dof = int(big.sum()) - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof), (chi2, dof)


def test_different_seeds_and_positions_differ():
    z = torch.zeros(64, 1000)
    tok_seed, _ = sample_positions(z, torch.arange(64), torch.zeros(64, dtype=torch.long), 1.0)
    tok_pos, _ = sample_positions(z, torch.zeros(64, dtype=torch.long), torch.arange(64), 1.0)
    assert len(set(tok_seed.tolist())) > 55 and len(set(tok_pos.tolist())) > 55
    assert not torch.equal(tok_seed, tok_pos)


def _params(**kw) -> SamplingParams:
    extra = {k: kw.pop(k) for k in ("rr_seed", "rr_temperature") if k in kw}
    return SamplingParams(temperature=kw.pop("temperature", 0.0), extra_args=extra, **kw)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (_params(rr_seed=1, temperature=0.8), "temperature=0"),
        (_params(rr_seed="7"), "must be an int"),
        (_params(rr_seed=1.0), "must be an int"),
        (_params(rr_seed=True), "must be an int"),
        (_params(rr_seed=1, rr_temperature=0.0), "> 0"),
        (_params(rr_seed=1, rr_temperature=-1), "> 0"),
        (_params(rr_seed=1, rr_temperature=float("nan")), "> 0"),
        (_params(rr_temperature=0.7), "requires"),
        (_params(rr_seed=1, presence_penalty=0.5), "presence_penalty"),
    ],
)
def test_validate_params_rejects(params, message):
    with pytest.raises(ValueError, match=message):
        PositionKeyedSampler.validate_params(params)


def test_validate_params_rejects_top_p_top_k():
    # Greedy resets top_p/top_k in __post_init__; check the guard on values set afterwards.
    params = _params(rr_seed=1)
    params.top_p, params.top_k = 0.9, 5
    with pytest.raises(ValueError, match="top_p, top_k"):
        PositionKeyedSampler.validate_params(params)


def test_validate_params_accepts():
    for params in (_params(), _params(rr_seed=2**64 - 1, rr_temperature=0.5), _params(rr_seed=-3)):
        PositionKeyedSampler.validate_params(params)
    assert SAMPLER_FQCN.split(":") == [PositionKeyedSampler.__module__, "PositionKeyedSampler"]


def test_processor_rewrites_only_opted_in_rows():
    proc = PositionKeyedSampler(SimpleNamespace(), torch.device("cpu"), False)
    assert proc.is_argmax_invariant() is False
    out_a, out_c = [5, 6], []
    added = [
        (0, _params(rr_seed=11, rr_temperature=0.7), [1, 2, 3], out_a),
        (1, _params(), [1, 2], []),
        (2, _params(rr_seed=2**64 - 2), [4], out_c),
    ]
    proc.update_state(BatchUpdate(batch_size=3, removed=[], added=added, moved=[]))
    torch.manual_seed(2)
    logits = torch.randn(3, 100)
    original = logits.clone()
    result = proc.apply(logits)
    assert torch.equal(result[1], original[1])
    tok, lp = sample_positions(
        original[[0, 2]], torch.tensor([11, -2]), torch.tensor([4, 0]), torch.tensor([0.7, 1.0])
    )
    for row, t, v in zip((0, 2), tok.tolist(), lp.tolist(), strict=True):
        assert result[row].argmax().item() == t and result[row, t].item() == v
        assert torch.isinf(result[row]).sum().item() == 99
    # The live output list advances the position; a removed row stops being touched.
    out_a.append(int(tok[0]))
    proc.update_state(BatchUpdate(batch_size=3, removed=[2], added=[], moved=[]))
    logits = original.clone()
    proc.apply(logits)
    assert torch.equal(logits[2], original[2])
    t5, _ = sample_positions(original[:1], torch.tensor([11]), torch.tensor([5]), 0.7)
    assert logits[0].argmax().item() == t5.item()
