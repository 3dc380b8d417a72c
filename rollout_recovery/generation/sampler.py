"""Resumable stochastic sampling: Gumbel-max noise keyed by (seed, absolute token position).

A generator-based sampler's next draw depends on every draw before it, so a call resumed from
a k-token prefix cannot reproduce the uninterrupted tail. Here the noise for a token is a pure
function of (seed, position, vocab index), so resubmitting `prompt + prefix` with the same seed
yields the same tail and logprobs (docs/design.md §8).

The hash is MRV2's `murmur3_hash32` and `murmur3_uniform32`
(vllm/v1/worker/gpu/sample/gumbel.py), integer for integer, computed in int64 lanes with split
multiplies so no intermediate overflows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from rollout_recovery.generation.vllm_compat import update_request_rows
from rollout_recovery.protocol import XARG_SEED, XARG_TEMPERATURE

if TYPE_CHECKING:
    from vllm.config import VllmConfig

SAMPLER_FQCN = "rollout_recovery.generation.sampler:PositionKeyedSampler"
SEED_KEY = XARG_SEED
TEMPERATURE_KEY = XARG_TEMPERATURE

_M32 = 0xFFFFFFFF
_C1, _C2 = 0xCC9E2D51, 0x1B873593
_F1, _F2 = 0x85EBCA6B, 0xC2B2AE35
# Elements per chunk of the [rows, vocab] int64 working set: 8 MiB keeps it cache-friendly.
_CHUNK_ELEMS = 1 << 20


def as_int64_seed(seed: int) -> int:
    """Map a seed in [-2**63, 2**64) to the int64 with the same 64 bits (what MRV2 stores)."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """In place: x = (x * c) mod 2**32 for x in [0, 2**32); 16-bit halves keep it below 2**49."""
    hi = x >> 16
    x.bitwise_and_(0xFFFF).mul_(c)
    hi.mul_(c).bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return x.add_(hi).bitwise_and_(_M32)


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    """In place: 32-bit rotate left."""
    low = x >> (32 - r)
    return x.bitwise_left_shift_(r).bitwise_and_(_M32).bitwise_or_(low)


def _scramble(key: torch.Tensor) -> torch.Tensor:
    """The key half of murmur3's mix step (in place)."""
    return _mul32(_rotl32(_mul32(key, _C1), 15), _C2)


def _mix_tail(h: torch.Tensor) -> torch.Tensor:
    """The state half of murmur3's mix step, after `h ^= scrambled key` (in place)."""
    return _rotl32(h, 13).mul_(5).add_(0xE6546B64).bitwise_and_(_M32)


def _row_state(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Hash state after mixing seed (low, high word) and position: one int64 per row."""
    h = torch.zeros_like(seeds)
    for key in (seeds & _M32, (seeds >> 32) & _M32, positions & _M32):
        h = _mix_tail(h.bitwise_xor_(_scramble(key)))
    return h


@lru_cache(maxsize=8)
def _vocab_keys(vocab: int, device: torch.device) -> torch.Tensor:
    """Scrambled vocab indices; row-independent, so computed once per vocab size."""
    return _scramble(torch.arange(vocab, dtype=torch.int64, device=device))


def murmur3_hash32(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """MRV2's `murmur3_hash32(seed, pos, v)` for every row and v < vocab: int64 [rows, vocab]."""
    state = _row_state(seeds, positions)
    if seeds.device.type == "cpu":
        return torch.from_numpy(_hash_uint32(state, vocab).astype(np.int64))
    return _hash_int64(state, vocab)


def _hash_int64(state: torch.Tensor, vocab: int) -> torch.Tensor:
    """The hash in int64 lanes, on any device (a GPU has no uint32 multiply in torch)."""
    h = state[:, None] ^ _vocab_keys(vocab, state.device)
    h = _mix_tail(h).bitwise_xor_(16)  # murmur3 finalises with the key length in bytes
    for shift, factor in ((16, _F1), (13, _F2)):  # fmix32
        _mul32(h.bitwise_xor_(h >> shift), factor)
    return h.bitwise_xor_(h >> 16)


_U32 = np.uint32


def _rotl_u32(x: np.ndarray, r: int) -> np.ndarray:
    return (x << _U32(r)) | (x >> _U32(32 - r))


@lru_cache(maxsize=8)
def _rotated_vocab_keys_u32(vocab: int) -> np.ndarray:
    """rotl13 of the scrambled vocab indices: a rotation distributes over xor, so the mix
    step's rotl13(state ^ key) is rotl13(state) ^ this, one pass per row instead of four."""
    k = np.arange(vocab, dtype=np.uint32) * _U32(_C1)
    return _rotl_u32(_rotl_u32(k, 15) * _U32(_C2), 13)


def _hash_uint32(state: torch.Tensor, vocab: int) -> np.ndarray:
    """The same hash in uint32 lanes (numpy), where a multiply wraps mod 2**32 by itself: the
    int64 lanes above need a 16-bit split per multiply. At a 151k vocabulary (tiny://qwen3,
    Qwen's) this is about 4x faster on the CPU, and the hash is most of the sampler's cost."""
    rotated_state = _rotl_u32(state.numpy().astype(np.uint32), 13)
    h = rotated_state[:, None] ^ _rotated_vocab_keys_u32(vocab)[None, :]
    h *= _U32(5)
    h += _U32(0xE6546B64)
    h ^= _U32(16)  # murmur3 finalises with the key length in bytes
    for shift, factor in ((16, _F1), (13, _F2)):  # fmix32
        h ^= h >> _U32(shift)
        h *= _U32(factor)
    h ^= h >> _U32(16)
    return h


# uniform32: both 16-bit halves of the hash convert to fp32 exactly; their fp32 sum is
# (h + 0.5) * 2**-32 correctly rounded, as in MRV2, so u lies in (0, 1]; u == 1 (p = 2**-25)
# gives g = -inf.
_HI_SCALE, _LO_SCALE = 1.52587890625e-05, 2.3283064365386963e-10  # 2**-16, 2**-32


def _uniform_into(out: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> None:
    """Write uniform32 of the hash for len(seeds) rows into the float32 tensor `out`."""
    vocab = out.shape[1]
    if out.device.type == "cpu":  # uint32 lanes straight to fp32: no int64 copy
        _uniform_from_uint32(out.numpy(), _hash_uint32(_row_state(seeds, positions), vocab))
    else:
        _uniform_from_int64(out, _hash_int64(_row_state(seeds, positions), vocab))


def _uniform_from_uint32(u: np.ndarray, h: np.ndarray) -> None:
    """uniform32 of uint32 hash lanes `h` (clobbered) into the float32 array `u`."""
    u[...] = h >> _U32(16)
    u *= np.float32(_HI_SCALE)
    h &= _U32(0xFFFF)
    lo = h.astype(np.float32)
    lo += np.float32(0.5)
    lo *= np.float32(_LO_SCALE)
    u += lo


def _uniform_from_int64(out: torch.Tensor, h: torch.Tensor) -> None:
    """uniform32 of int64 hash lanes `h` (clobbered) into `out`, in torch on any device."""
    torch.mul((h >> 16).to(torch.float32), _HI_SCALE, out=out)
    h.bitwise_and_(0xFFFF)
    out.add_(h.to(torch.float32).add_(0.5).mul_(_LO_SCALE))


def _noise_into(out: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> None:
    """Write Gumbel noise for len(seeds) rows into the float32 tensor `out` [rows, vocab]."""
    _uniform_into(out, seeds, positions)
    out.neg_().log1p_().neg_().log_().neg_()  # g = -log(-log1p(-u))


def _row_chunks(rows: int, vocab: int) -> range:
    return range(0, rows, max(1, _CHUNK_ELEMS // max(1, vocab)))


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [rows, vocab] float32 for int64 `seeds` and `positions` [rows]."""
    seeds, positions = seeds.to(torch.int64), positions.to(torch.int64)
    out = torch.empty(seeds.shape[0], vocab, dtype=torch.float32, device=seeds.device)
    step = _row_chunks(seeds.shape[0], vocab).step
    for i in range(0, seeds.shape[0], step):
        _noise_into(out[i : i + step], seeds[i : i + step], positions[i : i + step])
    return out


def sample_positions(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    temperature: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids argmax(z/T + G) and their logprobs log_softmax(z/T)[token], one per row.

    `positions` is the absolute position of the last input token (prompt length + tokens
    generated so far - 1), the same convention as MRV2. `logits` is not modified.
    """
    rows, vocab = logits.shape
    dev = logits.device
    seeds, positions = seeds.to(dev, torch.int64), positions.to(dev, torch.int64)
    temps = torch.as_tensor(temperature, dtype=torch.float32, device=dev).expand(rows)
    tokens = torch.empty(rows, dtype=torch.int64, device=dev)
    logprobs = torch.empty(rows, dtype=torch.float32, device=dev)
    chunks = _row_chunks(rows, vocab)
    noise = torch.empty(min(chunks.step, rows), vocab, dtype=torch.float32, device=dev)
    for i in chunks:
        j = min(i + chunks.step, rows)
        zt = logits[i:j].to(torch.float32) / temps[i:j, None]
        g = noise[: j - i]
        _noise_into(g, seeds[i:j], positions[i:j])
        tok = g.add_(zt).argmax(dim=1)
        tokens[i:j] = tok
        logprobs[i:j] = zt.gather(1, tok[:, None])[:, 0] - torch.logsumexp(zt, dim=1)
    return tokens, logprobs


def parse_request(params: SamplingParams) -> tuple[int, float] | None:
    """(int64 seed, temperature) for an opted-in request, None otherwise; ValueError if invalid."""
    extra = params.extra_args or {}
    if SEED_KEY not in extra:
        if TEMPERATURE_KEY in extra:
            raise ValueError(f"extra_args[{TEMPERATURE_KEY!r}] requires extra_args[{SEED_KEY!r}]")
        return None
    seed, temp = extra[SEED_KEY], extra.get(TEMPERATURE_KEY, 1.0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64:
        raise ValueError(
            f"extra_args[{SEED_KEY!r}] must be an int in [-2**63, 2**64), got {seed!r}"
        )
    if isinstance(temp, bool) or not isinstance(temp, int | float) or not 0 < temp < math.inf:
        raise ValueError(
            f"extra_args[{TEMPERATURE_KEY!r}] must be a finite number > 0, got {temp!r}"
        )
    if params.temperature != 0.0:
        raise ValueError(
            f"requests with extra_args[{SEED_KEY!r}] must use temperature=0 (got "
            f"{params.temperature}): the logits processor samples, the engine must run greedy; "
            f"put the sampling temperature in extra_args[{TEMPERATURE_KEY!r}]"
        )
    unsupported = {
        "top_p": params.top_p < 1.0,
        "top_k": params.top_k > 0,
        "min_p": params.min_p > 0.0,
        # vLLM applies penalties after custom logits processors: the draw would ignore them.
        "presence_penalty": params.presence_penalty != 0.0,
        "frequency_penalty": params.frequency_penalty != 0.0,
        "repetition_penalty": params.repetition_penalty != 1.0,
    }
    if bad := [name for name, is_set in unsupported.items() if is_set]:
        raise ValueError(
            f"{', '.join(bad)} cannot be combined with extra_args[{SEED_KEY!r}]: the "
            "position-keyed sampler does not implement them"
        )
    return as_int64_seed(seed), float(temp)


@dataclass(slots=True)
class _Row:
    seed: int
    temperature: float
    prompt_len: int
    output_ids: list[int]  # vLLM's live list: grows as the request decodes


def _new_row(
    params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
) -> _Row | None:
    parsed = parse_request(params)
    if parsed is None:
        return None
    if prompt_ids is None:
        raise ValueError(f"extra_args[{SEED_KEY!r}] needs prompt token ids, not prompt embeds")
    return _Row(parsed[0], parsed[1], len(prompt_ids), output_ids)


class PositionKeyedSampler(LogitsProcessor):
    """Replaces an opted-in row with a one-hot choice so the engine's greedy argmax takes it.

    The chosen token keeps the value log_softmax(z/T)[token], which vLLM reports as its logprob
    under `logprobs_mode="processed_logits"`. Rows without `rr_seed` are left untouched.
    """

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self._rows: dict[int, _Row] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        parse_request(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        update_request_rows(self._rows, batch_update, _new_row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows:
            return logits
        index = sorted(self._rows)
        rows = [self._rows[i] for i in index]
        idx = torch.tensor(index, dtype=torch.int64, device=logits.device)
        seeds = torch.tensor([r.seed for r in rows], dtype=torch.int64)
        positions = torch.tensor([r.prompt_len + len(r.output_ids) - 1 for r in rows])
        temps = torch.tensor([r.temperature for r in rows], dtype=torch.float32)
        tokens, logprobs = sample_positions(logits[idx], seeds, positions, temps)
        logits[idx] = float("-inf")
        logits[idx, tokens] = logprobs.to(logits.dtype)
        return logits
