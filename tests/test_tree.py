"""Draft trees are lossless: greedy tree decoding equals `model.generate`, tree sampling keeps the target's
distribution, the tree mask gives every path a chain's logits, compaction leaves a chain's cache, bad shapes fail."""

import pytest
import torch

from draftsmith.decode import tree
from draftsmith.decode.cache import compact
from draftsmith.decode.engine import SpeculativeDecoder
from draftsmith.drafters.base import Draft
from draftsmith.drafters.budget import DraftBudget
from draftsmith.errors import ConfigError
from tests.conftest import tiny_target
from tests.test_engine import reference


def random_tree(rng: torch.Generator, size: int, depth: int) -> list[int]:
    """Parents of a random tree of `size` nodes no deeper than `depth`, in topological order."""
    parents, depth_of = [], []
    for _ in range(size):
        options = [-1] + [i for i, d in enumerate(depth_of) if d < depth]
        p = options[int(torch.randint(0, len(options), (1,), generator=rng))]
        parents.append(p)
        depth_of.append(1 if p < 0 else depth_of[p] + 1)
    return parents


class TreeOracle:
    """A random tree whose nodes mostly carry the true continuation at their depth, sometimes a wrong token, and
    sometimes repeat a sibling: every acceptance length, branch order and compaction pattern occurs."""

    name = "tree-oracle"
    aux_layer_ids = ()

    def __init__(self, prompt_len: int, truth: list[int], seed: int, size: int, depth: int) -> None:
        self.prompt_len, self.truth, self.size, self.depth = prompt_len, truth, size, depth
        self.rng = torch.Generator().manual_seed(seed)

    def begin(self, prompt, features):
        pass

    def propose(self, tokens, max_tokens, temperature, generator):
        done = len(tokens) - self.prompt_len
        size = min(self.size, max_tokens)
        parents = random_tree(self.rng, size, min(self.depth, max_tokens))
        depth = tree.depths(torch.tensor(parents, dtype=torch.long)).tolist()
        toks = []
        for d in depth:
            at = done + d - 1
            true = self.truth[at] if at < len(self.truth) else 1
            roll = float(torch.rand(1, generator=self.rng))
            toks.append(true if roll < 0.6 else int(torch.randint(2, 50, (1,), generator=self.rng)))
        return Draft(torch.tensor(toks, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long))

    def accepted(self, num_accepted, features):
        pass


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("size", "depth"), [(1, 1), (4, 2), (8, 4), (16, 6), (12, 12)])
def test_greedy_tree_equals_generate(seed, size, depth):
    target = tiny_target(seed)
    prompt = [0] + torch.randint(2, 90, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
    truth = reference(target, prompt, 40)
    out = SpeculativeDecoder(target, TreeOracle(len(prompt), truth, seed, size, depth), size).generate(prompt, 40)
    assert out.tokens == truth
    assert out.acceptance_length > 1.0 or len(truth) < 8


def test_tree_mask_gives_each_path_the_logits_of_a_chain():
    target = tiny_target(3)
    prompt = torch.tensor([0, 5, 9, 12, 7])
    parents = torch.tensor([-1, -1, 0, 0, 1, 2, 4])
    tokens = torch.tensor([11, 13, 17, 19, 23, 29, 31])
    cache = target.new_cache()
    target.forward(prompt[:-1], cache)
    past = cache.get_seq_length()
    out = target.forward(
        torch.cat([prompt[-1:], tokens]),
        cache,
        attention_mask=tree.verify_mask(parents, past, torch.float32),
        position_ids=tree.verify_positions(parents, past),
    )
    for node in range(len(tokens)):
        chain, at = [], node
        while at >= 0:
            chain.insert(0, int(tokens[at]))
            at = int(parents[at])
        ref = target.model(torch.cat([prompt, torch.tensor(chain)])[None]).logits[0, -1]
        torch.testing.assert_close(out.logits[node + 1], ref, atol=1e-4, rtol=1e-4)


def test_compaction_leaves_the_cache_of_the_accepted_chain():
    target = tiny_target(5)
    prompt = torch.tensor([0, 5, 9, 12, 7])
    parents = torch.tensor([-1, -1, 1, 0, 2])
    tokens = torch.tensor([11, 13, 17, 19, 23])
    cache = target.new_cache()
    target.forward(prompt[:-1], cache)
    past = cache.get_seq_length()
    target.forward(
        torch.cat([prompt[-1:], tokens]),
        cache,
        attention_mask=tree.verify_mask(parents, past, torch.float32),
        position_ids=tree.verify_positions(parents, past),
    )
    path = [1, 2, 4]
    compact(cache, past + 1, [past + 1 + i for i in path])
    chain = target.new_cache()
    target.forward(torch.cat([prompt, tokens[path]]), chain)
    assert cache.get_seq_length() == chain.get_seq_length() == past + 1 + len(path)
    for mine, theirs in zip(cache.layers, chain.layers, strict=True):
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-5)
    # The next forward continues from the compacted cache exactly as from the chain's.
    nxt = torch.tensor([3])
    torch.testing.assert_close(target.forward(nxt, cache).logits, target.forward(nxt, chain).logits, atol=1e-4, rtol=0)


def test_accept_greedy_takes_the_longest_matching_path():
    parents = torch.tensor([-1, -1, 0, 1, 1, 4])
    tokens = torch.tensor([3, 4, 5, 6, 7, 8])
    logits = torch.zeros(7, 10)
    for row, best in enumerate([4, 0, 0, 0, 0, 8, 9]):  # rows: root, then nodes 0-5
        logits[row, best] = 1
    assert tree.accept_greedy(tokens, parents, logits) == ([1], 0)
    logits[2, 0], logits[2, 7] = 0, 1  # after node 1 the target wants 7 (node 4), then 8 (node 5), then 9
    assert tree.accept_greedy(tokens, parents, logits) == ([1, 4, 5], 9)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("depth=2,topk=2,total=7", "hold at most 6"),
        ("depth=-1,topk=2", "positive"),
        ("depth=3,topk=0", "positive"),
        ("depth=3", "needs depth and topk"),
        ("depth=3,width=2", "bad tree shape"),
    ],
)
def test_bad_tree_shapes_are_one_line_errors(text, message):
    with pytest.raises(ConfigError, match=message) as info:
        tree.TreeShape.parse(text)
    assert "\n" not in info.value.message


def test_topk_larger_than_the_draft_vocabulary_is_an_error():
    with pytest.raises(ConfigError, match="larger than the draft vocabulary"):
        tree.TreeShape.parse("depth=2,topk=50").check_vocab(32)
    assert tree.TreeShape.parse("depth=5,topk=4,total=16") == tree.TreeShape(5, 4, 16)
    assert tree.TreeShape.parse("topk=2,depth=3").total == 10


def eagle3(seed: int, shape: tree.TreeShape | None):
    from draftsmith.drafters.eagle3 import Eagle3Drafter
    from tests.test_eagle3 import make_model

    target = tiny_target(seed)
    return target, Eagle3Drafter(make_model(target, seed=seed), tree=shape)


def dflash(seed: int, shape: tree.TreeShape | None, block_size: int = 8, budget: DraftBudget | None = None):
    from draftsmith.drafters.dflash import DFlashDrafter
    from tests.test_dflash import make_model

    target = tiny_target(seed, vocab_size=12 if seed % 2 else 96)  # a small vocabulary: some paths accepted
    return target, DFlashDrafter(make_model(target, block_size, seed=seed), budget=budget, tree=shape)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    ("make", "shape"),
    [(make, shape) for make in (eagle3, dflash) for shape in ("depth=1,topk=3,total=3", "depth=3,topk=2,total=6")]
    + [(eagle3, "depth=5,topk=4,total=16"), (dflash, "depth=7,topk=4,total=16")],  # a DFlash block of 8: depth <= 7
)
def test_learned_greedy_tree_equals_generate(make, seed, shape):
    shape = tree.TreeShape.parse(shape)
    target, drafter = make(seed, shape)
    prompt = [0] + torch.randint(2, 12, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
    out = SpeculativeDecoder(target, drafter, shape.total).generate(prompt, 40)
    assert out.tokens == reference(target, prompt, 40)


# On the AMX Xeon a forward over 4+ new tokens costs ~1.5 plain steps against ~1.1 for 2-3 (drafters/budget.py)
STEPPED_COSTS = (1.0, 1.03, 1.1, 1.5, 1.5, 1.55, 1.6, 1.7, 1.8)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("shape", ["depth=3,topk=2,total=6", "depth=5,topk=4,total=16"])
def test_eagle3_budgeted_tree_equals_generate(seed, shape):
    """An adaptive budget verifies part of each tree (often a chain, sometimes nothing): still the target's text."""
    shape = tree.TreeShape.parse(shape)
    target, drafter = eagle3(seed, shape)
    drafter.budget = DraftBudget(forward_costs=STEPPED_COSTS, step_cost=0.05)
    prompt = [0] + torch.randint(2, 90, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
    out = SpeculativeDecoder(target, drafter, shape.total).generate(prompt, 40)
    assert out.tokens == reference(target, prompt, 40)


def budgeted_draft(costs: tuple[float, ...], scale: float) -> tuple[Draft, list[int], list[float]]:
    """The draft an adaptive budget with forward `costs` makes of one tree, with every grown node's token and
    calibrated chance of acceptance; its scale set by 10^4 decided tokens matched at `scale` times their confidence."""
    shape = tree.TreeShape(4, 3, 12)
    target, drafter = eagle3(2, shape)
    drafter.budget = DraftBudget(forward_costs=costs, step_cost=0.0, confidence=1e4, matched=1e4 * scale)
    prompt = torch.tensor([0, 5, 9, 14, 3, 22, 8])
    out = target.forward(prompt, target.new_cache(), drafter.aux_layer_ids, logits_to_keep=1)
    drafter.begin(prompt, out.aux_hidden)
    draft = drafter.propose(torch.cat([prompt, out.logits[-1].argmax().view(1)]), shape.total, 0.0, torch.Generator())
    _, drafted, parents, confidences = drafter.last_tree
    return draft, drafted, drafter.budget.tree_reach(parents, confidences)


def test_budgeted_tree_verifies_the_likeliest_nodes_while_they_pay():
    """Free rows: every node up to `total`; rows from the 4th at 3 plain steps: at most two nodes, the two likeliest;
    a drafter whose chance of acceptance is tiny: nothing (a plain step does better)."""
    free, _, _ = budgeted_draft((1.0,) * 13, 1.0)
    assert len(free.tokens) == 12
    pricey, drafted, reach = budgeted_draft((1.0, 1.0, 1.0) + (3.0,) * 10, 1.0)
    assert len(drafted) > 2 and 1 <= len(pricey.tokens) <= 2
    likeliest = sorted(sorted(range(len(reach)), key=lambda i: -reach[i])[: len(pricey.tokens)])
    assert pricey.tokens.tolist() == [drafted[i] for i in likeliest]
    none, _, _ = budgeted_draft((1.0, 1.5, 2.0) + (3.0,) * 10, 1e-3)
    assert len(none.tokens) == 0


def test_tree_calibration_decides_every_child_along_the_written_path():
    """Below the root and each node of the path the target wrote, all children are decided: the one carrying the
    written token matched, its siblings did not; nothing below the first miss is."""
    target, drafter = eagle3(0, tree.TreeShape(3, 2, 6))
    drafter.budget = DraftBudget(confidence=0.0, matched=0.0, decay=1.0)
    # root -> {a=7 (0.6), b=8 (0.3)}; a -> {c=9 (0.5), d=10 (0.2)}; c -> {e=11 (0.4)}
    drafter.last_tree = (3, [7, 8, 9, 10, 11], [-1, -1, 0, 0, 2], [0.6, 0.3, 0.5, 0.2, 0.4])
    drafter._score_last_tree(torch.tensor([1, 2, 3, 7, 10, 4]))  # wrote 7 (a), then 10 (d), then 4
    assert drafter.budget.matched == 2.0  # a and d
    assert drafter.budget.confidence == pytest.approx(0.6 + 0.3 + 0.5 + 0.2)  # e was never decided
    assert drafter.last_tree is None


def test_eagle3_tree_scores_are_the_log_probabilities_of_a_chain_along_each_path():
    """Each node's cumulative log-probability equals that of a chain forced along its path: the drafter's tree mask
    shows each node the context, its ancestors and itself, and nothing else."""
    shape = tree.TreeShape(4, 3, 20)
    target, drafter = eagle3(2, shape)
    prompt = torch.tensor([0, 5, 9, 14, 3, 22, 8])
    cache = target.new_cache()
    out = target.forward(prompt, cache, drafter.aux_layer_ids, logits_to_keep=1)
    tokens = torch.cat([prompt, out.logits[-1].argmax().view(1)])
    drafter.begin(prompt, out.aux_hidden)
    assert len(drafter.propose(tokens, shape.total, 0.0, torch.Generator()).tokens) == shape.total
    ids, parents, scores = drafter.grow_tree(shape.total)
    assert 3 <= int(tree.depths(parents).max()) <= shape.depth
    model = drafter.model
    to_draft = {t: d for d, t in enumerate(drafter.draft_ids.tolist())}
    for node in range(len(ids)):
        path, at = [], node
        while at >= 0:
            path.insert(0, int(ids[at]))
            at = int(parents[at])
        hidden, logits, total = drafter.hidden, drafter.logits, 0.0
        with torch.inference_mode():
            for i, tok in enumerate(path):
                total += float(torch.log_softmax(logits, -1)[to_draft[tok]])
                position = torch.tensor([drafter.context + i])
                hidden, step_logits = model(model.embed_tokens(torch.tensor([[tok]])), hidden, position, drafter.cache)
                logits = step_logits[0, -1]
        drafter.cache.crop(drafter.context)
        assert abs(total - float(scores[node])) < 1e-4, node


def test_eagle3_chain_shaped_tree_is_the_greedy_chain():
    target, chain = eagle3(1, None)
    _, single = eagle3(1, tree.TreeShape(5, 1, 5))
    prompt = [0, 5, 9, 14, 3]
    assert (
        SpeculativeDecoder(target, chain, 5).generate(prompt, 30).proposed
        == SpeculativeDecoder(target, single, 5).generate(prompt, 30).proposed
    )


def test_ngram_tree_merges_continuations_of_several_matches():
    from draftsmith.drafters.ngram import NgramDrafter

    drafter = NgramDrafter(1, 3, budget=DraftBudget.fixed(), tree=tree.TreeShape(3, 3, 8))
    text = torch.tensor([5, 6, 7, 8, 9, 6, 7, 2, 3, 5, 6, 7, 4, 6, 7])
    draft = drafter.propose(text, 8, 0.0, torch.Generator())
    # "6 7" occurred before, followed by 4 6 7 / 2 3 5 / 8 9 6 (latest first); "4 6 7" shares no prefix.
    paths = []
    for leaf in range(len(draft.tokens)):
        if leaf in draft.parents.tolist():
            continue
        path, at = [], leaf
        while at >= 0:
            path.insert(0, int(draft.tokens[at]))
            at = int(draft.parents[at])
        paths.append(path)
    assert paths == [[4, 6, 7], [2, 3, 5], [8, 9]]  # the third is cut at 8 nodes


@pytest.mark.parametrize("seed", range(4))
def test_ngram_tree_is_lossless(seed):
    from draftsmith.drafters.ngram import NgramDrafter

    target = tiny_target(seed)
    prompt = [0, 5, 9, 5, 9, 12, 5, 9, 14]
    truth = reference(target, prompt, 40)
    drafter = NgramDrafter(budget=DraftBudget.fixed(), tree=tree.TreeShape(4, 3, 10))
    assert SpeculativeDecoder(target, drafter, 10).generate(prompt, 40).tokens == truth


@pytest.mark.parametrize("seed", range(3))
def test_dflash_budgeted_tree_equals_generate(seed):
    """An adaptive budget verifies part of each block's tree and calibrates on what the target wrote."""
    budget = DraftBudget(forward_costs=STEPPED_COSTS, step_cost=0.05)
    target, drafter = dflash(seed, tree.TreeShape(5, 3, 12), budget=budget)
    prompt = [0, 3, 4, 5, 6]
    out = SpeculativeDecoder(target, drafter, 12).generate(prompt, 40)
    assert out.tokens == reference(target, prompt, 40)
    assert budget.confidence != DraftBudget().confidence or len(out.tokens) < 3  # scored its trees


def test_block_tree_expands_the_best_frontier_with_each_position_top_k():
    """Position 1's top-k hang below the root; the best k nodes of each level get the next position's top-k, so
    every node's score is the sum of its path's log-probabilities and the best `total` nodes form a tree."""
    from draftsmith.drafters.dflash import block_tree

    logp = torch.log_softmax(torch.randn(4, 10, generator=torch.Generator().manual_seed(0)), -1)
    ids, parents, scores = block_tree(logp, 3)
    assert len(ids) == tree.TreeShape(4, 3, 1).capacity
    assert ids[:3].tolist() == logp[0].topk(3).indices.tolist() and parents[:3] == [-1, -1, -1]
    depth = tree.depths(torch.tensor(parents)).tolist()
    for node in range(len(ids)):
        total, at = 0.0, node
        while at >= 0:
            total += float(logp[depth[at] - 1, ids[at]])
            at = parents[at]
        assert abs(total - scores[node]) < 1e-5
    for level in range(1, 4):  # exactly the best 3 of each level have children
        at_level = [i for i in range(len(ids)) if depth[i] == level]
        best = sorted(at_level, key=lambda i: -scores[i])[:3]
        assert sorted({p for p in parents if p >= 0 and depth[p] == level}) == sorted(best)


def test_dflash_tree_sampling_is_lossless():
    from draftsmith.drafters.dflash import DFlashDrafter
    from tests.test_dflash import make_model
    from tests.test_sampling import P_VALUE_FLOOR, chi_square_pvalue, exact_joint, sample_engine

    target = tiny_target(seed=3, vocab_size=5, layers=2, init_std=0.5)
    # the engine's 2 draft tokens a round: the best 2 nodes, siblings where position 1 is unsure
    drafter = DFlashDrafter(make_model(target, block_size=3, layers=1, ids=(1,)), tree=tree.TreeShape(2, 2, 4))
    prompt, runs, temperature = [2, 3, 4], 3000, 1.0
    counts = sample_engine(target, drafter, prompt, 4, runs, temperature)
    assert chi_square_pvalue(counts, exact_joint(target, prompt, 4, temperature), runs) > P_VALUE_FLOOR


def test_dflash_tree_deeper_than_its_block_is_an_error_and_tune_leaves_such_shapes_out():
    from draftsmith.drafters import with_tree
    from draftsmith.tune import candidate_shapes, fitting

    _, drafter = dflash(0, None, block_size=4)
    with pytest.raises(ConfigError, match="deeper than the 3 draft positions") as info:
        with_tree(drafter, tree.TreeShape(4, 2, 6))
    assert "\n" not in info.value.message
    assert {s.depth for s in fitting(drafter, candidate_shapes((2, 3, 6), (2,), (4, 8), (1, 5)))} == {1, 2, 3}
