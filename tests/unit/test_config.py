from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args, get_origin

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
import yaml
from pydantic import BaseModel

from rollout_recovery.config import (
    COMPONENT_VIEWS,
    CheckpointCoordinatorConfig,
    CheckpointingConfig,
    ConfigError,
    EnvironmentActorConfig,
    GenerationConfig,
    RolloutCheckpointingConfig,
    RolloutRecoveryConfig,
    WorkerConfig,
    dump_config,
    load_config,
    lookup_key,
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
    # A real Qwen3 on the GPU node and the tiny one here call tools the same way.
    qwen = load_config(REPO / "configs" / "qwen3_prefix_cpu.yaml")
    assert gpu.policy.model_path.startswith("hf://Qwen/Qwen3-")
    assert qwen.policy.model_path == "tiny://qwen3" and levels["qwen3_prefix_cpu.yaml"] == "prefix"
    assert qwen.vllm_cfg.tool_call_parser == gpu.vllm_cfg.tool_call_parser == "hermes"


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


@pytest.mark.parametrize(
    ("location", "scheme"),
    [
        ("foo://bucket/run", "foo"),
        ("s3a://bucket/run", "s3a"),
        ("http://host/run", "http"),
        ("S3://bucket/run", "S3"),
        ("runs/a://b", "runs/a"),
    ],
)
def test_checkpoint_dir_refuses_unknown_scheme(location, scheme):
    msg = _error(f"checkpointing.checkpoint_dir={location}")
    assert "`checkpointing.checkpoint_dir`" in msg
    assert f"unknown storage scheme `{scheme}://`" in msg
    assert "s3://" in msg and "gs://" in msg and "local path" in msg


@pytest.mark.parametrize(
    "location",
    [
        "runs/x",
        "~/runs/x",
        "../runs/x",
        "/tmp/runs/x",
        "file:///tmp/runs/x",
        "local:///tmp/runs/x",
        "s3://bucket/run?endpoint_override=localhost:9000",
        "gs://bucket/run",
        "gcs://bucket/run",
        "hdfs://namenode:8020/run",
        "viewfs://cluster/run",
        "abfs://container@account.dfs.core.windows.net/run",
        "abfss://container@account.dfs.core.windows.net/run",
    ],
)
def test_checkpoint_dir_accepts_local_paths_and_pyarrow_uris(location):
    # Local paths stay exactly as written (not resolved): the run resolves them where it runs.
    cfg = _load(f"checkpointing.checkpoint_dir={location}")
    assert cfg.checkpointing.checkpoint_dir == location


def test_refused_schemes_are_unknown_to_pyarrow_too():
    # pyarrow.fs is the source of truth; only offline-safe schemes are opened here.
    for uri in ("foo://bucket/run", "s3a://bucket/run", "S3://bucket/run"):
        with pytest.raises(pa.ArrowInvalid, match="Unrecognized filesystem type"):
            pafs.FileSystem.from_uri(uri)
    for uri in ("file:///tmp/x", "local:///tmp/x"):
        assert pafs.FileSystem.from_uri(uri)[1] == "/tmp/x"


def _mentions(annotation: Any, kind: type) -> bool:
    return annotation is kind or any(_mentions(arg, kind) for arg in get_args(annotation))


def _number_fields(
    model: type[BaseModel] = RolloutRecoveryConfig, prefix: str = ""
) -> Iterator[tuple[str, type, bool]]:
    """(dotted key, int or float, whether it is a mapping of them) for every numeric field."""
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _number_fields(annotation, f"{prefix}{name}.")
        elif _mentions(annotation, float) or _mentions(annotation, int):
            kind = float if _mentions(annotation, float) else int
            yield f"{prefix}{name}", kind, get_origin(annotation) is dict


NUMBER_FIELDS = list(_number_fields())
FLOAT_FIELDS = [(key, is_map) for key, kind, is_map in NUMBER_FIELDS if kind is float]


def test_field_discovery_sees_every_kind_of_number():
    keys = {key for key, _, _ in NUMBER_FIELDS}
    assert {
        "grpo.steps",
        "vllm_cfg.kv_cache_memory_bytes",
        "vllm_cfg.worker_resources",
        "rollout_checkpointing.attempt_timeout_s",
        "policy.generation.seed",
    } <= keys
    assert ("vllm_cfg.worker_resources", True) in FLOAT_FIELDS


@pytest.mark.parametrize("raw", [".nan", ".inf", "-.inf", "nan"])
@pytest.mark.parametrize(("key", "is_map"), FLOAT_FIELDS, ids=[k for k, _ in FLOAT_FIELDS])
def test_every_float_field_refuses_nan_and_inf(key, is_map, raw):
    msg = _error(f"{key}={{GPU: {raw}}}" if is_map else f"{key}={raw}")
    assert f"`{key}" in msg and "must be a finite number, not NaN or infinity" in msg


@pytest.mark.parametrize(
    "override",
    [
        "rollout_checkpointing.attempt_timeout_s=.nan",
        "rollout_checkpointing.attempt_timeout_s=.inf",
        "token_capture.control_timeout_s=.inf",
        "grpo.learning_rate=.nan",
    ],
)
def test_reported_nan_and_inf_cases_are_refused(override):
    key = override.partition("=")[0]
    assert f"`{key}`: must be a finite number, not NaN or infinity" in _error(override)


@pytest.mark.parametrize("raw", ["true", "off"])
@pytest.mark.parametrize(
    ("key", "kind", "is_map"), NUMBER_FIELDS, ids=[k for k, _, _ in NUMBER_FIELDS]
)
def test_every_number_field_refuses_booleans(key, kind, is_map, raw):
    msg = _error(f"{key}={{GPU: {raw}}}" if is_map else f"{key}={raw}")
    assert f"`{key}" in msg and "must be a number, not true/false" in msg


@pytest.mark.parametrize(
    "override",
    [
        "grpo.steps=true",
        "vllm_cfg.num_workers=true",
        "vllm_cfg.worker_resources={GPU: true}",
        "rollout_checkpointing.attempt_timeout_s=yes",
    ],
)
def test_reported_boolean_cases_are_refused(override):
    key = override.partition("=")[0]
    assert f"`{key}" in _error(override) and "must be a number, not true/false" in _error(override)


def test_numbers_still_load_where_numbers_are_expected():
    cfg = _load(
        "rollout_checkpointing.attempt_timeout_s=5",
        "grpo.steps='3'",
        "grpo.learning_rate=3e-5",
        "vllm_cfg.worker_resources={GPU: 1, node_a: 0.5}",
        "vllm_cfg.kv_cache_memory_bytes=null",
        "vllm_cfg.device=cuda",
    )
    timeout = cfg.rollout_checkpointing.attempt_timeout_s
    assert timeout == 5.0 and isinstance(timeout, float)
    assert cfg.grpo.steps == 3 and isinstance(cfg.grpo.steps, int)
    assert cfg.grpo.learning_rate == pytest.approx(3e-5)
    assert cfg.vllm_cfg.worker_resources == {"GPU": 1.0, "node_a": 0.5}
    assert cfg.vllm_cfg.kv_cache_memory_bytes is None


def test_assignment_refuses_booleans_and_nan():
    cfg = _load()
    with pytest.raises(ValueError, match="not true/false"):
        cfg.grpo.steps = True
    with pytest.raises(ValueError, match="finite number"):
        cfg.grpo.learning_rate = float("nan")


@pytest.mark.parametrize(
    ("yaml_text", "override", "key", "suggestion"),
    [
        ("vllm_cfg:\n  dtyp: x\n", "vllm_cfg.dtyp=x", "vllm_cfg.dtyp", "vllm_cfg.dtype"),
        ("polcy:\n  served_model_name: p\n", "polcy={served_model_name: p}", "polcy", "policy"),
        (
            "policy:\n  generation:\n    temprature: 0.5\n",
            "policy.generation.temprature=0.5",
            "policy.generation.temprature",
            "policy.generation.temperature",
        ),
        ("grpo:\n  zzz: 1\n", "grpo.zzz=1", "grpo.zzz", None),
    ],
)
def test_unknown_key_says_the_same_with_a_suggestion_from_yaml_and_override(
    tmp_path, yaml_text, override, key, suggestion
):
    p = tmp_path / "c.yaml"
    p.write_text(yaml_text)
    with pytest.raises(ConfigError) as info:
        load_config(p)
    from_yaml = str(info.value)
    from_override = _error(override)
    for msg in (from_yaml, from_override):
        assert "\n" not in msg
        assert "remove it or check its spelling" in msg
        assert f"unknown key `{key}" in msg
        if suggestion is None:
            assert "did you mean" not in msg
        else:
            assert f"did you mean `{suggestion}" in msg
    # Both paths say the same thing after their own prefix.
    assert from_yaml.partition(": ")[2] in from_override


def test_a_renamed_key_names_its_new_name_from_yaml_and_override(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("token_capture:\n  journal_interval_tokens: 8\n")
    with pytest.raises(ConfigError) as info:
        load_config(p)
    for msg in (str(info.value), _error("token_capture.journal_storage=false")):
        assert "\n" not in msg and "was renamed `token_capture.log_" in msg


def test_unknown_override_key_suggests_the_whole_corrected_path():
    msg = _error("polcy.served_model_name=p")
    assert "did you mean `policy.served_model_name`?" in msg


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_extends_cycle_names_every_file_in_order(tmp_path):
    a = _write(tmp_path / "a.yaml", "extends: b.yaml\n")
    _write(tmp_path / "b.yaml", "extends: a.yaml\n")
    with pytest.raises(ConfigError) as info:
        load_config(a)
    assert str(info.value).startswith(
        "config files extend each other in a cycle: a.yaml -> b.yaml -> a.yaml;"
    )
    loop = _write(tmp_path / "loop.yaml", "extends: loop.yaml\n")
    with pytest.raises(ConfigError, match=r"cycle: loop\.yaml -> loop\.yaml;"):
        load_config(loop)


def test_extends_cycle_across_folders_starts_where_it_closes(tmp_path):
    start = _write(tmp_path / "start.yaml", "extends: a.yaml\n")
    _write(tmp_path / "a.yaml", "extends: sub/b.yaml\n")
    _write(tmp_path / "sub" / "b.yaml", "extends: ../a.yaml\n")
    with pytest.raises(ConfigError) as info:
        load_config(start)
    msg = str(info.value)
    assert "cycle: a.yaml -> sub/b.yaml -> a.yaml;" in msg and "start.yaml" not in msg
    assert "remove one of these `extends`" in msg and "\n" not in msg


# ---------------------------------------------------------------- field docs


def _blocks(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, type[BaseModel]]]:
    """(dotted key, block class) for `model` and every block below it."""
    yield prefix.rstrip("."), model
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _blocks(annotation, f"{prefix}{name}.")


def test_every_field_of_every_block_and_view_is_documented():
    roots = [RolloutRecoveryConfig, *COMPONENT_VIEWS]
    seen = 0
    for root in roots:
        for key, block in _blocks(root):
            assert (block.__doc__ or "").strip(), f"{block.__name__} has no docstring"
            for name, field in block.model_fields.items():
                where = f"{root.__name__}: {key + '.' if key else ''}{name}"
                assert (field.description or "").strip(), f"{where} has no description"
                seen += 1
    assert seen > 60


def test_docs_state_the_interplay_between_blocks():
    keep = RolloutCheckpointingConfig.model_fields["keep_latest_k"].description
    assert "trainer-checkpoint retention" in keep and "save_data_plane=false" in keep
    # The split between the two checkpointing blocks is stated on both sides.
    assert "`checkpointing`" in RolloutCheckpointingConfig.__doc__
    assert "`rollout_checkpointing`" in CheckpointingConfig.__doc__
    assert (
        "seconds"
        in RolloutCheckpointingConfig.model_fields["attempt_timeout_s"].description.lower()
    )


def test_lookup_key_finds_settings_and_blocks_and_refuses_typos():
    setting = lookup_key("rollout_checkpointing.keep_latest_k")
    assert setting.block is None and setting.field.default == 3
    block = lookup_key("policy.generation")
    assert block.block is GenerationConfig
    with pytest.raises(ConfigError) as info:
        lookup_key("rollout_checkpointing.keep_latst_k")
    msg = str(info.value)
    assert msg == (
        "unknown key `rollout_checkpointing.keep_latst_k`; remove it or check its spelling; "
        "did you mean `rollout_checkpointing.keep_latest_k`?"
    )
    # The loader says the same words.
    assert msg in _error("rollout_checkpointing.keep_latst_k=2")
    for bad in ("", "grpo.", "grpo.steps.x"):
        with pytest.raises(ConfigError, match="unknown key"):
            lookup_key(bad)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("grpo.steps=0", "`grpo.steps`: must be >= 1 (got 0)"),
        ("vllm_cfg.kv_cache_memory_bytes=5", "must be >= 1048576 bytes (got 5)"),
        ("vllm_cfg.startup_timeout_s=0", "`vllm_cfg.startup_timeout_s`: must be > 0 seconds"),
        ("policy.generation.top_p=1.5", "`policy.generation.top_p`: must be <= 1 (got 1.5)"),
    ],
)
def test_bounds_read_the_same_in_every_error(override, expected):
    assert expected in _error(override)


# ---------------------------------------------------------------- component views

VIEWS = {
    WorkerConfig: ("worker_config", {"policy", "vllm_cfg", "token_capture"}),
    EnvironmentActorConfig: (
        "environment_config",
        {"policy", "environment", "token_capture", "rollout_recovery", "gateway", "failover"},
    ),
    CheckpointCoordinatorConfig: (
        "checkpoint_config",
        {"rollout_recovery", "rollout_checkpointing", "checkpointing", "token_capture"},
    ),
}


def test_views_hold_the_job_blocks_under_the_job_names():
    assert set(COMPONENT_VIEWS) == set(VIEWS)
    job_fields = RolloutRecoveryConfig.model_fields
    for view, (_, names) in VIEWS.items():
        assert set(view.model_fields) == names
        for name, field in view.model_fields.items():
            assert field.annotation is job_fields[name].annotation
            assert field.is_required(), f"{view.__name__}.{name} must come from the job"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_views_carry_the_job_settings_and_round_trip_as_dicts(path):
    cfg = load_config(path, ["vllm_cfg.num_workers=2", "token_capture.control_auth_token=t"])
    for view_cls, (method, names) in VIEWS.items():
        view = getattr(cfg, method)()
        assert type(view) is view_cls
        for name in names:
            assert getattr(view, name) == getattr(cfg, name)
        data = view.model_dump(mode="json")
        assert json.loads(json.dumps(data)) == data  # what crosses a Ray boundary
        assert view_cls.model_validate(data) == view
        assert view_cls.from_dict(data) == view
    assert cfg.worker_config().vllm_cfg.num_workers == 2
    assert cfg.checkpoint_config().token_capture.control_auth_token == "t"


def test_a_view_is_a_copy():
    cfg = _load()
    worker, env = cfg.worker_config(), cfg.environment_config()
    worker.token_capture.control_auth_token = "minted"
    worker.policy.generation.max_new_tokens = 7
    assert cfg.token_capture.control_auth_token is None
    assert env.token_capture.control_auth_token is None
    assert cfg.policy.generation.max_new_tokens == env.policy.generation.max_new_tokens == 64


def test_views_refuse_unknown_and_missing_blocks_in_one_line():
    data = _load().worker_config().model_dump(mode="json")
    with pytest.raises(ConfigError) as info:
        WorkerConfig.from_dict(data | {"grpo": {"steps": 3}})
    assert str(info.value) == (
        "invalid WorkerConfig: unknown key `grpo`; remove it or check its spelling"
    )
    del data["vllm_cfg"]
    with pytest.raises(ConfigError, match=r"invalid WorkerConfig: `vllm_cfg`: Field required"):
        WorkerConfig.from_dict(data)


def test_views_check_block_rules_while_cross_block_rules_stay_on_the_job():
    data = _load().worker_config().model_dump(mode="json")
    data["vllm_cfg"]["kv_cache_memory_bytes"] = None
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes must be set"):
        WorkerConfig.from_dict(data)
    # max_turns=3 without prefix supply is refused by the job, not re-checked by a view.
    env = _load().environment_config().model_dump(mode="json")
    env["environment"]["max_turns"] = 3
    assert EnvironmentActorConfig.from_dict(env).environment.max_turns == 3
    assert "environment.max_turns=3 needs" in _error("environment.max_turns=3")


# --- the configured functions' signatures (issue 25, item 5) -----------------------------------


async def episode_of_task(task):
    """An episode function that forgot the context."""


def sync_episode(ctx, task):
    """An episode function that is not async."""


def tasks_of_n(n):
    """A task function that forgot the seed."""


async def flexible_episode(ctx, task, *, extra=None):
    """Extra parameters with defaults are fine."""


def reward_of_anything(*args):
    return 0.0


def _decorated(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):  # a plain function returning the coroutine
        return fn(*args, **kwargs)

    return wrapper


@_decorated
async def decorated_episode(ctx, task):
    """An async episode behind a decorator that keeps `__wrapped__`."""


class CallableEpisode:
    async def __call__(self, ctx, task):
        """An object whose __call__ is async."""


callable_episode = CallableEpisode()
partial_reward = functools.partial(lambda scale, task, result: scale * result, 2.0)

TALLY = "rollout_recovery.episodes.tally"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            f"environment.episode={TALLY}:tasks",
            f"environment.episode={TALLY}:tasks is `def tasks(n, seed)`: it is not async; it "
            "must be `async def episode(ctx, task)` (the environment awaits it with the "
            "episode's context and its task)",
        ),
        (
            f"environment.episode={__name__}:episode_of_task",
            f"environment.episode={__name__}:episode_of_task is `async def episode_of_task(task)`"
            ": it cannot take 2 positional arguments; it must be `async def episode(ctx, task)`",
        ),
        (
            f"environment.episode={__name__}:sync_episode",
            f"environment.episode={__name__}:sync_episode is `def sync_episode(ctx, task)`: it is "
            "not async; it must be `async def episode(ctx, task)`",
        ),
        (
            f"environment.reward={TALLY}:episode",
            f"environment.reward={TALLY}:episode is `async def episode(ctx, task)`: it is async; "
            "it must be `def reward(task, result) -> float` (a plain function, called with the "
            "task and what the episode function returned)",
        ),
        (
            f"environment.reward={TALLY}:digit_share",
            f"environment.reward={TALLY}:digit_share is `def digit_share(text)`: it cannot take 2 "
            "positional arguments; it must be `def reward(task, result) -> float`",
        ),
        (
            f"environment.tasks={TALLY}:episode",
            f"environment.tasks={TALLY}:episode is `async def episode(ctx, task)`: it is async; it "
            "must be `def tasks(n, seed) -> list` (a plain function, called with the number of "
            "tasks a step needs and the step's seed)",
        ),
        (
            f"environment.tasks={__name__}:tasks_of_n",
            f"environment.tasks={__name__}:tasks_of_n is `def tasks_of_n(n)`: it cannot take 2 "
            "positional arguments; it must be `def tasks(n, seed) -> list`",
        ),
    ],
)
def test_a_function_of_the_wrong_shape_is_refused_at_load_in_one_line(override, expected):
    """`environment.episode` taking only the task, or pointing at the tasks function (and
    the like for reward and tasks), fails when the config loads, not inside the run."""
    msg = _error(override)
    assert msg.startswith(f"invalid config: {expected}"), msg
    assert msg.endswith("see docs/episodes.md"), msg


def test_a_function_of_the_wrong_shape_in_a_yaml_file_and_on_the_command_line(tmp_path, capsys):
    from rollout_recovery.cli import main

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"environment": {"episode": f"{TALLY}:tasks"}}))
    with pytest.raises(ConfigError, match=r"environment.episode=\S+:tasks is `def tasks"):
        load_config(path, [])
    assert main(["config", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "it must be `async def episode(ctx, task)`" in err
    cfg = _load()
    with pytest.raises(ValueError, match="it must be `async def episode"):
        cfg.environment.episode = f"{TALLY}:tasks"  # assignment is validated too


@pytest.mark.parametrize(
    "override",
    [
        f"environment.episode={__name__}:flexible_episode",
        f"environment.episode={__name__}:decorated_episode",
        f"environment.episode={__name__}:callable_episode",
        f"environment.reward={__name__}:reward_of_anything",
        f"environment.reward={__name__}:partial_reward",
        "environment.reward=null",
        "environment.episode=rollout_recovery.episodes.harness:episode",
        "environment.episode=rollout_recovery.episodes.notes:episode",
        "environment.reward=rollout_recovery.episodes.notes:reward",
        "environment.tasks=rollout_recovery.episodes.notes:tasks",
    ],
)
def test_functions_that_can_be_called_as_the_project_calls_them_load(override):
    """The shipped episodes, defaults, keyword-only extras, `*args`, partials, decorated
    async functions and objects with an async `__call__` are all accepted."""
    _load(override)
