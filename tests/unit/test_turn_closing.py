"""Prefix supply closes a finished parent turn that did not emit its end-of-turn token, and only
that one: the lineage holds a parent's tokens as a tuple, and a turn that ended on its end
token must not get a second one (the next turn's prompt would then hold the token twice)."""

from __future__ import annotations

import pytest

from rollout_recovery.environment.model_client import turn_closing

END = 151645


@pytest.mark.parametrize(
    ("tokens", "finish", "closing"),
    [
        ((5, 6, END), "stop", []),  # it emitted its end of turn
        ((5, 6, 151643), "stop", [END]),  # stopped on another end-of-sequence id or stop token
        ((5, 6), "length", [END]),  # cut by the length limit
        ((5, END), "length", []),
        ((), "stop", [END]),
        ((5, 6), "abort", []),  # not finished: nothing to continue from
        ((5, 6), None, []),
    ],
)
def test_a_finished_turn_gets_its_end_of_turn_once(tokens, finish, closing):
    assert turn_closing(tokens, finish, END) == closing
    assert turn_closing(list(tokens), finish, END) == closing
    assert turn_closing(tokens, finish, None) == []
