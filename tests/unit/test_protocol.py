"""The wire protocol: identities, the key grammar and continuations round-trip."""

from __future__ import annotations

import pytest

from rollout_recovery.protocol import (
    REQUEST_FIELDS,
    RESUME_LIMIT_ARG,
    CallIdentity,
    Continuation,
    check_continuation_fields,
    check_id,
    identity_from_extra_args,
    incomplete_key,
    is_incomplete_key,
    resume_request,
)


def test_identity_round_trips_through_request_fields_and_keys():
    ident = CallIdentity("s0001-p000-g2", "c1", 3)
    assert identity_from_extra_args(ident.to_xargs()) == ident
    assert set(ident.to_xargs()) <= REQUEST_FIELDS
    assert ident.chunk_key(7) == "s0001-p000-g2/c1/a3/c000007"
    assert CallIdentity.of_chunk_key(ident.chunk_key(7)) == ident
    assert ident.terminal_key() == "s0001-p000-g2/c1/a3/terminal"
    for not_a_chunk in (ident.terminal_key(), "r/c/3/c000001", "r/c/a3/cx", "r/c/a3", "a/b/c/d/e"):
        assert CallIdentity.of_chunk_key(not_a_chunk) is None, not_a_chunk


def test_identifiers_and_attempts_are_checked():
    assert identity_from_extra_args({}) is None
    with pytest.raises(ValueError, match="rr_attempt"):
        identity_from_extra_args(
            {"rr_rollout_id": "r", "rr_model_call_id": "c", "rr_attempt": True}
        )
    with pytest.raises(ValueError, match="rr_model_call_id"):
        identity_from_extra_args({"rr_rollout_id": "r", "rr_model_call_id": "a b"})
    with pytest.raises(ValueError):
        check_id("x", "r" * 129)


def test_a_continuation_goes_from_receipt_to_record_to_request_and_back():
    receipt = {"rollout_id": "r", "model_call_id": "c0", "attempt": 1,
               "disposition": "durable_prefix", "prefix_token_count": 9,
               "staging_keys": ["r/c0/a1/c000000", "r/c0/a1/c000001"],
               "prefix_digest": "ab" * 32, "cut_kind": "active_prefix"}  # fmt: skip
    cont = Continuation.from_receipt(receipt)
    record = cont.to_record()
    assert Continuation(**record) == cont and cont.cut
    fields = cont.to_request_fields(limit=48)
    check_continuation_fields(fields)
    got = resume_request(fields)
    assert (got.keys, got.tokens, got.digest, got.limit) == (cont.keys, 9, "ab" * 32, 48)
    assert RESUME_LIMIT_ARG not in cont.to_request_fields(limit=None)
    failed = Continuation.from_receipt(receipt | {"disposition": "durable_failure"})
    assert failed.to_record() == {"call_id": "c0", "attempt": 1} and not failed.cut
    assert failed.to_request_fields(limit=48) == {}


def test_malformed_continuation_fields_name_the_field():
    good = {"rr_resume_keys": ["r/c0/a0/c000000"], "rr_resume_tokens": 3, "rr_resume_digest": "x"}
    assert resume_request({}) is None
    for field, bad in (("rr_resume_keys", ["not a key"]), ("rr_resume_keys", []),
                       ("rr_resume_tokens", True), ("rr_resume_tokens", 0),
                       ("rr_resume_digest", 5), ("rr_resume_limit", "48")):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            check_continuation_fields(good | {field: bad})


def test_episode_names_round_trip():
    from rollout_recovery.protocol import (
        group_id,
        replay_key,
        rollout_id,
        rollout_of_replay_key,
        step_prefix,
    )

    gid = group_id(12, 3)
    assert gid == "s0012-p003" and gid.startswith(step_prefix(12))
    assert replay_key(gid, 2) == "s0012-p003/002"
    assert rollout_of_replay_key(replay_key(gid, 2)) == rollout_id(gid, 2) == "s0012-p003-g2"
    assert sorted(replay_key(gid, i) for i in (10, 2)) == [replay_key(gid, 2), replay_key(gid, 10)]


def test_incomplete_markers_have_their_own_key_shape():
    key = incomplete_key("r-g0", "c1")
    assert key == "r-g0/c1/incomplete" and is_incomplete_key(key)
    assert not is_incomplete_key("r-g0/c1/a0") and not is_incomplete_key("x/r-g0/c1/incomplete")
