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


def tied_names(model: torch.nn.Module) -> set[str]:
    """State-dict names that alias an earlier name's tensor: a model with tied input and output
    embeddings (Qwen3's small models, tiny://qwen3) lists one tensor as both
    `model.embed_tokens.weight` and `lm_head.weight`. A checkpoint holds it once, under the
    first name (safetensors refuses to write a tensor twice)."""
    seen: set[tuple[int, torch.dtype, tuple[int, ...]]] = set()
    tied = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
        if key in seen:
            tied.add(name)
        seen.add(key)
    return tied


def unique_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state with each tensor once (`tied_names` left out)."""
    tied = tied_names(model)
    return {k: v.detach().contiguous() for k, v in model.state_dict().items() if k not in tied}


def export_weights(model: torch.nn.Module, out_dir: str | Path) -> Path:
    """Write the weights as one safetensors file with the checkpoint's tensor names (a tied
    output embedding is not written: the engine ties it to the input one on load)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(unique_state(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
