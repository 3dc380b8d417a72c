from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rollout_recovery.config import (
    ConfigError,
    RolloutRecoveryConfig,
    dump_config,
    load_config,
)

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def _load(*overrides: str) -> RolloutRecoveryConfig:
    return load_config(None, list(overrides))


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        _load(*overrides)
    msg = str(info.value)
    assert "\n" not in msg, "config errors must be one line"
    return msg


def test_shipped_configs_load_and_validate():
    names = {p.name for p in CONFIGS}
    assert {
        "grpo_tiny_cpu.yaml",
        "prefix_recovery.yaml",
        "turn_recovery.yaml",
        "grpo_gpu.yaml",
    } <= names
    levels = {p.name: load_config(p).rollout_recovery.target_level for p in CONFIGS}
    assert levels["grpo_tiny_cpu.yaml"] == "none"
    assert levels["prefix_recovery.yaml"] == "prefix"
    assert levels["turn_recovery.yaml"] == "turn"
    gpu = load_config(REPO / "configs" / "grpo_gpu.yaml")
    assert gpu.vllm_cfg.device == "cuda" and gpu.vllm_cfg.kv_cache_memory_bytes is None


def test_extends_merges_base_under_file():
    cfg = load_config(REPO / "configs" / "prefix_recovery.yaml")
    base = load_config(REPO / "configs" / "grpo_tiny_cpu.yaml")
    assert cfg.token_capture.enabled and cfg.checkpointing.save_data_plane
    assert cfg.vllm_cfg == base.vllm_cfg
    assert cfg.grpo == base.grpo


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["rollout_recovery.target_level=turn"],
            "rollout_recovery.target_level=turn needs checkpointing.save_data_plane=true",
        ),
        (
            ["rollout_recovery.target_level=prefix", "token_capture.enabled=true"],
            "rollout_recovery.target_level=prefix needs checkpointing.save_data_plane=true",
        ),
        (
            ["rollout_recovery.target_level=prefix", "checkpointing.save_data_plane=true"],
            "rollout_recovery.target_level=prefix needs token_capture.enabled=true",
        ),
        (
            [
                "rollout_recovery.target_level=prefix",
                "checkpointing.save_data_plane=true",
                "token_capture.enabled=true",
                "policy.generation.top_logprobs=5",
            ],
            "refuses policy.generation.top_logprobs=5",
        ),
        (
            ["rollout_checkpointing.snapshot_attempt_interval_s=0"],
            "`rollout_checkpointing.snapshot_attempt_interval_s`: must be > 0 seconds",
        ),
        (
            ["token_capture.control_timeout_s=-1"],
            "`token_capture.control_timeout_s`: must be > 0 seconds",
        ),
        (
            ["rollout_checkpointing.keep_latest_k=0"],
            "`rollout_checkpointing.keep_latest_k`: must be >= 1",
        ),
        (
            [
                "rollout_recovery.target_level=prefix",
                "checkpointing.save_data_plane=true",
                "token_capture.enabled=true",
                "vllm_cfg.position_keyed_sampler=false",
            ],
            "needs vllm_cfg.position_keyed_sampler=true",
        ),
        (
            ["vllm_cfg.kv_cache_memory_bytes=null"],
            "vllm_cfg.kv_cache_memory_bytes must be set when vllm_cfg.device=cpu",
        ),
    ],
)
def test_cross_field_rules_name_key_and_fix(overrides, expected):
    msg = _error(*overrides)
    assert expected in msg
    # Every message says what to do about it.
    assert any(word in msg for word in ("set ", "use ", "must be")), msg


def test_cross_field_rules_accept_valid_combinations():
    turn = _load("rollout_recovery.target_level=turn", "checkpointing.save_data_plane=true")
    assert turn.rollout_recovery.target_level == "turn"
    prefix = _load(
        "rollout_recovery.target_level=prefix",
        "checkpointing.save_data_plane=true",
        "token_capture.enabled=true",
    )
    assert prefix.rollout_recovery.target_level == "prefix"
    # top-k logprobs are fine below prefix level.
    assert _load("policy.generation.top_logprobs=5").policy.generation.top_logprobs == 5


def test_unknown_keys_are_refused_with_their_path(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("vllm_cfg:\n  dtyp: float32\n")
    with pytest.raises(ConfigError, match=r"unknown key `vllm_cfg.dtyp`"):
        load_config(p)
    p.write_text("polcy:\n  model_path: tiny://default\n")
    with pytest.raises(ConfigError, match=r"unknown key `polcy`"):
        load_config(p)


def test_wrong_type_names_key():
    msg = _error("grpo.steps=many")
    assert "`grpo.steps`" in msg and "many" in msg
    msg = _error("vllm_cfg.dtype=float64")
    assert "`vllm_cfg.dtype`" in msg


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("grpo.steps", "write it as dotted.key=value"),
        ("=3", "write it as dotted.key=value"),
        ("grpo..steps=3", "write it as dotted.key=value"),
        ("grpo.stepz=3", "unknown key `grpo.stepz`"),
        ("grpo.steps.x=3", "unknown key `grpo.steps.x`"),
        ("policy.generation.seed=[1, ", "not valid YAML"),
    ],
)
def test_bad_overrides(override, expected):
    assert expected in _error(override)


def test_missing_model_path_fails_at_load(tmp_path):
    msg = _error(f"policy.model_path={tmp_path / 'nope'}")
    assert "`policy.model_path`" in msg and "make-tiny-model" in msg
    assert "unknown tiny model" in _error("policy.model_path=tiny://huge")
    assert "not `hf://<org>/<name>`" in _error("policy.model_path=hf://just-a-name")


def test_existing_model_path_is_resolved(tiny_model_dir):
    cfg = _load(f"policy.model_path={tiny_model_dir}")
    assert Path(cfg.policy.model_path) == tiny_model_dir.resolve()


def test_missing_or_bad_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML") as info:
        load_config(bad)
    assert "\n" not in str(info.value)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping of blocks"):
        load_config(bad)
    loop = tmp_path / "loop.yaml"
    loop.write_text("extends: loop.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(loop)


def test_yaml_plus_overrides_round_trip(tmp_path):
    cfg = load_config(
        REPO / "configs" / "grpo_tiny_cpu.yaml",
        [
            "grpo.steps=7",
            "grpo.learning_rate=3e-5",
            "policy.generation.temperature=0.7",
            "token_capture.enabled=true",
            "token_capture.control_auth_token=null",
            "checkpointing.checkpoint_dir=s3://bucket/run1",
        ],
    )
    assert cfg.grpo.steps == 7 and isinstance(cfg.grpo.steps, int)
    assert cfg.grpo.learning_rate == pytest.approx(3e-5)
    assert cfg.policy.generation.temperature == 0.7
    assert cfg.token_capture.enabled is True
    assert cfg.token_capture.control_auth_token is None
    assert cfg.checkpointing.checkpoint_dir == "s3://bucket/run1"
    out = tmp_path / "dumped.yaml"
    out.write_text(dump_config(cfg))
    again = load_config(out)
    assert again == cfg
    assert yaml.safe_load(out.read_text())["grpo"]["steps"] == 7


def test_assignment_is_validated_too():
    cfg = _load()
    with pytest.raises(ValueError):
        cfg.grpo.steps = 0


def test_prefix_supply_rules():
    msg = _error(
        "token_capture.supply_prefix_token_ids=true", "token_capture.request_token_ids=false"
    )
    assert "needs token_capture.request_token_ids=true" in msg
    msg = _error(
        "token_capture.supply_prefix_token_ids=true", "token_capture.use_completions_api=true"
    )
    assert "cannot be proven on the completions API" in msg
    assert _load("token_capture.supply_prefix_token_ids=true").token_capture.supply_prefix_token_ids


def test_multi_turn_episodes_need_prefix_supply():
    msg = _error("environment.max_turns=3")
    assert "environment.max_turns=3 needs token_capture.supply_prefix_token_ids=true" in msg
    cfg = _load("environment.max_turns=3", "token_capture.supply_prefix_token_ids=true")
    assert cfg.environment.max_turns == 3
    assert "environment.max_turns" in _error("environment.max_turns=0")
