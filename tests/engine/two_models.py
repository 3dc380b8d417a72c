"""The engine tests that run on both offline tiny models, and what each needs of one.

`tiny` (tiny://default) is a Llama with a 512-token byte-level BPE: every non-ASCII character
is several tokens. `qwen3` (tiny://qwen3) has Qwen's real 151k vocabulary: most characters are
one token, two ids end a generation, tool-call tags are single non-special tokens, and the
embedding has rows the tokenizer does not know. A test parametrized over `MODELS` gets its
model's worker with the `worker_of` fixture (tests/engine/conftest.py): one capture worker per
model for the whole session, the qwen3 one started by the first test that asks for it.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from rollout_recovery.config import RolloutRecoveryConfig
from rollout_recovery.data_plane import StagingStore
from rollout_recovery.generation.pool import WorkerHandle

MODELS = ("tiny", "qwen3")


@dataclass(frozen=True)
class ModelWorker:
    """A capture worker serving one of the tiny models, with what tests derive ids from."""

    name: str  # one of MODELS
    worker: WorkerHandle
    store: StagingStore
    cfg: RolloutRecoveryConfig  # the tiny job's config on this model (tests copy it)
    model_dir: Path

    @property
    def url(self) -> str:
        return self.worker.info.url

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return tokenizer(self.model_dir)

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends a generation: the tokenizer's EOS first, then the others
        generation_config.json lists (vLLM stops on those as stop token ids)."""
        return end_of_sequence_ids(self.model_dir)

    @property
    def ids_past_tokenizer(self) -> list[int]:
        """Embedding rows the tokenizer has no token for (none in tiny)."""
        return ids_past_tokenizer(self.model_dir)


@functools.cache
def tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir)


@functools.cache
def end_of_sequence_ids(model_dir: Path) -> list[int]:
    eos = tokenizer(model_dir).eos_token_id
    listed = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    listed = [listed] if isinstance(listed, int) else listed
    return [eos, *(i for i in listed if i != eos)]


def split_character(tok: PreTrainedTokenizerBase) -> tuple[str, list[int]]:
    """A character this tokenizer encodes as two tokens, neither a character alone (tiny: é,
    like most non-ASCII characters; qwen3, which holds those whole: a rare emoji, U+1F312 as a
    3-byte lead token and a continuation byte)."""
    for ch in ("é", "€", *map(chr, range(0x1F300, 0x1FB00))):
        ids = tok.encode(ch, add_special_tokens=False)
        if len(ids) == 2 and all(tok.decode([i]).endswith("\ufffd") for i in ids):
            return ch, ids
    raise AssertionError("no character split across two tokens")


def split_sampling(tok: PreTrainedTokenizerBase, seed: int) -> tuple[dict, dict]:
    """(vllm_xargs, request fields) of a seeded temperature-1 call (position-keyed, so it
    resumes exactly) whose output is dense in the pieces of `split_character` and in the
    special <|im_start|>, which decodes to nothing unless special tokens are kept: greedy
    output of these random models repeats whole tokens and never splits a character. Each
    gets a logit bias of ln(vocabulary size): against a near-uniform random model, each then
    weighs about as much as all other tokens together."""
    _, pieces = split_character(tok)
    bias = math.log(len(tok))
    ids = [*pieces, tok.convert_tokens_to_ids("<|im_start|>")]
    xargs = {"rr_seed": seed, "rr_temperature": 1.0}
    return xargs, {"logit_bias": {str(i): bias for i in ids}}


def splits_inside(ids: list[int], pieces: list[int]) -> list[int]:
    """Cut points k (a prefix of k tokens) that fall between two pieces of one character."""
    n = len(pieces)
    runs = [s for s in range(len(ids) - n + 1) if ids[s : s + n] == pieces]
    return sorted({k for s in runs for k in range(s + 1, s + n)})


@functools.cache
def ids_past_tokenizer(model_dir: Path) -> list[int]:
    """Embedding rows the tokenizer has no token for (qwen3: 151669-151935, Qwen3's padding):
    the model can sample them, they decode to '', and they come back as prompt ids."""
    rows = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return list(range(len(tokenizer(model_dir)), rows))
