"""The notes agent: a multi-turn tool episode whose tool changes state outside the process.

Each turn the model replies, then the `note.append` tool saves the reply's digits (or its first
32 non-space characters when it has none) as a note in a store under `ctx.scratch_dir` and adds
the digits' sum to a running register. The tiny random model emits mostly garbage, so the tool
is driven by rules over the reply text, not by structured tool calls.

The exactly-once contract, which any environment with side effects must keep:
- every side effect goes through `ctx.effect`; after a crash the episode runs again from the
  top, and an effect recorded in the restored journal is answered from it and does not run;
- an effect that ran after the last checkpoint is not in the restored journal and runs again
  on replay, under the same `ctx.effect_id`. The store therefore logs every operation by its
  effect id, in the same atomic file write as the state change, and answers a logged id with
  the recorded result instead of applying it twice.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any

from rollout_recovery import faults

TOOL = "note.append"
STORE_FILE = "notes_store.json"
DIGITS = "0123456789"


def note_text(reply: str) -> str:
    """What `note.append` saves for a reply: its digits, else its first 32 non-space chars."""
    digits = "".join(c for c in reply if c in DIGITS)
    return digits or "".join(reply.split())[:32]


class NoteStore:
    """Notes and a register in one JSON file, with an operation log keyed by effect id."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.path = self.dir / STORE_FILE

    def load(self) -> dict[str, Any]:
        if not self.path.exists():
            return {"notes": [], "register": 0, "ops": [], "dedupes": 0}
        return json.loads(self.path.read_text())

    def append(self, effect_id: str, text: str) -> dict[str, Any]:
        """Save `text` as a note under `effect_id`; a logged id returns its recorded result."""
        state = self.load()
        done = next((op for op in state["ops"] if op["effect_id"] == effect_id), None)
        if done is not None and not faults.active("effect_dedupe_disabled"):
            state["dedupes"] += 1  # a re-executed effect, absorbed; counted so checks see it
            self._write(state)
            return done["result"]
        state["notes"].append(text)
        state["register"] += sum(int(c) for c in text if c in DIGITS)
        result = {"effect_id": effect_id, "note": text, "count": len(state["notes"])}
        result["register"] = state["register"]
        state["ops"].append(
            {"effect_id": effect_id, "op": "append", "text": text, "result": result}
        )
        self._write(state)  # log entry and state change land in one write: both or neither
        return result

    def _write(self, state: dict[str, Any]) -> None:
        """Replace the store file atomically, so a crash never leaves a torn store. A temporary
        file left by a write a crash cut short is removed first: the store has one writer
        (its episode), and that write's effect runs again on replay, since it never finished."""
        for stale in self.dir.glob(".notes-*.tmp"):
            stale.unlink(missing_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".notes-", suffix=".tmp", dir=self.dir)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(state, f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)  # make the rename itself durable
        finally:
            os.close(dfd)


def append_note(scratch_dir: str | os.PathLike[str], effect_id: str | None, reply: str) -> dict:
    """The `note.append` tool: the effect function, keyed by the running effect's id."""
    if not effect_id:
        raise RuntimeError("append_note must run inside ctx.effect (no effect id)")
    return NoteStore(scratch_dir).append(effect_id, note_text(reply))


async def episode(ctx: Any, task: dict) -> dict:
    """Run `ctx.max_turns` model calls, applying `note.append` after each but the last."""
    messages = [dict(m) for m in task["messages"]]
    replies: list[str] = []
    notes: list[str] = []
    effects: list[str] = []
    register = 0
    for turn in range(ctx.max_turns):
        reply = await ctx.chat(messages)
        messages.append(reply.message)
        replies.append(reply.content)
        if turn == ctx.max_turns - 1:
            break
        # Only JSON-able args (the journal matches an effect by name + args); the effect id
        # exists only while the effect runs, so the closure reads it then.
        res = await ctx.effect(
            TOOL, lambda text: append_note(ctx.scratch_dir, ctx.effect_id, text), reply.content
        )
        notes.append(res["note"])  # from the result: what the store holds, even on replay
        effects.append(res["effect_id"])
        register = res["register"]
        tool_out = json.dumps({"notes": res["count"], "register": register})
        messages.append({"role": "tool", "name": TOOL, "content": tool_out})
    return {"register": register, "notes": notes, "effects": effects, "text": "\n".join(replies)}


_PROMPTS = (
    "Keep notes of the numbers you see: {nums}. Reply with numbers.",
    "Write down these numbers: {nums}. Answer only in digits.",
    "Numbers to remember: {nums}. Reply with the numbers.",
)


def tasks(n: int, seed: int) -> list[dict]:
    """`n` deterministic tasks for `seed`: a prompt listing a few numbers to note."""
    rng = random.Random(f"notes-{seed}")
    out = []
    for i in range(n):
        numbers = [rng.randrange(100) for _ in range(rng.randint(3, 5))]
        prompt = rng.choice(_PROMPTS).format(nums=" ".join(map(str, numbers)))
        out.append(
            {
                "id": f"notes-{seed}-{i}",
                "messages": [{"role": "user", "content": prompt}],
                "numbers": numbers,
            }
        )
    return out


def reward(task: dict, result: dict) -> float:
    """0.8 x the share of digits among the replies' non-space characters, plus 0.2 x the
    share of the task's numbers that appear in some saved note. Dense enough that samples of
    a random policy differ, so GRPO gets a signal."""
    chars = "".join(result.get("text", "").split())
    share = sum(c in DIGITS for c in chars) / len(chars) if chars else 0.0
    numbers = task.get("numbers") or []
    notes = result.get("notes", [])
    recall = sum(any(str(x) in n for n in notes) for x in numbers) / len(numbers) if numbers else 0
    return 0.8 * share + 0.2 * recall


def store_summary(scratch_dir: str | os.PathLike[str]) -> dict:
    """The store's visible state, to compare a reference run with a recovered one."""
    state = NoteStore(scratch_dir).load()
    ops = [op["effect_id"] for op in state["ops"]]
    return {k: state[k] for k in ("notes", "register", "dedupes")} | {"ops": ops}


def applied_exactly_once(scratch_dir: str | os.PathLike[str]) -> list[str]:
    """Violations of exactly-once (empty = fine): each effect id logged once, and the notes,
    register and recorded results equal a re-derivation from the op log in order."""
    state = NoteStore(scratch_dir).load()
    out: list[str] = []
    seen: set[str] = set()
    notes: list[str] = []
    register = 0
    for i, op in enumerate(state["ops"]):
        eid = op["effect_id"]
        if eid in seen:
            out.append(f"effect {eid} applied more than once (op {i})")
        seen.add(eid)
        notes.append(op["text"])
        register += sum(int(c) for c in op["text"] if c in DIGITS)
        want = {"effect_id": eid, "note": op["text"], "count": len(notes), "register": register}
        if op["result"] != want:
            out.append(f"op {i} ({eid}) recorded {op['result']}, re-derived {want}")
    if state["notes"] != notes:
        out.append(f"notes {state['notes']} differ from the op log's {notes}")
    if state["register"] != register:
        out.append(f"register {state['register']} differs from the op log's {register}")
    leftovers = sorted(p.name for p in Path(scratch_dir).glob(".notes-*.tmp"))
    if leftovers:
        out.append(f"temporary files left behind: {leftovers}")
    return out
