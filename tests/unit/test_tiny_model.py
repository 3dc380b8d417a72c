from __future__ import annotations

import hashlib
from pathlib import Path

from rollout_recovery.model_identity import resolve_model_path
from rollout_recovery.tiny_model import TinyModelSpec, build_tiny_model, ensure_tiny_model


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_two_builds_are_byte_identical(tmp_path):
    a = _digests(build_tiny_model(tmp_path / "a"))
    b = _digests(build_tiny_model(tmp_path / "b"))
    assert set(a) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert a == b


def test_a_different_seed_gives_different_weights(tmp_path):
    a = _digests(build_tiny_model(tmp_path / "a"))
    b = _digests(build_tiny_model(tmp_path / "b", TinyModelSpec(seed=99)))
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"]


def test_cache_builds_once(tmp_path):
    first = ensure_tiny_model(tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    second = ensure_tiny_model(tmp_path)
    assert first == second
    assert (second / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tiny-build-")]


def test_transformers_loads_model_tokenizer_and_chat_template(tiny_model_dir):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert config.head_dim == 64 and config.num_hidden_layers >= 2
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text)["input_ids"]
    # Byte-level BPE: any text round-trips, including multi-byte characters.
    sample = "naïve café 東京 🙂"
    assert tok.decode(tok(sample)["input_ids"]) == sample
    assert tok.eos_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), config.vocab_size)
    assert torch.isfinite(logits).all()


def test_model_paths_resolve_to_what_vllm_loads(tiny_model_dir, tmp_path):
    from rollout_recovery import tiny_model

    assert resolve_model_path("tiny://default") == str(tiny_model_dir)
    assert resolve_model_path("hf://Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    # Resolution is about which model a run uses, not about building the tiny one.
    assert not hasattr(tiny_model, "resolve_model_path")
