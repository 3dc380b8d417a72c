"""Owner epochs: one controller publishes. Two controllers race for real (OS processes) on a
local disk and on the local S3 test server (moto); a stale controller cannot publish, cannot
delete in retention and stops with a message naming the newer owner."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow.fs as pafs
import pytest

from rollout_recovery.data_plane import StagingStore, filesystem, ownership, retention, snapshot_io
from rollout_recovery.data_plane.ownership import Owner, OwnerFenced, OwnershipConflict
from rollout_recovery.errors import RecoveryError
from tests.cluster.store_helpers import (
    by_key,
    coordinator_without_engines,
    local_s3,
    replay_table,
)

pytestmark = pytest.mark.cluster


@pytest.fixture(params=["local", "s3"])
def root_uri(request, tmp_path) -> Iterator[str]:
    """A snapshot root on the local disk, or on a moto S3 server."""
    if request.param == "local":
        yield str(tmp_path / "snaps")
        return
    with local_s3("owners", f"{tmp_path.name}/data_plane") as uri:  # moto's state is global
        yield uri


def _fs(root_uri: str) -> tuple[pafs.FileSystem, str]:
    return filesystem.resolve(root_uri)


def _invariant_violations(log: ownership.OwnershipLog) -> list[str]:
    """Valid publish entries that follow a claim of a higher epoch (must be none)."""
    top, bad = 0, []
    for slot in sorted(log.entries):
        body = log.entries[slot]
        if body.kind == "claim":
            top = max(top, body.epoch)
        elif body.epoch < top:
            bad.append(f"slot {slot}: epoch {body.epoch} published after epoch {top} claimed")
    return bad


# ---------------------------------------------------------------- processes racing for real


def _slow_creates(delay_s: float) -> None:
    """Widen the window between reading the log and the create-only write (in a child
    process): both controllers then claim from the same reading."""
    real = ownership.create_only

    def slow(fs, path, data):
        time.sleep(delay_s)
        return real(fs, path, data)

    ownership.create_only = slow


def _meet_before_creating(meet) -> None:
    """Both claimers have read the log before either writes its entry (in a child process):
    every round is a race, whatever the load, not only the rounds a delay happens to overlap."""
    real = ownership.create_only

    def met(fs, path, data):
        meet.wait(timeout=60)
        return real(fs, path, data)

    ownership.create_only = met


def _claimer(root_uri: str, rounds: int, barrier, meet, out) -> None:
    fs, root = _fs(root_uri)
    _meet_before_creating(meet)
    results = []
    for _ in range(rounds):
        barrier.wait()
        try:
            owner = ownership.claim(fs, root)
            results.append(("won", owner.slot, owner.epoch, ""))
        except OwnershipConflict as err:
            results.append(("conflict", 0, 0, str(err)))
        barrier.wait()
    out.put(results)


def _run(target, args_per_proc: list[tuple], timeout: float = 120) -> list:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, out)) for args in args_per_proc]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=timeout) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    return results


def test_racing_claims_one_winner_per_slot(root_uri):
    """Two processes claim the same root at the same moment, round after round: each slot is
    won by exactly one claim, epochs grow with the slots, and a loser raises
    OwnershipConflict naming the winner."""
    rounds = 12
    barrier, meet = mp.get_context("spawn").Barrier(2), mp.get_context("spawn").Barrier(2)
    a, b = _run(_claimer, [(root_uri, rounds, barrier, meet)] * 2)
    log = ownership.read_log(*_fs(root_uri))
    assert not log.unreadable
    claims = log.claims()
    won = [r for r in a + b if r[0] == "won"]
    lost = [r for r in a + b if r[0] == "conflict"]
    assert sorted((s, e) for _, s, e, _ in won) == [(s, c.epoch) for s, c in claims]
    assert len(won) == rounds and len(lost) == rounds  # one winner per round: each raced
    epochs = [c.epoch for _, c in claims]
    assert epochs == sorted(set(epochs)), "one claim per epoch, growing with the slot"
    for _, _, _, message in lost:
        assert "claimed" in message and "at the same time" in message
        assert "stops without publishing or deleting anything" in message


def _first_claimer(root_uri: str, barrier, out) -> None:
    fs, root = _fs(root_uri)
    _slow_creates(0.02)
    barrier.wait()
    try:
        owner = ownership.claim(fs, root, first=True)
        out.put(("won", owner.slot, owner.epoch, ""))
    except OwnershipConflict as err:
        out.put(("refused", 0, 0, str(err)))


def test_a_fresh_run_is_refused_a_root_another_run_owns_or_is_claiming(root_uri):
    """Two fresh runs claim the same empty root at the same moment: one owns it, the other is
    refused naming it. A fresh run after that (the first has written nothing else) is refused
    too. A plain claim (a restore) would have taken the root over: that was the bug."""
    barrier = mp.get_context("spawn").Barrier(2)
    results = sorted(_run(_first_claimer, [(root_uri, barrier), (root_uri, barrier)]))
    assert [r[:3] for r in results] == [("refused", 0, 0), ("won", 1, 1)]
    log = ownership.read_log(*_fs(root_uri))
    [(slot, body)] = log.claims()
    winner = Owner.of(slot, body)
    assert f"is owned by another run: {winner.describe()}" in results[0][3]
    fs, root = _fs(root_uri)
    with pytest.raises(
        OwnershipConflict, match=f"owned by another run: epoch 1 .*pid {body.owner.pid}"
    ):
        ownership.claim(fs, root, first=True)
    assert ownership.read_log(fs, root).claims() == [(slot, body)]  # nothing was written
    assert ownership.claim(fs, root).epoch == 2  # without `first`, the root is taken over


def _empty_snapshot(fs, root: str, gen: int, owner: Owner | None) -> tuple[str, str]:
    """Publish one small real snapshot (a sidecar only) as `owner`; (name, sidecar bytes)."""
    _, path = snapshot_io.new_snapshot_dir(fs, root)
    data = b"generation %d" % gen
    side = snapshot_io.write_sidecar(fs, path, "ledger.json", data)
    body = snapshot_io.ManifestBody(
        snapshot_id=path.rsplit("-", 1)[-1], seq=gen, created_at=snapshot_io.now_iso(),
        num_shards=1, partitions={}, files=[], leases=[], payload_bytes=0, sidecars=[side],
    )  # fmt: skip
    snapshot_io.publish_manifest(fs, path, body, owner=owner)
    return path.rsplit("/", 1)[-1], data.decode()


def _claim_anew(fs, root: str) -> Owner:
    """Claim until a claim wins (the usurper may take the slot first)."""
    while True:
        with contextlib.suppress(OwnershipConflict):
            return ownership.claim(fs, root)


def _publisher(root_uri: str, attempts: int, barrier, done, out) -> None:
    """A controller that publishes again and again; fenced, it claims anew (as a restarted
    controller would) and goes on."""
    fs, root = _fs(root_uri)
    _slow_creates(0.005)
    barrier.wait()
    owner = _claim_anew(fs, root)
    published, fenced = [], 0
    for gen in range(attempts):
        try:
            published.append(_empty_snapshot(fs, root, gen, owner))
        except OwnerFenced:
            fenced += 1
            owner = _claim_anew(fs, root)
    done.set()
    out.put(("publisher", published, fenced))


def _usurper(root_uri: str, barrier, done, out) -> None:
    """Claims the root again and again while the publisher runs."""
    fs, root = _fs(root_uri)
    won, i = 0, 0
    barrier.wait()
    while not done.is_set() and i < 15:
        i += 1
        time.sleep(0.02 * (1 + i % 5))
        with contextlib.suppress(OwnershipConflict):
            ownership.claim(fs, root)
            won += 1
    out.put(("usurper", won, 0))


def test_racing_publications_and_claims_keep_the_invariant(root_uri):
    """A controller publishing while another keeps claiming: no publish entry of a lower epoch
    ever follows a claim, each publication that returned is published, the fenced ones are
    not, and every published snapshot verifies and restores its bytes."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    barrier, done = ctx.Barrier(2), ctx.Event()
    procs = [ctx.Process(target=_publisher, args=(root_uri, 24, barrier, done, out)),
             ctx.Process(target=_usurper, args=(root_uri, barrier, done, out))]  # fmt: skip
    for p in procs:
        p.start()
    try:
        got = {r[0]: r[1:] for r in (out.get(timeout=90), out.get(timeout=90))}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    published, fenced = got["publisher"]
    fs, root = _fs(root_uri)
    log = ownership.read_log(fs, root)
    assert not log.unreadable
    assert _invariant_violations(log) == []
    assert fenced > 0, "the usurper never fenced the publisher"
    listed = {_name(u) for u in snapshot_io.published_uris(root_uri)}
    assert listed == {name for name, _ in published} and published
    for name, data in published:
        uri = filesystem.child_uri(root_uri, name)
        manifest = StagingStore.verify(uri, use_cache=False)
        assert StagingStore.read_sidecar(uri, "ledger.json").decode() == data
        assert manifest.body.sidecars[0].name == "ledger.json"
    dirs = snapshot_io._list_snapshot_dirs(fs, root)
    assert all(d.why for d in dirs if d.has_manifest and not d.published)


# ---------------------------------------------------------------- a stale owner, a real store


def _snap(store: StagingStore, root_uri: str, gen: int, owner: Owner | None) -> str:
    store.put("replay", replay_table([f"gen{gen}/{j:03d}" for j in range(3)]))
    return store.snapshot(root_uri, sidecars={"ledger.json": b"%d" % gen}, owner=owner).uri


def _name(uri: str) -> str:
    return urlsplit(uri).path.rstrip("/").rsplit("/", 1)[-1]


def _dirs(root_uri: str) -> list[str]:
    fs, root = _fs(root_uri)
    return [d.name for d in snapshot_io._list_snapshot_dirs(fs, root)]


def test_a_stale_owner_cannot_publish_or_delete(make_store, root_uri):
    store = make_store(1)
    a = StagingStore.claim(root_uri)
    first = _snap(store, root_uri, 1, a)
    assert StagingStore.latest(root_uri) == first
    b = StagingStore.claim(root_uri)
    assert (b.epoch, b.slot) == (a.epoch + 1, a.slot + 2)

    with pytest.raises(OwnerFenced) as fenced:
        _snap(store, root_uri, 2, a)
    message = str(fenced.value)
    for part in (f"epoch {b.epoch}", f"host {b.host}", f"pid {b.pid}", b.claimed_at):
        assert part in message
    assert "stops without publishing or deleting anything" in message
    assert isinstance(fenced.value, RecoveryError)  # the CLI's one-line error, exit 1
    assert StagingStore.latest(root_uri) == first
    before = _dirs(root_uri)
    assert len(before) == 2, "A's attempt left an unpublished directory"

    with pytest.raises(OwnerFenced, match=f"epoch {b.epoch}"):
        StagingStore.gc(root_uri, keep_latest_k=1, owner=a)
    assert _dirs(root_uri) == before, "a fenced retention deletes nothing"

    second = _snap(store, root_uri, 3, b)
    expected = by_key(store.get("replay", store.list("replay"))[0])
    assert StagingStore.latest(root_uri) == second
    deleted = StagingStore.gc(root_uri, keep_latest_k=1, owner=b)
    assert len(deleted) == 2  # the first snapshot and A's unpublished attempt
    assert _dirs(root_uri) == [_name(second)]
    fresh = make_store(1)
    fresh.restore(second)
    assert by_key(fresh.get("replay", fresh.list("replay"))[0]).equals(expected)
    log = ownership.read_log(*_fs(root_uri))
    assert log.newest_claim() == b and _invariant_violations(log) == []
    assert min(log.entries) == b.slot, "entries before the kept snapshot were pruned"


def test_a_stale_publish_that_races_the_claim_loses_its_slot(root_uri):
    """A writer that read the log before the newer claim landed tries the slot that claim
    took: its create-only write loses, it re-reads and is fenced (nothing published)."""
    fs, root = _fs(root_uri)
    a = ownership.claim(fs, root)
    seen = ownership.prepare_publish(fs, root, a)
    b = ownership.claim(fs, root)
    with pytest.raises(OwnerFenced, match=f"epoch {b.epoch}"):
        ownership.publish_entry(fs, root, a, "snapshot-0000000001-0badf00d", "00", seen)
    log = ownership.read_log(fs, root)
    assert sorted(log.entries) == [a.slot, b.slot] and log.publications() == {}


def test_break_it_without_fencing_the_stale_publish_lands(tmp_path, monkeypatch):
    """With the fencing rule switched off, the stale controller's publication is accepted and
    becomes the latest snapshot: the checks above would catch that regression."""
    monkeypatch.setattr(ownership, "_outranks", lambda claim_epoch, epoch: False)
    fs, root = pafs.LocalFileSystem(), str(tmp_path / "snaps")
    a = ownership.claim(fs, root)
    ownership.claim(fs, root)
    name, _ = _empty_snapshot(fs, root, 1, a)
    assert snapshot_io.latest_published(fs, root).endswith(name)
    assert _invariant_violations(ownership.read_log(fs, root))


def test_an_unreadable_entry_after_the_claim_fails_closed(tmp_path):
    fs, root = pafs.LocalFileSystem(), str(tmp_path / "snaps")
    a = ownership.claim(fs, root)
    torn = Path(root) / "ownership" / ownership.entry_name(a.slot + 1)
    torn.write_bytes(b'{"body": {"slot": ')
    with pytest.raises(OwnerFenced, match=f"{torn.name} .*unreadable"):
        _empty_snapshot(fs, root, 1, a)
    with pytest.raises(OwnerFenced, match="unreadable"):
        retention.gc(fs, root, 1, a)
    assert snapshot_io.latest_published(fs, root) is None
    b = ownership.claim(fs, root)  # a new claim counts the unreadable slot as a possible claim
    assert b.epoch > a.slot + 1


def test_create_only_never_overwrites(root_uri):
    fs, root = _fs(root_uri)
    filesystem.make_dirs(fs, root)
    path = filesystem.join(root, "x.json")
    assert filesystem.create_only(fs, path, b"first") is True
    assert filesystem.create_only(fs, path, b"second") is False
    with fs.open_input_stream(path) as f:
        assert f.read() == b"first"


# ---------------------------------------------------------------- the coordinator stops


async def test_the_coordinator_stops_when_fenced(make_store, tmp_path):
    """A real CheckpointCoordinator (real store, real environment actor, no engines): once a
    newer controller claimed the run, its next checkpoint raises OwnerFenced at once, not a
    retried failure, and the checkpoint log says why."""
    run_dir = tmp_path / "run"
    with coordinator_without_engines(
        make_store(1), run_dir, "rollout_checkpointing.max_consecutive_failures=3"
    ) as (coordinator, _env, storage):
        first = await coordinator.counted("trainer_checkpoint")
        assert first is not None and StagingStore.latest(coordinator.snapshot_root)
        newer = StagingStore.claim(coordinator.snapshot_root)
        with pytest.raises(OwnerFenced) as fenced:
            await coordinator.counted("trainer_checkpoint")
        assert f"epoch {newer.epoch}" in str(fenced.value)
        assert f"pid {newer.pid}" in str(fenced.value)
        assert coordinator.failures_in_a_row == 0, "not counted as a retryable failure"
        assert StagingStore.latest(coordinator.snapshot_root) == first["checkpoint"]
        lines = storage.read_lines("checkpoints.jsonl")
        assert "fenced" in lines[-1] and f"epoch {newer.epoch}" in lines[-1]


@pytest.mark.parametrize("claimed_in", ["commit", "freeze", "freeze, unchecked"])
async def test_an_owner_paused_mid_attempt_writes_no_snapshot_file(
    make_store, tmp_path, claimed_in
):
    """The newer claim lands in the middle of an attempt, after the check at its start: while
    it commits the episodes (refused before the freeze makes the snapshot's directory) or while
    it freezes (refused before its shards write a file; the directory stays, empty and
    unpublished). Broken on purpose (the check before the write skipped), the stale owner's
    shards write the snapshot's files and only its publication is refused."""
    from rollout_recovery.data_plane.ownership import Fence

    def snapshot_files(root: str) -> dict[str, list[str]]:
        return {p.name: sorted(f.name for f in p.rglob("*") if f.is_file())
                for p in Path(root).iterdir() if p.name.startswith("snapshot-")}  # fmt: skip

    run_dir = tmp_path / "run"
    with coordinator_without_engines(make_store(1), run_dir) as (coordinator, env, storage):
        fenced = storage.fenced(Fence.of(coordinator.snapshot_root, coordinator.owner))
        coordinator.storage = fenced
        await coordinator.counted("trainer_checkpoint")
        first = snapshot_files(coordinator.snapshot_root)
        stage = (env, "commit") if claimed_in == "commit" else (coordinator.store, "afreeze")
        original = getattr(*stage)

        async def then_claimed(*args, **kwargs):
            out = await original(*args, **kwargs)
            StagingStore.claim(coordinator.snapshot_root)
            return out

        setattr(*stage, then_claimed)
        if claimed_in == "freeze, unchecked":
            check = fenced.check_owner
            fenced.check_owner = lambda doing: doing == "writing a snapshot" or check(doing)
        with pytest.raises(OwnerFenced) as refused:
            await coordinator.attempt("trainer_checkpoint")
        after = snapshot_files(coordinator.snapshot_root)
    new = {name: files for name, files in after.items() if name not in first}
    if claimed_in == "commit":
        assert "creating a snapshot" in str(refused.value) and new == {}
    elif claimed_in == "freeze":
        assert "writing a snapshot" in str(refused.value) and list(new.values()) == [[]]
    else:
        [files] = new.values()
        assert files, "the stale owner's snapshot files landed"
