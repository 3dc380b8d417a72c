"""The run's step log, `<checkpoint_dir>/steps.jsonl`: one line per finished trainer step (its
record), plus event lines (`{"event": "restore" | "stalled", ...}`), appended through the
run's fenced storage."""

from __future__ import annotations

import json

from rollout_recovery.storage import RunStorage
from rollout_recovery.trainer.trainer_checkpoints import read_step_record

STEPS_LOG = "steps.jsonl"


def append(storage: RunStorage, record: dict) -> None:
    storage.append_line(STEPS_LOG, json.dumps(record))


def complete(storage: RunStorage, step: int) -> bool:
    """A crash between a step's trainer checkpoint and its log line loses the line: write it
    from the record the trainer checkpoint kept (True when it did)."""
    records = [json.loads(ln) for ln in storage.read_lines(STEPS_LOG)]
    logged = {r.get("step") for r in records if "event" not in r}
    if step > 0 and step not in logged:
        record = read_step_record(storage, step)
        if record is not None:
            append(storage, record | {"logged_from": "trainer_checkpoint"})
            return True
    return False
