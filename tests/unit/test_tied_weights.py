"""A policy with tied input and output embeddings (tiny://qwen3, Qwen3's small models): its
weights export and its trainer checkpoints hold the tied tensor once, and load back tied.
safetensors refuses a tensor written under two names, so before this the first step's export
failed on tiny://qwen3."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rollout_recovery.training.checkpoint import load_state, state_files
from rollout_recovery.training.policy import export_weights, tied_names


def _model(tied: bool) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      tie_word_embeddings=tied)  # fmt: skip
    return Qwen3ForCausalLM(cfg)


@pytest.mark.parametrize("tied", [True, False])
def test_export_writes_each_tensor_once(tmp_path, tied):
    model = _model(tied)
    names = set(load_file(str(export_weights(model, tmp_path) / "model.safetensors")))
    assert "model.embed_tokens.weight" in names
    assert ("lm_head.weight" in names) is not tied
    assert tied_names(model) == ({"lm_head.weight"} if tied else set())


def test_a_tied_checkpoint_loads_back_tied_and_equal():
    model = _model(tied=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    files = state_files(model, opt)
    other = _model(tied=True)
    with torch.no_grad():
        other.model.embed_tokens.weight.zero_()
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    load_state(files, other, other_opt)
    assert other.lm_head.weight is other.model.embed_tokens.weight
    assert torch.equal(other.lm_head.weight, model.lm_head.weight)
    assert state_files(other, other_opt) == files  # byte for byte


def test_a_checkpoint_of_another_model_is_refused():
    files = state_files(_model(tied=False), torch.optim.AdamW(_model(tied=False).parameters()))
    tied = _model(tied=True)
    with pytest.raises(ValueError, match=r"unexpected \['lm_head.weight'\]"):
        load_state(files, tied, torch.optim.AdamW(tied.parameters()))
