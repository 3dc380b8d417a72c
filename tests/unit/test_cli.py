from __future__ import annotations

import subprocess
import sys

import pytest

from rollout_recovery.cli import build_parser, main

SUBCOMMANDS = ["make-tiny-model", "config", "demo", "train", "serve"]


def test_every_subcommand_is_listed_in_help():
    text = build_parser().format_help()
    for name in SUBCOMMANDS:
        assert name in text


@pytest.mark.parametrize("sub", [[], *([s] for s in SUBCOMMANDS)])
def test_help_exits_zero(sub):
    out = subprocess.run(
        [sys.executable, "-m", "rollout_recovery.cli", *sub, "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: rollout-recovery")


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
