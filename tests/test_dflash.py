"""The DFlash drafter: lossless decoding through the engine (greedy and sampling), its context cache, and errors."""

import json

import pytest
import torch

from draftsmith.decode.engine import SpeculativeDecoder
from draftsmith.drafters.budget import DraftBudget
from draftsmith.drafters.dflash import (
    DFlashConfig,
    DFlashDrafter,
    DFlashModel,
    default_layer_ids,
    save_checkpoint,
)
from draftsmith.errors import DraftsmithError
from draftsmith.formats.load import load_drafter
from tests.conftest import tiny_target
from tests.test_engine import reference
from tests.test_sampling import P_VALUE_FLOOR, chi_square_pvalue, exact_joint, sample_engine


def make_model(target, block_size: int = 8, layers: int = 2, seed: int = 0, ids=(1, 3)) -> DFlashModel:
    """A random drafter with non-trivial norm weights, so a wrong norm cannot hide; the target's embeddings/head."""
    config = DFlashConfig.from_target(target, layers, ids, block_size, fingerprint="x")
    torch.manual_seed(seed)
    model = DFlashModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif p.requires_grad:
                p.normal_(0, 0.3)
    return model.attach_target(target)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_greedy_equals_generate(seed, block_size):
    target = tiny_target(seed, vocab_size=12 if seed % 2 else 96)  # a small vocabulary: drafts often accepted
    prompt = [0] + torch.randint(2, 12, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
    truth = reference(target, prompt, 40)
    drafter = DFlashDrafter(make_model(target, block_size, seed=seed))
    out = SpeculativeDecoder(target, drafter, block_size - 1).generate(prompt, 40)
    assert out.tokens == truth
    if seed % 2 and len(truth) >= 20:
        assert sum(out.accepted) > 0  # some blocks were (partly) accepted: the context kept growing correctly


def test_context_cache_equals_a_fresh_forward():
    """After rounds of accepted tokens, the cached context keys give the same block as one forward from scratch."""
    target = tiny_target(3, vocab_size=12)
    model = make_model(target, 4)
    prompt = [0, 4, 5, 6, 7]
    decoder = SpeculativeDecoder(target, drafter := DFlashDrafter(model), 3)
    out = decoder.generate(prompt, 20)
    tokens = torch.tensor(prompt + out.tokens)  # the drafter has seen the features of all but the newest
    cached = drafter.block_logits(tokens, 3)
    fresh = DFlashDrafter(model)
    features = target.forward(tokens[:-1], target.new_cache(), drafter.aux_layer_ids).aux_hidden
    fresh.begin(tokens[:-1], features)
    torch.testing.assert_close(cached, fresh.block_logits(tokens, 3), atol=1e-4, rtol=1e-4)


def test_sampling_is_lossless_with_a_dflash_drafter():
    target = tiny_target(seed=3, vocab_size=5, layers=2, init_std=0.5)
    drafter = DFlashDrafter(make_model(target, block_size=3, layers=1, ids=(1,)))
    prompt, runs, temperature = [2, 3, 4], 3000, 1.0
    counts = sample_engine(target, drafter, prompt, 4, runs, temperature)
    assert chi_square_pvalue(counts, exact_joint(target, prompt, 4, temperature), runs) > P_VALUE_FLOOR


def test_checkpoint_round_trip_through_load_drafter(tmp_path):
    target = tiny_target(1)
    model = make_model(target)
    save_checkpoint(model, tmp_path / "checkpoints" / "step-000003")
    (tmp_path / "latest").write_text("checkpoints/step-000003\n")
    drafter = load_drafter(tmp_path, target)
    assert isinstance(drafter, DFlashDrafter) and drafter.aux_layer_ids == (1, 3)
    ours = {k: v for k, v in model.state_dict().items()}
    assert all(torch.equal(drafter.model.state_dict()[k], v) for k, v in ours.items())


def test_default_layer_ids_spread_like_zlab():
    assert default_layer_ids(30, 1) == (16,)
    assert default_layer_ids(36, 5) == (2, 10, 18, 26, 34)  # Qwen3-8B's published DFlash: z-lab 1, 9, 17, 25, 33


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"aux_layer_ids": (1, 4)}, r"reads target layers \[1, 4\].*has 4 layers"),
        ({"mask_token_id": 96}, "mask token 96 is outside"),
        ({"hidden_size": 64}, "hidden size 64 != target 32"),
    ],
)
def test_bad_checkpoints_are_one_line_errors(tmp_path, change, message):
    target = tiny_target(0)
    save_checkpoint(make_model(target), tmp_path)
    config = (tmp_path / "config.json").read_text()
    (tmp_path / "config.json").write_text(json.dumps(json.loads(config) | change))
    with pytest.raises(DraftsmithError, match=message) as err:
        load_drafter(tmp_path, target)
    assert "\n" not in err.value.message and err.value.hint


def test_block_size_one_is_refused():
    with pytest.raises(DraftsmithError, match="block size must be at least 2"):
        DFlashConfig.from_target(tiny_target(0), 1, (1,), block_size=1, fingerprint="x")


def cutting_budget() -> DraftBudget:
    """Costs under which verifying more than one draft never pays: (1 + L) / cost(L + 1) is largest at L = 1."""
    return DraftBudget(forward_costs=(1.0, 1.05, 1.6, 2.2, 2.8, 3.4, 4.0, 4.6), step_cost=0.05)


def recording(drafter: DFlashDrafter) -> list[int]:
    """The length of every proposal the drafter makes from now on."""
    lengths, propose = [], drafter.propose

    def spy(*args, **kwargs):
        draft = propose(*args, **kwargs)
        lengths.append(len(draft.tokens))
        return draft

    drafter.propose = spy
    return lengths


@pytest.mark.parametrize("seed", range(4))
def test_an_adaptive_budget_cuts_blocks_and_stays_lossless(seed):
    """A measured budget verifies the prefix of the block that pays (here at most one token), rests after blocks
    that do not, and calibrates on what the target wrote; the output is still the target's own."""
    target = tiny_target(seed, vocab_size=12)
    drafter = DFlashDrafter(make_model(target, 8, seed=seed), budget=(budget := cutting_budget()))
    lengths = recording(drafter)
    prompt = [0, 3, 4, 5]
    out = SpeculativeDecoder(target, drafter, 7).generate(prompt, 40)
    assert out.tokens == reference(target, prompt, 40)
    assert max(lengths) <= 1  # cut
    if len(lengths) > 1:  # a second round scored the first block against what the target wrote
        assert budget.confidence != cutting_budget().confidence
    fixed = DFlashDrafter(drafter.model)  # no budget: the whole block every round
    full = recording(fixed)
    assert SpeculativeDecoder(target, fixed, 7).generate(prompt, 40).tokens == out.tokens
    assert max(full) == min(7, 40 - 1) or len(out.tokens) < 40  # whole blocks, unless the output ended early


def test_sampling_is_lossless_with_a_cut_block():
    target = tiny_target(seed=3, vocab_size=5, layers=2, init_std=0.5)
    drafter = DFlashDrafter(make_model(target, block_size=3, layers=1, ids=(1,)), budget=cutting_budget())
    prompt, runs, temperature = [2, 3, 4], 3000, 1.0
    counts = sample_engine(target, drafter, prompt, 4, runs, temperature)
    assert chi_square_pvalue(counts, exact_joint(target, prompt, 4, temperature), runs) > P_VALUE_FLOOR


def with_draft_vocab(model: DFlashModel, target, size: int, seed: int = 0) -> DFlashModel:
    """The same weights with a random draft vocabulary of `size` target tokens (what the vocab stage would pick)."""
    config = model.config.model_copy(update={"draft_vocab_size": size})
    restricted = DFlashModel(config).attach_target(target)
    restricted.load_state_dict(
        model.state_dict() | {"draft_ids": torch.randperm(target.vocab_size)[:size]}, strict=False
    )
    return restricted


@pytest.mark.parametrize("seed", range(4))
def test_draft_vocabulary_drafts_only_its_tokens_and_stays_lossless(seed):
    target = tiny_target(seed, vocab_size=12)
    model = with_draft_vocab(make_model(target, 8, seed=seed), target, 6)
    allowed = set(model.draft_ids.tolist())
    drafter = DFlashDrafter(model)
    prompt = [0, 3, 4, 5]
    out = SpeculativeDecoder(target, drafter, 7).generate(prompt, 30)
    assert out.tokens == reference(target, prompt, 30)
    tokens = torch.tensor(prompt + out.tokens[:10])
    drafter.begin(tokens[:-1], target.forward(tokens[:-1], target.new_cache(), drafter.aux_layer_ids).aux_hidden)
    draft = drafter.propose(tokens, 7, 1.0, torch.Generator().manual_seed(0))
    assert set(draft.tokens.tolist()) <= allowed and torch.allclose(draft.probs.sum(-1), torch.ones(7))
    assert float(draft.probs[:, [i for i in range(12) if i not in allowed]].sum()) == 0.0


def test_sampling_is_lossless_with_a_draft_vocabulary():
    target = tiny_target(seed=3, vocab_size=5, layers=2, init_std=0.5)
    model = with_draft_vocab(make_model(target, block_size=3, layers=1, ids=(1,)), target, 3)
    prompt, runs, temperature = [2, 3, 4], 3000, 1.0
    counts = sample_engine(target, DFlashDrafter(model), prompt, 4, runs, temperature)
    assert chi_square_pvalue(counts, exact_joint(target, prompt, 4, temperature), runs) > P_VALUE_FLOOR
