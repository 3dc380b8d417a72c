from __future__ import annotations

import pytest

from rollout_recovery.data_plane import StagingStore, StoreLimits


@pytest.fixture
def make_store(ray_session):
    """Create stores that are killed after the test."""
    made: list[StagingStore] = []

    def make(num_shards: int = 1, limits: StoreLimits | None = None) -> StagingStore:
        store = StagingStore.create(num_shards=num_shards, limits=limits or StoreLimits())
        made.append(store)
        return store

    yield make
    for store in made:
        store.shutdown()
