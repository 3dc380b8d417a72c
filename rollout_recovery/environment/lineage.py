"""Request-time parent lineage: which earlier call of this rollout a new call continues.

Each finished call is recorded with a fingerprint of the assistant turn it produced and a
digest of the whole conversation up to and including that turn. A new request is resolved once,
before dispatch, on the messages as received: ROOT if no model-authored turn exists; RESOLVED
when exactly one recorded call (identical retries collapse to one) matches both the last
assistant turn's fingerprint and the conversation digest; UNRESOLVED otherwise, with a reason.
The resolver never raises into a rollout for its own failures; memory is bounded by LRU
eviction of whole rollouts.
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from rollout_recovery.data_plane.digest import token_digest
from rollout_recovery.environment.token_entry import ParentResolution

ASSISTANT_DOMAIN = b"rollout_recovery/assistant-turn/v1\x00"
CONVERSATION_DOMAIN = b"rollout_recovery/conversation/v1\x00"


def _canonical_content(content: Any) -> Any:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return [dict(sorted(p.items())) if isinstance(p, dict) else p for p in content]
    raise ValueError(f"message content must be a string, a list of parts or null, got {content!r}")


def canonical_message(msg: Any) -> dict:
    """The prompt-relevant part of a chat message, normalised; ValueError when malformed."""
    if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
        raise ValueError(f"malformed message (needs a string role): {msg!r}")
    out: dict[str, Any] = {"role": msg["role"], "content": _canonical_content(msg.get("content"))}
    calls = msg.get("tool_calls")
    if calls:
        canon = []
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(f"malformed tool call: {call!r}")
            args = fn.get("arguments", "{}")
            try:
                parsed = json.loads(args) if isinstance(args, str) else None
            except json.JSONDecodeError:
                parsed = None
            if not isinstance(parsed, dict):
                raise ValueError(f"tool call arguments must be a JSON object string: {args!r}")
            canon.append({"name": fn["name"], "arguments": parsed})
        out["tool_calls"] = canon
    for key in ("name", "tool_call_id"):
        if msg.get(key) is not None:
            out[key] = msg[key]
    return out


def _bytes(msg: dict) -> bytes:
    return json.dumps(msg, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def assistant_fingerprint(msg: dict) -> str:
    return hashlib.sha256(ASSISTANT_DOMAIN + _bytes(canonical_message(msg))).hexdigest()


def conversation_digest(messages: list[dict]) -> str:
    h = hashlib.sha256(CONVERSATION_DOMAIN)
    for m in messages:
        b = _bytes(canonical_message(m))
        h.update(struct.pack("<Q", len(b)))
        h.update(b)
    return h.hexdigest()


def validate_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for m in messages:
        canonical_message(m)
    return messages


@dataclass(frozen=True)
class Resolution:
    outcome: ParentResolution
    parent_call_id: str | None = None
    parent_tokens: tuple[int, ...] | None = None
    reason: str | None = None


@dataclass
class _Candidate:
    call_id: str
    tokens: tuple[int, ...]
    tokens_digest: bytes


@dataclass
class _Rollout:
    calls: dict[tuple[str, str], list[_Candidate]] = field(default_factory=dict)
    tokens: int = 0


class LineageStore:
    """Recorded calls per rollout, for resolving new calls' parents. Thread-safe."""

    def __init__(self, max_rollouts: int = 10_000, max_tokens: int = 200_000_000) -> None:
        self.max_rollouts, self.max_tokens = max_rollouts, max_tokens
        self._rollouts: OrderedDict[str, _Rollout] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self.evicted_rollouts = 0

    def record(
        self,
        rollout_id: str,
        call_id: str,
        request_messages: list[dict],
        assistant_message: dict,
        cumulative_ids: list[int],
    ) -> None:
        """Remember a finished call (after its TokenEntry is durable)."""
        key = (
            assistant_fingerprint(assistant_message),
            conversation_digest([*request_messages, assistant_message]),
        )
        cand = _Candidate(call_id, tuple(cumulative_ids), token_digest(cumulative_ids))
        with self._lock:
            ro = self._rollouts.pop(rollout_id, None) or _Rollout()
            self._rollouts[rollout_id] = ro
            ro.calls.setdefault(key, []).append(cand)
            ro.tokens += len(cand.tokens)
            self._tokens += len(cand.tokens)
            self._evict()

    def forget(self, rollout_id: str) -> None:
        """Drop a rollout's calls (it starts over: its new calls must not resolve to them)."""
        with self._lock:
            ro = self._rollouts.pop(rollout_id, None)
            if ro is not None:
                self._tokens -= ro.tokens

    def _evict(self) -> None:
        while len(self._rollouts) > 1 and (
            len(self._rollouts) > self.max_rollouts or self._tokens > self.max_tokens
        ):
            _, ro = self._rollouts.popitem(last=False)
            self._tokens -= ro.tokens
            self.evicted_rollouts += 1

    def resolve(self, rollout_id: str, messages: list[dict]) -> Resolution:
        """Resolve once per call, before dispatch. Malformed messages raise ValueError;
        the resolver's own failures come back as UNRESOLVED(lookup_error)."""
        validate_messages(messages)
        try:
            res = self._resolve(rollout_id, messages)
        except Exception:
            res = Resolution(ParentResolution.UNRESOLVED, reason="lookup_error")
        with self._lock:
            self.outcomes[res.reason or res.outcome.value] += 1
        return res

    def _resolve(self, rollout_id: str, messages: list[dict]) -> Resolution:
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None:
            return Resolution(ParentResolution.ROOT)
        key = (assistant_fingerprint(messages[last]), conversation_digest(messages[: last + 1]))
        with self._lock:
            ro = self._rollouts.get(rollout_id)
            if ro is not None:
                self._rollouts.move_to_end(rollout_id)
            cands = list(ro.calls.get(key, [])) if ro is not None else []
        if not cands:
            return Resolution(ParentResolution.UNRESOLVED, reason="no_match")
        if len({c.tokens_digest for c in cands}) > 1:
            return Resolution(ParentResolution.UNRESOLVED, reason="ambiguous")
        first = cands[0]  # identical retries collapse to the first recorded call
        return Resolution(ParentResolution.RESOLVED, first.call_id, first.tokens)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "rollouts": len(self._rollouts),
                "tokens": self._tokens,
                "evicted_rollouts": self.evicted_rollouts,
                **{f"resolve.{k}": v for k, v in self.outcomes.items()},
            }
