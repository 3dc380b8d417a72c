"""Domain-separated, length-prefixed sha256 digests of token ids.

A flat digest names a whole token sequence; a chained digest lets a prefix staged as several
chunks be verified chunk by chunk: chunk n's digest covers chunk n-1's digest plus its own
delta, so a missing, reordered or altered chunk changes every digest after it. The chunk that
ends a finished call is sealed with how it finished (`finish_digest`), so a forged or dropped
finish record fails the chain like a changed token.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

DIGEST_BYTES = 32
TOKENS_DOMAIN = b"rollout_recovery/tokens/v1\x00"
CHUNK_DOMAIN = b"rollout_recovery/chunk/v1\x00"
FINISH_DOMAIN = b"rollout_recovery/finish/v1\x00"
CHAIN_ROOT = bytes(DIGEST_BYTES)  # the "previous digest" of chunk 0


def _token_bytes(token_ids) -> tuple[int, bytes]:
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        raise ValueError("token ids must fit in int32 and be non-negative")
    return arr.size, np.ascontiguousarray(arr, dtype="<i4").tobytes()


def token_digest(token_ids) -> bytes:
    """sha256(domain ‖ u64le(n) ‖ int32le ids) of a whole sequence."""
    n, data = _token_bytes(token_ids)
    h = hashlib.sha256(TOKENS_DOMAIN)
    h.update(struct.pack("<Q", n))
    h.update(data)
    return h.digest()


def chain_digest(prev_digest: bytes, delta_token_ids) -> bytes:
    """sha256(domain ‖ prev ‖ u64le(n) ‖ int32le delta); use CHAIN_ROOT as prev for chunk 0."""
    if len(prev_digest) != DIGEST_BYTES:
        raise ValueError(f"previous digest must be {DIGEST_BYTES} bytes, got {len(prev_digest)}")
    n, data = _token_bytes(delta_token_ids)
    h = hashlib.sha256(CHUNK_DOMAIN)
    h.update(prev_digest)
    h.update(struct.pack("<Q", n))
    h.update(data)
    return h.digest()


def chain_digests(deltas) -> list[bytes]:
    """Digests of consecutive chunks, each chained on the one before."""
    out, prev = [], CHAIN_ROOT
    for delta in deltas:
        prev = chain_digest(prev, delta)
        out.append(prev)
    return out


def finish_digest(chain: bytes, finish_reason: str, stop_reason_json: str | None) -> bytes:
    """Seal a chunk's chain digest with its call's finish record:
    sha256(domain ‖ chain ‖ u64le(len) ‖ reason ‖ u64le(len) ‖ stop reason json, or u64 max
    for none)."""
    if len(chain) != DIGEST_BYTES:
        raise ValueError(f"chain digest must be {DIGEST_BYTES} bytes, got {len(chain)}")
    h = hashlib.sha256(FINISH_DOMAIN)
    h.update(chain)
    reason = finish_reason.encode()
    h.update(struct.pack("<Q", len(reason)))
    h.update(reason)
    if stop_reason_json is None:
        h.update(struct.pack("<Q", 2**64 - 1))
    else:
        stop = stop_reason_json.encode()
        h.update(struct.pack("<Q", len(stop)))
        h.update(stop)
    return h.digest()
