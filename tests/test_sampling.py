"""Sampling is lossless: speculative sampling reproduces the target's distribution, whatever the drafter's q.

Each test compares empirical frequencies with the exact target distribution by a chi-square test at a fixed seed,
and runs the same statistic on a deliberately broken verifier (the classic bug: resample from p instead of the
residual max(0, p - q) after a rejection) to show the test has the power to catch a biased sampler.
"""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from draftsmith.decode import engine as engine_module
from draftsmith.decode.engine import SpeculativeDecoder
from draftsmith.decode.verify import target_probs, verify_sampling
from draftsmith.drafters.base import Draft
from draftsmith.drafters.draft_model import ModelDrafter
from tests.conftest import tiny_target

P_VALUE_FLOOR = 1e-3  # a correct sampler fails this with probability 0.1 % per fresh seed; the seeds are fixed


def chi_square_pvalue(counts: dict, expected_probs: dict, n: int) -> float:
    """Chi-square goodness of fit; cells expected below 5 are pooled so the approximation holds."""
    obs, exp, pool_obs, pool_exp = [], [], 0.0, 0.0
    for key, p in expected_probs.items():
        if p * n >= 5:
            obs.append(counts.get(key, 0))
            exp.append(p * n)
        else:
            pool_obs += counts.get(key, 0)
            pool_exp += p * n
    if pool_exp > 0:
        obs.append(pool_obs)
        exp.append(pool_exp)
    scale = sum(obs) / sum(exp)  # float rounding only: chisquare wants equal totals
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


def buggy_verify(draft, draft_probs, probs, generator):
    """Accept/reject like the real rule, but resample rejected positions from p: biased towards the draft."""
    n, _ = verify_sampling(draft, draft_probs, probs, generator)
    return n, int(torch.multinomial(probs[n], 1, generator=generator))


def test_verify_rule_keeps_first_token_distribution():
    """One position: draws from q, verified against p, emit tokens distributed exactly as p."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.05, 0.15, 0.3, 0.5]])
    n, counts = 20000, {}
    for _ in range(n):
        draft = torch.multinomial(q[0], 1, generator=gen)
        accepted, bonus = verify_sampling(draft, q, p, gen)
        first = int(draft[0]) if accepted else bonus
        counts[first] = counts.get(first, 0) + 1
    expected = {i: float(p[0, i]) for i in range(4)}
    assert chi_square_pvalue(counts, expected, n) > P_VALUE_FLOOR


def test_point_mass_draft_keeps_distribution():
    """A deterministic draft (q = point mass) is accepted with probability p(x), and still lossless."""
    gen = torch.Generator().manual_seed(1)
    p = torch.tensor([[0.1, 0.6, 0.3], [0.2, 0.3, 0.5]])
    n, counts = 20000, {}
    for _ in range(n):
        accepted, bonus = verify_sampling(torch.tensor([2]), None, p, gen)
        first = 2 if accepted else bonus
        counts[first] = counts.get(first, 0) + 1
    assert chi_square_pvalue(counts, {i: float(p[0, i]) for i in range(3)}, n) > P_VALUE_FLOOR


def exact_joint(target, prompt: list[int], length: int, temperature: float) -> dict[tuple[int, ...], float]:
    """P(x1..x_length | prompt) by enumerating every prefix (the vocabulary is tiny); EOS ends a sequence early."""
    joint = {(): 1.0}
    for _ in range(length):
        done = {pre: p for pre, p in joint.items() if pre and pre[-1] in target.eos_token_ids}
        prefixes = [pre for pre in joint if pre not in done]
        ids = torch.tensor([prompt + list(pre) for pre in prefixes])
        with torch.no_grad():
            probs = target_probs(target.model(ids).logits[:, -1], temperature)
        vocab = range(target.vocab_size)
        joint = done | {pre + (x,): joint[pre] * float(probs[i, x]) for i, pre in enumerate(prefixes) for x in vocab}
    return joint


def sample_engine(target, drafter, prompt, length, runs, temperature):
    decoder = SpeculativeDecoder(target, drafter, num_draft_tokens=2)
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(runs):
        key = tuple(decoder.generate(prompt, length, temperature=temperature, seed=seed).tokens)
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.fixture(scope="module")
def small_vocab_pair():
    target = tiny_target(seed=3, vocab_size=5, layers=2, init_std=0.5)
    draft = tiny_target(seed=4, vocab_size=5, layers=2, init_std=0.5)
    return target, draft


def test_engine_sampling_matches_target_joint(small_vocab_pair):
    """Four tokens: the prefill token, then two drafts verified in one forward plus a bonus (or a residual draw)."""
    target, draft = small_vocab_pair
    prompt, runs, temperature = [2, 3, 4], 3000, 1.0
    expected = exact_joint(target, prompt, 4, temperature)
    drafted = exact_joint(draft, prompt, 4, temperature)
    # The drafter must really differ from the target, or the test would prove nothing.
    assert sum(abs(expected[k] - drafted[k]) for k in expected) / 2 > 0.2
    counts = sample_engine(target, ModelDrafter(draft, target), prompt, 4, runs, temperature)
    assert sum(counts.values()) == runs
    assert chi_square_pvalue(counts, expected, runs) > P_VALUE_FLOOR


def test_chi_square_catches_a_biased_verifier(small_vocab_pair, monkeypatch):
    target, draft = small_vocab_pair
    prompt, runs, temperature = [2, 3, 4], 1500, 1.0
    monkeypatch.setattr(engine_module, "verify_sampling", buggy_verify)
    counts = sample_engine(target, ModelDrafter(draft, target), prompt, 4, runs, temperature)
    assert chi_square_pvalue(counts, exact_joint(target, prompt, 4, temperature), runs) < P_VALUE_FLOOR


@pytest.mark.parametrize("top_p", [0.3, 0.7, 0.95])
def test_top_p_matches_transformers(top_p):
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    ours = target_probs(logits, 0.7, top_p)
    theirs = torch.softmax(TopPLogitsWarper(top_p)(None, logits / 0.7), dim=-1)
    torch.testing.assert_close(ours, theirs)


def test_joint_enumeration_sums_to_one(small_vocab_pair):
    joint = exact_joint(small_vocab_pair[0], [2, 3, 4], 2, 1.0)
    assert abs(sum(joint.values()) - 1) < 1e-5
    finished = {(1,)}  # EOS (id 1) first: the sequence stops there
    assert set(joint) == finished | {k for k in itertools.product(range(5), repeat=2) if k[0] != 1}


class TreeSampler:
    """A tree per round from a small draft LM: two independent draws from q under the root (they may repeat), its
    argmax twice (a deterministic sibling and its repeat), and a draw from q below the first draw: every kind of
    sibling the multi-candidate rule must handle."""

    name = "tree-sampler"
    aux_layer_ids = ()

    def __init__(self, draft) -> None:
        self.draft = draft

    def begin(self, prompt, features):
        pass

    def q(self, tokens: list[int], temperature: float) -> torch.Tensor:
        with torch.no_grad():
            return target_probs(self.draft.model(torch.tensor([tokens])).logits[0, -1], temperature)

    def propose(self, tokens, max_tokens, temperature, generator):
        tokens = tokens.tolist()
        q0 = self.q(tokens, temperature)
        a, b = torch.multinomial(q0, 2, replacement=True, generator=generator).tolist()
        q1 = self.q(tokens + [a], temperature)
        c = int(torch.multinomial(q1, 1, generator=generator))
        best = int(q0.argmax())
        point = torch.zeros_like(q0)
        point[best] = 1.0
        nodes = [(a, -1, q0), (b, -1, q0), (best, -1, point), (best, -1, point), (c, 0, q1)][:max_tokens]
        return Draft(
            torch.tensor([t for t, _, _ in nodes]),
            torch.stack([q for _, _, q in nodes]),
            parents=torch.tensor([p for _, p, _ in nodes]),
        )

    def accepted(self, num_accepted, features):
        pass


def sample_tree_engine(target, drafter, prompt, length, runs, temperature):
    decoder = SpeculativeDecoder(target, drafter, num_draft_tokens=5)
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(runs):
        key = tuple(decoder.generate(prompt, length, temperature=temperature, seed=seed).tokens)
        counts[key] = counts.get(key, 0) + 1
    return counts


def test_tree_sampling_matches_target_joint(small_vocab_pair):
    target, draft = small_vocab_pair
    prompt, runs, temperature = [2, 3, 4], 3000, 1.0
    counts = sample_tree_engine(target, TreeSampler(draft), prompt, 4, runs, temperature)
    assert chi_square_pvalue(counts, exact_joint(target, prompt, 4, temperature), runs) > P_VALUE_FLOOR


def test_chi_square_catches_a_tree_verifier_that_forgets_rejected_siblings(small_vocab_pair, monkeypatch):
    """The classic multi-candidate bug: try each sibling against the untouched p (no residual after a rejection)."""
    from draftsmith.decode import tree

    def forgetful(tokens, parents, draft_probs, probs, generator):
        kids, path, row = tree.children(parents), [], 0
        while True:
            p = probs[row]
            for c in kids[row]:
                x = int(tokens[c])
                if float(torch.rand(1, generator=generator)) * draft_probs[c, x] <= p[x]:
                    path.append(c)
                    row = c + 1
                    break
            else:
                return path, int(torch.multinomial(p, 1, generator=generator))

    target, draft = small_vocab_pair
    prompt, runs, temperature = [2, 3, 4], 1500, 1.0
    monkeypatch.setattr(tree, "accept_sampling", forgetful)
    counts = sample_tree_engine(target, TreeSampler(draft), prompt, 4, runs, temperature)
    assert chi_square_pvalue(counts, exact_joint(target, prompt, 4, temperature), runs) < P_VALUE_FLOOR
