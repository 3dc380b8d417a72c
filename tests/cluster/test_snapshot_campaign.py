"""The snapshot-file campaign (issue 13, item 2), reduced: every damaged file of the newest
snapshot is either refused with a reason naming it (and the previous snapshot restored
exactly) or harmless; never silently wrong. A break-it run proves the campaign can fail."""

from __future__ import annotations

import hashlib

import pytest

from rollout_recovery.data_plane import StagingStore, filesystem, snapshot_io
from rollout_recovery.testing.campaign import snapshot_files as campaign

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def store(ray_session):
    made = StagingStore.create(num_shards=2, partitions=campaign.PARTITIONS)
    yield made
    made.shutdown()


def test_reduced_campaign_has_no_silent_corruption(store, tmp_path):
    history = campaign.build_history(store, str(tmp_path / "snaps"))
    result = campaign.run_campaign(
        history, campaign.store_restorer(store), data_flips=32, data_prefixes=64
    )
    print(result.table())
    assert result.silent_corruption == 0, result.silent[:5]
    assert result.unexpected == [] and result.unnamed_reasons == []
    counts = result.counts
    assert counts["control"]["restored_exact"] == len(result.files) == 7
    for klass in ("byte_prefix", "bit_flip_meta", "bit_flip_data"):
        assert counts[klass]["refused_fell_back"] == sum(counts[klass].values()) > 0, klass
    # Every byte prefix and every flip of the manifest, the ledger and B's ownership log entry
    # (a damaged entry leaves B unpublished: reported, and A restored) were run.
    meta = {rel: n for rel, n in result.files.items() if not campaign.is_data(rel)}
    assert history.b_entry.startswith("ownership/")
    assert set(meta) == {"MANIFEST.json", "sidecars/ledger.json", history.b_entry}
    assert counts["bit_flip_meta"]["refused_fell_back"] == sum(meta.values())
    assert set(result.data_flip_offsets.values()) == {32}
    assert result.to_json()["silent_corruption"] == 0


def test_campaign_reports_silent_corruption_when_checksums_are_skipped(
    store, tmp_path, monkeypatch
):
    """With the data-file checksum checks made no-ops, flipped bits reach the restored rows:
    the campaign must count them as silent corruption."""
    history = campaign.build_history(store, str(tmp_path / "snaps"))
    real_read = snapshot_io.read_verified

    def read_unchecked(fs, snapshot_dir, entry):
        with open(filesystem.join(snapshot_dir, entry.path), "rb") as f:
            data = f.read()
        lax = entry.model_copy(update={"sha256": hashlib.sha256(data).hexdigest()})
        return real_read(fs, snapshot_dir, lax)

    monkeypatch.setattr(snapshot_io, "_check_file", lambda fs, snapshot_dir, entry: None)
    monkeypatch.setattr(snapshot_io, "read_verified", read_unchecked)
    sizes = {rel: len(b) for rel, b in campaign.snapshot_files(history.b_dir).items()}
    cases = [c for c in campaign.generate_cases(sizes, 16) if c.klass == "bit_flip_data"]
    assert len(cases) == 4 * 16
    result = campaign.run_campaign(history, campaign.file_restorer, cases=cases)
    print(result.table())
    assert result.silent_corruption > 0, result.table()
    assert any("restored data differs" in s["detail"] for s in result.silent)
