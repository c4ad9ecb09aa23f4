"""A learned drafter and the n-gram drafter verified as one tree: the merge keeps every proposal's paths, shares
deterministic prefixes, keeps sampled proposals apart with their q, and stays lossless greedy and sampling. Taking
turns (`take_turns`), the n-gram drafter drafts the rounds it speaks in, alone, and the learned one the others."""

import pytest
import torch

from draftsmith.decode import tree
from draftsmith.decode.engine import SpeculativeDecoder
from draftsmith.drafters.base import Draft
from draftsmith.drafters.budget import DraftBudget
from draftsmith.drafters.draft_model import ModelDrafter
from draftsmith.drafters.eagle3 import Eagle3Drafter, save_checkpoint
from draftsmith.drafters.merged import MergedDrafter, merge
from draftsmith.drafters.ngram import NgramDrafter
from draftsmith.errors import ConfigError
from draftsmith.formats.load import build_drafter
from draftsmith.serve.scheduler import fork_drafter
from tests.conftest import tiny_target
from tests.test_eagle3 import make_model
from tests.test_engine import reference
from tests.test_sampling import P_VALUE_FLOOR, chi_square_pvalue, exact_joint


def paths(draft: Draft) -> set[tuple[int, ...]]:
    """Every root-to-node token path of a draft (a chain when it has no parents)."""
    parents = draft.parents.tolist() if draft.parents is not None else list(range(-1, len(draft.tokens) - 1))
    out = set()
    for i in range(len(parents)):
        path, at = [], i
        while at >= 0:
            path.insert(0, int(draft.tokens[at]))
            at = parents[at]
        out.add(tuple(path))
    return out


def test_deterministic_drafts_merge_into_a_trie():
    chain = Draft(torch.tensor([5, 6, 7]))
    other = Draft(torch.tensor([5, 6, 9, 4]))
    branching = Draft(torch.tensor([8, 5, 3]), parents=torch.tensor([-1, -1, 1]))
    merged = merge([chain, Draft.empty(), other, branching])
    assert merged.tokens.tolist() == [5, 6, 7, 9, 4, 8, 3]  # the first drafter's nodes first
    assert merged.parents.tolist() == [-1, 0, 1, 1, 3, -1, 0]  # 5 and 5-6 verified once; 8's sibling 5 is shared
    assert merged.probs is None
    assert paths(merged) == paths(chain) | paths(other) | paths(branching)


def test_a_lone_draft_is_returned_unchanged():
    chain = Draft(torch.tensor([5, 6]))
    assert merge([Draft.empty(), chain]) is chain
    assert len(merge([Draft.empty(), Draft.empty()]).tokens) == 0


def test_sampled_drafts_keep_their_own_subtree_and_q():
    q = torch.softmax(torch.randn(2, 10, generator=torch.Generator().manual_seed(0)), -1)
    sampled = Draft(torch.tensor([5, 6]), q)
    lookup = Draft(torch.tensor([5, 6, 7]))  # the same tokens, but deterministic: not the same candidates
    merged = merge([sampled, lookup])
    assert merged.tokens.tolist() == [5, 6, 5, 6, 7]
    assert merged.parents.tolist() == [-1, 0, -1, 2, 3]
    assert torch.equal(merged.probs[:2], q)
    assert torch.equal(merged.probs[2:], torch.nn.functional.one_hot(torch.tensor([5, 6, 7]), 10).float())


def learned_and_ngram(seed: int, shape: tree.TreeShape | None = None, take_turns: bool = False):
    target = tiny_target(seed)
    eagle = Eagle3Drafter(make_model(target, seed=seed), tree=shape)
    return target, MergedDrafter([eagle, NgramDrafter(budget=DraftBudget.fixed())], take_turns)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("shape", [None, "depth=3,topk=2,total=6"])
@pytest.mark.parametrize("take_turns", [False, True])
def test_greedy_merged_output_equals_generate(seed, shape, take_turns):
    shape = None if shape is None else tree.TreeShape.parse(shape)
    target, drafter = learned_and_ngram(seed, shape, take_turns)
    prompt = [0, 5, 9, 5, 9, 12] + torch.randint(2, 90, (4,), generator=torch.Generator().manual_seed(seed)).tolist()
    decoder = SpeculativeDecoder(target, drafter, 4 if shape is None else shape.total)
    out = decoder.generate(prompt, 40)
    assert out.tokens == reference(target, prompt, 40)
    assert out.target_forwards < 40  # the merged drafts do get accepted


def test_merged_spec_builds_from_a_run_directory(tmp_path):
    target = tiny_target(1)
    save_checkpoint(make_model(target, seed=1), tmp_path / "checkpoints" / "step-000003")
    (tmp_path / "latest").write_text("checkpoints/step-000003\n")
    drafter = build_drafter(f"{tmp_path}+ngram:1-3", target, draft_length="fixed", tree=tree.TreeShape(3, 2, 6))
    assert isinstance(drafter, MergedDrafter)
    eagle, ngram = drafter.parts
    assert eagle.tree == tree.TreeShape(3, 2, 6) and ngram.tree is None  # the shape is the first part's
    assert drafter.aux_layer_ids == eagle.aux_layer_ids and ngram.name == "ngram[1-3]"
    prompt = [0, 5, 9, 5, 9, 12, 7]
    assert SpeculativeDecoder(target, drafter, 6).generate(prompt, 30).tokens == reference(target, prompt, 30)


class Spy:
    """Records which rounds a drafter was asked to propose in."""

    def __init__(self, drafter) -> None:
        self.drafter, self.asked = drafter, []
        self.name, self.aux_layer_ids = drafter.name, drafter.aux_layer_ids

    def begin(self, prompt, features):
        self.drafter.begin(prompt, features)

    def propose(self, tokens, max_tokens, temperature, generator):
        draft = self.drafter.propose(tokens, max_tokens, temperature, generator)
        self.asked.append((len(tokens), len(draft.tokens)))
        return draft

    def accepted(self, num_accepted, features):
        self.drafter.accepted(num_accepted, features)


def test_taking_turns_the_learned_drafter_drafts_only_where_the_lookup_is_silent():
    target = tiny_target(2)
    eagle, lookup = Spy(Eagle3Drafter(make_model(target, seed=2))), Spy(NgramDrafter(budget=DraftBudget.fixed()))
    prompt = [0, 5, 9, 5, 9, 12, 5, 9, 12, 7]
    out = SpeculativeDecoder(target, MergedDrafter([eagle, lookup], take_turns=True), 4).generate(prompt, 40)
    assert out.tokens == reference(target, prompt, 40)
    spoken = {at for at, n in lookup.asked if n}
    assert spoken and len(lookup.asked) == out.target_forwards - 1  # asked every round after the prefill's
    assert {at for at, _ in eagle.asked} == {at for at, _ in lookup.asked} - spoken  # the rounds it was silent in


def test_merged_spec_with_a_bar_takes_turns(tmp_path):
    target = tiny_target(1)
    save_checkpoint(make_model(target, seed=1), tmp_path / "checkpoints" / "step-000003")
    (tmp_path / "latest").write_text("checkpoints/step-000003\n")
    drafter = build_drafter(f"{tmp_path}|ngram", target, draft_length="fixed")
    assert isinstance(drafter, MergedDrafter) and drafter.take_turns and "|" in drafter.name
    assert fork_drafter(drafter).take_turns
    assert not build_drafter(f"{tmp_path}+ngram", target, draft_length="fixed").take_turns
    with pytest.raises(ConfigError, match="mixes"):
        build_drafter(f"{tmp_path}+ngram|ngram:1-2", target)


def test_merging_two_learned_drafters_is_an_error():
    target = tiny_target(0)
    eagle = Eagle3Drafter(make_model(target))
    with pytest.raises(ConfigError, match="at most one of them reading target features"):
        MergedDrafter([eagle, Eagle3Drafter(make_model(target, seed=1))])
    with pytest.raises(ConfigError, match="need two or more"):
        MergedDrafter([eagle])


def test_fork_gives_each_request_its_own_parts_and_shares_the_weights():
    _, drafter = learned_and_ngram(0)
    fork = fork_drafter(drafter)
    assert fork.parts[0] is not drafter.parts[0] and fork.parts[1] is not drafter.parts[1]
    assert fork.parts[0].model is drafter.parts[0].model


@pytest.mark.parametrize("take_turns", [False, True])
def test_merged_sampling_matches_target_joint(take_turns):
    """A sampled proposal (a small LM at T=1) beside a deterministic one (n-gram): siblings from different q, or
    (taking turns) rounds drafted from a point mass and rounds drafted from q."""
    target = tiny_target(seed=3, vocab_size=5, layers=2, init_std=0.5)
    draft = tiny_target(seed=4, vocab_size=5, layers=2, init_std=0.5)
    drafter = MergedDrafter([ModelDrafter(draft, target), NgramDrafter(budget=DraftBudget.fixed())], take_turns)
    decoder = SpeculativeDecoder(target, drafter, num_draft_tokens=2)
    prompt, runs = [2, 3, 4, 2, 3], 3000
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(runs):
        key = tuple(decoder.generate(prompt, 4, temperature=1.0, seed=seed).tokens)
        counts[key] = counts.get(key, 0) + 1
    assert chi_square_pvalue(counts, exact_joint(target, prompt, 4, 1.0), runs) > P_VALUE_FLOOR
