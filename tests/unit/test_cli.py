from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rollout_recovery.cli import build_parser, main

SUBCOMMANDS = ["make-tiny-model", "config", "demo", "train", "serve", "gateway"]


def test_every_subcommand_is_listed_in_help():
    text = build_parser().format_help()
    for name in [*SUBCOMMANDS, "snapshots"]:
        assert name in text


def test_the_module_entry_point_prints_help():
    """`python -m rollout_recovery.cli` imports and runs (the rest of the help is in process)."""
    out = subprocess.run(
        [sys.executable, "-m", "rollout_recovery.cli", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: rollout-recovery")


@pytest.mark.parametrize(
    "sub", [*([s] for s in SUBCOMMANDS), *(["snapshots", a] for a in ("ls", "show", "verify"))]
)
def test_help_exits_zero(sub, capsys):
    with pytest.raises(SystemExit) as done:
        main([*sub, "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: rollout-recovery {' '.join(sub)}")


def test_config_command_prints_resolved_yaml(capsys):
    assert main(["config", "grpo.steps=9"]) == 0
    assert "steps: 9" in capsys.readouterr().out


def test_config_error_is_one_line_and_exit_2(capsys):
    assert main(["config", "vllm_cfg.num_wrkers=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown key `vllm_cfg.num_wrkers`" in err


def test_make_tiny_model_command(tmp_path, capsys):
    assert main(["make-tiny-model", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m" / "model.safetensors").is_file()
    assert "tiny model written" in capsys.readouterr().out


def test_config_explain_a_setting(capsys):
    assert main(["config", "--explain", "rollout_checkpointing.keep_latest_k"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "rollout_checkpointing.keep_latest_k"
    assert "  type: int" in lines
    assert "  default: 3" in lines
    assert "  constraints: >= 1" in lines
    assert "  in views: CheckpointCoordinatorConfig" in lines
    text = " ".join(out.split())
    assert "Snapshots to keep" in text and "trainer-checkpoint retention" in text


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (
            "vllm_cfg.device",
            ["  type: cpu | cuda", '  default: "cpu"', "  constraints: one of: cpu, cuda"],
        ),
        ("vllm_cfg.kv_cache_memory_bytes", ["  type: int or null", "  constraints: >= 1048576"]),
        ("policy.generation.top_p", ["  type: float", "  constraints: > 0 and <= 1"]),
        ("vllm_cfg.worker_resources", ["  type: mapping of str to float", "  default: {}"]),
        ("token_capture.control_auth_token", ["  type: str or null", "  default: null"]),
        ("grpo.seed", ["  type: int", "  constraints: none"]),
    ],
)
def test_config_explain_shows_types_defaults_and_choices(capsys, key, expected):
    assert main(["config", "--explain", key]) == 0
    lines = capsys.readouterr().out.splitlines()
    for line in expected:
        assert line in lines


def test_config_explain_a_block_lists_its_fields(capsys):
    from rollout_recovery.config import TokenCaptureConfig

    assert main(["config", "--explain", "token_capture"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("token_capture (block)\n")
    assert "Whether the workers record every generated token" in out
    rows = out.split("fields (")[1].splitlines()[1:]
    assert [r.split()[0] for r in rows] == list(TokenCaptureConfig.model_fields)
    assert all(len(r) <= 100 for r in rows), "one line per field"
    assert any(r.split()[0] == "enabled" and "Install token capture" in r for r in rows)


def test_config_explain_a_nested_block(capsys):
    assert main(["config", "--explain", "policy.generation"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("policy.generation (block)\n")
    assert "  temperature " in out and "  top_logprobs " in out


def test_config_explain_unknown_key_says_what_the_loader_says(capsys):
    assert main(["config", "--explain", "rollout_checkpointing.keep_latst_k"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "rollout-recovery: unknown key `rollout_checkpointing.keep_latst_k`; remove it or check "
        "its spelling; did you mean `rollout_checkpointing.keep_latest_k`?\n"
    )
    assert main(["config", "rollout_checkpointing.keep_latst_k=2"]) == 2
    assert "remove it or check its spelling; did you mean" in capsys.readouterr().err


def test_config_explain_refuses_overrides(capsys):
    assert main(["config", "--explain", "grpo.steps", "grpo.steps=3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "reads no KEY=VALUE overrides" in err


def test_config_explain_works_outside_the_repository(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "rollout_recovery.cli", "config", "--explain", "grpo.steps"],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("grpo.steps\n  type: int\n")


@pytest.mark.parametrize("action", ["ls", "show", "verify"])
def test_snapshots_with_nothing_there_is_one_line_and_exit_2(tmp_path, capsys, action):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "empty").mkdir()
    for target, said in [
        (tmp_path / "missing", "nothing at"),
        (tmp_path / "a-file", "is a file"),
        (tmp_path / "empty", "no snapshots under"),
        ("foo://bucket/run", "unknown storage scheme `foo://`"),
    ]:
        assert main(["snapshots", action, str(target)]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1, captured.err
        assert captured.err.startswith("rollout-recovery: ") and said in captured.err


def test_snapshots_of_an_unpublished_directory(tmp_path, capsys):
    """A directory without a manifest is listed and shown, but there is nothing to verify."""
    snap = tmp_path / "run" / "data_plane" / "snapshot-0000000001-0badf00d"
    (snap / "shard-000").mkdir(parents=True)
    (snap / "shard-000" / "replay.0000.arrow").write_bytes(b"12345")
    assert main(["snapshots", "ls", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().out.splitlines()[2].split() == [
        snap.name, "unpublished", "-", "-", "-", "-", "-", "5", "-", "-",
    ]  # fmt: skip
    assert main(["snapshots", "show", str(snap), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["status"] == "unpublished" and shown["files"][0]["bytes"] == 5
    assert main(["snapshots", "verify", str(snap)]) == 2
    assert "is not published (no MANIFEST.json); nothing to verify" in capsys.readouterr().err
    assert main(["snapshots", "show", str(tmp_path / "run"), "snapshot-0000000009-00000000"]) == 2
    assert "no snapshot snapshot-0000000009-00000000 under" in capsys.readouterr().err
    assert (snap / "shard-000" / "replay.0000.arrow").read_bytes() == b"12345"


def test_snapshots_at_an_unreachable_uri_is_the_one_line_storage_error(capsys):
    uri = "s3://user:secret@bucket/run?endpoint_override=127.0.0.1:1&scheme=http&region=us-east-1"
    assert main(["snapshots", "ls", uri]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rollout-recovery: cannot read s3://bucket/run")
    assert "secret" not in err


def test_gateway_refuses_a_location_holding_a_run_without_restore(tmp_path, capsys):
    """Nothing is started and nothing deleted: the one line names the fix."""
    (tmp_path / "data_plane" / "snapshot-0000000001-abcd").mkdir(parents=True)
    assert main(["gateway", f"checkpointing.checkpoint_dir={tmp_path}"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "`gateway --restore`" in err
    assert [p.name for p in (tmp_path / "data_plane").iterdir()] == ["snapshot-0000000001-abcd"]


def _published(root, ledger) -> str:
    """A published snapshot holding no rows and `ledger`, written without a store (the
    manifest, the ledger sidecar and the ownership log's publish entry)."""
    import pyarrow.fs as pafs

    from rollout_recovery.controller.selection import LEDGER
    from rollout_recovery.data_plane.snapshot_io import (
        ManifestBody,
        new_snapshot_dir,
        now_iso,
        publish_manifest,
        write_sidecar,
    )

    fs = pafs.LocalFileSystem()
    seq, path = new_snapshot_dir(fs, str(root))
    sidecar = write_sidecar(fs, path, LEDGER, ledger.to_json())
    meta = {"trainer_step": str(ledger.step), "reason": ledger.reason}
    body = ManifestBody(snapshot_id=path.rsplit("-", 1)[1], seq=seq, created_at=now_iso(),
                        num_shards=1, partitions={"replay": "replay_row"}, files=[], leases=[],
                        payload_bytes=0, sidecars=[sidecar], meta=meta)  # fmt: skip
    publish_manifest(fs, path, body)
    return path.rsplit("/", 1)[1]


def test_snapshots_ls_shows_partly_done_episodes_and_their_journaled_steps(tmp_path, capsys):
    """Per snapshot: the unfinished episodes its ledger records, how many are partly done
    (a step journaled) and their journaled steps by kind: what a restore answers from the
    journal instead of decoding or running effects again."""
    from rollout_recovery.protocol import EpisodeRecord, JournalStep, Ledger, ServedModel, TurnRef

    def step(kind: str, name: str, turn: int | None = None) -> JournalStep:
        return JournalStep(kind=kind, name=name, request_sha256="00" * 32, result={}, turn=turn)

    def episode(i: int, journal: list[JournalStep]) -> EpisodeRecord:
        turns = [TurnRef(entry_id=f"s0001-p000-g{i}/{s.name}/a0", payload_sha256="ef" * 32)
                 for s in journal if s.kind == "chat"]  # fmt: skip
        return EpisodeRecord(rollout_id=f"s0001-p000-g{i}", group_id="s0001-p000",
                             generation_index=i, seed=i, attempt=0, task={"messages": []},
                             journal=journal, turns=turns)  # fmt: skip

    model = ServedModel(base={"path": "tiny://default", "sha256": "ab" * 32}, weight_version=1,
                        weights_sha256="cd" * 32)  # fmt: skip
    root = tmp_path / "run" / "data_plane"
    idle = _published(root, Ledger(step=1, weight_version=1, reason="trainer_checkpoint",
                                   level="turn", model=model))  # fmt: skip
    journal = [step("chat", "c0", 0), step("effect", "tally"), step("chat", "c1", 1)]
    busy = _published(root, Ledger(step=1, weight_version=1, reason="cadence", level="turn",
                                   model=model,
                                   episodes=[episode(0, journal), episode(1, [])]))  # fmt: skip

    assert main(["snapshots", "ls", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out.splitlines()
    at = out.index("unfinished episodes (a restore answers their journaled steps from the "
                   "journal, then goes on):")  # fmt: skip
    assert out[at + 1].split() == [busy, "2", "unfinished", "1", "partly", "done", "3", "steps",
                                   "journaled", "(chat=2", "effect=1)"]  # fmt: skip
    assert out[at + 2].startswith("owner claims")  # the snapshot without episodes: not listed
    assert main(["snapshots", "ls", str(root), "--json"]) == 0
    listed = {s["name"]: s for s in json.loads(capsys.readouterr().out)["snapshots"]}
    assert (listed[idle]["episodes"], listed[idle]["partly_done"], listed[idle]["journaled"]) == (
        0, 0, {})  # fmt: skip
    assert (listed[busy]["episodes"], listed[busy]["partly_done"], listed[busy]["journaled"]) == (
        2, 1, {"chat": 2, "effect": 1})  # fmt: skip
    assert main(["snapshots", "show", str(root), busy]) == 0
    assert "2 unfinished, 2 turns committed, 3 steps journaled" in capsys.readouterr().out
    assert main(["snapshots", "ls", str(root / idle)]) == 0
    assert "unfinished episodes: none recorded" in capsys.readouterr().out.splitlines()
