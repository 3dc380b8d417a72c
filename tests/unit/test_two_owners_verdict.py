"""The two-owner check's verdict (functional_tests/two_owners.py) on synthetic locations: a
stale owner that wrote after its thaw fails the check by name, one that stopped in one line and
wrote nothing passes. (The end-to-end run with `fencing_disabled` is a manual command in
docs/testing.md; tests/unit/test_fenced_writes.py shows that fault letting the write land.)"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "two_owners", REPO / "functional_tests" / "two_owners.py"
)
two = importlib.util.module_from_spec(spec)
spec.loader.exec_module(two)


def _entry(run: Path, slot: int, kind: str, epoch: int, pid: int, snapshot: str | None = None):
    path = run / "data_plane" / "ownership" / f"{slot:010d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"slot": slot, "kind": kind, "epoch": epoch, "snapshot": snapshot,
            "owner": {"pid": pid}}  # fmt: skip
    path.write_text(json.dumps({"body": body}))


def _write(run: Path, rel: str, text: str, append: bool = False) -> None:
    path = run / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a" if append else "w") as f:
        f.write(text)


def _check(run: Path, thawed) -> list[str]:
    """A claimed and wrote step 1; B claimed, published and wrote steps 2-3; then `thawed(run)`
    does what A did after its thaw. Returns the verdict's violations."""
    _entry(run, 1, "claim", 1, 100)
    _write(run, "steps.jsonl", '{"step": 1}\n')
    _write(run, "trainer/step-000001/meta.json", "a")
    frozen = two.State(run)
    _entry(run, 2, "claim", 2, 200)
    _entry(run, 3, "publish", 2, 200, "snapshot-0000000004-x")
    _write(run, "steps.jsonl", '{"event": "restore", "step": 1}\n{"step": 2}\n{"step": 3}\n', True)
    _write(run, "trainer/step-000003/meta.json", "b")
    after_b = two.State(run)
    line = thawed(run)
    after_a = two.State(run)
    actors = [
        {"actor": "A before the freeze", "exit": None, "frozen": {"mid_generation": True},
         "wrote": two.wrote(two.State(None), frozen)},
        {"actor": "B", "exit": 0, "wrote": two.wrote(frozen, after_b)},
        {"actor": "A after the thaw", "exit": 1, "wrote": two.wrote(after_b, after_a),
         "fenced": {"exited_after_s": 1.0, "stderr": [line], "processes_left": []}},
    ]  # fmt: skip
    args = SimpleNamespace(fence_timeout=120, steps=3, out=run)
    states = {"frozen": frozen, "after_b": after_b, "after_a": after_a}
    return two.verdict(args, actors, states)


FENCED = ("rollout-recovery: this controller, epoch 1 (pid 100) no longer owns the snapshots: "
          "a newer controller owns it: epoch 2 (host h, pid 200, slot 2)")  # fmt: skip


def test_a_stale_owner_that_stopped_in_one_line_and_wrote_nothing_passes(tmp_path):
    assert _check(tmp_path, lambda run: FENCED) == []


def test_a_stale_owner_that_wrote_after_its_thaw_fails_by_name(tmp_path):
    def unfenced(run: Path) -> str:
        _write(run, "token_log/worker-0/seg-000001.arrow", "rows")
        _write(run, "trainer/step-000003/meta.json", "A's")
        _write(run, "steps.jsonl", '{"step": 2}\n', True)
        return FENCED

    violations = _check(tmp_path, unfenced)
    assert any("[fencing] A after the thaw wrote 1 new files" in v for v in violations)
    assert any("[fencing] A after the thaw: 1 changed" in v for v in violations)
    assert any("[fencing] A after the thaw appended to the logs" in v for v in violations)


def test_a_stale_owner_that_went_on_or_said_more_fails(tmp_path):
    violations = _check(tmp_path, lambda run: "Traceback (most recent call last):")
    assert [v for v in violations if v.startswith("[fencing] A's stderr")]
