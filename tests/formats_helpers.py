"""A tiny target with a briefly trained EAGLE-3 drafter, shared by the export/import and doctor tests.

The drafter is trained on the target's own greedy continuations, so it gets drafts accepted: a random drafter has
an acceptance length of ~1, which would make "same acceptance per position" and doctor's smoke test vacuous.
Built once per test session (a few seconds) in a session temporary directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from typer.testing import CliRunner

from draftsmith.cli import app
from draftsmith.data.tokenize import encode_chat
from draftsmith.store import extract
from draftsmith.target import Target, load_target
from draftsmith.vocab import vocab_from_store
from tests.conftest import tiny_target

LAYERS = (2, 3, 4)  # inputs of layers 2..4 of a 6-layer target; SGLang ids (1, 2, 3) read alike in every version
DRAFT_VOCAB = 64


@dataclass
class Trained:
    root: Path
    model_dir: Path  # the target saved as a Hugging Face directory
    target: Target  # loaded back from model_dir, as every CLI command loads it
    store: Path
    run: Path  # the training run directory (`latest` -> checkpoints/step-*)


_cache: dict[str, Trained] = {}


def trained_setup(root: Path) -> Trained:
    if "trained" not in _cache:
        _cache["trained"] = _build(root)
    return _cache["trained"]


def chat_prompts(target: Target, n: int, seed: int) -> list[list[int]]:
    """User turns of 4 random words `t<id>`, rendered as `draftsmith eval` renders prompts."""
    words = torch.randint(2, target.vocab_size, (n, 4), generator=torch.Generator().manual_seed(seed))
    return [
        encode_chat(target.tokenizer, [{"role": "user", "content": " ".join(f"t{int(t)}" for t in row)}])
        for row in words
    ]


def greedy_samples(target: Target, n: int, new_tokens: int = 48) -> list[tuple[str, list[int], list[int]]]:
    """(id, a chat prompt + the target's greedy continuation, loss mask over the continuation)."""
    out = []
    for i, prompt in enumerate(chat_prompts(target, n, seed=1)):
        ids = torch.tensor([prompt])
        full = target.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False, pad_token_id=1
        )[0].tolist()
        out.append((f"s{i}", full, [0] * len(prompt) + [1] * (len(full) - len(prompt))))
    return out


def _build(root: Path) -> Trained:
    model_dir = root / "model"
    source = tiny_target(5, layers=6)
    source.model.save_pretrained(model_dir)
    source.tokenizer.save_pretrained(model_dir)
    target = load_target(str(model_dir))
    store = extract(target, greedy_samples(target, 16), root / "store", layer_ids=LAYERS, dtype="float32",
                    progress=False)  # fmt: skip
    vocab_from_store(store, DRAFT_VOCAB, root / "vocab")
    result = CliRunner().invoke(
        app,
        ["train", str(store), "--vocab", str(root / "vocab"), "--target", str(model_dir), "--out", str(root / "run"),
         "--max-steps", "100", "--batch-size", "4", "--ttt-steps", "2", "--lr", "2e-2", "--warmup-steps", "5",
         "--checkpoint-every", "1000", "--eval-every", "50"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return Trained(root, model_dir, target, store, root / "run")
