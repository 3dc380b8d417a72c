"""Weight-version spans (data_plane/spans.py), and the chain check that holds a resumed call's
prefix to the versions its chunks recorded."""

from __future__ import annotations

import numpy as np
import pytest

from rollout_recovery.data_plane.chain import ResumeRefused, validate_chunks
from rollout_recovery.data_plane.digest import CHAIN_ROOT, chain_digest
from rollout_recovery.data_plane.schemas import ChunkRow
from rollout_recovery.data_plane.spans import (
    NO_VERSION,
    SpanError,
    check_spans,
    from_starts,
    merged,
    per_token,
    resumed,
    shifted,
    version_range,
)
from rollout_recovery.protocol import CallIdentity, decode_spans, encode_spans


def test_spans_must_cover_the_tokens_in_order_without_going_back():
    check_spans([(0, 0, 2), (1, 2, 5)], 0, 5)
    check_spans([], 3, 3)
    for bad, why in [
        ([(0, 0, 2), (1, 3, 5)], "continue at 2"),  # a gap
        ([(0, 0, 3), (1, 2, 5)], "continue at 3"),  # an overlap
        ([(0, 0, 2), (0, 2, 2), (1, 2, 5)], "continue at 2"),  # an empty span
        ([(0, 0, 4)], "spans end at 4, the tokens at 5"),
        ([(2, 0, 2), (1, 2, 5)], "decrease"),
        ([(-1, 0, 5)], "continue at 0"),
    ]:
        with pytest.raises(SpanError, match=why):
            check_spans(bad, 0, 5)


def test_engine_switch_points_become_spans():
    assert from_starts([], 4, 7) == [(7, 0, 4)]
    assert from_starts([(1, 0), (2, 3)], 5, 0) == [(1, 0, 3), (2, 3, 5)]
    assert from_starts([(2, 3)], 5, 1) == [(1, 0, 3), (2, 3, 5)]  # before the first label
    assert from_starts([(1, 0), (2, 3), (3, 9)], 5, 0) == [(1, 0, 3), (2, 3, 5)]  # not yet
    assert from_starts([(1, 0), (1, 2)], 4, 0) == [(1, 0, 4)]


def test_a_resumed_call_keeps_its_prefix_versions_and_takes_the_engines_after_it():
    prefix = [(0, 0, 3), (1, 3, 5)]
    assert resumed(prefix, [(4, 0, 8)], 5, 8) == [(0, 0, 3), (1, 3, 5), (4, 5, 8)]
    assert resumed(prefix, [(1, 0, 8)], 5, 8) == [(0, 0, 3), (1, 3, 8)]
    assert shifted([(0, 0, 2)], 10) == [(0, 10, 12)]
    assert merged([(1, 0, 2), (1, 2, 4), (2, 4, 5), (1, 6, 7)]) == [
        (1, 0, 4), (2, 4, 5), (1, 6, 7)]  # fmt: skip
    np.testing.assert_array_equal(per_token([(3, 1, 3), (4, 4, 5)], 6),
                                  [NO_VERSION, 3, 3, NO_VERSION, 4, NO_VERSION])  # fmt: skip
    assert version_range([(3, 1, 3), (4, 4, 5)]) == (3, 4) and version_range([]) is None


def test_spans_on_the_wire():
    assert decode_spans(encode_spans([(0, 0, 2), (1, 2, 5)])) == [(0, 0, 2), (1, 2, 5)]
    for bad in ('{"a": 1}', "[[1, 2]]", "[[1, 2, true]]", '[["1", 0, 1]]'):
        with pytest.raises(ValueError):
            decode_spans(bad)


IDENTITY = CallIdentity("r", "c0", 1)
PROMPT = [1, 2]


def _chain(spans_per_row: list[list[tuple[int, int, int]] | None], versions: list[int]):
    rows, digest, prev = [], CHAIN_ROOT, 0
    for seq, (spans, version) in enumerate(zip(spans_per_row, versions, strict=True)):
        ids = np.arange(10 + prev, 13 + prev, dtype=np.int32)
        digest = chain_digest(digest, ids)
        rows.append(ChunkRow(key=f"r/c0/a0/c{seq}", rollout_id="r", model_call_id="c0", attempt=0,
                             chunk_seq=seq, token_ids=ids, logprobs=np.zeros(3, np.float32),
                             weight_version=version, prev_len=prev, digest=digest,
                             prompt_token_ids=np.asarray(PROMPT, np.int32) if seq == 0 else None,
                             weight_versions=spans))  # fmt: skip
        prev += 3
    return rows, digest


def _check(rows, digest):
    return validate_chunks(rows, IDENTITY, [r.key for r in rows], PROMPT, 3 * len(rows),
                           digest.hex())  # fmt: skip


def test_the_checked_prefix_carries_each_tokens_version():
    rows, digest = _chain([[(0, 0, 2), (1, 2, 3)], [(1, 3, 6)]], [1, 1])
    assert _check(rows, digest).weight_versions == [(0, 0, 2), (1, 2, 6)]
    rows, digest = _chain([None, [(2, 3, 5), (3, 5, 6)]], [1, 3])  # a v2 row first
    assert _check(rows, digest).weight_versions == [(1, 0, 3), (2, 3, 5), (3, 5, 6)]


@pytest.mark.parametrize(
    ("spans", "versions", "reason"),
    [
        ([[(0, 0, 2)], [(0, 3, 6)]], [0, 0], "weight_version_spans"),  # a token without one
        ([[(0, 0, 3)], [(0, 2, 6)]], [0, 0], "weight_version_spans"),  # not its own tokens
        ([[(2, 0, 3)], [(1, 3, 6)]], [2, 1], "weight_version_order"),
        ([None, None], [2, 1], "weight_version_order"),
    ],
)
def test_spans_that_do_not_describe_the_chain_refuse_the_resume(spans, versions, reason):
    rows, digest = _chain(spans, versions)
    with pytest.raises(ResumeRefused) as refused:
        _check(rows, digest)
    assert refused.value.reason == reason
