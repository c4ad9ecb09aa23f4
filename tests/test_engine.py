"""Greedy speculative decoding is lossless: the output equals `model.generate` token for token."""

import pytest
import torch

from draftsmith.decode.engine import SpeculativeDecoder
from draftsmith.decode.verify import verify_greedy
from draftsmith.drafters.base import Draft, NullDrafter
from draftsmith.drafters.budget import DraftBudget
from draftsmith.drafters.draft_model import ModelDrafter
from draftsmith.drafters.ngram import NgramDrafter
from draftsmith.errors import ConfigError, TargetError
from tests.conftest import tiny_target


def reference(target, prompt: list[int], max_new_tokens: int) -> list[int]:
    eos = min(target.eos_token_ids)
    ids = torch.tensor([prompt])
    out = target.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos,
    )[0, len(prompt) :].tolist()
    return out[: out.index(eos) + 1] if eos in out else out


class OracleDrafter:
    """Proposes the true greedy continuation with one token corrupted at a random position (or none), so every
    acceptance length from 0 to k occurs and the cache rollback is exercised at every depth."""

    name = "oracle"
    aux_layer_ids = ()

    def __init__(self, prompt_len: int, truth: list[int], seed: int) -> None:
        self.prompt_len, self.truth = prompt_len, truth
        self.rng = torch.Generator().manual_seed(seed)

    def begin(self, prompt, features):
        pass

    def propose(self, tokens, max_tokens, temperature, generator):
        done = len(tokens) - self.prompt_len
        draft = torch.tensor(self.truth[done : done + max_tokens], dtype=torch.long)
        if len(draft):
            bad = int(torch.randint(0, len(draft) + 1, (1,), generator=self.rng))
            if bad < len(draft):
                draft[bad] = (draft[bad] + 1) % 50
        return Draft(draft)

    def accepted(self, num_accepted, features):
        pass


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_greedy_equals_generate_with_partial_acceptance(seed, k):
    target = tiny_target(seed)
    prompt = [0] + torch.randint(2, 90, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
    truth = reference(target, prompt, 48)
    out = SpeculativeDecoder(target, OracleDrafter(len(prompt), truth, seed), k).generate(prompt, 48)
    assert out.tokens == truth
    # Each forward adds its accepted drafts + 1, except that an accepted EOS ends the answer without a bonus.
    assert len(out.tokens) - out.target_forwards <= sum(out.accepted) <= len(out.tokens) - out.target_forwards + 1
    assert out.acceptance_length > 1.0 or len(truth) < 8


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_equals_generate_for_real_drafters(seed, k):
    target, other = tiny_target(seed), tiny_target(seed + 100)
    prompt = [0, 5, 9, 5, 9, 12]
    truth = reference(target, prompt, 40)
    for drafter in (NgramDrafter(budget=DraftBudget.fixed()), ModelDrafter(other, target), NullDrafter()):
        assert SpeculativeDecoder(target, drafter, k).generate(prompt, 40).tokens == truth, drafter.name


def test_self_drafting_accepts_everything():
    """The target drafting for itself must be accepted in full: catches an off-by-one in either KV cache."""
    target = tiny_target(7)
    prompt = [0, 3, 4, 5]
    out = SpeculativeDecoder(target, ModelDrafter(target, target), 4).generate(prompt, 30)
    assert out.tokens == reference(target, prompt, 30)
    assert all(p == a for p, a in zip(out.proposed, out.accepted, strict=True))
    assert out.acceptance_length > 4.0 or out.tokens[-1] in target.eos_token_ids


def test_stops_at_eos_and_at_max_new_tokens():
    target = tiny_target(2)  # its greedy path from this prompt reaches EOS (id 1) early
    prompt = [0, 5, 7, 9]
    truth = reference(target, prompt, 60)
    assert truth[-1] == 1 and len(truth) < 60
    for k in (1, 5):
        assert SpeculativeDecoder(target, NullDrafter(), k).generate(prompt, 60).tokens == truth
        drafter = OracleDrafter(len(prompt), truth + [1] * 10, 0)
        assert SpeculativeDecoder(target, drafter, k).generate(prompt, 60).tokens == truth
    for n in (1, 2, 5):
        assert SpeculativeDecoder(target, NullDrafter(), 3).generate(prompt, n).tokens == truth[:n]


def test_verify_greedy():
    logits = torch.zeros(4, 10)
    logits[0, 3] = logits[1, 5] = logits[2, 7] = logits[3, 9] = 1
    assert verify_greedy(torch.tensor([3, 5, 7]), logits) == (3, 9)
    assert verify_greedy(torch.tensor([3, 6, 7]), logits) == (1, 5)
    assert verify_greedy(torch.tensor([4, 5, 7]), logits) == (0, 3)
    assert verify_greedy(torch.tensor([], dtype=torch.long), logits[:1]) == (0, 3)


def test_bad_arguments_are_clear_errors():
    target = tiny_target(0)
    with pytest.raises(ConfigError, match="num-draft-tokens"):
        SpeculativeDecoder(target, NullDrafter(), 0)
    with pytest.raises(TargetError, match="exceeds the context"):
        SpeculativeDecoder(target, NullDrafter(), 3).generate([0] * 250, 10)


def test_model_drafter_rejects_a_different_tokenizer():
    target = tiny_target(0, vocab_size=96)
    with pytest.raises(ConfigError, match="tokenizer"):
        ModelDrafter(tiny_target(1, vocab_size=80), target)
