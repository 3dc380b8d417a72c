"""`rollout-recovery snapshots verify` checks what a restore needs outside the snapshot too, so
`ok` means restorable: the trainer checkpoint the ledger pairs with (complete, its sha256, the
weights the snapshot's calls were decoded with) and the ledger's model identity (well-formed;
the model given, or the one the ledger names when it is on this machine). Snapshots built
without Ray or a store, as `snapshots ls` is tested in test_cli.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rollout_recovery.cli import main
from rollout_recovery.model_identity import base_model_identity
from rollout_recovery.protocol import Ledger, ServedModel
from rollout_recovery.storage import RunStorage
from rollout_recovery.trainer import trainer_checkpoints
from rollout_recovery.training.checkpoint import state_files
from tests.unit.test_cli import _published


@pytest.fixture(autouse=True)
def _no_cached_tiny_model(tmp_path, monkeypatch):
    """The tiny model is compared only when it is cached on this machine: start with none."""
    monkeypatch.setenv("ROLLOUT_RECOVERY_CACHE", str(tmp_path / "cache"))


def _model_dir(where: Path, seed: int) -> Path:
    """A local model directory: config.json and the weights of `seed`."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "config.json").write_text('{"model_type": "toy"}')
    gen = torch.Generator().manual_seed(seed)
    save_file({"w": torch.randn(4, 4, generator=gen)}, str(where / "model.safetensors"))
    return where


def _trainer_checkpoint(run: Path, step: int) -> str:
    """A real trainer checkpoint of `step` under the run; returns its digest."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    files = state_files(model, opt)
    return trainer_checkpoints.save(RunStorage(str(run)), step, files, {}, None)["digest"]


def _ledger(step: int, paired: str | None, base: dict) -> Ledger:
    model = ServedModel(base=base, weight_version=step, weights_sha256=None)
    return Ledger(step=step, weight_version=step, reason="trainer_checkpoint", level="turn",
                  model=model, trainer_checkpoint=paired)  # fmt: skip


def _verify(capsys, *args: str) -> tuple[int, list[str], list[dict]]:
    """(exit status, the text lines, the JSON results) of `snapshots verify ARGS`."""
    code = main(["snapshots", "verify", *args])
    lines = capsys.readouterr().out.splitlines()
    assert main(["snapshots", "verify", *args, "--json"]) == code
    return code, lines, json.loads(capsys.readouterr().out)


@pytest.fixture
def run(tmp_path) -> tuple[Path, dict, str]:
    """A run directory holding the trainer checkpoint of step 1, and the local model it was
    started with: (run, the model's identity, the checkpoint's model digest)."""
    model = _model_dir(tmp_path / "model", seed=0)
    run = tmp_path / "run"
    return run, base_model_identity(str(model), str(model)), _trainer_checkpoint(run, 1)


def test_a_restorable_snapshot_is_ok_and_says_what_was_checked(run, capsys):
    run, identity, weights = run
    name = _published(run / "data_plane", _ledger(1, weights, identity))
    code, lines, [result] = _verify(capsys, str(run))
    assert code == 0
    assert lines[0].split() == [name, "ok"]
    assert lines[1].split()[:2] == ["ledger", "ok:"] and "step 1" in lines[1]
    assert lines[2].startswith("    trainer checkpoint  ok: ")
    assert f"{run}/trainer/step-000001: complete" in lines[2] and weights[:12] in lines[2]
    assert (
        lines[3].startswith("    model               ok: ") and identity["sha256"][:12] in lines[3]
    )
    assert result["ok"] and result["reason"] is None
    assert [result[k]["status"] for k in ("ledger", "trainer_checkpoint", "model")] == ["ok"] * 3


def test_a_missing_trainer_checkpoint_is_not_restorable(run, capsys):
    run, identity, weights = run
    fine = _published(run / "data_plane", _ledger(1, weights, identity))
    ahead = _published(run / "data_plane", _ledger(2, weights, identity))  # no step-000002
    code, lines, results = _verify(capsys, str(run))
    assert code == 1
    assert lines[0].split() == [fine, "ok"]
    at = lines.index(f"{ahead}  NOT RESTORABLE: trainer_checkpoint_missing")
    assert lines[at + 2].startswith("    trainer checkpoint  trainer_checkpoint_missing: ")
    assert (
        "trainer checkpoint of step 2" in lines[at + 2] and "missing or incomplete" in lines[at + 2]
    )
    assert [r["ok"] for r in results] == [True, False]
    assert results[1]["reason"] == "trainer_checkpoint_missing" and results[1]["file"] is None
    assert results[1]["trainer_checkpoint"]["status"] == "failed"
    # An incomplete checkpoint (its meta.json, written last, absent) is missing as well.
    (run / "trainer" / "step-000001" / "meta.json").unlink()
    code, _, results = _verify(capsys, str(run), fine)
    assert code == 1 and results[0]["reason"] == "trainer_checkpoint_missing"


def test_another_or_an_altered_trainer_checkpoint_is_not_restorable(run, capsys):
    run, identity, weights = run
    name = _published(run / "data_plane", _ledger(1, "ee" * 32, identity))
    code, lines, [result] = _verify(capsys, str(run))
    assert code == 1
    assert lines[0] == f"{name}  NOT RESTORABLE: trainer_checkpoint_differs"
    assert f"has digest {weights[:12]}, the snapshot was paired with eeeeeeeeeeee" in lines[2]
    assert result["trainer_checkpoint"]["code"] == "trainer_checkpoint_differs"
    assert result["model"]["status"] == "ok"  # the other checks still ran

    good = _published(run / "data_plane", _ledger(1, weights, identity))
    state = run / "trainer" / "step-000001" / "state.safetensors"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x01
    state.write_bytes(bytes(data))
    code, lines, [result] = _verify(capsys, str(run), good)
    assert code == 1 and lines[0] == f"{good}  NOT RESTORABLE: trainer_checkpoint_damaged"
    assert "fails its sha256 check" in result["trainer_checkpoint"]["detail"]


def test_another_model_than_the_ledgers_is_not_restorable(run, tmp_path, capsys):
    run, identity, weights = run
    name = _published(run / "data_plane", _ledger(1, weights, identity))
    other = _model_dir(tmp_path / "other", seed=1)
    code, lines, [result] = _verify(capsys, str(run), "--model", str(other))
    assert code == 1 and lines[0] == f"{name}  NOT RESTORABLE: model_differs"
    assert result["model"]["code"] == "model_differs"
    assert f"policy.model_path={other} has sha256" in result["model"]["detail"]
    assert result["trainer_checkpoint"]["status"] == "ok"
    # The run's config names the model; --model wins over it.
    config = tmp_path / "run.yaml"
    config.write_text(f"policy:\n  model_path: {other}\n")
    assert _verify(capsys, str(run), "--config", str(config))[0] == 1
    assert _verify(capsys, str(run), "--config", str(config), "--model", identity["path"])[0] == 0
    # Without either, the model the ledger names, here on this machine, is compared: its
    # weights changed since the snapshot.
    assert _verify(capsys, str(run))[0] == 0
    weights_file = _model_dir(Path(identity["path"]), seed=2) / "model.safetensors"
    later = weights_file.stat().st_mtime_ns + 10**9  # not the digest this process remembers
    os.utime(weights_file, ns=(later, later))
    code, lines, [result] = _verify(capsys, str(run))
    assert code == 1 and lines[0] == f"{name}  NOT RESTORABLE: model_differs"
    # A model that cannot be loaded is a configuration error, as for train.
    assert main(["snapshots", "verify", str(run), "--model", str(tmp_path / "nowhere")]) == 2
    assert "no model at" in capsys.readouterr().err


def test_a_malformed_model_identity_is_not_restorable(run, capsys):
    run, identity, weights = run
    name = _published(run / "data_plane", _ledger(1, weights, identity | {"sha256": "xyz"}))
    code, lines, [result] = _verify(capsys, str(run))
    assert code == 1 and lines[0] == f"{name}  NOT RESTORABLE: model_identity_malformed"
    assert result["model"]["detail"] == "model.base.sha256 is 'xyz', not a sha256 (64 hex digits)"


def test_what_does_not_apply_is_not_an_error_and_says_why(tmp_path, capsys):
    """A run without trainer checkpoints (a standalone gateway), step 0, a snapshot root
    outside a run directory, a hub model, the tiny model not built here: ok, not checked."""
    gateway = tmp_path / "gateway-run"
    hub = {"path": "hf://org/model", "sha256": None}
    later = _published(gateway / "data_plane", _ledger(3, "cd" * 32, hub))
    code, lines, [result] = _verify(capsys, str(gateway))
    assert code == 0 and lines[0].split() == [later, "ok"]
    assert lines[2] == (
        "    trainer checkpoint  not checked: the run keeps no trainer checkpoints (no trainer/ "
        f"or steps.jsonl in {gateway}): a standalone gateway's, or a trainer of your own whose "
        "checkpoints are not paired here"
    )
    assert lines[3].startswith("    model               not checked: recorded hf://org/model ")
    assert "a hub model, which a restore compares by name" in lines[3]
    assert result["trainer_checkpoint"]["status"] == result["model"]["status"] == "not_checked"
    # A hub model given is compared by name, as a restore does.
    assert _verify(capsys, str(gateway), "--model", "hf://org/model")[0] == 0
    assert _verify(capsys, str(gateway), "--model", "hf://org/other")[0] == 1

    tiny = {"path": "tiny://default", "sha256": "ab" * 32}
    first = _published(tmp_path / "snaps", _ledger(0, None, tiny))
    code, lines, [result] = _verify(capsys, str(tmp_path / "snaps" / first))
    assert code == 0
    assert result["trainer_checkpoint"]["detail"] == (
        "step 0: the base weights; no trainer checkpoint pairs with it"
    )
    assert "tiny://default is not built on this machine" in result["model"]["detail"]
    second = _published(tmp_path / "snaps", _ledger(2, "cd" * 32, tiny))
    code, _, [result] = _verify(capsys, str(tmp_path / "snaps"), second)
    assert code == 0 and result["trainer_checkpoint"]["detail"].startswith(
        f"{tmp_path / 'snaps'} is not a run's data_plane/"
    )


def test_a_ledger_this_version_does_not_restore_is_not_restorable(tmp_path, capsys):
    old = _ledger(0, None, {"path": "hf://org/model", "sha256": None}).model_copy(
        update={"format": 2}
    )
    name = _published(tmp_path / "run" / "data_plane", old)
    code, lines, [result] = _verify(capsys, str(tmp_path / "run"))
    assert code == 1 and lines[0] == f"{name}  NOT RESTORABLE: ledger_unrestorable"
    assert "its ledger has format 2" in lines[1]
    assert result["trainer_checkpoint"] is None and result["model"] is None
