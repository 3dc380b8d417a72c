"""One validated configuration for every component, loaded from YAML plus dotted overrides.

Every block forbids unknown keys so a typo fails at load instead of silently running with a
default. Errors are `ConfigError`s whose one-line message names the key and says how to fix it.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

TINY_MODEL_SCHEME = "tiny://"
HUB_MODEL_SCHEME = "hf://"
# The URI schemes pyarrow.fs.FileSystem.from_uri opens natively (pyarrow 26); `mock` is left out
# (an in-memory test filesystem loses every checkpoint), as are the fsspec-backed `hf://` and
# `fsspec+...://`, which need extra packages on every node.
STORAGE_SCHEMES = ("file", "local", "s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss")


class ConfigError(ValueError):
    """A configuration problem; the message is one line naming the key and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


def _not_bool(value: object) -> object:
    """Refuse booleans before number parsing: YAML reads true/yes/on as True, and int(True) is 1."""
    if isinstance(value, bool):
        raise ValueError("must be a number, not true/false")
    return value


# Numeric strings stay accepted: PyYAML reads `3e-5` (no dot) as a string, and "3" is unambiguous.
Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[float, BeforeValidator(_not_bool)]


class _Block(BaseModel):
    # NaN compares false with every bound and inf never times out, so neither is a setting.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class GenerationConfig(_Block):
    temperature: Float = Field(1.0, ge=0.0)
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: Int = Field(64, ge=1)
    seed: Int = 0
    top_logprobs: Int = Field(0, ge=0, le=20)


class PolicyConfig(_Block):
    model_path: str = Field(
        f"{TINY_MODEL_SCHEME}default",
        description=(
            "A local model directory, `tiny://default` for the offline tiny Llama this project "
            "builds, or `hf://<org>/<name>` for a hub model resolved on the node that serves it."
        ),
    )
    served_model_name: str = "policy"
    generation: GenerationConfig = GenerationConfig()

    @field_validator("model_path")
    @classmethod
    def _model_path_exists(cls, value: str) -> str:
        if value.startswith(TINY_MODEL_SCHEME):
            name = value.removeprefix(TINY_MODEL_SCHEME)
            if name != "default":
                raise ValueError(f"unknown tiny model {name!r}; use `tiny://default`")
            return value
        if value.startswith(HUB_MODEL_SCHEME):
            if not re.fullmatch(r"[\w.-]+/[\w.-]+", value.removeprefix(HUB_MODEL_SCHEME)):
                raise ValueError(f"{value!r} is not `hf://<org>/<name>`")
            return value
        path = Path(os.path.expanduser(value))
        if not (path / "config.json").is_file():
            raise ValueError(
                f"no model at {value!r} (no config.json there); build one with "
                "`rollout-recovery make-tiny-model DIR`, or use `tiny://default` or `hf://<org>/<name>`"
            )
        return str(path.resolve())


class VllmConfig(_Block):
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "float32"
    gpu_memory_utilization: Float = Field(0.9, gt=0.0, le=1.0)
    kv_cache_memory_bytes: Int | None = Field(
        256 * 1024 * 1024,
        ge=1024 * 1024,
        description="Explicit KV cache size; on CPU always set it (utilization sizing drifts).",
    )
    max_model_len: Int = Field(1024, ge=16)
    enforce_eager: bool = True
    flat_logprobs: bool = True
    num_workers: Int = Field(1, ge=1)
    enable_prefix_caching: bool = False
    position_keyed_sampler: bool = Field(
        True,
        description="Register the position-keyed sampler: requests with vllm_xargs rr_seed "
        "sample at rr_temperature with noise keyed by (seed, position), so resumes reproduce.",
    )
    worker_num_cpus: Float = Field(
        1.0, ge=0.0, description="Ray CPUs reserved per GenerationWorker actor."
    )
    worker_resources: dict[str, Float] = Field(
        default_factory=dict,
        description="Extra Ray resources per worker, to place workers on chosen nodes.",
    )
    host: str = "127.0.0.1"
    startup_timeout_s: Float = Field(600.0, gt=0.0)

    @model_validator(mode="after")
    def _cpu_needs_explicit_kv(self) -> VllmConfig:
        if self.device == "cpu" and self.kv_cache_memory_bytes is None:
            raise ConfigError(
                "vllm_cfg.kv_cache_memory_bytes must be set when vllm_cfg.device=cpu "
                "(utilization-based sizing follows a NUMA node's memory, which drifts); "
                "set e.g. vllm_cfg.kv_cache_memory_bytes=268435456"
            )
        return self


class TokenCaptureConfig(_Block):
    enabled: bool = False
    control_timeout_s: Float = 10.0
    staging_partition: str = "rollout_staging"
    terminal_partition: str = "rollout_terminal"
    max_inventory_calls: Int = Field(4096, ge=1)
    max_attempt_records: Int = Field(
        100_000,
        ge=1,
        description="Call attempts each worker remembers what its engine did for (resume "
        "verdict, prefix, decoded tokens); older ones are dropped and counted.",
    )
    request_token_ids: bool = Field(
        True, description="Ask the workers for prompt and generated token ids (return_token_ids)."
    )
    supply_prefix_token_ids: bool = Field(
        False, description="Send a resolved parent's exact tokens as the call's required prefix."
    )
    use_completions_api: bool = False

    @model_validator(mode="after")
    def _supply_needs_proof(self) -> TokenCaptureConfig:
        if self.supply_prefix_token_ids and not self.request_token_ids:
            raise ConfigError(
                "token_capture.supply_prefix_token_ids=true needs token_capture."
                "request_token_ids=true (the returned prompt ids prove the prefix was used); "
                "set it, or set supply_prefix_token_ids=false"
            )
        if self.supply_prefix_token_ids and self.use_completions_api:
            raise ConfigError(
                "token_capture.supply_prefix_token_ids=true cannot be proven on the completions "
                "API (token_capture.use_completions_api=true); use chat completions or set "
                "supply_prefix_token_ids=false"
            )
        return self

    control_auth_token: str | None = Field(
        None, description="Bearer token for control routes; minted per run when unset."
    )

    @field_validator("control_timeout_s")
    @classmethod
    def _positive_timeout(cls, value: float) -> float:
        if value <= 0:
            raise ValueError(f"must be > 0 seconds (got {value}); set e.g. 10")
        return value


class RolloutRecoveryLevelConfig(_Block):
    target_level: Literal["none", "turn", "prefix"] = "none"


class RolloutCheckpointingConfig(_Block):
    snapshot_attempt_interval_s: Float = 60.0
    attempt_timeout_s: Float = Field(
        60.0, gt=0.0, description="A checkpoint attempt still running after this is aborted."
    )
    keep_latest_k: Int = 3
    max_consecutive_failures: Int = Field(3, ge=1)
    restore_mode: Literal["latest", "trainer_checkpoint"] = "latest"

    @field_validator("snapshot_attempt_interval_s")
    @classmethod
    def _positive_interval(cls, value: float) -> float:
        if value <= 0:
            raise ValueError(f"must be > 0 seconds (got {value}); set e.g. 60")
        return value

    @field_validator("keep_latest_k")
    @classmethod
    def _keep_at_least_one(cls, value: int) -> int:
        if value < 1:
            raise ValueError(
                f"must be >= 1 (got {value}); keeping 0 snapshots leaves none to restore"
            )
        return value


class CheckpointingConfig(_Block):
    checkpoint_dir: str = Field(
        "runs/checkpoints", description="A local path or a pyarrow.fs URI (s3://, gs://)."
    )
    save_data_plane: bool = False

    @field_validator("checkpoint_dir")
    @classmethod
    def _known_storage_scheme(cls, value: str) -> str:
        """Refuse a URI pyarrow.fs cannot open now, not at the first checkpoint; no network use."""
        scheme, sep, _ = value.partition("://")
        if sep and scheme not in STORAGE_SCHEMES:
            accepted = ", ".join(f"{s}://" for s in STORAGE_SCHEMES)
            raise ValueError(
                f"unknown storage scheme `{scheme}://`; use a local path or a URI starting "
                f"with one of {accepted}"
            )
        return value


class GrpoConfig(_Block):
    steps: Int = Field(3, ge=1)
    prompts_per_step: Int = Field(2, ge=1)
    generations_per_prompt: Int = Field(4, ge=2)
    learning_rate: Float = Field(1e-4, gt=0.0)
    seed: Int = 0


class EnvironmentConfig(_Block):
    max_turns: Int = Field(
        1,
        ge=1,
        le=16,
        description="Model calls per episode: 1 is single-turn GRPO; more makes multi-turn "
        "episodes where the tally tool acts between calls.",
    )


class RolloutRecoveryConfig(_Block):
    """The whole job configuration (one YAML file)."""

    policy: PolicyConfig = PolicyConfig()
    vllm_cfg: VllmConfig = VllmConfig()
    token_capture: TokenCaptureConfig = TokenCaptureConfig()
    rollout_recovery: RolloutRecoveryLevelConfig = RolloutRecoveryLevelConfig()
    rollout_checkpointing: RolloutCheckpointingConfig = RolloutCheckpointingConfig()
    checkpointing: CheckpointingConfig = CheckpointingConfig()
    environment: EnvironmentConfig = EnvironmentConfig()
    grpo: GrpoConfig = GrpoConfig()

    @model_validator(mode="after")
    def _cross_field_rules(self) -> RolloutRecoveryConfig:
        level = self.rollout_recovery.target_level
        if level in ("turn", "prefix") and not self.checkpointing.save_data_plane:
            raise ConfigError(
                f"rollout_recovery.target_level={level} needs checkpointing.save_data_plane=true "
                "(the staged rows live in the data plane); set it, or use target_level=none"
            )
        if level == "prefix" and not self.token_capture.enabled:
            raise ConfigError(
                "rollout_recovery.target_level=prefix needs token_capture.enabled=true "
                "(prefixes are cut from captured tokens); set it, or use target_level=turn"
            )
        if (
            level == "prefix"
            and self.policy.generation.temperature > 0
            and not self.vllm_cfg.position_keyed_sampler
        ):
            raise ConfigError(
                "rollout_recovery.target_level=prefix with policy.generation.temperature>0 needs "
                "vllm_cfg.position_keyed_sampler=true (seeded sampling must be resumable, or no "
                "call could be cut); set it, or use target_level=turn"
            )
        if level == "prefix" and self.policy.generation.top_logprobs > 0:
            raise ConfigError(
                "rollout_recovery.target_level=prefix refuses policy.generation.top_logprobs="
                f"{self.policy.generation.top_logprobs} (top-k logprobs are not staged with "
                "prefixes); set policy.generation.top_logprobs=0, or use target_level=turn"
            )
        if self.environment.max_turns > 1 and not self.token_capture.supply_prefix_token_ids:
            raise ConfigError(
                f"environment.max_turns={self.environment.max_turns} needs token_capture."
                "supply_prefix_token_ids=true (each turn must continue its parent's exact "
                "tokens, or the episode is not one token sequence); set it, or max_turns=1"
            )
        return self


def _block_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _unknown_key_message(path: Sequence[str]) -> str:
    """The same words for a typo in YAML or in an override, with the closest key of its block."""
    message = f"unknown key `{'.'.join(path)}`; remove it or check its spelling"
    model: type[BaseModel] | None = RolloutRecoveryConfig
    for i, part in enumerate(path):
        if model is None:
            break
        if part not in model.model_fields:
            close = difflib.get_close_matches(part, list(model.model_fields), n=1)
            if close:
                guess = [*path[:i], close[0], *path[i + 1 :]]
                if not _known_key(guess):
                    guess = guess[: i + 1]
                message += f"; did you mean `{'.'.join(guess)}`?"
            break
        model = _block_model(model.model_fields[part].annotation)
    return message


def _format_validation_error(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            parts.append(_unknown_key_message([str(p) for p in e["loc"]]))
        elif e["type"] == "value_error" and isinstance(e.get("ctx", {}).get("error"), ConfigError):
            parts.append(str(e["ctx"]["error"]))
        else:
            msg = e["msg"].removeprefix("Value error, ")
            if e["type"] == "finite_number":
                msg = "must be a finite number, not NaN or infinity"
            where = f"`{key}`" if key else "config"
            parts.append(f"{where}: {msg} (got {e.get('input')!r})")
    return "; ".join(parts)


def validate_config(data: dict[str, Any]) -> RolloutRecoveryConfig:
    """Validate a plain dict; raises ConfigError with a one-line reason."""
    try:
        return RolloutRecoveryConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"invalid config: {_format_validation_error(err)}") from None


def _known_key(path: Sequence[str]) -> bool:
    model: type[BaseModel] = RolloutRecoveryConfig
    for part in path:
        field = model.model_fields.get(part)
        if field is None:
            return False
        block = _block_model(field.annotation)
        if block is None:
            return part == path[-1]
        model = block
    return True


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides; values are parsed as YAML scalars (3, true, null, [1, 2])."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", key):
            raise ConfigError(
                f"bad override {item!r}: write it as dotted.key=value, e.g. grpo.steps=3"
            )
        path = key.split(".")
        if not _known_key(path):
            raise ConfigError(f"bad override {item!r}: {_unknown_key_message(path)}")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as err:
            raise ConfigError(f"bad override {item!r}: value is not valid YAML ({err})") from None
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"bad override {item!r}: `{part}` is not a block")
            node = child
        node[path[-1]] = value
    return data


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read one YAML file; a top-level `extends: other.yaml` is loaded first and merged under it."""
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found")
    if path.resolve() in seen:
        cycle = [*seen[seen.index(path.resolve()) :], path.resolve()]
        names = " -> ".join(os.path.relpath(p, cycle[0].parent) for p in cycle)
        raise ConfigError(
            f"config files extend each other in a cycle: {names}; remove one of these `extends`"
        )
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of blocks at top level")
    base = loaded.pop("extends", None)
    if base is None:
        return loaded
    if not isinstance(base, str):
        raise ConfigError(f"`extends` in {str(path)!r} must be a file name, got {base!r}")
    merged = _read_yaml(path.parent / base, (*seen, path.resolve()))
    _deep_merge(merged, loaded)
    return merged


def _deep_merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = value


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> RolloutRecoveryConfig:
    """Load YAML (or the defaults when path is None), apply overrides, validate."""
    data = _read_yaml(Path(path)) if path is not None else {}
    apply_overrides(data, overrides or [])
    return validate_config(data)


def dump_config(cfg: RolloutRecoveryConfig) -> str:
    """YAML text that loads back to an equal config."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
