"""The policy in torch: the same checkpoint the workers serve, per-token logprobs, and export
of its weights in the checkpoint layout the workers reload."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file


def load_policy(model_dir: str | Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train()
    return model


def token_logprobs(model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1, shape [batch, time - 1] (position t-1 predicts t)."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def export_weights(model: torch.nn.Module, out_dir: str | Path) -> Path:
    """Write the weights as one safetensors file with the checkpoint's tensor names."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
