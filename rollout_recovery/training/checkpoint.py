"""Trainer checkpoints without pickle: tensors in safetensors, everything else in JSON.

Holds the model, AdamW state, torch RNG state, the data cursor and the step, written to a
temporary directory and renamed into place, so a crash never leaves a half checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def save_trainer_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict
) -> Path:
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                tensors[f"optim.{names[id(p)]}.{key}"] = torch.as_tensor(value).detach().clone()
    tensors["rng.torch"] = torch.get_rng_state()
    save_file(tensors, str(tmp / "state.safetensors"))
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    meta = {"param_groups": groups, "extra": extra}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=list))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def load_trainer_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict:
    """Restore model, optimizer and RNG in place; returns the `extra` dict (cursor, step)."""
    path = Path(path)
    tensors = load_file(str(path / "state.safetensors"))
    meta = json.loads((path / "meta.json").read_text())
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
