"""TokenEntry: the environment's record of one model call's exact tokens (schema v4).

Versions: v1 identity and token arrays; v2 adds parent_call_id, cumulative length and digest;
v3 adds the parent resolution; v4 adds prefix_requested / prefix_supplied; v5 adds
generated_weight_versions (the weight-version spans of the generated tokens, as the worker
reported them; None when it reported none). Older records load
with the later fields at their defaults; a record newer than this reader, or older than its
floor, is refused.
"""

from __future__ import annotations

import hashlib
import json
from enum import StrEnum
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollout_recovery.data_plane.digest import token_digest
from rollout_recovery.data_plane.spans import check_spans
from rollout_recovery.protocol import ID_PATTERN, MAX_ID_LENGTH, CallIdentity

SCHEMA_VERSION = 5
SCHEMA_FLOOR = 1


class TokenEntryVersionError(ValueError):
    pass


class ParentResolution(StrEnum):
    ROOT = "ROOT"
    RESOLVED = "RESOLVED"
    UNRESOLVED = "UNRESOLVED"


class TokenEntry(BaseModel):
    """One call's tokens as generated (never re-tokenized), with its lineage and proof."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = SCHEMA_VERSION
    # v1
    rollout_id: str = Field(pattern=ID_PATTERN, max_length=MAX_ID_LENGTH)
    model_call_id: str = Field(pattern=ID_PATTERN, max_length=MAX_ID_LENGTH)
    attempt: int = Field(0, ge=0)
    prompt_token_ids: list[int]
    generated_token_ids: list[int]
    generated_logprobs: list[float]
    finish_reason: str | None = None
    # v2
    parent_call_id: str | None = Field(None, pattern=ID_PATTERN, max_length=MAX_ID_LENGTH)
    cumulative_len: int | None = None
    cumulative_digest: str | None = None
    # v3
    parent_resolution: ParentResolution = ParentResolution.UNRESOLVED
    resolution_reason: str | None = None
    # v4
    prefix_requested: bool = False
    prefix_supplied: bool = False
    # v5
    generated_weight_versions: list[tuple[int, int, int]] | None = None

    @field_validator("generated_logprobs")
    @classmethod
    def _float32(cls, v: list[float]) -> list[float]:
        # Logprobs are float32 in the engine and in the store: keep records canonical.
        return np.asarray(v, dtype=np.float32).astype(float).tolist()

    @field_validator("prompt_token_ids", "generated_token_ids")
    @classmethod
    def _token_range(cls, v: list[int]) -> list[int]:
        if any(t < 0 or t > 2**31 - 1 for t in v):
            raise ValueError("token ids must be in [0, 2**31)")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> TokenEntry:
        if len(self.generated_token_ids) != len(self.generated_logprobs):
            raise ValueError(
                f"generated_token_ids ({len(self.generated_token_ids)}) and generated_logprobs "
                f"({len(self.generated_logprobs)}) must have equal length"
            )
        if self.parent_resolution == ParentResolution.RESOLVED and not self.parent_call_id:
            raise ValueError("a RESOLVED entry needs parent_call_id")
        if self.parent_resolution != ParentResolution.RESOLVED and self.parent_call_id:
            raise ValueError(f"a {self.parent_resolution} entry must not name a parent")
        if self.prefix_supplied and not self.prefix_requested:
            raise ValueError("prefix_supplied requires prefix_requested")
        if self.generated_weight_versions is not None:
            check_spans(self.generated_weight_versions, 0, len(self.generated_token_ids))
        cum = self.cumulative_ids()
        if self.cumulative_len is not None and self.cumulative_len != len(cum):
            raise ValueError(f"cumulative_len {self.cumulative_len} != {len(cum)}")
        if self.cumulative_digest is not None and self.cumulative_digest != token_digest(cum).hex():
            raise ValueError("cumulative_digest does not match the tokens")
        return self

    @property
    def entry_id(self) -> str:
        return CallIdentity(self.rollout_id, self.model_call_id, self.attempt).key_prefix()

    def cumulative_ids(self) -> list[int]:
        """Prompt plus generated ids: what a child call's prompt must start with."""
        return [*self.prompt_token_ids, *self.generated_token_ids]

    def canonical_bytes(self) -> bytes:
        return json.dumps(
            self.model_dump(mode="json"), sort_keys=True, separators=(",", ":")
        ).encode()

    def payload_sha256(self) -> str:
        return hashlib.sha256(self.canonical_bytes()).hexdigest()

    @classmethod
    def build(cls, **fields: Any) -> TokenEntry:
        """An entry with cumulative length and digest filled in from the tokens."""
        cum = [*fields["prompt_token_ids"], *fields["generated_token_ids"]]
        return cls(cumulative_len=len(cum), cumulative_digest=token_digest(cum).hex(), **fields)


def read_token_entry(data: dict | str | bytes) -> TokenEntry:
    """Load a record of any supported version; refuse newer or too old ones with a clear error."""
    if isinstance(data, str | bytes):
        data = json.loads(data)
    if not isinstance(data, dict):
        raise ValueError("a TokenEntry record must be a JSON object")
    version = data.get("schema_version", 1)
    if not isinstance(version, int):
        raise TokenEntryVersionError(f"schema_version must be an integer, got {version!r}")
    if version > SCHEMA_VERSION:
        raise TokenEntryVersionError(
            f"TokenEntry schema v{version} is newer than this reader (v{SCHEMA_VERSION}); "
            "upgrade the reader (rollout_recovery)"
        )
    if version < SCHEMA_FLOOR:
        raise TokenEntryVersionError(
            f"TokenEntry schema v{version} is below this reader's floor v{SCHEMA_FLOOR}"
        )
    data = {**data, "schema_version": SCHEMA_VERSION}
    if version < 3:  # no recorded resolution: a named parent was resolved, else unknown
        data.setdefault(
            "parent_resolution", "RESOLVED" if data.get("parent_call_id") else "UNRESOLVED"
        )
        data.setdefault("resolution_reason", f"upgraded_from_v{version}")
    return TokenEntry.model_validate(data)
