"""Fenced writes on S3 (the local moto server): the ownership log's entries are created with
`If-None-Match: *`, and a stale owner's next write under the run raises OwnerFenced naming the
newer owner and lands nothing, as on a disk (tests/unit/test_fenced_writes.py)."""

from __future__ import annotations

import pytest

from rollout_recovery.data_plane.errors import OwnerFenced
from tests.cluster.store_helpers import local_s3
from tests.unit.test_fenced_writes import WRITES, owners

pytestmark = pytest.mark.cluster


def test_a_stale_owner_writes_nothing_on_s3():
    with local_s3("rr-fenced", "runs/a") as uri:
        a, b = owners(uri)
        for name, write in WRITES.items():
            with pytest.raises(OwnerFenced, match="a newer controller owns it: epoch 2"):
                write(a)
            assert b.read_bytes("trainer/step-000002/state.bin") == b"B's step 2", name
        assert [ln for ln in b.read_lines("steps.jsonl")] == [
            '{"step": 2, "by": "A"}',
            '{"step": 2, "by": "B"}',
        ]
