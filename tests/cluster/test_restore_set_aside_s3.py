"""A restore's skipped snapshot set aside on S3 (the local moto server), as on a disk
(tests/unit/test_restore_set_aside.py): moved object by object through the run's storage
layer, it outlives the restored run's retention byte for byte, and the restore line names where
it went without credentials. No Ray."""

from __future__ import annotations

import hashlib

import pyarrow.fs as pafs
import pytest

from rollout_recovery.controller.selection import DATA_PLANE, select_snapshot
from rollout_recovery.storage import RunStorage
from rollout_recovery.trainer import run_plan
from rollout_recovery.trainer.set_aside import SET_ASIDE_DIR
from rollout_recovery.training.checkpoint import load_state
from tests.cluster.store_helpers import local_s3
from tests.unit.test_restore_set_aside import config, old_run

pytestmark = pytest.mark.cluster


def s3_tree(storage: RunStorage) -> dict[str, str]:
    """Every object under the location (relative) with its sha256."""
    base = storage.root.rstrip("/") + "/"
    selector = pafs.FileSelector(storage.root, recursive=True, allow_not_found=True)
    rels = [i.path[len(base) :] for i in storage.fs.get_file_info(selector)
            if i.type == pafs.FileType.File]  # fmt: skip
    return {rel: hashlib.sha256(storage.read_bytes(rel)).hexdigest() for rel in rels}


def test_a_skipped_snapshot_is_set_aside_on_s3_and_kept(capsys, tmp_path):
    with local_s3("rr-set-aside", "runs/a") as uri:
        run, newest = old_run(uri, "missing")
        before = s3_tree(run.storage)
        mine = {rel: sha for rel, sha in before.items()
                if rel.startswith((f"{DATA_PLANE}/{newest}/", "trainer/step-000003/",
                                   "batches/step-000003."))}  # fmt: skip
        assert len(mine) >= 6, mine
        plan, owner = run_plan.claim_restore(config(str(tmp_path)), run.storage)
        assert plan.step == 2 and len(plan.choice.skipped) == 1
        run_plan.announce(run.storage, plan)
        out = capsys.readouterr().out
        load_state(plan.checkpoint.files, run.model, run.opt)
        for step in range(3, 7):
            run.step(step, owner, "restored")

        after = s3_tree(run.storage)
        [where] = run.storage.list_dir(SET_ASIDE_DIR)
        for rel, sha in mine.items():
            assert after.get(f"{SET_ASIDE_DIR}/{where}/{rel}") == sha, rel
        assert not any(rel.startswith(f"{DATA_PLANE}/{newest}/") for rel in after)
        shown = f"s3://rr-set-aside/runs/a/{SET_ASIDE_DIR}/{where}"
        assert f"; set aside to {shown}/{DATA_PLANE}/{newest}\n" in out
        assert "testing:testing" not in out and f"Also set aside to {shown}: " in out
        choice = select_snapshot(run.storage.child_uri(SET_ASIDE_DIR, where, DATA_PLANE),
                                 "latest", "none")  # fmt: skip
        assert choice.ledger.step == 3 and choice.skipped == []
