"""What the engines did across a crash, and the checks and lost-work figures built on it.

A deterministic sampler makes a call decoded from scratch look exactly like a resumed one, so
these checks read the workers' engine evidence (`call_attempts` records: resume verdict,
prefix tokens spliced in, tokens the engine decoded, per call attempt), never what a caller
meant to do. Every violation starts with the property it breaks, in brackets:

- `[resumed]`: a call the snapshot cut was not resumed by its worker;
- `[decoded_tail]`: the engine did not decode exactly length - prefix tokens for it;
- `[committed_turn_decoded_again]`: a turn the snapshot committed (or an episode it had
  finished) was decoded again after the restore;
- `[restore_refused]`: an episode record failed closed and started over;
- `[logprobs]`: generation logprobs drifted past the check's thresholds.

Lost work at one kill point: B is what each call's engine had decoded before the crash (read
from the workers at the kill), A what the restore's engines decoded for the same calls, as
position intervals [prefix, prefix + decoded). Work lost = the tokens in both. The level the
run used is measured as it ran; for the coarser levels the restore would have decoded every
call (`none`) or every call not committed in the snapshot (`turn`) from scratch, which is
what the uninterrupted reference run's engines decoded for them (same weights, seeds and
sampler; the parity checks show the restored run decodes the same tokens).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

from rollout_recovery import protocol

Call = tuple[str, str]  # (rollout id, model call id)


def spans(records: Iterable[dict]) -> dict[Call, list[tuple[int, int]]]:
    """Position intervals each call's engine decoded, one per attempt with decoded tokens."""
    out: dict[Call, list[tuple[int, int]]] = defaultdict(list)
    for r in records:
        if r["decoded_tokens"]:
            start = r["prefix_tokens"]
            out[(r["rollout_id"], r["model_call_id"])].append((start, start + r["decoded_tokens"]))
    return out


def union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The intervals merged where they touch or overlap, in order."""
    merged: list[list[int]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """Positions covered by both interval lists."""
    total = 0
    for x0, x1 in union(a):
        for y0, y1 in union(b):
            total += max(0, min(x1, y1) - max(x0, y0))
    return total


def of_step(records: Iterable[dict], step: int) -> list[dict]:
    """The records of calls generated for trainer step `step` (by the driver's rollout ids)."""
    return [r for r in records if r["rollout_id"].startswith(protocol.step_prefix(step))]


def committed(ledger: dict, finished_keys: Iterable[str]) -> tuple[set[Call], set[str]]:
    """The calls a snapshot committed (turns of its unfinished episodes) and the rollouts it
    had finished (every call of those is committed)."""
    calls = {
        (e["rollout_id"], f"c{i}")
        for e in ledger.get("episodes", [])
        for i in range(len(e["turns"]))
    }
    return calls, {protocol.rollout_of_replay_key(k) for k in finished_keys}


def lost_work(
    before: Iterable[dict],
    after: Iterable[dict],
    reference: Iterable[dict],
    ledger: dict,
    finished_keys: Iterable[str],
    level: str,
) -> dict:
    """Tokens decoded before the crash and decoded again after the restore, at the level the
    run used (measured) and at the coarser levels (against the reference's engine record)."""
    b, a, r = spans(before), spans(after), spans(reference)
    calls, done = committed(ledger, finished_keys)

    def kept(call: Call) -> bool:
        return call in calls or call[0] in done

    out = {
        "none": sum(overlap(b[c], r.get(c, [])) for c in b),
        level: sum(overlap(b[c], a.get(c, [])) for c in b),
        "decoded_before_crash": sum(e - s for iv in b.values() for s, e in iv),
        "decoded_after_restore": sum(e - s for iv in a.values() for s, e in iv),
    }
    if level == "prefix":
        out["turn"] = sum(overlap(b[c], r.get(c, [])) for c in b if not kept(c))
    return out


def check_engine_evidence(
    level: str,
    ledger: dict,
    finished_keys: Iterable[str],
    after: list[dict],
    length_of: Callable[[str, str], int | None],
) -> list[str]:
    """Every call the snapshot cut was resumed by its worker and its engine decoded exactly
    the rest of it; nothing the snapshot committed was decoded again. `after`: the restore
    phase's engine records of the step it redid; `length_of(rollout, call)`: the call's
    length in the recovered training batch."""
    out = []
    calls, done = committed(ledger, finished_keys)
    for r in after:
        if (r["rollout_id"], r["model_call_id"]) in calls or r["rollout_id"] in done:
            out.append(
                f"[committed_turn_decoded_again] {r['rollout_id']}/{r['model_call_id']} was "
                f"committed in the snapshot, yet attempt {r['attempt']} decoded "
                f"{r['decoded_tokens']} tokens of it after the restore"
            )
    if level != "prefix":
        return out
    by_call: dict[Call, list[dict]] = defaultdict(list)
    for r in after:
        by_call[(r["rollout_id"], r["model_call_id"])].append(r)
    for ep in ledger.get("episodes", []):
        cont = ep.get("continuation") or {}
        if not cont.get("keys") or ep["rollout_id"] in done:
            continue
        name = f"{ep['rollout_id']}/{cont['call_id']}"
        later = [r for r in by_call[(ep["rollout_id"], cont["call_id"])]
                 if r["attempt"] > cont["attempt"]]  # fmt: skip
        if len(later) != 1 or later[0]["resume"] != "resumed":
            seen = [(r["attempt"], r["resume"], r["refused_reason"]) for r in later]
            out.append(f"[resumed] {name} was cut with {cont['tokens']} tokens, but its "
                       f"worker did not resume it: attempts after the restore {seen}")  # fmt: skip
            continue
        rec, length = later[0], length_of(ep["rollout_id"], cont["call_id"])
        if rec["prefix_tokens"] != cont["tokens"]:
            out.append(f"[resumed] {name} resumed from {rec['prefix_tokens']} tokens, the "
                       f"snapshot cut {cont['tokens']}")  # fmt: skip
        elif length is None or rec["decoded_tokens"] != length - cont["tokens"]:
            out.append(f"[decoded_tail] {name}: the engine decoded {rec['decoded_tokens']} "
                       f"tokens after a {cont['tokens']}-token prefix, the call is {length} "
                       "tokens long")  # fmt: skip
    return out


def check_logprobs(details: dict[int, dict], min_identical: float, max_diff: float) -> list[str]:
    """Per step: the share of bit-identical generation logprobs and the largest |difference|
    against the reference, within the check's thresholds."""
    out = []
    for step, d in sorted(details.items()):
        if d["logprobs_bit_identical"] < min_identical or not (
            d["logprobs_max_abs_diff"] <= max_diff
        ):
            out.append(
                f"[logprobs] step {step}: {d['logprobs_bit_identical']:.2%} bit-identical "
                f"(>= {min_identical:.2%} required), max |diff| {d['logprobs_max_abs_diff']:.3g} "
                f"(<= {max_diff:.3g} allowed)"
            )
    return out
