"""Shared fixtures: tiny random Llama targets built in memory, and one real SmolLM2 target per test run."""

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from draftsmith.target import Target

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

# Tiny models gain nothing from threads, and on a busy 2-core machine OpenMP spin-waiting makes them up to
# 80x slower (measured: 620 ms vs 8 ms per generation). One thread keeps the suite fast and steady.
torch.set_num_threads(1)


def tiny_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", pad_token="t1")


def tiny_target(
    seed: int = 0, vocab_size: int = 96, layers: int = 4, init_std: float = 0.3, eos_token_id: int = 1
) -> Target:
    """A random Llama with peaky, seed-dependent distributions: greedy paths vary and drafts often miss."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=init_std,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        bos_token_id=0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    return Target(f"tiny-{seed}", model, tiny_tokenizer(vocab_size))


@pytest.fixture(scope="session")
def smollm2() -> Target:
    """The real built-in target, loaded once per test run (about 30 s the very first time, then ~1 s)."""
    from draftsmith.target import load_target

    return load_target("smollm2-135m")


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.exists():
        pytest.skip(f"{SHARED_DATA} not found: the shared benchmark data sits beside the repo only in CI/dev")
    return SHARED_DATA


def saved_tiny_model(directory: Path) -> str:
    """tiny_target(0, vocab 96) written as an HF directory, for tests that go through the CLI."""
    target = tiny_target(0, vocab_size=96)
    target.model.save_pretrained(directory)
    target.tokenizer.save_pretrained(directory)
    return str(directory)


def tiny_conversations(path: Path, n: int) -> Path:
    """n two-turn ShareGPT conversations in the tiny tokenizer's words."""
    path.write_text(
        "".join(
            json.dumps({"id": f"c{i}", "conversations": [
                {"from": "human", "value": f"t{20 + i} t{30 + i}"}, {"from": "gpt", "value": f"t{40 + i} t{50 + i} t5"},
            ]}) + "\n"
            for i in range(n)
        )
    )  # fmt: skip
    return path
