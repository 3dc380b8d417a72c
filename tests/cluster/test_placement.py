"""Placement from config on a two-node Ray cluster (two_node_placement.py, in its own process):
store shards and environment actors land on the nodes their `placement` block asks for, by
node affinity, by placement group (STRICT_SPREAD: one shard per node) and by custom resources;
`spread` runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.cluster


def test_actors_run_where_their_placement_block_asks():
    proc = subprocess.run(
        [sys.executable, str(HERE / "two_node_placement.py")],
        capture_output=True, text=True, timeout=300, check=False, cwd=HERE.parents[1],
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    r = json.loads(lines[-1].removeprefix("RESULT "))
    a, b = r["node_a"], r["node_b"]
    assert a != b
    # node_affinity: actor i on node_ids[i % len(node_ids)].
    assert r["affinity_shards"] == [a, b, a]
    assert r["affinity_environments"] == [b, a]
    # placement_group STRICT_SPREAD: one shard per node, shard i in bundle i.
    assert sorted(r["group_shards"]) == sorted([a, b])
    assert r["group_shards"] == r["group_bundles"]
    assert r["group_state"] == "REMOVED"
    # spread runs; custom resources pin both environment actors to node_b.
    assert len(r["spread_shards"]) == 2 and set(r["spread_shards"]) <= {a, b}
    assert r["resource_environments"] == [b, b]
    assert isinstance(r["counters"], dict)
