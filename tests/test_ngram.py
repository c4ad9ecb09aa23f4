import torch

from draftsmith.drafters.ngram import NgramDrafter

GEN = torch.Generator()


def propose(drafter, tokens, k=4):
    return drafter.propose(torch.tensor(tokens), k, 0.0, GEN).tokens.tolist()


def test_longest_suffix_match_uses_latest_occurrence():
    d = NgramDrafter(min_ngram=1, max_ngram=3, break_even=0.0)
    # suffix [7, 8] occurred twice; the latest occurrence is followed by 9, 10
    assert propose(d, [7, 8, 1, 2, 7, 8, 9, 10, 3, 7, 8]) == [9, 10, 3, 7]
    # longest match wins: [5, 6, 7] matches once (followed by 1), [6, 7] later (followed by 2)
    assert propose(d, [5, 6, 7, 1, 6, 7, 2, 5, 6, 7]) == [1, 6, 7, 2]
    assert propose(d, [1, 2, 3, 4]) == []  # nothing repeats


def test_draft_is_capped_at_max_tokens():
    d = NgramDrafter(break_even=0.0)
    assert propose(d, [1, 2, 3, 4, 5, 6, 1, 2], k=2) == [3, 4]


def test_match_lengths_that_do_not_pay_go_silent_and_others_stay():
    d = NgramDrafter(min_ngram=1, max_ngram=2, break_even=0.6, prior_weight=2)
    unigram_only = [1, 2, 3, 1]  # suffix [1] matches, [3, 1] does not
    assert propose(d, unigram_only) == [2, 3, 1]
    d.accepted(0, None)  # rejected: the 1-gram yield falls to 1.2 / 3 = 0.4 < 0.6
    assert propose(d, unigram_only) == []
    bigram = [4, 5, 6, 4, 5]
    for _ in range(5):
        assert propose(d, bigram) == [6, 4, 5]
        d.accepted(3, None)
    assert d.yields[2].mean > 0.6 > d.yields[1].mean


def test_feedback_without_a_pending_draft_is_ignored():
    d = NgramDrafter(break_even=0.0)
    before = {n: (y.proposals, y.accepted) for n, y in d.yields.items()}
    d.accepted(2, None)
    assert {n: (y.proposals, y.accepted) for n, y in d.yields.items()} == before
