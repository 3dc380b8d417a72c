"""Trainer checkpoints without pickle: tensors in safetensors, everything else in JSON.

A checkpoint `trainer/step-NNNNNN/` holds the model, the AdamW state, the torch RNG state, the
data cursor and the step (`state.safetensors`, `meta.json`: the same bytes in every run that
reached the same state), plus the step's log record (`step.json`, with its timings), from which
the step log is completed when a crash came between the checkpoint and the log write.
`meta.json` is written last and names the
sha256 of `state.safetensors` and the digest of the model tensors, so a checkpoint is complete
exactly when its meta exists and its state matches it; a restore checks both (and the model
digest against the snapshot's) before loading anything. Writes go through `RunStorage`, so the
checkpoint location may be a local path or an object store.
"""

from __future__ import annotations

import hashlib
import json

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from rollout_recovery.crashpoints import crash_point
from rollout_recovery.model_identity import weights_digest
from rollout_recovery.storage import RunStorage

FORMAT = 2


class TrainerCheckpointError(RuntimeError):
    """A trainer checkpoint is missing, incomplete or altered; the message is one line.
    `kind` says which: `missing` (no complete checkpoint of the step), `damaged` (unreadable,
    another format, or its state missing or failing its sha256) or `differs` (other weights
    than the snapshot paired with it was decoded with)."""

    def __init__(self, message: str, kind: str = "damaged") -> None:
        super().__init__(message)
        self.kind = kind


def trainer_dir(step: int) -> str:
    return f"trainer/step-{step:06d}"


def trainer_steps(storage: RunStorage) -> list[int]:
    """Steps with a complete trainer checkpoint (a meta.json), oldest first."""
    names = storage.list_dir("trainer")
    return sorted(
        int(n[5:])
        for n in names
        if n.startswith("step-") and n[5:].isdigit() and storage.exists(f"trainer/{n}/meta.json")
    )


def save_trainer_checkpoint(
    storage: RunStorage,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict,
    log_record: dict | None = None,
) -> dict:
    """Write the checkpoint of `step`; returns its meta. An earlier, partial write of the same
    step is first made incomplete (its meta removed), so old meta never vouches for new state."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                tensors[f"optim.{names[id(p)]}.{key}"] = torch.as_tensor(value).detach().clone()
    tensors["rng.torch"] = torch.get_rng_state()
    state = save_safetensors(tensors)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    meta = {
        "format": FORMAT,
        "step": step,
        "state_sha256": hashlib.sha256(state).hexdigest(),
        "weights_sha256": weights_digest([state], prefix="model."),
        "param_groups": groups,
        "extra": extra,
    }
    where = trainer_dir(step)
    storage.delete_file(f"{where}/meta.json")
    storage.write_bytes(f"{where}/state.safetensors", state)
    crash_point("trainer_checkpoint_file")
    if log_record is not None:
        storage.write_bytes(f"{where}/step.json", json.dumps(log_record).encode())
        crash_point("trainer_checkpoint_file")
    storage.write_bytes(f"{where}/meta.json", json.dumps(meta, indent=1, default=list).encode())
    crash_point("trainer_checkpoint_file")
    return meta


def read_step_record(storage: RunStorage, step: int) -> dict | None:
    """The log record a trainer checkpoint kept of its step (None when it kept none)."""
    try:
        return json.loads(storage.read_bytes(f"{trainer_dir(step)}/step.json"))
    except (FileNotFoundError, ValueError):
        return None


def read_trainer_meta(storage: RunStorage, step: int) -> dict:
    """The meta of a complete checkpoint; TrainerCheckpointError when there is none."""
    where = trainer_dir(step)
    try:
        meta = json.loads(storage.read_bytes(f"{where}/meta.json"))
    except FileNotFoundError:
        raise TrainerCheckpointError(
            f"the trainer checkpoint of step {step} ({storage.display(where)}) is missing or "
            "incomplete",
            kind="missing",
        ) from None
    except ValueError:
        raise TrainerCheckpointError(f"{storage.display(where)}/meta.json is unreadable") from None
    if meta.get("format") != FORMAT:
        raise TrainerCheckpointError(
            f"{storage.display(where)} has format {meta.get('format')!r}; this version reads "
            f"format {FORMAT}"
        )
    return meta


def read_trainer_state(storage: RunStorage, step: int, meta: dict) -> bytes:
    """The checkpoint's state bytes, verified against its meta (sha256 and model digest)."""
    where = trainer_dir(step)
    try:
        state = storage.read_bytes(f"{where}/state.safetensors")
    except FileNotFoundError:
        raise TrainerCheckpointError(
            f"{storage.display(where)}/state.safetensors is missing"
        ) from None
    if hashlib.sha256(state).hexdigest() != meta["state_sha256"]:
        raise TrainerCheckpointError(
            f"{storage.display(where)}/state.safetensors fails its sha256 check (altered or torn)"
        )
    return state


def check_paired_checkpoint(
    storage: RunStorage, step: int, weights_sha256: str | None
) -> tuple[dict, bytes] | None:
    """The trainer checkpoint a snapshot taken at `step` pairs with, checked as a restore needs
    it: complete (its meta), its state matching the meta's sha256, and its model digest equal
    to the snapshot's `weights_sha256` (the weights its in-flight calls were decoded with).
    (meta, verified state); None at step 0 (the base weights: no checkpoint pairs with it);
    TrainerCheckpointError (with its `kind`) when it fails. `train --restore` and
    `snapshots verify` both check with this."""
    if step == 0:
        return None
    meta = read_trainer_meta(storage, step)
    state = read_trainer_state(storage, step, meta)
    if meta["weights_sha256"] != weights_sha256:
        raise TrainerCheckpointError(
            f"the trainer checkpoint of step {step} ({storage.display(trainer_dir(step))}) "
            f"holds weights {str(meta['weights_sha256'])[:12]}, the snapshot's calls were "
            f"decoded with {str(weights_sha256)[:12]}",
            kind="differs",
        )
    return meta, state


def load_trainer_checkpoint(
    state: bytes, meta: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict:
    """Restore model, optimizer and RNG in place from verified state; returns `extra`."""
    tensors = load_safetensors(state)
    model.load_state_dict(
        {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    )
    params = dict(model.named_parameters())
    optimizer.state.clear()
    for key, value in tensors.items():
        if key.startswith("optim."):
            name, field = key.removeprefix("optim.").rsplit(".", 1)
            optimizer.state[params[name]][field] = value
    for group, saved in zip(optimizer.param_groups, meta["param_groups"], strict=True):
        group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
    torch.set_rng_state(tensors["rng.torch"])
    return meta["extra"]
