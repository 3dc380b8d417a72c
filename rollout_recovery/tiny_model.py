"""Offline, byte-for-byte reproducible tiny models, and the cache that builds each once.

Nothing can be downloaded from a model hub on our machines, yet every engine test needs a
model vLLM and transformers both load. `tiny://default` is a Llama with a byte-level BPE
trained here on a fixed corpus; `tiny://qwen3` (tiny_qwen.py) is a Qwen3 with Qwen's real
vocabulary. Both come from fixed seeds: the same files, the same bytes, every time (for a
given tokenizers/transformers version).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar, Protocol

from rollout_recovery.tiny_qwen import TinyQwen3Spec
from rollout_recovery.tiny_weights import write_seeded_weights

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A small, fixed training corpus: arithmetic, short instructions and tool-call-like text, so
# merges cover the vocabulary the project's toy tasks use.
_CORPUS_LINES = [
    "What is {a} + {b}? The answer is {c}.",
    "Count the letters in the word {w}: there are {n}.",
    "Repeat after me: {w} {w} {w}.",
    'Call the tool add with {{"a": {a}, "b": {b}}} and report the result {c}.',
    "The user asked about {w}; the assistant answered politely.",
    "Question: reverse {w}. Answer: {r}.",
]
_WORDS = ["apple", "river", "python", "matrix", "rollout", "token", "prefix", "garden", "sunny"]


def _corpus() -> list[str]:
    lines = []
    for i in range(600):
        a, b = (i * 7) % 97, (i * 13) % 89
        w = _WORDS[i % len(_WORDS)]
        template = _CORPUS_LINES[i % len(_CORPUS_LINES)]
        lines.append(template.format(a=a, b=b, c=a + b, w=w, n=len(w), r=w[::-1]))
    lines.append("Ünïcödé façade — naïve café, 東京, emoji 🙂 stay as bytes.")
    return lines


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model; head_dim must be >= 32 for vLLM's CPU attention."""

    dir_prefix: ClassVar[str] = "tiny-llama"

    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    init_std: float = 0.05
    seed: int = 1234
    format_version: int = 1

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]

    def build(self, out_dir: str | Path) -> Path:
        return build_tiny_model(out_dir, self)


class TinySpec(Protocol):
    """What the cache needs of a tiny model's spec: a directory name and a builder."""

    dir_prefix: ClassVar[str]

    def digest(self) -> str: ...

    def build(self, out_dir: str | Path) -> Path: ...


# `tiny://<name>` -> the spec it builds. The default's spec (and so its bytes and cache
# directory) never changes; a new model gets a new name.
TINY_MODELS: dict[str, TinySpec] = {"default": TinyModelSpec(), "qwen3": TinyQwen3Spec()}


def tiny_spec(name: str) -> TinySpec:
    """The spec of `tiny://<name>`; the error lists the known names."""
    if name not in TINY_MODELS:
        known = ", ".join(f"`tiny://{n}`" for n in TINY_MODELS)
        raise ValueError(f"unknown tiny model {name!r}; use one of {known}")
    return TINY_MODELS[name]


def _train_tokenizer(spec: TinyModelSpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        min_frequency=2,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer, length=None)
    return tok


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write the model (config, safetensors weights, tokenizer, chat template) into out_dir."""
    if spec.head_dim < 32:
        raise ValueError(f"head_dim {spec.head_dim} < 32 is not supported by vLLM's CPU backend")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    # Rayon's thread count does not change BPE merges, but pin it so training is single-threaded
    # and identical on every machine.
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    tok = _train_tokenizer(spec)
    vocab = tok.get_vocab()
    vocab_size = len(vocab)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
    ids = {t: vocab[t] for t in SPECIAL_TOKENS}
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "model_max_length": spec.max_position_embeddings,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
            "added_tokens_decoder": {
                str(i): {
                    "content": t,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                }
                for t, i in ids.items()
            },
        },
    )
    _write_json(
        out / "special_tokens_map.json",
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    )
    _write_json(
        out / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab_size,
            "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size,
            "num_hidden_layers": spec.num_hidden_layers,
            "num_attention_heads": spec.num_attention_heads,
            "num_key_value_heads": spec.num_key_value_heads,
            "head_dim": spec.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": spec.max_position_embeddings,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            "torch_dtype": "float32",
            "initializer_range": spec.init_std,
        },
    )
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
    )

    # Weights from our own generator in a fixed order, so they do not depend on how a
    # transformers version happens to initialise modules.
    h, inter, kv = (
        spec.hidden_size,
        spec.intermediate_size,
        spec.num_key_value_heads * spec.head_dim,
    )
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (vocab_size, h),
    }
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    write_seeded_weights(shapes, spec.seed, spec.init_std, out / "model.safetensors")
    return out


def default_cache_dir() -> Path:
    root = os.environ.get("ROLLOUT_RECOVERY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rollout_recovery"
    )
    return Path(root)


def tiny_model_dir(cache_dir: str | Path | None = None, spec: TinySpec = TinyModelSpec()) -> Path:
    """Where a tiny model is cached (built there once it holds `model.safetensors`)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / f"{spec.dir_prefix}-{spec.digest()}"


def ensure_tiny_model(
    cache_dir: str | Path | None = None, spec: TinySpec = TinyModelSpec()
) -> Path:
    """Return the cached tiny model directory, building it once (safe across processes)."""
    target = tiny_model_dir(cache_dir, spec)
    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    if (target / "model.safetensors").is_file():
        return target
    with open(root / ".tiny-model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "model.safetensors").is_file():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=".tiny-build-", dir=root))
        try:
            spec.build(tmp)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
