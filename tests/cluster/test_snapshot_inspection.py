"""`rollout-recovery snapshots ls|show|verify` on real store snapshots: published, unpublished
and damaged directories are told apart, verification names the damaged file, and nothing is
ever changed. Local files and S3 (the local moto server)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_recovery.cli import main
from rollout_recovery.cli.inspection import list_snapshots, show_snapshot, verify_location
from rollout_recovery.controller.selection import DATA_PLANE, LEDGER
from rollout_recovery.data_plane.filesystem import resolve
from rollout_recovery.data_plane.snapshot_io import MANIFEST_NAME
from rollout_recovery.protocol import Continuation, EpisodeRecord, Ledger, ServedModel, TurnRef
from tests.cluster.store_helpers import local_s3, replay_table

pytestmark = pytest.mark.cluster
MODEL = ServedModel(base={"path": "tiny://default", "sha256": "ab" * 32}, weight_version=1,
                    weights_sha256="cd" * 32)  # fmt: skip
CUT = Continuation(call_id="c0", attempt=0, keys=["r-g0/c0/a0/c000000"], tokens=3,
                   digest="00" * 32, cut_kind="active_prefix")  # fmt: skip
UNCUT = Continuation(call_id="c1", attempt=1)
EPISODE = EpisodeRecord(
    rollout_id="r-g0", group_id="r", generation_index=0, seed=7, attempt=0,
    task={"messages": [{"role": "user", "content": "go"}]},
    turns=[TurnRef(entry_id="r-g0/c0/a0", payload_sha256="ef" * 32)],
    continuation=CUT,
)  # fmt: skip


def _snap(store, root: str, step: int, reason: str, with_work: bool = False) -> str:
    """A published snapshot whose ledger validates as `protocol.Ledger`; returns its URI."""
    store.put("replay", replay_table([f"r/{step}-{reason}"]))
    ledger = Ledger(
        step=step, weight_version=step, reason=reason, level="prefix", model=MODEL,
        episodes=[EPISODE] if with_work else [],
        continuations={"r-g0": CUT, "r-g1": UNCUT} if with_work else {},
    )  # fmt: skip
    return store.snapshot(
        root, meta={"trainer_step": str(step), "reason": reason},
        sidecars={LEDGER: ledger.to_json()},
    ).uri  # fmt: skip


@pytest.fixture(autouse=True)
def _no_cached_tiny_model(tmp_path, monkeypatch):
    """MODEL's digest is made up: `verify` compares it with the tiny model only where that is
    cached, so start without one (test_snapshot_verify.py covers the comparison)."""
    monkeypatch.setenv("ROLLOUT_RECOVERY_CACHE", str(tmp_path / "cache"))


def _verdicts(out: str) -> list[str]:
    """`verify`'s line per snapshot, without the checks indented under it."""
    return [line for line in out.splitlines() if not line.startswith(" ")]


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


@pytest.fixture
def good_run(make_store, tmp_path) -> tuple[Path, list[str]]:
    """A run directory with two good snapshots (the newer holds in-flight work)."""
    run = tmp_path / "run"
    store = make_store(2)
    first = _snap(store, str(run / DATA_PLANE), 1, "trainer_checkpoint")
    second = _snap(store, str(run / DATA_PLANE), 1, "cadence", with_work=True)
    return run, [first, second]


def test_ls_tells_published_unpublished_and_damaged_apart(good_run, make_store, capsys):
    run, (first, second) = good_run
    root = run / DATA_PLANE
    torn = Path(_snap(make_store(1), str(root), 2, "cadence"))
    (torn / MANIFEST_NAME).write_bytes((torn / MANIFEST_NAME).read_bytes()[:80])
    unpublished = root / "snapshot-0000000004-0badf00d"
    (unpublished / "shard-000").mkdir(parents=True)
    (unpublished / "shard-000" / "replay.0000.arrow").write_bytes(b"x" * 10)
    before = _tree(root)

    shown, snaps = list_snapshots(str(run))
    assert shown == str(root)
    assert [s.name for s in snaps] == [Path(first).name, Path(second).name, torn.name,
                                       unpublished.name]  # fmt: skip
    assert [s.status for s in snaps] == ["published", "published", "damaged", "unpublished"]
    a, b, c, d = snaps
    assert (a.step, a.reason, a.level, a.continuations) == (1, "trainer_checkpoint", "prefix", 0)
    assert (b.reason, b.continuations, b.rows["replay"]) == ("cadence", 2, 2)
    assert a.rows["replay"] == 1 and a.rows["rollout_staging"] == 0
    assert a.bytes == sum(len(v) for k, v in before.items() if k.startswith(a.name))
    assert "MANIFEST" in c.problem and c.step is None
    assert d.bytes == 10 and d.rows == {} and d.problem is None

    assert main(["snapshots", "ls", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"snapshots under {root} (newest last)"
    assert out[1].split() == ["NAME", "STATUS", "STEP", "REASON", "LEVEL", "ROWS",
                              "CONTINUATIONS", "BYTES", "EPOCH", "SLOT"]  # fmt: skip
    assert out[2].split()[:6] == [a.name, "published", "1", "trainer_checkpoint", "prefix",
                                  "replay=1"]  # fmt: skip
    assert out[3].split()[-4:] == ["2", str(b.bytes), "0", str(b.slot)]
    assert (a.epoch, a.slot, b.slot) == (0, 1, 2)  # published without an owner claim
    assert out[4].split()[:2] == [c.name, "damaged"] and "MANIFEST" in out[5]
    assert out[6].split()[:2] == [d.name, "unpublished"]

    assert main(["snapshots", "ls", str(root), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["root"] == str(root)
    assert [s["status"] for s in listed["snapshots"]] == [s.status for s in snaps]
    assert listed["snapshots"][1] == b.model_dump(mode="json")
    assert listed["claims"] == []
    assert _tree(root) == before  # looking changed nothing


def test_show_describes_files_sidecars_model_and_episodes(good_run, capsys):
    run, (_, second) = good_run
    detail = show_snapshot(str(run), Path(second).name)
    assert detail == show_snapshot(second)  # by name under the run, or the directory itself
    assert detail == show_snapshot(str(run))  # the newest
    assert detail.status == "published" and detail.num_shards == 2
    manifest = json.loads((Path(second) / MANIFEST_NAME).read_text())["body"]
    assert [(f.path, f.rows, f.bytes) for f in detail.files] == [
        (f["path"], f["rows"], f["bytes"]) for f in manifest["files"]
    ]
    assert [f.sha256 for f in detail.files] == [m["sha256"][:12] for m in manifest["files"]]
    assert [s.name for s in detail.sidecars] == [LEDGER]
    ledger = detail.ledger
    assert ledger.model == MODEL and (ledger.episodes, ledger.turns) == (1, 1)
    assert [(c.rollout_id, c.cut, c.tokens) for c in ledger.continuations] == [
        ("r-g0", True, 3),
        ("r-g1", False, None),
    ]

    assert main(["snapshots", "show", str(run), Path(second).name, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == detail.model_dump(mode="json")
    assert main(["snapshots", "show", second]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{Path(second).name}  published\n")
    assert "tiny://default (weights sha256 abababababab)" in out
    assert "1 unfinished, 1 turns committed" in out
    assert "r-g0  call c0 attempt 0  resumes from 3 tokens (active_prefix)" in out
    assert "r-g1  call c1 attempt 1  decoded again" in out
    assert f"sidecars (1):\n  {LEDGER}  " in out


def test_verify_passes_good_snapshots_and_names_a_flipped_data_file(good_run, capsys):
    run, (first, second) = good_run
    assert main(["snapshots", "verify", str(run)]) == 0
    out = capsys.readouterr().out
    lines = _verdicts(out)
    assert [ln.split() for ln in lines] == [[Path(first).name, "ok"], [Path(second).name, "ok"]]
    # What a restore needs beyond the files: step 1 of a run without trainer checkpoints.
    assert "    trainer checkpoint  not checked: the run keeps no trainer checkpoints" in out
    assert "    model               not checked: recorded tiny://default" in out

    arrow = sorted(Path(first).rglob("*.arrow"))[0]
    _flip_byte(arrow)  # same size: only reading every byte finds it
    before = _tree(run)
    rel = str(arrow.relative_to(first))
    assert main(["snapshots", "verify", str(run)]) == 1
    lines = _verdicts(capsys.readouterr().out)
    assert lines[0].split(None, 1) == [Path(first).name, f"DAMAGED: {rel}: fails its sha256 check"]
    assert lines[1].split() == [Path(second).name, "ok"]
    assert [r.ok for r in verify_location(first)] == [False]
    assert main(["snapshots", "verify", str(run), Path(second).name]) == 0
    capsys.readouterr()
    # `ls` reads manifests and ledgers only: a flipped byte in a data file is verify's to find.
    assert list_snapshots(str(run))[1][0].status == "published"
    assert _tree(run) == before  # nothing repaired, moved or deleted


def test_verify_names_a_damaged_sidecar_and_ls_sees_it(good_run, capsys):
    run, (_, second) = good_run
    _flip_byte(Path(second) / "sidecars" / LEDGER)
    assert main(["snapshots", "verify", str(run), "--json"]) == 1
    results = json.loads(capsys.readouterr().out)
    assert [r["ok"] for r in results] == [True, False]
    assert results[1]["file"] == f"sidecars/{LEDGER}"
    assert results[1]["reason"] == "fails its sha256 check"
    second_ls = list_snapshots(str(run))[1][1]
    assert second_ls.status == "damaged" and LEDGER in second_ls.problem


def test_verify_a_torn_manifest_and_a_missing_file(good_run, capsys):
    run, (first, second) = good_run
    (Path(second) / MANIFEST_NAME).write_text("{")
    next(Path(first).rglob("*.arrow")).unlink()
    assert main(["snapshots", "verify", str(run)]) == 1
    lines = _verdicts(capsys.readouterr().out)
    assert "DAMAGED: shard-" in lines[0] and lines[0].endswith(": missing")
    assert f"DAMAGED: {MANIFEST_NAME}: " in lines[1]


def test_the_command_line_end_to_end(good_run, tmp_path):
    run, (first, _) = good_run
    script = Path(sys.executable).parent / "rollout-recovery"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "rollout_recovery.cli"]

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*cmd, "snapshots", *args], capture_output=True, text=True,
                              check=False, cwd=tmp_path)  # fmt: skip

    out = cli("ls", str(run))
    assert out.returncode == 0 and out.stdout.count("published") == 2, out.stderr
    assert cli("verify", str(run)).returncode == 0
    _flip_byte(next(Path(first).rglob("*.arrow")))
    out = cli("verify", str(run))
    assert out.returncode == 1 and "DAMAGED: shard-" in out.stdout, out.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    out = cli("verify", str(empty))
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (
        f"rollout-recovery: no snapshots under {empty} (nor under its data_plane/); give a run's "
        "checkpoint directory, a snapshot root or a snapshot directory\n"
    )


@pytest.fixture(scope="module")
def s3_run():
    with local_s3("rr-inspect", "runs/a") as uri:
        yield uri


def test_s3_ls_show_and_verify(make_store, s3_run, capsys):
    from rollout_recovery.data_plane.filesystem import child_uri

    fs, _ = resolve(s3_run)
    fs.create_dir("rr-inspect")
    store = make_store(1)
    root = child_uri(s3_run, DATA_PLANE)
    uri = _snap(store, root, 3, "cadence", with_work=True)
    name = uri.split("?")[0].rsplit("/", 1)[-1]

    assert main(["snapshots", "ls", s3_run]) == 0
    out = capsys.readouterr().out
    assert out.startswith("snapshots under s3://rr-inspect/runs/a/data_plane (newest last)\n")
    assert f"{name}  published" in out
    assert main(["snapshots", "show", s3_run, name, "--json"]) == 0
    detail = json.loads(capsys.readouterr().out)
    assert detail["location"] == f"s3://rr-inspect/runs/a/data_plane/{name}"
    assert detail["ledger"]["continuations"][0]["tokens"] == 3
    assert main(["snapshots", "verify", s3_run]) == 0
    assert _verdicts(capsys.readouterr().out) == [f"{name}  ok"]

    manifest = json.loads(fs.open_input_stream(f"rr-inspect/runs/a/data_plane/{name}/"
                                               f"{MANIFEST_NAME}").read())  # fmt: skip
    rel = manifest["body"]["files"][0]["path"]
    path = f"rr-inspect/runs/a/data_plane/{name}/{rel}"
    data = bytearray(fs.open_input_stream(path).read())
    data[-1] ^= 0xFF
    with fs.open_output_stream(path) as f:
        f.write(bytes(data))
    assert main(["snapshots", "verify", s3_run]) == 1
    captured = capsys.readouterr()
    assert captured.out.strip() == f"{name}  DAMAGED: {rel}: fails its sha256 check"
    assert "testing:testing" not in captured.out + captured.err + out
