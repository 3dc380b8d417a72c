"""The shipped driver's trainer checkpoint format, without pickle: tensors in safetensors,
the rest in JSON.

`state.safetensors` holds the model, the AdamW state and the torch RNG state; `trainer.json`
the optimizer's parameter groups (the data cursor goes in the checkpoint's `extra`). Equal
states give equal bytes, so a recovered run's final checkpoint is byte-identical to an
uninterrupted one's. The run keeps
these files as any loop's (trainer/trainer_checkpoints.py: written through fenced storage,
paired with the next snapshot by digest, verified before they are handed back).
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from rollout_recovery.training.policy import tied_names, unique_state

STATE = "state.safetensors"
TRAINER = "trainer.json"


def state_files(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, bytes]:
    """The trainer's state as the files of a checkpoint."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {f"model.{k}": v for k, v in unique_state(model).items()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                tensors[f"optim.{names[id(p)]}.{key}"] = torch.as_tensor(value).detach().clone()
    tensors["rng.torch"] = torch.get_rng_state()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    trainer = json.dumps({"param_groups": groups}, indent=1, default=list).encode()
    return {STATE: save_safetensors(tensors), TRAINER: trainer}


def load_state(
    files: dict[str, bytes], model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """Restore model, optimizer and RNG in place from a checkpoint's (verified) files."""
    tensors = load_safetensors(files[STATE])
    state = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    want = set(model.state_dict()) - tied_names(model)  # a tied tensor under its first name
    if set(state) != want:
        raise ValueError(
            f"the checkpoint's model state does not fit this model: missing "
            f"{sorted(want - set(state))}, unexpected {sorted(set(state) - want)}"
        )
    model.load_state_dict(state, strict=False)
    params = dict(model.named_parameters())
    optimizer.state.clear()
    for key, value in tensors.items():
        if key.startswith("optim."):
            name, field = key.removeprefix("optim.").rsplit(".", 1)
            optimizer.state[params[name]][field] = value
    saved = json.loads(files[TRAINER])["param_groups"]
    for group, kept in zip(optimizer.param_groups, saved, strict=True):
        group.update({k: tuple(v) if isinstance(v, list) else v for k, v in kept.items()})
    torch.set_rng_state(tensors["rng.torch"])
