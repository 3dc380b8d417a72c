"""The wire protocol: every request field, identifier pattern and storage key this project adds.

Stdlib and pydantic only, so any process (trainer, environment, worker, a user's client) can
import it without vLLM or Ray. A call is named by `CallIdentity` (rollout id, model call id,
attempt); everything stored about it is keyed by the grammar below:

    <rollout>/<call>/a<attempt>             token entry id, and the prefix of the keys below
    <rollout>/<call>/a<attempt>/c<seq:06d>  a staged chunk of the call's generated tokens
    <rollout>/<call>/a<attempt>/terminal    the finished call's terminal row
    <rollout>/<call>/incomplete             a lost call's token-entry marker
    <group>/<index:03d>                     a finished episode's replay row
    <group>-g<index>                        the rollout id of a group's index-th episode
    s<step:04d>-p<prompt:03d>               the GRPO driver's group ids

Requests carry the identity and, for a restored call, its `Continuation` in the OpenAI body's
`vllm_xargs` (vLLM passes them through as `SamplingParams.extra_args`).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    field_validator,
    model_serializer,
    model_validator,
)

if TYPE_CHECKING:
    from rollout_recovery.data_plane import ReplayRow

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
"""Rollout ids, model call ids and checkpoint ids (at most `MAX_ID_LENGTH` characters)."""
ID_RE = re.compile(ID_PATTERN)
MAX_ID_LENGTH = 128
KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]*$"
"""Data-plane row keys: identifiers joined by `/` (the grammar above)."""

# Request fields (`vllm_xargs`): the call's identity ...
XARG_ROLLOUT = "rr_rollout_id"
XARG_CALL = "rr_model_call_id"
XARG_ATTEMPT = "rr_attempt"
# ... the position-keyed sampler's seed and temperature ...
XARG_SEED = "rr_seed"
XARG_TEMPERATURE = "rr_temperature"
# ... the exact prompt prefix a turn must continue (prefix supply) ...
XARG_REQUIRED_PREFIX = "rr_required_prefix"
# ... and a restored call's continuation.
RESUME_KEYS_ARG = "rr_resume_keys"
RESUME_TOKENS_ARG = "rr_resume_tokens"
RESUME_DIGEST_ARG = "rr_resume_digest"
RESUME_LIMIT_ARG = "rr_resume_limit"
RESUME_ARGS = (RESUME_KEYS_ARG, RESUME_TOKENS_ARG, RESUME_DIGEST_ARG, RESUME_LIMIT_ARG)
REQUEST_FIELDS = frozenset(
    {XARG_ROLLOUT, XARG_CALL, XARG_ATTEMPT, XARG_SEED, XARG_TEMPERATURE, XARG_REQUIRED_PREFIX,
     *RESUME_ARGS}
)  # fmt: skip

# Response header of an identified, non-streamed call: the weight-version spans of its
# generated tokens as JSON `[[version, start, end], ...]` (data_plane/spans.py).
WEIGHT_VERSIONS_HEADER = "x-rollout-recovery-weight-versions"


def encode_spans(spans) -> str:
    return json.dumps([list(s) for s in spans], separators=(",", ":"))


def decode_spans(text: str) -> list[tuple[int, int, int]]:
    """ValueError unless `text` is a list of [version, start, end] integer triples."""
    data = json.loads(text)
    if not isinstance(data, list) or not all(
        isinstance(s, list) and len(s) == 3
        and all(isinstance(x, int) and not isinstance(x, bool) for x in s)
        for s in data
    ):  # fmt: skip
        raise ValueError(f"{WEIGHT_VERSIONS_HEADER} must be [[version, start, end], ...]")
    return [tuple(s) for s in data]


def rollout_id(group_id: str, index: int) -> str:
    """The rollout id of a group's `index`-th generation."""
    return f"{group_id}-g{index}"


def environment_of(rollout: str, count: int) -> int:
    """Which of `count` environment actors owns rollout `rollout`: runs its episode, records it
    at checkpoints and sweeps its staged rows. A stable hash, the same in every process; not
    crc32, whose low bits are linear in the input's bits, so that a group's generations
    `-g0`..`-g3` would all land on one of 2 or 4 actors."""
    if count <= 1:
        return 0
    return int.from_bytes(hashlib.sha256(rollout.encode()).digest()[:8], "big") % count


def replay_key(group_id: str, index: int) -> str:
    """The replay-row key of a group's `index`-th generation (sorts by group, then index)."""
    return f"{group_id}/{index:03d}"


def incomplete_key(rollout: str, model_call_id: str) -> str:
    """The token-entry key recording that a call was lost (never silently dropped)."""
    return f"{rollout}/{model_call_id}/incomplete"


def is_incomplete_key(key: str) -> bool:
    parts = key.split("/")
    return len(parts) == 3 and parts[2] == "incomplete"


def rollout_of_replay_key(key: str) -> str:
    """`s0001-p000/002` -> `s0001-p000-g2`."""
    group, index = key.rsplit("/", 1)
    return rollout_id(group, int(index))


def group_id(step: int, prompt: int, attempt: int = 0) -> str:
    """The GRPO driver's id of a step's `prompt`-th prompt group (its rollouts start with
    `step_prefix(step)`); `attempt` > 0 for a prompt asynchronous GRPO generates again after
    its group went stale (`-r<attempt>`). `parse_group_id` reads it back."""
    base = f"{step_prefix(step)}p{prompt:03d}"
    return f"{base}-r{attempt}" if attempt else base


def step_prefix(step: int) -> str:
    return f"s{step:04d}-"


GROUP_ID = re.compile(r"s(\d+)-p(\d+)(?:-r(\d+))?")


def parse_group_id(group: str) -> tuple[int, int, int] | None:
    """(step, prompt, attempt) of a driver group id (`group_id`); None for another id."""
    found = GROUP_ID.fullmatch(group)
    return None if found is None else (int(found[1]), int(found[2]), int(found[3] or 0))


def check_id(name: str, value: Any) -> str:
    """`value` if it is a valid identifier; ValueError naming `name` otherwise."""
    if not isinstance(value, str) or not ID_RE.fullmatch(value) or len(value) > MAX_ID_LENGTH:
        raise ValueError(f"{name} must match {ID_PATTERN} (got {value!r})")
    return value


def is_int(value: Any) -> bool:
    """A JSON integer (a boolean is not one, though Python says so)."""
    return isinstance(value, int) and not isinstance(value, bool)


class CallIdentity(NamedTuple):
    """One attempt of one model call of one rollout, and the keys of what is stored for it."""

    rollout_id: str
    model_call_id: str
    attempt: int

    def key_prefix(self) -> str:
        """`<rollout>/<call>/a<attempt>`: also the id of the attempt's token entry."""
        return f"{self.rollout_id}/{self.model_call_id}/a{self.attempt}"

    def chunk_key(self, chunk_seq: int) -> str:
        return f"{self.key_prefix()}/c{chunk_seq:06d}"

    def terminal_key(self) -> str:
        return f"{self.key_prefix()}/terminal"

    @classmethod
    def of_chunk_key(cls, key: str) -> CallIdentity | None:
        """The call attempt a chunk key belongs to, or None for a key of another shape."""
        parts = key.split("/")
        if len(parts) != 4 or not parts[2][1:].isdigit() or not parts[3].startswith("c"):
            return None
        if not parts[2].startswith("a") or not parts[3][1:].isdigit():
            return None
        return cls(parts[0], parts[1], int(parts[2][1:]))

    def to_xargs(self) -> dict[str, Any]:
        """The request fields that name this call attempt."""
        return {XARG_ROLLOUT: self.rollout_id, XARG_CALL: self.model_call_id,
                XARG_ATTEMPT: self.attempt}  # fmt: skip


def identity_from_extra_args(extra: dict | None) -> CallIdentity | None:
    """The call's identity from its request fields, None when the request carries none;
    ValueError naming the field when one is malformed."""
    if not extra or XARG_ROLLOUT not in extra:
        return None
    attempt = extra.get(XARG_ATTEMPT, 0)
    if not is_int(attempt) or attempt < 0:
        raise ValueError(f"{XARG_ATTEMPT} must be a non-negative integer (got {attempt!r})")
    return CallIdentity(
        check_id(XARG_ROLLOUT, extra[XARG_ROLLOUT]),
        check_id(XARG_CALL, extra.get(XARG_CALL)),
        attempt,
    )


def check_continuation_fields(xargs: dict) -> None:
    """Types of the continuation fields as the caller sent them (raw JSON), before vLLM's
    request model would coerce them (`true` into 1); ValueError names the field."""
    if RESUME_KEYS_ARG not in xargs:
        return
    keys = xargs[RESUME_KEYS_ARG]
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
        raise ValueError(f"{RESUME_KEYS_ARG} must be a non-empty list of staging keys")
    bad = [k for k in keys if CallIdentity.of_chunk_key(k) is None]
    if bad:
        raise ValueError(
            f"{RESUME_KEYS_ARG} must name chunk keys (<rollout>/<call>/a<attempt>/c<seq>); "
            f"got {bad[0]!r}"
        )
    if not is_int(xargs.get(RESUME_TOKENS_ARG)) or xargs[RESUME_TOKENS_ARG] < 1:
        raise ValueError(f"{RESUME_TOKENS_ARG} must be a positive integer")
    if not isinstance(xargs.get(RESUME_DIGEST_ARG), str):
        raise ValueError(f"{RESUME_DIGEST_ARG} must be a hex digest string")
    limit = xargs.get(RESUME_LIMIT_ARG)
    if limit is not None and not is_int(limit):
        raise ValueError(f"{RESUME_LIMIT_ARG} must be an integer")


class CallRef(BaseModel):
    """One call attempt named in a cut inventory."""

    model_config = ConfigDict(extra="forbid")

    rollout_id: str
    model_call_id: str
    attempt: StrictInt = Field(0, ge=0)

    @field_validator("rollout_id", "model_call_id")
    @classmethod
    def _ids(cls, v: str, info) -> str:
        return check_id(info.field_name, v)

    def identity(self) -> CallIdentity:
        return CallIdentity(self.rollout_id, self.model_call_id, self.attempt)


class CutInventory(BaseModel):
    model_config = ConfigDict(extra="forbid")

    checkpoint_id: str
    calls: list[CallRef]

    @field_validator("checkpoint_id")
    @classmethod
    def _ckpt(cls, v: str) -> str:
        return check_id("checkpoint_id", v)

    def digest(self) -> str:
        body = json.dumps([c.model_dump() for c in self.calls], sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()


class CallReceipt(BaseModel):
    rollout_id: str
    model_call_id: str
    attempt: int
    disposition: Literal["durable_prefix", "durable_failure"]
    cut_kind: Literal["active_prefix", "terminal_completion"] | None = None
    staging_keys: list[str] = []
    prefix_token_count: int = 0
    prefix_digest: str | None = None
    effective_output_limit: int | None = None
    finish_reason: str | None = None  # terminal_completion: how the call finished
    reason: str | None = None


class CutReceipt(BaseModel):
    checkpoint_id: str
    inventory_digest: str
    calls: list[CallReceipt]
    staged_rows: int
    staged_tokens: int
    lock_hold_us: float
    elapsed_s: float


class Continuation(BaseModel):
    """How the call in flight at a checkpoint goes on after a restore (an episode record's
    `continuation`). Without `keys` it was not cut: the call is decoded again as the next
    attempt. With them, the next attempt resumes from the staged prefix."""

    model_config = ConfigDict(extra="forbid")

    call_id: str
    attempt: int
    keys: list[str] | None = None  # staged chunk keys, in order
    tokens: int | None = None  # prefix length
    digest: str | None = None  # the prefix's chained digest (hex)
    cut_kind: str | None = None  # active_prefix or terminal_completion

    @classmethod
    def from_receipt(cls, call: CallReceipt | dict) -> Continuation:
        """From a cut receipt's entry for the call."""
        call = CallReceipt.model_validate(call)
        cont = cls(call_id=call.model_call_id, attempt=call.attempt)
        if call.disposition == "durable_prefix":
            cont.keys, cont.tokens = call.staging_keys, call.prefix_token_count
            cont.digest, cont.cut_kind = call.prefix_digest, call.cut_kind
        return cont

    @model_serializer(mode="wrap")
    def _without_unset(self, handler) -> dict[str, Any]:
        """Records and ledgers keep only the fields a continuation has."""
        return {k: v for k, v in handler(self).items() if v is not None}

    @property
    def cut(self) -> bool:
        return bool(self.keys)

    def to_record(self) -> dict:
        """The JSON form kept in episode records and ledgers (unset fields left out)."""
        return self.model_dump()

    def to_request_fields(self, limit: int | None) -> dict[str, Any]:
        """The request fields that make the next attempt resume from the prefix; `limit`:
        the call's output limit (the resumed request must carry the same)."""
        if not self.cut:
            return {}
        fields = {RESUME_KEYS_ARG: self.keys, RESUME_TOKENS_ARG: self.tokens,
                  RESUME_DIGEST_ARG: self.digest}  # fmt: skip
        return fields if limit is None else fields | {RESUME_LIMIT_ARG: limit}


class ResumeRequest(NamedTuple):
    """A continuation as a worker reads it from a request's fields."""

    keys: list[str]
    tokens: int
    digest: str
    limit: int | None


def resume_request(xargs: dict) -> ResumeRequest | None:
    """The continuation a request carries, None when it carries none; ValueError naming the
    field when it is malformed."""
    if RESUME_KEYS_ARG not in xargs:
        return None
    check_continuation_fields(xargs)
    return ResumeRequest(xargs[RESUME_KEYS_ARG], xargs[RESUME_TOKENS_ARG],
                         xargs[RESUME_DIGEST_ARG], xargs.get(RESUME_LIMIT_ARG))  # fmt: skip


# ---------------------------------------------------------------- episode records and ledgers

EPISODE_RECORD_FORMAT = 2  # 2: episode functions (task and journal replace messages/state)
LEDGER_FORMAT = 3  # 3: the model identity (base model, weight version and digest)


class TurnRef(BaseModel):
    """A committed model call in an episode record: its token entry, by id and payload digest
    (the tokens stay in the data plane)."""

    model_config = ConfigDict(extra="forbid")

    entry_id: str
    payload_sha256: str


class JournalStep(BaseModel):
    """One completed step of an episode function, in the order the function took it. A replay
    answers the step from here when the function asks for the same thing again (same kind,
    name and request digest); anything else is a divergence."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["chat", "effect", "random"]
    name: str  # chat: the model call id (c0, c1, ...); effect: its name; random: "random"
    request_sha256: str  # chat: messages + sampling fields; effect: name + arguments
    # chat: {"message", "response"?} (response: the worker's body as text; older records: the
    # parsed object); effect and random: the value returned
    result: Any = None
    turn: int | None = None  # chat: its index in the record's turns


class EpisodeRecord(BaseModel):
    """An unfinished episode as a checkpoint keeps it: restoring it runs the episode function
    again as a later attempt (+ 1 for the first restore of its snapshot, more for each restore
    of it after that: restore.attempt_step), answering the journal's steps without decoding or
    running effects, and resumes the call in flight from its cut."""

    model_config = ConfigDict(extra="forbid")

    format: int = EPISODE_RECORD_FORMAT
    rollout_id: str
    group_id: str
    generation_index: int
    seed: int
    attempt: int
    restarts: int = 0  # fresh starts after a refused record or a divergence (names effect ids)
    task: dict[str, Any]
    journal: list[JournalStep] = []
    turns: list[TurnRef] = []
    continuation: Continuation | None = None

    @model_validator(mode="before")
    @classmethod
    def _format_1(cls, data: Any) -> Any:
        """A format-1 record (the built-in loop's, before episode functions) still loads, so
        its snapshot stays usable: its task is its first prompt, and the environment refuses
        the record itself (`restore_refused.record_format`), starting the episode over."""
        if not isinstance(data, dict) or data.get("format") != 1 or "messages" not in data:
            return data
        old = {k: v for k, v in data.items() if k not in ("messages", "state")}
        messages = data.get("messages", [])
        turns = [{k: t[k] for k in ("entry_id", "payload_sha256")} for t in old.get("turns", [])]
        first = data["turns"][0].get("request_messages", 1) if turns else len(messages)
        return old | {"task": {"messages": messages[:first]}, "turns": turns}


class ServedModel(BaseModel):
    """The model that decoded a snapshot's tokens: a restore with another one is refused."""

    base: dict[str, Any]  # model_identity.base_model_identity: path and weights digest
    weight_version: int
    weights_sha256: str | None  # None: the base model's weights were served


class CheckpointRecords(BaseModel):
    """What the environment commits at a checkpoint: every unfinished episode's record, and
    the continuation of each call in flight, by rollout id."""

    episodes: list[EpisodeRecord] = []
    continuations: dict[str, Continuation] = {}
    chunk_rows_swept: int = 0  # staging rows of finished or dead calls deleted on commit


class EnvironmentProgress(BaseModel):
    """What an environment is doing, as the controller's liveness watch sees it
    (controller/liveness.py): a step is moving while calls are in flight or moving to a live
    worker, effects run, or `events` grows."""

    episodes_running: int = 0  # taken by a step and not finished
    calls_in_flight: int = 0
    calls_moving: int = 0  # off a dead worker, waiting for a live one (failover)
    effects_running: int = 0
    events: int = 0  # model calls started and answered, episodes finished: only ever grows
    restored_waiting: int = 0  # restored episodes no step has taken yet
    restored_waiting_s: float = 0.0  # how long they have waited (since the restore)
    restored_example: str | None = None  # one of them, to name in a message

    def __add__(self, other: EnvironmentProgress) -> EnvironmentProgress:
        """Two environments' progress as one (counts summed, the longer wait kept)."""
        return EnvironmentProgress(
            episodes_running=self.episodes_running + other.episodes_running,
            calls_in_flight=self.calls_in_flight + other.calls_in_flight,
            calls_moving=self.calls_moving + other.calls_moving,
            effects_running=self.effects_running + other.effects_running,
            events=self.events + other.events,
            restored_waiting=self.restored_waiting + other.restored_waiting,
            restored_waiting_s=max(self.restored_waiting_s, other.restored_waiting_s),
            restored_example=self.restored_example or other.restored_example,
        )


class Ledger(BaseModel):
    """A snapshot's `ledger.json`: when it was taken, at what level, with which model, and
    the episode records a restore loads."""

    format: int = LEDGER_FORMAT
    step: int  # the trainer step whose rollouts were being generated
    weight_version: int
    reason: str  # cadence or trainer_checkpoint
    level: Literal["none", "turn", "prefix"]
    model: ServedModel
    # The digest of the trainer checkpoint of `step` its rollouts continue from (None: none
    # was saved through the run, e.g. at step 0); a restore pairs only that one with it.
    trainer_checkpoint: str | None = None
    episodes: list[EpisodeRecord] = []
    continuations: dict[str, Continuation] = {}
    # The settings its records depend on (controller/run_settings.py), compared by a restore
    # before it touches anything; empty in ledgers written before they were recorded.
    settings: dict[str, Any] = {}

    def holds_unfinished_work(self) -> bool:
        return bool(self.continuations or self.episodes)

    def to_json(self) -> bytes:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()


class EpisodeOutcome(NamedTuple):
    """A finished episode as the environment returns it."""

    row: ReplayRow  # its training row (already durable in `replay`)
    decoded_tokens: int  # tokens the engines decoded for it in this run
    result: Any  # what the episode function returned, as its row keeps it (JSON values)


@dataclass
class GroupResult:
    """One finished group as the trainer gets it: its rows, rewards, the tokens decoded for it
    and what each episode function returned (JSON values, kept with its row)."""

    group_id: str
    rows: list[ReplayRow]
    rewards: list[float]
    generated_tokens: int
    results: list

    @classmethod
    def of(cls, group_id: str, outcomes: list[EpisodeOutcome]) -> GroupResult:
        rows, decoded = [o.row for o in outcomes], sum(o.decoded_tokens for o in outcomes)
        return cls(group_id, rows, [r.reward for r in rows], decoded, [o.result for o in outcomes])
